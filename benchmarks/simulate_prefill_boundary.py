"""Where a quantized prefill loses time to its bytes bound, by cache size, in the offload simulator: TTFT, the
copy stream's busy time (the bound) and its idle time, for duoserve (oracle:1) on Qwen3-30B-A3B's 48 layers,
random routing, prompt 512, at each cache size and batch size; then, at one cache size, the same prefill with
the profile's host costs of a layer call scaled (what if the engine's host work took less): the call's host time
before its first group (``call_host_us`` past its routing read), each further group's (``group_host_by_tokens``)
and each dequantization pass's (``dequant_host_us``).

The copy stream idles at each layer boundary from the end of the prefill's look-ahead into layer l+1 (the
cache's free slots' worth of copies) until layer l+1's first fetch: meanwhile the device computes layer l's last
group and layer l+1's attention, and the host reads the router and queues the call's cached experts
(``runtime/scheduler.py``, step 5). Last, at that cache size, where the copy stream idles in that prefill: before
which step's copies, waiting for the host or for a staging buffer (``copy_waits``). Needs no GPU.

    python benchmarks/simulate_prefill_boundary.py --out benchmarks/results/simulate_prefill_boundary_h200.json
"""

from __future__ import annotations

import copy
import traceback

from rich.console import Console
from rich.table import Table

from duoserve.bench.costs import Costs, resolve_profile
from duoserve.bench.drivers import RandomRouting
from duoserve.bench.results import parser, write_result
from duoserve.bench.simulate import ModelShape, Simulator, generation_passes, run
from duoserve.runtime.policies import POLICIES
from duoserve.runtime.settings import EngineSettings


def scaled_host(profile: dict, first: float, groups: float, passes: float) -> dict:
    """``profile`` with a layer call's host time before its first group scaled by ``first`` (its routing read
    kept), each further group's by ``groups`` and each dequantization pass's by ``passes``."""
    out = copy.deepcopy(profile)
    for row in out["call_host_us"]:
        routing = row.get("routing_us", row["us"])
        row["us"] = routing + (row["us"] - routing) * first
    for row in out.get("group_host_by_tokens") or []:
        row["us"] *= groups
    out["group_host_us"] = out.get("group_host_us", 0.0) * groups
    out["dequant_host_us"] = {fmt: us * passes for fmt, us in out.get("dequant_host_us", {}).items()}
    return out


def _prefill_run(shape: ModelShape, profile: dict, fmt: str, slots: int, batch: int, prompt: int):
    """A simulator of duoserve (oracle:1) at ``slots`` and its passes: a warm-up generation, then the timed prefill."""
    settings = EngineSettings(gpu_expert_budget=slots * shape.layout.nbytes)
    sim = Simulator(shape, Costs(profile), POLICIES["duoserve"], "oracle:1", settings, expert_dtype=fmt)
    routing = RandomRouting(shape.num_layers, shape.num_experts, shape.top_k, seed=0)
    passes = [(-1, p) for p in generation_passes(routing, batch, prompt, 2)]
    passes.append((0, next(iter(generation_passes(routing, batch, prompt, 2)))))
    return sim, passes


def prefill(shape: ModelShape, profile: dict, fmt: str, slots: int, batch: int, prompt: int) -> dict:
    """One timed prefill after a warm-up generation: TTFT, the copy stream's busy and idle time, in ms."""
    sim, passes = _prefill_run(shape, profile, fmt, slots, batch, prompt)
    result = run(sim, passes)
    busy = result["copies"]["prefill"] * sim.costs.copy_ms(sim.scheduler.stores[0].row_bytes)
    ttft = result["ttft_ms"]["p50"]
    return {"ttft_ms": ttft, "copy_busy_ms": busy, "copy_idle_ms": ttft - busy, "x_bound": ttft / busy,
            "cache_slots": result["cache_slots"]}


# the schedule's steps that queue a prefill's copies (``runtime/schedule.py``, ``runtime/scheduler.py``), by the
# engine function that queues them
STEPS = {"stage": "the first fetched group, staged", "fetch_missing": "a fetched group",
         "copy_ahead": "the look-ahead into the next layer"}


