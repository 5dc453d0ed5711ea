"""Accuracy of a trained predictor and every baseline on the requests it was not trained on.

Shape legend: M examples (token, target layer, depth), B a chunk, E experts, k top-k, nb budgets.

Metrics per scorer, overall and per phase, dataset and layer: exact-top-k, at-least-half and
recall@k, plus recall and precision when b = k + m experts are fetched. Every baseline is scored
one layer ahead (depth 1); the predictor's deeper heads, and the baselines that can look further
(popularity, affinity-Markov, next-gate where the trace recorded it, the oracle), at depths 2..D too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from duoserve.evaluate import scorers as S
from duoserve.features.examples import load_routing, make_examples
from duoserve.features.stats import RoutingStats, stats_from_ids
from duoserve.files import write_json
from duoserve.metrics import overlap
from duoserve.predictor.artifact import load_predictor, trained_requests
from duoserve.trace.format import open_trace

BASELINES = ("popularity", "affinity", "activation-matrix", "next-gate", "previous-token", "logistic", "oracle")
DEEP_SCORERS = ("trained MLP", "popularity", "affinity-Markov", "next-gate", "oracle")  # scored at depths > 1 too


@dataclass
class AccuracyReport:
    table: pd.DataFrame  # one row per (scorer, depth, phase, dataset, layer) group; "all" where aggregated
    budgets: list[int]
    info: dict = field(default_factory=dict)
    stats: RoutingStats | None = None  # the baselines' statistics (not saved in report.json)

    def at_depth(self, depth: int = 1) -> pd.DataFrame:
        """The rows of one look-ahead depth (a report without depths is depth 1)."""
        t = self.table
        return t[t.depth == depth] if "depth" in t else t

    def overall(self, phase: str = "decode", depth: int = 1) -> pd.DataFrame:
        t = self.at_depth(depth)
        return t[(t.phase == phase) & (t.dataset == "all") & (t.layer == "all")].set_index("scorer")

    @property
    def depths(self) -> list[int]:
        return sorted(self.table.depth.unique().tolist()) if "depth" in self.table else [1]

    def to_json(self) -> dict:
        return {"info": self.info, "budgets": self.budgets, "rows": self.table.to_dict("records")}


def hits_at_budgets(scorer: S.Scorer, ev: S.EvalSet, budgets: Sequence[int], chunk: int = 8192) -> np.ndarray:
    """M x nb: routed experts among the scorer's top-b, for each budget b."""
    out = np.zeros((len(ev), len(budgets)), dtype=np.int16)
    top = max(budgets)
    for start in range(0, len(ev), chunk):
        idx = np.arange(start, min(start + chunk, len(ev)))
        truth = torch.from_numpy(ev.table.ids[ev.examples.token[idx], ev.examples.target[idx]].astype(np.int64))
        ranked = scorer.scores(ev, idx).float().topk(top, dim=1).indices  # B x max(b)
        for j, b in enumerate(budgets):
            out[idx, j] = overlap(ranked[:, :b], truth, ev.E).numpy()
    return out


