"""Find the MoE layers of a transformers model and record their routing with forward pre-hooks.

transformers (>= 5) dispatches every experts module through its experts interface, so each one is
called as ``experts(hidden_states, top_k_index, top_k_weights)``. One forward pre-hook per MoE
layer therefore sees the router's choice for every token, for any architecture that uses the
interface. The recorder installs its hooks on ``__enter__`` and removes them on ``__exit__``: with
tracing off the model is untouched and pays nothing.

Shape legend: T tokens in one forward call, L MoE layers, E experts, k top-k, H hidden size,
D look-ahead depth of the next-gate speculation.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


class UnsupportedModelError(ValueError):
    """The model has no MoE layers the tracer can hook."""


@dataclass(frozen=True)
class MoELayer:
    name: str  # module path of the experts module
    decoder_index: int  # index of its decoder layer in the model
    experts: nn.Module
    router: nn.Module | None  # the sibling gate/router; None if not found (no next-gate then)


@dataclass(frozen=True)
class MoEGeometry:
    num_layers: int  # MoE layers only
    num_experts: int
    top_k: int
    decoder_indices: tuple[int, ...]


def _is_interface_experts(module: nn.Module) -> bool:
    # functools.wraps copies the wrapped name, so look at the code object the decorator installed
    code = getattr(getattr(type(module), "forward", None), "__code__", None)
    return code is not None and code.co_qualname.startswith("use_experts_implementation.")


def _decoder_index(name: str) -> int:
    numbers = re.findall(r"\.(\d+)\.", f".{name}.")
    if not numbers:
        raise UnsupportedModelError(f"cannot tell the decoder layer of experts module {name!r}")
    return int(numbers[-1])


def find_moe_layers(model: nn.Module, model_name: str = "model") -> list[MoELayer]:
    """The model's MoE layers in forward order; refuses models the tracer cannot record."""
    layers, unsupported = [], []
    for name, module in model.named_modules():
        if _is_interface_experts(module):
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            router = next((getattr(parent, a) for a in ("gate", "router") if isinstance(getattr(parent, a, None), nn.Module)),
                          None)
            layers.append(MoELayer(name, _decoder_index(name), module, router))
        elif name.rpartition(".")[2] == "experts":
            unsupported.append(f"{name} ({type(module).__name__})")
    if unsupported:
        raise UnsupportedModelError(
            f"{model_name}: experts module(s) not dispatched through transformers' experts interface: "
            f"{', '.join(unsupported[:3])}{' ...' if len(unsupported) > 3 else ''}. duoserve records routing only "
            "for models whose experts use @use_experts_implementation (transformers >= 5).")
    if not layers:
        raise UnsupportedModelError(f"{model_name} ({type(model).__name__}) has no MoE layers: no experts module "
                                    "dispatched through transformers' experts interface was found.")
    return sorted(layers, key=lambda layer: layer.decoder_index)


def moe_geometry(model: nn.Module, layers: list[MoELayer]) -> MoEGeometry:
    """L, E, k and the decoder index of each MoE layer."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    top_k = getattr(config, "num_experts_per_tok", None)
    experts = {getattr(layer.experts, "num_experts", None) for layer in layers}
    if top_k is None or None in experts or len(experts) != 1:
        raise UnsupportedModelError(f"cannot read top-k / expert count from {type(model).__name__}'s config "
                                    f"(num_experts_per_tok={top_k}, experts per layer={sorted(map(str, experts))})")
    return MoEGeometry(len(layers), experts.pop(), int(top_k), tuple(layer.decoder_index for layer in layers))


def _router_top_k(router: nn.Module, hidden: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k ids chosen by ``router`` for ``hidden`` (T x H), through its own forward, bypassing its hooks."""
    out = router.forward(hidden)
    if isinstance(out, tuple) and out[-1].dtype in (torch.int64, torch.int32) and out[-1].shape[-1] == k:
        return out[-1]  # transformers' routers return (logits, weights, indices)
    logits = out[0] if isinstance(out, tuple) else out
    return logits.topk(k, dim=-1).indices


