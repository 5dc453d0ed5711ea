"""The offload engine: runs a transformers MoE model whose routed experts live in host memory.

Shape legend: T tokens in a forward pass, B sequences, H hidden size, L MoE layers, E experts,
k top-k, S cache slots.

It plugs in through transformers' experts interface (``plugin.py``). Each MoE layer's call then
runs, for the experts its router chose:

  1. one CPU read of the routing (which experts, how many tokens each), grouped by expert;
  2. a look-up in the device cache of experts shared by all layers (``cache.py``: slots, events, pins,
     eviction, the books of copies made ahead);
  3. a decode call whose experts all fit in the cache (B=1 always): its misses fetched, then every
     pair computed in one call over the cache slots, replayed from a CUDA graph where one can be
     captured (``experts.py``); any other call: the cached experts at once, the rest fetched in
     pipelined groups of half the cache (``schedule.py``: the prefill schedule);
  4. decode with a predictor: layer l+d's experts predicted on their own stream while 1-3 run and
     copied into the cache right away (``prefetch.py``: the decode prefetch plan). A predictor on
     the host (the benchmarks' oracle) has its copies queued before a one-group call, behind this
     layer's misses and pair rows, where the cache has room for them beside this layer's experts:
     at B=1 the copies bound a step.
  5. policies without prediction: ``full-layer`` copies all of layer l+1 ahead; ``duoserve``'s
     prefill copies the cache's worth of layer l+1 ahead when a pass routes so many pairs that nearly
     every expert is needed (the prefill look-ahead).

``cpu-experts`` skips 2-5: the hidden states go to the host, the routed experts run there on the CPU, read
in place from the packed stores (the same grouped kernels, every expert its own group), and the output comes
back.
"""

from __future__ import annotations

import torch
from torch import nn

from duoserve.discovery import next_gate_fn
from duoserve.predictor.fast import TrainedPredictor
from duoserve.predictor.model import ExpertPredictor
from duoserve.runtime.cache import ExpertCache
from duoserve.runtime.experts import Routing, SlotCompute, SlotView, graphs_supported, slot_experts, slot_windows
from duoserve.runtime.plugin import ExpertsPlugin
from duoserve.runtime.policies import Policy
from duoserve.runtime.prefetch import DecodePrefetch
from duoserve.runtime.schedule import GroupedFetch
from duoserve.runtime.settings import EngineSettings
from duoserve.runtime.sources import HostPredictor, LayerPredictor, RoutingSource
from duoserve.runtime.store import HostExperts
from duoserve.runtime.streams import EngineTimers, Streams


def default_capacity(policy: Policy, num_experts: int, top_k: int, lookahead: int = 1) -> int:
    """Cache slots when no budget is given: k for the layer computing plus k for each layer looked ahead;
    k for policies that keep nothing; two whole layers for full-layer prefetch."""
    if policy.host_compute:
        return 1  # nothing is computed from the device cache
    if policy.prefetch_layer:
        return 2 * num_experts
    return (1 + lookahead) * top_k if policy.reuse else top_k