def metrics_table(hits: dict[str, np.ndarray], ev: S.EvalSet, budgets: Sequence[int], depth: int = 1) -> pd.DataFrame:
    """Group metrics at one look-ahead depth: overall, per phase, per dataset and per layer."""
    k = ev.k
    tokens = ev.examples.token
    labels = pd.DataFrame({
        "phase": np.where(ev.table.decode[tokens], "decode", "prefill"),
        "dataset": [ev.table.requests[r][0] for r in ev.table.request[tokens]],
        "layer": ev.examples.target,
    })
    rows = []
    for name, h in hits.items():
        df = labels.copy()
        df["exact_topk"] = h[:, 0] == k
        df["at_least_half"] = h[:, 0] >= -(-k // 2)
        df["recall"] = h[:, 0] / k
        for j, b in enumerate(budgets):
            df[f"recall@{b}"] = h[:, j] / k
            df[f"precision@{b}"] = h[:, j] / b
        metrics = [c for c in df.columns if c not in labels.columns]
        for phase_df, phase in ((df, "all"), *((df[df.phase == p], p) for p in ("prefill", "decode"))):
            if phase_df.empty:
                continue
            groups = [("all", "all", phase_df)]
            groups += [(d, "all", g) for d, g in phase_df.groupby("dataset")]
            groups += [("all", str(l), g) for l, g in phase_df.groupby("layer")]
            for dataset, layer, g in groups:
                rows.append({"scorer": name, "depth": depth, "phase": phase, "dataset": dataset, "layer": layer,
                             "examples": len(g), **g[metrics].mean().to_dict()})
    return pd.DataFrame(rows)


def _train_traces(predictor_config: dict, train_traces: Sequence[Path] | None) -> list[Path]:
    if train_traces:
        return list(train_traces)
    listed = [Path(p) for p in predictor_config.get("training_data", {}).get("traces", [])]
    if not listed or not all(p.exists() for p in listed):
        raise FileNotFoundError(f"the predictor's training traces {[str(p) for p in listed]} are not here; pass "
                                "--train-traces with them (baselines are built from the same training requests)")
    return listed


def evaluate_accuracy(traces: Sequence[Path], predictor_path: Path, train_traces: Sequence[Path] | None = None,
                      baselines: Sequence[str] = BASELINES, extra_budgets: Sequence[int] = (1, 2),
                      progress: Callable[[str], None] | None = None, max_depth: int | None = None) -> AccuracyReport:
    """Score the predictor and the baselines on every (token, layer) of the requests it was not trained on, at
    look-ahead depths 1..``max_depth`` (default: the predictor's own)."""
    unknown = set(baselines) - set(BASELINES)
    if unknown:
        raise ValueError(f"unknown baseline(s) {sorted(unknown)}; choose from {', '.join(BASELINES)}")
    predictor = load_predictor(predictor_path)
    opened = [open_trace(t) for t in traces]
    meta = opened[0].meta
    predictor.check_geometry(meta.num_layers, meta.num_experts, meta.top_k, "trace")
    trained = trained_requests(predictor_path)
    max_depth = max_depth or predictor.spec.lookahead
    if not 1 <= max_depth <= meta.num_layers - 1:
        raise ValueError(f"look-ahead depth must be in 1..{meta.num_layers - 1}, got {max_depth}")

    table = load_routing(opened, lookahead=max_depth)
    unseen = np.array([table.requests[r] not in trained for r in table.request])
    if not unseen.any():
        raise ValueError(f"the predictor was trained on every request in {[str(t) for t in traces]}: "
                         "evaluate it on other requests")
    ev_table = table.select(np.flatnonzero(unseen))
    if predictor.spec.uses_nextgate and ev_table.nextgate_depth < predictor.spec.lookahead:
        raise ValueError(f"the predictor uses next-gate features {predictor.spec.lookahead} layer(s) ahead but the "
                         f"traces recorded {ev_table.nextgate_depth}")
    if predictor.spec.uses_scores and len(ev_table.nextgate_scores) < predictor.spec.lookahead:
        raise ValueError(f"the {predictor.spec.family} predictor needs the next-gate's scores: traces of format "
                         "version 2")
    ev = S.EvalSet(ev_table, make_examples(np.arange(len(ev_table)), meta.num_layers))

    train_paths = _train_traces(predictor.config, train_traces)
    same = sorted(Path(p).resolve() for p in train_paths) == sorted(Path(t).resolve() for t in traces)
    train_table = table if same else load_routing([open_trace(t) for t in train_paths])  # read once when shared
    in_train = np.array([train_table.requests[r] in trained for r in train_table.request])
    train_table = train_table.select(np.flatnonzero(in_train))
    stats = stats_from_ids(train_table.ids, meta.num_experts)
    popularity, affinity = torch.from_numpy(stats.popularity), torch.from_numpy(stats.affinity)

    k = meta.top_k
    budgets = sorted({k, *(k + m for m in extra_budgets if 0 < k + m <= meta.num_experts)})
    scorers: list[S.Scorer] = [S.TrainedMLP(predictor)]
    make = {
        "popularity": lambda: S.Popularity(popularity),
        "affinity": lambda: S.AffinityMarkov(affinity),
        "activation-matrix": lambda: S.ActivationMatrix(train_table, ev),
        "next-gate": lambda: S.NextGate() if ev_table.nextgate else None,
        "previous-token": lambda: S.PreviousToken(ev_table, popularity),
        "logistic": lambda: S.LogisticBaseline(
            predictor.spec, popularity, affinity,
            S.EvalSet(train_table, make_examples(np.arange(len(train_table)), meta.num_layers))),
        "oracle": lambda: S.Oracle(),
    }
    for name in baselines:
        if progress:
            progress(f"building {name}")
        scorer = make[name]()
        if scorer is not None:
            scorers.append(scorer)
    hits = {}
    for scorer in scorers:
        if progress:
            progress(f"scoring {scorer.name}")
        hits[scorer.name] = hits_at_budgets(scorer, ev, budgets)
    tables = [metrics_table(hits, ev, budgets)]
    for d in range(2, max_depth + 1):
        deep = S.EvalSet(ev_table, make_examples(np.arange(len(ev_table)), meta.num_layers, (d,)))
        reach = {"trained MLP": predictor.spec.lookahead, "next-gate": ev_table.nextgate_depth}  # deepest each scores
        usable = [s for s in scorers if s.name in DEEP_SCORERS and d <= reach.get(s.name, d)]
        if progress:
            progress(f"scoring {len(usable)} scorers {d} layers ahead")
        tables.append(metrics_table({s.name: hits_at_budgets(s, deep, budgets) for s in usable}, deep, budgets, d))
    info = {
        "predictor": str(predictor_path), "predictor_config": predictor.config,
        "traces": [str(t) for t in traces], "train_traces": [str(p) for p in train_paths],
        "geometry": {"num_layers": meta.num_layers, "num_experts": meta.num_experts, "top_k": k},
        "evaluated_requests": int(len(np.unique(ev_table.request))),
        "skipped_trained_requests": int(len(np.unique(table.request[~unseen]))),
        "evaluated_tokens": len(ev_table), "examples": len(ev), "depths": max_depth,
        "scorers": {s.name: s.description for s in scorers},
    }
    return AccuracyReport(pd.concat(tables, ignore_index=True), budgets, info, stats)


def save_json(report: AccuracyReport, path: Path) -> None:
    write_json(path, report.to_json(), default=str)


def load_report(folder: Path) -> AccuracyReport:
    path = Path(folder) / "report.json"
    if not path.exists():
        raise FileNotFoundError(f"no report.json in {folder}; run duoserve-eval accuracy first")
    data = json.loads(path.read_text())
    return AccuracyReport(pd.DataFrame(data["rows"]), data["budgets"], data["info"])
