"""Streams, events and span timers on CUDA, with synchronous stand-ins when the CPU plays the GPU.

On CUDA the runtime uses four streams: compute (the caller's current stream), copy (host-to-device
expert fetches), predict (the predictor) and dequant (quantized experts turned into cache rows as they
land, so the next expert's copy overlaps that work: ``quant.py``). Work is ordered across them with
events only, so the CPU never waits except where it must read a result (the routing, the predictor's choice). On the
CPU every operation runs in program order, so events are ``None`` and waits do nothing.

Expert copies go straight to ``cudaMemcpyAsync`` of the CUDA runtime torch itself loaded: at batch 1 a
decode step is host-bound and queues k copies a layer, and torch's ``copy_`` costs the host more per copy
(docs/benchmarks.md, "host cost of one expert copy"). Where that runtime cannot be found, ``copy_`` is used.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch


class Streams:
    """The runtime's four streams on ``device`` (all the same, and synchronous, on the CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.copy = torch.cuda.Stream(device)
            self.predict = torch.cuda.Stream(device)
            self.dequant = torch.cuda.Stream(device)
        else:
            self.compute = self.copy = self.predict = self.dequant = None
        # the runtime call queues on the current device's context: the engine's device must be current
        self._memcpy = runtime_memcpy() if self.cuda and device.index in (None, torch.cuda.current_device()) \
            else None

    @property
    def cache_device(self) -> torch.device:
        """Where the expert cache's slots live: the device (a simulator's streams put them nowhere: meta)."""
        return self.device

    def on(self, stream):
        """Context that makes ``stream`` current (nothing on the CPU)."""
        return torch.cuda.stream(stream) if self.cuda else nullcontext()

    def record(self, stream=None) -> torch.cuda.Event | None:
        """An event marking the work queued so far on ``stream`` (default: compute)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream or self.compute)
        return event

    @staticmethod
    def wait(stream, event: torch.cuda.Event | None) -> None:
        """Make ``stream`` wait for ``event`` (no-op for ``None``)."""
        if event is not None:
            stream.wait_event(event)

    @property
    def copy_path(self) -> str:
        """How ``copy_to_device`` queues a copy: "cudaMemcpyAsync" (the runtime, directly) or "torch copy_"."""
        return "torch copy_" if self._memcpy is None else "cudaMemcpyAsync"

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        """Queue the copy of host or device tensor ``src`` into device tensor ``dst`` (both contiguous, same size)
        on ``stream``, without blocking the host where ``src`` is pinned or on the device. The runtime call records
        nothing with torch's allocators, so both must outlive the copy: expert stores, the cache and its staging
        buffers do, as the engine synchronises its streams on exit."""
        if self._memcpy is None:
            with self.on(stream):
                dst.copy_(src, non_blocking=self.cuda)
        elif error := self._memcpy(dst.data_ptr(), src.data_ptr(), src.nbytes,
                                   _DEVICE_TO_DEVICE if src.is_cuda else _HOST_TO_DEVICE, stream.cuda_stream):
            raise RuntimeError(f"cudaMemcpyAsync failed with CUDA error {error}")

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


_HOST_TO_DEVICE, _DEVICE_TO_DEVICE = 1, 3  # cudaMemcpyKind


def cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded (torch's own, so its streams are ours), or None where none is
    found (a runtime linked into torch statically, a system without /proc)."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "/libcudart.so" in line), None)
        return None if path is None else ctypes.CDLL(path)
    except OSError:
        return None


def runtime_memcpy():
    """``cudaMemcpyAsync`` of ``cuda_runtime()``, or None where there is none."""
    memcpy = getattr(cuda_runtime(), "cudaMemcpyAsync", None)
    if memcpy is not None:
        memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        memcpy.restype = ctypes.c_int
    return memcpy


class SpanTimer:
    """Total time of marked spans of one stream's work: CUDA events, read once at ``total_ms``."""

    def __init__(self, streams: Streams):
        self.streams = streams
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._cpu_ms = 0.0

    @contextmanager
    def span(self, stream=None) -> Iterator[None]:
        if not self.streams.cuda:
            start = time.perf_counter()
            yield
            self._cpu_ms += (time.perf_counter() - start) * 1e3
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = stream or self.streams.compute
        begin.record(stream)
        yield
        end.record(stream)
        self._pairs.append((begin, end))

    def total_ms(self) -> float:
        """Sum of all spans so far (synchronises the device once)."""
        if self._pairs:
            self.streams.synchronize()
            self._cpu_ms += sum(b.elapsed_time(e) for b, e in self._pairs)
            self._pairs.clear()
        return self._cpu_ms


class CpuSections:
    """Host time per named section of the engine (where the CPU waits or works between launches), in milliseconds:
    ``clock`` read at each end, ``ms_per_tick`` of it a millisecond (default: wall time in seconds; the offload
    simulator gives its simulated host clock, in ms). The clock is called as given, no wrapper around it: a decode
    step enters several sections a layer."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, ms_per_tick: float = 1e3):
        self.ms: dict[str, float] = {}
        self.clock, self.ms_per_tick = clock, ms_per_tick

    def __call__(self, name: str) -> _Section:
        return _Section(self, name)

    def add(self, name: str, ms: float) -> None:
        self.ms[name] = self.ms.get(name, 0.0) + ms


class _Section:
    """One timed section: a plain class, as a generator-based context costs more host time per use, and a decode
    step enters several sections a layer."""

    __slots__ = ("mark", "name", "sections", "start")

    def __init__(self, sections: CpuSections, name: str):
        self.sections, self.name = sections, name

    def __enter__(self) -> None:
        # named in a profiler's trace when one records (benchmarks/runtime_profile.py); one flag read otherwise
        self.mark = torch.autograd.profiler.record_function(self.name) \
            if torch.autograd.profiler._is_profiler_enabled else None
        if self.mark is not None:
            self.mark.__enter__()
        self.start = self.sections.clock()

    def __exit__(self, *exc) -> None:
        sections, ms = self.sections, self.sections.ms  # inline, not ``add``: one call fewer a section
        ms[self.name] = ms.get(self.name, 0.0) + (sections.clock() - self.start) * sections.ms_per_tick
        if self.mark is not None:
            self.mark.__exit__(*exc)


class EngineTimers:
    """What the engine times: stalls waiting for copies and the predictor (device spans), and its host sections."""

    def __init__(self, streams: Streams):
        self.streams = streams
        self.reset()

    def reset(self) -> None:
        self.stall, self.predict, self.cpu = SpanTimer(self.streams), SpanTimer(self.streams), CpuSections()


class _Nothing:
    """A context that does nothing, and a section timer's and a span timer's interface that time nothing."""

    ms: dict[str, float] = {}

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None

    def __call__(self, name: str = "") -> _Nothing:
        return self

    def span(self, stream=None) -> _Nothing:
        return self

    def total_ms(self) -> float:
        return 0.0


class NullTimers:
    """``EngineTimers`` that time nothing, for callers that keep their own clocks (the offload simulator): the hot
    path then pays no timer."""

    stall = predict = cpu = _Nothing()

    def reset(self) -> None:
        return None
