"""The host's cost of a prefill call's fetch-and-compute groups, by policy and by the call's tokens: what the device
profile's ``group_host_us`` stands for (measured there with lru's groups on calls of E/k tokens) and what the
engine spends in a gate-fetching policy's prefill (docs/runtime.md, "The offload simulator": on-demand's replayed
prefills are simulated short).

    python3 benchmarks/group_host_probe.py --shape qwen3-30b-a3b-substrate --layers 4 --out RESULT.json

For lru (its default cache, 2k slots: groups of k) and on-demand (k slots: groups of k/2), and each prompt of T
random tokens (E/k, 64, 512: at E/k some experts go unrouted, from 64 on nearly none), a prefill layer call started
on an idle device: its host milliseconds (its work not waited for) and its wall milliseconds (waited for), the
median of ``--calls`` calls cycling through the layers (so none finds its experts cached), and the host per group
(each call's host time over the groups its own routing needs). Needs a GPU for figures that mean anything
(on the CPU the kernels run inside the host's time).
"""

from __future__ import annotations

import statistics
import tempfile
import time

import numpy as np
import torch

from duoserve.bench.drivers import random_ids
from duoserve.bench.harness import host_op_us, sync
from duoserve.bench.profile import packed_experts
from duoserve.bench.results import parser, write_result
from duoserve.bench.shapes import model_source
from duoserve.loading import model_from_config, resolve_device
from duoserve.runtime.engine import OffloadEngine
from duoserve.runtime.policies import POLICIES
from duoserve.runtime.settings import EngineSettings


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__, geometry=None)
    ap.add_argument("--shape", default="qwen3-30b-a3b-substrate", help="a named shape, a config path or embedded")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="prompt lengths (default: E/k, 64, 512)")
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    with tempfile.TemporaryDirectory() as folder:
        model = model_from_config(model_source(args.shape, folder), device, dtype, args.layers)
    stores, (L, E, k) = packed_experts(model, device)
    H, hdtype = model.config.get_text_config().hidden_size, stores[0].layout.dtype
    rng = np.random.default_rng(0)
    rows = []
    for policy in ("lru", "on-demand"):
        for T in args.tokens or [E // k, 64, 512]:
            hidden = torch.randn(T, H, dtype=hdtype, device=device)  # T x H
            weights = torch.full((T, k), 1.0 / k, dtype=hdtype, device=device)  # T x k
            host, wall, groups = [], [], []  # per call
            with torch.no_grad(), OffloadEngine(model, stores, POLICIES[policy],
                                                settings=EngineSettings(step_graphs=False)) as engine:
                engine.phase = "prefill"
                for i in range(args.calls + L):  # the first pass over the layers warms the caches and kernels
                    ids = random_ids(rng, T, 1, E, k)[:, 0]  # T x k
                    idx = torch.as_tensor(ids, device=device)
                    sync(device)
                    start = time.perf_counter()
                    engine.run_layer(i % L, hidden, idx, weights)
                    mid = time.perf_counter()
                    sync(device)
                    end = time.perf_counter()
                    if i >= L:
                        host.append((mid - start) * 1e3)
                        wall.append((end - start) * 1e3)
                        groups.append(-(-len(np.unique(ids)) // engine.grouped.group_size(stores[0])))
            row = {"policy": policy, "tokens": T, "groups": statistics.median(groups),
                   "host_ms": statistics.median(host), "wall_ms": statistics.median(wall),
                   "host_per_group_ms": statistics.median(h / n for h, n in zip(host, groups)),
                   "host_op_us": host_op_us(device)}
            rows.append(row)
            print(f"{policy:>9} T={T:>4}: {row['groups']:.0f} groups, host {row['host_ms']:.2f} ms "
                  f"({row['host_per_group_ms']:.3f} a group), wall {row['wall_ms']:.2f} ms, "
                  f"host pace {row['host_op_us']:.1f} us an op", flush=True)
    result = {"shape": args.shape, "layers": L, "geometry": [L, E, k], "device": str(device), "rows": rows}
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
