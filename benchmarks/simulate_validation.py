"""The offload simulator against the engine measured on one GPU: every run of the benches that
benchmarks/simulate_h200.sh made, replayed through ``duoserve.bench.simulate`` on that machine's profile of its
shape (same policy, predictor, cache budget, batch, prompt, tokens and routing source; a random draw is not
the same draw, a replayed trace is the same rows), and simulated TTFT and time per output token set beside
the measured ones. Needs no GPU.

    python benchmarks/simulate_validation.py --profiles benchmarks/results/simulate_h200_v4_profiles \\
        --out benchmarks/results/simulate_validation_h200.json
    python benchmarks/simulate_validation.py --machine h100 --out benchmarks/results/simulate_validation_h100.json

Each row carries the host's pace (``host_op_us``, microseconds per small op) during its runs and during its
profile, where the profile recorded it: host-bound rows move with it; and the host milliseconds of the timed
generation in each of the engine's host sections, measured (the bench's ``host_ms``, median of the rounds) and
simulated (``Simulator(sections=True)``: the same sections on the simulated clock), so a row that misses shows
whether its host or its device side is off (the table: simulated over measured, all sections and the queueing of
fetches and compute). Where the profile recorded its pace, each point is simulated at its runs' (``Costs``'
``host_op_us``; ``--no-pace``: at the profile's), and every row also keeps the simulation at the profile's pace
(``unpaced``). ``--round i``: each profile's engine host costs of its round i alone (``engine_rounds``, version 5
profiles), not the rounds' medians: what a single-round profile would have given. ``--no-layer-split``: a
version 9 profile's decode layers simulated as older profiles' were (their kernels running as the host launches
them), not launched at once after the host's work before the experts call.
``--machine`` picks the files: the benches ``simulate_bench_*_{machine}.json`` and the shipped profiles
``{machine}-*`` (simulate_h200.sh names them h200; a run that landed on an H100 is renamed to h100). The shipped
H200 profiles come from a later instance than the benches in ``benchmarks/results/`` (their own benches are in
``simulate_h200_v8/``); the version 4 profiles made beside those are in ``simulate_h200_v4_profiles/``.
Skipped, each with its reason (on screen and under ``skipped``): a bench whose trace or profile is not here, and a
run whose trained predictor is not here (simulate_h200.sh's header gives the commands that trained them) or reads
the next-gate (on a replayed trace the engine fed it other tokens' guesses).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from duoserve.bench.drivers import RandomRouting, ReplayRouting, is_artifact
from duoserve.bench.profile import profile_round
from duoserve.bench.results import parser, write_result
from duoserve.bench.costs import Costs, resolve_profile
from duoserve.bench.simulate import ModelShape, Simulator, bench_passes, run
from duoserve.predictor.artifact import predictor_spec
from duoserve.runtime.policies import POLICIES
from duoserve.runtime.settings import EngineSettings

RESULTS = Path(__file__).parent / "results"
TOLERANCE = 0.10
# bench (simulate_bench_{name}_{machine}.json) -> (model shape, the trace it replayed: where simulate_h200.sh found
# it); its profile is the shipped {machine}-{shape}
BENCHES = {
    "qwen3-30b-a3b": ("qwen3-30b-a3b", None),
    "qwen3-30b-a3b_2gb": ("qwen3-30b-a3b", None),
    "embedded": ("embedded", "out/traces"),
    "qwen3-30b-a3b-substrate": ("qwen3-30b-a3b-substrate", "benchmarks/data/substrate/traces"),
    "qwen3-30b-a3b-flame": ("qwen3-30b-a3b-flame", "out/validation/flame-trace"),
}


def simulate_run(bench: dict, r: dict, shape: ModelShape, costs: Costs, trace: str | None) -> dict:
    """One bench run simulated: its warm-up and timed generation on a fresh engine, as the bench ran them."""
    budget = bench["gpu_expert_budget"]
    if budget is None and r.get("cache_slots"):  # the cache the run had: the default is not the same in every version
        budget = r["cache_slots"] * shape.layout.nbytes
    # a bench file from before the deferred decode prefetch ran it within the layer call
    settings = EngineSettings(gpu_expert_budget=budget, lookahead=bench["lookahead"],
                              prefetch_min_score=bench["prefetch_min_score"],
                              defer_prefetch=bench.get("defer_prefetch", False))
    L, E, k = shape.num_layers, shape.num_experts, shape.top_k
    routing = ReplayRouting(trace, L, E, k) if trace else RandomRouting(L, E, k, seed=0)
    predictor = r["predictor"] or "none"
    sim = Simulator(shape, costs, POLICIES[r["policy"]], predictor, settings, r.get("expert_dtype", "model"),
                    sections=True)
    return run(sim, bench_passes(routing, r["batch_size"], r["prompt_len"], r["new_tokens"]))


def unreplayable(predictor: str | None, trace: str | None) -> str | None:
    """Why a bench run's trained predictor cannot be replayed here, or None: it is not here, or it reads the
    next-gate on a replayed trace, where the engine computed it from its own prompts' hidden states, not the
    trace's tokens, so no simulation can replay those guesses."""
    if not predictor or not is_artifact(predictor):
        return None
    try:
        spec = predictor_spec(predictor)
    except FileNotFoundError:
        return f"no predictor at {predictor} (simulate_h200.sh's header says how it was trained)"
    if trace and spec.uses_nextgate:
        return f"{predictor} reads the next-gate, which a replayed trace's engine takes from other tokens"
    return None


