"""Routing statistics from traces: per-layer popularity and consecutive-layer affinity, with counts.

Shape legend: N tokens, L MoE layers, E experts, k top-k.

Counts are kept (not only frequencies) so statistics of several trace folders merge exactly; they
are counted by ``duoserve.features.counting`` (compiled CPU loop, or a CUDA device).
Saved as safetensors (arrays) with JSON metadata, loadable without the training code.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from duoserve.features.counting import RoutingCounter
from duoserve.files import atomic_path
from duoserve.loading import resolve_device
from duoserve.trace.format import Trace, open_trace

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


def accumulate(batches: Iterable[np.ndarray], num_layers: int, num_experts: int, top_k: int,
               meta: dict | None = None, device: str = "cpu", backend: str = "auto") -> RoutingStats:
    """Statistics of a stream of N x L x k id batches, counted on ``device`` (cpu, cuda, cuda:N); ``backend``
    picks the CPU loop (``duoserve.features.counting.BACKENDS``)."""
    counter = RoutingCounter(num_layers, num_experts, top_k, resolve_device(device), backend)
    for ids in batches:
        counter.add(ids)
    popularity, affinity = counter.counts()
    return RoutingStats(popularity, affinity, counter.tokens, meta or {})


def compute_stats(trace: Trace, phase: str | None = None, datasets: list[str] | None = None,
                  batch_rows: int = 65_536, workers: int = 1, device: str = "cpu") -> RoutingStats:
    """Stream ``trace`` once and count popularity and affinity (optionally one phase / some datasets).
    ``workers`` > 1 counts the part files in that many processes and sums their counts (exact); ``device``
    'cuda' counts on the GPU instead (one process: the read overlaps the device's count)."""
    meta = {"trace": str(trace.path), "model": trace.meta.model, "phase": phase, "datasets": datasets}
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if workers > 1 and resolve_device(device).type != "cpu":
        raise ValueError(f"--workers {workers} counts in CPU processes; with --device {device} leave it at 1")
    g = trace.meta
    if workers == 1 or len(trace.files) == 1:
        return accumulate(trace.iter_experts(phase, datasets, batch_rows), g.num_layers, g.num_experts, g.top_k,
                          meta, device)
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
    return accumulate(batches, ids.shape[1], num_experts, ids.shape[2], meta)


def merged_stats(paths: Sequence[str | Path], phase: str | None = None, workers: int = 1,
                 on_folder: Callable[[], None] | None = None, device: str = "cpu") -> RoutingStats:
    """The statistics of several trace folders (same geometry), their counts merged; ``on_folder`` after each."""
    resolve_device(device)
    opened = [open_trace(p) for p in paths]  # every folder checked before any is counted
    merged = None
    for trace in opened:
        one = compute_stats(trace, phase, workers=workers, device=device)
        merged = one if merged is None else merged.merge(one)
        if on_folder:
            on_folder()
    if merged is None:
        raise ValueError("no trace folder given")
    return merged
