"""Command-line front: duoserve-trace, duoserve-train, duoserve-eval, duoserve-run (typer)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from duoserve.embedded import EMBEDDED_NAME
from duoserve.predictor.model import PAPER_WIDTHS
from duoserve.runtime.policies import DEFAULT_POLICIES, POLICIES

console = Console()
err_console = Console(stderr=True)

_USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, RuntimeError)


@contextmanager
def _user_errors() -> Iterator[None]:
    """Errors a user can fix by changing the command line: printed plainly, exit code 2."""
    try:
        yield
    except typer.Exit:  # a RuntimeError too, but already the answer
        raise
    except _USER_ERRORS as err:
        err_console.print(f"[bold red]error:[/] {err}")
        raise typer.Exit(2) from err


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title)
    for col in columns:
        table.add_column(col, overflow="fold")  # narrow terminals fold figures instead of cutting them
    return table


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

    with _user_errors():
        specs = parse_datasets(dataset or DEFAULT_DATASETS, data_files or (), split)
        settings = CollectSettings(
            model=model, datasets=specs, out=out, fraction=None if count is not None else fraction, count=count,
            seed=seed, max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens, batch_size=batch_size,
            lookahead=lookahead, device=device, dtype=dtype, revision=revision, rows_per_part=part_rows)
        with _progress() as progress:
            task = progress.add_task("tracing", total=None)
            result = run_collect(settings, lambda done, total: progress.update(task, completed=done, total=total))
    g = result.geometry
    table = _table(f"trace -> {result.out}", "model", "L x E, k", "requests", "resumed", "prefill rows",
                   "decode rows", "seconds")
    table.add_row(model, f"{g.num_layers} x {g.num_experts}, {g.top_k}", str(result.requests), str(result.resumed),
                  str(result.rows["prefill"]), str(result.rows["decode"]), f"{result.seconds:.1f}")
    console.print(table)


@trace_app.command()
def info(path: Annotated[Path, typer.Argument(help="Trace folder or part file.")]) -> None:
    """Summarise a trace: how it was made, requests and tokens per phase, per-layer expert usage."""
    from duoserve.trace.format import open_trace
    from duoserve.trace.info import layer_stats, summarize

    with _user_errors():
        trace = open_trace(path)
    meta, summary = trace.meta, summarize(trace)
    console.print(f"[bold]{path}[/]: model {meta.model}, {meta.num_layers} MoE layers "
                  f"(decoder {meta.decoder_indices[0]}..{meta.decoder_indices[-1]}), {meta.num_experts} experts, "
                  f"top-{meta.top_k}, next-gate depth {meta.lookahead}, {len(trace.files)} part file(s)")
    tokens = _table("requests and tokens", "dataset", "requests", "prefill tokens", "decode tokens")
    for name, n in sorted(summary.requests.items()):
        tokens.add_row(name, str(n), str(summary.tokens.get((name, "prefill"), 0)),
                       str(summary.tokens.get((name, "decode"), 0)))
    console.print(tokens)
    usage = _table("expert usage per MoE layer", "layer", "experts used", "max load / uniform",
                   "entropy (norm.)")
    for s in layer_stats(summary.usage):
        usage.add_row(str(s["layer"]), f"{s['experts_used']}/{meta.num_experts}", f"{s['max_over_uniform']:.2f}",
                      f"{s['entropy']:.3f}")
    console.print(usage)


@trace_app.command("import")
def import_cmd(
    source: Annotated[Path, typer.Argument(help="Log file, or a folder of them.")],
    out: Annotated[Path, typer.Option(help="New trace folder.")],
    format: Annotated[str, typer.Option(help="long (jsonl/csv/parquet rows per token and layer), sglang "
                                             "(per_token recorder .pt dumps) or npy (.npy/.npz arrays).")] = "long",
    request: Annotated[str, typer.Option(help="long: request id column.")] = "request_id",
    token: Annotated[str, typer.Option(help="long: token index (position) column.")] = "token",
    layer: Annotated[str, typer.Option(help="long: MoE layer column (0-based).")] = "layer",
    experts: Annotated[str, typer.Option(help="long: column of the layer's top-k expert ids.")] = "experts",
    scores: Annotated[Optional[str], typer.Option(help="long: column of router weights, if any.")] = None,
    dataset_column: Annotated[Optional[str], typer.Option(help="long: column naming each row's dataset.")] = None,
    phase_column: Annotated[Optional[str], typer.Option(help="long: column with prefill/decode.")] = None,
    token_id_column: Annotated[Optional[str], typer.Option(help="long: column with the token id.")] = None,
    dataset: Annotated[str, typer.Option(help="Dataset name when no column gives it.")] = "imported",
    phase: Annotated[str, typer.Option(help="Phase when no column gives it.")] = "decode",
    layout: Annotated[str, typer.Option(help="npy: lt = [layers, tokens, k], tl = [tokens, layers, k].")] = "lt",
    num_layers: Annotated[Optional[int], typer.Option(help="Declared MoE layers (checked). [default: inferred]")]
    = None,
    num_experts: Annotated[Optional[int], typer.Option(help="Declared experts (checked). [default: max id + 1]")]
    = None,
    top_k: Annotated[Optional[int], typer.Option(help="Declared top-k (checked). [default: inferred]")] = None,
    model: Annotated[str, typer.Option(help="Model name to record in the trace metadata.")] = "imported",
) -> None:
    """Convert routing logs from serving engines (vLLM, SGLang, your own) into a duoserve trace."""
    from duoserve.trace.importers import ImportSettings, import_trace

    settings = ImportSettings(source=source, out=out, format=format, request=request, token=token, layer=layer,
                              experts=experts, scores=scores, dataset_column=dataset_column, phase_column=phase_column,
                              token_id_column=token_id_column, dataset=dataset, phase=phase, layout=layout,
                              num_layers=num_layers, num_experts=num_experts, top_k=top_k, model=model)
    with _user_errors():
        with _progress() as progress:
            task = progress.add_task("importing (tokens)", total=None)
            result = import_trace(settings, lambda n: progress.update(task, completed=n))
    L, E, k = result.geometry
    table = _table(f"import -> {result.out}", "format", "L x E, k", "tokens", "dropped (missing layers)",
                   "inferred", "seconds")
    table.add_row(format, f"{L} x {E}, {k}", str(result.tokens), str(result.dropped),
                  ", ".join(result.inferred) or "-", f"{result.seconds:.1f}")
    console.print(table)
    if result.dropped:
        err_console.print(f"[yellow]warning:[/] {result.dropped} token(s) lacked some layer and were dropped")


@trace_app.command("export")
def export_cmd(
    path: Annotated[Path, typer.Argument(help="Trace folder.")],
    out: Annotated[Path, typer.Option(help="Long JSON-lines file, one row per (request, token, layer).")],
) -> None:
    """Write a trace as long JSON lines (the `import --format long` input, with every field)."""
    from duoserve.trace.format import open_trace
    from duoserve.trace.importers import export_long

    with _user_errors():
        rows = export_long(open_trace(path), out)
    console.print(f"{rows} rows -> {out}")


run_app = typer.Typer(help="Serve an MoE model with its experts in host memory: dual-phase offload (stage 5).",
                      no_args_is_help=True, pretty_exceptions_enable=False)

POLICY_HELP = f"{', '.join(POLICIES)} (duoserve-run policies says what each does)."
LOOKAHEAD_HELP = ("Decode prefetch depth in layers (duoserve): layer l's predictions are for layer l+d. "
                  "Trained predictors need 1; oracles take any.")
EAGER_HELP = "Launch every decode call's kernels; no CUDA graph replays (see duoserve/runtime/experts.py)."
MIN_SCORE_HELP = ("Decode prefetch (duoserve): copy ahead only predicted experts scored at least this, 0-1 (a trained "
                  "predictor's scores are probabilities); 0 copies every expert of the predicted top-k.")
BUDGET_HELP = ("Device memory for cached experts of the caching policies (duoserve, lru), e.g. 8GiB; at least top-k "
               "experts. [default: (1 + lookahead) x top-k experts]")


def _gb(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.2f}"


def _num(value, fmt: str = ".3f") -> str:
    return "-" if value is None else format(value, fmt)


def _default_prompts(count: int = 2) -> list[str]:
    from duoserve.data.tasks import load_requests, parse_datasets

    return [load_requests(spec, None, 1, seed=0)[0].prompt
            for spec in parse_datasets(DEFAULT_DATASETS)][:count]


@run_app.command()
def policies() -> None:
    """List the offload policies and what each does."""
    table = _table("offload policies", "policy", "what it does")
    for p in POLICIES.values():
        table.add_row(p.name, p.about)
    console.print(table)


@run_app.command()
def generate(
    model: Annotated[str, typer.Option(help=f"HF model id, local path, or '{EMBEDDED_NAME}'.")] = EMBEDDED_NAME,
    prompt: Annotated[Optional[list[str]], typer.Option(
        help="Prompt text; repeat for a batch. [default: one built-in SQuAD-style and one Orca-Math-style prompt]")]
    = None,
    predictor: Annotated[Optional[Path], typer.Option(help="Exported predictor folder (duoserve policy).")] = None,
    policy: Annotated[str, typer.Option(help=POLICY_HELP)] = "duoserve",
    new_tokens: Annotated[int, typer.Option(help="Most tokens to generate (greedy; stops at EOS).")] = 64,
    gpu_expert_budget: Annotated[Optional[str], typer.Option(help=BUDGET_HELP)] = None,
    lookahead: Annotated[int, typer.Option(help=LOOKAHEAD_HELP)] = 1,
    eager: Annotated[bool, typer.Option(help=EAGER_HELP)] = False,
    prefetch_min_score: Annotated[float, typer.Option(help=MIN_SCORE_HELP, min=0.0, max=1.0)] = 0.0,
    device: Annotated[str, typer.Option(help="auto, cuda, cuda:N or cpu (the CPU stands in for a GPU).")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16, float16.")] = "auto",
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write texts and figures here.")] = None,
) -> None:
    """Generate with the experts offloaded to host memory; print the texts and the run's figures."""
    from duoserve.predictor.artifact import load_predictor
    from duoserve.runtime import ExpertsPlugin, OffloadEngine, get_policy, offload, parse_bytes, timed_generate
    from duoserve.runtime.store import put_experts
    from duoserve.trace.collect import load_model, resolve_device

    with _user_errors():
        chosen = get_policy(policy)
        budget = parse_bytes(gpu_expert_budget) if gpu_expert_budget else None
        scorer = load_predictor(predictor) if predictor else None
        target = resolve_device(device)
        net, tokenizer = load_model(model, device="cpu", dtype=dtype)
        prompts = prompt or _default_prompts()
        if chosen.resident:
            net.to(target)
            plugin = ExpertsPlugin(net)
        else:
            stores = offload(net, chosen, target)
            plugin = OffloadEngine(net, stores, chosen, scorer, gpu_expert_budget=budget, device=target,
                                   lookahead=lookahead, eager=eager, prefetch_min_score=prefetch_min_score)
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to(target)
    with plugin:
        out, timing = timed_generate(net, batch.input_ids, batch.attention_mask, new_tokens)
        counters = plugin.stats() if isinstance(plugin, OffloadEngine) else {}
    if not chosen.resident:
        put_experts(plugin.layers, stores, target)
    texts = tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
    for p, text in zip(prompts, texts):
        console.print(f"[bold]{p[-60:]!r}[/] -> {text!r}")
    table = _table(f"{chosen.name} on {target}", "figure", "value")
    table.add_row("TTFT (s)", _num(timing["ttft_s"]))
    table.add_row("time per output token (ms)", _num(timing["tpot_ms"], ".2f"))
    table.add_row("end to end (s)", _num(timing["e2e_s"]))
    table.add_row("peak GPU memory (GB)", _gb(timing["peak_gpu_bytes"]))
    if counters:
        table.add_row("host-to-device GB (prefill / decode)",
                      f"{_gb(counters['bytes_h2d']['prefill'])} / {_gb(counters['bytes_h2d']['decode'])}")
        table.add_row("decode cache hit rate", _num(counters["hit_rate"]["decode"]))
        table.add_row("stall waiting for copies (ms)", _num(counters["stall_ms"], ".1f"))
        table.add_row("predictor (ms)", _num(counters["predictor_ms"], ".1f"))
        table.add_row("expert copies via", counters["copy_path"])
    console.print(table)
    if json_out:
        from duoserve.trace.writer import atomic_write_bytes

        result = {"policy": chosen.name, "texts": texts, **timing, **counters}
        atomic_write_bytes(json_out, (json.dumps(result, indent=2) + "\n").encode())


