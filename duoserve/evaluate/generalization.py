"""How far a predictor carries: train on one task and test on the other, and learning curves.

The paper trains one predictor per task on 2.5% of its data; users need to know what a predictor
trained on other traffic, or on fewer traces, is worth. Both studies fit fresh predictors with the
training stage. Cross-task scores decode tokens of each dataset's unseen requests; the learning
curve scores the same held-out validation requests (all phases) for every training share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pandas as pd

from duoserve.evaluate.accuracy import evaluate_accuracy
from duoserve.features.examples import load_routing
from duoserve.trace.format import open_trace
from duoserve.train.fit import FitSettings, fit

CROSS_BASELINES = ("popularity", "affinity", "next-gate")


def cross_task(traces: Sequence[Path], work: Path, base: FitSettings,
               progress: Callable[[str], None] | None = None) -> pd.DataFrame:
    """For each dataset A: fit on A's training requests, score on every dataset's unseen requests."""
    datasets = sorted({d for d, _ in load_routing([open_trace(t) for t in traces]).requests})
    if len(datasets) < 2:
        raise ValueError(f"cross-task evaluation needs traces of two datasets or more, found {datasets}")
    rows = []
    for train_on in datasets:
        if progress:
            progress(f"cross-task: fitting on {train_on}")
        artifact = fit(replace(base, traces=list(traces), out=work / f"fit-{train_on}", datasets=[train_on],
                               progress=False)).out
        report = evaluate_accuracy(traces, artifact, traces, baselines=CROSS_BASELINES)
        t = report.table
        t = t[(t.phase == "decode") & (t.layer == "all") & (t.dataset != "all")]
        for _, r in t.iterrows():
            rows.append({"train": train_on, "test": r.dataset, "scorer": r.scorer, "exact_topk": r.exact_topk,
                         "at_least_half": r.at_least_half, "recall": r.recall})
    return pd.DataFrame(rows)


def learning_curve(traces: Sequence[Path], work: Path, base: FitSettings, fractions: Sequence[float],
                   progress: Callable[[str], None] | None = None) -> pd.DataFrame:
    """Validation accuracy (same held-out requests) against the share of training requests used."""
    rows = []
    for f in sorted(fractions):
        if progress:
            progress(f"learning curve: fitting on {f:.0%} of the training requests")
        result = fit(replace(base, traces=list(traces), out=work / f"fit-{f:g}", train_fraction=f, progress=False))
        for scorer, m in result.metrics.items():
            rows.append({"train_fraction": f, "train_requests": result.info["split"]["train_requests"],
                         "scorer": scorer, **m})
    return pd.DataFrame(rows)
