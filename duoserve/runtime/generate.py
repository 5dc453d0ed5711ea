"""Offload a loaded model and time greedy generations: TTFT, time per output token, end to end, peak memory.

Shape legend: B sequences, S prompt length, N new tokens.
"""

from __future__ import annotations

import re
import time

import torch
from torch import nn
from transformers.generation.streamers import BaseStreamer

from duoserve.runtime.policies import Policy
from duoserve.runtime.store import HostExperts, take_experts
from duoserve.trace.hooks import find_moe_layers

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'8GiB', '512MiB', '1.5GB' or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 8GiB, 512MiB or 2GB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def offload(model: nn.Module, policy: Policy, device: torch.device | str) -> list[HostExperts]:
    """Move ``model``'s routed experts to host stores of the kind ``policy`` reads, the rest to ``device``.

    Packed stores are pinned when ``device`` is a GPU. ``duoserve.runtime.store.put_experts`` undoes it.
    """
    device = torch.device(device)
    layers = find_moe_layers(model)
    if policy.pinned:
        stores = take_experts(layers, lambda p: HostExperts.pack(p, pin=device.type == "cuda"))
    else:
        stores = take_experts(layers, HostExperts.as_modules)
    model.to(device)
    return stores


class _StepClock(BaseStreamer):
    """Stamps the time of every ``put``: the prompt, then each generated token (generate syncs before each)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def timed_generate(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int,
                   fixed_length: bool = False) -> tuple[torch.Tensor, dict]:
    """Greedy generation of up to ``new_tokens`` (exactly, with ``fixed_length``) and its timings.

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
    clock = _StepClock()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens if fixed_length else None, do_sample=False,
                             streamer=clock, pad_token_id=pad)
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
