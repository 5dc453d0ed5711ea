"""Offload policies side by side on one model (``duoserve-run bench``): latency, memory, bytes, and their bounds.

Shape legend: B sequences, S prompt length, N new tokens.

Each policy runs the same random prompts with the same routing. The model may be config-only
(random weights, built on the device); then its routers are degenerate and ``routing`` should be
``random`` or a trace to replay. Bounds, per run: prefill >= max(prefill bytes / pinned bandwidth,
all-resident TTFT); a decode step >= max(its bytes / pinned bandwidth, all-resident time per token).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import duoserve
from duoserve.predictor.artifact import load_predictor
from duoserve.predictor.model import ExpertPredictor
from duoserve.runtime.engine import ExpertsPlugin, OffloadEngine
from duoserve.runtime.generate import timed_generate
from duoserve.runtime.policies import DEFAULT_POLICIES, Policy, get_policy
from duoserve.runtime.sources import OraclePredictor, RandomRouting, ReplayRouting
from duoserve.runtime.store import HostExperts, drop_experts, put_experts, take_experts
from duoserve.trace.collect import DTYPES, load_model, resolve_device, resolve_model
from duoserve.trace.hooks import find_moe_layers, moe_geometry

GB = 1e9
BOUND_LIMIT = 1.15  # the runtime issue's target: prefill and decode within this factor of their bounds


@dataclass
class BenchSettings:
    model: str
    config_only: bool = False
    layers: int | None = None  # config-only: keep this many decoder layers
    dtype: str = "auto"
    device: str = "auto"
    policies: list[str] = field(default_factory=lambda: list(DEFAULT_POLICIES))
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    prompt_len: int = 512
    new_tokens: int = 128
    baseline_new_tokens: int | None = None  # fewer tokens for the fetch-bound baselines
    routing: str = "router"  # router, random, or a trace folder to replay
    predictors: list[str] = field(default_factory=lambda: ["none"])  # none, oracle[:recall], or an artifact
    gpu_expert_budget: int | None = None
    seed: int = 0
    repeats: int = 1  # rounds over every configuration, interleaved, so drift and order show
    lookahead: int = 1  # decode prefetch depth (layers)
    eager: bool = False  # no CUDA graphs for decode calls
    prefetch_min_score: float = 0.0  # decode prefetch: only predicted experts scored at least this


def build_model(s: BenchSettings, device: torch.device):
    """The model (eval mode) with all weights, on ``device`` when config-only (random init), else on the CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not s.config_only:
        if s.layers:
            raise ValueError("--layers needs --config-only (a trained model keeps its layers)")
        return load_model(s.model, device="cpu", dtype=s.dtype)[0]
    try:
        config = AutoConfig.from_pretrained(resolve_model(s.model))
    except (OSError, ValueError) as err:
        raise ValueError(f"could not read a config for {s.model!r}: {err}") from err
    if s.layers:
        text = config.get_text_config()
        text.num_hidden_layers = s.layers
        if getattr(text, "layer_types", None):
            text.layer_types = text.layer_types[:s.layers]
    dtype = DTYPES[s.dtype] if s.dtype != "auto" else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def copy_bandwidth(device: torch.device, nbytes: int, trials: int = 3) -> dict[str, float | None]:
    """Host-to-device GB/s from pinned and pageable memory (on the CPU: memcpy, as 'pageable'): copies of
    ``nbytes`` (one expert) back to back, 1 GB a trial on CUDA, the best of ``trials`` (the bounds use it)."""
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    total = 1 << 30 if device.type == "cuda" else 1 << 26  # the CPU stand-in only needs a figure
    repeats = max(2, -(-total // nbytes))
    result = {}
    for kind in ("pinned", "pageable"):
        if kind == "pinned" and device.type != "cuda":
            result["pinned_gbps"] = None
            continue
        src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned")
        dst.copy_(src)
        best = float("inf")
        for _ in range(trials):
            _sync(device)
            start = time.perf_counter()
            for _ in range(repeats):
                dst.copy_(src, non_blocking=kind == "pinned")
            _sync(device)
            best = min(best, time.perf_counter() - start)
        result[f"{kind}_gbps"] = nbytes * repeats / best / GB
    return result


def host_op_us(device: torch.device, ops: int = 500) -> float:
    """Host microseconds per small tensor op (dispatch and launch) right now: the unit a host-bound decode step is
    made of. On shared machines it drifts between runs; each run records it next to its timings."""
    x = torch.zeros(1, device=device)
    _sync(device)
    start = time.perf_counter()
    for _ in range(ops):
        x.add_(1)
    _sync(device)
    return (time.perf_counter() - start) / ops * 1e6


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _routing(s: BenchSettings, L: int, E: int, k: int, device: torch.device):
    if s.routing == "router":
        return None
    if s.routing == "random":
        return RandomRouting(L, E, k, seed=s.seed, device=device)
    return ReplayRouting(s.routing, L, E, k)


def _load_predictors(specs: list[str], routing: str) -> dict[str, ExpertPredictor]:
    """The trained artifacts among ``specs``, read once (on the CPU); refuses a spec that cannot run, before a
    large model is built."""
    if routing == "router" and any(spec.startswith("oracle") for spec in specs):
        raise ValueError("an oracle predictor needs --routing random or a trace (it must know the routing)")
    return {spec: load_predictor(spec) for spec in specs if spec != "none" and not spec.startswith("oracle")}


def _predictor(spec: str, routing, E: int, device: torch.device, loaded: dict[str, ExpertPredictor]):
    if spec == "none":
        return None
    if spec.startswith("oracle"):
        return OraclePredictor(routing, E, float(spec.partition(":")[2] or 1.0))
    return loaded[spec] if spec in loaded else load_predictor(spec, device)


def run_policy(model, stores: dict[bool, list[HostExperts]], policy: Policy, predictor: str, s: BenchSettings,
               input_ids: torch.Tensor, new_tokens: int, loaded: dict[str, ExpertPredictor] | None = None) -> dict:
    """One timed generation of ``policy`` (after a short warm-up), with the engine's counters. ``loaded``: trained
    predictors already read, by spec (others are read here)."""
    device = input_ids.device
    layers = find_moe_layers(model)
    g = moe_geometry(model, layers)
    routing = _routing(s, g.num_layers, g.num_experts, g.top_k, device)
    mask = torch.ones_like(input_ids)
    if policy.resident:
        put_experts(layers, stores[True], device)
        plugin = ExpertsPlugin(model, routing)
    else:
        plugin = OffloadEngine(model, stores[policy.pinned], policy,
                               _predictor(predictor, routing, g.num_experts, device, loaded or {}), routing,
                               s.gpu_expert_budget, device, s.lookahead, s.eager, s.prefetch_min_score)
    try:
        with plugin:
            timed_generate(model, input_ids, mask, 2)  # warm-up at full size: kernel loading, cuBLAS, allocator
            if isinstance(plugin, OffloadEngine):
                plugin.reset_stats()
            gc.collect()
            op_us = host_op_us(device)
            _, timing = timed_generate(model, input_ids, mask, new_tokens, fixed_length=True)
            counters = plugin.stats() if isinstance(plugin, OffloadEngine) else {}
    finally:
        if policy.resident:
            drop_experts(layers)
        del plugin
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"policy": policy.name, "predictor": predictor if policy.predict else None,
            "batch_size": len(input_ids), "host_op_us": op_us, **timing, **counters}


def _peers(a: dict, b: dict) -> bool:
    """Runs that are compared: same batch size, same round."""
    return a["batch_size"] == b["batch_size"] and a["round"] == b["round"]


def add_bounds(runs: list[dict], pinned_gbps: float | None, pageable_gbps: float | None) -> None:
    """Add each run's prefill and decode bounds (see the module docstring) and its ratio to them."""
    for run in runs:
        resident = next((r for r in runs if r["policy"] == "all-resident" and _peers(r, run)), None)
        bandwidth = (pinned_gbps or pageable_gbps) * GB
        moved = run.get("bytes_h2d", {"prefill": 0, "decode": 0})
        steps = max(run["new_tokens"] - 1, 1)
        prefill = max(moved["prefill"] / bandwidth, resident["ttft_s"] if resident else 0.0)
        decode = max(moved["decode"] / steps / bandwidth * 1e3, resident["tpot_ms"] if resident else 0.0)
        run.update(prefill_bound_s=prefill, decode_bound_ms=decode, ttft_vs_bound=run["ttft_s"] / prefill,
                   tpot_vs_bound=run["tpot_ms"] / decode if run["tpot_ms"] else None)


def check_targets(runs: list[dict]) -> list[dict]:
    """The runtime issue's targets, per batch size and DuoServe run, where the runs they compare exist; with several
    rounds, also each target's median over the rounds (``"round": "median"``), as host-bound ratios drift."""
    checks = []
    for run in (r for r in runs if r["policy"] == "duoserve"):
        same = {r["policy"]: r for r in runs if _peers(r, run) and r["policy"] != "duoserve"}
        tag = {"batch_size": run["batch_size"], "predictor": run["predictor"], "round": run["round"]}
        if "on-demand" in same and run["peak_gpu_bytes"] is not None:
            extra = (run["peak_gpu_bytes"] - same["on-demand"]["peak_gpu_bytes"]) / GB
            checks.append(_check(tag, "peak GPU memory <= on-demand + 0.3 GB", extra, at_most=0.3))
        if "accelerate" in same:
            checks.append(_check(tag, "TTFT >= 1.8x better than accelerate",
                                 same["accelerate"]["ttft_s"] / run["ttft_s"], at_least=1.8))
            checks.append(_check(tag, "TPOT >= 1.4x better than accelerate",
                                 same["accelerate"]["tpot_ms"] / run["tpot_ms"], at_least=1.4))
        for phase, key in (("prefill", "ttft_vs_bound"), ("decode", "tpot_vs_bound")):
            checks.append(_check(tag, f"{phase} within {BOUND_LIMIT}x of its bound", run[key], at_most=BOUND_LIMIT))
    rounds: dict[tuple, list[dict]] = {}
    for c in checks:
        rounds.setdefault((c["batch_size"], c["predictor"], c["target"]), []).append(c)
    for (batch, predictor, target), group in rounds.items():
        if len(group) > 1:
            limits = {k: group[0][k] for k in ("at_most", "at_least") if k in group[0]}
            checks.append(_check({"batch_size": batch, "predictor": predictor, "round": "median"}, target,
                                 statistics.median(c["value"] for c in group), **limits))
    return checks


def _check(tag: dict, target: str, value: float, at_most: float | None = None, at_least: float | None = None) -> dict:
    limit = {"at_most": at_most} if at_most is not None else {"at_least": at_least}
    met = value <= at_most if at_most is not None else value >= at_least
    return {**tag, "target": target, "value": value, **limit, "met": met}


def bench(s: BenchSettings, on_run: Callable[[dict], None] | None = None,
          on_status: Callable[[str], None] | None = None) -> dict:
    """Run every (batch size, policy, predictor) of ``s``; the results as one JSON-ready dict. ``on_run`` gets each
    timed run's result, ``on_status`` a line saying what runs next (untimed warm-ups included)."""
    say = on_status or (lambda text: None)
    policies = [get_policy(p) for p in s.policies]
    loaded = _load_predictors(s.predictors, s.routing)
    device = resolve_device(s.device)
    model = build_model(s, device)
    layers = find_moe_layers(model)
    geometry = moe_geometry(model, layers)
    pin = device.type == "cuda"
    want_packed = any(p.pinned for p in policies)
    want_modules = any(not p.pinned for p in policies)
    pairs = take_experts(layers, lambda p: (HostExperts.pack(p, pin) if want_packed else None,
                                            HostExperts.as_modules(p) if want_modules else None))
    packed = [a for a, _ in pairs] if want_packed else None
    stores = {True: packed, False: [b for _, b in pairs] if want_modules else None}
    layout = (packed or stores[False])[0].layout
    bandwidth = copy_bandwidth(device, layout.nbytes)
    model.to(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    gc.collect()
    gc.freeze()  # the model's many objects: out of the collector's way during timed runs
    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(s.seed)
    runs = []
    # all-resident first: its experts go on and off the device before any offload run is timed
    order = sorted(policies, key=lambda p: not p.resident)
    warm = [order[0]] + [p for p in order if not p.resident][:1 if order[0].resident else 0]
    for batch in s.batch_sizes:
        input_ids = torch.randint(vocab, (batch, s.prompt_len), generator=generator).to(device)
        # untimed: on the H200 the process's first offload run, and the first run at a new batch size
        # (all-resident too), were up to 2-7x slower than later ones
        for policy in warm:
            say(f"warm-up {policy.name} B={batch} (untimed)")
            run_policy(model, stores, policy, s.predictors[0] if policy.predict else "none", s, input_ids,
                       _new_tokens(s, policy), loaded)
        for round_ in range(s.repeats):
            for policy in order:
                for predictor in (s.predictors if policy.predict else ["none"]):
                    say(f"{policy.name}{'' if predictor == 'none' else ' ' + predictor} B={batch}")
                    run = run_policy(model, stores, policy, predictor, s, input_ids, _new_tokens(s, policy), loaded)
                    run["round"] = round_
                    # config-only models may keep fewer layers than the real one: per-layer figures scale
                    run["per_moe_layer"] = {"ttft_s": run["ttft_s"] / geometry.num_layers,
                                            "tpot_ms": run["tpot_ms"] / geometry.num_layers if run["tpot_ms"] else None}
                    runs.append(run)
                    if on_run:
                        on_run(run)
    add_bounds(runs, bandwidth["pinned_gbps"], bandwidth["pageable_gbps"])
    return {
        "duoserve": duoserve.__version__, "torch": torch.__version__, "device": _device_name(device),
        "model": s.model, "config_only": s.config_only, "dtype": str(layout.dtype),
        "geometry": {"moe_layers": geometry.num_layers, "experts": geometry.num_experts, "top_k": geometry.top_k,
                     "expert_mb": layout.nbytes / 1e6},
        "routing": s.routing, "prompt_len": s.prompt_len, "new_tokens": s.new_tokens,
        "baseline_new_tokens": s.baseline_new_tokens, "gpu_expert_budget": s.gpu_expert_budget, "eager": s.eager,
        "prefetch_min_score": s.prefetch_min_score,
        "bandwidth": bandwidth, "runs": runs, "targets": check_targets(runs),
    }


def _new_tokens(s: BenchSettings, policy: Policy) -> int:
    """Tokens a run generates: fewer for the fetch-bound baselines when ``baseline_new_tokens`` is set."""
    slow = not (policy.predict or policy.resident)
    return s.baseline_new_tokens if slow and s.baseline_new_tokens else s.new_tokens


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
