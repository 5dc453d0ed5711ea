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

from duoserve.evaluate.accuracy import AccuracyReport, evaluate_accuracy
from duoserve.evaluate.report import markdown_table
from duoserve.features.examples import load_routing
from duoserve.trace.format import open_trace
from duoserve.train.fit import fit
from duoserve.train.settings import FEATURES, FitSettings

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
            rows.append({"train": train_on, "test": r.dataset, "scorer": r.scorer, "depth": r.depth,
                         "exact_topk": r.exact_topk, "at_least_half": r.at_least_half, "recall": r.recall})
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


def add_studies(report: AccuracyReport, traces: Sequence[Path], work: Path, fit_epochs: int = 3,
                cross: bool = False, fractions: Sequence[float] | None = None,
                progress: Callable[[str], None] | None = None) -> str:
    """Run the cross-task study and/or the learning curve for ``report``'s predictor (fresh fits of its widths,
    history window, dropout, features, family, phase and training settings: lr, weight decay, loss, batch size; in
    ``work``), store their rows in ``report.info`` and return their markdown sections."""
    if not (cross or fractions):
        return ""
    config = report.info["predictor_config"]
    spec, trained = config["feature_spec"], config.get("training", {})
    phase = config.get("training_data", {}).get("phase", "all")
    base = FitSettings(traces=traces, widths=tuple(config["widths"]), epochs=fit_epochs, window=spec["window"],
                       dropout=config["dropout"], phase=None if phase == "all" else phase,
                       features=[f for f in FEATURES if spec[f]], family=spec.get("family", "paper"),
                       lookahead=spec.get("lookahead", 1), progress=False,
                       **{key: trained[key] for key in ("lr", "weight_decay", "loss", "batch_size") if key in trained})
    extra = ""
    if cross:
        ct = cross_task(traces, work, base, progress)
        report.info["cross_task"] = ct.to_dict("records")
        for depth, at in ct.groupby("depth"):
            pivot = at.pivot_table(index=["scorer", "train"], columns="test", values="exact_topk")
            pivot.index = [f"{s} / trained on {t}" for s, t in pivot.index]
            extra += (f"## Cross-task (decode, exact-top-k{f', {depth} layers ahead' if depth > 1 else ''})\n\n"
                      + markdown_table(pivot, "scorer / train") + "\n\n")
    if fractions:
        lc = learning_curve(traces, work, base, fractions, progress)
        report.info["learning_curve"] = lc.to_dict("records")
        pivot = lc.pivot_table(index="train_fraction", columns="scorer", values="exact_topk")
        extra += ("## Learning curve (validation requests, all phases, exact-top-k)\n\n"
                  + markdown_table(pivot, "train fraction") + "\n\n")
    return extra
