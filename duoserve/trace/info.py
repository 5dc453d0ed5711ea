"""Summaries of a trace folder: requests, tokens per phase and dataset, per-layer expert usage.

Shape legend: N rows (tokens), L MoE layers, E experts, k top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from duoserve.trace.format import Trace


@dataclass
class TraceSummary:
    requests: dict[str, int]  # dataset -> requests
    tokens: dict[tuple[str, str], int]  # (dataset, phase) -> rows
    usage: np.ndarray  # L x E: how often each expert was selected


def expert_counts(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """L x E selection counts of one N x L x k batch of expert ids."""
    _, L, _ = ids.shape
    E = num_experts
    layer = np.arange(L, dtype=np.int32)[None, :, None]  # 1 x L x 1
    return np.bincount((layer * E + ids.astype(np.int32)).ravel(), minlength=L * E).reshape(L, E)


def expert_usage(trace: Trace, phase: str | None = None, dataset: str | None = None) -> np.ndarray:
    """L x E counts of expert selections, streamed batch by batch."""
    usage = np.zeros((trace.meta.num_layers, trace.meta.num_experts), dtype=np.int64)
    for ids in trace.iter_experts(phase, [dataset] if dataset else None):
        usage += expert_counts(ids, trace.meta.num_experts)
    return usage


def layer_stats(usage: np.ndarray) -> list[dict]:
    """Per layer of an L x E usage table: experts used, max load relative to uniform, normalised entropy."""
    L, E = usage.shape
    stats = []
    for l in range(L):
        counts = usage[l]
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


def summarize_trace(trace: Trace) -> TraceSummary:
    """Requests per dataset, rows per (dataset, phase) and the L x E expert usage of a trace."""
    table = trace.dataset.to_table(columns=["dataset", "request_id", "phase"])
    requests = table.group_by(["dataset", "request_id"]).aggregate([]).column("dataset").value_counts()
    tokens = table.group_by(["dataset", "phase"]).aggregate([("request_id", "count")])
    return TraceSummary(
        requests={r["values"]: r["counts"] for r in requests.to_pylist()},
        tokens={(d, p): n for d, p, n in zip(tokens.column("dataset").to_pylist(), tokens.column("phase").to_pylist(),
                                             tokens.column("request_id_count").to_pylist())},
        usage=expert_usage(trace),
    )
