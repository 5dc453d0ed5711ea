"""The quantized experts' dequantization on a CUDA device (``quant.dequantize_into``), as Triton kernels.

Shape legend: n experts in a pass, Q bytes of a stored expert, S cache slots, P elements of a packed expert,
R x C one weight matrix.

A pass reads its staged rows (n x Q bytes) once and writes its slots' cache rows once: per weight matrix one
kernel whose programs each take a stretch of one expert's codes, so loads and stores are contiguous and the pass
runs near the device's memory bandwidth (``benchmarks/dequant_speed.py``: about twice the floor); the eager torch
ops take several passes over float32 temporaries, and ``torch.compile``'s kernel of them ran 2.5x slower than
those on Mixtral's large experts (an H100). Each weight is its code times its scale in float32, rounded once to
the cache's dtype, as ``quant.dequantize`` computes it on the CPU: tests hold the two equal bit for bit. Imported
on CUDA devices only (Triton comes with torch's CUDA builds for Linux).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from duoserve.runtime.quant import block_side

BLOCK = 1024  # codes (fp8) or bytes (int4, two codes each) a program dequantizes


@triton.jit
def _fp8(stored, scales, slots, table, row_bytes, row_floats, P, numel, C, br, bc, code_at, scale_at, dst_at,
         BLOCK: tl.constexpr):
    e = tl.program_id(1)  # the expert; axis 0 takes the blocks, as a grid's axis 1 stops at 65535
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # positions in the R x C matrix
    live = i < numel
    r, c = i // C, i % C
    code = tl.load(stored + e * row_bytes + code_at + i, mask=live)
    scale = tl.load(scales + e * row_floats + scale_at + (r // br) * (C // bc) + c // bc, mask=live)
    value = code.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
    slot = tl.load(slots + e)
    tl.store(table + slot * P + dst_at + i, value.to(table.dtype.element_ty), mask=live)


@triton.jit
def _int4(stored, scales, slots, table, row_bytes, row_floats, P, nbytes, half_c, groups, half_g, code_at, scale_at,
          dst_at, BLOCK: tl.constexpr):
    e = tl.program_id(1)
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # bytes of the matrix: weights 2j and 2j + 1
    live = j < nbytes
    code = tl.load(stored + e * row_bytes + code_at + j, mask=live)
    # both weights of a byte share a group (the group size is even): row j // (C/2), group (j % (C/2)) // (g/2)
    scale = tl.load(scales + e * row_floats + scale_at + (j // half_c) * groups + (j % half_c) // half_g, mask=live)
    low = ((code & 15).to(tl.float32) - 8) * scale
    high = ((code >> 4).to(tl.float32) - 8) * scale
    slot = tl.load(slots + e)
    tl.store(table + slot * P + dst_at + tl.interleave(2 * j, 2 * j + 1),
             tl.interleave(low, high).to(table.dtype.element_ty), mask=tl.interleave(live, live))


def dequantize_into(stored: torch.Tensor, slots: torch.Tensor, qlayout, layout, table: torch.Tensor) -> None:
    """``quant.dequantize_into`` on a CUDA device: n stored rows (n x Q uint8, contiguous) into rows ``slots`` (n,
    int64) of ``table`` (S x P), on the current stream."""
    n, Q = stored.shape
    scales = stored.view(torch.float32)  # n x Q/4: every segment's scales start 16-byte aligned
    at = dict(zip(layout.names, layout.offsets))
    for seg in qlayout.segments:
        dst_at = at[seg.name]
        if seg.kind == "raw":  # biases: stored as they are
            numel = math.prod(seg.shape)
            rows = stored[:, seg.offset:seg.offset + seg.nbytes].contiguous().view(layout.dtype)  # n x numel
            table[:, dst_at:dst_at + numel].index_copy_(0, slots, rows)
            continue
        R, C = seg.shape
        br, bc = block_side(R), block_side(C)
        common = (stored, scales, slots, table, Q, Q // 4, table.shape[1])
        if seg.kind == "fp8":
            _fp8[(triton.cdiv(R * C, BLOCK), n)](*common, R * C, C, br, bc, seg.offset, seg.scale_offset // 4, dst_at,
                                                 BLOCK=BLOCK)
        else:
            nbytes = R * C // 2
            _int4[(triton.cdiv(nbytes, BLOCK), n)](*common, nbytes, C // 2, C // bc, bc // 2, seg.offset,
                                                   seg.scale_offset // 4, dst_at, BLOCK=BLOCK)
