"""Prediction metrics shared by training (validation) and evaluation.

Shape legend: N predictions, E experts, k top-k (routed width), b budget (experts fetched).

- exact-top-k: the predicted k-set equals the routed k-set.
- at-least-half: the two sets share at least ceil(k/2) experts.
- recall: |predicted ∩ routed| / k; with a budget b > k, how much fetching b experts covers.
"""

from __future__ import annotations

import math

import torch


def overlap(pred: torch.Tensor, true: torch.Tensor, num_experts: int) -> torch.Tensor:
    """N: how many of each row's routed ids (N x k) are among its predicted ids (N x b)."""
    hit = torch.zeros(pred.shape[0], num_experts, dtype=torch.bool, device=pred.device)
    hit.scatter_(1, pred.long(), True)  # N x E: predicted
    return hit.gather(1, true.long()).sum(1)  # N


def hit_metrics(hits: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """exact-top-k, at-least-half and recall (0-dim tensors) from N overlap counts with k routed experts."""
    hits = hits.float()
    return {
        "exact_topk": (hits == k).float().mean(),
        "at_least_half": (hits >= math.ceil(k / 2)).float().mean(),
        "recall": (hits / k).mean(),
    }


def topk_metrics(scores: torch.Tensor, true: torch.Tensor, num_experts: int) -> dict[str, float]:
    """Metrics of N x E scores (their top-k is the prediction) against N x k routed ids."""
    k = true.shape[1]
    hits = overlap(scores.topk(k, dim=1).indices, true, num_experts)
    return {name: value.item() for name, value in hit_metrics(hits, k).items()}


def multi_hot(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """N x E float 0/1 from N x k ids."""
    return torch.zeros(ids.shape[0], num_experts, device=ids.device).scatter_(1, ids.long(), 1.0)
