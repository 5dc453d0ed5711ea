"""Routing-statistics throughput: popularity + affinity counts streamed from Parquet, against the read alone.

    python benchmarks/stats_throughput.py [--rows 400000] [--layers 48 --experts 128 --top-k 8] [--device cuda]

Writes a synthetic trace of uniformly random routing (the count is the same work whatever the
routing), then times, in one run:
- CPU, one core (Arrow's decoding threads too): a plain read of the `experts` column and the
  statistics end to end with the compiled counting loop, in alternating rounds (medians), then
  once with numpy's bincount (the fallback without numba). The figure is count time / read time;
  target (issue): <= 1.5x.
  The compiled loop's first-call compile (cached on disk after it) is timed apart.
- `--device cuda`, all cores: the read alone, `compute_stats(device="cuda")` end to end, and the
  GPU's count alone on ids already on the device; rows/s each. Target (issue): >= 20M rows/s
  including the read, or a statement of what bounds it.
Every timed count is checked against the CPU's counts, bit for bit.
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
from duoserve.features.counting import RoutingCounter
from duoserve.features.stats import accumulate, compute_stats
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


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def read_all(trace) -> int:
    return sum(len(b) for b in trace.iter_experts())


def cpu_figures(trace, rows: int, L: int, E: int, k: int, rounds: int) -> tuple[dict, np.ndarray]:
    """One core: the read, the compiled count and numpy's, each end to end from Parquet (medians of rounds)."""
    import torch

    pa.set_cpu_count(1)
    torch.set_num_threads(1)
    compile_s, _ = timed(lambda: RoutingCounter(L, E, k, backend="numba").add(np.zeros((1, L, k), np.int16)))
    read_all(trace)  # warm-up: the file cache
    reads, counts = [], []
    for _ in range(rounds):  # alternating, so drift in the machine's pace hits both alike
        read_s, read_rows = timed(read_all, trace)
        numba_s, stats = timed(lambda: accumulate(trace.iter_experts(), L, E, k, backend="numba"))
        reads.append(read_s)
        counts.append(numba_s)
    read_s, numba_s = float(np.median(reads)), float(np.median(counts))
    numpy_s, fallback = timed(lambda: accumulate(trace.iter_experts(), L, E, k, backend="numpy"))
    assert read_rows == stats.tokens == fallback.tokens == rows
    assert (fallback.affinity_counts == stats.affinity_counts).all()
    figures = {"threads": 1, "rounds": rounds, "stats_vs_read_time_ratio_per_round": [c / r for c, r in zip(counts, reads)],
               "read_only_rows_per_s": rows / read_s, "stats_rows_per_s": rows / numba_s,
               "stats_vs_read_time_ratio": numba_s / read_s, "numpy_stats_rows_per_s": rows / numpy_s,
               "numpy_stats_vs_read_time_ratio": numpy_s / read_s, "numba_first_call_s": compile_s,
               "target_stats_vs_read_time_ratio": 1.5}
    print(f"CPU, one core: read only {figures['read_only_rows_per_s']:,.0f} rows/s; statistics (compiled loop) "
          f"{figures['stats_rows_per_s']:,.0f} rows/s = {figures['stats_vs_read_time_ratio']:.2f}x the read time "
          f"(target <= 1.5x); numpy's bincount {figures['numpy_stats_rows_per_s']:,.0f} rows/s = "
          f"{figures['numpy_stats_vs_read_time_ratio']:.2f}x; first call (compile or load from cache) {compile_s:.2f} s")
    return figures, stats.affinity_counts


def cuda_figures(trace, rows: int, L: int, E: int, k: int, reference: np.ndarray) -> dict:
    """All cores: the read, the GPU count end to end, and the GPU count of ids already on the device."""
    import torch

    pa.set_cpu_count(os.cpu_count() or 1)
    compute_stats(trace, device="cuda")  # warm-up: CUDA context, pinned buffers, kernels
    read_s, _ = timed(read_all, trace)
    end_to_end_s, stats = timed(compute_stats, trace, device="cuda")
    assert (stats.affinity_counts == reference).all(), "GPU counts differ from the CPU's"
    resident = torch.from_numpy(np.concatenate(list(trace.iter_experts()))).cuda()  # N x L x k int16
    counter = RoutingCounter(L, E, k, "cuda")
    torch.cuda.synchronize()
    count_s, _ = timed(lambda: (counter.add(resident), torch.cuda.synchronize()))
    assert (counter.counts()[1] == reference).all()
    figures = {"read_threads": pa.cpu_count(), "gpu": torch.cuda.get_device_name(),
               "read_only_rows_per_s": rows / read_s, "stats_rows_per_s": rows / end_to_end_s,
               "stats_vs_read_time_ratio": end_to_end_s / read_s, "count_only_rows_per_s": rows / count_s,
               "target_rows_per_s": 20_000_000}
    print(f"CUDA ({figures['gpu']}), read on {pa.cpu_count()} threads: read only {figures['read_only_rows_per_s']:,.0f} "
          f"rows/s; statistics end to end {figures['stats_rows_per_s']:,.0f} rows/s "
          f"({figures['stats_vs_read_time_ratio']:.2f}x the read time); the GPU's count alone "
          f"{figures['count_only_rows_per_s']:,.0f} rows/s (target 20M rows/s including the read)")
    return figures


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3, help="alternating read / count rounds (medians)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: also the GPU figures")
    args = ap.parse_args()
    L, E, k = args.layers, args.experts, args.top_k
    report = {"benchmark": "stats_throughput", "rows": args.rows, "geometry": {"L": L, "E": E, "k": k}}
    with tempfile.TemporaryDirectory() as tmp:
        synthetic_trace(Path(tmp), args.rows, L, E, k)
        trace = open_trace(tmp)
        report["cpu"], reference = cpu_figures(trace, args.rows, L, E, k, args.rounds)
        if args.device == "cuda":
            report["cuda"] = cuda_figures(trace, args.rows, L, E, k, reference)
    write_result(args.out, report)


if __name__ == "__main__":
    main()
