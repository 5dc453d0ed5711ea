"""The engine's schedule: which experts a layer call finds cached, fetches, computes and copies ahead, and on which
stream; the same code whether the streams are a GPU's or a simulator's clocks.

Shape legend: T tokens in a forward pass, B sequences, H hidden size, L MoE layers, E experts,
k top-k, S cache slots.

Each MoE layer's call runs, for the experts its router chose:

  1. one CPU read of the routing (which experts, how many tokens each), grouped by expert;
  2. a look-up in the device cache of experts shared by all layers (``cache.py``: slots, events, pins,
     eviction, the books of copies made ahead);
  3. a decode call whose experts all fit in the cache (B=1 always): its misses fetched, then every
     pair computed in one call over the cache slots (``experts.py``); any other call: the cached experts at
     once, the rest fetched in pipelined groups (``schedule.py``: the prefill schedule);
  4. decode with a predictor: layer l+d's experts predicted on their own stream while 1-3 run and
     copied into the cache (``prefetch.py``: the decode prefetch plan). With ``defer_prefetch`` (the
     settings' default) and decoder layers replayed from step graphs, so that the next layer call comes
     quickly, the copies are queued at the next call's start, before it waits for its routing: the device
     then runs this call's compute and the next layer's attention while the host queues them. Otherwise
     they are queued within this call: a predictor on the host (the benchmarks' oracle) has them queued
     before a one-group call, behind this layer's misses and pair rows, where the cache has room for them
     beside this layer's experts (an eager decoder layer takes the host longer than the copies take, so
     they start before it); a device predictor after the call's compute.
  5. policies without prediction: ``full-layer`` copies all of layer l+1 ahead; ``duoserve``'s
     prefill copies the cache's worth of layer l+1 ahead when a pass routes so many pairs that nearly
     every expert is needed (the prefill look-ahead).

``ExpertScheduler`` knows no model: it gets the geometry, the host stores, the streams and the compute it queues
work on. ``OffloadEngine`` (``engine.py``) gives it a model's experts on a GPU; the offload simulator
(``duoserve.bench.simulate``) gives it clocks that a device profile's costs advance, so both make the same
decisions: one implementation of the cache, its eviction and pinning, the prefill grouping and the prefetch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from duoserve.discovery import Gate
from duoserve.runtime.cache import ExpertCache
from duoserve.runtime.experts import Routing
from duoserve.runtime.policies import Policy
from duoserve.runtime.prefetch import DecodePrefetch
from duoserve.runtime.schedule import FETCH_SECTION, GroupedFetch
from duoserve.runtime.settings import EngineSettings, budget_slots
from duoserve.runtime.sources import HostPredictor, LayerPredictor
from duoserve.runtime.store import HostExperts
from duoserve.runtime.streams import EngineTimers, Streams


ROUTING_SECTION = "wait for routing"  # the host section of a layer call before it queues any fetch (profiles time it)


# stored bytes a default cache over quantized experts holds at least (``default_capacity``): the cache's worth is both
# a prefill group and what the prefill copies ahead into the next layer, and a layer call of a long prompt spends about
# 2 ms on the host before its first fetch is queued (4096 tokens, H100/H200), which 128 MiB of copies at 55 GB/s
# covers (Qwen3-30B-A3B x48, fp8, B=8, prompt 512, one H100: TTFT 1.15-1.16x of its bound with 16 slots, 78 MiB
# stored, 1.05-1.06x with 32; benchmarks/results/int4_staging_h100)
QUANTIZED_CACHE_BYTES = 128 << 20


def default_capacity(policy: Policy, num_experts: int, top_k: int, lookahead: int = 1,
                     store: HostExperts | None = None) -> int:
    """Cache slots when no budget is given: k for the layer computing plus k for each layer looked ahead;
    k for policies that keep nothing; two whole layers for full-layer prefetch. A caching policy over a quantized
    ``store`` holds up to twice as many, enough that the cache's slots store ``QUANTIZED_CACHE_BYTES``: its prefill
    computes the fetched experts in groups of the whole cache (``schedule.py``), and a group's host time does not
    shrink with its bytes, so groups of a quarter of the bytes (int4) left the copy stream idle (Qwen3-30B-A3B at 48
    layers on an H100, B=1: TTFT 0.63-0.69 s with 16 slots, 0.33-0.39 s with 32; benchmarks/results/int4_cache_h100);
    and the cache's worth is what the prefill reads ahead into the next layer while a long prompt's layer call starts."""
    if policy.host_compute:
        return 1  # nothing is computed from the device cache
    if policy.prefetch_layer:
        return 2 * num_experts
    if not policy.reuse:
        return top_k
    slots = (1 + lookahead) * top_k
    if store is not None and store.dequantizes:
        wanted = -(-QUANTIZED_CACHE_BYTES // store.row_bytes)  # ceil
        slots = min(2 * slots, max(slots, -(-wanted // top_k) * top_k))  # in whole top-k's
    return slots


class ExpertScheduler:
    """The schedule of ``policy`` over ``stores`` (one per MoE layer) for a model of ``geometry`` (L, E, k).

    ``streams``: where work is queued (``Streams``, or a simulator's clocks). ``compute(cache, streams, timers)``
    makes what computes the experts from the cache's slots (``experts.SlotCompute`` or a simulator's stand-in).
    ``predictor``: a deployed ``LayerPredictor`` or a ``HostPredictor`` (decode prefetch; policies that predict
    only), with ``next_gate``, per target layer, what gives its next-gate features from a hidden state (or None).
    ``settings``: the cache budget, look-ahead, pins and prefetch threshold. ``timers``: what times its host
    sections and device stalls (default: ``EngineTimers``; a simulator, which keeps its own clocks, gives
    ``NullTimers``).

    ``layers_replayed``: whether the driver's layer calls follow one another in little host time (decode layers
    replayed from step graphs); a driver sets it. Where it holds and ``settings.defer_prefetch`` asks for it, a decode
    call's prefetch waits for the next layer call's start (``defer_prefetch``, step 4 above).
    """

    layers_replayed = False

    def __init__(self, geometry: tuple[int, int, int], stores: list[HostExperts], policy: Policy,
                 settings: EngineSettings, streams: Streams, compute: Callable,
                 predictor: LayerPredictor | HostPredictor | None = None,
                 next_gate: list[Gate | None] | None = None, timers: EngineTimers | None = None):
        self.L, self.E, self.k = geometry
        if len(stores) != self.L:
            raise ValueError(f"{len(stores)} expert stores for {self.L} MoE layers")
        if policy.pinned != (stores[0].packed is not None):
            raise ValueError(f"policy {policy.name} needs {'packed' if policy.pinned else 'per-module'} expert stores")
        if predictor is not None and not policy.predict:
            raise ValueError(f"policy {policy.name} does not use a predictor")
        if not settings.lookahead < self.L:
            raise ValueError(f"look-ahead must be in 1..{self.L - 1} layers, got {settings.lookahead}")
        depth = getattr(predictor, "lookahead", None)  # a trained predictor's heads; an oracle has no such bound
        if depth is not None and settings.lookahead > depth:
            raise ValueError(f"look-ahead {settings.lookahead} needs a predictor with heads that deep; this one has "
                             f"depth {depth} (duoserve-train fit --lookahead {settings.lookahead})")
        self.policy, self.settings, self.stores, self.streams = policy, settings, stores, streams
        self.phase, self.batch = "prefill", 0
        self._deferred: tuple | None = None  # (targets, scores) of a decode prefetch left for the next call
        self.timers = timers or EngineTimers(streams)
        self.cache = ExpertCache(stores[0].layout, self._capacity(), streams)
        if settings.pin:
            self._pin(settings.pin)
        self.compute = compute(self.cache, streams, self.timers)
        self.grouped = GroupedFetch(self.cache, stores, streams, self.timers, self.compute, policy.overlap)
        self.prefetch = None if predictor is None else DecodePrefetch(
            predictor, self.cache, stores, streams, self.timers, geometry, settings.lookahead,
            settings.prefetch_min_score, next_gate)

    def _capacity(self) -> int:
        """Cache slots: the policy's default, or as many experts as the budget holds (caching policies)."""
        policy, budget, nbytes = self.policy, self.settings.gpu_expert_budget, self.stores[0].layout.nbytes
        slots = default_capacity(policy, self.E, self.k, self.settings.lookahead, self.stores[0])
        if budget is not None and policy.reuse and not policy.prefetch_layer:
            if isinstance(budget, str):  # a number of experts of this model ('10%', '2k')
                slots, held = budget_slots(budget, self.L, self.E, self.k), f"{budget} of {self.L} x {self.E} experts"
            else:
                slots, held = budget // nbytes, f"{budget / 1e9:.2f} GB, {nbytes / 1e6:.1f} MB an expert"
            if slots < self.k:
                raise ValueError(f"a GPU expert budget of {held} holds {slots} experts; the cache needs at least "
                                 f"top-k = {self.k}")
        return min(slots, self.L * self.E)

    def _pin(self, keys: tuple[tuple[int, int], ...]) -> None:
        """Pin the first of ``keys`` the budget holds beyond the slots the cache's own work needs."""
        if not self.policy.reuse or self.policy.prefetch_layer:
            raise ValueError(f"policy {self.policy.name} keeps no cache to pin experts in (duoserve and lru do)")
        if bad := [key for key in keys if not (0 <= key[0] < self.L and 0 <= key[1] < self.E)]:
            raise ValueError(f"pinned expert {bad[0]} is not a (layer, expert) of this model's {self.L} x {self.E}")
        count = self.cache.slots - default_capacity(self.policy, self.E, self.k, self.settings.lookahead)
        if count <= 0:
            raise ValueError(f"a GPU expert budget of {self.cache.slots} experts leaves none to pin beyond the "
                             f"{self.cache.slots - count} the cache needs; raise --gpu-expert-budget")
        self.cache.pin(list(keys[:count]), self.stores)

    @property
    def defer_prefetch(self) -> bool:
        """Whether a decode call leaves its prefetch to the next layer call's start (step 4 above)."""
        return self.layers_replayed and self.settings.defer_prefetch

    def begin_pass(self, phase: str, batch: int) -> None:
        """A forward pass of ``batch`` sequences starts, in ``phase`` (prefill or decode)."""
        self.phase, self.batch = phase, batch
        self._deferred = None  # a pass cut short leaves nothing for the next one
        if phase == "decode" and self.prefetch is not None:
            self.prefetch.begin_step(batch)

    def queue_deferred(self) -> None:
        """Queue the decode prefetch the last layer call left for this moment (``defer_prefetch``), if any: called
        before the next layer call waits for its routing."""
        if self._deferred is not None:
            targets, scores = self._deferred
            self._deferred = None
            self.prefetch.copy(targets, self.prefetch.rank(scores))

    def run_layer(self, l: int, hidden: torch.Tensor, idx: torch.Tensor | np.ndarray,
                  weights: torch.Tensor) -> torch.Tensor:
        """T x H output of MoE layer ``l`` for hidden states (T x H) routed to ``idx`` (T x k) with ``weights``; ``idx``
        may be a host array where no predictor on the device reads it (the offload simulator's)."""
        cpu, cache, plan = self.timers.cpu, self.cache, self.prefetch
        self.queue_deferred()
        defer = self.defer_prefetch
        with cpu(ROUTING_SECTION):
            routing = Routing(idx, self.E)
        targets = plan.targets(l) if plan is not None and self.phase == "decode" and plan.history is not None \
            and plan.history.shape[0] == idx.shape[0] else []
        # the predictor stream starts from the routing (a host-side predictor reads none of it)
        routed = self.streams.record() if targets and not plan.on_host else None
        if not self.policy.reuse:
            cache.forget()
        hits = cache.resident(l, routing.needed, self.phase)
        missing = [e for e in routing.needed if e not in hits]
        ranked, prefetched = None, False  # the predicted experts, best first; their copies are queued
        if self.phase == "decode" and cache.fits(l, routing.needed):
            # a decode call computes little: every pair in one group once its misses land, shapes fixed per batch
            with cpu(FETCH_SECTION):
                keep = {(l, e) for e in routing.needed}
                slots = hits | dict(zip(missing, cache.fetch(l, missing, self.stores[l], self.phase, keep,
                                                             self.grouped.stream) if missing else []))
            inputs = self.compute.load_all(hidden, weights, routing, slots)  # before any prefetch: see load_all
            scores = plan.launch(l, hidden, idx, routed, targets) if plan is not None else None
            if targets and plan.on_host and not defer:  # its guesses are on the host already
                ranked = plan.rank(scores)
                if sum(map(len, ranked)) <= cache.room(keep):
                    # room beside this layer's experts: layer l+1's copies are queued before this layer's compute,
                    # as at B=1 the copies bound a step
                    plan.copy(targets, ranked, busy=keep)
                    prefetched = True
            out = self.compute.compute_all(l, hidden, weights, inputs, slots)
        else:
            out = self.grouped.compute_cached(l, hidden, weights, routing, hits, missing)
            scores = plan.launch(l, hidden, idx, routed, targets) if plan is not None else None
            out = self.grouped.fetch_missing(l, hidden, weights, routing, missing, self.phase, out)
        if targets and defer:
            self._deferred = (targets, scores)
        elif targets and not prefetched:  # after this layer's work is queued, free to refill its slots
            plan.copy(targets, ranked or plan.rank(scores))
        elif self.policy.prefetch_layer:
            with cpu("queue prefetch"):
                nxt = (l + 1) % self.L
                cache.copy_ahead(nxt, [(e, 1.0) for e in range(self.E)], self.stores[nxt], self.phase)
        elif (self.policy.prefill_lookahead and self.phase == "prefill" and l + 1 < self.L
              and routing.ids.size >= 8 * self.E):
            # so many pairs route nearly every expert (uniform routing leaves one unused with odds e^-8), so the
            # copy stream fills the gap while the host reaches layer l+1's router with experts it will compute first
            with cpu("queue prefetch"):
                cache.copy_ahead(l + 1, [(e, 1.0) for e in range(min(cache.open_slots, self.E))], self.stores[l + 1],
                                 self.phase, predicted=False)
        return out

    def reset_stats(self) -> None:
        self.streams.synchronize()
        self.cache.stats = type(self.cache.stats)()
        self.timers.reset()

    def stats(self) -> dict:
        """Counters since the last reset: bytes and copies per phase, hit rates, stall and predictor time (device),
        host time per engine section (waiting for the routing or the predictor, queueing work), and how expert
        copies were queued (``Streams.copy_path``)."""
        s = self.cache.stats
        return {
            "cache_slots": self.cache.slots, "cache_bytes": self.cache.nbytes, "pinned_experts": len(self.cache.pinned),
            "bytes_h2d": dict(s.bytes), "copies": dict(s.copies),
            "hit_rate": {p: s.hits[p] / s.lookups[p] if s.lookups[p] else None for p in s.lookups},
            "prefetched": s.prefetched,
            "prefetch_precision": s.prefetch_used / s.prefetched if s.prefetched else None,
            "stall_ms": self.timers.stall.total_ms(), "predictor_ms": self.timers.predict.total_ms(),
            "host_ms": dict(self.timers.cpu.ms), "copy_path": self.streams.copy_path,
        }
