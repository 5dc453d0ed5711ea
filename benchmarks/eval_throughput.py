"""Evaluation throughput on one CPU core: scoring and tabulating 1M token-layer predictions.

    python benchmarks/eval_throughput.py [--predictions 1000000] [--layers 8 --experts 16 --top-k 4]

Synthetic routing (uniformly random, the work does not depend on it) in the embedded model's
geometry. Times, per scorer, the evaluation engine (`hits_at_budgets`: scores, top-b, overlap with
the routed set at 3 budgets) and then `metrics_table` (the per phase / dataset / layer tables). The
trained-MLP row uses the paper's widths; the issue's target is "1M predictions in under a minute".
"""

from __future__ import annotations

import time

import numpy as np
import torch

from duoserve.bench.drivers import random_ids
from duoserve.bench.results import parser, write_result
from duoserve.evaluate import scorers as S
from duoserve.evaluate.accuracy import hits_at_budgets, metrics_table
from duoserve.features.examples import RoutingTable, make_examples
from duoserve.features.stats import stats_from_ids
from duoserve.predictor.model import PAPER_WIDTHS, ExpertPredictor, FeatureSpec
from duoserve.trace.format import TraceMeta


def synthetic_table(tokens: int, L: int, E: int, k: int) -> RoutingTable:
    rng = np.random.default_rng(0)
    ids = random_ids(rng, tokens, L, E, k).astype(np.int16)
    meta = TraceMeta(model="synthetic", num_layers=L, num_experts=E, top_k=k, decoder_indices=list(range(L)),
                     datasets=[], lookahead=1, nextgate_width=k)
    request = np.arange(tokens) // 100
    return RoutingTable(meta, ids, {1: ids[:, 1:].copy()}, {}, request, [("synthetic", int(r)) for r in np.unique(request)],
                        np.arange(tokens) % 100 >= 80, (np.arange(tokens) % 100).astype(np.int32))


def main() -> None:
    ap = parser(__doc__, (8, 16, 4))
    ap.add_argument("--predictions", type=int, default=1_000_000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    L, E, k = args.layers, args.experts, args.top_k
    table = synthetic_table(-(-args.predictions // (L - 1)), L, E, k)
    ev = S.EvalSet(table, make_examples(np.arange(len(table)), L))
    stats = stats_from_ids(table.ids, E)
    pop, aff = torch.from_numpy(stats.popularity), torch.from_numpy(stats.affinity)
    mlp = ExpertPredictor(FeatureSpec(L, E, k, L - 1), PAPER_WIDTHS, 0.1, pop, aff).eval()
    scorers = [S.Popularity(pop), S.AffinityMarkov(aff), S.NextGate(), S.PreviousToken(table, pop), S.Oracle(),
               S.TrainedMLP(mlp)]
    budgets = [k, k + 1, k + 2]
    seconds, hits = {}, {}
    for scorer in scorers:
        t = time.perf_counter()
        hits[scorer.name] = hits_at_budgets(scorer, ev, budgets)
        seconds[scorer.name] = time.perf_counter() - t
        print(f"{scorer.name:16s} {len(ev) / seconds[scorer.name]:12,.0f} predictions/s  "
              f"({seconds[scorer.name]:.1f} s for {len(ev):,})", flush=True)
    t = time.perf_counter()
    metrics_table(hits, ev, budgets)
    seconds["tables (all scorers)"] = time.perf_counter() - t
    baselines = sum(v for n, v in seconds.items() if n != "trained MLP")
    print(f"tables: {seconds['tables (all scorers)']:.1f} s; five baselines + tables: {baselines:.1f} s "
          f"for {len(ev):,} predictions each; the paper-width MLP alone: {seconds['trained MLP']:.1f} s")
    write_result(args.out, {"benchmark": "eval_throughput",
                                        "predictions": len(ev), "geometry": {"L": L, "E": E, "k": k},
                                        "threads": 1, "seconds": seconds})


if __name__ == "__main__":
    main()
