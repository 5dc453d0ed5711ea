"""Import throughput on one CPU core: long JSON lines -> trace, 10M (token, layer) rows by default.

    python benchmarks/import_throughput.py [--rows 10000000] [--layers 48 --experts 128 --top-k 8]

Writes a synthetic long log (tokens in order, their layers together, as serving engines log them),
then times `import_trace` twice in the same run: geometry declared (one pass) and inferred (a
scan first). Target (issue): 10M rows in under 2 minutes.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from duoserve.bench.drivers import random_ids
from duoserve.bench.results import parser, write_result
from duoserve.trace.importers import ImportSettings, import_trace


def write_log(path: Path, rows: int, L: int, E: int, k: int) -> None:
    rng = np.random.default_rng(0)
    tokens = rows // L
    with path.open("w") as f:
        for start in range(0, tokens, 20_000):
            n = min(20_000, tokens - start)
            ids = random_ids(rng, n, L, E, k)
            token = np.arange(start, start + n)
            f.writelines(f'{{"request_id": {t // 500}, "token": {t % 500}, "layer": {l}, "experts": {json.dumps(e)}}}\n'
                         for t, per_layer in zip(token.tolist(), ids.tolist()) for l, e in enumerate(per_layer))


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=10_000_000)
    args = ap.parse_args()
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    L, E, k = args.layers, args.experts, args.top_k
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "routing.jsonl"
        t = time.perf_counter()
        write_log(log, args.rows, L, E, k)
        print(f"wrote {log.stat().st_size / 2**20:,.0f} MiB of long JSONL in {time.perf_counter() - t:.0f} s", flush=True)
        seconds = {}
        for name, geometry in (("declared", dict(num_layers=L, num_experts=E, top_k=k)), ("inferred", {})):
            t = time.perf_counter()
            result = import_trace(ImportSettings(log, Path(tmp) / f"trace-{name}", **geometry))
            seconds[name] = time.perf_counter() - t
            rows = result.tokens * L
            print(f"geometry {name}: {rows:,} rows in {seconds[name]:.1f} s = {rows / seconds[name]:,.0f} rows/s "
                  f"(target: 10M rows in 120 s)", flush=True)
    rows = (args.rows // L) * L
    write_result(args.out, {"benchmark": "import_throughput", "rows": rows,
                            "geometry": {"L": L, "E": E, "k": k}, "threads": 1, "seconds": seconds,
                            "rows_per_s": {n: rows / s for n, s in seconds.items()}})

if __name__ == "__main__":
    main()
