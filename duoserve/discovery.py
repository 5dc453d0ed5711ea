"""Find the MoE layers of a transformers model: where its experts modules are, their geometry, their routers.

transformers (>= 5) dispatches every experts module through its experts interface, so each one is
called as ``experts(hidden_states, top_k_index, top_k_weights)``. Any module whose class forward was
installed by ``@use_experts_implementation`` is an MoE layer here, whatever the architecture; the
tracer hooks it and the runtime plugs into it. The next-gate function applies a layer's router to
another layer's input: the speculation both the tracer records and the runtime's predictors use.

Shape legend: T tokens, H hidden size, E experts, k top-k.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

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


def _router_logits_and_top_k(router: nn.Module, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``router``'s logits (T x E) and top-k ids for ``hidden`` (T x H), through its own forward, bypassing its
    hooks: transformers' routers return (logits, weights, indices)."""
    out = router.forward(hidden)
    logits = out[0] if isinstance(out, tuple) else out
    if isinstance(out, tuple) and out[-1].dtype in (torch.int64, torch.int32) and out[-1].shape[-1] == k:
        return logits, out[-1]
    return logits, logits.topk(k, dim=-1).indices


def _linear_logits(weight: torch.Tensor, bias: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(hidden.to(weight.dtype), weight, bias)


# the next-gate of a target layer, B x H hidden states to its router's B x m ids (and their B x m scores): what
# ``next_gate_fn`` makes (a module, so one compiled call of the runtime's predictor serves every target's)
Gate = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


def top_k(scores: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` best of ``scores`` along their last dimension and their ids, best first. Eagerly a topk; under
    ``torch.compile`` a sort, which Inductor fuses with the work around it into one kernel (a topk stays a library
    call of two: at batch 1 on a GPU, launches are the cost)."""
    if torch.compiler.is_compiling():
        ranked = scores.sort(dim=-1, descending=True)
        return ranked.values[..., :n], ranked.indices[..., :n]
    best = scores.topk(n, dim=-1)
    return best.values, best.indices


def _widen(logits: torch.Tensor, top: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """T x m ids (the router's top-k ``top`` first, then the most probable of the rest) and their softmax
    probabilities over all E experts (float32)."""
    probs = logits.float().softmax(-1)  # T x E
    k = top.shape[-1]
    if width > k:
        rest = top_k(probs.scatter(-1, top.long(), -1.0), width - k)[1]  # T x (m - k): not yet chosen
        top = torch.cat([top.long(), rest], dim=-1)
    return top, probs.gather(-1, top.long())


class LinearGate(nn.Module):
    """The next-gate of a router whose top-k is its linear logits' top-k: T x H hidden states to T x m ids, best
    first (the router's top-k lead), and with ``scores`` their softmax probabilities (T x m). Its weights are the
    router's own tensors, not copies. A module: ``torch.compile`` takes its tensors as inputs of the call it is
    passed to, so one compiled call serves every layer's gate."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, width: int, scores: bool):
        super().__init__()
        self.register_buffer("weight", weight.detach(), persistent=False)  # E x H
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)  # E
        self.width, self.scores = width, scores

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = _linear_logits(self.weight, self.bias, hidden)  # T x E
        ids = top_k(logits, self.width)[1]  # T x m
        return (ids, logits.float().softmax(-1).gather(-1, ids)) if self.scores else (ids,)


class RouterGate(nn.Module):
    """The next-gate through the router's own forward (routers that do more than a linear top-k): the same
    outputs as ``LinearGate``, their probabilities the softmax of the router's logits."""

    def __init__(self, router: nn.Module, k: int, width: int, scores: bool):
        super().__init__()
        self.router, self.k, self.width, self.scores = router, k, width, scores

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ids, probs = _widen(*_router_logits_and_top_k(self.router, hidden, self.k), self.width)  # T x m each
        return (ids, probs) if self.scores else (ids,)


@torch.no_grad()
def next_gate_fn(router: nn.Module, k: int, width: int | None = None, scores: bool = True
                 ) -> LinearGate | RouterGate:
    """The cheapest exact way to get ``router``'s guess for T x H hidden states: T x m ids (``width`` m, default
    k; its own top-k first) and, with ``scores``, their softmax probabilities (T x m); ``(ids,)`` without.

    Most routers pick the top-k of a monotonic function (softmax, sigmoid) of their linear logits;
    then the logits' top-k is the same set at a fraction of the launches, which is what keeps
    tracing overhead low in launch-bound decode. Routers that do more (group-limited routing,
    score-correction biases) fail the probe on random hidden states and keep their own forward;
    their probabilities are still the softmax of their logits.
    """
    m = width or k
    weight = getattr(router, "weight", None)
    bias = router.bias if isinstance(getattr(router, "bias", None), torch.Tensor) else None
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        probe = torch.randn(256, weight.shape[1], generator=torch.Generator().manual_seed(0))
        probe = probe.to(weight.device, weight.dtype)
        try:
            same = torch.equal(_router_logits_and_top_k(router, probe, k)[1].sort(-1).values,
                               _linear_logits(weight, bias, probe).topk(k, dim=-1).indices.sort(-1).values)
        except (RuntimeError, ValueError):
            same = False
        if same:
            return LinearGate(weight, bias, m, scores)
    return RouterGate(router, k, m, scores)
