"""The bench's bounds and the runtime's acceptance targets, computed from a bench's runs.

Bounds, per run: prefill >= max(prefill bytes / pinned bandwidth, all-resident TTFT); a decode
step >= max(its bytes / pinned bandwidth, all-resident time per token), where the all-resident figures are the
fastest of the resident runs (``all-resident``: transformers' eager decode; ``all-resident-compiled``: its static
cache and compiled decode step) and each run records which one bounded it. Runs of experts stored quantized
(``expert_dtype``) are compared with runs of the same dtype, and with the policies that have no dtype choice
(all-resident, accelerate); their own targets are ratios against the model's dtype (``QUANT_TARGETS``).
"""

from __future__ import annotations

import statistics

GB = 1e9
BOUND_LIMIT = 1.15  # the runtime's target: prefill and decode within this factor of their bounds
# quantized experts against the model's dtype, duoserve at B=1: (decode bytes per token, time per token) at most
QUANT_TARGETS = {"fp8": (0.55, 0.65), "int4": (0.3, 0.45)}


def _same_point(a: dict, b: dict) -> bool:
    """Runs of the same batch size, prompt length and round."""
    return (a["batch_size"], a.get("prompt_len"), a["round"]) == (b["batch_size"], b.get("prompt_len"), b["round"])


def _peers(a: dict, b: dict) -> bool:
    """Runs that are compared: the same point, and the same expert dtype unless one has no choice of it."""
    dtypes = a.get("expert_dtype", "model") == b.get("expert_dtype", "model") or a.get("dtype_fixed", True) \
        or b.get("dtype_fixed", True)
    return _same_point(a, b) and dtypes


def add_bounds(runs: list[dict], pinned_gbps: float | None, pageable_gbps: float | None) -> None:
    """Add each run's prefill and decode bounds (see the module docstring) and its ratio to them."""
    for run in runs:
        resident = [r for r in runs if r["resident"] and _peers(r, run)]
        first = min(resident, key=lambda r: r["ttft_s"], default=None)
        step = min((r for r in resident if r["tpot_ms"]), key=lambda r: r["tpot_ms"], default=None)
        bandwidth = (pinned_gbps or pageable_gbps) * GB
        moved = run.get("bytes_h2d", {"prefill": 0, "decode": 0})
        steps = max(run["new_tokens"] - 1, 1)
        prefill = max(moved["prefill"] / bandwidth, first["ttft_s"] if first else 0.0)
        decode = max(moved["decode"] / steps / bandwidth * 1e3, step["tpot_ms"] if step else 0.0)
        run.update(prefill_bound_s=prefill, decode_bound_ms=decode, ttft_vs_bound=run["ttft_s"] / prefill,
                   tpot_vs_bound=run["tpot_ms"] / decode if run["tpot_ms"] else None,
                   decode_bound_by=step["policy"] if step and decode == step["tpot_ms"] else "bytes")


def check_targets(runs: list[dict]) -> list[dict]:
    """The runtime issue's targets, per batch size and DuoServe run, where the runs they compare exist; with several
    rounds, also each target's median over the rounds (``"round": "median"``), as host-bound ratios drift."""
    checks = []
    for run in (r for r in runs if r["policy"] == "duoserve"):
        same = {r["policy"]: r for r in runs if _peers(r, run) and r["policy"] != "duoserve"}
        tag = {"batch_size": run["batch_size"], "prompt_len": run.get("prompt_len"), "predictor": run["predictor"],
               "round": run["round"], "expert_dtype": run.get("expert_dtype", "model")}
        if "on-demand" in same and run["peak_gpu_bytes"] is not None:
            extra = (run["peak_gpu_bytes"] - same["on-demand"]["peak_gpu_bytes"]) / GB
            checks.append(_check(tag, "peak GPU memory <= on-demand + 0.3 GB", extra, at_most=0.3))
        for peer in ("accelerate-pinned", "accelerate"):  # Accelerate's own offload, pinned and pageable
            if peer in same:
                checks.append(_check(tag, f"TTFT >= 1.8x better than {peer}",
                                     same[peer]["ttft_s"] / run["ttft_s"], at_least=1.8))
                checks.append(_check(tag, f"TPOT >= 1.4x better than {peer}",
                                     same[peer]["tpot_ms"] / run["tpot_ms"], at_least=1.4))
        for phase, key in (("prefill", "ttft_vs_bound"), ("decode", "tpot_vs_bound")):
            checks.append(_check(tag, f"{phase} within {BOUND_LIMIT}x of its bound", run[key], at_most=BOUND_LIMIT))
        fmt = run.get("expert_dtype", "model")
        base = next((r for r in runs if r["policy"] == "duoserve" and r.get("expert_dtype", "model") == "model"
                     and r["predictor"] == run["predictor"] and _same_point(r, run)), None)
        if fmt in QUANT_TARGETS and base is not None and run["batch_size"] == 1 and base["bytes_h2d"]["decode"]:
            bytes_limit, tpot_limit = QUANT_TARGETS[fmt]
            checks.append(_check(tag, f"{fmt} decode bytes per token <= {bytes_limit}x of the model dtype's",
                                 run["bytes_h2d"]["decode"] / base["bytes_h2d"]["decode"], at_most=bytes_limit))
            checks.append(_check(tag, f"{fmt} TPOT <= {tpot_limit}x of the model dtype's",
                                 run["tpot_ms"] / base["tpot_ms"], at_most=tpot_limit))
    rounds: dict[tuple, list[dict]] = {}
    for c in checks:
        rounds.setdefault((c["batch_size"], c["prompt_len"], c["predictor"], c["expert_dtype"], c["target"]),
                          []).append(c)
    for (batch, prompt_len, predictor, fmt, target), group in rounds.items():
        if len(group) > 1:
            limits = {k: group[0][k] for k in ("at_most", "at_least") if k in group[0]}
            checks.append(_check({"batch_size": batch, "prompt_len": prompt_len, "predictor": predictor,
                                  "round": "median", "expert_dtype": fmt}, target,
                                 statistics.median(c["value"] for c in group), **limits))
    return checks


def _check(tag: dict, target: str, value: float, at_most: float | None = None, at_least: float | None = None) -> dict:
    limit = {"at_most": at_most} if at_most is not None else {"at_least": at_least}
    met = value <= at_most if at_most is not None else value >= at_least
    return {**tag, "target": target, "value": value, **limit, "met": met}
