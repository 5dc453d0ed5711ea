"""duoserve-run: serve an MoE model with its experts in host memory, and compare offload policies (stage 5)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Annotated, Optional

import typer

from duoserve.cli.common import (
    ENGINE,
    BudgetOption,
    DeferPrefetchOption,
    DtypeOption,
    EagerOption,
    LookaheadOption,
    MinScoreOption,
    ModelOption,
    PinOption,
    PolicyHelp,
    StepGraphsOption,
    console,
    engine_settings,
    gb,
    new_app,
    num,
    progress,
    table,
    user_errors,
)
from duoserve.embedded import EMBEDDED_NAME
from duoserve.files import check_output
from duoserve.runtime.policies import DEFAULT_POLICIES, POLICIES

ExpertDtypeHelp = ("How host experts are stored and copied: model (the model's dtype), fp8 (e4m3, 128x128 block "
                   "scales) or int4 (group-128 symmetric); quantized on load, dequantized on the device as they land "
                   "(docs/runtime.md, 'Quantized experts').")

app = new_app("Serve an MoE model with its experts in host memory: dual-phase offload (stage 5).")


@app.command()
def policies() -> None:
    """List the offload policies and what each does."""
    listing = table("offload policies", "policy", "what it does")
    for p in POLICIES.values():
        listing.add_row(p.name, p.about)
    console.print(listing)


@app.command()
def generate(
    model: ModelOption = EMBEDDED_NAME,
    prompt: Annotated[Optional[list[str]], typer.Option(
        help="Prompt text; repeat for a batch. [default: one built-in SQuAD-style and one Orca-Math-style prompt]")]
    = None,
    predictor: Annotated[Optional[Path], typer.Option(help="Exported predictor folder (duoserve policy).")] = None,
    policy: Annotated[str, typer.Option(help=PolicyHelp)] = "duoserve",
    new_tokens: Annotated[int, typer.Option(min=1, help="Most tokens to generate (greedy; stops at EOS).")] = 64,
    gpu_expert_budget: BudgetOption = None,
    lookahead: LookaheadOption = ENGINE.lookahead,
    eager: EagerOption = ENGINE.eager,
    step_graphs: StepGraphsOption = ENGINE.step_graphs,
    defer_prefetch: DeferPrefetchOption = ENGINE.defer_prefetch,
    prefetch_min_score: MinScoreOption = ENGINE.prefetch_min_score,
    pin: PinOption = None,
    expert_dtype: Annotated[str, typer.Option(help=ExpertDtypeHelp + " auto: fp8 for a block-wise FP8 checkpoint "
                                              "(its own codes), else model.")] = "auto",
    device: Annotated[str, typer.Option(help="auto, cuda, cuda:N or cpu (the CPU stands in for a GPU).")] = "auto",
    dtype: DtypeOption = "auto",
    out: Annotated[Optional[Path], typer.Option(help="Also write the texts and figures here (JSON).")] = None,
) -> None:
    """Generate with the experts offloaded to host memory; print the texts and the run's figures."""
    from duoserve.data.tasks import default_prompts
    from duoserve.files import write_json
    from duoserve.runtime.generation import generate as run_generate

    with user_errors():
        if out:
            check_output(out)
        settings = engine_settings(gpu_expert_budget, lookahead, eager, prefetch_min_score, pin, step_graphs,
                                   defer_prefetch)
        result = run_generate(model, prompt or default_prompts(), policy, predictor, new_tokens, settings, device,
                              dtype, expert_dtype)
    for p, text in zip(result.prompts, result.texts):
        console.print(f"[bold]{p[-60:]!r}[/] -> {text!r}")
    timing, counters = result.timing, result.counters
    figures = table(f"{result.policy} on {device}", "figure", "value")
    figures.add_row("TTFT (s)", num(timing["ttft_s"]))
    figures.add_row("time per output token (ms)", num(timing["tpot_ms"], ".2f"))
    figures.add_row("end to end (s)", num(timing["e2e_s"]))
    figures.add_row("peak GPU memory (GB)", gb(timing["peak_gpu_bytes"]))
    figures.add_row("host experts stored as", result.expert_dtype)
    if counters:
        figures.add_row("host-to-device GB (prefill / decode)",
                        f"{gb(counters['bytes_h2d']['prefill'])} / {gb(counters['bytes_h2d']['decode'])}")
        if "cache_slots" in counters:  # the engine's policies (Accelerate's keep no cache)
            cache = f"{counters['cache_slots']} / {gb(counters['cache_bytes'])}"
            figures.add_row("GPU expert cache (slots / GB)", cache)
        figures.add_row("decode cache hit rate", num(counters["hit_rate"]["decode"]))
        figures.add_row("experts pinned", str(counters["pinned_experts"]))
        figures.add_row("stall waiting for copies (ms)", num(counters["stall_ms"], ".1f"))
        figures.add_row("predictor (ms)", num(counters["predictor_ms"], ".1f"))
        figures.add_row("expert copies via", counters["copy_path"])
        figures.add_row("decoder-layer calls replayed from step graphs", str(counters["graphed_layer_calls"]))
    console.print(figures)
    if out:
        write_json(out, result.to_dict())


