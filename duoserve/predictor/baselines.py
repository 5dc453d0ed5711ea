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


def nextgate_rank_scores(nextgate: torch.Tensor, num_experts: int) -> torch.Tensor:
    """B x E scores of the next-gate guess (B x m ids, best first): its order, so the top b are its first b."""
    m = nextgate.shape[1]
    rank = torch.arange(m, 0, -1, dtype=torch.float32, device=nextgate.device).expand(len(nextgate), m)  # m .. 1
    return torch.zeros(len(nextgate), num_experts, device=nextgate.device).scatter_(1, nextgate.long(), rank)
