"""Pinning and prediction on real routing, by cache budget, in the offload simulator: time per token, decode bytes
per token and hit rate of lru, duoserve without a predictor and duoserve with a trained one (its prefetch copying
every guess, and only those scored at least 0.5), each with and without the trace's most popular experts pinned.

The larger substrate's trace (16 MoE layers, 64 experts, top-8, Qwen3-30B-A3B's expert widths), replayed request by
request at B=1 on the H200 profile measured for that shape; the pins are the trace's own popularity (the best a
stats file of the same workload can give), as in ``runtime_pinning.py``, whose engine runs give the same bytes and
hit rates on the CPU and measure the time on a GPU. The predictor is history-only, trained on the same trace:

    duoserve-train fit benchmarks/data/substrate/traces --family paper --epochs 4 --out PREDICTOR
    python benchmarks/simulate_pinning.py --predictor PREDICTOR --out benchmarks/results/simulate_pinning_h200.json

Needs no GPU (about 5 minutes on one core).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rich.console import Console
from rich.table import Table

from duoserve.bench.results import parser, write_result
from duoserve.bench.whatif import SimulateSettings, Study
from duoserve.features.stats import compute_stats
from duoserve.runtime.cache import popular_keys
from duoserve.trace.format import open_trace

PROFILE = "benchmarks/results/simulate_h200_v8/h200-qwen3-30b-a3b-substrate.json"
# (policy, predictor given, prefetch minimum score): the rows of each budget and pinning
ROWS = (("lru", False, 0.0), ("duoserve", False, 0.0), ("duoserve", True, 0.0), ("duoserve", True, 0.5))


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__, geometry=None)
    ap.add_argument("--predictor", required=True, help="a history-only predictor artifact trained on the trace")
    ap.add_argument("--traces", type=Path, default=Path("benchmarks/data/substrate/traces"))
    ap.add_argument("--shape", default="qwen3-30b-a3b-substrate", help="the model shape (duoserve.bench.shapes)")
    ap.add_argument("--profile", default=PROFILE, help="a device profile of that shape")
    ap.add_argument("--budgets", default="10%,25%,50%", help="k, 2k or shares of the L x E experts")
    args = ap.parse_args(argv)
    keys = tuple(popular_keys(compute_stats(open_trace(args.traces)).popularity))
    rows = []
    for budget in args.budgets.split(","):
        for pinned in (False, True):
            # one study a budget and pinning: the predictor's scores on the trace are computed once for its rows
            study = Study(SimulateSettings(model_shape=args.shape, profile=args.profile, traces=args.traces,
                                           gpu_expert_budget=budget, pin=keys if pinned else ()))
            for policy, predicted, min_score in ROWS:
                study.s = dataclasses.replace(study.s, prefetch_min_score=min_score)  # a grid point, pins kept
                point = study.point(policy, args.predictor if predicted else "none", 1)
                rows.append({"budget": budget, "pinned": pinned, "predicted": predicted,
                             **{k: point[k] for k in ("policy", "prefetch_min_score", "cache_slots", "pinned_experts",
                                                      "ttft_ms", "tpot_ms", "hit_rate", "stall_ms", "bytes_h2d")},
                             "decode_mb_per_token": point["bytes_h2d"]["decode"] / point["decode_steps"] / 1e6})
    lru = {r["budget"]: r for r in rows if r["policy"] == "lru" and not r["pinned"]}
    table = Table(title=f"{args.traces} on {args.shape}, simulated on {Path(args.profile).stem}, B=1")
    for col in ("budget", "policy", "predictor", "pin", "TPOT ms", "vs lru", "decode MB/token", "vs lru", "hits"):
        table.add_column(col)
    for r in rows:
        ref = lru[r["budget"]]
        r["tpot_vs_lru"] = r["tpot_ms"]["p50"] / ref["tpot_ms"]["p50"]
        r["bytes_vs_lru"] = r["decode_mb_per_token"] / ref["decode_mb_per_token"]
        table.add_row(r["budget"], r["policy"], f">= {r['prefetch_min_score']}" if r["predicted"] else "-",
                      "yes" if r["pinned"] else "-", f"{r['tpot_ms']['p50']:.1f}", f"{r['tpot_vs_lru']:.2f}",
                      f"{r['decode_mb_per_token']:.0f}", f"{r['bytes_vs_lru']:.2f}", f"{r['hit_rate']['decode']:.3f}")
    Console(width=120).print(table)
    result = {"traces": str(args.traces), "shape": args.shape, "profile": args.profile, "predictor": args.predictor,
              "batch_size": 1, "pin_stats": "popularity of the replayed trace itself", "rows": rows}
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
