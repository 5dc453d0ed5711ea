"""Training examples from traces: routing tables in memory, a split by request, (token, layer) pairs.

Shape legend: N tokens, L MoE layers, k top-k, M examples, B a batch of them.

An example is a (token, target layer t) pair, t in 1..L-1: the input is the token's expert ids at
the layers before t (features are built from them inside the predictor), the target the ids at t.
Examples are kept as index pairs into one N x L x k id table, never as wide feature rows.
The split is by request (a seeded hash of dataset and request id), so no prompt is on both sides.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from duoserve.trace.format import Trace, TraceMeta, row_filter


@dataclass
class RoutingTable:
    """The routing of a set of traces, in memory."""

    meta: TraceMeta
    ids: np.ndarray  # N x L x k int16
    nextgate: np.ndarray | None  # N x (L-1) x m int16, if recorded: the router's top-k first
    nextgate_scores: np.ndarray | None  # N x (L-1) x m float32 probabilities (version-2 traces)
    request: np.ndarray  # N: index into ``requests``
    requests: list[tuple[str, int]]  # (dataset, request_id)
    decode: np.ndarray  # N bool: decode-phase token
    position: np.ndarray  # N int32: position in the sequence

    def __len__(self) -> int:
        return len(self.ids)

    def select(self, tokens: np.ndarray) -> RoutingTable:
        """The table restricted to the given token rows (same request index)."""
        def rows(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[tokens]

        return RoutingTable(self.meta, self.ids[tokens], rows(self.nextgate), rows(self.nextgate_scores),
                            self.request[tokens], self.requests, self.decode[tokens], self.position[tokens])


def _same_geometry(a: TraceMeta, b: TraceMeta) -> bool:
    return (a.num_layers, a.num_experts, a.top_k) == (b.num_layers, b.num_experts, b.top_k)


def load_routing(traces: Sequence[Trace], phase: str | None = None,
                 datasets: Sequence[str] | None = None) -> RoutingTable:
    """Read ``traces`` (same geometry) into one table, optionally one phase and some datasets."""
    if not traces:
        raise ValueError("no trace given")
    meta = traces[0].meta
    for t in traces[1:]:
        if not _same_geometry(meta, t.meta):
            raise ValueError(f"{t.path} has geometry L={t.meta.num_layers}, E={t.meta.num_experts}, "
                             f"k={t.meta.top_k}, unlike {traces[0].path}")
    L = meta.num_layers
    with_ng = all(t.meta.lookahead >= 1 for t in traces)
    # one width for all: the narrowest folder's (a version-1 trace keeps k); scores only where every folder has them
    m = min(t.meta.nextgate_width for t in traces) if with_ng else 0
    with_scores = with_ng and all(t.meta.nextgate_scores for t in traces)
    cols = ["dataset", "request_id", "phase", "position", "experts", *(["nextgate"] if with_ng else []),
            *(["nextgate_scores"] if with_scores else [])]
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
        nextgate=fixed("nextgate", L - 1, m).astype(np.int16) if with_ng else None,
        nextgate_scores=fixed("nextgate_scores", L - 1, m).astype(np.float32) if with_scores else None,
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
    target: np.ndarray  # M: layer to predict, 1..L-1


def make_examples(tokens: np.ndarray, num_layers: int) -> Examples:
    """Every (token, target layer) pair for the given token rows."""
    targets = np.arange(1, num_layers)
    return Examples(np.repeat(tokens, len(targets)), np.tile(targets, len(tokens)))


class ExampleSet(Dataset):
    """(token, target layer) examples over one routing table; fetched a whole batch at a time."""

    def __init__(self, table: RoutingTable, examples: Examples):
        self.ids = torch.from_numpy(table.ids.astype(np.int64))  # N x L x k
        self.nextgate = None if table.nextgate is None else torch.from_numpy(table.nextgate.astype(np.int64))
        self.nextgate_scores = None if table.nextgate_scores is None else torch.from_numpy(table.nextgate_scores)
        self.token = torch.from_numpy(examples.token)
        self.target = torch.from_numpy(examples.target)

    def __len__(self) -> int:
        return len(self.token)

    def __getitems__(self, index: list[int]) -> dict[str, torch.Tensor]:
        token, target = self.token[index], self.target[index]  # B, B
        batch = {"history": self.ids[token], "target": target, "truth": self.ids[token, target]}  # B x L x k, B x k
        if self.nextgate is not None:  # the guess for layer t made at t-1
            batch["nextgate"] = self.nextgate[token, target - 1]  # B x m ids, the router's top-k first
        if self.nextgate_scores is not None:
            batch["nextgate_scores"] = self.nextgate_scores[token, target - 1]  # B x m probabilities
        return batch

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.__getitems__([i]).items()}


def previous_experts(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """B x k: the experts routed one layer before each example's target."""
    return batch["history"][torch.arange(len(batch["target"])), batch["target"] - 1]
