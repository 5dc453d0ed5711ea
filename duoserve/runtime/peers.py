"""The real peers a user would otherwise pick, run on the same model object: Accelerate's offload hooks.

``accelerate`` and ``accelerate-pinned`` hand each MoE layer's experts module to Accelerate's own
``cpu_offload`` (what ``from_pretrained(device_map=...)`` sets up for a module mapped to "cpu"): its
``AlignDevicesHook`` moves every parameter of the module to the GPU before each forward and drops it after,
from the state dict it was given, pageable (as a checkpoint loads) or pinned. Nothing here re-implements
Accelerate; the plugin only counts what the hook moves (every expert of a layer, each call) and leaves
the model's own experts kernel to compute.

Shape legend: L MoE layers, E experts.
"""

from __future__ import annotations

import torch
from accelerate import cpu_offload
from accelerate.hooks import remove_hook_from_module
from torch import nn

from duoserve.runtime.plugin import ExpertsPlugin
from duoserve.runtime.sources import RoutingSource
from duoserve.runtime.store import HostExperts, drop_experts


class AccelerateOffload(ExpertsPlugin):
    """Inside ``with``, every experts module of ``model`` is offloaded by Accelerate's ``cpu_offload`` to run on
    ``device`` from the parameters in ``stores`` (per-module host stores; with ``pin``, where a GPU is present,
    those not pinned yet are copied to pinned memory first); leaving it removes the hooks and the parameters
    again."""

    def __init__(self, model: nn.Module, stores: list[HostExperts], pin: bool, routing: RoutingSource | None = None,
                 device: torch.device | str | None = None):
        super().__init__(model, routing)
        if stores[0].modules is None:
            raise ValueError("Accelerate's offload reads per-module expert stores (HostExperts.as_modules)")
        self.device = torch.device(device) if device is not None else self.device
        pin = pin and self.device.type == "cuda"
        self._weights = [{n: p.pin_memory() if pin and not p.is_pinned() else p for n, p in store.modules.items()}
                         for store in stores]
        self._layer_bytes = [sum(p.nbytes for p in weights.values()) for weights in self._weights]
        self.reset_stats()

    def __enter__(self):
        for layer, weights in zip(self.layers, self._weights):
            for name, value in weights.items():
                layer.experts.register_parameter(name, nn.Parameter(value, requires_grad=False))
            cpu_offload(layer.experts, execution_device=self.device, state_dict=weights)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for layer in self.layers:
            remove_hook_from_module(layer.experts)
        drop_experts(self.layers)

    def run_layer(self, l: int, hidden: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The model's own kernel on the parameters Accelerate's hook has just moved to the device."""
        self.bytes[self.phase] += self._layer_bytes[l]
        self.calls[self.phase] += 1
        return super().run_layer(l, hidden, idx, weights)

    def reset_stats(self) -> None:
        self.bytes = {"prefill": 0, "decode": 0}
        self.calls = {"prefill": 0, "decode": 0}

    def stats(self) -> dict:
        """What the hooks moved since the last reset: every expert of each layer called (``bytes_h2d``), the layer
        calls (``copies``: Accelerate copies a module's parameters per call); no cache, so no hit rate."""
        return {"bytes_h2d": dict(self.bytes), "copies": dict(self.calls),
                "hit_rate": {"prefill": None, "decode": None}, "stall_ms": None, "predictor_ms": None,
                "host_ms": {}, "copy_path": "accelerate AlignDevicesHook", "pinned_experts": 0,
                "graphed_layer_calls": 0}
