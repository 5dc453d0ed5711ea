"""The offload simulator's stand-ins for the runtime's streams, expert stores, expert compute and timers: they do no
work and hold no data, but advance clocks by a device profile's costs (``costs.py``); ``simulate.py`` says
what each one models.

Shape legend: S cache slots.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple

import numpy as np
import torch

from duoserve.bench.costs import Costs
from duoserve.runtime.quant import chunks, stage_buffers, stage_chunk, stored_nbytes
from duoserve.runtime.store import ExpertLayout, runs
from duoserve.runtime.streams import CpuSections, NullTimers


class _Event(NamedTuple):
    owner: SimStreams
    t: float  # ms: when the work queued before it ends

    def synchronize(self) -> None:
        """The host waits for it."""
        self.owner.host = max(self.owner.host, self.t)


class _Clock:
    """A simulated stream: the time its queued work ends."""

    __slots__ = ("owner", "t")

    def __init__(self, owner: SimStreams):
        self.owner, self.t = owner, 0.0

    def wait_event(self, event: _Event) -> None:
        self.owner.wait(self, event)


class SimStreams:
    """The ``Streams`` interface over clocks (module docstring); ``host`` is the host's clock, in ms."""

    cuda = False
    copy_path = "simulated"

    def __init__(self):
        self.device = torch.device("cpu")  # where a trained predictor runs
        self.cache_device = torch.device("meta")  # the cache's slots take no memory
        self.host, self.stall_ms = 0.0, 0.0
        self.compute, self.copy, self.predict, self.dequant = (_Clock(self) for _ in range(4))

    def on(self, stream):
        return nullcontext()

    # comparisons, not max(): these run several times per simulated layer call, and a builtin call costs more
    def record(self, stream=None) -> _Event:
        t = (stream or self.compute).t
        return _Event(self, t if t > self.host else self.host)

    def wait(self, stream: _Clock, event: _Event | None) -> None:
        if event is None:
            return
        start = stream.t if stream.t > self.host else self.host
        if event.t > start:
            if stream is self.compute:
                self.stall_ms += event.t - start
            start = event.t
        stream.t = start

    def run(self, stream: _Clock, ms: float, copy: bool = False) -> None:
        """``ms`` of work queued now on ``stream``; a ``copy`` on the compute stream stalls its compute."""
        stream.t = max(stream.t, self.host) + ms
        if copy and stream is self.compute:
            self.stall_ms += ms

    def replay(self, wall_ms: float, device_ms: float) -> None:
        """Work the host spends ``wall_ms`` on before it launches ``device_ms`` of kernels at once (a CUDA graph's
        replay, at the end of that host time): they run after it, behind what the stream holds."""
        self.host += wall_ms
        self.compute.t = max(self.compute.t, self.host) + device_ms

    def launch(self, wall_ms: float, device_ms: float) -> None:
        """Work the host spends ``wall_ms`` launching onto the compute stream, ``device_ms`` of kernels there: they
        run as the host launches them (behind what the stream holds), ending no earlier than the last launch."""
        start, self.host = self.host, self.host + wall_ms
        self.compute.t = max(max(self.compute.t, start) + device_ms, self.host)

    def block(self, stream: _Clock) -> None:
        """The host waits for ``stream``'s work so far."""
        self.host = max(self.host, stream.t)

    def synchronize(self) -> None:
        self.host = max(self.host, self.compute.t, self.copy.t, self.predict.t, self.dequant.t)


