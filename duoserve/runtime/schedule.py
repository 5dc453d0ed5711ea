"""The fetch schedule of calls whose experts do not all fit in the cache at once: prefill, and large decode batches.

Experts already cached are computed first (their pair rows uploaded on the fetch stream, ahead of the
copies the call queues next); every other routed expert is fetched once, in groups, and each group is
computed as soon as it lands. With a copy stream (policies with ``overlap``), groups of half the cache: the
next group's copies are queued before this group's compute, so the copy stream always has work while the
host queues compute. A quantized store's copies land in staging and only their dequantization waits for the
slots' last compute, so its groups take the whole cache (``group_size``): the next group is queued after this
one's compute and its copies still run during it; and its first group's copies go to staging before the cached
experts' compute is queued (``ExpertCache.stage``), so the copy stream is busy while the host queues that compute,
whose slots the group's dequantization then takes. Without a copy stream (on-demand), each group is copied on
the compute stream and waited for.

Shape legend: T tokens of the call, H hidden size, n (token, expert) pairs of a group.
"""

from __future__ import annotations

import contextlib

import torch

from duoserve.runtime.cache import ExpertCache
from duoserve.runtime.experts import PairRows, Routing, SlotCompute
from duoserve.runtime.store import HostExperts, staged
from duoserve.runtime.streams import EngineTimers, Streams

FETCH_SECTION = "queue fetches"  # the host section where a layer call queues its misses' copies (profiles time it)


class GroupedFetch:
    """Fetch-and-compute in groups over ``cache`` for a layer call (see the module docstring)."""

    def __init__(self, cache: ExpertCache, stores: list[HostExperts], streams: Streams, timers: EngineTimers,
                 compute: SlotCompute, overlap: bool):
        self.cache, self.stores, self.streams, self.timers, self.compute = cache, stores, streams, timers, compute
        self.stream = streams.copy if overlap else streams.compute
        self.overlap = overlap

    def group_size(self, store: HostExperts) -> int:
        """Experts per fetched group (module docstring): the whole cache for a store that stages its copies, half of
        it otherwise. Fewer groups matter because each costs the host about as much to queue as a quantized group's
        copies take (Qwen3-30B-A3B's fp8 prefill: 16 groups a layer became 8)."""
        slots = self.cache.open_slots
        return max(1, slots if self.overlap and staged(store, self.streams) else slots // 2)

    def compute_cached(self, l: int, hidden: torch.Tensor, weights: torch.Tensor, routing: Routing,
                       hits: dict[int, int], missing: list[int]) -> torch.Tensor:
        """T x H fp32 sum of layer ``l``'s cached experts ``hits`` (expert -> slot), computed first in one group; the
        first of the ``missing`` experts' copies go to staging before it where the store stages them."""
        timers = self.timers
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # T x H, summed in fp32
        if hits:
            with timers.cpu("queue compute"):
                # on the fetch stream, ahead of the copies this call queues next: an upload on the compute stream
                # waits for the copy stream's whole backlog on the H200, copies queued after it included (measured:
                # full-layer's prefill idled its copy stream 5 ms every second layer), so it holds this compute
                rows = self.compute.upload(routing.rows(hits, self.cache.slots), self.stream)
                apart = self.stream is not self.streams.compute  # else stream order already holds the compute
                uploaded = self.streams.record(self.stream) if apart else None
            store = self.stores[l]
            if missing and self.overlap and staged(store, self.streams):
                # the first group's copies run while this group computes; their slots are chosen once it is queued
                with timers.cpu(FETCH_SECTION):
                    self.cache.stage(missing[:self.group_size(store)], store, self.stream)
            with timers.stall.span():
                self.cache.wait_ready(hits.values())
                self.streams.wait(self.streams.compute, uploaded)
            with timers.cpu("queue compute"):
                self.compute.add_group(l, hidden, weights, rows, hits, out)
        return out

    def fetch_missing(self, l: int, hidden: torch.Tensor, weights: torch.Tensor, routing: Routing,
                      missing: list[int], phase: str, out: torch.Tensor) -> torch.Tensor:
        """Fetch ``missing`` experts in groups (``group_size``), each computed into ``out`` (T x H, fp32) as soon as
        it lands; returns ``out`` in the hidden states' dtype. A group's pair rows travel on its stream right after
        its experts: host-to-device copies run in order, so rows uploaded on the compute stream would wait behind
        the next group's copies, and this group's compute with them."""
        cache, stream, timers = self.cache, self.stream, self.timers
        chunk = self.group_size(self.stores[l])
        groups = [missing[i:i + chunk] for i in range(0, len(missing), chunk)]
        depth = 2 if self.overlap and 2 * chunk <= cache.open_slots else 1  # groups fetched, not computed
        queued: list[tuple[dict[int, int], PairRows]] = []  # (expert -> slot, rows) of each fetched group
        # a stall span times the compute stream from its start: around the host's queueing of copies on another
        # stream it would count that queueing (all of it, where the device waits for the host) as a stall, so there
        # it holds the wait for a group's copies only; copies on the compute stream (on-demand's, lru's) are its stalls
        copies_stall = self.stream is self.streams.compute
        for i in range(len(groups)):
            with timers.stall.span() if copies_stall else contextlib.nullcontext():
                while len(queued) < depth and i + len(queued) < len(groups):
                    experts = groups[i + len(queued)]
                    keep = {(l, e) for group, _ in queued for e in group}  # not computed yet: not to be refilled
                    with timers.cpu(FETCH_SECTION):
                        slots = cache.fetch(l, experts, self.stores[l], phase, keep, stream, seal=False)
                        fetched = dict(zip(experts, slots))
                        rows = self.compute.upload(routing.rows(fetched, cache.slots), stream)
                        cache.seal(slots, stream)
                    queued.append((fetched, rows))
            group, rows = queued.pop(0)
            with timers.stall.span():
                cache.wait_ready(group.values())
            with timers.cpu("queue compute"):
                self.compute.add_group(l, hidden, weights, rows, group, out)
        return out.to(hidden.dtype)