def copy_waits(shape: ModelShape, profile: dict, fmt: str, slots: int, batch: int, prompt: int) -> dict[str, float]:
    """Where one timed prefill's copy stream idles, in ms: before each copy, by what it waited for (the host, which
    queued it only then, or an event: a staging buffer's last read) and by the step of the schedule that queued it
    (``STEPS``), and at the pass's start and end."""
    sim, passes = _prefill_run(shape, profile, fmt, slots, batch, prompt)
    run(sim, passes[:-1])
    streams, spans = sim.streams, []
    streams.synchronize()  # as ``run`` starts a timed pass: on an idle device
    queue = streams.run

    def traced(stream, ms: float, copy: bool = False) -> None:
        queued = streams.host
        queue(stream, ms, copy)
        if stream is streams.copy:
            names = [frame.name for frame in traceback.extract_stack(limit=12)]
            step = next((STEPS[n] for n in reversed(names) if n in STEPS), "another step")
            spans.append((stream.t - ms, stream.t, queued, step))

    start = streams.host
    streams.run = traced  # this simulator's copies only, for one pass
    try:
        sim.forward(passes[-1][1])
    finally:
        del streams.run
    waits = {"the pass's start, before its first copy": spans[0][0] - start}
    for (_, end, _, _), (begin, _, queued, step) in zip(spans, spans[1:]):
        if begin > end:
            cause = "the host" if begin <= queued else "a staging buffer"
            waits[f"{cause}, before {step}"] = waits.get(f"{cause}, before {step}", 0.0) + begin - end
    waits["the pass's end, after its last copy"] = streams.host - spans[-1][1]
    return waits


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__, geometry=None)
    p.add_argument("--profile", default="h200-qwen3-30b-a3b", help="a device profile file or a shipped profile's name")
    p.add_argument("--shape", default="qwen3-30b-a3b", help="the model shape (duoserve.bench.shapes)")
    p.add_argument("--expert-dtype", default="int4", choices=("fp8", "int4"))
    p.add_argument("--slots", type=int, nargs="+", default=[32, 64, 96], help="cache sizes, in experts")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--whatif-slots", type=int, default=32, help="the cache size of the scaled-host rows")
    args = p.parse_args(argv)
    profile = resolve_profile(args.profile)
    shape = ModelShape.of(args.shape)
    shape.check(profile)
    rows = [{"slots": slots, "batch_size": batch, "host": "profile",
             **prefill(shape, profile, args.expert_dtype, slots, batch, args.prompt_len)}
            for slots in args.slots for batch in args.batch_size]
    scalings = {"first group x0.5": (0.5, 1, 1), "further groups x0.5": (1, 0.5, 1), "dequant passes x0.5": (1, 1, 0.5),
                "all three x0.5": (0.5, 0.5, 0.5), "all three x0": (0, 0, 0)}
    batch = max(args.batch_size)
    rows += [{"slots": args.whatif_slots, "batch_size": batch, "host": name,
              **prefill(shape, scaled_host(profile, *factors), args.expert_dtype, args.whatif_slots, batch,
                        args.prompt_len)} for name, factors in scalings.items()]
    table = Table(title=f"{args.expert_dtype} prefill of {args.prompt_len} tokens a sequence, {shape.num_layers} layers, "
                        f"simulated on {args.profile}")
    for col in ("slots", "B", "host costs", "TTFT ms", "x bound", "copy busy ms", "copy idle ms"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["cache_slots"]), str(r["batch_size"]), r["host"], f"{r['ttft_ms']:.1f}",
                      f"{r['x_bound']:.2f}", f"{r['copy_busy_ms']:.1f}", f"{r['copy_idle_ms']:.1f}")
    Console().print(table)
    waits = copy_waits(shape, profile, args.expert_dtype, args.whatif_slots, batch, args.prompt_len)
    table = Table(title=f"where the copy stream idles: {args.whatif_slots} slots, B={batch}, the profile's costs")
    table.add_column("waiting for")
    table.add_column("ms")
    for where, ms in waits.items():
        table.add_row(where, f"{ms:.1f}")
    Console().print(table)
    result = {"profile": str(args.profile), "shape": args.shape, "expert_dtype": args.expert_dtype,
              "prompt_len": args.prompt_len, "layers": shape.num_layers, "rows": rows,
              "copy_waits": {"slots": args.whatif_slots, "batch_size": batch, "ms": waits}}
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
