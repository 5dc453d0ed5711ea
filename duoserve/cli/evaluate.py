"""duoserve-eval: how well a predictor knows the next layer's experts, against the baselines (stage 4)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from duoserve.cli.common import (ENGINE, BudgetOption, DeferPrefetchOption, MinScoreOption, PinOption, console, gb,
                                 int_list, new_app, num, pin_keys, progress, table, user_errors)
from duoserve.evaluate.accuracy import BASELINES
from duoserve.files import check_output

app = new_app("How well a predictor knows the next layer's experts, against the baselines (stage 4).")


def _print_overall(report) -> None:
    for phase in ("decode", "prefill"):
        overall = report.overall(phase)
        if overall.empty:
            continue
        summary = table(f"{phase} tokens ({int(overall['examples'].iloc[0])} token-layer predictions)", "scorer",
                        "exact-top-k", "at-least-half", "recall", *(f"recall@{b}" for b in report.budgets[1:]))
        for name, row in overall.iterrows():
            summary.add_row(f"[bold]{name}[/]" if name == "trained MLP" else name, f"{row.exact_topk:.3f}",
                            f"{row.at_least_half:.3f}", f"{row.recall:.3f}",
                            *(f"{row[f'recall@{b}']:.3f}" for b in report.budgets[1:]))
        console.print(summary)


@app.command()
def accuracy(
    traces: Annotated[list[Path], typer.Argument(help="Trace folder(s) to evaluate on (requests the predictor "
                                                      "was trained on are skipped).")],
    predictor: Annotated[Path, typer.Option(help="Predictor artifact folder (duoserve-train fit).")],
    out: Annotated[Path, typer.Option(help="Report folder: report.json, report.md, plots.")] = Path("report"),
    train_traces: Annotated[Optional[list[Path]], typer.Option(
        help="Traces the predictor was trained on (for the baselines). [default: those in its config.json]")] = None,
    baseline: Annotated[Optional[list[str]], typer.Option(
        help=f"Baselines to include (repeatable). [default: all: {', '.join(BASELINES)}]")] = None,
    extra_budget: Annotated[str, typer.Option(help="Extra experts fetched beyond k, comma-separated.")] = "1,2",
    depth: Annotated[Optional[int], typer.Option(
        min=1, help="Also score look-ahead depths 2..D (layer l+d predicted when layer l runs): the predictor's "
                    "heads up to its own depth, and popularity, affinity-Markov and next-gate (as deep as the trace "
                    "recorded it). [default: the predictor's depth]")] = None,
    cross_task: Annotated[bool, typer.Option(help="Also fit per dataset and test on the others.")] = False,
    learning_curve: Annotated[Optional[str], typer.Option(
        help="Also fit on these shares of the training requests, e.g. 0.1,0.25,0.5,1.")] = None,
    fit_epochs: Annotated[int, typer.Option(min=1, help="Epochs of the extra fits (cross-task, learning curve).")]
    = 3,
    fits_dir: Annotated[Optional[Path], typer.Option(
        help="Keep the extra fits' predictors in this folder. [default: a temporary folder, removed after]")] = None,
    simulate: Annotated[Optional[str], typer.Option(
        help="A device profile (a file or a shipped one, e.g. h200-qwen3-30b-a3b): add what each scorer buys, its "
             "simulated time per token replaying the first traces' requests (duoserve-eval simulate; the trained "
             "predictor also at its best prefetch minimum score; a baseline simulated as an oracle of its recall); "
             "writes whatif.json.")] = None,
    model_shape: Annotated[Optional[str], typer.Option(
        help="With --simulate: the model shape. [default: the trace's model]")] = None,
    simulate_requests: Annotated[int, typer.Option(min=1, help="With --simulate: requests replayed.")] = 40,
) -> None:
    """Accuracy of PREDICTOR and every baseline on unseen requests; writes report.json, report.md and plots."""
    import tempfile

    from duoserve.evaluate.accuracy import evaluate_accuracy
    from duoserve.evaluate.generalization import add_studies
    from duoserve.evaluate.report import check_report_dir, write_report

    with user_errors(), tempfile.TemporaryDirectory(prefix="duoserve-fits-") as scratch:
        check_report_dir(out)
        if fits_dir is not None:
            check_output(fits_dir, folder=True)
        budgets = int_list(extra_budget, "--extra-budget")
        fractions = [float(f) for f in learning_curve.split(",")] if learning_curve else None
        with progress("evaluating") as update:
            say = lambda text: update(description=text)  # noqa: E731
            report = evaluate_accuracy(traces, predictor, train_traces, baseline or BASELINES, budgets, say, depth)
            extra = add_studies(report, traces, fits_dir or Path(scratch), fit_epochs, cross_task, fractions, say)
            if extra:
                report.info["fits"] = str(fits_dir) if fits_dir else "discarded (--fits-dir keeps them)"
            say("writing the report")
            write_report(report, out, report.stats, extra)
            buys = _what_it_buys(report, traces[0], predictor, simulate, model_shape, simulate_requests, out, say) \
                if simulate else None
    _print_overall(report)
    if buys:
        ranked = table(f"what it buys on {buys['device']}: {buys['model_shape']}, B=1, simulated", "scorer",
                       "decode recall", "simulated as", "TPOT P50 ms", "decode GB", "decode hits")
        for r in buys["rows"]:
            ranked.add_row(r["scorer"], num(r["recall"]), Path(r["simulated_as"]).name, num(r["tpot_p50_ms"], ".2f"),
                           gb(r["decode_bytes"]), num(r["decode_hit_rate"]))
        console.print(ranked)
    console.print(f"report: {out / 'report.md'}, {out / 'report.json'}, plots {', '.join(report.info['plots'])}")


def _what_it_buys(report, trace: Path, predictor: Path, profile: str, shape: str | None, requests: int, out: Path,
                  say) -> dict:
    """The scorers of ``report`` ranked by simulated time per token (``whatif.json`` in the report folder)."""
    from duoserve.bench.results import write_result
    from duoserve.bench.costs import resolve_profile
    from duoserve.bench.whatif import SimulateSettings, what_it_buys
    from duoserve.trace.format import open_trace

    say("simulating what each scorer buys")
    shape = shape or open_trace(trace).meta.model
    recalls = report.overall("decode")["recall"].to_dict()
    s = SimulateSettings(model_shape=shape, profile=profile, traces=trace, requests=requests)
    result = {"model_shape": shape, "profile": profile, "device": resolve_profile(profile)["device"],
              "traces": str(trace), "requests": requests, "rows": what_it_buys(s, recalls, str(predictor))}
    write_result(out / "whatif.json", result)
    return result


@app.command()
def report(folder: Annotated[Path, typer.Argument(help="Report folder written by duoserve-eval accuracy.")]) -> None:
    """Print the summary tables of a saved report."""
    from duoserve.evaluate.accuracy import load_report

    with user_errors():
        saved = load_report(folder)
    info = saved.info
    console.print(f"[bold]{folder}[/]: predictor {info['predictor']}, {info['evaluated_requests']} unseen requests, "
                  f"{info['examples']} token-layer predictions")
    _print_overall(saved)


@app.command()
def health(trace: Annotated[Path, typer.Argument(help="Trace folder.")]) -> None:
    """Is the routing worth predicting? Per-layer load, task dependence, affinity predictability."""
    from duoserve.evaluate.health import routing_health
    from duoserve.trace.format import open_trace

    with user_errors():
        h = routing_health(open_trace(trace))
    summary = table(f"routing health of {trace}", "figure", "value")
    summary.add_row("experts used (worst layer)", f"{h['min_experts_used']}/{h['num_experts']}")
    summary.add_row("max load / uniform (worst layer)", f"{h['max_over_uniform']:.2f}")
    if "task_tv_per_layer" in h:
        tv = h["task_tv_per_layer"]
        summary.add_row("task total-variation per layer",
                        f"{min(tv):.3f}-{max(tv):.3f} (mean {sum(tv) / len(tv):.3f})")
    a = h["affinity"]
    summary.add_row(f"affinity, {h['affinity_decode_tokens']} odd-request decode tokens",
                    f"exact {a['exact_topk']:.3f}, at-least-half {a['at_least_half']:.3f}" if a else "n/a (none)")
    summary.add_row("random choice, at-least-half", f"{h['random_at_least_half']:.3f}")
    console.print(summary)


if __name__ == "__main__":
    app()


@app.command()
def simulate(
    profile: Annotated[str, typer.Option(
        help="Device profile: a file from duoserve-run profile, or a shipped one (h200-qwen3-30b-a3b, "
             "h200-embedded).")],
    model_shape: Annotated[str, typer.Option(
        help="The model: qwen3-30b-a3b, mixtral-8x7b, embedded, or a config (hub id, local path).")],
    traces: Annotated[Optional[Path], typer.Option(
        help="Trace folder to replay request by request. [default: uniform random routing]")] = None,
    predictor: Annotated[Optional[list[str]], typer.Option(
        help="Repeatable, for the predicting policies: none, oracle[:RECALL] or an artifact folder (its real "
             "predictions on the replayed tokens). [default: none, oracle]")] = None,
    policy: Annotated[Optional[list[str]], typer.Option(
        help="Repeatable: duoserve, on-demand, lru, full-layer, per-module. [default: duoserve, on-demand, lru]")]
    = None,
    batch_size: Annotated[Optional[list[int]], typer.Option(
        min=1, help="Repeatable: consecutive requests served together. [default: 1]")] = None,
    gpu_expert_budget: BudgetOption = None,
    pin: PinOption = None,
    lookahead: Annotated[int, typer.Option(min=1, help="Decode prefetch depth d (layers ahead).")] = 1,
    prefetch_min_score: MinScoreOption = ENGINE.prefetch_min_score,
    defer_prefetch: DeferPrefetchOption = ENGINE.defer_prefetch,
    expert_dtype: Annotated[str, typer.Option(help="Host experts stored as model, fp8 or int4.")] = "model",
    layers: Annotated[Optional[int], typer.Option(min=2, help="Keep this many decoder layers of the shape.")] = None,
    dtype: Annotated[str, typer.Option(help="The model's dtype (the profile's: bfloat16 on a GPU).")] = "bfloat16",
    requests: Annotated[Optional[int], typer.Option(
        min=1, help="Only the trace's first N requests (random routing: N generations). [default: all; 4]")] = None,
    prompt_len: Annotated[int, typer.Option(min=1, help="Random routing: prompt tokens.")] = 512,
    new_tokens: Annotated[int, typer.Option(min=2, help="Random routing: tokens generated.")] = 32,
    host_op_us: Annotated[Optional[float], typer.Option(
        min=0.01, help="Simulate a host of this pace, microseconds per small op (duoserve-run profile prints its "
                       "own): host-side costs scale from the profile's. [default: the profile's host]")] = None,
    charts: Annotated[bool, typer.Option(
        help="Also run the sweeps of the charts (accuracy, cache budget, look-ahead, batch, each trained predictor's "
             "prefetch minimum score) and draw them.")] = True,
    out: Annotated[Path, typer.Option(help="Folder: simulate.json and the charts (PNG).")] = Path("sim"),
) -> None:
    """What each policy and predictor buys on a device: replays traces (or random routing) through the runtime's
    own schedule on a device profile's costs; TTFT, time per token, bytes moved, stalls, hit rate, peak expert
    memory."""
    from duoserve.bench.results import write_result
    from duoserve.bench.whatif import SimulateSettings, simulate as run_simulation
    from duoserve.runtime.settings import parse_budget

    with user_errors():
        check_output(out, folder=True)
        s = SimulateSettings(model_shape=model_shape, profile=profile, traces=traces, layers=layers, dtype=dtype,
                             policies=policy or ["duoserve", "on-demand", "lru"],
                             predictors=predictor or ["none", "oracle"], batch_sizes=batch_size or [1],
                             gpu_expert_budget=parse_budget(gpu_expert_budget) if gpu_expert_budget else None,
                             pin=pin_keys(pin), lookahead=lookahead, prefetch_min_score=prefetch_min_score,
                             defer_prefetch=defer_prefetch, expert_dtype=expert_dtype, requests=requests,
                             prompt_len=prompt_len, new_tokens=new_tokens, host_op_us=host_op_us)
        with progress("simulating") as update:
            result = run_simulation(s, out if charts else None,
                                    lambda done, total, what: update(completed=done, total=total, description=what))
        write_result(out / "simulate.json", result)  # with the commit, machine and command
    layers = "step-graphed" if result["step_graphs"] else "eager (--no-step-graphs)"
    paced = f"; host at {host_op_us:g} us an op ({result['host_scale']:.2f}x the profile's)" if host_op_us else ""
    summary = table(f"{model_shape} ({result['layers']} MoE layers) on {result['device']}, simulated: "
                    f"{result['routing']}; decode layers {layers}, as the profile measured them{paced}; TTFT and TPOT in "
                    "ms, P50/P95; GB moved, decode hit rate, stall ms, expert cache GB", "policy", "predictor", "B",
                    "TTFT", "TPOT", "GB", "hits", "stall", "cache")
    summary.show_edge = summary.pad_edge = False  # nine columns in an 80-column terminal
    for r in result["rows"]:
        name = "-" if r["predictor"] is None else Path(r["predictor"]).name
        summary.add_row(r["policy"], name, str(r["batch_size"]),
                        *(f"{num(r[key]['p50'], '.1f')}/{num(r[key]['p95'], '.1f')}" for key in ("ttft_ms", "tpot_ms")),
                        gb(sum(r["bytes_h2d"].values())), num(r["hit_rate"]["decode"], ".2f"),
                        num(r["stall_ms"], ".0f"), gb(r["peak_expert_bytes"]))
    console.print(summary)
    for note in result["notes"]:
        console.print(f"[yellow]note[/yellow]: {note}")
    for best in result.get("best_min_score", []):
        none, ms = best["no_predictor_tpot_p50_ms"], best["tpot_p50_ms"]
        head = (f"prefetch minimum score: {Path(best['predictor']).name} at B={best['batch_size']} is fastest at "
                f"{best['min_score']:g} ({ms:.2f} ms a token; {best['lowest_tpot_p50_ms']:.2f} at "
                f"{best['lowest_min_score']:g})")
        if none is not None and none < ms:
            console.print(f"{head}, but {none:.2f} with no predictor: on this profile its prefetch does not pay")
        else:
            console.print(f"{head}: duoserve-run generate --prefetch-min-score {best['min_score']:g}")
    console.print(f"results: {out / 'simulate.json'}"
                  + (f"; charts: {', '.join(str(out / c) for c in result['charts'])}" if charts else ""))
