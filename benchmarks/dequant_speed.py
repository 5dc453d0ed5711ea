"""Device time of the engine's dequantization of quantized experts, eager torch ops against the GPU's Triton
kernels, and the floor it has.

A quantized fetch's dequantization runs between an expert's copy and its compute, on its own stream: its device
time adds to every layer of a prefill and of a decode step whose copies it trails. For each named shape's expert
(random bf16 weights) and each stored format, this times the engine's pass (``quant.dequantize_into``: the staging
chunk of ``quant.stage_chunk`` experts, 10 of Qwen3-30B-A3B's and one of Mixtral-8x7B's, straight into every other
slot of a cache) replayed from a CUDA graph, per expert: eager (``quant.dequantize_into``, the CPU's path) and as
the engine runs it on a GPU (``quant.dequantizer``: Triton kernels); and the floor, the pass's bytes (stored rows
read, cache rows written) at the device's own copy bandwidth (a device-to-device copy of the cache rows, timed
alike).

    python benchmarks/dequant_speed.py --device cuda --out benchmarks/results/dequant_speed_h100.json
"""

from __future__ import annotations

import torch

from duoserve.bench.profile import device_ms
from duoserve.bench.results import parser, write_result
from duoserve.bench.shapes import shape_config
from duoserve.runtime.quant import QuantizedExperts, dequantize_into, dequantizer, stage_chunk
from duoserve.runtime.store import ExpertLayout


def random_experts(name: str, n: int, device: torch.device) -> dict[str, torch.Tensor]:
    """``n`` experts of the named shape (gate and up fused, as transformers' experts modules hold them), bf16."""
    config = shape_config(name)
    H = config.hidden_size
    inner = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    torch.manual_seed(0)
    return {"gate_up_proj": torch.randn(n, 2 * inner, H, device=device, dtype=torch.bfloat16) * 0.02,
            "down_proj": torch.randn(n, H, inner, device=device, dtype=torch.bfloat16) * 0.02}


def measure(name: str, device: torch.device, repeats: int) -> list[dict]:
    """One row per stored format for the named shape's expert (module docstring)."""
    layout = ExpertLayout.of(random_experts(name, 1, torch.device("meta")))
    n = max(stage_chunk(layout), 1)
    params = random_experts(name, n, device)
    table = torch.empty(2 * n, layout.numel, dtype=layout.dtype, device=device)  # 2n x P: a cache's rows
    slots = torch.arange(0, 2 * n, 2, device=device)  # n: every other slot, as a decode pass's are no stretch
    rows, other = table[:n], table[n:]
    copy_ms = device_ms(lambda: other.copy_(rows), device, repeats)  # reads and writes n x P
    gbps = 2 * rows.numel() * rows.element_size() / copy_ms / 1e6
    out = []
    for fmt in ("fp8", "int4"):
        store = QuantizedExperts.quantize(params, fmt, pin=False)
        stored = store.packed.to(device)  # n x Q
        times = {label: device_ms(lambda fn=fn: fn(stored, slots, store.qlayout, layout, table), device, repeats) / n
                 for label, fn in (("eager", dequantize_into), ("engine", dequantizer(device)))}
        floor_ms = (stored.numel() + rows.numel() * rows.element_size()) / gbps / 1e6 / n
        out.append({"shape": name, "format": fmt, "experts_per_pass": n, "expert_mb": layout.nbytes / 1e6,
                    "stored_mb": store.row_bytes / 1e6, **{f"{label}_ms": ms for label, ms in times.items()},
                    "floor_ms": floor_ms, "copy_gbps": gbps, "engine_vs_eager": times["eager"] / times["engine"],
                    "engine_vs_floor": times["engine"] / floor_ms})
        print(f"{name:>14} {fmt:>4}, {n:>2} experts a pass, us an expert: eager {times['eager'] * 1e3:7.1f}, "
              f"engine {times['engine'] * 1e3:7.1f} "
              f"({out[-1]['engine_vs_eager']:.1f}x faster than eager, {out[-1]['engine_vs_floor']:.2f}x the floor "
              f"of {floor_ms * 1e3:.1f} at {gbps:.0f} GB/s)")
    return out


def main() -> None:
    ap = parser(__doc__, geometry=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", action="append", default=None, help="qwen3-30b-a3b and mixtral-8x7b by default")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    device = torch.device(args.device)
    shapes = args.shape or ["qwen3-30b-a3b", "mixtral-8x7b"]
    rows = [row for name in shapes for row in measure(name, device, args.repeats)]
    write_result(args.out, {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                            "rows": rows})


if __name__ == "__main__":
    main()
