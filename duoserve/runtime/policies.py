"""The offload policies the engine runs: DuoServe's dual-phase schedule and the baselines it is measured against."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    name: str
    about: str
    pinned: bool = True  # host experts packed, pinned with a GPU (else the model's own parameters, pageable)
    overlap: bool = True  # fetch on the copy stream, pipelined with compute (else on the compute stream, blocking)
    reuse: bool = True  # experts stay cached across layers and tokens (else each call fetches what it routes to)
    predict: bool = False  # decode: prefetch the predictor's experts for layer l+1 while layer l computes
    prefetch_layer: bool = False  # prefetch every expert of layer l+1 while layer l computes
    prefill_lookahead: bool = False  # prefill routing >= 8 pairs per expert: layer l+1's first experts fetched early
    resident: bool = False  # no offload: every expert on the device (the upper bound)
    compiled: bool = False  # static KV cache, so transformers' generate compiles the decode step (CUDA graphs)
    host_compute: bool = False  # routed experts computed on the host CPU; only hidden states cross to it and back
    accelerate: str = ""  # run by Accelerate's own offload hooks (``peers.py``) from "pageable" or "pinned" memory

    @property
    def quantizable(self) -> bool:
        """Whether its experts may be stored quantized: it copies them from packed stores to the device (so not the
        per-module, resident or host-computing policies)."""
        return self.pinned and not (self.resident or self.host_compute)


POLICIES = {p.name: p for p in [
    Policy("duoserve", "prefill: each routed expert fetched once, pipelined on two streams, cached ones first, "
                       "and with >= 8 routed pairs per expert the cache's worth of layer l+1's experts fetched before "
                       "its router runs; decode: predictor-driven prefetch of layer l+1, misses fetched at the gate",
           predict=True, prefill_lookahead=True),
    Policy("on-demand", "fetch each routed expert at the gate and wait for it (pinned, one copy per expert)",
           overlap=False, reuse=False),
    Policy("accelerate", "Accelerate's own offload (cpu_offload, as from_pretrained(device_map=...) maps a module "
                         "to cpu): every expert of a layer moved to the GPU per call, from pageable memory",
           pinned=False, overlap=False, reuse=False, accelerate="pageable"),
    Policy("accelerate-pinned", "Accelerate's own offload as above, its state dict in pinned memory",
           pinned=False, overlap=False, reuse=False, accelerate="pinned"),
    Policy("per-module", "the engine imitating a per-module offload hook that knew the routing: the routed experts "
                         "only, from pageable memory, one blocking copy per parameter, nothing kept between calls",
           pinned=False, overlap=False, reuse=False),
    Policy("lru", "on-demand fetches into an LRU expert cache of the same budget (as mixtral-offloading)",
           overlap=False),
    Policy("full-layer", "prefetch all of layer l+1's experts while layer l computes (as MoESys)",
           prefetch_layer=True),
    Policy("cpu-experts", "routed experts computed on the host CPU, in place in the packed host store; attention, "
                          "norms and routers on the GPU: only hidden states cross PCIe (as llama.cpp's --n-cpu-moe, "
                          "KTransformers, Fiddler)", overlap=False, reuse=False, host_compute=True),
    Policy("all-resident", "every expert on the device; no offload; transformers' eager decode", resident=True),
    Policy("all-resident-compiled", "every expert on the device, a static KV cache, and transformers' own "
                                    "torch.compile of the decode step (CUDA graphs on a GPU): the fastest "
                                    "all-resident decode a transformers user gets (the compute bound)",
           resident=True, compiled=True),
]}


DEFAULT_POLICIES = ("duoserve", "on-demand", "accelerate", "all-resident")  # what a bench compares unless told


def get_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    return POLICIES[name]
