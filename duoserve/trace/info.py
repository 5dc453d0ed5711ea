"""Summaries of a trace folder: requests, tokens per phase and dataset, per-layer expert usage.

Shape legend: N rows (tokens), L MoE layers, E experts, k top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc

from duoserve.trace.format import Trace


@dataclass
class TraceSummary:
    requests: dict[str, int]  # dataset -> requests
    tokens: dict[tuple[str, str], int]  # (dataset, phase) -> rows
    usage: np.ndarray  # L x E: how often each expert was selected

    @property
    def num_layers(self) -> int:
        return self.usage.shape[0]

    def layer_stats(self) -> list[dict]:
        """Per layer: share of experts used, max load relative to uniform, normalised entropy."""
        L, E = self.usage.shape
        stats = []
        for l in range(L):
            counts = self.usage[l]
            total = counts.sum()
            p = counts / max(total, 1)
            nz = p[p > 0]
            stats.append({
                "layer": l,
                "experts_used": int((counts > 0).sum()),
                "max_over_uniform": float(p.max() * E) if total else 0.0,
                "entropy": float(-(nz * np.log(nz)).sum() / np.log(E)) if total else 0.0,
            })
        return stats


def expert_usage(trace: Trace, phase: str | None = None, dataset: str | None = None) -> np.ndarray:
    """L x E counts of expert selections, streamed batch by batch."""
    L, E, k = trace.meta.num_layers, trace.meta.num_experts, trace.meta.top_k
    filt = None
    for name, value in (("phase", phase), ("dataset", dataset)):
        if value is not None:
            cond = pc.field(name) == value
            filt = cond if filt is None else filt & cond
    usage = np.zeros((L, E), dtype=np.int64)
    layer_of = np.repeat(np.arange(L), k)  # L*k: the layer of each slot
    for batch in trace.dataset.to_batches(columns=["experts"], filter=filt):
        ids = batch.column("experts").flatten().to_numpy().reshape(-1, L * k)  # N x L*k
        usage += np.bincount((layer_of * E + ids).ravel(), minlength=L * E).reshape(L, E)
    return usage


def summarize(trace: Trace) -> TraceSummary:
    table = trace.dataset.to_table(columns=["dataset", "request_id", "phase"])
    requests = table.group_by(["dataset", "request_id"]).aggregate([]).column("dataset").value_counts()
    tokens = table.group_by(["dataset", "phase"]).aggregate([("request_id", "count")])
    return TraceSummary(
        requests={r["values"]: r["counts"] for r in requests.to_pylist()},
        tokens={(d, p): n for d, p, n in zip(tokens.column("dataset").to_pylist(), tokens.column("phase").to_pylist(),
                                             tokens.column("request_id_count").to_pylist())},
        usage=expert_usage(trace),
    )
