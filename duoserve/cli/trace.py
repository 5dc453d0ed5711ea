"""duoserve-trace: record which experts an MoE model routes every token to (stage 1), or import such logs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from duoserve.cli.common import (
    DtypeOption,
    ModelOption,
    console,
    err_console,
    new_app,
    progress,
    table,
    user_errors,
)
from duoserve.data.tasks import SAMPLE_DATASETS
from duoserve.files import check_output
from duoserve.trace.collect import CollectSettings
from duoserve.trace.importers import ImportSettings

app = new_app("Record which experts an MoE model routes every token to (stage 1).")
COLLECT = CollectSettings()
IMPORT = ImportSettings(source=Path(), out=Path())


@app.command()
def collect(
    model: ModelOption = COLLECT.model,
    dataset: Annotated[Optional[list[str]], typer.Option(
        help="squad, orca-math (hub or --data-files) or squad-sample, orca-math-sample (built in). Repeatable. "
             f"[default: {', '.join(SAMPLE_DATASETS)}]")] = None,
    data_files: Annotated[Optional[list[str]], typer.Option(
        help="Local file or folder (json, jsonl, parquet, csv) in the hub schema, one per --dataset, same order.")]
    = None,
    split: Annotated[Optional[str], typer.Option(help="Hub split. [default: train]")] = None,
    fraction: Annotated[float, typer.Option(help="Share of each dataset's rows to trace (seeded draw).")]
    = COLLECT.fraction,
    count: Annotated[Optional[int], typer.Option(help="Trace this many rows per dataset instead of --fraction.")]
    = None,
    seed: Annotated[int, typer.Option(help="Seed of the row draw.")] = COLLECT.seed,
    max_new_tokens: Annotated[int, typer.Option(min=0, help="Greedy decode steps per request (0: prefill only).")]
    = COLLECT.max_new_tokens,
    max_prompt_tokens: Annotated[int, typer.Option(help="Truncate longer prompts (from the left).")]
    = COLLECT.max_prompt_tokens,
    batch_size: Annotated[int, typer.Option(min=1, help="Requests per generate call.")] = COLLECT.batch_size,
    lookahead: Annotated[int, typer.Option(help="Record next-gate guesses for layers l+1..l+D (0: none).")]
    = COLLECT.lookahead,
    nextgate_width: Annotated[Optional[int], typer.Option(
        min=1, help="Next-gate ids and scores kept per token and layer (the router's top-k first). [default: 2 x "
                    "top-k]")] = COLLECT.nextgate_width,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:1, ...")] = COLLECT.device,
    dtype: DtypeOption = COLLECT.dtype,
    revision: Annotated[Optional[str], typer.Option(help="Model revision (hub models).")] = None,
    part_rows: Annotated[int, typer.Option(min=1, help="A part file at the latest every this many rows (bounds "
                                                       "file size and memory).")] = COLLECT.rows_per_part,
    part_requests: Annotated[int, typer.Option(min=1, help="... or every this many requests (what a crash can "
                                                           "lose at most).")] = COLLECT.requests_per_part,
    part_seconds: Annotated[float, typer.Option(min=1, help="... or every this many seconds of tracing.")]
    = COLLECT.seconds_per_part,
    out: Annotated[Path, typer.Option(help="Trace folder; re-run with the same arguments to resume.")]
    = COLLECT.out,
) -> None:
    """Trace prefill and greedy-decode routing of MODEL on sampled task prompts into Parquet."""
    from duoserve.data.tasks import parse_datasets
    from duoserve.trace.collect import collect as run_collect

    with user_errors():
        specs = parse_datasets(dataset or SAMPLE_DATASETS, data_files or (), split)
        settings = CollectSettings(
            model=model, datasets=specs, out=out, fraction=None if count is not None else fraction, count=count,
            seed=seed, max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens, batch_size=batch_size,
            lookahead=lookahead, nextgate_width=nextgate_width, device=device, dtype=dtype, revision=revision,
            rows_per_part=part_rows, requests_per_part=part_requests, seconds_per_part=part_seconds)
        with progress("tracing") as update:
            result = run_collect(settings, lambda done, total: update(completed=done, total=total))
    g = result.geometry
    summary = table(f"trace -> {result.out}", "model", "L x E, k", "requests", "resumed", "prefill rows",
                    "decode rows", "seconds")
    summary.add_row(model, f"{g.num_layers} x {g.num_experts}, {g.top_k}", str(result.requests),
                    str(result.resumed), str(result.rows["prefill"]), str(result.rows["decode"]),
                    f"{result.seconds:.1f}")
    console.print(summary)


@app.command()
def info(path: Annotated[Path, typer.Argument(help="Trace folder or part file.")]) -> None:
    """Summarise a trace: how it was made, requests and tokens per phase, per-layer expert usage."""
    from duoserve.trace.format import open_trace
    from duoserve.trace.info import layer_stats, summarize_trace

    with user_errors():
        trace = open_trace(path)
    meta, summary = trace.meta, summarize_trace(trace)
    console.print(f"[bold]{path}[/]: model {meta.model}, {meta.num_layers} MoE layers "
                  f"(decoder {meta.decoder_indices[0]}..{meta.decoder_indices[-1]}), {meta.num_experts} experts, "
                  f"top-{meta.top_k}, next-gate depth {meta.lookahead}"
                  + (f" (top {meta.nextgate_width} ids{' and scores' if meta.nextgate_scores else ''})"
                     if meta.lookahead else "")
                  + f", format version {meta.version}, {len(trace.files)} part file(s)")
    tokens = table("requests and tokens", "dataset", "requests", "prefill tokens", "decode tokens")
    for name, n in sorted(summary.requests.items()):
        tokens.add_row(name, str(n), str(summary.tokens.get((name, "prefill"), 0)),
                       str(summary.tokens.get((name, "decode"), 0)))
    console.print(tokens)
    usage = table("expert usage per MoE layer", "layer", "experts used", "max load / uniform", "entropy (norm.)")
    for s in layer_stats(summary.usage):
        usage.add_row(str(s["layer"]), f"{s['experts_used']}/{meta.num_experts}", f"{s['max_over_uniform']:.2f}",
                      f"{s['entropy']:.3f}")
    console.print(usage)


@app.command("import")
def import_cmd(
    source: Annotated[Path, typer.Argument(help="Log file, or a folder of them.")],
    out: Annotated[Path, typer.Option(help="New trace folder.")],
    format: Annotated[str, typer.Option(help="long (jsonl/csv/parquet rows per token and layer), sglang "
                                             "(per_token recorder .pt dumps) or npy (.npy/.npz arrays).")]
    = IMPORT.format,
    request: Annotated[str, typer.Option(help="long: request id column.")] = IMPORT.request,
    token: Annotated[str, typer.Option(help="long: token index (position) column.")] = IMPORT.token,
    layer: Annotated[str, typer.Option(help="long: MoE layer column (0-based).")] = IMPORT.layer,
    experts: Annotated[str, typer.Option(help="long: column of the layer's top-k expert ids.")] = IMPORT.experts,
    scores: Annotated[Optional[str], typer.Option(help="long: column of router weights, if any.")] = None,
    dataset_column: Annotated[Optional[str], typer.Option(help="long: column naming each row's dataset.")] = None,
    phase_column: Annotated[Optional[str], typer.Option(help="long: column with prefill/decode.")] = None,
    token_id_column: Annotated[Optional[str], typer.Option(help="long: column with the token id.")] = None,
    dataset: Annotated[str, typer.Option(help="Dataset name when no column gives it.")] = IMPORT.dataset,
    phase: Annotated[str, typer.Option(help="Phase when no column gives it.")] = IMPORT.phase,
    layout: Annotated[str, typer.Option(help="npy: lt = [layers, tokens, k], tl = [tokens, layers, k].")]
    = IMPORT.layout,
    num_layers: Annotated[Optional[int], typer.Option(help="Declared MoE layers (checked). [default: inferred]")]
    = None,
    num_experts: Annotated[Optional[int], typer.Option(help="Declared experts (checked). [default: max id + 1]")]
    = None,
    top_k: Annotated[Optional[int], typer.Option(help="Declared top-k (checked). [default: inferred]")] = None,
    model: Annotated[str, typer.Option(help="Model name to record in the trace metadata.")] = IMPORT.model,
    part_rows: Annotated[int, typer.Option(min=1, help="A part file at the latest every this many tokens (what a "
                                                       "crash can lose at most) ...")] = IMPORT.rows_per_part,
    part_seconds: Annotated[float, typer.Option(min=1, help="... or every this many seconds.")]
    = IMPORT.seconds_per_part,
) -> None:
    """Convert routing logs from serving engines (vLLM, SGLang, your own) into a duoserve trace (resumable: run the
    same command again after a crash)."""
    from duoserve.trace.importers import import_trace

    settings = ImportSettings(source=source, out=out, format=format, request=request, token=token, layer=layer,
                              experts=experts, scores=scores, dataset_column=dataset_column, phase_column=phase_column,
                              token_id_column=token_id_column, dataset=dataset, phase=phase, layout=layout,
                              num_layers=num_layers, num_experts=num_experts, top_k=top_k, model=model,
                              rows_per_part=part_rows, seconds_per_part=part_seconds)
    with user_errors():
        with progress("importing (tokens)") as update:
            result = import_trace(settings, lambda n: update(completed=n))
    L, E, k = result.geometry
    summary = table(f"import -> {result.out}", "format", "L x E, k", "tokens", "dropped (missing layers)",
                    "inferred", "seconds")
    summary.add_row(format, f"{L} x {E}, {k}", str(result.tokens), str(result.dropped),
                    ", ".join(result.inferred) or "-", f"{result.seconds:.1f}")
    console.print(summary)
    if result.dropped:
        err_console.print(f"[yellow]warning:[/] {result.dropped} token(s) lacked some layer and were dropped")


@app.command("export")
def export_cmd(
    path: Annotated[Path, typer.Argument(help="Trace folder.")],
    out: Annotated[Path, typer.Option(help="Long JSON-lines file, one row per (request, token, layer).")],
) -> None:
    """Write a trace as long JSON lines (the `import --format long` input, with every field)."""
    from duoserve.trace.format import open_trace
    from duoserve.trace.importers import export_long

    with user_errors():
        check_output(out)
        rows = export_long(open_trace(path), out)
    console.print(f"{rows} rows -> {out}")


if __name__ == "__main__":
    app()