@run_app.command("bench")
def bench_cmd(
    model: Annotated[str, typer.Option(help=f"HF model id, local path, or '{EMBEDDED_NAME}'.")] = EMBEDDED_NAME,
    config_only: Annotated[bool, typer.Option(
        help="Build the model from its config with random weights, on the device (no checkpoint needed).")] = False,
    layers: Annotated[Optional[int], typer.Option(help="Config-only: keep this many decoder layers.")] = None,
    policy: Annotated[Optional[list[str]], typer.Option(
        help=f"Repeatable: {POLICY_HELP} [default: {', '.join(DEFAULT_POLICIES)}]")] = None,
    predictor: Annotated[Optional[list[str]], typer.Option(
        help="Repeatable, for the duoserve policy: none, oracle, oracle:RECALL (knows the routing, keeps each "
             "true expert with that probability) or a predictor folder. [default: none]")] = None,
    routing: Annotated[str, typer.Option(
        help="router (the model's own), random (uniform top-k, seeded) or a trace folder to replay.")] = "router",
    batch_size: Annotated[Optional[list[int]], typer.Option(help="Repeatable. [default: 1]")] = None,
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens (random ids).")] = 512,
    new_tokens: Annotated[int, typer.Option(help="Tokens generated per run.")] = 128,
    baseline_new_tokens: Annotated[Optional[int], typer.Option(
        help="Fewer tokens for the fetch-bound baselines (all but duoserve and all-resident).")] = None,
    gpu_expert_budget: Annotated[Optional[str], typer.Option(help=BUDGET_HELP)] = None,
    device: Annotated[str, typer.Option(help="auto, cuda, cuda:N or cpu.")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto (bfloat16 on GPU for config-only), float32, bfloat16.")] = "auto",
    seed: Annotated[int, typer.Option(help="Seed of prompts and random routing.")] = 0,
    repeats: Annotated[int, typer.Option(
        help="Rounds over every configuration, interleaved (timings drift on shared machines).")] = 1,
    lookahead: Annotated[int, typer.Option(help=LOOKAHEAD_HELP)] = 1,
    eager: Annotated[bool, typer.Option(help=EAGER_HELP)] = False,
    prefetch_min_score: Annotated[float, typer.Option(help=MIN_SCORE_HELP, min=0.0, max=1.0)] = 0.0,
    out: Annotated[Path, typer.Option(help="JSON result file.")] = Path("bench.json"),
) -> None:
    """Run offload policies side by side: TTFT, time per token, peak memory, bytes, hit rate, and their bounds."""
    from duoserve.runtime.bench import BenchSettings, bench
    from duoserve.runtime.generate import parse_bytes
    from duoserve.trace.writer import atomic_write_bytes

    with _user_errors():
        s = BenchSettings(model=model, config_only=config_only, layers=layers, dtype=dtype, device=device,
                          policies=policy or list(DEFAULT_POLICIES),
                          batch_sizes=batch_size or [1], prompt_len=prompt_len, new_tokens=new_tokens,
                          baseline_new_tokens=baseline_new_tokens, routing=routing, predictors=predictor or ["none"],
                          gpu_expert_budget=parse_bytes(gpu_expert_budget) if gpu_expert_budget else None, seed=seed,
                          repeats=repeats, lookahead=lookahead, eager=eager, prefetch_min_score=prefetch_min_score)
        if repeats < 1:
            raise ValueError(f"--repeats must be at least 1, got {repeats}")
        runs_total = repeats * len(s.batch_sizes) * sum(len(s.predictors) if p == "duoserve" else 1 for p in s.policies)
        with _progress() as bar:
            task = bar.add_task("policies", total=runs_total)
            result = bench(s, on_run=lambda run: bar.advance(task),
                           on_status=lambda text: bar.update(task, description=text))
    bw = result["bandwidth"]
    console.print(f"{result['device']}: copy bandwidth pinned {_num(bw['pinned_gbps'], '.1f')} GB/s, "
                  f"pageable {_num(bw['pageable_gbps'], '.1f')} GB/s; expert {result['geometry']['expert_mb']:.1f} MB, "
                  f"routing {result['routing']}")
    rounds = s.repeats > 1
    latency = _table("latency and memory", "policy", "predictor", "B", *(["round"] if rounds else []), "TTFT s",
                     "bound", "TPOT ms", "bound", "peak GB")
    traffic = _table("host-to-device copies", "policy", "predictor", "B", *(["round"] if rounds else []),
                     "prefill GB", "decode GB", "decode hits", "stall ms", "pred. ms")
    for r in result["runs"]:
        who = (r["policy"], r["predictor"] or "-", str(r["batch_size"]), *([str(r["round"])] if rounds else []))
        latency.add_row(*who, _num(r["ttft_s"]), _num(r["prefill_bound_s"]), _num(r["tpot_ms"], ".2f"),
                        _num(r["decode_bound_ms"], ".2f"), _gb(r["peak_gpu_bytes"]))
        if "bytes_h2d" in r:
            traffic.add_row(*who, _gb(r["bytes_h2d"]["prefill"]), _gb(r["bytes_h2d"]["decode"]),
                            _num(r["hit_rate"]["decode"]), _num(r["stall_ms"], ".0f"), _num(r["predictor_ms"], ".0f"))
    console.print(latency)
    console.print(traffic)
    if result["targets"]:
        targets = _table("targets", "B", "predictor", *(["round"] if rounds else []), "target", "value", "met")
        for t in result["targets"]:
            targets.add_row(str(t["batch_size"]), t["predictor"], *([str(t["round"])] if rounds else []),
                            t["target"], _num(t["value"], ".2f"), "yes" if t["met"] else "[red]no[/]")
        console.print(targets)
    atomic_write_bytes(out, (json.dumps(result, indent=2) + "\n").encode())
    console.print(f"results: {out}")


train_app = typer.Typer(help="Routing statistics and next-layer expert predictor training (stages 2-3).",
                        no_args_is_help=True, pretty_exceptions_enable=False)
PHASE_HELP = "prefill, decode, or all."


def _phase(phase: str) -> Optional[str]:
    if phase not in ("all", "prefill", "decode"):
        raise typer.BadParameter(f"phase must be all, prefill or decode, not {phase!r}")
    return None if phase == "all" else phase


@train_app.command()
def stats(
    traces: Annotated[list[Path], typer.Argument(help="Trace folders (same geometry); their counts are merged.")],
    out: Annotated[Path, typer.Option(help="Output .safetensors file (counts + JSON metadata).")]
    = Path("stats.safetensors"),
    phase: Annotated[str, typer.Option(help=PHASE_HELP)] = "all",
    workers: Annotated[int, typer.Option(help="Processes counting a folder's part files in parallel.")] = 1,
) -> None:
    """Per-layer popularity (L x E) and consecutive-layer affinity ((L-1) x E x E) with counts."""
    from duoserve.features.stats import compute_stats
    from duoserve.trace.format import open_trace

    with _user_errors():
        opened = [open_trace(t) for t in traces]
        with _progress() as progress:
            task = progress.add_task("counting", total=len(opened))
            merged = None
            for trace in opened:
                one = compute_stats(trace, _phase(phase), workers=workers)
                merged = one if merged is None else merged.merge(one)
                progress.advance(task)
        merged.save(out)
    L, E = merged.geometry
    table = _table(f"statistics -> {out}", "tokens", "layers", "experts", "top expert per layer (share)")
    pop = merged.popularity
    table.add_row(str(merged.tokens), str(L), str(E),
                  ", ".join(f"{l}:{int(pop[l].argmax())} ({pop[l].max():.2f})" for l in range(min(L, 8)))
                  + (" ..." if L > 8 else ""))
    console.print(table)


@train_app.command("fit")
def fit_cmd(
    traces: Annotated[list[Path], typer.Argument(help="Trace folders (same geometry).")],
    out: Annotated[Path, typer.Option(help="Predictor artifact folder.")] = Path("predictor"),
    phase: Annotated[str, typer.Option(help=f"Tokens to train on: {PHASE_HELP}")] = "all",
    val_fraction: Annotated[float, typer.Option(help="Share of requests held out for validation.")] = 0.1,
    seed: Annotated[int, typer.Option(help="Seed of the split, initialisation and shuffling.")] = 0,
    window: Annotated[Optional[int], typer.Option(help="History window in layers. [default: all previous]")]
    = None,
    widths: Annotated[str, typer.Option(help="Hidden widths, comma-separated (the paper's by default).")]
    = ",".join(map(str, PAPER_WIDTHS)),
    feature: Annotated[Optional[list[str]], typer.Option(
        help="Features beside the history: popularity, affinity, nextgate. Repeatable. "
             "[default: popularity, affinity]")] = None,
    epochs: Annotated[int, typer.Option(help="Maximum epochs (early stopping on validation exact-top-k).")] = 10,
    patience: Annotated[int, typer.Option(help="Epochs without improvement before stopping.")] = 3,
    batch_size: Annotated[int, typer.Option(help="Examples per step.")] = 1024,
    lr: Annotated[float, typer.Option(help="AdamW learning rate.")] = 1e-3,
    accelerator: Annotated[str, typer.Option(help="Lightning accelerator: auto, cpu, gpu.")] = "auto",
    devices: Annotated[str, typer.Option(help="Lightning devices: auto, 1, 2, ...")] = "auto",
    strategy: Annotated[str, typer.Option(help="Lightning strategy: auto, ddp, ...")] = "auto",
    onnx: Annotated[bool, typer.Option(
        help="Also write model.onnx into the artifact, checked against PyTorch (needs duoserve[onnx]).")] = False,
) -> None:
    """Train the next-layer expert predictor (Lightning) and export it as a self-contained artifact."""
    from duoserve.train.fit import FitSettings, fit

    with _user_errors():
        settings = FitSettings(
            traces=traces, out=out, phase=_phase(phase), val_fraction=val_fraction, seed=seed, window=window,
            widths=tuple(int(w) for w in widths.split(",") if w.strip()),
            features=tuple(feature) if feature else ("popularity", "affinity"), epochs=epochs, patience=patience,
            batch_size=batch_size, lr=lr, accelerator=accelerator,
            devices=int(devices) if devices.isdigit() else devices, strategy=strategy)
        result = fit(settings)
    if result.out is None:
        return
    table = _table(f"validation ({result.val_examples} token-layer examples) -> {result.out}", "predictor",
                   "exact-top-k", "at-least-half", "recall")
    for name, m in result.metrics.items():
        table.add_row(name if name != "predictor" else "[bold]trained MLP[/]", f"{m['exact_topk']:.3f}",
                      f"{m['at_least_half']:.3f}", f"{m['recall']:.3f}")
    console.print(table)
    console.print(f"{result.train_examples} training examples, {result.epochs} epoch(s), {result.seconds:.0f} s")
    if onnx:
        from duoserve.predictor.artifact import load_predictor
        from duoserve.predictor.onnx import export_onnx

        with _user_errors():
            path, diff = export_onnx(load_predictor(result.out), result.out)
        console.print(f"ONNX: {path} (onnxruntime vs PyTorch: max |logit difference| {diff:.1e})")


eval_app = typer.Typer(help="How well a predictor knows the next layer's experts, against the baselines (stage 4).",
                       no_args_is_help=True, pretty_exceptions_enable=False)


def _print_overall(report) -> None:
    for phase in ("decode", "prefill"):
        overall = report.overall(phase)
        if overall.empty:
            continue
        table = _table(f"{phase} tokens ({int(overall['examples'].iloc[0])} token-layer predictions)", "scorer",
                       "exact-top-k", "at-least-half", "recall", *(f"recall@{b}" for b in report.budgets[1:]))
        for name, row in overall.iterrows():
            table.add_row(f"[bold]{name}[/]" if name == "trained MLP" else name, f"{row.exact_topk:.3f}",
                          f"{row.at_least_half:.3f}", f"{row.recall:.3f}",
                          *(f"{row[f'recall@{b}']:.3f}" for b in report.budgets[1:]))
        console.print(table)


@eval_app.command()
def accuracy(
    traces: Annotated[list[Path], typer.Option(help="Trace folder(s) to evaluate on (requests the predictor "
                                                    "was trained on are skipped).")],
    predictor: Annotated[Path, typer.Option(help="Predictor artifact folder (duoserve-train fit).")],
    out: Annotated[Path, typer.Option(help="Report folder: report.json, report.md, plots.")] = Path("report"),
    train_traces: Annotated[Optional[list[Path]], typer.Option(
        help="Traces the predictor was trained on (for the baselines). [default: those in its config.json]")] = None,
    baseline: Annotated[Optional[list[str]], typer.Option(
        help="Baselines to include (repeatable). [default: all: popularity, affinity, activation-matrix, "
             "next-gate, previous-token, logistic, oracle]")] = None,
    extra_budget: Annotated[str, typer.Option(help="Extra experts fetched beyond k, comma-separated.")] = "1,2",
    cross_task: Annotated[bool, typer.Option(help="Also fit per dataset and test on the others.")] = False,
    learning_curve: Annotated[Optional[str], typer.Option(
        help="Also fit on these shares of the training requests, e.g. 0.1,0.25,0.5,1.")] = None,
    fit_epochs: Annotated[int, typer.Option(help="Epochs of the extra fits (cross-task, learning curve).")] = 3,
) -> None:
    """Accuracy of PREDICTOR and every baseline on unseen requests; writes report.json, report.md and plots."""
    from duoserve.evaluate import accuracy as acc
    from duoserve.evaluate import generalization
    from duoserve.evaluate.report import markdown_table, write_report
    from duoserve.train.fit import FitSettings

    with _user_errors():
        with _progress() as progress:
            task = progress.add_task("evaluating", total=None)
            say = lambda text: progress.update(task, description=text)  # noqa: E731
            report = acc.evaluate_accuracy(traces, predictor, train_traces, baseline or acc.BASELINES,
                                           [int(b) for b in extra_budget.split(",") if b.strip()], say)
            extra = ""
            if cross_task or learning_curve:
                config = report.info["predictor_config"]
                base = FitSettings(traces=traces, widths=tuple(config["widths"]), epochs=fit_epochs,
                                   features=[f for f in ("popularity", "affinity", "nextgate")
                                             if config["feature_spec"][f]], progress=False)
                work = out / "fits"
                if cross_task:
                    ct = generalization.cross_task(traces, work, base, say)
                    report.info["cross_task"] = ct.to_dict("records")
                    pivot = ct.pivot_table(index=["scorer", "train"], columns="test", values="exact_topk")
                    pivot.index = [f"{s} / trained on {t}" for s, t in pivot.index]
                    extra += "## Cross-task (decode, exact-top-k)\n\n" + markdown_table(pivot, "scorer / train") + "\n\n"
                if learning_curve:
                    lc = generalization.learning_curve(traces, work, base,
                                                       [float(f) for f in learning_curve.split(",")], say)
                    report.info["learning_curve"] = lc.to_dict("records")
                    pivot = lc.pivot_table(index="train_fraction", columns="scorer", values="exact_topk")
                    extra += ("## Learning curve (validation requests, all phases, exact-top-k)\n\n"
                              + markdown_table(pivot, "train fraction") + "\n\n")
            progress.update(task, description="writing the report")
            write_report(report, out, report.stats, extra)
    _print_overall(report)
    console.print(f"report: {out / 'report.md'}, {out / 'report.json'}, plots {', '.join(report.info['plots'])}")


@eval_app.command()
def report(folder: Annotated[Path, typer.Argument(help="Report folder written by duoserve-eval accuracy.")]) -> None:
    """Print the summary tables of a saved report."""
    from duoserve.evaluate.accuracy import load_report

    with _user_errors():
        saved = load_report(folder)
    info = saved.info
    console.print(f"[bold]{folder}[/]: predictor {info['predictor']}, {info['evaluated_requests']} unseen requests, "
                  f"{info['examples']} token-layer predictions")
    _print_overall(saved)


@eval_app.command()
def health(trace: Annotated[Path, typer.Argument(help="Trace folder.")]) -> None:
    """Is the routing worth predicting? Per-layer load, task dependence, affinity predictability."""
    from duoserve.evaluate.health import routing_health
    from duoserve.trace.format import open_trace

    with _user_errors():
        h = routing_health(open_trace(trace))
    table = _table(f"routing health of {trace}", "figure", "value")
    table.add_row("experts used (worst layer)", f"{h['min_experts_used']}/{h['num_experts']}")
    table.add_row("max load / uniform (worst layer)", f"{h['max_over_uniform']:.2f}")
    if "task_tv_per_layer" in h:
        tv = h["task_tv_per_layer"]
        table.add_row("task total-variation per layer", f"{min(tv):.3f}-{max(tv):.3f} (mean {sum(tv) / len(tv):.3f})")
    a = h["affinity"]
    table.add_row(f"affinity, {h['affinity_decode_tokens']} odd-request decode tokens",
                  f"exact {a['exact_topk']:.3f}, at-least-half {a['at_least_half']:.3f}" if a else "n/a (none)")
    table.add_row("random choice, at-least-half", f"{h['random_at_least_half']:.3f}")
    console.print(table)
