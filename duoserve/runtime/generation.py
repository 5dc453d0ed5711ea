"""Offload a model and time greedy generations: TTFT, time per output token, end to end, peak memory.

Shape legend: B sequences, S prompt length, N new tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import StaticCache
from transformers.generation import utils as generation_utils
from transformers.generation.streamers import BaseStreamer

from duoserve.discovery import find_moe_layers
from duoserve.loading import checkpoint_experts, load_model, resolve_device
from duoserve.predictor.artifact import load_predictor
from duoserve.runtime.engine import OffloadEngine
from duoserve.runtime.peers import AccelerateOffload
from duoserve.runtime.plugin import ExpertsPlugin
from duoserve.runtime.policies import Policy, get_policy
from duoserve.runtime.quant import check_expert_dtype, make_store
from duoserve.runtime.settings import EngineSettings
from duoserve.runtime.sources import RoutingSource
from duoserve.runtime.store import HostExperts, put_experts, take_experts


def offload(model: nn.Module, policy: Policy, device: torch.device | str,
            expert_dtype: str = "model") -> list[HostExperts]:
    """Move ``model``'s routed experts to host stores of the kind ``policy`` reads, the rest to ``device``.

    Packed stores are pinned when ``device`` is a GPU, and hold the experts in ``expert_dtype`` (``quant.py``:
    the model's own, fp8 or int4; quantized on ``device`` a layer at a time). ``duoserve.runtime.store.put_experts``
    undoes it, with quantized experts put back dequantized.
    """
    device = torch.device(device)
    check_expert_dtype(expert_dtype)
    layers = find_moe_layers(model)
    if expert_dtype != "model" and not policy.quantizable:
        why = ("computes the experts on the host in the model's dtype" if policy.host_compute
               else "copies the model's own parameters")
        raise ValueError(f"policy {policy.name} {why}; quantized experts ({expert_dtype}) need a policy with packed "
                         "stores that copies them to the device")
    if policy.pinned:
        def store(params: dict[str, torch.Tensor]) -> HostExperts:
            if expert_dtype != "model":
                params = {n: p.to(device) for n, p in params.items()}
            return make_store(params, expert_dtype, pin=device.type == "cuda")
        stores = take_experts(layers, store)
    else:
        pin = policy.accelerate == "pinned" and device.type == "cuda"  # Accelerate's state dict, one copy
        stores = take_experts(layers, lambda params: HostExperts.as_modules(params, pin))
    model.to(device)
    return stores


def offload_plugin(model: nn.Module, stores: list[HostExperts], policy: Policy, predictor=None,
                   routing: RoutingSource | None = None, settings: EngineSettings = EngineSettings(),
                   device: torch.device | str | None = None) -> OffloadEngine | AccelerateOffload:
    """What runs ``model`` under an offload ``policy`` from ``stores``: Accelerate's own hooks for the accelerate
    policies, else the engine (``predictor``, ``routing`` and ``settings`` as ``OffloadEngine`` takes them)."""
    if policy.accelerate:
        if predictor is not None:
            raise ValueError(f"policy {policy.name} does not use a predictor")
        return AccelerateOffload(model, stores, policy.accelerate == "pinned", routing, device)
    return OffloadEngine(model, stores, policy, predictor, routing, settings, device)


class _StepClock(BaseStreamer):
    """Stamps the time of every ``put``: the prompt, then each generated token (generate syncs before each)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def kv_cache(model: nn.Module, max_len: int) -> StaticCache:
    """A static KV cache of ``max_len`` tokens for ``model``, to hand to ``timed_generate`` for one batch size again
    and again: an engine's step graphs (``stepgraph.py``) address its tensors, so they are captured once for all
    generations on it."""
    return StaticCache(config=model.config, max_cache_len=max_len)


def cache_for(plugin, model: nn.Module, max_len: int) -> StaticCache | None:
    """The KV cache generations under ``plugin`` run on: a static one of ``max_len`` tokens where its step graphs
    address the cache's tensors (``ExpertsPlugin.static_cache``), else None (transformers' own dynamic cache)."""
    return kv_cache(model, max_len) if getattr(plugin, "static_cache", False) else None


def _cache_kwargs(cache: StaticCache) -> dict:
    # transformers renamed generate's past_key_values to cache (5.2x); the old name warns there
    name = "cache" if "cache" in getattr(generation_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"
    return {name: cache, "disable_compile": True}


def timed_generate(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int,
                   fixed_length: bool = False, static_cache: bool = False,
                   cache: StaticCache | None = None) -> tuple[torch.Tensor, dict]:
    """Greedy generation of up to ``new_tokens`` (exactly, with ``fixed_length``) and its timings.

    ``static_cache``: a static KV cache, with which transformers' ``generate`` compiles the decode step
    (``torch.compile``, CUDA graphs; on a GPU, or wherever ``generation_config.compile_config`` allows it).
    ``cache``: a static KV cache to generate on instead (``kv_cache``), reset first, with no compiled step.

    Returns the B x (S + N) sequences and ttft_s (prompt in -> first token out), tpot_ms (mean gap
    between later tokens), e2e_s, new_tokens, and peak_gpu_bytes (allocator peak during the call, GPU only).
    """
    device = input_ids.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    if cache is not None:
        cache.reset()  # reused: this generation starts from an empty cache
    clock = _StepClock()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens if fixed_length else None, do_sample=False,
                             streamer=clock, pad_token_id=pad,
                             **(_cache_kwargs(cache) if cache is not None else
                                {"cache_implementation": "static" if static_cache else None}))
    if cuda:
        torch.cuda.synchronize(device)
    end = time.perf_counter()
    steps = clock.times[1:]  # the first put is the prompt
    timing = {
        "ttft_s": steps[0] - start,
        "tpot_ms": (steps[-1] - steps[0]) / (len(steps) - 1) * 1e3 if len(steps) > 1 else None,
        "e2e_s": end - start,
        "new_tokens": len(steps),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
    }
    return out, timing


@dataclass
class Generation:
    """What ``generate`` returns: the texts, the run's timings and (offloaded) the engine's counters."""

    policy: str
    prompts: list[str]
    texts: list[str]
    timing: dict
    counters: dict = field(default_factory=dict)
    expert_dtype: str = "model"  # how the host experts were stored

    def to_dict(self) -> dict:
        return {"policy": self.policy, "expert_dtype": self.expert_dtype, "texts": self.texts, **self.timing,
                **self.counters}


def resolve_expert_dtype(expert_dtype: str, model: str, policy: Policy) -> str:
    """``expert_dtype``, where "auto" is the checkpoint's own format where ``policy`` can store it (fp8 for a
    block-wise FP8 checkpoint, ``loading.checkpoint_experts``) and the model's dtype otherwise."""
    if expert_dtype != "auto":
        return check_expert_dtype(expert_dtype)
    return checkpoint_experts(model) if policy.quantizable else "model"


def generate(model: str, prompts: Sequence[str], policy: str = "duoserve", predictor: str | Path | None = None,
             new_tokens: int = 64, settings: EngineSettings = EngineSettings(), device: str = "auto",
             dtype: str = "auto", expert_dtype: str = "auto") -> Generation:
    """Load ``model`` (hub id, path or 'embedded'), offload its experts under ``policy`` (stored in ``expert_dtype``,
    ``resolve_expert_dtype``) and generate greedily from ``prompts`` (a batch) with the predictor artifact at
    ``predictor``; the model is put back together after."""
    chosen = get_policy(policy)
    expert_dtype = resolve_expert_dtype(expert_dtype, model, chosen)
    scorer = load_predictor(predictor) if predictor else None
    target = resolve_device(device)
    net, tokenizer = load_model(model, device="cpu", dtype=dtype)
    if chosen.resident:
        net.to(target)
        plugin, stores = ExpertsPlugin(net), None
    else:
        stores = offload(net, chosen, target, expert_dtype)
        plugin = offload_plugin(net, stores, chosen, scorer, settings=settings, device=target)
    batch = tokenizer(list(prompts), return_tensors="pt", padding=True).to(target)
    cache = cache_for(plugin, net, batch.input_ids.shape[1] + new_tokens)
    try:
        with plugin:
            out, timing = timed_generate(net, batch.input_ids, batch.attention_mask, new_tokens,
                                         static_cache=chosen.compiled, cache=cache)
            counters = {} if chosen.resident else plugin.stats()
    finally:
        if stores is not None:
            put_experts(plugin.layers, stores, target)
    texts = tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
    return Generation(chosen.name, list(prompts), texts, timing, counters, expert_dtype if stores else "model")
