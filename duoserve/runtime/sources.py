"""What the engine reads routing and predictions from: the protocols its sources and predictors follow.

Routing: the model's own router (no source), or a ``RoutingSource`` that overrides it for a forward
pass (benchmarks on random weights, whose routers are degenerate: ``duoserve.bench.drivers``). A
source draws every layer's routing when a pass starts, so an oracle can look ahead.

Predictors score the experts of a later layer for each sequence of a decode step: on the device
(``LayerPredictor``: a trained artifact, ``duoserve.predictor.TrainedPredictor``) or on the host
(``HostPredictor``: the benchmarks' oracle, which names its guesses directly).

Shape legend: T tokens in a forward pass, B sequences, L MoE layers, E experts, k top-k.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from duoserve.discovery import Gate


class RoutingSource(Protocol):
    def begin(self, tokens: int) -> torch.Tensor: ...  # L x T x k for the forward pass starting (host or device)
    def ids(self, layer: int) -> np.ndarray: ...  # T x k of that pass, on the host


class LayerPredictor(Protocol):
    """Scores layer ``target``'s experts for each sequence of a decode step, on the device, ``depth`` layers ahead
    (1..``lookahead``), from the B x L x k routing history up to layer target - depth (and, if it uses them, the
    next-gate's B x m ids for ``target``: ``gate``, the target's next-gate, applied to ``hidden``, the B x H MoE input
    of layer target - depth; ``nextgate`` says how many ids, 0 for none, and ``nextgate_scores`` whether their
    scores too). ``top`` gives each sequence's ``k`` best scores in [0, 1] and their expert ids (B x k each, on the
    device; they may be overwritten by a later call). Optionally, ``history(batch, device)`` gives the zeroed
    B x L x k buffer the engine keeps the routing in and passes to ``top``: one the predictor reads in place
    (``TrainedPredictor``'s CUDA graphs do); without it the engine keeps a buffer of its own."""

    on_host = False
    nextgate: int
    nextgate_scores: bool
    lookahead: int

    def top(self, history: torch.Tensor, target: int, k: int, hidden: torch.Tensor | None = None,
            gate: Gate | None = None, depth: int = 1) -> tuple[torch.Tensor, torch.Tensor]: ...


class HostPredictor(Protocol):
    """Names layer ``target``'s predicted experts on the host from no device input, all equally sure (the
    benchmarks' oracle): the engine queues nothing on the device for it and waits for nothing."""

    on_host = True

    def begin_step(self) -> None: ...  # a decode step starts: the routing it knows is new

    def top(self, target: int) -> np.ndarray: ...  # B x k expert ids
