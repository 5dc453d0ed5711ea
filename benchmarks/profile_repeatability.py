"""How far a device profile moves when it is measured again on the same machine, minutes apart: the floor under
any agreement between the simulator and the engine, whose host-bound steps are made of these costs.

    python benchmarks/profile_repeatability.py --model embedded --rounds 3 \
        --out benchmarks/results/profile_repeatability_h200.json

Measures the profile (``duoserve.bench.profile``, at 4 layers as ``benchmarks/simulate_h200.sh`` does, on a smaller
grid of batch sizes, contexts and token counts that holds the operating points read below; the engine's host costs
of each profile are the medians of the profile's own default rounds) ``--rounds`` times back to back and reports,
for each cost the simulator reads, every round's value and the spread (the largest over the smallest): host costs
(a layer call's, a fetch's, a compute group's, a copy's queueing, each decoder layer's and each pass's own launch
time, a predictor call's), the per-module fetch, and the device's (a copy's bandwidth, an expert group's kernel
time) for contrast.
"""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.table import Table

from duoserve.bench.profile import ProfileSettings, profile
from duoserve.bench.results import parser, write_result


def costs(p: dict) -> dict[str, float]:
    """The profile's costs at the validation's operating points (B=1 decode, a 64-token context, one expert's
    copy), one number each, those it measured."""
    def at(rows: list[dict], **keys) -> dict:
        return next(r for r in rows if all(r[k] == v for k, v in keys.items()))

    expert = p["geometry"]["expert_bytes"]
    found = {
        "host: decode call, B=1 (us)": at(p["call_host_us"], phase="decode", tokens=1)["us"],
        "host: fetch, smallest cache (us)": p["fetch_host_us"][0]["us"],
        "host: compute group (us)": p["group_host_us"],
        "host: copy queueing (us)": p["copy_host_us"],
        "host: decoder layer, decode B=1 (ms)": at(p["layer_ms"], batch=1, context=64)["decode_ms"],
        "host: pass, decode B=1 (ms)": at(p["step_ms"], batch=1, context=64)["decode_ms"],
        "host: predictor call, B=1 (ms)": at(p["predictor_ms"], batch=1)["host_ms"],
        "per-module fetch (ms)": p["module_copy_ms"],
        "device: pinned copy of one expert (GB/s)": at(p["copy"], bytes=expert)["pinned_gbps"],
        "device: group of k experts, 1 token each (ms)": max(r["ms"] for r in p["expert_ms"] if r["tokens"] == 1),
    }
    return {name: value for name, value in found.items() if value is not None}  # no pinned copies on a CPU


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__, geometry=None)
    ap.add_argument("--model", default="embedded", help="a config (hub id, local path) or embedded")
    ap.add_argument("--rounds", type=int, default=3, help="profiles measured back to back")
    args = ap.parse_args(argv)
    settings = ProfileSettings(args.model, layers=4, batch_sizes=[1, 8], contexts=[64, 512], tokens=[1, 16, 256])
    rounds = [costs(profile(settings)) for _ in range(args.rounds)]
    rows = [{"cost": name, "rounds": [r[name] for r in rounds],
             "spread": max(r[name] for r in rounds) / max(min(r[name] for r in rounds), 1e-12),
             "median": statistics.median(r[name] for r in rounds)} for name in rounds[0]]
    table = Table(title=f"{args.model}: the profile measured {args.rounds} times back to back")
    for col in ("cost", *(f"round {i + 1}" for i in range(args.rounds)), "largest / smallest"):
        table.add_column(col)
    for row in rows:
        table.add_row(row["cost"], *(f"{v:.3g}" for v in row["rounds"]), f"{row['spread']:.2f}")
    Console().print(table)
    result = {"model": args.model, "settings": vars(settings), "rows": rows}
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
