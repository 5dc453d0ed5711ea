"""Host time to queue one expert's host-to-device copy, by the way it is issued.

At batch 1 a decode step is host-bound, and the engine queues k expert copies per layer (Qwen3-30B-A3B:
8 x 9.4 MB), so each copy's host cost is paid k x L times per token. Variants, each timed over groups of
k copies (the host's issue time only; the device drains the copies untimed between groups):

  torch copy_     slot.copy_(row, non_blocking=True) per expert, rows from the caching host allocator
                  (pin_memory=True), which records an event per copy
  registered      the same, rows in pageable memory registered with cudaHostRegister (no allocator event)
  foreach         torch._foreach_copy_ of the group in one call
  cudart          cudaMemcpyAsync called through ctypes on raw pointers (the engine's ``runtime_memcpy``)
  cudart batch    one cudaMemcpyBatchAsync of the group through ctypes, its pointer arrays built per group
                  (CUDA 12.8 and later; the engine does not use it: it gained nothing in a decode step, docs)
  cache.fetch     the engine's ExpertCache.fetch of the group (victims, bookkeeping, waits, copies, event), its
                  experts not consecutive (a copy each)

Then the device's side, as PCIe bandwidth of whole groups issued each way (cudart, cudart batch), waited for.

    python3 benchmarks/runtime_copy_issue.py [--expert-mb 9.4] [--group 8] [--groups 200] [--out FILE.json]
"""

from __future__ import annotations

import ctypes
import statistics
import time

import torch

from duoserve.bench.results import parser, write_result
from duoserve.runtime.cache import ExpertCache
from duoserve.runtime.store import ExpertLayout, HostExperts
from duoserve.runtime.streams import Streams, cuda_runtime, runtime_memcpy


class CopyAttributes(ctypes.Structure):
    """``cudaMemcpyAttributes``: source access order, source and destination location hints, flags."""

    _fields_ = [("src_access_order", ctypes.c_int), ("src_hint", ctypes.c_int * 2), ("dst_hint", ctypes.c_int * 2),
                ("flags", ctypes.c_uint)]


