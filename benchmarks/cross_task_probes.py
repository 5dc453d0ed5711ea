"""What a predictor fitted on one task learns that does not carry to another: three probes, decode tokens, d = 1.

    python benchmarks/cross_task_probes.py out/families/traces --family hybrid \\
        --out benchmarks/results/cross_task_probes_embedded_cpu.json

On a trace of two tasks with next-gate scores (``duoserve-trace collect --lookahead 1`` or deeper), for each task A:
the family is fitted on A's training requests alone (``--epochs``, as ``duoserve-eval accuracy --cross-task`` refits
it), once with the whole history window and once with ``--short-window`` layers, and each task's held-out requests
(the fit's own validation split) are scored:

  own stats    the fitted artifact as it is
  swapped      the same weights with the test task's popularity and affinity (from its training requests) in place of
               A's: a model that read its statistics as features would carry to a task whose statistics it is given
  next-gate    the router's guess (no training), the bar a trained family has to clear
  request      next-gate's log-probabilities plus ``--alpha`` x log(f + 0.1), f the share of each expert among the
               routing of the request's own earlier tokens (prompt included) at the target layer: a prior that is the
               test request's own, with no training

Needing no training, next-gate and the request prior are also scored on the decode tokens of every request of each
task (``training_free``): a sample ten times the held-out one.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import numpy as np
import torch

from duoserve.bench.results import parser, write_result
from duoserve.evaluate import scorers as S
from duoserve.evaluate.accuracy import hits_at_budgets
from duoserve.features.examples import RoutingTable, load_routing, make_examples, split_requests
from duoserve.features.stats import stats_from_ids
from duoserve.predictor.artifact import load_predictor
from duoserve.predictor.model import TIE_BREAK
from duoserve.trace.format import open_trace
from duoserve.train.fit import fit
from duoserve.train.settings import FitSettings

PRIOR_FLOOR = 0.1  # added to a request's expert share before its log: unseen experts are not ruled out


def request_counts(table: RoutingTable) -> np.ndarray:
    """N x L x E: per token, how often each expert was routed to at each layer by its request's earlier tokens."""
    counts = np.zeros((len(table), table.meta.num_layers, table.meta.num_experts), dtype=np.float32)
    for r in np.unique(table.request):
        tokens, _, before = S.request_routing(table, r)
        counts[tokens] = before.numpy()
    return counts


class RequestPrior(S.Scorer):
    """next-gate's log-probabilities plus ``alpha`` x log(share + floor) of the request's earlier routing."""

    name = "request prior"

    def __init__(self, counts: np.ndarray, alpha: float):
        self.counts, self.alpha = counts, alpha  # counts: N x L x E, rows of the scored table

    def scores(self, ev, idx):
        b = ev.batch(idx)
        logp = torch.full((len(idx), ev.E), np.log(1e-6) - 1.0)  # B x E: floor where the router kept no score
        position = torch.arange(b["nextgate"].shape[1]) * TIE_BREAK  # m: equal (float16) scores keep its order
        logp.scatter_(1, b["nextgate"].long(), b["nextgate_scores"].float().clamp_min(1e-6).log() - position)
        c = torch.from_numpy(self.counts[ev.examples.token[idx], ev.examples.target[idx]])  # B x E
        share = c / c.sum(1, keepdim=True).clamp_min(1.0)
        return logp + self.alpha * (share + PRIOR_FLOOR).log()


def exact(scorer: S.Scorer, ev: S.EvalSet) -> float:
    return float((hits_at_budgets(scorer, ev, [ev.k])[:, 0] == ev.k).mean())


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__, geometry=None)
    p.add_argument("traces", type=Path)
    p.add_argument("--family", default="hybrid")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--short-window", type=int, default=1)
    p.add_argument("--alpha", type=float, default=0.2)
    args = p.parse_args(argv)
    table = load_routing([open_trace(args.traces)], lookahead=1)
    L, E = table.meta.num_layers, table.meta.num_experts
    val = split_requests(table.requests, 0.1, 0)[table.request]  # N: the fits' own validation split
    task = np.array([d for d, _ in table.requests])[table.request]  # N
    tasks = sorted(set(task))
    counts = request_counts(table)
    held_out = {t: np.flatnonzero(val & table.decode & (task == t)) for t in tasks}
    evals = {t: S.EvalSet(table.select(rows), make_examples(np.arange(len(rows)), L)) for t, rows in held_out.items()}
    stats = {t: stats_from_ids(table.ids[~val & (task == t)], E) for t in tasks}
    training_free = {}
    for t in tasks:
        every = np.flatnonzero(table.decode & (task == t))
        ev = S.EvalSet(table.select(every), make_examples(np.arange(len(every)), L))
        training_free[t] = {"tokens": len(every), "next_gate": exact(S.NextGate(), ev),
                            "request_prior": exact(RequestPrior(counts[every], args.alpha), ev)}
        print(f"every request of {t}: next-gate {training_free[t]['next_gate']:.3f}, request prior "
              f"{training_free[t]['request_prior']:.3f} ({len(every)} decode tokens)")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for window in (None, args.short_window):
            for train_on in tasks:
                out = Path(work) / f"fit-{train_on}-{window}"
                fit(FitSettings(traces=[args.traces], out=out, datasets=[train_on], family=args.family,
                                window=window, epochs=args.epochs, progress=False, clean=True))
                own = load_predictor(out)
                for test_on, ev in evals.items():
                    swapped = copy.deepcopy(own)
                    swapped.popularity.copy_(torch.from_numpy(stats[test_on].popularity))
                    swapped.affinity.copy_(torch.from_numpy(stats[test_on].affinity))
                    row = {"window": window or L - 1, "train": train_on, "test": test_on, "tokens": len(held_out[test_on]),
                           "own_stats": exact(S.TrainedMLP(own), ev), "swapped_stats": exact(S.TrainedMLP(swapped), ev),
                           "next_gate": exact(S.NextGate(), ev),
                           "request_prior": exact(RequestPrior(counts[held_out[test_on]], args.alpha), ev)}
                    rows.append(row)
                    print(f"window {row['window']:>2}, {args.family} fitted on {train_on}, tested on {test_on}: "
                          f"exact-top-k {row['own_stats']:.3f} (its stats), {row['swapped_stats']:.3f} (the test "
                          f"task's), next-gate {row['next_gate']:.3f}, request prior {row['request_prior']:.3f}")
    result = {"traces": str(args.traces), "family": args.family, "epochs": args.epochs, "alpha": args.alpha,
              "rows": rows, "training_free": training_free}
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
