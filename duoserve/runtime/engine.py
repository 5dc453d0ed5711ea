"""The offload engine: runs a transformers MoE model whose routed experts live in host memory.

Shape legend: T tokens in a forward pass, H hidden size, L MoE layers, E experts, k top-k.

It plugs in through transformers' experts interface (``plugin.py``), and each MoE layer's call runs the
schedule of ``scheduler.py`` (routing read, cache look-up, misses fetched, prefill grouping, decode prefetch)
over the model's experts on the device: ``experts.SlotCompute`` computes from the cache's slots, a decode call
whose experts all fit replayed from a CUDA graph where one can be captured. On a GPU the rest of a decode step
(attention, norms, routers) replays from CUDA graphs too, a piece per stretch between experts calls
(``stepgraph.py``), so a step's host time is the engine's own.

``cpu-experts`` skips the schedule: the hidden states go to the host, the routed experts run there on the CPU,
read in place from the packed stores (the same grouped kernels, every expert its own group), and the output
comes back.
"""

from __future__ import annotations

import torch
from torch import nn

from duoserve.discovery import next_gate_fn
from duoserve.predictor.fast import TrainedPredictor
from duoserve.predictor.model import ExpertPredictor
from duoserve.runtime.experts import Routing, SlotCompute, SlotView, graphs_supported, slot_experts, slot_windows
from duoserve.runtime.plugin import ExpertsPlugin
from duoserve.runtime.policies import Policy
from duoserve.runtime.scheduler import ROUTING_SECTION, ExpertScheduler
from duoserve.runtime.settings import EngineSettings
from duoserve.runtime.sources import HostPredictor, LayerPredictor, RoutingSource
from duoserve.runtime.store import HostExperts
from duoserve.runtime.streams import Streams


class OffloadEngine(ExpertsPlugin, ExpertScheduler):
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
        ExpertsPlugin.__init__(self, model, routing)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if isinstance(predictor, ExpertPredictor):
            predictor.check_geometry(self.L, self.E, self.k)
            predictor = TrainedPredictor(predictor, self.device, compile=not settings.eager)

        def compute(cache, streams, timers) -> SlotCompute:
            graphs = not settings.eager and graphs_supported(cache.layout.dtype, self.device)
            return SlotCompute([layer.experts for layer in self.layers], cache, streams, timers, graphs=graphs)

        ExpertScheduler.__init__(self, (self.L, self.E, self.k), stores, policy, settings, Streams(self.device),
                                 compute, predictor, self._next_gate(predictor) if predictor is not None else None)
        # cpu-experts: each layer's experts module seen with its host parameters as its experts, read in place from
        # the packed store's rows (one expert's parameters are contiguous in its row; no second host copy)
        if policy.host_compute and stores[0].dequantizes:
            raise ValueError(f"policy {policy.name} computes on the host from the model's own dtype; its experts "
                             "cannot be stored quantized")
        self._host_views = [SlotView(layer.experts, store.layout.views(store.packed), self.E) for layer, store in
                            zip(self.layers, stores)] if policy.host_compute else None
        if settings.step_graphs and not settings.eager and self.device.type == "cuda":
            self.graph_steps()

    @property
    def layers_replayed(self) -> bool:
        """Whether this decode call is replayed from step graphs: the host reaches the next layer call after a few
        graph replays, so the scheduler may leave its prefetch to that call's start (``defer_prefetch``)."""
        return self.step_graphs is not None and self.step_graphs.replaying

    def _next_gate(self, predictor) -> list | None:
        """Per target layer t >= 1: its router's top-m ids (and scores) on layer t-1's MoE input, for a predictor
        that reads next-gate features; None for one that does not."""
        width = getattr(predictor, "nextgate", 0)
        if not width:
            return None
        if any(layer.router is None for layer in self.layers[1:]):
            raise ValueError("this predictor uses next-gate features, but not every MoE layer's router was found "
                             "(a `gate` or `router` sibling of its experts module)")
        scores = getattr(predictor, "nextgate_scores", False)  # no softmax in the decode step for ids alone
        return [None] + [next_gate_fn(layer.router, self.k, width, scores) for layer in self.layers[1:]]

    def __exit__(self, *exc) -> None:
        self.streams.synchronize()
        super().__exit__(*exc)

    def reset_stats(self) -> None:
        super().reset_stats()
        if self.step_graphs is not None:
            self.step_graphs.captured = self.step_graphs.replayed = 0

    def stats(self) -> dict:
        """The schedule's counters (``ExpertScheduler.stats``) and the decoder-layer calls replayed from step
        graphs."""
        return {**super().stats(), "graphed_layer_calls": self.step_graphs.replayed if self.step_graphs else 0}

    def _begin_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        super()._begin_forward(module, args, kwargs)
        self.begin_pass(self.phase, self.batch)

    def run_layer(self, l: int, hidden: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """T x H output of MoE layer ``l`` for hidden states (T x H) routed to ``idx`` (T x k) with ``weights``."""
        if self._host_views is None:
            return ExpertScheduler.run_layer(self, l, hidden, idx, weights)
        with self.timers.cpu(ROUTING_SECTION):
            routing = Routing(idx, self.E)
        return self._host_layer(l, hidden, weights, routing)

    def _host_layer(self, l: int, hidden: torch.Tensor, weights: torch.Tensor, routing: Routing) -> torch.Tensor:
        """T x H output of layer ``l``'s routed experts computed on the host CPU (``cpu-experts``)."""
        with self.timers.cpu("host experts"):
            rows = routing.rows({e: e for e in routing.needed}, self.E)
            out = slot_experts(self._host_views[l], hidden.cpu(), weights.cpu(), torch.from_numpy(rows), self.E,
                               slot_windows(rows, self.E))  # T x H
        return out.to(hidden.device)
