"""Routed experts in host memory: taken off the model, kept per layer, copied to the device an expert (or a stretch
of consecutive ones) at a time.

Shape legend: L MoE layers, E experts per layer, P elements of one packed expert, S device slots.

Two forms, one per kind of fetch the policies compare:
  packed  E x P, pinned when a GPU is present: every parameter of expert e in one contiguous row,
          so one asynchronous copy moves the whole expert at full PCIe bandwidth. Pinned at its exact size
          (``host_zeros``), not through torch's ``pin_memory``, which rounds each block up to a power of two.
  modules the model's own E x ... parameters, pageable: one blocking copy per parameter, which is
          what a per-module offload hook (Accelerate's cpu_offload) does.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from duoserve.discovery import MoELayer
from duoserve.runtime.streams import Streams

T = TypeVar("T")
_ALIGN = 8  # elements: keeps every parameter's offset 16-byte aligned for bf16 grouped GEMMs


@dataclass(frozen=True)
class ExpertLayout:
    """Which per-expert parameters an experts module has, and where each sits in a packed row."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]  # per expert, without the leading E
    offsets: tuple[int, ...]
    numel: int  # P, padded
    dtype: torch.dtype

    @classmethod
    def of(cls, params: dict[str, torch.Tensor]) -> ExpertLayout:
        dtypes = {p.dtype for p in params.values()}
        if len(dtypes) != 1:
            raise ValueError(f"experts parameters mix dtypes {sorted(map(str, dtypes))}; cast the model to one dtype")
        names, shapes, offsets, offset = [], [], [], 0
        for name, p in params.items():
            names.append(name)
            shapes.append(tuple(p.shape[1:]))
            offsets.append(offset)
            offset += math.ceil(p[0].numel() / _ALIGN) * _ALIGN
        return cls(tuple(names), tuple(shapes), tuple(offsets), offset, dtypes.pop())

    @property
    def nbytes(self) -> int:
        """Bytes of one expert (packed)."""
        return self.numel * self.dtype.itemsize

    def views(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-parameter views (N x shape) of packed rows (N x P); no copy."""
        return {name: rows[:, off:off + math.prod(shape)].view(len(rows), *shape)
                for name, shape, off in zip(self.names, self.shapes, self.offsets)}


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Zeros in host memory, page-locked if ``pin``, taking exactly their bytes. torch's ``pin_memory`` allocates
    through its caching host allocator, which rounds every block up to a power of two: a Qwen3-30B-A3B layer's 1.21 GB
    of bf16 experts takes a 2 GiB block, a Mixtral-8x7B layer's 2.82 GB a 4 GiB one. Here the tensor's own
    pages are registered with the CUDA runtime instead (as torch's checkpoint stager does), and unregistered when its
    storage is freed (``benchmarks/pinned_host_memory.py`` measures both)."""
    t = torch.zeros(shape, dtype=dtype)
    if pin and t.numel():
        storage = t.untyped_storage()
        cudart = torch.cuda.cudart()
        if err := int(cudart.cudaHostRegister(storage.data_ptr(), storage.nbytes(), 1)):  # 1: portable
            raise RuntimeError(f"could not page-lock {storage.nbytes() / 1e9:.2f} GB of host memory for expert rows "
                               f"(CUDA error {err}): free host memory, raise the locked-memory limit (ulimit -l), or "
                               "store the experts quantized (--expert-dtype fp8|int4)")
        # not at exit, where the CUDA context may be gone before it
        weakref.finalize(storage, cudart.cudaHostUnregister, storage.data_ptr()).atexit = False
    return t


class Rows:
    """An N x P table's rows as one copy moves them: a row, or a stretch of consecutive ones. The one-row views are
    made once (a fetch is on the decode step's path, where a view costs the host as much as the copy's call)."""

    def __init__(self, table: torch.Tensor):
        self.table = table  # N x P
        self._one = list(table.unbind(0))  # N views of P

    def span(self, start: int, count: int = 1) -> torch.Tensor:
        """Rows ``start`` .. ``start + count - 1`` (P, or count x P)."""
        return self._one[start] if count == 1 else self.table[start:start + count]


def staged(store, streams: Streams) -> bool:
    """Whether ``store``'s copies reach the cache's slots through staging and the dequant stream (a quantized store,
    where there is such a stream: a GPU, or a simulator's clocks): then only that stream writes the slots."""
    return store.dequantizes and streams.dequant is not None


def runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first of ``src``, first of ``dst``, count) for each stretch where both step up by one together: what one copy
    moves. A prefill's groups are mostly such stretches (experts in order, into slots in order), so each takes one
    copy where it took one per expert."""
    n = len(src)
    if n == 1:  # a decode step's misses, mostly: on its path
        return [(src[0], dst[0], 1)]
    spans, start = [], 0
    for i in range(1, n + 1):
        if i == n or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            spans.append((src[start], dst[start], i - start))
            start = i
    return spans


class HostExperts:
    """One MoE layer's routed experts in host memory (packed or per module, see the module docstring)."""

    dequantizes = False  # a quantized store's copies end on the dequant stream (``quant.py``)

    def __init__(self, layout: ExpertLayout, packed: torch.Tensor | None = None,
                 modules: dict[str, torch.Tensor] | None = None):
        self.layout, self.packed, self.modules = layout, packed, modules
        self.rows = Rows(packed) if packed is not None else None  # E x P

    @classmethod
    def pack(cls, params: dict[str, torch.Tensor], pin: bool) -> HostExperts:
        """Packed E x P copy of ``params`` (pinned if ``pin``)."""
        layout = ExpertLayout.of(params)
        E = len(next(iter(params.values())))
        packed = host_zeros((E, layout.numel), layout.dtype, pin)  # E x P
        for name, view in layout.views(packed).items():
            view.copy_(params[name])
        return cls(layout, packed=packed)

    @classmethod
    def as_modules(cls, params: dict[str, torch.Tensor], pin: bool = False) -> HostExperts:
        """The parameters as they are, in host memory: pageable (moved there if elsewhere), or pinned if ``pin``."""
        if pin:
            host = {n: host_zeros(tuple(p.shape), p.dtype, True).copy_(p) for n, p in params.items()}
        else:
            host = {n: p.cpu().contiguous() for n, p in params.items()}
        return cls(ExpertLayout.of(params), modules=host)

    @property
    def row_bytes(self) -> int:
        """Bytes one expert's copy moves (a quantized store's are fewer than the cache slot's)."""
        return self.layout.nbytes

    def copy_group(self, experts: list[int], slots: list[int], rows: Rows, streams: Streams, stream,
                   scratch: dict) -> None:
        """Queue the copies of ``experts`` into cache ``slots`` (``rows``: the cache's S x P rows) on ``stream``:
        packed and pinned, one asynchronous copy per stretch of consecutive experts into consecutive slots
        (``runs``); per module, one blocking copy per parameter and expert. ``scratch``: the cache's buffers for
        stores that stage their copies. A store that dequantizes returns the event its last pass recorded on the
        dequant stream (``ExpertCache.seal`` marks the slots ready with it); this one, None."""
        if self.packed is not None:
            for e, s, n in runs(experts, slots):
                streams.copy_to_device(rows.span(s, n), self.rows.span(e, n), stream)
            return None
        with streams.on(stream):
            for e, s in zip(experts, slots):
                for name, view in self.layout.views(rows.span(s)[None]).items():
                    view[0].copy_(self.modules[name][e])

    def params(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The E x ... parameters, unpacked, on ``device``."""
        if self.modules is not None:
            return {n: p.to(device) for n, p in self.modules.items()}
        return {n: v.to(device).contiguous() for n, v in self.layout.views(self.packed).items()}


def expert_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """The experts module's own per-expert parameters (leading dim E); submodules stay with the model."""
    E = module.num_experts
    return {n: p for n, p in module.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == E}


def take_experts(layers: list[MoELayer], make: Callable[[dict[str, torch.Tensor]], T]) -> list[T]:
    """Move every MoE layer's routed experts off the model into host stores made by ``make``.

    The parameters are removed from their modules (so ``model.to(device)`` leaves them alone) one
    layer at a time, which keeps the extra host memory to one layer; ``put_experts`` restores them.
    """
    stores = []
    for layer in layers:
        params = expert_params(layer.experts)
        if not params:
            raise ValueError(f"{layer.name} has no per-expert parameters to offload")
        stores.append(make({n: p.detach() for n, p in params.items()}))
        for name in params:
            del layer.experts._parameters[name]
    return stores


def put_experts(layers: list[MoELayer], stores: list[HostExperts], device: torch.device | str) -> None:
    """Give each experts module its parameters back, on ``device`` (undoes ``take_experts``)."""
    for layer, store in zip(layers, stores):
        for name, value in store.params(device).items():
            layer.experts.register_parameter(name, nn.Parameter(value, requires_grad=False))


def drop_experts(layers: list[MoELayer]) -> None:
    """Remove the experts modules' parameters again after ``put_experts`` (frees their device memory)."""
    for layer in layers:
        for name in expert_params(layer.experts):
            del layer.experts._parameters[name]

