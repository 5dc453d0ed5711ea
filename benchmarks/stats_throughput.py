"""Routing-statistics throughput on one CPU core: popularity + affinity counts streamed from Parquet.

    python benchmarks/stats_throughput.py [--rows 200000] [--layers 48 --experts 128 --top-k 8]

Writes a synthetic trace of uniformly random routing (the count is the same work whatever the
routing), then times `compute_stats` end to end, and, as baselines of the same run, a plain read of
the `experts` column and the arithmetic of the densest counting formulation: per layer pair, one
bf16 one-hot GEMM (E x N) @ (N x E) on one thread (AMX where the CPU has it; exact only up to 256
per cell, so a ceiling, not a method). Target (issue): at least 1M token rows per second for L=48,
E=128, k=8; a row is (L-1) * k * k = 3008 pair increments. Also timed: the same count with one
worker process per part file, up to the machine's cores (`duoserve-train stats --workers N`).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from duoserve.bench.drivers import random_ids
from duoserve.bench.results import parser, write_result
from duoserve.features.stats import compute_stats
from duoserve.trace.format import TraceMeta, open_trace
from duoserve.trace.writer import TraceWriter


def synthetic_trace(out: Path, rows: int, L: int, E: int, k: int) -> None:
    meta = TraceMeta(model="synthetic", num_layers=L, num_experts=E, top_k=k, decoder_indices=list(range(L)),
                     datasets=[{"name": "synthetic", "source": "benchmark"}])
    writer = TraceWriter(out, meta, rows_per_part=100_000)
    rng = np.random.default_rng(0)
    for start in range(0, rows, 50_000):
        n = min(50_000, rows - start)
        ids = random_ids(rng, n, L, E, k).astype(np.int16)
        writer.add({"request_id": np.arange(start, start + n) // 100, "dataset": np.full(n, "synthetic", dtype=object),
                    "phase": np.full(n, "decode", dtype=object), "position": np.zeros(n, np.int32),
                    "token_id": np.zeros(n, np.int32), "experts": ids.reshape(n, -1),
                    "scores": np.zeros((n, L * k), np.float16)})
    writer.flush()


def gemm_ceiling_rows_per_s(L: int, E: int, k: int, rows: int = 16_384) -> float:
    """Rows per second of the one-hot GEMM counting arithmetic alone (one thread, bf16, data already one-hot)."""
    import torch  # here, not at the top: --workers processes re-import this script and need no torch

    torch.set_num_threads(1)
    ids = torch.randint(E, (L, rows, k))
    onehot = torch.zeros(L, E, rows, dtype=torch.bfloat16).scatter_(1, ids.transpose(1, 2), 1)  # L x E x N
    onehot_t = onehot.transpose(1, 2).contiguous()  # L x N x E
    best = float("inf")
    for _ in range(4):  # the first is a warm-up; the best of the others
        t = time.perf_counter()
        torch.bmm(onehot[:-1], onehot_t[1:])  # (L-1) x E x E
        best = min(best, time.perf_counter() - t)
    return rows / best


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=200_000)
    args = ap.parse_args()
    pa.set_cpu_count(1)  # Arrow's decoding threads too: the figure is one core's (worker processes have their own)
    with tempfile.TemporaryDirectory() as tmp:
        synthetic_trace(Path(tmp), args.rows, args.layers, args.experts, args.top_k)
        trace = open_trace(tmp)
        t = time.perf_counter()
        read_rows = sum(len(b) for b in trace.iter_experts())
        read_s = time.perf_counter() - t
        t = time.perf_counter()
        stats = compute_stats(trace)
        stats_s = time.perf_counter() - t
        workers = min(os.cpu_count() or 1, len(trace.files))
        t = time.perf_counter()
        parallel = compute_stats(trace, workers=workers)  # one process per part file, up to the cores
        parallel_s = time.perf_counter() - t
    assert read_rows == stats.tokens == parallel.tokens == args.rows
    assert (parallel.affinity_counts == stats.affinity_counts).all()
    gemm = gemm_ceiling_rows_per_s(args.layers, args.experts, args.top_k)
    report = {
        "benchmark": "stats_throughput", "rows": args.rows,
        "geometry": {"L": args.layers, "E": args.experts, "k": args.top_k}, "threads": 1,
        "read_only_rows_per_s": args.rows / read_s, "stats_rows_per_s": args.rows / stats_s,
        "stats_vs_read_time_ratio": stats_s / read_s, "gemm_ceiling_rows_per_s": gemm,
        "workers": workers, "stats_rows_per_s_workers": args.rows / parallel_s,
        "target_rows_per_s": 1_000_000,
    }
    print(f"read only: {report['read_only_rows_per_s']:,.0f} rows/s; statistics: {report['stats_rows_per_s']:,.0f} "
          f"rows/s ({report['stats_vs_read_time_ratio']:.1f}x the read time); one-hot GEMM arithmetic alone: "
          f"{gemm:,.0f} rows/s; target 1,000,000 rows/s. With {workers} worker processes (--workers): "
          f"{report['stats_rows_per_s_workers']:,.0f} rows/s")
    write_result(args.out, report)


if __name__ == "__main__":
    main()
