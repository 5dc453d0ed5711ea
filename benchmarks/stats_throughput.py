"""Routing-statistics throughput on one CPU core: popularity + affinity counts streamed from Parquet.

    python benchmarks/stats_throughput.py [--rows 200000] [--layers 48 --experts 128 --top-k 8]

Writes a synthetic trace of uniformly random routing (the count is the same work whatever the
routing), then times `compute_stats` end to end, and, as the baseline of the same run, a plain
read of the `experts` column. Target (issue): at least 1M token rows per second for L=48, E=128, k=8.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import parser, random_routing, write_result  # noqa: E402

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
        ids = random_routing(rng, n, L, E, k).astype(np.int16)
        writer.add({"request_id": np.arange(start, start + n) // 100, "dataset": np.full(n, "synthetic", dtype=object),
                    "phase": np.full(n, "decode", dtype=object), "position": np.zeros(n, np.int32),
                    "token_id": np.zeros(n, np.int32), "experts": ids.reshape(n, -1),
                    "scores": np.zeros((n, L * k), np.float16)})
    writer.flush()


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=200_000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        synthetic_trace(Path(tmp), args.rows, args.layers, args.experts, args.top_k)
        trace = open_trace(tmp)
        t = time.perf_counter()
        read_rows = sum(len(b) for b in trace.iter_experts())
        read_s = time.perf_counter() - t
        t = time.perf_counter()
        stats = compute_stats(trace)
        stats_s = time.perf_counter() - t
    assert read_rows == stats.tokens == args.rows
    report = {
        "benchmark": "stats_throughput", "command": " ".join(sys.argv), "rows": args.rows,
        "geometry": {"L": args.layers, "E": args.experts, "k": args.top_k}, "threads": 1,
        "read_only_rows_per_s": args.rows / read_s, "stats_rows_per_s": args.rows / stats_s,
        "stats_vs_read_time_ratio": stats_s / read_s, "target_rows_per_s": 1_000_000,
    }
    print(f"read only: {report['read_only_rows_per_s']:,.0f} rows/s; statistics: {report['stats_rows_per_s']:,.0f} "
          f"rows/s ({report['stats_vs_read_time_ratio']:.1f}x the read time); target 1,000,000 rows/s")
    write_result(args.out, report)


if __name__ == "__main__":
    main()
