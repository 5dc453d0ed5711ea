"""Probe: a quantized expert fetch as one kernel reading pinned host memory in place (zero-copy over PCIe) and
dequantizing straight into cache slots, against the staged path (copy engine -> staging -> dequant -> slot copy).

    python3 benchmarks/zero_copy_probe.py
"""

from __future__ import annotations

import ctypes
import time

import torch
import triton
import triton.language as tl

from duoserve.runtime.quant import QuantizedExperts, dequantize
from duoserve.runtime.store import Rows
from duoserve.runtime.streams import Streams


def device_pointer(t: torch.Tensor) -> int:
    with open("/proc/self/maps") as maps:
        path = next(line.split()[-1] for line in maps if "/libcudart.so" in line)
    fn = ctypes.CDLL(path).cudaHostGetDevicePointer
    fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint]
    out = ctypes.c_void_p()
    err = fn(ctypes.byref(out), ctypes.c_void_p(t.data_ptr()), 0)
    assert err == 0, err
    return out.value


class Ptr:
    def __init__(self, ptr: int, dtype: torch.dtype):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


@triton.jit
def fp8_tiles(src, idx, dst, row_q, row_p, seg_off, scale_off, out_off, C: tl.constexpr, SC: tl.constexpr,
              BR: tl.constexpr, BC: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr):
    j = tl.program_id(0)
    t = tl.program_id(1)
    e = tl.load(idx + 2 * j).to(tl.int64)
    s = tl.load(idx + 2 * j + 1).to(tl.int64)
    tr = t // (C // TC)
    tc = t % (C // TC)
    rows = tr * TR + tl.arange(0, TR)
    cols = tc * TC + tl.arange(0, TC)
    base = src + e * row_q
    codes = tl.load(base + seg_off + rows[:, None] * C + cols[None, :])
    scale = tl.load((base + scale_off + 4 * ((tr * TR // BR) * SC + tc * TC // BC)).to(tl.pointer_type(tl.float32)))
    x = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
    tl.store(dst + s * row_p + out_off + rows[:, None] * C + cols[None, :], x.to(tl.bfloat16))


@triton.jit
def int4_tiles(src, idx, dst, row_q, row_p, seg_off, scale_off, out_off, C: tl.constexpr, G: tl.constexpr,
               TR: tl.constexpr, TC: tl.constexpr):
    j = tl.program_id(0)
    t = tl.program_id(1)
    e = tl.load(idx + 2 * j).to(tl.int64)
    s = tl.load(idx + 2 * j + 1).to(tl.int64)
    tr = t // (C // TC)
    tc = t % (C // TC)
    rows = tr * TR + tl.arange(0, TR)
    bcols = tc * (TC // 2) + tl.arange(0, TC // 2)
    base = src + e * row_q
    b = tl.load(base + seg_off + rows[:, None] * (C // 2) + bcols[None, :]).to(tl.int32)
    v = tl.reshape(tl.join((b & 15) - 8, (b >> 4) - 8), (TR, TC)).to(tl.float32)
    scale = tl.load((base + scale_off).to(tl.pointer_type(tl.float32)) + rows * (C // G) + tc * TC // G)
    cols = tc * TC + tl.arange(0, TC)
    tl.store(dst + s * row_p + out_off + rows[:, None] * C + cols[None, :], (v * scale[:, None]).to(tl.bfloat16))


def zero_copy_fetch(store: QuantizedExperts, host_ptr: int, idx_ptr, cache: torch.Tensor, n: int, TR=16, TC=128):
    for seg in store.qlayout.segments:
        R, C = seg.shape
        out_off = store.layout.offsets[store.layout.names.index(seg.name)]
        if seg.kind == "fp8":
            BR, BC = (128 if R % 128 == 0 else R), (128 if C % 128 == 0 else C)
            fp8_tiles[(n, (R // TR) * (C // TC))](
                Ptr(host_ptr, torch.uint8), idx_ptr, cache, store.qlayout.nbytes, store.layout.numel, seg.offset,
                seg.scale_offset, out_off, C=C, SC=C // BC, BR=BR, BC=BC, TR=TR, TC=TC)
        else:
            G = 128 if C % 128 == 0 else C
            int4_tiles[(n, (R // TR) * (C // TC))](
                Ptr(host_ptr, torch.uint8), idx_ptr, cache, store.qlayout.nbytes, store.layout.numel, seg.offset,
                seg.scale_offset, out_off, C=C, G=G, TR=TR, TC=TC)


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    host, dev = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        b.record()
        torch.cuda.synchronize()
        dev.append(a.elapsed_time(b) * 1e3)
    host.sort(), dev.sort()
    return host[len(host) // 2], dev[len(dev) // 2]


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    E, H, I, n = 128, 2048, 768, 8  # Qwen3-30B-A3B experts, B=1 top-8
    params = {"gate_up_proj": torch.randn(E, 2 * I, H, dtype=torch.bfloat16, device=dev) * 0.02,
              "down_proj": torch.randn(E, H, I, dtype=torch.bfloat16, device=dev) * 0.02}
    streams = Streams(dev)
    bw = torch.empty(n, 2 * I * H + H * I, dtype=torch.bfloat16).pin_memory()
    bdst = torch.empty_like(bw, device=dev)
    for fmt in ("fp8", "int4"):
        store = QuantizedExperts.quantize(params, fmt, pin=True)
        cache = torch.zeros(32, store.layout.numel, dtype=torch.bfloat16, device=dev)
        rows = Rows(cache)
        experts = torch.randperm(E)[:n].tolist()
        slots = list(range(3, 3 + n))
        scratch = {}

        def staged():
            store.copy_group(experts, slots, rows, streams, streams.copy, scratch)
            streams.wait(streams.compute, streams.record(streams.dequant))

        h, d = timed(staged)
        ref = cache[slots].clone()
        print(f"{fmt} staged:    host {h:7.1f} us  device {d:7.1f} us  ({n} experts, {store.row_bytes / 1e6:.2f} MB each)")
        cache.zero_()
        host_ptr = device_pointer(store.packed)
        idx = torch.tensor([v for pair in zip(experts, slots) for v in pair], dtype=torch.int32).pin_memory()
        idx_ptr = Ptr(device_pointer(idx), torch.int32)
        for TR, TC in ((16, 128), (32, 128), (8, 256), (64, 128)):
            h, d = timed(lambda: zero_copy_fetch(store, host_ptr, idx_ptr, cache, n, TR, TC))
            ok = torch.equal(cache[slots], ref)
            print(f"{fmt} zero-copy TR={TR} TC={TC}: host {h:7.1f} us  device {d:7.1f} us  "
                  f"{n * store.row_bytes / d / 1e3:.1f} GB/s  equal={ok}")
        check = torch.empty(n, store.layout.numel, dtype=torch.bfloat16, device=dev)
        dequantize(store.packed[experts].to(dev), store.qlayout, store.layout, check)
        print(f"{fmt} reference equal: {torch.equal(check, ref)}")
    h, d = timed(lambda: [streams.copy_to_device(bdst[j], bw[j], torch.cuda.current_stream()) for j in range(n)])
    print(f"bf16 memcpy: host {h:7.1f} us  device {d:7.1f} us  {bw.nbytes / d / 1e3:.1f} GB/s")


if __name__ == "__main__":
    main()
