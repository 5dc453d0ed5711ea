"""The decode prefetch plan: predict the experts of layers ahead while a layer computes, and copy them in.

At decode layer l the predictor scores layer l+d (d = the look-ahead; a step's first layer predicts
1..d) with its depth-d head from the token's routing history up to l (and, for predictors trained with
them, next-gate ids and scores: layer t's router on this layer's input, computed inside the predictor's
call, on a GPU inside its CUDA graph), on its own stream. Its top
experts, the batch's union scored at least the minimum score, best first, are copied into the cache
at once, so the target layer finds them resident; its router's real choice is still checked and a miss is fetched then.

A predictor on the host (the benchmarks' oracle) names its guesses at once: nothing is queued on
the device for it and nothing waited for.

Shape legend: B sequences, L MoE layers, E experts, k top-k, H hidden size, D targets at one layer.
"""

from __future__ import annotations

import torch

from duoserve.discovery import Gate
from duoserve.runtime.cache import ExpertCache
from duoserve.runtime.sources import HostPredictor, LayerPredictor
from duoserve.runtime.store import HostExperts
from duoserve.runtime.streams import EngineTimers, Streams

Ranked = list[tuple[int, float]]  # (expert, score), best first


class DecodePrefetch:
    """The plan for one engine: its predictor, look-ahead and minimum score (see the module docstring)."""

    def __init__(self, predictor: LayerPredictor | HostPredictor, cache: ExpertCache, stores: list[HostExperts],
                 streams: Streams, timers: EngineTimers, geometry: tuple[int, int, int], lookahead: int,
                 min_score: float,
                 next_gate: list[Gate | None] | None):
        self.predictor, self.cache, self.stores, self.streams, self.timers = predictor, cache, stores, streams, timers
        self.L, self.E, self.k = geometry
        self.lookahead, self.min_score, self.next_gate = lookahead, min_score, next_gate
        self.on_host = getattr(predictor, "on_host", False)
        self.history: torch.Tensor | None = None  # B x L x k routing of the current decode step
        self._host_top: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # pinned D x B x k ids, scores
        self._targets = [list(range(1 if l == 0 else l + lookahead, min(l + lookahead, self.L - 1) + 1))
                         for l in range(self.L)]  # asked at every layer call: worked out once

    def begin_step(self, batch: int) -> None:
        """A decode forward pass of ``batch`` sequences starts: a history of that size."""
        if self.on_host:
            self.predictor.begin_step()
        if self.history is None or len(self.history) != batch:  # a host predictor reads none: it sizes the step
            own = None if self.on_host else getattr(self.predictor, "history", None)  # the buffer it reads in place
            self.history = own(batch, self.streams.device) if own else \
                torch.zeros(batch, self.L, self.k, dtype=torch.long, device=self.streams.device)  # B x L x k

    def targets(self, l: int) -> list[int]:
        """Layers to predict at layer ``l``: l + d, and at a step's first layer every layer up to d."""
        return self._targets[l]

    def launch(self, l: int, hidden: torch.Tensor, idx: torch.Tensor, routed, targets: list[int]):
        """Queue the predictor for ``targets`` (nothing when empty); what ``rank`` reads."""
        if not targets:
            return None
        with self.timers.cpu("queue predictor"):
            return self._launch(l, hidden, idx, routed, targets)

    def _launch(self, l: int, hidden: torch.Tensor, idx: torch.Tensor, routed, targets: list[int]) -> tuple:
        """D x B x k top ids and scores on the host, and the event that says they have landed (the CPU reads them
        only after the misses are queued). A host predictor gives its D B x k guesses at once, with no scores (all
        equally sure) and nothing to wait for."""
        if self.on_host:  # nothing to queue; no history is kept for it
            return [self.predictor.top(t) for t in targets], None, None
        stream = self.streams.predict
        self.streams.wait(stream, routed)
        if self.streams.cuda:  # read on the predictor's stream: not to be reused by the compute stream before
            idx.record_stream(stream)
            hidden.record_stream(stream)
        shape = (len(targets), len(self.history), self.k)  # D x B x k
        if shape not in self._host_top:  # reused: no (pinned) allocation per call
            self._host_top[shape] = (torch.empty(shape, dtype=torch.long, pin_memory=self.streams.cuda),
                                     torch.empty(shape, dtype=torch.float32, pin_memory=self.streams.cuda))
        ids, vals = self._host_top[shape]
        with self.streams.on(stream), self.timers.predict.span(stream):
            self.history[:, l].copy_(idx)
            for d, t in enumerate(targets):
                # the head of depth t - l; next-gate features: layer t's router on this layer's MoE input
                gate = self.next_gate[t] if self.next_gate else None
                top_vals, top_ids = self.predictor.top(self.history, t, self.k, hidden, gate, depth=t - l)  # B x k each
                # to the host, where ``rank`` reads them (a CUDA graph's outputs are overwritten at its next replay)
                ids[d].copy_(top_ids, non_blocking=True)
                vals[d].copy_(top_vals, non_blocking=True)
            done = self.streams.record(stream)  # on the CPU: none, or a simulator's clock
        return ids.numpy(), vals.numpy(), done  # views of the host buffers: read once ``done`` has passed

    def rank(self, scores: tuple) -> list[Ranked]:
        """Per target: the predicted union of the batch's experts scored at least the minimum score (a host
        predictor's all score 1), best score first."""
        ids, vals, done = scores
        with self.timers.cpu("wait for predictor"):
            if done is not None:
                done.synchronize()  # the CPU waits for the predictor only, not for the compute stream
            ranked = []
            for d, target_ids in enumerate(ids):  # B x k each
                target_ids = target_ids.reshape(-1).tolist()  # B*k
                if vals is None:  # all equally sure: the union in the order named (what the sort below keeps)
                    ranked.append([(e, 1.0) for e in dict.fromkeys(target_ids)] if self.min_score <= 1.0 else [])
                    continue
                target_vals = vals[d].reshape(-1).tolist()
                best: dict[int, float] = {}
                for e, v in zip(target_ids, target_vals):
                    if v >= self.min_score:
                        best[e] = max(v, best.get(e, 0.0))
                ranked.append(sorted(best.items(), key=lambda item: -item[1]))
        return ranked

    def copy(self, targets: list[int], ranked: list[Ranked], busy: frozenset | set = frozenset()) -> None:
        """Copy each target layer's ranked experts into the cache, nearest layer first; ``busy`` keys stay."""
        with self.timers.cpu("queue prefetch"):
            for target, choice in zip(targets, ranked):
                self.cache.copy_ahead(target, choice, self.stores[target], "decode", busy=busy)
