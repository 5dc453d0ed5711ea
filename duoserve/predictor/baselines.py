"""Zero-training predictors from routing statistics, for comparison with the trained MLP.

Shape legend: B examples, L MoE layers, E experts, k top-k.
"""

from __future__ import annotations

import torch


def popularity_scores(popularity: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """B x E: layer ``target``'s static selection frequencies (L x E table)."""
    return popularity[target.long()]


def affinity_markov_scores(affinity: torch.Tensor, source: torch.Tensor, target: torch.Tensor,
                           depth: torch.Tensor | None = None, max_depth: int = 1) -> torch.Tensor:
    """B x E: the experts routed at layer s = t - d (B x k ids) carried to layer t through the affinity tables
    ((L-1) x E x E, P(j at l+1 | i at l)). At depth 1 the sum of their rows of P(j at t | i at t-1); each further
    layer multiplies by the next table and divides by k (a Markov chain; one scale at every depth). ``depth``
    defaults to 1; ``max_depth`` bounds it, so the loop has a fixed length (CUDA graphs, ONNX)."""
    E, k, target = affinity.shape[-1], source.shape[1], target.long()
    depth = torch.ones_like(target) if depth is None else depth.long()
    first = target - depth  # B: source layers
    scores = affinity.reshape(-1, E)[first[:, None] * E + source.long()].sum(1)  # B x E, at layer s + 1
    for step in range(1, max_depth):
        table = affinity[(first + step).clamp(max=len(affinity) - 1)]  # B x E x E: P(at s+step+1 | at s+step)
        carried = torch.bmm(scores[:, None], table)[:, 0] / k  # B x E
        scores = torch.where((depth > step)[:, None], carried, scores)
    return scores


def nextgate_rank_scores(nextgate: torch.Tensor, num_experts: int) -> torch.Tensor:
    """B x E scores of the next-gate guess (B x m ids, best first): its order, so the top b are its first b."""
    m = nextgate.shape[1]
    rank = torch.arange(m, 0, -1, dtype=torch.float32, device=nextgate.device).expand(len(nextgate), m)  # m .. 1
    return torch.zeros(len(nextgate), num_experts, device=nextgate.device).scatter_(1, nextgate.long(), rank)
