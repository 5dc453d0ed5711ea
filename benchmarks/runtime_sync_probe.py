"""Does reading the routing to the host at every layer slow a B=1 decode step? A probe, on CUDA.

    python3 benchmarks/runtime_sync_probe.py MODEL_DIR   # a config folder, e.g. Qwen3-30B-A3B's
builds the model as `duoserve-run bench --config-only --layers 16 --routing random` does, then, twice in a
row, times 32 greedy tokens at B=1 for: the all-resident model; the same with a read of the routing to the
host (``top_k_index.cpu()``) or a stream synchronisation at every layer, as the engine must; the duoserve
policy with no predictor; the same with Python's garbage collector off; and the same with the engine's
routing read going through a pinned buffer and an event instead of a pageable copy. Each line gives
TPOT and a decode step's host ms per layer inside and between experts calls. The two rounds show how
much the machine itself varies on host-bound work.
"""

from __future__ import annotations

import gc
import sys
from typing import ClassVar

import numpy as np
import torch
from runtime_profile import setup, split_run

import duoserve.runtime.engine as engine_module
from duoserve.runtime.bench import BenchSettings
from duoserve.runtime.experts import Routing
from duoserve.trace.hooks import find_moe_layers


class PinnedRouting(Routing):
    """The routing read through a reused pinned buffer and an event (the engine reads a pageable copy)."""

    buffers: ClassVar[dict[tuple, torch.Tensor]] = {}  # shape -> pinned buffer, shared by every read

    def __init__(self, idx: torch.Tensor, num_experts: int):
        key = tuple(idx.shape)
        if key not in self.buffers:
            self.buffers[key] = torch.empty(key, dtype=idx.dtype, pin_memory=True)
        host = self.buffers[key]
        host.copy_(idx, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        super().__init__(host, num_experts)


def main() -> None:
    s = BenchSettings(model=sys.argv[1], config_only=True, layers=16, routing="random", new_tokens=32)
    model, stores, ids = setup(s, 1, torch.device("cuda"))
    layers = find_moe_layers(model)

    def run(label: str, policy: str, inject=None, gc_off: bool = False, routing=Routing) -> None:
        hooks = [layer.experts.register_forward_pre_hook(inject) for layer in layers] if inject else []
        engine_module.Routing = routing
        if gc_off:
            gc.disable()
        try:
            r, inside, between = split_run(model, stores, s, ids, policy)
        finally:
            gc.enable()
            engine_module.Routing = Routing
            for h in hooks:
                h.remove()
        print(f"{label}: TPOT {r['tpot_ms']:.2f}; inside {inside:.3f} between {between:.3f}", flush=True)

    def read_routing(module, args) -> None:
        if len(args[0]) == 1:
            np.asarray(args[1].cpu())

    def sync_only(module, args) -> None:
        if len(args[0]) == 1:
            torch.cuda.current_stream().synchronize()

    for _ in range(2):
        run("resident", "all-resident")
        run("resident + idx.cpu() per layer", "all-resident", inject=read_routing)
        run("resident + stream sync per layer", "all-resident", inject=sync_only)
        run("duoserve none", "duoserve")
        run("duoserve none, gc off", "duoserve", gc_off=True)
        run("duoserve none, pinned routing read", "duoserve", routing=PinnedRouting)


if __name__ == "__main__":
    main()
