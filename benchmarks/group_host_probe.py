"""The host's cost of a prefill call's fetch-and-compute groups, by policy and by the call's tokens: what the device
profile's ``group_host_us`` stands for (measured there with lru's groups on calls of E/k tokens) and what the
engine spends in a gate-fetching policy's prefill (docs/simulator.md, "Validation against the engine": on-demand's replayed
prefills are simulated short).

    python3 benchmarks/group_host_probe.py --shape qwen3-30b-a3b-substrate --layers 4 --out RESULT.json

For lru (its default cache, 2k slots: groups of k) and on-demand (k slots: groups of k/2), and each prompt of T
random tokens (E/k, 64, 512: at E/k some experts go unrouted, from 64 on nearly none), a prefill layer call started
on an idle device: its host milliseconds (its work not waited for) and its wall milliseconds (waited for), the
median of ``--calls`` calls cycling through the layers (so none finds its experts cached), and the host per group
(each call's host time over the groups its own routing needs). Needs a GPU for figures that mean anything
(on the CPU the kernels run inside the host's time).

``--policy`` picks the policies (default lru and on-demand), ``--expert-dtype fp8|int4`` stores the experts
quantized (the copy-then-dequantize groups of the whole cache), and ``--python-profile N`` also profiles the timed
calls of each row with cProfile and keeps its N costliest functions by own time (``profile``: where a group's host
time goes; cProfile's own cost inflates the small ones):

    python3 benchmarks/group_host_probe.py --shape qwen3-30b-a3b --layers 8 --tokens 512 --policy duoserve \
        --expert-dtype int4 --python-profile 25 --out RESULT.json
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path

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
from duoserve.runtime.quant import make_store
from duoserve.runtime.settings import EngineSettings


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__, geometry=None)
    ap.add_argument("--shape", default="qwen3-30b-a3b-substrate", help="a named shape, a config path or embedded")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="prompt lengths (default: E/k, 64, 512)")
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--policy", action="append", default=None, choices=("lru", "on-demand", "duoserve"),
                    help="policies to probe (repeat; default lru and on-demand)")
    ap.add_argument("--expert-dtype", default="model", choices=("model", "fp8", "int4"),
                    help="store the experts in this format (model: as the model holds them)")
    ap.add_argument("--python-profile", type=int, default=0, metavar="N",
                    help="also cProfile the timed calls and keep the N costliest functions by own time")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    with tempfile.TemporaryDirectory() as folder:
        model = model_from_config(model_source(args.shape, folder), device, dtype, args.layers)
    stores, (L, E, k) = packed_experts(model, device)
    H, hdtype = model.config.get_text_config().hidden_size, stores[0].layout.dtype
    if args.expert_dtype != "model":
        stores = [make_store(store.params(device), args.expert_dtype, pin=device.type == "cuda") for store in stores]
    rng = np.random.default_rng(0)
    rows = []
    for policy in args.policy or ["lru", "on-demand"]:
        for T in args.tokens or [E // k, 64, 512]:
            hidden = torch.randn(T, H, dtype=hdtype, device=device)  # T x H
            weights = torch.full((T, k), 1.0 / k, dtype=hdtype, device=device)  # T x k
            host, wall, groups = [], [], []  # per call
            profiler = cProfile.Profile() if args.python_profile else None
            with torch.no_grad(), OffloadEngine(model, stores, POLICIES[policy],
                                                settings=EngineSettings(step_graphs=False)) as engine:
                engine.phase = "prefill"
                for i in range(args.calls + L):  # the first pass over the layers warms the caches and kernels
                    ids = random_ids(rng, T, 1, E, k)[:, 0]  # T x k
                    idx = torch.as_tensor(ids, device=device)
                    sync(device)
                    timed = profiler is not None and i >= L
                    start = time.perf_counter()
                    if timed:
                        profiler.enable()
                    engine.run_layer(i % L, hidden, idx, weights)
                    if timed:
                        profiler.disable()
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
                   "host_op_us": host_op_us(device), "expert_dtype": args.expert_dtype}
            if profiler is not None:
                row["profile"] = _costliest(profiler, args.python_profile, args.calls)
            rows.append(row)
            print(f"{policy:>9} T={T:>4}: {row['groups']:.0f} groups, host {row['host_ms']:.2f} ms "
                  f"({row['host_per_group_ms']:.3f} a group), wall {row['wall_ms']:.2f} ms, "
                  f"host pace {row['host_op_us']:.1f} us an op", flush=True)
    result = {"shape": args.shape, "layers": L, "geometry": [L, E, k], "device": str(device), "rows": rows}
    write_result(args.out, result)
    return result


def _costliest(profiler: cProfile.Profile, count: int, calls: int) -> list[dict]:
    """The ``count`` functions of most own time in ``profiler``'s calls: microseconds a layer call, own and with
    what they call, and how often a call runs each."""
    stats = pstats.Stats(profiler, stream=io.StringIO()).stats
    rows = [{"function": f"{Path(file).name}:{line}({name})", "own_us": own / calls * 1e6,
             "cumulative_us": cumulative / calls * 1e6, "per_call": n / calls}
            for (file, line, name), (_, n, own, cumulative, _) in stats.items()]
    return sorted(rows, key=lambda r: -r["own_us"])[:count]


if __name__ == "__main__":
    main()
