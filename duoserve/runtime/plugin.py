"""How the runtime plugs into a transformers MoE model: its experts interface, and a hook that tells the phase.

Inside ``with ExpertsPlugin(model)`` every experts module of the model (``duoserve.discovery``) calls
``run_layer`` through an experts implementation registered under the plugin's own name, and a
forward pre-hook tells prefill from decode; with ``step_graphs`` the decoder layers' decode calls
are graphed around the experts calls (``stepgraph.py``). Leaving the ``with`` restores the model's
own implementation and forwards and removes the hook. Nothing is replaced globally.

Shape legend: T tokens in a forward pass, B sequences, S tokens per sequence, H hidden size,
L MoE layers, k top-k.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from duoserve.discovery import find_moe_layers, moe_geometry
from duoserve.runtime.sources import RoutingSource
from duoserve.runtime.stepgraph import StepGraphs, decoder_layers


class ExpertsPlugin:
    """By itself it runs the model's own experts kernel, on the routing of ``routing`` when one is given (the
    all-resident bound of a benchmark); ``OffloadEngine`` overrides ``run_layer``."""

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
        self.step_graphs: StepGraphs | None = None  # the decode step's layers graphed around the experts calls

    def __enter__(self):
        self._previous = self.model.config._experts_implementation
        self._kernels = [ALL_EXPERTS_FUNCTIONS.get_interface(self._previous, type(layer.experts).forward.__wrapped__)
                         for layer in self.layers]
        experts = self._experts_forward
        if self.step_graphs is not None:
            experts = self.step_graphs.__enter__().experts_call
        ALL_EXPERTS_FUNCTIONS[self._name] = experts
        self.model.set_experts_implementation(self._name)
        self._hook = self.model.register_forward_pre_hook(self._begin_forward, with_kwargs=True)
        return self

    def graph_steps(self) -> None:
        """Replay the decoder layers' decode calls from CUDA graphs around the experts calls (``stepgraph.py``; a CUDA
        model, generating on a ``generation.kv_cache``)."""
        first = self.layers[0]
        self.step_graphs = StepGraphs(decoder_layers(self.model, first.name, first.decoder_index),
                                      self._experts_forward, lambda: self.phase == "decode", self.device)

    @property
    def static_cache(self) -> bool:
        """Whether generations under this plugin need a static KV cache (``generation.kv_cache``): its step graphs
        address the cache's tensors."""
        return self.step_graphs is not None

    def __exit__(self, *exc) -> None:
        if self.step_graphs is not None:
            self.step_graphs.__exit__(*exc)
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
        """T x H output of MoE layer ``l`` for hidden states (T x H) routed to ``idx`` (T x k) with ``weights``."""
        return self._kernels[l](self.layers[l].experts, hidden, idx, weights)
