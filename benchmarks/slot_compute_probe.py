"""Device time of the engine's one-group expert compute by the expert cache's size: does a call over S slots,
nearly all of them without a pair, cost more as S grows?

Why: the offload simulator times a decode call's experts from the profile's groups of 1 and k experts (measured
over E groups) whatever the cache's size, and on the H200 a 2 GB cache (211 slots of Qwen3-30B-A3B) decodes B=1
at 0.80x of what it simulates while the default 16-slot cache agrees within 4% (docs/benchmarks.md). A decode call
runs every pair in one grouped GEMM over all S slots (``experts.slot_experts``), so its cost may grow with S.

For each S, B tokens of random routing (k distinct experts each, cached in slots spread over the S) go through
``Routing.rows`` and ``slot_experts`` as the engine builds them, replayed from a CUDA graph and timed by events
on a GPU (no host time), the median wall time on the CPU. Prints milliseconds by S and B, and each against the
smallest S that holds its experts.

    python benchmarks/slot_compute_probe.py [--shape qwen3-30b-a3b] [--slots 16 64 128 211 512 1024] \
        [--batch 1 8] [--out benchmarks/results/slot_compute_probe_h200.json]
"""

from __future__ import annotations

import tempfile

import numpy as np
import torch

from duoserve.bench.profile import device_ms
from duoserve.bench.results import parser, write_result
from duoserve.bench.shapes import SHAPES, model_source
from duoserve.discovery import find_moe_layers, moe_geometry
from duoserve.loading import model_from_config, resolve_device
from duoserve.runtime.experts import Routing, SlotView, slot_experts, slot_windows
from duoserve.runtime.store import ExpertLayout, expert_params


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__, geometry=None)
    ap.add_argument("--shape", default="qwen3-30b-a3b", help=f"one of {', '.join(SHAPES)} or embedded")
    ap.add_argument("--slots", type=int, nargs="+", default=[16, 64, 128, 211, 512, 1024])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():
        model = model_from_config(model_source(args.shape, folder), device, str(dtype).removeprefix("torch."), 1)
        moe = find_moe_layers(model)
        g = moe_geometry(model, moe)
        experts = moe[0].experts
        layout = ExpertLayout.of(expert_params(experts))
        H = model.config.get_text_config().hidden_size
        buffer = torch.randn(max(args.slots), layout.numel, dtype=dtype, device=device) * 0.02  # S x P
        rng = np.random.default_rng(0)
        rows = []
        for S in sorted(args.slots):
            view = SlotView(experts, layout.views(buffer[:S]), S)
            for B in args.batch:
                idx = np.stack([rng.choice(g.num_experts, g.top_k, replace=False) for _ in range(B)])  # B x k
                routing = Routing(torch.from_numpy(idx), g.num_experts)
                if len(routing.needed) > S:
                    continue  # a call's experts must all be cached
                where = rng.choice(S, len(routing.needed), replace=False)  # cached anywhere in the S slots
                pairs = routing.rows(dict(zip(routing.needed, where.tolist())), S)
                hidden = torch.randn(B, H, dtype=dtype, device=device)  # B x H
                weights = torch.full((B, g.top_k), 1 / g.top_k, dtype=dtype, device=device)  # B x k
                on_device = torch.from_numpy(pairs).to(device)
                windows = slot_windows(pairs, S)
                ms = device_ms(lambda: slot_experts(view, hidden, weights, on_device, S, windows), device,
                               args.repeats)
                rows.append({"slots": S, "batch": B, "experts": len(routing.needed), "ms": ms})
    base: dict[int, dict] = {}
    for r in rows:  # by increasing S
        first = base.setdefault(r["batch"], r)
        r["vs_smallest"] = r["ms"] / first["ms"]
        print(f"S={r['slots']:>5} B={r['batch']:>2} ({r['experts']:>3} experts): {r['ms'] * 1e3:8.1f} us "
              f"= {r['vs_smallest']:.2f}x of S={first['slots']}")
    result = {"shape": args.shape, "device": str(device), "dtype": str(dtype), "rows": rows}
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
