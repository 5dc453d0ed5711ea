"""The offload engine: runs a transformers MoE model whose routed experts live in host memory.

Shape legend: T tokens in a forward pass, B sequences, H hidden size, L MoE layers, E experts,
k top-k, S cache slots, n (token, expert) pairs of a group.

It plugs in through transformers' experts interface: ``with OffloadEngine(...)`` registers one
experts implementation and switches the model to it, plus one forward pre-hook that tells prefill
from decode; leaving the ``with`` restores the model's own implementation and removes both. Each
MoE layer's call then runs, for the experts its router chose:

  1. one CPU read of the routing (which experts, how many tokens each), grouped by expert;
  2. the experts already in the device cache, in one grouped call over the cache slots, its pairs
     sorted on the host and uploaded in one copy (``experts.py``: a few launches where the model's
     own grouped_mm function, which must find the grouping on the device, takes some 40);
  3. every other expert as soon as its copy lands, in groups of half the cache: fetched on the copy
     stream, the next group's copies queued before this group's compute (policies with ``overlap``),
     or copied on the compute stream and waited for (on-demand);
  4. decode with a predictor: the predictor scores layer l+1 on its own stream from the token's
     routing history (and, if it was trained with them, next-gate ids: layer l+1's router on this
     layer's input) while 2-3 run, and its top experts (those scored at least ``prefetch_min_score``)
     are copied into the cache right away, so layer l+1 finds them resident; its router's real
     choice is still checked in step 1 and a miss is fetched at once. Batches use the union of their
     tokens' experts.

A decode call whose experts all fit in the cache (B=1 always) runs 2-3 as one group instead: its
misses are fetched, then every pair is computed in one call, replayed from a CUDA graph where one
can be captured (``experts.py``). A predictor on the host (the benchmarks' oracle) has
its copies queued before that call, behind this layer's misses and pair rows, where the cache has
room for them beside this layer's experts: at B=1 the copies bound a step.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from duoserve.predictor.model import ExpertPredictor
from duoserve.runtime.cache import ExpertCache
from duoserve.runtime.experts import (
    GraphedSlotExperts,
    Routing,
    add_slot_experts,
    graphs_supported,
    slot_experts,
)
from duoserve.runtime.policies import Policy
from duoserve.runtime.sources import (
    HostPredictor,
    LayerPredictor,
    RoutingSource,
    TrainedPredictor,
)
from duoserve.runtime.store import HostExperts
from duoserve.runtime.streams import CpuSections, SpanTimer, Streams
from duoserve.trace.hooks import find_moe_layers, moe_geometry, next_gate_fn


class _SlotView:
    """An experts module as its kernels see it, with the cache's slots in place of its experts."""

    def __init__(self, module: nn.Module, weights: dict[str, torch.Tensor], count: int):
        self.__dict__.update(_module=module, _weights=weights, num_experts=count)

    def __getattr__(self, name: str):
        weights = self.__dict__["_weights"]
        return weights[name] if name in weights else getattr(self.__dict__["_module"], name)


def default_capacity(policy: Policy, num_experts: int, top_k: int, lookahead: int = 1) -> int:
    """Cache slots when no budget is given: k for the layer computing plus k for each layer looked ahead;
    k for policies that keep nothing; two whole layers for full-layer prefetch."""
    if policy.prefetch_layer:
        return 2 * num_experts
    return (1 + lookahead) * top_k if policy.reuse else top_k