@app.command("bench")
def bench_cmd(
    model: ModelOption = EMBEDDED_NAME,
    config_only: Annotated[bool, typer.Option(
        help="Build the model from its config with random weights, on the device (no checkpoint needed).")] = False,
    layers: Annotated[Optional[int], typer.Option(help="Config-only: keep this many decoder layers.")] = None,
    policy: Annotated[Optional[list[str]], typer.Option(
        help=f"Repeatable: {PolicyHelp} [default: {', '.join(DEFAULT_POLICIES)}]")] = None,
    predictor: Annotated[Optional[list[str]], typer.Option(
        help="Repeatable, for the duoserve policy: none, oracle, oracle:RECALL (knows the routing, keeps each "
             "true expert with that probability) or a predictor folder. [default: none]")] = None,
    routing: Annotated[str, typer.Option(
        help="router (the model's own), random (uniform top-k, seeded) or a trace folder to replay.")] = "router",
    batch_size: Annotated[Optional[list[int]], typer.Option(help="Repeatable. [default: 1]")] = None,
    prompt_len: Annotated[Optional[list[int]], typer.Option(
        min=1, help="Repeatable: prompt tokens (random ids). [default: 512]")] = None,
    grid: Annotated[str, typer.Option(
        help="product: every batch size at every prompt length; axes: the batch sizes at the first prompt length, "
             "then the other prompt lengths at the first batch size.")] = "product",
    new_tokens: Annotated[int, typer.Option(min=2, help="Tokens generated per run (2 or more: a time per token "
                                                        "needs two).")] = 128,
    baseline_new_tokens: Annotated[Optional[int], typer.Option(
        help="Fewer tokens for the fetch-bound baselines (all but duoserve and all-resident).")] = None,
    gpu_expert_budget: BudgetOption = None,
    device: Annotated[str, typer.Option(help="auto, cuda, cuda:N or cpu.")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto (bfloat16 on GPU for config-only), float32, bfloat16.")] = "auto",
    seed: Annotated[int, typer.Option(help="Seed of prompts and random routing.")] = 0,
    repeats: Annotated[int, typer.Option(
        min=1, help="Rounds over every configuration, interleaved (timings drift on shared machines).")] = 1,
    lookahead: LookaheadOption = ENGINE.lookahead,
    eager: EagerOption = ENGINE.eager,
    step_graphs: StepGraphsOption = ENGINE.step_graphs,
    defer_prefetch: DeferPrefetchOption = ENGINE.defer_prefetch,
    prefetch_min_score: MinScoreOption = ENGINE.prefetch_min_score,
    pin: PinOption = None,
    expert_dtype: Annotated[Optional[list[str]], typer.Option(
        help=f"Repeatable: {ExpertDtypeHelp} Each runs every packed-store policy. [default: model]")] = None,
    out: Annotated[Path, typer.Option(help="JSON result file (with the commit, machine and command).")]
    = Path("bench.json"),
) -> None:
    """Run offload policies side by side: TTFT, time per token, peak memory, bytes, hit rate, and their bounds."""
    from duoserve.bench.harness import BenchSettings, bench
    from duoserve.bench.results import write_result

    with user_errors():
        check_output(out)
        s = BenchSettings(model=model, config_only=config_only, layers=layers, dtype=dtype, device=device,
                          policies=policy or list(DEFAULT_POLICIES), batch_sizes=batch_size or [1],
                          prompt_lens=prompt_len or [512], grid=grid, new_tokens=new_tokens,
                          baseline_new_tokens=baseline_new_tokens,
                          routing=routing, predictors=predictor or ["none"], seed=seed, repeats=repeats,
                          engine=engine_settings(gpu_expert_budget, lookahead, eager, prefetch_min_score, pin,
                                                 step_graphs, defer_prefetch),
                          expert_dtypes=expert_dtype or ["model"])
        with progress("policies", total=s.run_count()) as update:
            def on_run(run: dict, so_far: dict) -> None:  # what was measured survives a stopped bench
                write_result(out, so_far)
                update(advance=1)

            result = bench(s, on_run=on_run, on_status=lambda text: update(description=text))
    _print_bench(result, rounds=s.repeats > 1)
    write_result(out, result)
    console.print(f"results: {out}")


@app.command("profile")
def profile_cmd(
    model: Annotated[str, typer.Option(
        help="A model config (hub id, local path or checkpoint folder): its shape is built with random weights.")],
    layers: Annotated[int, typer.Option(
        min=2, help="Decoder layers built; per-layer and per-pass costs are fitted from 1 and this many.")] = 2,
    batch_size: Annotated[Optional[list[int]], typer.Option(
        min=1, help="Repeatable: batch sizes of the per-layer costs. [default: 1, 8]")] = None,
    context: Annotated[Optional[list[int]], typer.Option(
        min=1, help="Repeatable: context (prompt) lengths of the per-layer costs. [default: 128, 512]")] = None,
    tokens: Annotated[Optional[list[int]], typer.Option(
        min=1, help="Repeatable: tokens per expert of the expert-compute groups, and of the prefill calls whose "
                    "host time is measured. [default: 1, 8, 64, 512]")] = None,
    device: Annotated[str, typer.Option(help="auto, cuda, cuda:N or cpu.")] = "auto",
    dtype: DtypeOption = "auto",
    step_graphs: StepGraphsOption = ENGINE.step_graphs,
    rounds: Annotated[int, typer.Option(
        min=1, help="Rounds of the engine's host costs, each cost the median of its rounds (a host's speed "
                    "drifts between minutes).")] = 3,
    out: Annotated[Path, typer.Option(help="The profile (JSON, with the commit, machine and command).")]
    = Path("gpu.json"),
) -> None:
    """Measure this machine's offload costs for a model shape: copy bandwidth by size, the host cost of a copy, the
    engine's expert compute by tokens, the host time of an engine call, dequantization, and each layer's and each
    pass's non-expert time: the cost model of duoserve-eval simulate."""
    from duoserve.bench.profile import ProfileSettings, profile
    from duoserve.bench.results import write_result

    with user_errors():
        check_output(out)
        s = ProfileSettings(model=model, layers=layers, dtype=dtype, device=device,
                            batch_sizes=batch_size or [1, 8], contexts=context or [128, 512],
                            tokens=tokens or [1, 8, 64, 512], step_graphs=step_graphs, rounds=rounds)
        with progress("profile", total=None) as update:
            result = profile(s, say=lambda text: update(description=text))
    write_result(out, result)
    copies = table(f"{result['device']}: host-to-device copies", "MB", "pinned GB/s", "pageable GB/s")
    for c in result["copy"]:
        copies.add_row(num(c["bytes"] / 2**20, ".2f"), num(c["pinned_gbps"], ".1f"), num(c["pageable_gbps"], ".1f"))
    console.print(copies)
    compute = table("the engine's expert compute (device time)", "experts", "tokens each", "ms")
    for e in result["expert_ms"]:
        compute.add_row(str(e["experts"]), str(e["tokens"]), num(e["ms"], ".3f"))
    console.print(compute)
    calls = table("host time of an engine layer call, every expert cached", "phase", "tokens", "us",
                  "routing us")
    for c in result["call_host_us"]:
        calls.add_row(c["phase"], str(c["tokens"]), num(c["us"], ".1f"), num(c["routing_us"], ".1f"))
    console.print(calls)
    rest = table("per layer without its experts, and per pass", "B", "context", "decode ms", "prefill ms",
                 "pass decode ms", "pass prefill ms")
    for r, step in zip(result["layer_ms"], result["step_ms"]):
        rest.add_row(str(r["batch"]), str(r["context"]), num(r["decode_ms"], ".3f"), num(r["prefill_ms"], ".3f"),
                     num(step["decode_ms"], ".3f"), num(step["prefill_ms"], ".3f"))
    console.print(rest)
    console.print(f"copy queued in {result['copy_host_us']:.1f} us of host time; dequantizing one expert: "
                  + ", ".join(f"{k} {v:.3f} ms" for k, v in result["dequant_ms"].items())
                  + "; host time of a quantized fetch's dequantization pass: "
                  + ", ".join(f"{k} {v:.0f} us" for k, v in result["dequant_host_us"].items()))
    console.print("host time of each prefill group past a call's first: "
                  + ", ".join(f"{g['us']:.0f} us at {g['tokens']} tokens" for g in result["group_host_by_tokens"]))
    first = result["predictor_ms"][0]
    launch = f", the engine's launch of it {first['launch_host_ms']:.3f} ms" if "launch_host_ms" in first else ""
    pace = result["host_op_us"]
    console.print(f"a predictor call at B={first['batch']}: host {first['host_ms']:.3f} ms{launch}; the host's pace "
                  f"{pace['median']:.1f} us an op ({pace['min']:.1f}-{pace['max']:.1f})")
    console.print(f"profile: {out}")


def _print_bench(result: dict, rounds: bool) -> None:
    bw = result["bandwidth"]
    console.print(f"{result['device']}: copy bandwidth pinned {num(bw['pinned_gbps'], '.1f')} GB/s, "
                  f"pageable {num(bw['pageable_gbps'], '.1f')} GB/s; expert {result['geometry']['expert_mb']:.1f} MB, "
                  f"routing {result['routing']}")
    round_col = ["round"] if rounds else []
    dtypes = len({r["expert_dtype"] for r in result["runs"]}) > 1
    dtype_col = ["experts"] if dtypes else []
    prompts = len(result["prompt_lens"]) > 1
    prompt_col = ["S"] if prompts else []
    latency = table("latency and memory", "policy", *dtype_col, "predictor", "B", *prompt_col, *round_col, "TTFT s",
                    "bound", "TPOT ms", "bound", "peak GB")
    traffic = table("host-to-device copies", "policy", *dtype_col, "predictor", "B", *prompt_col, *round_col,
                    "prefill GB", "decode GB", "decode hits", "stall ms", "pred. ms")
    for r in result["runs"]:
        who = (r["policy"], *([r["expert_dtype"]] if dtypes else []), r["predictor"] or "-", str(r["batch_size"]),
               *([str(r["prompt_len"])] if prompts else []), *([str(r["round"])] if rounds else []))
        latency.add_row(*who, num(r["ttft_s"]), num(r["prefill_bound_s"]), num(r["tpot_ms"], ".2f"),
                        num(r["decode_bound_ms"], ".2f"), gb(r["peak_gpu_bytes"]))
        if "bytes_h2d" in r:
            traffic.add_row(*who, gb(r["bytes_h2d"]["prefill"]), gb(r["bytes_h2d"]["decode"]),
                            num(r["hit_rate"]["decode"]), num(r["stall_ms"], ".0f"), num(r["predictor_ms"], ".0f"))
    console.print(latency)
    console.print(traffic)
    if paces := [r["host_op_us"] for r in result["runs"]]:
        console.print(f"the host's pace over the runs: {min(paces):.1f}-{max(paces):.1f} us a small op (median "
                      f"{statistics.median(paces):.1f}); a host-bound step moves with it (duoserve-eval simulate "
                      "--host-op-us replays a run at its pace)")
    for note in result.get("skipped", []):
        console.print(f"[yellow]not run[/yellow] {note['policy']}: {note['reason']}")
    for note in result.get("notes", []):
        console.print(f"[yellow]note[/yellow]: {note}")
    if result["device"] == "cpu":
        console.print("The CPU stood in for a GPU: bytes, hit rates and correctness carry over, times do not. The "
                      "runtime's targets are GPU targets and are not checked here (docs/runtime.md has the H200's).")
    elif result["targets"]:
        targets = table("targets", "B", *prompt_col, *dtype_col, "predictor", *round_col, "target", "value", "met")
        for t in result["targets"]:
            targets.add_row(str(t["batch_size"]), *([str(t["prompt_len"])] if prompts else []),
                            *([t["expert_dtype"]] if dtypes else []), t["predictor"],
                            *([str(t["round"])] if rounds else []), t["target"], num(t["value"], ".2f"),
                            "yes" if t["met"] else "[red]no[/]")
        console.print(targets)


if __name__ == "__main__":
    app()
