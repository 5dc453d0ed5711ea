"""Everything a user could use to guess layer t's experts, scored on the same (token, layer) examples.

Shape legend: M examples, B a chunk of them, N tokens, L MoE layers, E experts, k top-k, R stored requests.

Each scorer maps example indices to B x E scores; the top-b scores are its prediction at budget b.
Statistics come from the training requests only, the same ones the trained predictor saw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from duoserve.features.examples import (
    Examples,
    ExampleSet,
    RoutingTable,
    source_experts,
)
from duoserve.metrics import multi_hot
from duoserve.predictor.baselines import affinity_markov_scores, nextgate_rank_scores, popularity_scores
from duoserve.predictor.fast import TrainedPredictor
from duoserve.predictor.model import ExpertPredictor, FeatureSpec


@dataclass
class EvalSet:
    """Examples to score, with their inputs gathered once."""

    table: RoutingTable
    examples: Examples

    def __post_init__(self):
        self.data = ExampleSet(self.table, self.examples)
        self.E, self.k = self.table.meta.num_experts, self.table.meta.top_k

    def __len__(self) -> int:
        return len(self.data)

    def batch(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        return self.data.__getitems__(idx.tolist())


class Scorer:
    name: str = ""
    description: str = ""

    def scores(self, ev: EvalSet, idx: np.ndarray) -> torch.Tensor:
        raise NotImplementedError


class TrainedMLP(Scorer):
    name, description = "trained MLP", "the exported predictor artifact (BN folded, sparse first layer: as deployed)"

    def __init__(self, predictor: ExpertPredictor):
        self.predictor = TrainedPredictor(predictor.eval(), sparse=True)

    def scores(self, ev, idx):
        b = ev.batch(idx)
        return self.predictor.logits(b["history"], b["target"], b.get("nextgate"), b.get("nextgate_scores"), b["depth"])


class Popularity(Scorer):
    name, description = "popularity", "static per-layer top-k of the training traces"

    def __init__(self, popularity: torch.Tensor):
        self.popularity = popularity

    def scores(self, ev, idx):
        return popularity_scores(self.popularity, torch.from_numpy(ev.examples.target[idx]))


class AffinityMarkov(Scorer):
    name, description = "affinity-Markov", ("the source layer's routed experts times the affinity matrix (chained "
                                            "through the layers between, d > 1)")

    def __init__(self, affinity: torch.Tensor):
        self.affinity = affinity

    def scores(self, ev, idx):
        b = ev.batch(idx)
        return affinity_markov_scores(self.affinity, source_experts(b), b["target"], b["depth"],
                                      int(ev.examples.depth.max(initial=1)))


class NextGate(Scorer):
    name, description = "next-gate", "layer t's router on the hidden state entering layer t-d (from the trace)"

    def scores(self, ev, idx):
        return nextgate_rank_scores(ev.batch(idx)["nextgate"], ev.E)


class Oracle(Scorer):
    name, description = "oracle", "the routed experts themselves (upper bound)"

    def scores(self, ev, idx):
        return multi_hot(ev.batch(idx)["truth"], ev.E)


class PreviousToken(Scorer):
    name, description = "previous token", "the previous token's experts at the same layer (popularity for a first token)"

    def __init__(self, table: RoutingTable, popularity: torch.Tensor):
        order = np.lexsort((table.position, table.request))  # tokens by request, then position
        prev = np.full(len(table), -1)
        same = table.request[order[1:]] == table.request[order[:-1]]
        prev[order[1:][same]] = order[:-1][same]
        self.prev, self.popularity = prev, popularity

    def scores(self, ev, idx):
        token, target = ev.examples.token[idx], torch.from_numpy(ev.examples.target[idx])
        prev = self.prev[token]
        out = popularity_scores(self.popularity, target).clone()
        has = prev >= 0
        if has.any():
            ids = torch.from_numpy(ev.table.ids[prev[has], ev.examples.target[idx][has]].astype(np.int64))  # B' x k
            out[torch.from_numpy(has)] = multi_hot(ids, ev.E) + 1.0  # above any popularity score
        return out


def request_routing(table: RoutingTable, request: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """One request's tokens in position order (T rows of ``table``), each token's own routing as a T x L x E one-hot,
    and the routing counts of the request's earlier tokens at each layer (T x L x E)."""
    L, E = table.meta.num_layers, table.meta.num_experts
    tokens = np.flatnonzero(table.request == request)
    tokens = tokens[np.argsort(table.position[tokens])]
    onehot = torch.zeros(len(tokens), L, E)
    onehot.scatter_(2, torch.from_numpy(table.ids[tokens].astype(np.int64)), 1.0)  # T x L x E
    return tokens, onehot, torch.cumsum(onehot, 0) - onehot