def _logit_top_k(weight: torch.Tensor, bias: torch.Tensor | None, hidden: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k of a router's linear logits: two kernels instead of the router's whole forward."""
    return nn.functional.linear(hidden.to(weight.dtype), weight, bias).topk(k, dim=-1).indices


@torch.no_grad()
def next_gate_fn(router: nn.Module, k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The cheapest exact way to get ``router``'s top-k ids for T x H hidden states.

    Most routers pick the top-k of a monotonic function (softmax, sigmoid) of their linear logits;
    then the logits' top-k is the same set at a fraction of the launches, which is what keeps
    tracing overhead low in launch-bound decode. Routers that do more (group-limited routing,
    score-correction biases) fail the probe on random hidden states and keep their own forward.
    """
    weight = getattr(router, "weight", None)
    bias = router.bias if isinstance(getattr(router, "bias", None), torch.Tensor) else None
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        probe = torch.randn(256, weight.shape[1], generator=torch.Generator().manual_seed(0))
        probe = probe.to(weight.device, weight.dtype)
        try:
            same = torch.equal(_router_top_k(router, probe, k).sort(-1).values,
                               _logit_top_k(weight, bias, probe, k).sort(-1).values)
        except (RuntimeError, ValueError):
            same = False
        if same:
            return lambda hidden: _logit_top_k(weight, bias, hidden, k)
    return lambda hidden: _router_top_k(router, hidden, k)


@dataclass
class ForwardRecord:
    """Routing of one forward call, on the CPU."""

    ids: torch.Tensor  # T x L x k, int16, router order
    weights: torch.Tensor  # T x L x k, float32
    nextgate: dict[int, torch.Tensor] = field(default_factory=dict)  # depth d -> T x (L - d) x k, int16


class RoutingRecorder:
    """Records, while active, every MoE layer's top-k ids and weights, and the next-gate speculation.

    ``lookahead`` D >= 1 also applies the router of MoE layer l + d (d = 1..D) to the hidden state
    entering layer l: the "next-gate" guess, the strongest zero-training baseline. D = 0 disables it.
    """

    def __init__(self, layers: list[MoELayer], top_k: int, lookahead: int = 1):
        if lookahead and any(layer.router is None for layer in layers[1:]):
            raise UnsupportedModelError("next-gate needs each MoE layer's router as a `gate` or `router` sibling of "
                                        "its experts module; pass lookahead=0 to trace without it")
        self.layers, self.top_k, self.lookahead = layers, top_k, lookahead
        self._next_gate = [next_gate_fn(layer.router, top_k) if lookahead and l else None
                           for l, layer in enumerate(layers)]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._clear()

    def _clear(self) -> None:
        L = len(self.layers)
        self._ids: list[list[torch.Tensor]] = [[] for _ in range(L)]
        self._weights: list[list[torch.Tensor]] = [[] for _ in range(L)]
        self._nextgate = {d: [[] for _ in range(L - d)] for d in range(1, self.lookahead + 1)}

    def _hook(self, l: int):
        L = len(self.layers)
        depths = range(1, min(self.lookahead, L - 1 - l) + 1)

        # Hot path: append the router's own tensors, no conversion or copy (pop() does that once).
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden, ids, weights = (*args, *(kwargs[n] for n in ("hidden_states", "top_k_index",
                                                                 "top_k_weights")[len(args):]))[:3]
            self._ids[l].append(ids)  # T x k
            self._weights[l].append(weights)  # T x k
            for d in depths:
                self._nextgate[d][l].append(self._next_gate[l + d](hidden))  # T x k

        return pre_hook

    def __enter__(self) -> RoutingRecorder:
        self._clear()
        self._handles = [layer.experts.register_forward_pre_hook(self._hook(l), with_kwargs=True)
                         for l, layer in enumerate(self.layers)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def pop(self) -> list[ForwardRecord]:
        """The records of the forward calls since the last pop, one per call, moved to the CPU."""
        calls = {len(per_layer) for per_layer in self._ids}
        if len(calls) != 1:
            raise RuntimeError(f"MoE layers fired unequal numbers of times: {sorted(calls)}")
        if calls == {0}:
            return []
        sizes = [t.shape[0] for t in self._ids[0]]
        k = self.top_k
        for l, per_layer in enumerate(self._ids):
            if [t.shape[0] for t in per_layer] != sizes or per_layer[0].shape[-1] != k:
                raise RuntimeError(f"{self.layers[l].name}: routed shapes {[tuple(t.shape) for t in per_layer]} "
                                   f"differ from the first layer's {sizes} tokens x top-{k}")

        def gather(per_layer: list[list[torch.Tensor]], dtype: torch.dtype) -> list[torch.Tensor]:
            stacked = torch.stack([torch.cat(calls_) for calls_ in per_layer], dim=1)  # sum(T) x L' x k
            return list(stacked.to(dtype).cpu().split(sizes))

        ids = gather(self._ids, torch.int16)
        weights = gather(self._weights, torch.float32)
        nextgate = {d: gather(layers, torch.int16) for d, layers in self._nextgate.items() if layers}
        self._clear()
        return [ForwardRecord(ids[c], weights[c], {d: ng[c] for d, ng in nextgate.items()}) for c in range(len(sizes))]