def compare(simulated: dict, measured: dict) -> tuple[dict, dict, bool]:
    """A simulation's TTFT and time per token (means), their ratios to the measured ones, and whether all are
    within the tolerance."""
    sim = {key: simulated[key]["mean"] for key in measured}
    ratio = {key: sim[key] / measured[key] for key in measured}
    return sim, ratio, all(abs(v - 1) <= TOLERANCE for v in ratio.values())


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__, geometry=None)
    p.add_argument("--results", type=Path, default=RESULTS, help="where the bench files are")
    p.add_argument("--machine", default="h200", choices=("h200", "h100"), help="which GPU's benches and profiles")
    p.add_argument("--profiles", type=Path, default=None,
                   help="a folder of {machine}-{shape}.json profiles to use instead of the shipped ones")
    p.add_argument("--pace", action=argparse.BooleanOptionalAction, default=True,
                   help="simulate each point at its runs' host pace where its profile recorded its own (default); "
                        "every row also carries the simulation at the profile's pace (unpaced)")
    p.add_argument("--round", type=int, default=None,
                   help="each profile's engine costs of this round alone (engine_rounds), not the rounds' medians")
    p.add_argument("--layer-split", action=argparse.BooleanOptionalAction, default=True,
                   help="launch a step-graphed decode layer's kernels once its host work before its experts call is "
                        "done, where the profile timed that part (version 9; default); --no-layer-split: over its "
                        "whole host time, as before")
    args = p.parse_args(argv)
    rows, skipped = [], []
    for bench_name, (spec, trace) in BENCHES.items():
        name, profile_name = f"simulate_bench_{bench_name}_{args.machine}.json", f"{args.machine}-{spec}"
        path = args.results / name
        if not path.exists():
            print(f"skipping {name}: not found", file=sys.stderr)
            continue
        if trace and not Path(trace).exists():
            print(f"skipping {name}: its trace {trace} is not here (simulate_h200.sh says how it was made)",
                  file=sys.stderr)
            continue
        bench = json.loads(path.read_text())
        try:
            profile = resolve_profile(args.profiles / f"{profile_name}.json" if args.profiles else profile_name)
        except FileNotFoundError as err:
            print(f"skipping {name}: {err}", file=sys.stderr)
            skipped.append({"bench": name, "why": str(err)})
            continue
        if args.round is not None:
            profile = profile_round(profile, args.round)
        if not args.layer_split:  # as a profile before version 9: every layer launched over its whole host time
            profile = {**profile, "layer_ms": [{key: v for key, v in row.items() if not key.endswith("_before_ms")}
                                               for row in profile["layer_ms"]]}
        layers = bench["geometry"]["moe_layers"] if bench["config_only"] else None
        shape = ModelShape.of(spec, layers, bench["dtype"].removeprefix("torch."))
        try:  # a profile applies to the dtype it was measured in
            shape.check(profile)
        except ValueError as err:
            print(f"skipping {name}: {err}", file=sys.stderr)
            skipped.append({"bench": name, "why": str(err)})
            continue
        profile_pace = profile.get("host_op_us", {}).get("median")  # profiles before the gauge lack it
        paced = args.pace and profile_pace is not None
        rounds: dict[tuple, list[dict]] = {}  # a bench of several rounds: the median of each point's rounds
        for r in bench["runs"]:
            point = (r["policy"], r["predictor"], r.get("expert_dtype", "model"), r["batch_size"], r["prompt_len"])
            rounds.setdefault(point, []).append(r)
        for runs in rounds.values():
            r = runs[0]
            if why := unreplayable(r["predictor"], trace):
                print(f"skipping {name} {r['policy']} B={r['batch_size']}: {why}", file=sys.stderr)
                skipped.append({"bench": name, "policy": r["policy"], "batch_size": r["batch_size"], "why": why})
                continue
            pace = {"runs": statistics.median(x["host_op_us"] for x in runs), "profile": profile_pace}
            measured = {"ttft_ms": statistics.median(x["ttft_s"] for x in runs) * 1e3,
                        "tpot_ms": statistics.median(x["tpot_ms"] for x in runs)}
            unpaced = simulate_run(bench, r, shape, Costs(profile), trace)
            simulated = simulate_run(bench, r, shape, Costs(profile, pace["runs"]), trace) if paced else unpaced
            sim, ratio, within = compare(simulated, measured)
            rows.append({"bench": name, "rounds": len(runs), "policy": r["policy"], "predictor": r["predictor"],
                         "expert_dtype": r.get("expert_dtype", "model"), "batch_size": r["batch_size"],
                         "prompt_len": r["prompt_len"], "measured": measured,
                         "simulated": sim, "ratio": ratio, "within": within, "host_op_us": pace, "paced": paced,
                         "unpaced": dict(zip(("simulated", "ratio", "within"), compare(unpaced, measured))),
                         "host_ms": {"measured": _median_sections(runs), "simulated": simulated["host_ms"]},
                         "bytes_h2d": {"measured": r["bytes_h2d"], "simulated": simulated["bytes_h2d"]},
                         "hit_rate": {"measured": r["hit_rate"], "simulated": simulated["hit_rate"]}})
    table = Table(title=f"simulated / measured on the {args.machine.upper()} (within {TOLERANCE:.0%})")
    for col in ("bench", "policy", "predictor", "B", "TTFT ms", "sim", "ratio", "TPOT ms", "sim", "ratio", "ok",
                "host us/op run/prof.", "host sections sim/run"):
        table.add_column(col)
    for row in rows:
        m, s, q = row["measured"], row["simulated"], row["ratio"]
        name = row["bench"].removeprefix("simulate_bench_").removesuffix(f"_{args.machine}.json")
        policy = row["policy"] + ("" if row["expert_dtype"] == "model" else f" ({row['expert_dtype']})")
        table.add_row(name, policy, str(row["predictor"] or "-"), str(row["batch_size"]), f"{m['ttft_ms']:.1f}",
                      f"{s['ttft_ms']:.1f}", f"{q['ttft_ms']:.2f}", f"{m['tpot_ms']:.2f}", f"{s['tpot_ms']:.2f}",
                      f"{q['tpot_ms']:.2f}", "yes" if row["within"] else "no", _pace(row["host_op_us"]),
                      _sections(row["host_ms"]))
    Console().print(table)
    held, held_unpaced = sum(row["within"] for row in rows), sum(row["unpaced"]["within"] for row in rows)
    print(f"{held} of {len(rows)} rows within {TOLERANCE:.0%}; {held_unpaced} at the profiles' own host pace")
    result = {"machine": args.machine, "tolerance": TOLERANCE, "pace": args.pace, "round": args.round, "rows": rows,
              "held": held, "held_unpaced": held_unpaced, "skipped": skipped}
    write_result(args.out, result)
    return result


def _median_sections(runs: list[dict]) -> dict[str, float]:
    """The engine's host milliseconds per section over a point's timed generations, the median of its rounds."""
    names = sorted({name for r in runs for name in r["host_ms"]})
    return {name: statistics.median(r["host_ms"].get(name, 0.0) for r in runs) for name in names}


def _sections(host_ms: dict) -> str:
    """The simulated host time in the engine's sections over the measured, all sections and the two that queue work
    (fetches, compute): where a row's error lies, host or device."""
    def ratio(names) -> str:
        measured = sum(host_ms["measured"].get(n, 0.0) for n in names)
        return f"{sum(host_ms['simulated'].get(n, 0.0) for n in names) / measured:.2f}" if measured else "-"
    return f"{ratio(host_ms['measured'])} ({ratio(('queue fetches', 'queue compute'))})"


def _pace(pace: dict) -> str:
    """The host's pace during a point's runs and during its profile: a row off by a host that drifted shows it."""
    profile = "-" if pace["profile"] is None else f"{pace['profile']:.1f}"
    return f"{pace['runs']:.1f}/{profile}"


if __name__ == "__main__":
    main()