def memcpy_batch(runtime: ctypes.CDLL):
    """``runtime``'s ``cudaMemcpyBatchAsync`` as ``batch(dst_ptrs, src_ptrs, nbytes, stream) -> error``, every copy of
    ``nbytes`` with stream-ordered sources; None before CUDA 12.8. CUDA 13 dropped its ``failIdx`` argument."""
    version = ctypes.c_int()
    fn = getattr(runtime, "cudaMemcpyBatchAsync", None)
    if fn is None or runtime.cudaRuntimeGetVersion(ctypes.byref(version)) or version.value < 12080:
        return None
    pointers, sizes = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)
    fail = [(ctypes.c_size_t * 1)()] if version.value < 13000 else []
    fn.argtypes = [pointers, pointers, sizes, ctypes.c_size_t, ctypes.POINTER(CopyAttributes), sizes, ctypes.c_size_t,
                   *[sizes] * len(fail), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    attributes, first = CopyAttributes(1), (ctypes.c_size_t * 1)(0)  # 1: cudaMemcpySrcAccessOrderStream

    def batch(dst_ptrs: list[int], src_ptrs: list[int], nbytes: int, stream: int) -> int:
        n = len(dst_ptrs)
        dsts, srcs = (ctypes.c_void_p * n)(*dst_ptrs), (ctypes.c_void_p * n)(*src_ptrs)
        sizes = (ctypes.c_size_t * n)(*[nbytes] * n)
        return fn(dsts, srcs, sizes, n, ctypes.byref(attributes), first, 1, *fail, stream)

    return batch


def main() -> None:
    ap = parser(__doc__, geometry=None)
    ap.add_argument("--expert-mb", type=float, default=9.4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--groups", type=int, default=200)
    args = ap.parse_args()
    device = torch.device("cuda")
    P, k = int(args.expert_mb * 1e6 / 2), args.group
    E = 2 * k
    pinned = torch.randn(E, P).to(torch.bfloat16).pin_memory()  # E x P
    pageable = torch.zeros(E, P, dtype=torch.bfloat16)  # E x P
    torch.cuda.cudart().cudaHostRegister(pageable.data_ptr(), pageable.numel() * 2, 0)
    slots = torch.zeros(2 * k, P, dtype=torch.bfloat16, device=device)  # S x P
    stream = torch.cuda.Stream(device)
    rows, reg_rows, slot_rows = list(pinned.unbind(0)), list(pageable.unbind(0)), list(slots.unbind(0))
    runtime = cuda_runtime()
    if runtime is None:
        raise SystemExit("torch's CUDA runtime is not a shared library in this process: no direct copies to time")
    memcpy, batched = runtime_memcpy(), memcpy_batch(runtime)  # what the engine calls; the batched call
    if batched is None:
        raise SystemExit("this CUDA runtime has no cudaMemcpyBatchAsync (CUDA 12.8 and later)")
    handle, nbytes = stream.cuda_stream, P * 2
    src_ptrs, dst_ptrs = [r.data_ptr() for r in rows], [r.data_ptr() for r in slot_rows]

    layout = ExpertLayout(("w",), ((P,),), (0,), P, torch.bfloat16)
    store = HostExperts(layout, packed=pinned)
    cache = ExpertCache(layout, 2 * k, Streams(device))
    scattered = list(range(0, E, 2))  # no two consecutive: a copy each

    def torch_copy(g: int) -> None:
        for i in range(k):
            slot_rows[(g + i) % (2 * k)].copy_(rows[(g * k + i) % E], non_blocking=True)

    def registered(g: int) -> None:
        for i in range(k):
            slot_rows[(g + i) % (2 * k)].copy_(reg_rows[(g * k + i) % E], non_blocking=True)

    def foreach(g: int) -> None:
        torch._foreach_copy_([slot_rows[(g + i) % (2 * k)] for i in range(k)],
                             [rows[(g * k + i) % E] for i in range(k)], non_blocking=True)

    def direct(g: int) -> None:
        for i in range(k):
            if memcpy(dst_ptrs[(g + i) % (2 * k)], src_ptrs[(g * k + i) % E], nbytes, 1, handle):
                raise RuntimeError("cudaMemcpyAsync failed")

    def batch(g: int) -> None:
        if batched([dst_ptrs[(g + i) % (2 * k)] for i in range(k)], [src_ptrs[(g * k + i) % E] for i in range(k)],
                   nbytes, handle):
            raise RuntimeError("cudaMemcpyBatchAsync failed")

    def fetch(g: int) -> None:
        cache.fetch(g, scattered, store, "decode", set())

    variants = {"torch copy_": torch_copy, "registered": registered, "foreach": foreach, "cudart": direct,
                "cudart batch": batch, "cache.fetch": fetch}
    times = {name: [] for name in variants}
    for g in range(args.groups):  # interleaved, so drift in the host's pace hits every variant alike
        for name, issue in variants.items():
            torch.cuda.synchronize()
            with torch.cuda.stream(stream):
                start = time.perf_counter()
                issue(g)
                times[name].append((time.perf_counter() - start) * 1e6 / k)
    torch.cuda.synchronize()
    slots.zero_()
    with torch.cuda.stream(stream):
        batch(1)
    torch.cuda.synchronize()
    ok = all(torch.equal(slots[(1 + i) % (2 * k)].cpu(), pinned[(k + i) % E]) for i in range(k))
    gbps = {}
    for name in ("cudart", "cudart batch"):  # the device's side: whole groups, waited for
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            start = time.perf_counter()
            for g in range(20):
                variants[name](g)
            torch.cuda.synchronize()
        gbps[name] = 20 * k * nbytes / (time.perf_counter() - start) / 1e9
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; expert {nbytes / 1e6:.1f} MB, groups of {k}, "
          f"{args.groups} groups; host us per copy queued (median, p90); batched copies landed intact: {ok}")
    base = statistics.median(times["torch copy_"])
    summary = {}
    for name, t in times.items():
        t = sorted(t)
        med, p90 = statistics.median(t), t[int(0.9 * len(t))]
        summary[name] = {"median_us": med, "p90_us": p90, "vs_torch_copy": med / base}
        print(f"  {name:21s} {med:6.2f} {p90:6.2f}   {med / base:.2f}x of torch copy_")
    print("  PCIe GB/s of whole groups: " + ", ".join(f"{name} {v:.1f}" for name, v in gbps.items()))
    write_result(args.out, {"benchmark": "runtime_copy_issue", "device": torch.cuda.get_device_name(),
                            "expert_mb": nbytes / 1e6, "group": k, "groups": args.groups, "landed_intact": ok,
                            "host_us_per_copy": summary, "group_gbps": gbps})


if __name__ == "__main__":
    main()
