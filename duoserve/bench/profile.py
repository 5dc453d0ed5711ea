"""A device profile (``duoserve-run profile``): the costs a trace-driven offload simulator needs, measured here.

Shape legend: T tokens, B sequences, C context (prompt) length, H hidden size, E experts, P one packed expert.

The model is built from its config with random weights and a few decoder layers (timings do not depend on the
weights, and any shape fits any GPU). Fields (``PROFILE_FIELDS``; ``load_profile`` refuses a file without one):
  geometry      the shape measured: MoE layers of the full model, E, k, hidden size, bytes of one expert
  copy          host-to-device GB/s by copy size, pinned and pageable
  copy_host_us  host microseconds to queue one expert copy on the engine's copy path, not waiting for it
                (on the CPU the copy is synchronous, so this is the copy itself)
  expert_ms     one expert's GEMMs (the model's own experts kernel) by the tokens routed to it
  dequant_ms    dequantizing one expert on the device, by stored expert dtype
  layer_ms      everything but the routed experts, per decoder layer: a decode step and a prefill, by batch
                size and context length (the experts replaced by zeros through the experts interface)
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from duoserve.bench.harness import copy_bandwidth, device_name, sync
from duoserve.discovery import find_moe_layers, moe_geometry
from duoserve.loading import model_from_config, resolve_device
from duoserve.runtime.generation import timed_generate
from duoserve.runtime.plugin import ExpertsPlugin
from duoserve.runtime.quant import dequantize, make_store
from duoserve.runtime.store import HostExperts, expert_params
from duoserve.runtime.streams import Streams

PROFILE_VERSION = 1
PROFILE_FIELDS = ("device", "geometry", "copy", "copy_host_us", "expert_ms", "dequant_ms", "layer_ms")
MB = 1 << 20


@dataclass
class ProfileSettings:
    model: str  # a config (hub id, local path, checkpoint folder): only its shape is used
    layers: int = 2  # decoder layers built: layer costs are per layer
    dtype: str = "auto"
    device: str = "auto"
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    contexts: list[int] = field(default_factory=lambda: [128, 512])
    tokens: list[int] = field(default_factory=lambda: [1, 8, 64, 512])  # routed to one expert
    copy_mb: list[float] = field(default_factory=lambda: [1.0, 4.0, 16.0, 64.0])  # besides one expert's size
    repeats: int = 5

    def __post_init__(self):
        if self.layers < 1 or self.repeats < 1:
            raise ValueError("layers and repeats must be at least 1")
        if min(self.batch_sizes + self.contexts + self.tokens) < 1 or min(self.copy_mb) <= 0:
            raise ValueError("batch sizes, contexts, token counts and copy sizes must be positive")


class _NoExperts(ExpertsPlugin):
    """The model with its routed experts answering zeros: what the rest of a layer costs."""

    def run_layer(self, l: int, hidden: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden)


def _median_ms(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median wall milliseconds of ``fn`` over ``repeats`` calls after one warm-up, the device synchronised."""
    times = []
    for i in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _copy_host_us(store: HostExperts, device: torch.device, copies: int = 32) -> float:
    """Host microseconds per queued expert copy (the engine's ``Streams.copy_to_device``), the copies not waited
    for inside the timed span."""
    streams = Streams(device)
    slot = torch.empty(store.layout.numel, dtype=store.layout.dtype, device=device)  # P
    rows = store.packed.unbind(0)
    streams.copy_to_device(slot, rows[0], streams.copy)
    streams.synchronize()
    start = time.perf_counter()
    for i in range(copies):
        streams.copy_to_device(slot, rows[i % len(rows)], streams.copy)
    elapsed = time.perf_counter() - start
    streams.synchronize()
    return elapsed / copies * 1e6


