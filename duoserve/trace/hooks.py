"""Record the routing of a transformers MoE model with forward pre-hooks on its experts modules.

One forward pre-hook per MoE layer (``duoserve.discovery``) sees the router's choice for every
token, for any architecture that uses transformers' experts interface. The recorder installs its
hooks on ``__enter__`` and removes them on ``__exit__``: with tracing off the model is untouched and
pays nothing.

Shape legend: T tokens in one forward call, L MoE layers, E experts, k top-k, H hidden size,
D look-ahead depth of the next-gate speculation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from duoserve.discovery import MoELayer, UnsupportedModelError, next_gate_fn


@dataclass
class ForwardRecord:
    """Routing of one forward call, on the CPU."""

    ids: torch.Tensor  # T x L x k, int16, router order
    weights: torch.Tensor  # T x L x k, float32
    nextgate: dict[int, torch.Tensor] = field(default_factory=dict)  # depth d -> T x (L - d) x m ids, int16
    nextgate_scores: dict[int, torch.Tensor] = field(default_factory=dict)  # depth d -> T x (L - d) x m, float16


class RoutingRecorder:
    """Records, while active, every MoE layer's top-k ids and weights, and the next-gate speculation.

    ``lookahead`` D >= 1 also applies the router of MoE layer l + d (d = 1..D) to the hidden state
    entering layer l: the "next-gate" guess, the strongest zero-training baseline, kept as its top
    ``width`` ids (default 2k) and their probabilities. D = 0 disables it.
    """

    def __init__(self, layers: list[MoELayer], top_k: int, lookahead: int = 1, width: int | None = None):
        if lookahead and any(layer.router is None for layer in layers[1:]):
            raise UnsupportedModelError("next-gate needs each MoE layer's router as a `gate` or `router` sibling of "
                                        "its experts module; pass lookahead=0 to trace without it")
        self.layers, self.top_k, self.lookahead = layers, top_k, lookahead
        self.width = width or 2 * top_k
        self._next_gate = [next_gate_fn(layer.router, top_k, self.width) if lookahead and l else None
                           for l, layer in enumerate(layers)]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._clear()

    def _clear(self) -> None:
        L = len(self.layers)
        self._ids: list[list[torch.Tensor]] = [[] for _ in range(L)]
        self._weights: list[list[torch.Tensor]] = [[] for _ in range(L)]
        self._nextgate = {d: [[] for _ in range(L - d)] for d in range(1, self.lookahead + 1)}  # (ids, scores)

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
                self._nextgate[d][l].append(self._next_gate[l + d](hidden))  # T x m ids, T x m scores

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
        guesses = {d: layers for d, layers in self._nextgate.items() if layers}
        nextgate = {d: gather([[ids for ids, _ in calls_] for calls_ in layers], torch.int16)
                    for d, layers in guesses.items()}
        scores = {d: gather([[p for _, p in calls_] for calls_ in layers], torch.float16)
                  for d, layers in guesses.items()}
        self._clear()
        return [ForwardRecord(ids[c], weights[c], {d: ng[c] for d, ng in nextgate.items()},
                              {d: sc[c] for d, sc in scores.items()}) for c in range(len(sizes))]
