"""Command-line front: duoserve-trace, duoserve-train, duoserve-eval, duoserve-run (typer)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from duoserve.embedded import EMBEDDED_NAME

console = Console()
err_console = Console(stderr=True)

# Errors a user can fix by changing the command line: printed plainly, exit code 2.
_USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, RuntimeError)


def _fail(err: Exception) -> None:
    err_console.print(f"[bold red]error:[/] {err}")
    raise typer.Exit(2)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err_console, transient=False)


trace_app = typer.Typer(help="Record which experts an MoE model routes every token to (stage 1).",
                        no_args_is_help=True, pretty_exceptions_enable=False)

DEFAULT_DATASETS = ["squad-sample", "orca-math-sample"]


@trace_app.command()
def collect(
    model: Annotated[str, typer.Option(help=f"HF model id, local path, or '{EMBEDDED_NAME}' (the bundled tiny MoE).")]
    = EMBEDDED_NAME,
    dataset: Annotated[Optional[list[str]], typer.Option(
        help="squad, orca-math (hub or --data-files) or squad-sample, orca-math-sample (built in). Repeatable. "
             f"[default: {', '.join(DEFAULT_DATASETS)}]")] = None,
    data_files: Annotated[Optional[list[str]], typer.Option(
        help="Local file or folder (json, jsonl, parquet, csv) in the hub schema, one per --dataset, same order.")]
    = None,
    split: Annotated[Optional[str], typer.Option(help="Hub split. [default: train]")] = None,
    fraction: Annotated[float, typer.Option(help="Share of each dataset's rows to trace (seeded draw).")] = 0.025,
    count: Annotated[Optional[int], typer.Option(help="Trace this many rows per dataset instead of --fraction.")]
    = None,
    seed: Annotated[int, typer.Option(help="Seed of the row draw.")] = 0,
    max_new_tokens: Annotated[int, typer.Option(help="Greedy decode steps per request (0: prefill only).")] = 32,
    max_prompt_tokens: Annotated[int, typer.Option(help="Truncate longer prompts (from the left).")] = 1024,
    batch_size: Annotated[int, typer.Option(help="Requests per generate call.")] = 8,
    lookahead: Annotated[int, typer.Option(help="Record next-gate guesses for layers l+1..l+D (0: none).")] = 1,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:1, ...")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16, float16.")] = "auto",
    revision: Annotated[Optional[str], typer.Option(help="Model revision (hub models).")] = None,
    part_rows: Annotated[int, typer.Option(help="Rows per Parquet part file (bounds file size and memory).")]
    = 200_000,
    out: Annotated[Path, typer.Option(help="Trace folder; re-run with the same arguments to resume.")]
    = Path("traces"),
) -> None:
    """Trace prefill and greedy-decode routing of MODEL on sampled task prompts into Parquet."""
    from duoserve.data.tasks import parse_datasets
    from duoserve.trace.collect import CollectSettings, collect as run_collect

    try:
        specs = parse_datasets(dataset or DEFAULT_DATASETS, data_files or (), split)
        settings = CollectSettings(
            model=model, datasets=specs, out=out, fraction=None if count is not None else fraction, count=count,
            seed=seed, max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens, batch_size=batch_size,
            lookahead=lookahead, device=device, dtype=dtype, revision=revision, rows_per_part=part_rows)
        with _progress() as progress:
            task = progress.add_task("tracing", total=None)
            result = run_collect(settings, lambda done, total: progress.update(task, completed=done, total=total))
    except _USER_ERRORS as err:
        _fail(err)
    g = result.geometry
    table = Table(title=f"trace -> {result.out}")
    for col in ("model", "L x E, k", "requests", "resumed", "prefill rows", "decode rows", "seconds"):
        table.add_column(col)
    table.add_row(model, f"{g.num_layers} x {g.num_experts}, {g.top_k}", str(result.requests), str(result.resumed),
                  str(result.rows["prefill"]), str(result.rows["decode"]), f"{result.seconds:.1f}")
    console.print(table)


@trace_app.command()
def info(path: Annotated[Path, typer.Argument(help="Trace folder or part file.")]) -> None:
    """Summarise a trace: how it was made, requests and tokens per phase, per-layer expert usage."""
    from duoserve.trace.format import open_trace
    from duoserve.trace.info import summarize

    try:
        trace = open_trace(path)
    except _USER_ERRORS as err:
        _fail(err)
    meta, summary = trace.meta, summarize(trace)
    console.print(f"[bold]{path}[/]: model {meta.model}, {meta.num_layers} MoE layers "
                  f"(decoder {meta.decoder_indices[0]}..{meta.decoder_indices[-1]}), {meta.num_experts} experts, "
                  f"top-{meta.top_k}, next-gate depth {meta.lookahead}, {len(trace.files)} part file(s)")
    tokens = Table(title="requests and tokens")
    for col in ("dataset", "requests", "prefill tokens", "decode tokens"):
        tokens.add_column(col)
    for name, n in sorted(summary.requests.items()):
        tokens.add_row(name, str(n), str(summary.tokens.get((name, "prefill"), 0)),
                       str(summary.tokens.get((name, "decode"), 0)))
    console.print(tokens)
    usage = Table(title="expert usage per MoE layer")
    for col in ("layer", "experts used", "max load / uniform", "entropy (norm.)"):
        usage.add_column(col)
    for s in summary.layer_stats():
        usage.add_row(str(s["layer"]), f"{s['experts_used']}/{meta.num_experts}", f"{s['max_over_uniform']:.2f}",
                      f"{s['entropy']:.3f}")
    console.print(usage)


def _not_built(stage: str, issue: str) -> typer.Typer:
    app = typer.Typer(help=f"{stage} (not yet built).", pretty_exceptions_enable=False)

    @app.callback(invoke_without_command=True)
    def main() -> None:
        err_console.print(f"{stage} is not built yet ({issue}).")
        raise typer.Exit(3)

    return app


train_app = _not_built("duoserve-train: features and predictor training", "see the features/predictor issue")
eval_app = _not_built("duoserve-eval: accuracy report", "see the evaluation issue")
run_app = _not_built("duoserve-run: dual-phase offload runtime", "see the runtime issue")