def profile(s: ProfileSettings, say: Callable[[str], None] = lambda text: None) -> dict:
    """Measure every field of the profile (module docstring) for ``s``'s model shape on its device."""
    device = resolve_device(s.device)
    meta = model_from_config(s.model, torch.device("meta"), s.dtype)  # the whole model's geometry, no memory
    full = moe_geometry(meta, find_moe_layers(meta))
    model = model_from_config(s.model, device, s.dtype, s.layers)
    layers = find_moe_layers(model)
    params = {n: p.detach() for n, p in expert_params(layers[0].experts).items()}
    store = HostExperts.pack(params, pin=device.type == "cuda")
    nbytes = store.layout.nbytes
    H = model.config.get_text_config().hidden_size

    say("copy bandwidth by size")
    sizes = sorted({int(mb * MB) for mb in s.copy_mb} | {nbytes})
    copy = [{"bytes": n, **copy_bandwidth(device, n)} for n in sizes]
    say("host cost of queueing a copy")
    host_us = _copy_host_us(store, device)

    say("one expert's GEMMs by tokens")
    expert_ms = []
    with torch.no_grad(), ExpertsPlugin(model) as plugin:
        for T in s.tokens:
            hidden = torch.randn(T, H, dtype=store.layout.dtype, device=device)  # T x H
            idx = torch.zeros(T, 1, dtype=torch.long, device=device)  # T x 1: every token to expert 0
            w = torch.ones(T, 1, dtype=store.layout.dtype, device=device)
            ms = _median_ms(lambda: plugin.run_layer(0, hidden, idx, w), device, s.repeats)
            expert_ms.append({"tokens": T, "ms": ms})

    say("dequantizing one expert")
    dequant_ms = {}
    slot = torch.empty(1, store.layout.numel, dtype=store.layout.dtype, device=device)  # 1 x P
    for fmt in ("fp8", "int4"):
        quantized = make_store({n: p.to(device) for n, p in params.items()}, fmt, pin=False)
        stored = quantized.packed[:1].to(device)  # 1 x Q
        dequant_ms[fmt] = _median_ms(lambda: dequantize(stored, quantized.qlayout, store.layout, slot), device,
                                     s.repeats)

    layer_ms = []
    vocab = model.get_input_embeddings().num_embeddings
    decoder_layers = model.config.get_text_config().num_hidden_layers
    with _NoExperts(model):
        for B in s.batch_sizes:
            for C in s.contexts:
                say(f"layers without experts, B={B} C={C}")
                ids = torch.randint(vocab, (B, C), device=device)
                mask = torch.ones_like(ids)
                timed_generate(model, ids, mask, 2, fixed_length=True)  # warm-up
                _, timing = timed_generate(model, ids, mask, 8, fixed_length=True)
                layer_ms.append({"batch": B, "context": C, "decode_ms": timing["tpot_ms"] / decoder_layers,
                                 "prefill_ms": timing["ttft_s"] * 1e3 / decoder_layers})
    return {"profile_version": PROFILE_VERSION, "device": device_name(device), "model": s.model,
            "dtype": str(store.layout.dtype), "measured_layers": s.layers,
            "geometry": {"moe_layers": full.num_layers, "experts": full.num_experts, "top_k": full.top_k,
                         "hidden_size": H, "expert_bytes": nbytes},
            "copy": copy, "copy_host_us": host_us, "expert_ms": expert_ms, "dequant_ms": dequant_ms,
            "layer_ms": layer_ms}


def load_profile(path: str | Path) -> dict:
    """A profile file, refused with what is wrong if it is not one this version reads or misses a field."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read a device profile from {path}: {err}") from err
    if not isinstance(data, dict) or data.get("profile_version") != PROFILE_VERSION:
        found = data.get("profile_version") if isinstance(data, dict) else None
        raise ValueError(f"{path} is not a version-{PROFILE_VERSION} device profile (profile_version: {found}); "
                         f"make one with duoserve-run profile")
    missing = [f for f in PROFILE_FIELDS if not data.get(f)]
    if missing:
        raise ValueError(f"device profile {path} lacks {', '.join(missing)}; make it again with duoserve-run profile")
    return data

