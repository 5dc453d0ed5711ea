"""Training examples from traces: routing tables in memory, a split by request, (token, layer) pairs.

Shape legend: N tokens, L MoE layers, k top-k, m next-gate width, A look-ahead depths, M examples, B a batch.

An example is a (token, target layer t, depth d) triple, 1 <= d <= t <= L-1: the input is the token's
expert ids at the layers up to the source s = t - d (features are built from them inside the predictor)
and the next-gate guess for t made on layer s's input, the target the ids at t. The paper's examples
are depth 1. Examples are kept as index triples into one N x L x k id table, never as wide feature rows.
The split is by request (a seeded hash of dataset and request id), so no prompt is on both sides.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from duoserve.trace.format import Trace, TraceMeta, nextgate_column, nextgate_scores_column, row_filter


@dataclass
class RoutingTable:
    """The routing of a set of traces, in memory."""

    meta: TraceMeta
    ids: np.ndarray  # N x L x k int16
    nextgate: dict[int, np.ndarray]  # depth d -> N x (L-d) x m int16: layer l+d's guess on layer l's input, if recorded
    nextgate_scores: dict[int, np.ndarray]  # depth d -> N x (L-d) x m float16 probabilities (version-2 traces)
    request: np.ndarray  # N: index into ``requests``
    requests: list[tuple[str, int]]  # (dataset, request_id)
    decode: np.ndarray  # N bool: decode-phase token
    position: np.ndarray  # N int32: position in the sequence

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def nextgate_depth(self) -> int:
        """How many layers ahead the next-gate guesses reach (0: none recorded)."""
        return len(self.nextgate)

    def select(self, tokens: np.ndarray) -> RoutingTable:
        """The table restricted to the given token rows (same request index)."""
        def rows(by_depth: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
            return {d: a[tokens] for d, a in by_depth.items()}

        return RoutingTable(self.meta, self.ids[tokens], rows(self.nextgate), rows(self.nextgate_scores),
                            self.request[tokens], self.requests, self.decode[tokens], self.position[tokens])


def _same_geometry(a: TraceMeta, b: TraceMeta) -> bool:
    return (a.num_layers, a.num_experts, a.top_k) == (b.num_layers, b.num_experts, b.top_k)


def load_routing(traces: Sequence[Trace], phase: str | None = None, datasets: Sequence[str] | None = None,
                 lookahead: int = 1) -> RoutingTable:
    """Read ``traces`` (same geometry) into one table, optionally one phase and some datasets, with their
    next-gate guesses up to ``lookahead`` layers ahead (as deep as every trace recorded)."""
    if not traces:
        raise ValueError("no trace given")
    meta = traces[0].meta
    for t in traces[1:]:
        if not _same_geometry(meta, t.meta):
            raise ValueError(f"{t.path} has geometry L={t.meta.num_layers}, E={t.meta.num_experts}, "
                             f"k={t.meta.top_k}, unlike {traces[0].path}")
    L = meta.num_layers
    depths = range(1, min(lookahead, *(t.meta.lookahead for t in traces)) + 1)
    # one width for all: the narrowest folder's (a version-1 trace keeps k); scores only where every folder has them
    m = min(t.meta.nextgate_width for t in traces) if depths else 0
    with_scores = bool(depths) and all(t.meta.nextgate_scores for t in traces)
    cols = ["dataset", "request_id", "phase", "position", "experts", *(nextgate_column(d) for d in depths),
            *(nextgate_scores_column(d) for d in depths if with_scores)]
    tables = [t.dataset.to_table(columns=cols, filter=row_filter(phase, list(datasets) if datasets else None))
              for t in traces]
    n = sum(t.num_rows for t in tables)
    if n == 0:
        raise ValueError(f"no trace rows match phase={phase or 'any'}, datasets={list(datasets or []) or 'any'}")

    def fixed(name: str, layers: int, keep: int | None = None) -> np.ndarray:
        """N x layers x ``keep`` (default: all) of a fixed-size list column; each folder's own width per layer."""
        return np.concatenate([t.column(name).combine_chunks().flatten().to_numpy().reshape(t.num_rows, layers, -1)
                               [..., :keep] for t in tables])

    keys = list(zip(np.concatenate([t.column("dataset").to_numpy(zero_copy_only=False) for t in tables]),
                    np.concatenate([t.column("request_id").to_numpy() for t in tables]).tolist()))
    requests = sorted(set(keys))
    index = {key: i for i, key in enumerate(requests)}
    return RoutingTable(
        meta=meta,
        ids=fixed("experts", L).astype(np.int16),
        nextgate={d: fixed(nextgate_column(d), L - d, m).astype(np.int16) for d in depths},
        nextgate_scores={d: fixed(nextgate_scores_column(d), L - d, m).astype(np.float16)
                         for d in depths if with_scores},
        request=np.array([index[key] for key in keys], dtype=np.int64),
        requests=[(str(d), int(r)) for d, r in requests],
        decode=np.concatenate([t.column("phase").to_numpy(zero_copy_only=False) for t in tables]) == "decode",
        position=np.concatenate([t.column("position").to_numpy() for t in tables]),
    )


