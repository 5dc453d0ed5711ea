"""Host memory one MoE layer's expert store takes when pinned, and the copy bandwidth from it: torch's
``pin_memory`` (its caching host allocator, which rounds every block up to a power of two) against the engine's
``store.host_zeros`` (the tensor's own pages registered with the CUDA runtime, at their exact size), for a layer of
each named shape in each stored format.

For each (shape, format) and each way in turn: LAYERS layers' stores (E x row bytes) allocated, the drop of the
system's available memory per layer against the store's bytes, one copy of 8 experts' rows to the device timed
with CUDA events (best of 20; both ways are page-locked, so the same bandwidth is expected), then all freed (torch's
cached host blocks emptied) before the other way.

    python benchmarks/pinned_host_memory.py --out benchmarks/results/pinned_host_memory_h100.json
"""

from __future__ import annotations

import gc

import psutil
import torch

from duoserve.bench.results import parser, write_result
from duoserve.bench.simulate import ModelShape
from duoserve.runtime.quant import stored_nbytes
from duoserve.runtime.store import host_zeros

GB = 1e9
WAYS = {"host_zeros": lambda shape: host_zeros(shape, torch.uint8, True),
        "pin_memory": lambda shape: torch.zeros(shape, dtype=torch.uint8, pin_memory=True)}


def copy_gbps(store: torch.Tensor, count: int = 8, repeats: int = 20) -> float:
    """Best bandwidth of one non-blocking copy of ``count`` rows of ``store`` to the device."""
    src = store[:count]
    dst = torch.empty_like(src, device="cuda")
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return src.numel() / (best / 1e3) / GB


def measure(way: str, rows: int, row_bytes: int, layers: int) -> dict:
    """Host bytes a layer's store takes pinned ``way``, and the copy bandwidth from it."""
    gc.collect()
    before = psutil.virtual_memory().available
    stores = [WAYS[way]((rows, row_bytes)) for _ in range(layers)]
    taken = (before - psutil.virtual_memory().available) / layers
    pinned = all(s.is_pinned() for s in stores)
    gbps = copy_gbps(stores[0])
    del stores
    gc.collect()
    getattr(torch._C, "_host_emptyCache", lambda: None)()  # torch's cached pinned blocks back to the system
    return {"host_bytes_per_layer": taken, "pinned": pinned, "copy_gbps": gbps}


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__, geometry=None)
    ap.add_argument("--layers", type=int, default=4, help="layers' stores held at once per way")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark pins host memory for a GPU: run it where CUDA is available")
    torch.cuda.init()
    rows = []
    for name in ("qwen3-30b-a3b", "mixtral-8x7b"):
        shape = ModelShape.of(name)
        for fmt in ("model", "fp8", "int4"):
            row_bytes = stored_nbytes(shape.layout, fmt)
            store_bytes = shape.num_experts * row_bytes
            row = {"shape": name, "expert_dtype": fmt, "store_bytes": store_bytes}
            for way in WAYS:
                row[way] = measure(way, shape.num_experts, row_bytes, args.layers)
                row[way]["vs_store_bytes"] = row[way]["host_bytes_per_layer"] / store_bytes
            rows.append(row)
            ours, torchs = row["host_zeros"], row["pin_memory"]
            print(f"{name:>14} {fmt:>5}: a layer's store {store_bytes / GB:.2f} GB; pinned by host_zeros "
                  f"{ours['vs_store_bytes']:.2f}x its bytes at {ours['copy_gbps']:.1f} GB/s, "
                  f"by pin_memory {torchs['vs_store_bytes']:.2f}x at {torchs['copy_gbps']:.1f} GB/s")
    result = {"layers": args.layers, "rows": rows}
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
