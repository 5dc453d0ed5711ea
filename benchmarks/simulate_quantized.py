"""The offload simulator against engine runs with quantized experts, on a profile from another run of the machine:
each bench run given is simulated as ``simulate_validation.py`` simulates its own benches (same policy, predictor,
expert dtype, batch, prompt, tokens, random routing; at the run's own host pace), and its TTFT and time per output
token are set beside the measured ones.

    python benchmarks/simulate_quantized.py \\
        --profile benchmarks/results/simulate_h100_v6/recall/h100-qwen3-30b-a3b.json \\
        --dequant-us fp8=8.5 --dequant-us int4=7.9 \\
        --bench benchmarks/results/defer_prefetch_ab_h100/ab1_defer-prefetch_int4_qwen3-30b-a3b_h100.json ... \\
        --out benchmarks/results/simulate_quantized_h100.json

``--dequant-us FMT=US`` replaces the profile's device time of one expert's dequantization pass in that format
(``dequant_ms``): for a profile measured before the engine's dequantization kernels, with what the profile's own
timing of a pass gave after them. Where the profile's engine host costs and the runs come from different machine
instances, only the host pace (``host_op_us``) carries the difference: an estimate, not the validation table.
Needs no GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from duoserve.bench.costs import Costs, resolve_profile
from duoserve.bench.results import parser, write_result
from duoserve.bench.simulate import ModelShape
from simulate_validation import TOLERANCE, compare, simulate_run


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__, geometry=None)
    p.add_argument("--profile", required=True, help="a device profile file or a shipped profile's name")
    p.add_argument("--bench", type=Path, action="append", required=True, help="a duoserve-run bench result (repeat)")
    p.add_argument("--shape", default="qwen3-30b-a3b", help="the benches' model shape (duoserve.bench.shapes)")
    p.add_argument("--dequant-us", action="append", default=[], metavar="FMT=US",
                   help="one expert's dequantization pass on the device, in us, for that expert dtype (repeat)")
    args = p.parse_args(argv)
    profile = resolve_profile(args.profile)
    for item in args.dequant_us:
        fmt, _, us = item.partition("=")
        if fmt not in ("fp8", "int4") or not us.replace(".", "", 1).isdigit():
            p.error(f"--dequant-us takes FMT=US with FMT fp8 or int4 and US a number of microseconds, not {item!r}")
        profile["dequant_ms"] = {**profile["dequant_ms"], fmt: float(us) / 1e3}
    rows = []
    for path in args.bench:
        bench = json.loads(path.read_text())
        shape = ModelShape.of(args.shape, bench["geometry"]["moe_layers"], bench["dtype"].removeprefix("torch."))
        shape.check(profile)
        for r in bench["runs"]:
            measured = {"ttft_ms": r["ttft_s"] * 1e3, "tpot_ms": r["tpot_ms"]}
            simulated = simulate_run(bench, r, shape, Costs(profile, r["host_op_us"]), None)
            sim, ratio, within = compare(simulated, measured)
            rows.append({"bench": path.name, "policy": r["policy"], "predictor": r["predictor"],
                         "expert_dtype": r.get("expert_dtype", "model"), "batch_size": r["batch_size"],
                         "host_op_us": r["host_op_us"], "measured": measured, "simulated": sim, "ratio": ratio,
                         "within": within})
    table = Table(title=f"simulated / measured, each run at its own host pace (within {TOLERANCE:.0%})")
    for col in ("bench", "experts", "B", "host us/op", "TTFT ms", "sim", "ratio", "TPOT ms", "sim", "ratio"):
        table.add_column(col)
    for row in rows:
        m, s, q = row["measured"], row["simulated"], row["ratio"]
        table.add_row(row["bench"], row["expert_dtype"], str(row["batch_size"]), f"{row['host_op_us']:.1f}",
                      f"{m['ttft_ms']:.0f}", f"{s['ttft_ms']:.0f}", f"{q['ttft_ms']:.2f}", f"{m['tpot_ms']:.1f}",
                      f"{s['tpot_ms']:.1f}", f"{q['tpot_ms']:.2f}")
    Console().print(table)
    result = {"profile": str(args.profile), "dequant_ms": profile["dequant_ms"], "tolerance": TOLERANCE, "rows": rows,
              "held": sum(row["within"] for row in rows)}
    print(f"{result['held']} of {len(rows)} runs within {TOLERANCE:.0%} on TTFT and time per token")
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
