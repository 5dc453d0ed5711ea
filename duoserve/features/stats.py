"""Routing statistics from traces: per-layer popularity and consecutive-layer affinity, with counts.

Shape legend: N tokens, L MoE layers, E experts, k top-k.

Counts are kept (not only frequencies) so statistics of several trace folders merge exactly.
Saved as safetensors (arrays) with JSON metadata, loadable without the training code.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from duoserve.files import atomic_path
from duoserve.trace.format import Trace, open_trace
from duoserve.trace.info import expert_counts

STATS_VERSION = 1


@dataclass
class RoutingStats:
    popularity_counts: np.ndarray  # L x E: selections of each expert
    affinity_counts: np.ndarray  # (L-1) x E x E: [l, i, j] = tokens with i at l and j at l+1
    tokens: int
    meta: dict = field(default_factory=dict)

    @property
    def geometry(self) -> tuple[int, int]:
        return self.popularity_counts.shape

    @property
    def popularity(self) -> np.ndarray:
        """L x E float32: each layer's selection frequencies (rows sum to 1)."""
        c = self.popularity_counts.astype(np.float64)
        return (c / np.maximum(c.sum(1, keepdims=True), 1)).astype(np.float32)

    @property
    def affinity(self) -> np.ndarray:
        """(L-1) x E x E float32: P(j at l+1 | i at l); rows of unseen experts are zero."""
        c = self.affinity_counts.astype(np.float64)
        return (c / np.maximum(c.sum(2, keepdims=True), 1)).astype(np.float32)

    def merge(self, other: RoutingStats) -> RoutingStats:
        if self.geometry != other.geometry:
            raise ValueError(f"cannot merge statistics of geometry {self.geometry} and {other.geometry}")
        return RoutingStats(self.popularity_counts + other.popularity_counts,
                            self.affinity_counts + other.affinity_counts, self.tokens + other.tokens,
                            {"merged": [self.meta, other.meta]})

    def save(self, path: str | Path) -> None:
        with atomic_path(path) as tmp:
            save_file({"popularity_counts": self.popularity_counts, "affinity_counts": self.affinity_counts},
                      str(tmp), metadata={"duoserve_stats": json.dumps({"version": STATS_VERSION,
                                                                        "tokens": self.tokens, "meta": self.meta})})

    @classmethod
    def load(cls, path: str | Path) -> RoutingStats:
        from safetensors import safe_open

        with safe_open(str(path), "np") as f:
            info = json.loads((f.metadata() or {}).get("duoserve_stats", "{}"))
        if info.get("version") != STATS_VERSION:
            raise ValueError(f"{path} is not a duoserve statistics file of version {STATS_VERSION}")
        arrays = load_file(str(path))
        return cls(arrays["popularity_counts"], arrays["affinity_counts"], info["tokens"], info["meta"])


def count_routing(ids: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Popularity (L x E) and affinity ((L-1) x E x E) counts of one N x L x k batch."""
    _, L, _ = ids.shape
    E = num_experts
    by_layer = np.ascontiguousarray(ids.transpose(1, 0, 2), dtype=np.int32)  # L x N x k, one block per layer
    affinity = np.empty((L - 1, E, E), dtype=np.int64)
    for l in range(L - 1):  # per layer pair, so the E*E bins stay in cache
        pairs = by_layer[l][:, :, None] * E + by_layer[l + 1][:, None, :]  # N x k x k: flat (i, j)
        affinity[l] = np.bincount(pairs.ravel(), minlength=E * E).reshape(E, E)
    return expert_counts(ids, E), affinity


def accumulate(batches, num_layers: int, num_experts: int, meta: dict | None = None) -> RoutingStats:
    """Statistics of a stream of N x L x k id batches."""
    L, E = num_layers, num_experts
    popularity = np.zeros((L, E), dtype=np.int64)
    affinity = np.zeros((L - 1, E, E), dtype=np.int64)
    tokens = 0
    for ids in batches:
        p, a = count_routing(ids, E)
        popularity += p
        affinity += a
        tokens += len(ids)
    return RoutingStats(popularity, affinity, tokens, meta or {})


def compute_stats(trace: Trace, phase: str | None = None, datasets: list[str] | None = None,
                  batch_rows: int = 65_536, workers: int = 1) -> RoutingStats:
    """Stream ``trace`` once and count popularity and affinity (optionally one phase / some datasets).
    ``workers`` > 1 counts the part files in that many processes and sums their counts (exact)."""
    meta = {"trace": str(trace.path), "model": trace.meta.model, "phase": phase, "datasets": datasets}
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if workers == 1 or len(trace.files) == 1:
        return accumulate(trace.iter_experts(phase, datasets, batch_rows), trace.meta.num_layers,
                          trace.meta.num_experts, meta)
    jobs = [(str(f), phase, datasets, batch_rows) for f in trace.files]
    # spawn: a forked child could inherit a lock held by one of Arrow's threads
    with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=get_context("spawn")) as pool:
        parts = list(pool.map(_count_part, jobs))
    total = parts[0]
    for part in parts[1:]:
        total = total.merge(part)
    return RoutingStats(total.popularity_counts, total.affinity_counts, total.tokens, meta)


def _count_part(job: tuple[str, str | None, list[str] | None, int]) -> RoutingStats:
    """One part file's counts (a worker process's share of ``compute_stats``)."""
    path, phase, datasets, batch_rows = job
    return compute_stats(open_trace(path), phase, datasets, batch_rows)


def stats_from_ids(ids: np.ndarray, num_experts: int, batch_rows: int = 65_536, meta: dict | None = None) -> RoutingStats:
    """Statistics of an in-memory N x L x k id table."""
    batches = (ids[i:i + batch_rows] for i in range(0, len(ids), batch_rows))
    return accumulate(batches, ids.shape[1], num_experts, meta)


def merged_stats(paths: Sequence[str | Path], phase: str | None = None, workers: int = 1,
                 on_folder: Callable[[], None] | None = None) -> RoutingStats:
    """The statistics of several trace folders (same geometry), their counts merged; ``on_folder`` after each."""
    opened = [open_trace(p) for p in paths]  # every folder checked before any is counted
    merged = None
    for trace in opened:
        one = compute_stats(trace, phase, workers=workers)
        merged = one if merged is None else merged.merge(one)
        if on_folder:
            on_folder()
    if merged is None:
        raise ValueError("no trace folder given")
    return merged