class SimStore:
    """One MoE layer's experts as the simulator sees them: what a copy moves and costs (no data)."""

    def __init__(self, layout: ExpertLayout, costs: Costs, packed: bool, fmt: str = "model"):
        self.layout, self.costs, self.fmt = layout, costs, fmt
        self.host_ms = costs.copy_host_ms  # per expert fetched; the simulator sets its cache's fetch cost
        self.pass_host_ms = costs.dequant_host_ms.get(fmt)  # per dequantization pass (None: one copy's queueing)
        self.packed = torch.empty(0, device="meta") if packed else None  # what the scheduler checks a policy against
        self.modules = None if packed else {}
        self.dequantizes = fmt != "model"
        self.row_bytes = stored_nbytes(layout, fmt)
        self.chunk = stage_chunk(layout)  # experts a quantized fetch dequantizes per pass
        self.buffers = stage_buffers(layout)  # its staging buffers

    def copy_group(self, experts: list[int], slots: list[int], rows, streams: SimStreams, stream,
                   scratch) -> _Event | None:
        """n experts in r copies (``runs``: a stretch of consecutive experts into consecutive slots is one), each
        queued by the host (``host_ms``) and then run on ``stream`` (``copy`` an expert), a quantized store's
        dequantization passes each costing the host ``pass_host_ms``: in closed form, for plain stores, the last
        ends at max(t0 + n copy, h + host + n copy, h + r host + last copy) for a stream at t0 and the host at h
        (the latest of the stream's own work, the first copy's queueing and the last one's). A quantized store
        returns its last pass's event, as ``QuantizedExperts.copy_group`` does."""
        costs, n = self.costs, len(experts)
        if self.packed is None:  # a blocking copy from pageable memory per parameter, each waited for
            streams.run(stream, n * costs.module_copy_ms, copy=True)
            streams.block(stream)
            return None
        host, copy = self.host_ms, costs.copy_ms(self.row_bytes)
        if self.dequantizes:  # as ``QuantizedExperts.copy_group``: chunks to its staging buffers (``stage_buffers``) in
            # turn (or found there, ``stage``), each chunk dequantized straight into its slots on its own stream once it
            # lands (their ids uploaded first: one more copy); a buffer is refilled once its last chunk is read
            staging = self._staging(stream, scratch)
            b = None
            for chunk in chunks(experts, self.chunk):
                found = staging["staged"].pop((self, tuple(chunk)), None)
                b, copied = found if found is not None else self._copy_chunk(chunk, staging, streams, stream)
                streams.wait(streams.dequant, copied)
                streams.host += host if self.pass_host_ms is None else self.pass_host_ms
                streams.run(streams.dequant, len(chunk) * costs.dequant_ms[self.fmt])
                staging["read"][b] = streams.record(streams.dequant)
            staging["staged"].clear()
            return staging["read"][b]
        spans = runs(experts, slots)
        h = streams.host
        streams.host = h + len(spans) * host
        start = stream.t
        stream.t = max(start + n * copy, h + host + n * copy, h + len(spans) * host + spans[-1][2] * copy)
        if stream is streams.compute:
            streams.stall_ms += n * copy

    def stage(self, experts: list[int], rows, streams: SimStreams, stream, scratch) -> None:
        """As ``QuantizedExperts.stage``: the first chunks of ``experts`` copied to staging buffers, as many as there
        are buffers, for the next ``copy_group`` of them to dequantize."""
        staging = self._staging(stream, scratch)
        for chunk in chunks(experts, self.chunk)[:self.buffers]:
            staging["staged"][self, tuple(chunk)] = self._copy_chunk(chunk, staging, streams, stream)

    def _staging(self, stream, scratch) -> dict:
        return scratch.setdefault(("staging", id(stream)), {"next": 0, "read": [None] * self.buffers, "staged": {}})

    def _copy_chunk(self, chunk: list[int], staging: dict, streams: SimStreams, stream) -> tuple[int, _Event]:
        """Copy ``chunk`` to the next staging buffer once its last chunk is read; (the buffer, the copies' event)."""
        b = staging["next"] = (staging["next"] + 1) % self.buffers
        if staging["staged"]:  # what was staged in it is overwritten
            staging["staged"] = {key: found for key, found in staging["staged"].items() if found[0] != b}
        streams.wait(stream, staging["read"][b])
        for *_, count in runs(chunk, range(len(chunk))):
            streams.host += self.host_ms
            streams.run(stream, count * self.costs.copy_ms(self.row_bytes), copy=True)
        return b, streams.record(stream)


class SimTimers:
    """``EngineTimers`` for a simulation: the engine's host sections (``streams.CpuSections``) on the simulated host
    clock, by the names a ``duoserve-run bench`` run records; no device spans (the simulator keeps its stalls)."""

    stall = predict = NullTimers.stall

    def __init__(self, streams: SimStreams):
        self.streams = streams
        self.reset()

    def reset(self) -> None:
        self.cpu = CpuSections(lambda: self.streams.host, ms_per_tick=1.0)


class SimCompute:
    """The engine's expert compute (``experts.SlotCompute``) as compute-stream time; its host time in the sections
    the engine's compute times (``queue compute``)."""

    graphs = None

    def __init__(self, cache, streams: SimStreams, timers: SimTimers | None, costs: Costs):
        self.cache, self.streams, self.timers, self.costs = cache, streams, timers, costs  # timers None: time nothing
        self.groups = 0  # of the layer call under way: each beyond the first costs the host (profile's group_host)
        self.call_host_ms, self.grouped_host_ms, self.tokens = 0.0, 0.0, 0

    def begin_call(self, host_ms: float, tokens: int, grouped_host_ms: float) -> None:
        """A layer call of ``tokens`` starts; ``host_ms``: its host time after its routing read, spent before its first
        group is launched (its fetches, if any, are queued before it: their copies run while the host works), where
        it computes in one group (``compute_all``); ``grouped_host_ms`` where it computes in groups (``add_group``: a
        prefill's path, which a decode call takes when its experts do not fit the cache)."""
        self.groups, self.call_host_ms, self.grouped_host_ms, self.tokens = 0, host_ms, grouped_host_ms, tokens

    def _counts(self, rows: np.ndarray) -> list[int]:
        n = (len(rows) - self.cache.slots) // 3
        return [c for c in np.bincount(rows[2 * n:3 * n]).tolist() if c]  # tokens of each slot with pairs

    def upload(self, rows: np.ndarray, stream=None) -> list[int]:
        return self._counts(rows)

    def load_all(self, hidden, weights, routing, slots: dict[int, int]) -> list[int]:
        return routing.pair_counts(slots)

    def _run(self, counts: list[int], slots: dict[int, int], first_ms: float) -> None:
        self.streams.host += self.costs.group_host_ms(self.tokens) if self.groups else first_ms
        self.groups += 1
        self.streams.run(self.streams.compute, self.costs.group_ms(counts))
        self.cache.release(list(slots.values()))

    def compute_all(self, l: int, hidden, weights, inputs: list[int], slots: dict[int, int]):
        self.cache.wait_ready(slots.values())
        start = self.streams.host
        self._run(inputs, slots, self.call_host_ms)
        if self.timers is not None:
            self.timers.cpu.add("queue compute", self.streams.host - start)
        return hidden

    def add_group(self, l: int, hidden, weights, rows: list[int], slots: dict[int, int], out) -> None:
        self._run(rows, slots, self.grouped_host_ms)

