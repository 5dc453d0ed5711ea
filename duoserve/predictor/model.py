"""The expert predictor: features built from a token's routing history, then an MLP, one head per look-ahead depth.

Shape legend: B examples, L MoE layers, E experts, k top-k, W history window (layers), D input width,
m next-gate width (ids and scores of the next-gate guess, the router's top-k first), A look-ahead depths.

An example is (token, target layer t, depth d): predict layer t's experts from what is known when layer
s = t - d runs: the routing of layers <= s and the next-gate guess for t made on layer s's input. The
paper's predictor is depth 1 only (A = 1); with ``lookahead`` A > 1 the MLP is shared and its last layer
holds one E-wide head per depth.

Families (``FeatureSpec.family``):
  paper     the DuoServe-MoE MLP: history + statistics (+ the next-gate's top-k as a multi-hot, if asked)
  hybrid    the paper's features plus the next-gate's scores for the target layer, as an E vector
  residual  the next-gate's log-probabilities plus a learned correction (an MLP over the hybrid's
            features whose last layer starts at zero): it starts as next-gate and learns where the
            router's guess is wrong

Features for target layer t at depth d (source layer s = t - d), concatenated:
  history    W x E  multi-hot of the experts selected at layers s-W+1 .. s (zero before layer 0)
  popularity E      layer t's selection frequencies (from the training traces)
  affinity   E      the affinity-Markov chain from layer s's selected experts to layer t (baselines.py)
  layer      L      one-hot of t
  depth      A      one-hot of d (only when A > 1)
  nextgate   E      optional: multi-hot of the next-gate guess for t (layer t's router on layer s's input)
  ng scores  E      hybrid and residual: the next-gate's probabilities at its m ids, zero elsewhere
The features are computed inside the module from expert ids, so training, evaluation and the
runtime share one definition, and the exported artifact carries the statistics it needs.
Needs torch only (no Lightning).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from duoserve.predictor.baselines import affinity_markov_scores, popularity_scores

PAPER_WIDTHS = (2048, 1024, 512, 256, 128, 64)
FAMILIES = ("paper", "hybrid", "residual")
LOG_FLOOR = 1e-6  # the residual's next-gate log-probability for experts outside the m it kept
TIE_BREAK = 1e-4  # per position: equal (float16) scores keep the next-gate's own order


@dataclass(frozen=True)
class FeatureSpec:
    num_layers: int
    num_experts: int
    top_k: int
    window: int  # previous layers in the history
    popularity: bool = True
    affinity: bool = True
    nextgate: bool = False
    family: str = "paper"
    nextgate_width: int = 0  # m next-gate ids (and scores) an example carries; 0: k
    lookahead: int = 1  # A: heads for depths 1..A

    def __post_init__(self):
        if not 1 <= self.lookahead <= self.num_layers - 1:
            raise ValueError(f"look-ahead depth must be in 1..{self.num_layers - 1} layers, got {self.lookahead}")
        if not 1 <= self.window <= self.num_layers - 1:
            raise ValueError(f"history window must be in 1..{self.num_layers - 1} layers, got {self.window}")
        if self.family not in FAMILIES:
            raise ValueError(f"unknown predictor family {self.family!r}; choose from {', '.join(FAMILIES)}")

    @property
    def uses_scores(self) -> bool:
        """Whether it takes the next-gate's scores (hybrid, residual), not only its ids."""
        return self.family != "paper"

    @property
    def uses_nextgate(self) -> bool:
        """Whether it takes a next-gate guess at all."""
        return self.nextgate or self.uses_scores

    @property
    def width(self) -> int:
        """m: next-gate ids per example."""
        return self.nextgate_width or self.top_k

    @property
    def input_dim(self) -> int:
        E = self.num_experts
        return (self.window * E + E * (self.popularity + self.affinity + self.nextgate + self.uses_scores)
                + self.num_layers + (self.lookahead if self.lookahead > 1 else 0))

    def to_dict(self) -> dict:
        return asdict(self)


