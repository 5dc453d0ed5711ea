"""What the decode prefetch's minimum score buys on a replayed trace: the offload simulator (``duoserve-eval
simulate``'s ``Study``) runs ``duoserve`` with a trained predictor at each of ``whatif.MIN_SCORES``, beside ``duoserve``
with no predictor, at each batch size, and prints each point's time per output token against the predictor at
minimum score 0 (the engine's default) and against no predictor, all from one run. Needs no GPU: times are the
profile's (a profile from ``duoserve-run profile`` on the GPU to serve on), bytes and hits the engine's exactly.

    duoserve-train fit benchmarks/data/substrate/traces --family paper --epochs 3 --out PRED
    python benchmarks/simulate_min_score.py --traces benchmarks/data/substrate/traces --predictor PRED \\
        --profile benchmarks/results/simulate_h100_replay_v6/h100-qwen3-30b-a3b-substrate.json \\
        --model-shape qwen3-30b-a3b-substrate --requests 40 --batch-size 1 --batch-size 8 \\
        --out benchmarks/results/simulate_min_score_substrate_h100.json

The embedded model on its own trace (``make demo``'s ``out/traces``), with a paper-family predictor fitted on it:

    duoserve-train fit out/traces --family paper --epochs 4 --out out/validation/embedded-predictor
    python benchmarks/simulate_min_score.py --traces out/traces --predictor out/validation/embedded-predictor \\
        --profile h100-embedded --model-shape embedded --requests 40 \\
        --out benchmarks/results/simulate_min_score_embedded_h100.json
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from duoserve.bench.results import parser, write_result
from duoserve.bench.whatif import MIN_SCORES, SimulateSettings, Study


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__, geometry=None)
    p.add_argument("--traces", type=Path, required=True, help="a trace folder, replayed request by request")
    p.add_argument("--predictor", required=True, help="a trained predictor's artifact folder, fitted on that geometry")
    p.add_argument("--profile", required=True, help="a device profile file or a shipped profile's name")
    p.add_argument("--model-shape", required=True, help="a named shape (duoserve.bench.shapes) or a config")
    p.add_argument("--requests", type=int, default=40, help="replay the trace's first N requests")
    p.add_argument("--batch-size", type=int, action="append", help="repeat; default 1 and 8")
    args = p.parse_args(argv)
    batches = args.batch_size or [1, 8]
    study = Study(SimulateSettings(model_shape=args.model_shape, profile=args.profile, traces=args.traces,
                                   requests=args.requests, predictors=[args.predictor]))
    rows = []
    for B in batches:
        none = study.point("duoserve", "none", B)
        tried = [study.point("duoserve", args.predictor, B, min_score=m) for m in MIN_SCORES]
        for r in [none] + tried:
            rows.append({"batch_size": B, "predictor": "none" if r is none else "trained",
                         "prefetch_min_score": None if r is none else r["prefetch_min_score"],
                         "tpot_p50_ms": r["tpot_ms"]["p50"], "ttft_p50_ms": r["ttft_ms"]["p50"],
                         "decode_bytes": r["bytes_h2d"]["decode"], "decode_hit_rate": r["hit_rate"]["decode"],
                         "prefetched": r["prefetched"], "prefetch_precision": r["prefetch_precision"],
                         "vs_min_score_0": r["tpot_ms"]["p50"] / tried[0]["tpot_ms"]["p50"],
                         "vs_no_predictor": r["tpot_ms"]["p50"] / none["tpot_ms"]["p50"]})
    table = Table(title=f"{args.model_shape} on {study.profile['device']} (simulated, profile version "
                        f"{study.profile['profile_version']}): duoserve's decode by prefetch minimum score")
    # TPOT P50 over the predictor's at min score 0 and over no predictor's; decode bytes, hits, prefetch precision
    for column in ("B", "predictor", "min", "TPOT ms", "/ min 0", "/ none", "dec. GB", "hits", "prec."):
        table.add_column(column, justify="right")
    for r in rows:
        precision = r["prefetch_precision"]
        table.add_row(str(r["batch_size"]), r["predictor"], "-" if r["prefetch_min_score"] is None else
                      f"{r['prefetch_min_score']:g}", f"{r['tpot_p50_ms']:.2f}", f"{r['vs_min_score_0']:.3f}",
                      f"{r['vs_no_predictor']:.3f}", f"{r['decode_bytes'] / 1e9:.1f}", f"{r['decode_hit_rate']:.3f}",
                      "-" if precision is None else f"{precision:.3f}")
    Console().print(table)
    result = {"model_shape": args.model_shape, "profile": args.profile, "device": study.profile["device"],
              "profile_version": study.profile["profile_version"], "traces": str(args.traces),
              "requests": args.requests, "predictor": args.predictor, "rows": rows}
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
