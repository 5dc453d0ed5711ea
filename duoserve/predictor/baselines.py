"""Zero-training predictors from routing statistics, for comparison with the trained MLP.

Shape legend: B examples, L MoE layers, E experts, k top-k.
"""

from __future__ import annotations

import torch


def popularity_scores(popularity: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """B x E: layer ``target``'s static selection frequencies (L x E table)."""
    return popularity[target.long()]


def affinity_markov_scores(affinity: torch.Tensor, previous: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """B x E: sum over the experts routed at layer t-1 (B x k) of P(j at t | i at t-1) ((L-1) x E x E table)."""
    E = affinity.shape[-1]
    rows = (target.long() - 1)[:, None] * E + previous.long()  # B x k
    return affinity.reshape(-1, E)[rows].sum(1)