class ExpertPredictor(nn.Module):
    """Scores the experts of a target layer from the token's expert ids at earlier layers."""

    def __init__(self, spec: FeatureSpec, widths: tuple[int, ...] = PAPER_WIDTHS, dropout: float = 0.1,
                 popularity: torch.Tensor | None = None, affinity: torch.Tensor | None = None):
        super().__init__()
        L, E = spec.num_layers, spec.num_experts
        self.spec, self.widths, self.dropout = spec, tuple(widths), dropout
        self.register_buffer("popularity", torch.zeros(L, E) if popularity is None else popularity.float())
        self.register_buffer("affinity", torch.zeros(L - 1, E, E) if affinity is None else affinity.float())
        blocks, width = [], spec.input_dim
        for w in widths:
            blocks += [nn.Linear(width, w), nn.BatchNorm1d(w), nn.ReLU(), nn.Dropout(dropout)]
            width = w
        self.mlp = nn.Sequential(*blocks, nn.Linear(width, E * spec.lookahead))  # one head per depth
        if spec.family == "residual":  # a zero correction: the untrained model is next-gate
            nn.init.zeros_(self.mlp[-1].weight)
            nn.init.zeros_(self.mlp[-1].bias)

    def window(self, history: torch.Tensor, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The expert ids at the W layers up to each source layer s = t - d (B x W x k) and which of those layers
        exist (B x W)."""
        W = self.spec.window
        layers = source.long()[:, None] - W + 1 + torch.arange(W, device=source.device)  # B x W: layers in the window
        ids = history.long().gather(1, layers.clamp(min=0)[..., None].expand(-1, -1, history.shape[2]))
        return ids, layers >= 0

    def dense_features(self, window_ids: torch.Tensor, target: torch.Tensor, depth: torch.Tensor,
                       nextgate: torch.Tensor | None = None,
                       nextgate_scores: torch.Tensor | None = None) -> torch.Tensor:
        """B x (D - W*E): every feature after the history (popularity, affinity, layer, depth, next-gate)."""
        s = self.spec
        B, E, target = len(target), s.num_experts, target.long()
        parts = []
        if s.popularity:
            parts.append(popularity_scores(self.popularity, target))  # B x E
        if s.affinity:  # B x E, from the source layer's experts
            parts.append(affinity_markov_scores(self.affinity, window_ids[:, -1], target, depth, s.lookahead))
        parts.append(torch.zeros(B, s.num_layers, device=target.device).scatter_(1, target[:, None], 1.0))  # B x L
        if s.lookahead > 1:
            parts.append(torch.zeros(B, s.lookahead, device=target.device).scatter_(1, depth[:, None] - 1, 1.0))
        if s.uses_nextgate and nextgate is None:
            raise ValueError("this predictor was trained with next-gate features: pass nextgate ids")
        if s.nextgate:
            parts.append(torch.zeros(B, E, device=target.device).scatter_(1, nextgate[:, :s.top_k].long(), 1.0))
        if s.uses_scores:
            parts.append(self._scattered(nextgate, nextgate_scores))  # B x E
        return torch.cat(parts, dim=1)

    def _scattered(self, nextgate: torch.Tensor, nextgate_scores: torch.Tensor | None) -> torch.Tensor:
        """B x E: the next-gate's scores at its ids, zero elsewhere."""
        if nextgate_scores is None:
            raise ValueError(f"a {self.spec.family} predictor needs the next-gate's scores (traces of format "
                             "version 2 recorded with --lookahead >= 1)")
        return self._at_ids(nextgate, nextgate_scores.float(), 0.0)

    def _at_ids(self, nextgate: torch.Tensor, values: torch.Tensor, fill: float) -> torch.Tensor:
        """B x E: ``values`` (B x m) at the next-gate's ids, ``fill`` elsewhere."""
        out = torch.full((len(nextgate), self.spec.num_experts), fill, device=nextgate.device)
        return out.scatter_(1, nextgate.long(), values)

    def nextgate_logits(self, nextgate: torch.Tensor, nextgate_scores: torch.Tensor) -> torch.Tensor:
        """B x E: the residual family's starting point, the next-gate's log-probabilities (a floor where it kept
        no score), less a hair per position so equal scores keep the next-gate's order."""
        position = torch.arange(nextgate.shape[1], device=nextgate.device) * TIE_BREAK  # m
        ranked = nextgate_scores.float().clamp_min(LOG_FLOOR).log() - position  # B x m
        return self._at_ids(nextgate, ranked, math.log(LOG_FLOOR) - 1.0)

    def head(self, out: torch.Tensor, depth: torch.Tensor, nextgate: torch.Tensor | None,
             nextgate_scores: torch.Tensor | None) -> torch.Tensor:
        """B x E logits from the MLP's output (B x A*E): its depth-d head, itself or for the residual family a
        correction of next-gate."""
        if self.spec.lookahead > 1:
            heads = out.view(len(out), self.spec.lookahead, -1)  # B x A x E
            out = heads.gather(1, (depth.long() - 1)[:, None, None].expand(-1, 1, heads.shape[2]))[:, 0]  # B x E
        if self.spec.family != "residual":
            return out
        return self.nextgate_logits(nextgate, nextgate_scores) + out

    @staticmethod
    def depths(target: torch.Tensor, depth: torch.Tensor | None) -> torch.Tensor:
        """B look-ahead depths: ``depth``, or 1 for every example when it is not given."""
        return torch.ones_like(target, dtype=torch.long) if depth is None else depth.long()

    def features(self, history: torch.Tensor, target: torch.Tensor, nextgate: torch.Tensor | None = None,
                 nextgate_scores: torch.Tensor | None = None, depth: torch.Tensor | None = None) -> torch.Tensor:
        """B x D features. ``history`` B x L' x k ids (layers after the source t - d are ignored), ``target`` B
        layer ids in d..L-1, ``nextgate`` B x m ids guessed for the target layer on the source layer's input (the
        router's top-k first) and ``nextgate_scores`` their probabilities (B x m), when the spec uses them;
        ``depth`` B look-ahead depths in 1..A (default 1)."""
        depth = self.depths(target, depth)
        ids, valid = self.window(history, target.long() - depth)  # B x W x k, B x W
        B, W, E = len(target), self.spec.window, self.spec.num_experts
        multi_hot = torch.zeros(B, W, E, device=history.device).scatter_(2, ids, 1.0).mul_(valid[..., None].float())
        dense = self.dense_features(ids, target, depth, nextgate, nextgate_scores)
        return torch.cat([multi_hot.flatten(1), dense], dim=1)  # B x D

    def forward(self, history: torch.Tensor, target: torch.Tensor, nextgate: torch.Tensor | None = None,
                nextgate_scores: torch.Tensor | None = None, depth: torch.Tensor | None = None) -> torch.Tensor:
        """B x E logits for the experts of layer ``target``, predicted ``depth`` layers ahead."""
        depth = self.depths(target, depth)
        x = self.features(history, target, nextgate, nextgate_scores, depth)
        return self.head(self.mlp(x.to(self.mlp[0].weight.dtype)), depth, nextgate, nextgate_scores)

    @torch.no_grad()
    def predict(self, history: torch.Tensor, target: torch.Tensor, nextgate: torch.Tensor | None = None,
                nextgate_scores: torch.Tensor | None = None, budget: int | None = None,
                depth: torch.Tensor | None = None) -> torch.Tensor:
        """B x budget expert ids (default budget: top-k), best first."""
        logits = self.forward(history, target, nextgate, nextgate_scores, depth)
        return logits.topk(budget or self.spec.top_k, dim=1).indices

    def check_geometry(self, num_layers: int, num_experts: int, top_k: int, what: str = "model") -> None:
        """Refuse a model or trace whose geometry differs from the one this predictor was trained on."""
        s = self.spec
        if (num_layers, num_experts, top_k) != (s.num_layers, s.num_experts, s.top_k):
            raise ValueError(f"predictor geometry L={s.num_layers}, E={s.num_experts}, k={s.top_k} does not match "
                             f"the {what}'s L={num_layers}, E={num_experts}, k={top_k}")
