"""Quantized experts: fewer bytes per expert in host memory and over PCIe, dequantized on the device as they land.

Shape legend: E experts, R x C one weight matrix of an expert, Q bytes of one stored expert, P elements of
the cache's (unquantized) packed expert, n experts at once.

Formats (``EXPERT_DTYPES``):
  model the model's own dtype (bf16 on a GPU), as it is: no codec (``HostExperts.pack``).
  fp8   float8 e4m3 with one float32 scale per 128 x 128 block of each weight matrix (a whole dimension where it is
        not a multiple of 128), the scale being what a block's fp8 values are multiplied by: the layout of the
        official FP8 checkpoints (Qwen3-30B-A3B-FP8's ``weight_scale_inv``). 1 byte a weight plus 1/4096 of scales.
  int4  weight-only, symmetric, one float32 scale per group of 128 consecutive weights along a matrix's last
        dimension (transformers' input dimension; the whole row where it is not a multiple of 128), values -8..7
        stored as value + 8, two per byte, low nibble first (GPTQ's symmetric packing). 0.5 byte a weight + 1/32.
Parameters of one dimension per expert (biases) are stored unquantized.

An expert is one row of Q bytes (``QuantLayout``: where each parameter's codes and scales sit, 16-byte aligned).
A fetch copies those bytes to a device staging buffer on its stream and dequantizes them into the cache slot on
the dequant stream (the cache keeps the model's dtype, so the expert kernels are unchanged: a
dequantize-then-grouped-GEMM path), and ``ExpertCache.seal`` marks the slots ready on the dequant stream.
Staging buffers (``stage_buffers``) take chunks in turn, so the next copies overlap this dequantization: the copy
engine does not idle behind it, nor, for a chunk more, behind a dequantization that waits for its slots' readers.
Only the dequantization waits for the slots' last readers (``ExpertCache.fetch``): with a cache of a layer's worth
of slots (Mixtral's two), the next layer's copies to staging run during this layer's compute.
Dequantizing makes each weight its code (an fp8 value, or an int4 nibble less 8) times its block or group scale, in
float32, rounded once to the cache's dtype. On a GPU it runs as Triton kernels (``dequantizer``): one pass near
the memory bandwidth writes a pass's rows, where eager ops take several over temporaries (the dequantization runs
between an expert's copy and its compute, so its device time adds to both a prefill's and a decode step's). A
decode step is short of host time, so a fetch group is dequantized in passes of up to ``STAGE_ROWS`` experts (and
``STAGE_BYTES`` of cache rows; an expert larger than that, Mixtral's, is a pass of its own), each straight into its
slots (``dequantize_into``, the slot ids uploaded ahead of it) and on a GPU one CUDA-graph replay. ``dequantize`` is
the one implementation, used by the engine and by the reference model the tests compare against, so both round
the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from duoserve.loading import FP8_BLOCK
from duoserve.runtime.store import ExpertLayout, HostExperts, Rows, host_zeros, runs
from duoserve.runtime.streams import Streams

EXPERT_DTYPES = ("model", "fp8", "int4")
BLOCK = FP8_BLOCK  # fp8 block side (that of the FP8 checkpoints read, loading.py) and int4 group size
STAGE_BYTES = 96 << 20  # at most this many bytes of cache rows dequantized per pass of a fetch group, and at most
STAGE_ROWS = 16  # this many experts (device scratch per stream)
RING = 64  # host rows of slot ids a stream's passes upload from in turn
_ALIGN = 16  # bytes: every segment of a stored row starts 16-byte aligned (fp32 scales, vector loads)
_FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(_FP8).max  # 448


def check_expert_dtype(fmt: str) -> str:
    """``fmt`` if it names an expert dtype (``EXPERT_DTYPES``); refuses anything else."""
    if fmt not in EXPERT_DTYPES:
        raise ValueError(f"unknown expert dtype {fmt!r}; choose from {', '.join(EXPERT_DTYPES)}")
    return fmt


def block_side(dim: int) -> int:
    """The fp8 block side and int4 group size along a dimension: 128, or the whole dimension off multiples of it."""
    return BLOCK if dim % BLOCK == 0 else dim


def _aligned(nbytes: int) -> int:
    return math.ceil(nbytes / _ALIGN) * _ALIGN


@dataclass(frozen=True)
class Segment:
    """One parameter in a stored row: its codes at ``offset`` (``nbytes``), its scales after them (``scale_nbytes``)."""

    name: str
    shape: tuple[int, ...]  # per expert
    kind: str  # fp8, int4 or raw (stored in the model's dtype)
    offset: int
    nbytes: int
    scale_offset: int
    scale_nbytes: int

    @property
    def scale_shape(self) -> tuple[int, int]:
        R, C = self.shape
        return (R // block_side(R), C // block_side(C)) if self.kind == "fp8" else (R, C // block_side(C))


@dataclass(frozen=True)
class QuantLayout:
    """Where each parameter of one expert sits in its stored row of ``nbytes`` (Q) bytes."""

    fmt: str
    segments: tuple[Segment, ...]
    nbytes: int

    @classmethod
    def of(cls, layout: ExpertLayout, fmt: str) -> QuantLayout:
        if check_expert_dtype(fmt) == "model":
            raise ValueError("the model's own dtype has no quantized layout")
        segments, offset = [], 0
        for name, shape in zip(layout.names, layout.shapes):
            numel = math.prod(shape)
            kind = fmt if len(shape) == 2 and (fmt == "fp8" or shape[1] % 2 == 0) else "raw"
            nbytes = {"fp8": numel, "int4": numel // 2, "raw": numel * layout.dtype.itemsize}[kind]
            scales = 0
            if kind != "raw":
                R, C = shape
                scales = 4 * (R // block_side(R) if kind == "fp8" else R) * (C // block_side(C))
            segments.append(Segment(name, shape, kind, offset, nbytes, offset + _aligned(nbytes), scales))
            offset += _aligned(nbytes) + _aligned(scales)
        return cls(fmt, tuple(segments), offset)


def quantize(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (n x bytes, uint8) and float32 scales (n x ...) of n matrices ``w`` (n x R x C) in format ``kind``."""
    n, R, C = w.shape
    w = w.float()
    if kind == "fp8":
        br, bc = block_side(R), block_side(C)
        blocks = w.view(n, R // br, br, C // bc, bc)
        scale = blocks.abs().amax(dim=(2, 4)).clamp_min(1e-12) / _FP8_MAX  # n x R/br x C/bc
        codes = (blocks / scale[:, :, None, :, None]).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8)  # n x R/br x br x C/bc x bc
        return codes.view(n, -1).view(torch.uint8), scale
    g = block_side(C)
    groups = w.view(n, R, C // g, g)
    scale = groups.abs().amax(dim=3).clamp_min(1e-12) / 7  # n x R x C/g
    q = (groups / scale[..., None]).round().clamp(-8, 7).to(torch.int16).add(8).view(n, R, C // 2, 2)  # 0..15
    codes = (q[..., 0] | (q[..., 1] << 4)).to(torch.uint8)  # n x R x C/2
    return codes.view(n, -1), scale


def dequantize(stored: torch.Tensor, qlayout: QuantLayout, layout: ExpertLayout, out: torch.Tensor) -> None:
    """Write n stored rows (n x Q uint8) into n packed rows ``out`` (n x P, the cache's dtype), on the current
    stream of their device. Each weight is its code times its scale, computed in float32 and rounded once to the
    cache's dtype. This reads the rows in place (strided views), with float32 temporaries: the CPU's path and the
    reference (a GPU's is ``dequantizer``'s)."""
    n = len(stored)
    views = layout.views(out)
    for seg in qlayout.segments:
        codes = stored[:, seg.offset:seg.offset + seg.nbytes]
        dst = views[seg.name]  # n x shape
        if seg.kind == "raw":
            dst.copy_(codes.contiguous().view(layout.dtype).view(dst.shape))
            continue
        # every segment starts 16-byte aligned and Q is a multiple of 16: a float32 view of the strided rows
        scale = stored[:, seg.scale_offset:seg.scale_offset + seg.scale_nbytes].view(torch.float32)
        R, C = seg.shape
        if seg.kind == "fp8":
            br, bc = block_side(R), block_side(C)
            values = codes.view(_FP8).unflatten(1, (R // br, br, C // bc, bc)).float()  # n x R/br x br x C/bc x bc
            dst.view(n, R // br, br, C // bc, bc).copy_(values * scale.unflatten(1, (R // br, 1, C // bc, 1)))
        else:
            g = block_side(C)
            pairs = codes.unflatten(1, (R, C // 2))  # n x R x C/2: two weights a byte, the low nibble first
            shifts = torch.arange(0, 8, 4, dtype=torch.uint8, device=codes.device)  # 2: no host-to-device copy
            values = ((pairs[..., None] >> shifts) & 15).float() - 8  # n x R x C/2 x 2
            dst.view(n, R, C // g, g).copy_(values.view(n, R, C // g, g) * scale.unflatten(1, (R, C // g, 1)))


def dequantize_into(stored: torch.Tensor, slots: torch.Tensor, qlayout: QuantLayout, layout: ExpertLayout,
                    table: torch.Tensor) -> None:
    """Write n stored rows (n x Q uint8) into rows ``slots`` (n, int64, on its device) of ``table`` (S x P, the
    cache's rows): ``dequantize`` into scratch rows (padding zeroed), then scattered (on a GPU: ``dequantizer``)."""
    rows = torch.zeros(len(stored), layout.numel, dtype=layout.dtype, device=table.device)  # n x P
    dequantize(stored, qlayout, layout, rows)
    table.index_copy_(0, slots, rows)


def dequantizer(device: torch.device) -> Callable[..., None]:
    """``dequantize_into`` as it runs on ``device``: on a GPU as Triton kernels (``quant_kernels``: one pass over
    the staged rows, writing the slots' rows, near the device's memory bandwidth, where the eager ops take several
    passes over float32 temporaries), elsewhere eager. Both round the same way: tests hold them equal."""
    if device.type != "cuda":
        return dequantize_into
    try:
        from duoserve.runtime import quant_kernels  # Triton: it comes with torch's CUDA builds for Linux
    except ImportError:  # a CUDA build without it: the eager ops, slower
        return dequantize_into
    return quant_kernels.dequantize_into


def stage_chunk(layout: ExpertLayout) -> int:
    """Experts of ``layout`` a quantized fetch dequantizes per pass (0: one over ``STAGE_BYTES``, a pass of one)."""
    return min(STAGE_ROWS, STAGE_BYTES // layout.nbytes)


def chunks(items: list[int], chunk: int) -> list[list[int]]:
    """``items`` in the passes a quantized fetch takes them in: runs of ``chunk`` (``stage_chunk``; 0: one each)."""
    step = max(chunk, 1)
    return [items[i:i + step] for i in range(0, len(items), step)]


def stage_buffers(layout: ExpertLayout) -> int:
    """Staging buffers a stream takes in turn for experts of ``layout``. Two let a copy overlap the last pass's
    dequantization; a third lets a prefill's look-ahead copy on while a dequantization waits for its slots' last
    compute (Qwen3-30B-A3B's int4 at 96 slots, B=8, simulated on the H200 profile: TTFT 330 ms with two, 307 with
    three, 305 with four). Two where an expert is a pass of its own (over ``STAGE_BYTES``, Mixtral's): a buffer is
    then a whole expert, and its caches hold a few slots, with no look-ahead to feed."""
    return 3 if stage_chunk(layout) else 2


def stored_nbytes(layout: ExpertLayout, fmt: str) -> int:
    """Bytes one expert of ``layout`` takes stored in ``fmt`` (model: its packed row)."""
    return layout.nbytes if check_expert_dtype(fmt) == "model" else QuantLayout.of(layout, fmt).nbytes


class QuantizedExperts(HostExperts):
    """One MoE layer's routed experts stored quantized (``stored``: E x Q uint8, pinned with a GPU); a fetch copies
    an expert's Q bytes and dequantizes them into the cache's slot row (see the module docstring)."""

    dequantizes = True

    def __init__(self, layout: ExpertLayout, qlayout: QuantLayout, stored: torch.Tensor):
        super().__init__(layout, packed=stored)
        self.qlayout = qlayout
        self.chunk = stage_chunk(layout)

    @property
    def row_bytes(self) -> int:
        return self.qlayout.nbytes

    @classmethod
    def quantize(cls, params: dict[str, torch.Tensor], fmt: str, pin: bool) -> QuantizedExperts:
        """``params`` (E x ... each, on any device: quantized there, a GPU being fastest) stored in ``fmt``."""
        layout = ExpertLayout.of(params)
        qlayout = QuantLayout.of(layout, fmt)
        E = len(next(iter(params.values())))
        stored = host_zeros((E, qlayout.nbytes), torch.uint8, pin)  # E x Q
        for seg in qlayout.segments:
            p = params[seg.name]
            if seg.kind == "raw":
                stored[:, seg.offset:seg.offset + seg.nbytes] = p.reshape(E, -1).contiguous().view(torch.uint8).cpu()
                continue
            codes, scale = quantize(p, seg.kind)
            stored[:, seg.offset:seg.offset + seg.nbytes] = codes.cpu()
            stored[:, seg.scale_offset:seg.scale_offset + seg.scale_nbytes] = \
                scale.reshape(E, -1).contiguous().view(torch.uint8).cpu()
        return cls(layout, qlayout, stored)

    def _stage(self, table: torch.Tensor, stream, scratch: dict) -> _Staging:
        """The staging buffers of ``stream`` in ``scratch`` (the cache's, whose rows are ``table``), shared by every
        layer's store of this format and layout (one fetch runs at a time on a stream; stream order and the buffers'
        read events keep reuse safe)."""
        key = (id(stream), self.qlayout, self.layout, self.chunk)
        if key not in scratch:
            scratch[key] = _Staging(self, table, max(self.chunk, 1))
        return scratch[key]

    def copy_group(self, experts: list[int], slots: list[int], rows: Rows, streams: Streams, stream,
                   scratch: dict):
        """Queue on ``stream`` the copies of ``experts``' stored rows to staging (unless ``stage`` queued them) and,
        on the dequant stream, their dequantization into cache ``slots`` (``rows``: the cache's S x P rows), a pass
        per chunk of experts, each copy moving a stretch of consecutive rows (``runs``); ``scratch``: the cache's
        device buffers for it. Returns the event after the last pass (the slots' ready event,
        ``ExpertCache.seal``)."""
        stage = self._stage(rows.table, stream, scratch)
        work = streams.dequant if streams.dequant is not None else stream
        step, done = max(self.chunk, 1), None
        for i in range(0, len(experts), step):  # ``chunks``' passes, inline: a decode step's fetches are on this path
            chunk, targets = experts[i:i + step], slots[i:i + step]
            found = stage.staged.pop((self, tuple(chunk)), None) if stage.staged else None
            b, copied = found if found is not None else self._copy(chunk, stage, streams, stream)
            streams.wait(work, copied)
            with streams.on(work):
                stage.dequantize(b, targets, streams, work)
            done = stage.read[b]
        stage.staged.clear()  # what was staged for another group would be stale by its fetch
        return done

    def stage(self, experts: list[int], rows: Rows, streams: Streams, stream, scratch: dict) -> None:
        """Queue on ``stream`` the copies of the first chunks of ``experts`` to staging, as many chunks as there are
        buffers, before any slot is chosen for them: the next ``copy_group`` of the same experts (in the same order)
        then only dequantizes them. A prefill call stages its first fetched group while it computes its cached
        experts, which must run before their slots can be refilled (``schedule.py``)."""
        stage = self._stage(rows.table, stream, scratch)
        for chunk in chunks(experts, self.chunk)[:len(stage.read)]:
            stage.staged[self, tuple(chunk)] = self._copy(chunk, stage, streams, stream)

    def _copy(self, chunk: list[int], stage: _Staging, streams: Streams, stream) -> tuple[int, object]:
        """Queue the copies of ``chunk``'s stored rows into the next staging buffer once its last pass has read it;
        (the buffer, the event after the copies)."""
        b = stage.take()
        streams.wait(stream, stage.read[b])  # its last dequantization has read this staging buffer
        for e, j, count in runs(chunk, range(len(chunk))):
            streams.copy_to_device(stage.stored[b].span(j, count), self.rows.span(e, count), stream)
        return b, streams.record(stream)

    def params(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The E x ... parameters, dequantized, on ``device`` (the model put back holds what the engine computed)."""
        rows = torch.zeros(len(self.packed), self.layout.numel, dtype=self.layout.dtype, device=device)  # E x P
        fn, first = dequantizer(rows.device), torch.zeros(1, dtype=torch.int64, device=device)
        for e in range(len(rows)):  # an expert at a time: eager temporaries stay one expert's
            fn(self.packed[e:e + 1].to(device), first, self.qlayout, self.layout, rows[e:e + 1])
        return {n: v.contiguous() for n, v in self.layout.views(rows).items()}


class _Staging:
    """Device buffers for one stream's fetches into one cache's rows (``table``), ``stage_buffers`` of each, taken in
    turn so copies run ahead of the dequantizations: ``stored`` (chunk x Q bytes), ``slots`` (chunk slot ids, what
    each pass reads) and the event of each buffer's last read. A pass dequantizes its n staged experts straight into
    their slots (``dequantize_into``), the slot ids uploaded from a ring of ``RING`` host rows ahead of it. On a GPU
    a pass is a CUDA graph per (buffer, n), captured at its first pass: one launch and one small copy where eager ops
    take several per parameter, plus the views around them, in host time, which a decode step's prefetch is short
    of."""

    def __init__(self, store: QuantizedExperts, table: torch.Tensor, chunk: int):
        self.qlayout, self.layout, self.table = store.qlayout, store.layout, table
        device, cuda = table.device, table.device.type == "cuda"
        count = stage_buffers(store.layout)
        self.stored = [Rows(torch.empty(chunk, store.row_bytes, dtype=torch.uint8, device=device))
                       for _ in range(count)]
        self.slots = list(torch.zeros(count, chunk, dtype=torch.int64, device=device).unbind(0))
        ring = torch.zeros(RING, chunk, dtype=torch.int64, pin_memory=cuda)  # RING x chunk, on the host
        self._ring_rows, self._ring_np = list(ring.unbind(0)), ring.numpy()
        self._ring_read: list = [None] * RING  # per ring row: an event after the pass that read its upload
        self._ring_next = 0
        self.read: list = [None] * count
        self._next = 0
        self.staged: dict[tuple, tuple[int, object]] = {}  # (store, chunk) -> (buffer, copied event): ``stage``'s
        self.fn = dequantizer(device)
        # one memory pool (the kernels' small scratch): the graphs replay one after another on one stream
        self._pool = torch.cuda.graph_pool_handle() if cuda else None
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    def take(self) -> int:
        """The buffer to use next (what was staged in it is overwritten)."""
        self._next = b = (self._next + 1) % len(self.read)
        if self.staged:
            self.staged = {key: found for key, found in self.staged.items() if found[0] != b}
        return b

    def dequantize(self, b: int, targets: list[int], streams: Streams, stream) -> None:
        """Dequantize ``stored[b][:n]`` into the table's rows ``targets`` (n slots) on ``stream``, the current one,
        and mark the buffer read after it (``read[b]``)."""
        r, n = self._ring_next, len(targets)
        self._ring_next = (r + 1) % RING
        if (done := self._ring_read[r]) is not None:
            done.synchronize()  # this ring row's upload of RING passes ago has been read (long done)
        self._ring_np[r, :n] = targets
        streams.copy_to_device(self.slots[b], self._ring_rows[r], stream)
        if (graph := self._graphs.get((b, n))) is not None:
            graph.replay()
        else:
            args = (self.stored[b].table[:n], self.slots[b][:n], self.qlayout, self.layout, self.table)
            self.fn(*args)  # this pass's work, and the kernels' warm-up (and their compile)
            if self._pool is not None:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):  # synchronises the device: once per (buffer, n)
                    self.fn(*args)
                self._graphs[b, n] = graph
        self.read[b] = self._ring_read[r] = streams.record(stream)


def make_store(params: dict[str, torch.Tensor], fmt: str, pin: bool) -> HostExperts:
    """A packed host store of ``params`` in expert dtype ``fmt`` (``EXPERT_DTYPES``)."""
    if fmt == "model":
        return HostExperts.pack(params, pin)
    return QuantizedExperts.quantize(params, fmt, pin)