class ExpertsPlugin:
    """Inside ``with``: the model's experts modules call ``run_layer`` (registered through transformers' experts
    interface), and a forward pre-hook tells prefill from decode. By itself it runs the model's own experts
    kernel, on the routing of ``routing`` when one is given (the all-resident bound of a benchmark)."""

    def __init__(self, model: nn.Module, routing: RoutingSource | None = None):
        self.model, self.routing = model, routing
        self.layers = find_moe_layers(model)
        geometry = moe_geometry(model, self.layers)
        self.L, self.E, self.k = geometry.num_layers, geometry.num_experts, geometry.top_k
        self._layer_of = {id(layer.experts): i for i, layer in enumerate(self.layers)}
        self._name = f"duoserve-{type(self).__name__}-{id(self):x}"
        self.device = next(model.parameters()).device
        self.phase, self.batch = "prefill", 0
        self._routed: torch.Tensor | None = None  # L x T x k: the routing source's choice for this forward

    def __enter__(self):
        self._previous = self.model.config._experts_implementation
        self._kernels = [ALL_EXPERTS_FUNCTIONS.get_interface(self._previous, type(layer.experts).forward.__wrapped__)
                         for layer in self.layers]
        ALL_EXPERTS_FUNCTIONS[self._name] = self._experts_forward
        self.model.set_experts_implementation(self._name)
        self._hook = self.model.register_forward_pre_hook(self._begin_forward, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._hook.remove()
        self.model.set_experts_implementation(self._previous)
        del ALL_EXPERTS_FUNCTIONS[self._name]

    def _begin_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = kwargs.get("input_ids")
        x = (args[0] if args else kwargs.get("inputs_embeds")) if x is None else x
        self.batch, S = x.shape[:2]
        self.phase = "prefill" if S > 1 else "decode"
        if self.routing is not None:  # one copy per forward pass, so no layer waits for one
            self._routed = self.routing.begin(self.batch * S).to(self.device)

    def _experts_forward(self, module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
        l = self._layer_of[id(module)]
        if self.routing is not None:
            top_k_index = self._routed[l]  # T x k
        return self.run_layer(l, hidden, top_k_index, top_k_weights)

    def run_layer(self, l: int, hidden: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self._kernels[l](self.layers[l].experts, hidden, idx, weights)


class OffloadEngine(ExpertsPlugin):
    """Serve ``model`` with its routed experts in ``stores`` (one per MoE layer) under ``policy``.

    ``predictor``: an exported predictor, any ``LayerPredictor`` or a ``HostPredictor`` (decode prefetch; duoserve
    only).
    ``routing``: a source that overrides the routers' choices (benchmarks on random weights).
    ``gpu_expert_budget``: bytes for cached experts (at least k of them); replaces the default of
    (1 + lookahead) x k slots of the caching policies (duoserve, lru); the others hold what their schedule needs.
    ``lookahead``: decode prefetch depth d: layer l's predictions are for layer l+d (the first layer of a
    step predicts 1..d), so a copy has d layers of compute to hide behind. A trained predictor scores the next
    layer from the layers before it, so it needs d = 1; oracles take any d.
    ``eager``: never replay decode calls from CUDA graphs (``experts.py`` says where they are used).
    ``prefetch_min_score``: copy ahead only predicted experts scored at least this (a trained predictor's scores
    are probabilities); 0 copies every expert of each token's predicted top k. A wrong guess costs a whole copy.
    """

    def __init__(self, model: nn.Module, stores: list[HostExperts], policy: Policy,
                 predictor: ExpertPredictor | LayerPredictor | HostPredictor | None = None,
                 routing: RoutingSource | None = None,
                 gpu_expert_budget: int | None = None, device: torch.device | str | None = None,
                 lookahead: int = 1, eager: bool = False, prefetch_min_score: float = 0.0):
        if policy.resident:
            raise ValueError("the all-resident policy runs the model as it is, with no engine")
        super().__init__(model, routing)
        self.policy = policy
        if len(stores) != self.L:
            raise ValueError(f"{len(stores)} expert stores for {self.L} MoE layers")
        if policy.pinned != (stores[0].packed is not None):
            raise ValueError(f"policy {policy.name} needs {'packed' if policy.pinned else 'per-module'} expert stores")
        self.stores = stores
        if isinstance(predictor, ExpertPredictor):
            predictor.check_geometry(self.L, self.E, self.k)
        if predictor is not None and not policy.predict:
            raise ValueError(f"policy {policy.name} does not use a predictor")
        if not 1 <= lookahead < self.L:
            raise ValueError(f"look-ahead must be in 1..{self.L - 1} layers, got {lookahead}")
        if lookahead > 1 and isinstance(predictor, ExpertPredictor):
            raise ValueError("a trained predictor scores the next layer from the layers before it: it needs "
                             f"look-ahead 1, got {lookahead}")
        self.lookahead = lookahead
        if not 0.0 <= prefetch_min_score <= 1.0:
            raise ValueError(f"the prefetch minimum score must be in [0, 1], got {prefetch_min_score}")
        self.prefetch_min_score = prefetch_min_score
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.streams = Streams(self.device)
        self.predictor = TrainedPredictor(predictor, self.device) if isinstance(predictor, ExpertPredictor) \
            else predictor
        self._next_gate = None  # per target layer t >= 1: its router's top-k on layer t-1's MoE input
        if getattr(self.predictor, "nextgate", False):
            if any(layer.router is None for layer in self.layers[1:]):
                raise ValueError("this predictor uses next-gate features, but not every MoE layer's router was found "
                                 "(a `gate` or `router` sibling of its experts module)")
            self._next_gate = [None] + [next_gate_fn(layer.router, self.k) for layer in self.layers[1:]]
        self._host_predictor = getattr(self.predictor, "on_host", False)  # guesses on the host: no predictor stream
        slots = default_capacity(policy, self.E, self.k, lookahead)
        if gpu_expert_budget is not None and policy.reuse and not policy.prefetch_layer:
            slots = gpu_expert_budget // stores[0].layout.nbytes
            if slots < self.k:
                raise ValueError(f"a GPU expert budget of {gpu_expert_budget / 1e9:.2f} GB holds {slots} experts of "
                                 f"{stores[0].layout.nbytes / 1e6:.1f} MB; the cache needs at least top-k = {self.k}")
        self.cache = ExpertCache(stores[0].layout, min(slots, self.L * self.E), self.streams)
        self._slot_views = [_SlotView(layer.experts, self.cache.views, self.cache.slots) for layer in self.layers]
        self._graphs = GraphedSlotExperts(self.cache.slots, self.device) \
            if not eager and graphs_supported(stores[0].layout.dtype, self.device) else None
        self.stall, self.predict_time, self.cpu = SpanTimer(self.streams), SpanTimer(self.streams), CpuSections()
        self._history: torch.Tensor | None = None  # B x L x k routing of the current decode step
        self._wanted: dict[int, set[int]] = {}  # layer -> experts given a prefetch score for it
        self._prefetched: dict[int, set[int]] = {}  # layer -> experts copied ahead for it
        self._host_top: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # pinned D x B x k ids, scores

    def __exit__(self, *exc) -> None:
        self.streams.synchronize()
        super().__exit__(*exc)

    def _begin_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        super()._begin_forward(module, args, kwargs)
        if self.phase == "decode" and self.predictor is not None and (
                self._history is None or len(self._history) != self.batch):
            self._history = torch.zeros(self.batch, self.L, self.k, dtype=torch.long, device=self.device)

    # one MoE layer ------------------------------------------------------------------------------
    def run_layer(self, l: int, hidden: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """T x H output of MoE layer ``l`` for hidden states (T x H) routed to ``idx`` (T x k) with ``weights``."""
        with self.cpu("wait for routing"):
            routing = Routing(idx, self.E)
        targets = self._targets(l) if (self.policy.predict and self.predictor is not None and self.phase == "decode"
                                       and self._history is not None and len(self._history) == len(idx)) else []
        # the predictor stream starts from the routing (a host-side predictor reads none of it)
        routed = self.streams.record() if targets and not self._host_predictor else None
        hits = self._look_up(l, routing.needed)
        missing = [e for e in routing.needed if e not in hits]
        ranked, prefetched = None, False  # the predicted experts, best first; their copies are queued
        if self.phase == "decode" and len(routing.needed) <= self.cache.slots:
            # a decode call computes little: every pair in one group once its misses land, shapes fixed per batch
            with self.cpu("queue fetches"):
                keep = {(l, e) for e in routing.needed}
                slots = hits | dict(zip(missing, self.cache.fetch(l, missing, self.stores[l], self.phase, keep,
                                                                  self._fetch_stream) if missing else []))
            inputs = self._load_all(hidden, weights, routing, slots)  # before any prefetch: see _load_all
            scores = self._queue_predictor(l, hidden, idx, routed, targets)
            if targets and self._host_predictor:  # its guesses are on the host already
                ranked = self._rank(scores)
                if sum(map(len, ranked)) <= self.cache.slots - len(keep):
                    # room beside this layer's experts: layer l+1's copies are queued before this layer's compute,
                    # as at B=1 the copies bound a step
                    self._prefetch_ranked(targets, ranked, busy=keep)
                    prefetched = True
            out = self._compute_all(l, hidden, weights, inputs, slots)
        else:
            out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # T x H, summed in fp32
            if hits:
                with self.cpu("queue compute"):
                    rows = self._upload(routing.rows(hits, self.cache.slots))  # before this call's copies
                with self.stall.span():
                    self._wait_ready(hits.values())
                with self.cpu("queue compute"):
                    self._add_group(l, hidden, weights, rows, hits, out)
            scores = self._queue_predictor(l, hidden, idx, routed, targets)
            self._fetch_and_compute(l, hidden, weights, routing, missing, out)
            out = out.to(hidden.dtype)
        if targets and not prefetched:  # after this layer's work is queued, free to refill its slots
            self._prefetch_ranked(targets, ranked or self._rank(scores))
        elif self.policy.prefetch_layer:
            with self.cpu("queue prefetch"):
                self._prefetch((l + 1) % self.L, [(e, 1.0) for e in range(self.E)])
        elif self.policy.prefill_lookahead and self.phase == "prefill" and l + 1 < self.L and idx.numel() >= 8 * self.E:
            # so many pairs route nearly every expert (uniform routing leaves one unused with odds e^-8), so the
            # copy stream fills the gap while the host reaches layer l+1's router with experts it will compute first
            with self.cpu("queue prefetch"):
                self._prefetch(l + 1, [(e, 1.0) for e in range(min(self.cache.slots, self.E))], predicted=False)
        return out

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        """A host index array on the device, queued on the current stream without blocking the host."""
        t = torch.from_numpy(array)
        return t.pin_memory().to(self.device, non_blocking=True) if self.streams.cuda else t

    def _wait_ready(self, slots) -> None:
        """Make the compute stream wait until ``slots``' copies have landed (a group's slots share one event)."""
        for event in {id(e): e for e in (self.cache.ready[s] for s in slots)}.values():
            self.streams.wait(self.streams.compute, event)

    def _look_up(self, l: int, needed: list[int]) -> dict[int, int]:
        """Cached experts among ``needed`` (expert -> slot), counted per phase."""
        cache = self.cache
        if not self.policy.reuse:
            cache.forget()
        for e in self._wanted.pop(l, ()):  # this layer's router has spoken; predictions for it are moot
            if (s := cache.lookup((l, e))) is not None:
                cache.wanted[s] = 0.0
        hits = {e: s for e in needed if (s := cache.lookup((l, e))) is not None}
        cache.stats.lookups[self.phase] += len(needed)
        cache.stats.hits[self.phase] += len(hits)
        cache.stats.prefetch_used += len(self._prefetched.pop(l, set()).intersection(hits))
        return hits

    def _fetch_and_compute(self, l: int, hidden: torch.Tensor, weights: torch.Tensor, routing: Routing,
                           missing: list[int], out: torch.Tensor) -> None:
        """Fetch ``missing`` experts in groups of half the cache, each group computed as soon as it lands. With a
        copy stream, the next group's copies are queued before this group's compute, so the copy stream always
        has work while the host queues compute. A group's pair rows travel on its stream right after its experts:
        host-to-device copies run in order, so rows uploaded on the compute stream would wait behind the next
        group's copies, and this group's compute with them."""
        stream = self._fetch_stream
        chunk = max(1, self.cache.slots // 2)
        groups = [missing[i:i + chunk] for i in range(0, len(missing), chunk)]
        depth = 2 if self.policy.overlap and 2 * chunk <= self.cache.slots else 1  # groups fetched, not computed
        queued: list[tuple[dict[int, int], torch.Tensor]] = []  # (expert -> slot, rows) of each fetched group
        for i in range(len(groups)):
            with self.stall.span():
                while len(queued) < depth and i + len(queued) < len(groups):
                    experts = groups[i + len(queued)]
                    keep = {(l, e) for group, _ in queued for e in group}  # not computed yet: not to be refilled
                    with self.cpu("queue fetches"):
                        slots = self.cache.fetch(l, experts, self.stores[l], self.phase, keep, stream, seal=False)
                        fetched = dict(zip(experts, slots))
                        with self.streams.on(stream):
                            rows = self._upload(routing.rows(fetched, self.cache.slots))
                        self.cache.seal(slots, stream)
                        if stream is not self.streams.compute:  # allocated on the copy stream, read on compute
                            rows.record_stream(self.streams.compute)
                    queued.append((fetched, rows))
                group, rows = queued.pop(0)
                self._wait_ready(group.values())
            with self.cpu("queue compute"):
                self._add_group(l, hidden, weights, rows, group, out)

    @property
    def _fetch_stream(self):
        return self.streams.copy if self.policy.overlap else self.streams.compute

    def _load_all(self, hidden: torch.Tensor, weights: torch.Tensor, routing: Routing,
                  slots: dict[int, int]) -> tuple | torch.Tensor:
        """Queue the upload of a one-group call's pair rows (``slots``: expert -> slot), with the call's other inputs
        where it is replayed from a CUDA graph; what ``_compute_all`` takes. Called before the call's prefetch:
        host-to-device copies run in issue order, so rows queued behind layer l+1's copies would hold layer l's
        compute, and the host's next routing read with it, until those copies land."""
        with self.cpu("queue compute"):
            rows = routing.rows(slots, self.cache.slots)
            return self._graphs.load(hidden, weights, rows) if self._graphs is not None else self._upload(rows)

    def _compute_all(self, l: int, hidden: torch.Tensor, weights: torch.Tensor, inputs: tuple | torch.Tensor,
                     slots: dict[int, int]) -> torch.Tensor:
        """T x H output of every pair of the call, its experts resident in ``slots`` (expert -> slot) and its inputs
        loaded by ``_load_all``: one group, replayed from a CUDA graph where they run."""
        with self.stall.span():
            self._wait_ready(slots.values())
        with self.cpu("queue compute"):
            out = self._graphs.run(l, self._slot_views[l], inputs) if self._graphs is not None \
                else slot_experts(self._slot_views[l], hidden, weights, inputs, self.cache.slots)  # T x H
            self.cache.release(list(slots.values()))
        return out

    def _add_group(self, l: int, hidden: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor,
                   slots: dict[int, int], out: torch.Tensor) -> None:
        """Add the output of the resident experts ``slots`` (expert -> slot) for their pairs (``rows``) to ``out``."""
        add_slot_experts(self._slot_views[l], hidden, weights, rows, self.cache.slots, out)
        self.cache.release(list(slots.values()))

    # decode prediction --------------------------------------------------------------------------
    def _targets(self, l: int) -> list[int]:
        """Layers to predict at layer ``l``: l + d, and at a step's first layer every layer up to d."""
        first = 1 if l == 0 else l + self.lookahead
        return list(range(first, min(l + self.lookahead, self.L - 1) + 1))

    def _queue_predictor(self, l: int, hidden: torch.Tensor, idx: torch.Tensor, routed, targets: list[int]):
        if not targets:
            return None
        with self.cpu("queue predictor"):
            return self._launch_predictor(l, hidden, idx, routed, targets)

    def _launch_predictor(self, l: int, hidden: torch.Tensor, idx: torch.Tensor, routed, targets: list[int]) -> tuple:
        """Queue the predictor for ``targets`` on its stream: D x B x k top ids and scores on the host, and the
        event that says they have landed (the CPU reads them only after the misses are queued). A host predictor
        gives its D B x k guesses at once, with no scores (all equally sure) and nothing to wait for."""
        if self._host_predictor:  # nothing to queue; no history is kept for it
            return [self.predictor.top(t) for t in targets], None, None
        stream = self.streams.predict
        self.streams.wait(stream, routed)
        if self.streams.cuda:  # read on the predictor's stream: not to be reused by the compute stream before
            idx.record_stream(stream)
            hidden.record_stream(stream)
        with self.streams.on(stream), self.predict_time.span(stream):
            self._history[:, l].copy_(idx)
            # next-gate: layer t's router on this layer's MoE input (t = l + 1; such predictors take look-ahead 1)
            scores = torch.stack([self.predictor.scores(self._history, t, self._next_gate[t](hidden)
                                                        if self._next_gate else None)
                                  for t in targets])  # D x B x E
            top = scores.topk(self.k, dim=2)  # D x B x k
            if top.indices.device.type == "cpu":  # the CPU playing the GPU
                return top.indices.numpy(), top.values.numpy(), None
            shape = tuple(top.indices.shape)
            if shape not in self._host_top:  # reused: no pinned allocation per call
                self._host_top[shape] = (torch.empty(shape, dtype=torch.long, pin_memory=True),
                                         torch.empty(shape, dtype=torch.float32, pin_memory=True))
            ids, vals = self._host_top[shape]
            ids.copy_(top.indices, non_blocking=True)
            vals.copy_(top.values, non_blocking=True)
            done = self.streams.record(stream)
        return ids.numpy(), vals.numpy(), done  # views of the pinned buffers: read once ``done`` has passed

    def _rank(self, scores) -> list[list[tuple[int, float]]]:
        """Per target: the predicted union of the batch's experts scored at least ``prefetch_min_score`` (a host
        predictor's all score 1), best score first."""
        ids, vals, done = scores
        with self.cpu("wait for predictor"):
            if done is not None:
                done.synchronize()  # the CPU waits for the predictor only, not for the compute stream
            ranked = []
            for d, target_ids in enumerate(ids):  # B x k each
                target_ids = target_ids.reshape(-1).tolist()  # B*k
                target_vals = vals[d].reshape(-1).tolist() if vals is not None else [1.0] * len(target_ids)
                best: dict[int, float] = {}
                for e, v in zip(target_ids, target_vals):
                    if v >= self.prefetch_min_score:
                        best[e] = max(v, best.get(e, 0.0))
                ranked.append(sorted(best.items(), key=lambda item: -item[1]))
        return ranked

    def _prefetch_ranked(self, targets: list[int], ranked: list[list[tuple[int, float]]],
                         busy: frozenset | set = frozenset()) -> None:
        """Prefetch each target layer's ranked experts, nearest layer first."""
        with self.cpu("queue prefetch"):
            for target, choice in zip(targets, ranked):
                self._prefetch(target, choice, busy=busy)

    def _prefetch(self, layer: int, ranked: list[tuple[int, float]], predicted: bool = True,
                  busy: frozenset | set = frozenset()) -> None:
        """Copy the best-ranked experts of ``layer`` into the cache (as many as it holds besides the ``busy`` keys,
        which stay) on the copy stream. ``predicted``: counted in the prefetch statistics (the prefill look-ahead
        is not a prediction)."""
        cache, ranked = self.cache, ranked[:self.cache.slots - len(busy)]
        self._wanted.setdefault(layer, set()).update(e for e, _ in ranked)
        fetch = []
        for e, score in ranked:
            if (s := cache.lookup((layer, e))) is None:
                fetch.append((e, score))
            else:
                cache.wanted[s] = max(cache.wanted[s], score)
        if fetch:
            experts = [e for e, _ in fetch]
            cache.fetch(layer, experts, self.stores[layer], self.phase, {(layer, e) for e, _ in ranked} | busy,
                        wanted=[score for _, score in fetch])
            if predicted:
                cache.stats.prefetched += len(experts)
                self._prefetched.setdefault(layer, set()).update(experts)

    # measurement --------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self.streams.synchronize()
        self.cache.stats = type(self.cache.stats)()
        self.stall, self.predict_time, self.cpu = SpanTimer(self.streams), SpanTimer(self.streams), CpuSections()

    def stats(self) -> dict:
        """Counters since the last reset: bytes and copies per phase, hit rates, stall and predictor time (device),
        host time per engine section (waiting for the routing or the predictor, queueing work), and how expert
        copies were queued (``Streams.copy_path``)."""
        s = self.cache.stats
        return {
            "cache_slots": self.cache.slots, "cache_bytes": self.cache.nbytes,
            "bytes_h2d": dict(s.bytes), "copies": dict(s.copies),
            "hit_rate": {p: s.hits[p] / s.lookups[p] if s.lookups[p] else None for p in s.lookups},
            "prefetched": s.prefetched,
            "prefetch_precision": s.prefetch_used / s.prefetched if s.prefetched else None,
            "stall_ms": self.stall.total_ms(), "predictor_ms": self.predict_time.total_ms(),
            "host_ms": dict(self.cpu.ms), "copy_path": self.streams.copy_path,
        }