class ActivationMatrix(Scorer):
    """MoE-Infinity's request-level expert activation matrix (EAM) matching.

    Each training request is stored as its L x E activation counts. For an example (token i, layer t),
    the request's partial EAM (its earlier tokens, plus token i's layers before t) is matched by
    cosine similarity against the stored ones, and the best match's row t is the prediction.
    """

    name, description = "activation-matrix", "MoE-Infinity: cosine-matched request expert activation matrix"

    def __init__(self, train: RoutingTable, ev: EvalSet):
        L, E = train.meta.num_layers, train.meta.num_experts
        bank = np.zeros((len(train.requests), L, E), dtype=np.float32)  # R x L x E
        np.add.at(bank, (train.request[:, None, None], np.arange(L)[None, :, None], train.ids.astype(np.int64)), 1.0)
        bank = bank[bank.reshape(len(bank), -1).any(1)]
        self.bank = torch.from_numpy(bank)
        self._scores = self._match(ev)

    def _match(self, ev: EvalSet) -> torch.Tensor:
        table, ex = ev.table, ev.examples
        L, E = table.meta.num_layers, table.meta.num_experts
        bank = self.bank.reshape(len(self.bank), -1)  # R x L*E
        bank_unit = bank / bank.norm(dim=1, keepdim=True)
        token_scores = {}
        for r in np.unique(table.request[ex.token]):
            tokens, onehot, before = request_routing(table, r)  # before: the request's earlier tokens, T x L x E
            # partial EAM for target t: earlier tokens + this token's layers < t
            layer_mask = (torch.arange(L)[None, :] < torch.arange(1, L)[:, None]).float()  # (L-1) x L
            partial = before[:, None] + onehot[:, None] * layer_mask[None, :, :, None]  # T x (L-1) x L x E
            sim = partial.reshape(len(tokens), L - 1, -1) @ bank_unit.T  # T x (L-1) x R (norm of query is irrelevant)
            best = sim.argmax(-1)  # T x (L-1)
            rows = self.bank[best, torch.arange(1, L)[None, :]]  # T x (L-1) x E: matched request's row t
            for i, token in enumerate(tokens):
                token_scores[token] = rows[i]
        out = torch.stack([token_scores[t][target - 1] for t, target in zip(ex.token, ex.target)]) \
            if len(ex.token) else torch.zeros(0, E)
        return out  # M x E

    def scores(self, ev, idx):
        return self._scores[torch.from_numpy(idx)]


class LogisticBaseline(Scorer):
    """One-vs-rest logistic regression (scikit-learn) on the MLP's own input features."""

    name, description = "logistic regression", "scikit-learn one-vs-rest logistic regression on the MLP's features"

    def __init__(self, spec: FeatureSpec, popularity: torch.Tensor, affinity: torch.Tensor, train: EvalSet,
                 max_examples: int = 20_000, seed: int = 0):
        from sklearn.linear_model import LogisticRegression
        from sklearn.multiclass import OneVsRestClassifier

        self.featurizer = ExpertPredictor(spec, widths=(), popularity=popularity, affinity=affinity).eval()
        rng = np.random.default_rng(seed)
        idx = np.sort(rng.choice(len(train), size=min(max_examples, len(train)), replace=False))
        x, b = self._features(train, idx)
        y = multi_hot(b["truth"], train.E).numpy()
        keep = y.any(0) & ~y.all(0)  # experts with both outcomes in the sample; others get a constant
        self.constant = torch.from_numpy(np.where(y.all(0), 1.0, -1.0).astype(np.float32))
        self.keep = torch.from_numpy(keep)
        self.model = OneVsRestClassifier(LogisticRegression(max_iter=300)).fit(x, y[:, keep])

    def _features(self, ev: EvalSet, idx: np.ndarray):
        b = ev.batch(idx)
        with torch.no_grad():
            return self.featurizer.features(b["history"], b["target"], b.get("nextgate"),
                                            b.get("nextgate_scores")).numpy(), b

    def scores(self, ev, idx):
        x, _ = self._features(ev, idx)
        out = self.constant.repeat(len(idx), 1)
        out[:, self.keep] = torch.from_numpy(self.model.decision_function(x).astype(np.float32)).reshape(len(idx), -1)
        return out
