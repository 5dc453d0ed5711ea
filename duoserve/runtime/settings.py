"""The engine's knobs, declared once: the engine, the bench harness and the CLI all read this object."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'8GiB', '512MiB', '1.5GB' or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 8GiB, 512MiB or 2GB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


_SHARE = re.compile(r"([0-9]*\.?[0-9]+)%")  # a share of the model's L x E routed experts
_TOPK = re.compile(r"([0-9]*)k")  # a multiple of top-k


def _experts_budget(spec: str, required: bool = False) -> tuple[float, int] | None:
    """A budget written as a number of experts, as (percent of the L x E experts, multiple of top-k), one of them 0;
    None where ``spec`` is not written so (``required``: refused). Refuses a share outside (0, 100]% and a multiple
    below one."""
    if share := _SHARE.fullmatch(spec):
        if not 0 < float(share.group(1)) <= 100:
            raise ValueError(f"a GPU expert budget of {spec} of the experts: give a share in (0, 100]%")
        return float(share.group(1)), 0
    if times := _TOPK.fullmatch(spec):
        if int(times.group(1) or 1) < 1:
            raise ValueError(f"a GPU expert budget of {spec}: give at least one top-k (k, 2k, ...)")
        return 0.0, int(times.group(1) or 1)
    if required:
        raise ValueError(f"cannot read {spec!r} as a number of experts; write a share (10%) or a multiple of top-k "
                         "(2k)")
    return None


def parse_budget(text: str) -> int | str:
    """A GPU expert budget: bytes ('8GiB', as ``parse_bytes``), or a number of experts, kept as written to be
    resolved against the model (``budget_slots``): a share of its L x E routed experts ('10%') or a multiple of
    its top-k ('2k', 'k')."""
    spec = text.strip()
    if _experts_budget(spec) is not None:
        return spec
    try:
        return parse_bytes(spec)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a GPU expert budget; write a size (8GiB, 512MiB, 2GB), a share "
                         "of the model's experts (10%) or a multiple of its top-k (2k)") from None


def budget_slots(spec: str, L: int, E: int, k: int) -> int:
    """Cache slots of a budget written as a share of the L x E experts ('10%', rounded down) or a multiple of top-k
    ('2k'; 'k' is one)."""
    percent, times = _experts_budget(spec, required=True)
    return math.floor(L * E * percent / 100) if percent else times * k


@dataclass(frozen=True)
class EngineSettings:
    """How ``OffloadEngine`` schedules expert copies.

    ``gpu_expert_budget``: device memory for cached experts (at least top-k of them), in bytes, or as a number of
    experts written as ``parse_budget`` reads it ('10%' of the model's L x E, '2k'); replaces the default of
    (1 + lookahead) x k slots of the caching policies (duoserve, lru; up to twice that over quantized experts, as
    many as store 128 MiB of them: ``scheduler.default_capacity``); the others hold what their schedule needs.
    ``lookahead``: decode prefetch depth d: layer l's predictions are for layer l+d (the first layer of a step
    predicts 1..d), so a copy has d layers of compute to hide behind. A trained predictor needs heads that deep
    (``duoserve-train fit --lookahead D`` with D >= d); oracles take any d.
    ``eager``: never replay decode calls from CUDA graphs (``experts.py`` says where they are used), nor the decode
    step's layers, and capture a trained predictor's graphs from its plain call, not from ``torch.compile``'s (which
    takes seconds to compile at each batch size's first decode step, and replays 0.08 ms a call against 0.10 on
    the H200 at Qwen3-30B-A3B's shape: docs/benchmarks.md).
    ``step_graphs``: on a GPU, replay a decode step's work outside the experts (attention, norms, routers) from
    CUDA graphs, a piece per stretch between experts calls, on a static KV cache (``stepgraph.py``).
    ``prefetch_min_score``: copy ahead only predicted experts scored at least this (a trained predictor's scores
    are probabilities); 0 copies every expert of each token's predicted top k. A wrong guess costs a whole copy.
    ``pin``: (layer, expert) keys to keep resident for the whole run, best first (``cache.popular_keys``): as many
    as the budget holds beyond the (1 + lookahead) x k slots the cache needs for its own work; needs a budget.
    ``defer_prefetch``: where a decode step's layers replay from step graphs, queue each decode prefetch at the next
    layer call's start, before it waits for its routing, not within the call: the host then queues the copies while
    the device runs this call's compute and the next layer's attention (``scheduler.py``, step 4). Measured on an
    H100 at Qwen3-30B-A3B's 48 layers, B=1: 4-10% off a quantized decode step (docs/runtime.md).
    """

    gpu_expert_budget: int | str | None = None  # bytes, or a number of experts ('10%', '2k')
    lookahead: int = 1
    eager: bool = False
    step_graphs: bool = True
    prefetch_min_score: float = 0.0
    pin: tuple[tuple[int, int], ...] = ()
    defer_prefetch: bool = True

    def __post_init__(self):
        if isinstance(self.gpu_expert_budget, str):
            _experts_budget(self.gpu_expert_budget, required=True)  # refuses what parse_budget would
        elif self.gpu_expert_budget is not None and self.gpu_expert_budget <= 0:
            raise ValueError(f"the GPU expert budget must be positive, got {self.gpu_expert_budget} bytes")
        if self.lookahead < 1:
            raise ValueError(f"look-ahead must be at least 1 layer, got {self.lookahead}")
        if self.pin and self.gpu_expert_budget is None:
            raise ValueError("pinning experts needs a GPU expert budget (--gpu-expert-budget) to pin them in")
        if not 0.0 <= self.prefetch_min_score <= 1.0:
            raise ValueError(f"the prefetch minimum score must be in [0, 1], got {self.prefetch_min_score}")