class OffloadEngine(ExpertsPlugin):
    """Serve ``model`` with its routed experts in ``stores`` (one per MoE layer) under ``policy``.

    ``predictor``: an exported predictor, any ``LayerPredictor`` or a ``HostPredictor`` (decode prefetch; policies
    that predict only). ``routing``: a source that overrides the routers' choices (benchmarks on random weights).
    ``settings``: the cache budget, look-ahead, CUDA graphs and prefetch threshold (``EngineSettings``).
    """

    def __init__(self, model: nn.Module, stores: list[HostExperts], policy: Policy,
                 predictor: ExpertPredictor | LayerPredictor | HostPredictor | None = None,
                 routing: RoutingSource | None = None, settings: EngineSettings = EngineSettings(),
                 device: torch.device | str | None = None):
        if policy.resident:
            raise ValueError("the all-resident policy runs the model as it is, with no engine")
        if policy.accelerate:
            raise ValueError(f"policy {policy.name} runs through Accelerate's hooks (duoserve.runtime.peers), not "
                             "the engine")
        super().__init__(model, routing)
        self.policy, self.settings = policy, settings
        if len(stores) != self.L:
            raise ValueError(f"{len(stores)} expert stores for {self.L} MoE layers")
        if policy.pinned != (stores[0].packed is not None):
            raise ValueError(f"policy {policy.name} needs {'packed' if policy.pinned else 'per-module'} expert stores")
        self.stores = stores
        if isinstance(predictor, ExpertPredictor):
            predictor.check_geometry(self.L, self.E, self.k)
        if predictor is not None and not policy.predict:
            raise ValueError(f"policy {policy.name} does not use a predictor")
        if not settings.lookahead < self.L:
            raise ValueError(f"look-ahead must be in 1..{self.L - 1} layers, got {settings.lookahead}")
        # a trained predictor's heads reach ``lookahead`` layers; a host predictor (the oracle) has no such bound
        depth = (predictor.spec.lookahead if isinstance(predictor, ExpertPredictor)
                 else getattr(predictor, "lookahead", None))
        if depth is not None and settings.lookahead > depth:
            raise ValueError(f"look-ahead {settings.lookahead} needs a predictor with heads that deep; this one has "
                             f"depth {depth} (duoserve-train fit --lookahead {settings.lookahead})")
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.streams = Streams(self.device)
        self.timers = EngineTimers(self.streams)
        self.cache = ExpertCache(stores[0].layout, self._capacity(), self.streams)
        if settings.pin:
            self._pin(settings.pin)
        self.compute = SlotCompute([layer.experts for layer in self.layers], self.cache, self.streams, self.timers,
                                   graphs=not settings.eager and graphs_supported(stores[0].layout.dtype, self.device))
        self.grouped = GroupedFetch(self.cache, stores, self.streams, self.timers, self.compute, policy.overlap)
        self.prefetch = self._prefetch_plan(predictor) if predictor is not None else None
        # cpu-experts: each layer's experts module seen with its host parameters as its experts, read in place from
        # the packed store's rows (one expert's parameters are contiguous in its row; no second host copy)
        if policy.host_compute and stores[0].dequantizes:
            raise ValueError(f"policy {policy.name} computes on the host from the model's own dtype; its experts "
                             "cannot be stored quantized")
        self._host_views = [SlotView(layer.experts, store.layout.views(store.packed), self.E) for layer, store in
                            zip(self.layers, stores)] if policy.host_compute else None

    def _capacity(self) -> int:
        """Cache slots: the policy's default, or as many experts as the budget holds (caching policies)."""
        policy, budget, nbytes = self.policy, self.settings.gpu_expert_budget, self.stores[0].layout.nbytes
        slots = default_capacity(policy, self.E, self.k, self.settings.lookahead)
        if budget is not None and policy.reuse and not policy.prefetch_layer:
            slots = budget // nbytes
            if slots < self.k:
                raise ValueError(f"a GPU expert budget of {budget / 1e9:.2f} GB holds {slots} experts of "
                                 f"{nbytes / 1e6:.1f} MB; the cache needs at least top-k = {self.k}")
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

    def _prefetch_plan(self, predictor) -> DecodePrefetch:
        if isinstance(predictor, ExpertPredictor):
            predictor = TrainedPredictor(predictor, self.device)
        next_gate = None  # per target layer t >= 1: its router's top-m ids (and scores) on layer t-1's MoE input
        width = getattr(predictor, "nextgate", 0)
        if width:
            if any(layer.router is None for layer in self.layers[1:]):
                raise ValueError("this predictor uses next-gate features, but not every MoE layer's router was found "
                                 "(a `gate` or `router` sibling of its experts module)")
            scores = getattr(predictor, "nextgate_scores", False)  # no softmax in the decode step for ids alone
            next_gate = [None] + [next_gate_fn(layer.router, self.k, width, scores) for layer in self.layers[1:]]
        return DecodePrefetch(predictor, self.cache, self.stores, self.streams, self.timers, (self.L, self.E, self.k),
                              self.settings.lookahead, self.settings.prefetch_min_score, next_gate)

    def __exit__(self, *exc) -> None:
        self.streams.synchronize()
        super().__exit__(*exc)

    def _begin_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        super()._begin_forward(module, args, kwargs)
        if self.phase == "decode" and self.prefetch is not None:
            self.prefetch.begin_step(self.batch)

    def run_layer(self, l: int, hidden: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """T x H output of MoE layer ``l`` for hidden states (T x H) routed to ``idx`` (T x k) with ``weights``."""
        cpu, cache, plan = self.timers.cpu, self.cache, self.prefetch
        with cpu("wait for routing"):
            routing = Routing(idx, self.E)
        if self._host_views is not None:
            return self._host_layer(l, hidden, weights, routing)
        targets = plan.targets(l) if plan is not None and self.phase == "decode" and plan.history is not None \
            and len(plan.history) == len(idx) else []
        # the predictor stream starts from the routing (a host-side predictor reads none of it)
        routed = self.streams.record() if targets and not plan.on_host else None
        if not self.policy.reuse:
            cache.forget()
        hits = cache.resident(l, routing.needed, self.phase)
        missing = [e for e in routing.needed if e not in hits]
        ranked, prefetched = None, False  # the predicted experts, best first; their copies are queued
        if self.phase == "decode" and cache.fits(l, routing.needed):
            # a decode call computes little: every pair in one group once its misses land, shapes fixed per batch
            with cpu("queue fetches"):
                keep = {(l, e) for e in routing.needed}
                slots = hits | dict(zip(missing, cache.fetch(l, missing, self.stores[l], self.phase, keep,
                                                             self.grouped.stream) if missing else []))
            inputs = self.compute.load_all(hidden, weights, routing, slots)  # before any prefetch: see load_all
            scores = plan.launch(l, hidden, idx, routed, targets) if plan is not None else None
            if targets and plan.on_host:  # its guesses are on the host already
                ranked = plan.rank(scores)
                if sum(map(len, ranked)) <= cache.room(keep):
                    # room beside this layer's experts: layer l+1's copies are queued before this layer's compute,
                    # as at B=1 the copies bound a step
                    plan.copy(targets, ranked, busy=keep)
                    prefetched = True
            out = self.compute.compute_all(l, hidden, weights, inputs, slots)
        else:
            out = self.grouped.compute_cached(l, hidden, weights, routing, hits)
            scores = plan.launch(l, hidden, idx, routed, targets) if plan is not None else None
            out = self.grouped.fetch_missing(l, hidden, weights, routing, missing, self.phase, out)
        if targets and not prefetched:  # after this layer's work is queued, free to refill its slots
            plan.copy(targets, ranked or plan.rank(scores))
        elif self.policy.prefetch_layer:
            with cpu("queue prefetch"):
                nxt = (l + 1) % self.L
                cache.copy_ahead(nxt, [(e, 1.0) for e in range(self.E)], self.stores[nxt], self.phase)
        elif self.policy.prefill_lookahead and self.phase == "prefill" and l + 1 < self.L and idx.numel() >= 8 * self.E:
            # so many pairs route nearly every expert (uniform routing leaves one unused with odds e^-8), so the
            # copy stream fills the gap while the host reaches layer l+1's router with experts it will compute first
            with cpu("queue prefetch"):
                cache.copy_ahead(l + 1, [(e, 1.0) for e in range(min(cache.open_slots, self.E))], self.stores[l + 1],
                                 self.phase, predicted=False)
        return out

    def _host_layer(self, l: int, hidden: torch.Tensor, weights: torch.Tensor, routing: Routing) -> torch.Tensor:
        """T x H output of layer ``l``'s routed experts computed on the host CPU (``cpu-experts``)."""
        with self.timers.cpu("host experts"):
            rows = routing.rows({e: e for e in routing.needed}, self.E)
            out = slot_experts(self._host_views[l], hidden.cpu(), weights.cpu(), torch.from_numpy(rows), self.E,
                               slot_windows(rows, self.E))  # T x H
        return out.to(hidden.device)

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
