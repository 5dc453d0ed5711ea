"""Is a model's routing worth predicting? Load balance, task dependence and next-layer predictability.

Shape legend: N tokens, L MoE layers, E experts, k top-k.
"""

from __future__ import annotations

from math import ceil, comb

import numpy as np
import torch

from duoserve.features.examples import load_routing
from duoserve.features.stats import stats_from_ids
from duoserve.metrics import topk_metrics
from duoserve.predictor.baselines import affinity_markov_scores
from duoserve.trace.format import Trace
from duoserve.trace.info import expert_usage, layer_stats


def random_at_least_half(E: int, k: int) -> float:
    """Chance that a random k-set shares at least ceil(k/2) experts with the routed k-set."""
    return sum(comb(k, i) * comb(E - k, k - i) for i in range(ceil(k / 2), k + 1)) / comb(E, k)


def routing_health(trace: Trace) -> dict:
    """Per-layer load, the datasets' per-layer total-variation distance, and how well affinity
    statistics from even-numbered requests predict odd-numbered requests' decode routing."""
    L, E, k = trace.meta.num_layers, trace.meta.num_experts, trace.meta.top_k
    layers = layer_stats(expert_usage(trace))
    out = {"min_experts_used": min(s["experts_used"] for s in layers),
           "max_over_uniform": max(s["max_over_uniform"] for s in layers), "num_experts": E}
    names = [d["name"] for d in trace.meta.datasets]
    if len(names) >= 2:
        a, b = (expert_usage(trace, dataset=n).astype(float) for n in names[:2])
        tv = 0.5 * np.abs(a / a.sum(1, keepdims=True) - b / b.sum(1, keepdims=True)).sum(1)  # L
        out["task_tv_per_layer"] = tv.round(4).tolist()
    table = load_routing([trace])
    train = np.array([r % 2 == 0 for _, r in table.requests])[table.request]
    test = ~train & table.decode
    affinity = torch.from_numpy(stats_from_ids(table.ids[train], E).affinity)
    ids = torch.from_numpy(table.ids[test].astype(np.int64))  # N x L x k
    target = torch.arange(1, L).repeat(len(ids))  # every layer after the first
    scores = affinity_markov_scores(affinity, ids[:, :-1].reshape(-1, k), target)
    out["affinity"] = topk_metrics(scores, ids[:, 1:].reshape(-1, k), E) if len(ids) else None
    out["affinity_decode_tokens"] = len(ids)
    out["random_at_least_half"] = random_at_least_half(E, k)
    return out