def split_requests(requests: Sequence[tuple[str, int]], val_fraction: float, seed: int) -> np.ndarray:
    """Bool per request, True for validation: a seeded hash, stable under adding or removing requests."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"validation fraction must be in (0, 1), got {val_fraction}")
    u = np.array([int.from_bytes(hashlib.sha1(f"{seed}:{d}:{r}".encode()).digest()[:8], "big") / 2**64
                  for d, r in requests])
    val = u < val_fraction
    if val.all() or not val.any():
        raise ValueError(f"{len(requests)} request(s) cannot be split {1 - val_fraction:.0%}/{val_fraction:.0%} into "
                         "non-empty train and validation sets; trace more requests")
    return val


@dataclass
class Examples:
    token: np.ndarray  # M: row in the routing table
    target: np.ndarray  # M: layer to predict, depth..L-1
    depth: np.ndarray | None = None  # M: look-ahead depth d (the source layer is target - d); None: all 1

    def __post_init__(self):
        if self.depth is None:
            self.depth = np.ones_like(self.target)


def make_examples(tokens: np.ndarray, num_layers: int, depths: Sequence[int] = (1,)) -> Examples:
    """Every (token, target layer, depth) triple for the given token rows and depths (targets d..L-1 at depth d)."""
    pairs = np.array([(t, d) for d in depths for t in range(d, num_layers)], dtype=np.int64).reshape(-1, 2)
    return Examples(np.repeat(tokens, len(pairs)), np.tile(pairs[:, 0], len(tokens)), np.tile(pairs[:, 1], len(tokens)))


def _by_target(by_depth: dict[int, np.ndarray], depths: int, num_layers: int) -> torch.Tensor | None:
    """N x A x L x m: depth d's guesses indexed by their target layer (d..L-1; zero below), or None unless
    every depth 1..A was recorded."""
    if not all(d in by_depth for d in range(1, depths + 1)):
        return None
    first = by_depth[1]
    out = np.zeros((len(first), depths, num_layers, first.shape[2]), dtype=first.dtype)
    for d in range(1, depths + 1):
        out[:, d - 1, d:] = by_depth[d]
    return torch.from_numpy(out)


class ExampleSet(Dataset):
    """(token, target layer, depth) examples over one routing table; fetched a whole batch at a time."""

    def __init__(self, table: RoutingTable, examples: Examples):
        L, depths = table.meta.num_layers, int(examples.depth.max(initial=1))
        self.ids = torch.from_numpy(table.ids.astype(np.int64))  # N x L x k
        self.nextgate = _by_target(table.nextgate, depths, L)  # N x A x L x m int16
        self.nextgate_scores = _by_target(table.nextgate_scores, depths, L)  # N x A x L x m float16
        self.token = torch.from_numpy(examples.token)
        self.target = torch.from_numpy(examples.target)
        self.depth = torch.from_numpy(examples.depth)

    def __len__(self) -> int:
        return len(self.token)

    def __getitems__(self, index: list[int]) -> dict[str, torch.Tensor]:
        token, target, depth = self.token[index], self.target[index], self.depth[index]  # B, B, B
        batch = {"history": self.ids[token], "target": target, "depth": depth,
                 "truth": self.ids[token, target]}  # B x L x k, B, B, B x k
        if self.nextgate is not None:  # the guess for layer t made on layer t-d's input
            batch["nextgate"] = self.nextgate[token, depth - 1, target].long()  # B x m ids, the router's top-k first
        if self.nextgate_scores is not None:
            batch["nextgate_scores"] = self.nextgate_scores[token, depth - 1, target].float()  # B x m probabilities
        return batch

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.__getitems__([i]).items()}


def source_experts(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """B x k: the experts routed at each example's source layer (its target less its depth)."""
    return batch["history"][torch.arange(len(batch["target"])), batch["target"] - batch["depth"]]
