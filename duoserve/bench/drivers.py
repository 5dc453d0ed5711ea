"""The bench's drivers: routing sources and an oracle predictor that stand in for a trained model's own.

Random weights make a model's routers degenerate (a few experts take every token), so benchmarks on
config-only models drive routing with uniform random top-k or a replayed trace. The oracle knows the
source's routing and is degraded to a chosen recall, so latency can be charted against prediction
accuracy. Each follows a protocol of ``duoserve.runtime.sources``.

Shape legend: T tokens in a forward pass, B sequences, L MoE layers, E experts, k top-k.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from duoserve.runtime.sources import RoutingSource
from duoserve.trace.format import open_trace


def random_ids(rng: np.random.Generator, n: int, L: int, E: int, k: int) -> np.ndarray:
    """n x L x k uniformly random top-k expert ids, distinct within a layer (as a router picks them), on the host."""
    return np.argsort(rng.random((n, L, E), dtype=np.float32), axis=2)[..., :k]


class RandomRouting:
    """Uniformly random, distinct top-k experts per token and layer (seeded), drawn on ``device``.

    On a GPU the draw costs a forward pass microseconds, as a router does; on the host it took tens of
    milliseconds at a 4096-token prefill, charged to every policy's TTFT but to no bound. The host copy that
    ``ids`` reads (for an oracle) is queued at once and waited for only when first read.

    ``in_graph``: draw from the default generator and keep no host copy, so that ``torch.compile`` traces the
    draw into the decode step's graph (a generator object, a host copy and an event would each break it);
    then ``ids`` cannot be read (no oracle) and the draws are not seeded here.
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int, seed: int = 0,
                 device: torch.device | str = "cpu", in_graph: bool = False):
        self.shape, self.device = (num_layers, num_experts, top_k), torch.device(device)
        self.in_graph = in_graph
        self.generator = None if in_graph else torch.Generator(device=self.device).manual_seed(seed)
        self._ids: torch.Tensor | None = None  # L x T x k, on the host
        self._copied: torch.cuda.Event | None = None
        self._host: np.ndarray | None = None  # _ids once read: an oracle reads a layer per decode layer

    def begin(self, tokens: int) -> torch.Tensor:
        L, E, k = self.shape
        # the top k of E uniform draws are a uniformly random k-subset
        ids = torch.rand(L, tokens, E, generator=self.generator, device=self.device).topk(k, dim=-1).indices
        if self.in_graph:
            return ids
        if self.device.type == "cuda":
            self._ids = ids.to("cpu", non_blocking=True)  # pinned, not waited for here
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._ids = ids
        self._host = None
        return ids  # L x T x k, on the device

    def ids(self, layer: int) -> np.ndarray:
        if self.in_graph:
            raise RuntimeError("in-graph random routing keeps no host copy of its draws; an oracle cannot read it")
        if self._host is None:
            if self._copied is not None:
                self._copied.synchronize()
            self._host = self._ids.numpy()
        return self._host[layer]


def open_routing_trace(trace: str | Path, num_layers: int, num_experts: int, top_k: int):
    """The opened trace at ``trace``, refused unless it routes a model of this geometry (L, E, k)."""
    t = open_trace(trace)
    geometry = (t.meta.num_layers, t.meta.num_experts, t.meta.top_k)
    if geometry != (num_layers, num_experts, top_k):
        raise ValueError(f"trace {trace} has L, E, k = {geometry}; the model has {(num_layers, num_experts, top_k)}")
    return t


class ReplayRouting:
    """The token rows of a trace (optionally one phase), in file order and cycling, as successive tokens' routing."""

    def __init__(self, trace: str | Path, num_layers: int, num_experts: int, top_k: int, phase: str | None = None):
        t = open_routing_trace(trace, num_layers, num_experts, top_k)
        parts = list(t.iter_experts(phase))
        if not parts:
            raise ValueError(f"trace {trace} has no {phase or ''} rows to replay".replace("  ", " "))
        self.rows = torch.from_numpy(np.concatenate(parts)).long()  # N x L x k
        if (self.rows < 0).any():
            raise ValueError(f"trace {trace} has missing expert ids (-1); it cannot drive routing")
        self.cursor, self._ids = 0, None  # L x T x k of the pass, on the host

    def begin(self, tokens: int) -> torch.Tensor:
        take = (self.cursor + torch.arange(tokens)) % len(self.rows)
        self.cursor = (self.cursor + tokens) % len(self.rows)
        ids = self.rows[take].transpose(0, 1)  # L x T x k
        self._ids = ids.numpy()
        return ids

    def ids(self, layer: int) -> np.ndarray:
        return self._ids[layer]


def is_artifact(spec: str) -> bool:
    """Whether a predictor spec names a trained artifact (a path), not ``none`` or an oracle."""
    return spec != "none" and not spec.startswith("oracle")


def oracle_recall(spec: str) -> float:
    """The recall of an 'oracle' or 'oracle:RECALL' predictor spec; refuses anything else."""
    name, _, recall = spec.partition(":")
    try:
        value = float(recall or 1.0)
    except ValueError:
        value = -1.0
    if name != "oracle" or not 0.0 <= value <= 1.0:
        raise ValueError(f"predictor {spec!r}: write oracle or oracle:RECALL with a recall between 0 and 1")
    return value


class OraclePredictor:
    """Knows the routing source's choice for ``target`` and keeps each true expert with probability ``recall``,
    replacing the others by random experts the token does not route to. A ``HostPredictor``: the engine queues
    nothing on the device for it (a trained predictor's device cost is its own benchmark)."""

    on_host = True

    def __init__(self, routing: RoutingSource, num_layers: int, num_experts: int, recall: float = 1.0, seed: int = 0):
        if not 0.0 <= recall <= 1.0:
            raise ValueError(f"oracle recall must be in [0, 1], got {recall}")
        self.routing, self.L, self.E, self.recall = routing, num_layers, num_experts, recall
        self.rng = np.random.default_rng(seed)
        self._guesses: np.ndarray | None = None  # L x B x k of the current step, drawn at its first ``top``

    def begin_step(self) -> None:
        """A decode step starts: its routing is new."""
        self._guesses = None

    def top(self, target: int) -> np.ndarray:
        """B x k guessed experts of layer ``target``. numpy, not torch: small arrays, where each torch CPU op costs
        the host a dispatch; every layer's guesses of a step drawn at once (one draw, not one per layer)."""
        if self.recall == 1.0:
            return self.routing.ids(target)  # B x k
        if self._guesses is None:
            true = np.stack([self.routing.ids(l) for l in range(self.L)])  # L x B x k
            L, B, k = true.shape
            keep = self.rng.random((L, B, k)) < self.recall  # L x B x k
            others = self.rng.random((L, B, self.E))  # L x B x E
            np.put_along_axis(others, true, -1.0, axis=2)  # true experts last
            wrong = np.argpartition(-others, k - 1, axis=2)[..., :k]  # L x B x k experts the token does not route to
            self._guesses = np.where(keep, true, wrong)
        return self._guesses[target]
