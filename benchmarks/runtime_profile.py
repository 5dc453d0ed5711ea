"""Where one offload run spends its time: torch.profiler over `duoserve-run bench`'s run of one policy.

    python3 benchmarks/runtime_profile.py MODEL_DIR --layers 4 --policy duoserve --predictor oracle:1
prints the profiler's table (self CPU time; waits show up as cudaStreamSynchronize / cudaEventSynchronize)
and, on CUDA, a timeline per forward pass (prefill, then each decode step): host wall time, GPU span,
how busy the copy and compute streams were inside it, where the copy stream sat idle between copies
and which engine section the host was in meanwhile, and the engine's host sections per pass.
On CUDA a contention table follows: the busiest kernels of each stream, their median time alone and beside a
kernel of another stream (a fetch kernel that holds the multiprocessors shows up as compute kernels slowed).
``--trace t.json`` also writes the Chrome trace (engine sections are named in it); ``--timeline t.json``
prints the timeline and the table of a saved trace again, with no model and no GPU.

``--host-split all-resident duoserve:none duoserve:oracle:1`` runs each policy[:predictor][+eager] with no
profiler and splits a decode step's host time per layer: inside the experts call (the engine, or the model's
own kernel) and between two layers' calls (the model's own code: attention, norms, the router). ``+eager``:
no CUDA graph replays. Each line also gives the host's pace just before the run (microseconds per small op).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import itertools
import json
import statistics
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from duoserve.bench.harness import BenchSettings, build_model, run_policy
from duoserve.discovery import find_moe_layers
from duoserve.loading import resolve_device
from duoserve.runtime.policies import get_policy
from duoserve.runtime.settings import EngineSettings, parse_budget
from duoserve.runtime.quant import EXPERT_DTYPES, make_store
from duoserve.runtime.store import take_experts

SECTIONS = ("wait for routing", "queue compute", "queue fetches", "queue predictor", "wait for predictor",
            "queue prefetch")


@contextmanager
def named_passes(model):
    """Name each forward pass in the trace ("prefill" or "decode") with forward hooks; removed on exit."""
    marks = []

    def begin(module, args, kwargs):
        ids = kwargs.get("input_ids")
        marks.append(record_function("prefill" if ids is not None and ids.shape[1] > 1 else "decode"))
        marks[-1].__enter__()

    def end(module, args, out):
        marks.pop().__exit__(None, None, None)

    handles = [model.register_forward_pre_hook(begin, with_kwargs=True), model.register_forward_hook(end)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def experts_host_times(layers, tokens: int):
    """Host seconds inside each experts call and between consecutive layers' calls, of forward passes of
    ``tokens`` tokens (decode steps): (inside, between) lists, filled while the context is open."""
    inside, between, last = [], [], {}

    def pre(l):
        def hook(module, args):
            if len(args[0]) == tokens:
                now = last["enter"] = time.perf_counter()
                if last.get("layer") == l - 1:
                    between.append(now - last["exit"])
        return hook

    def post(l):
        def hook(module, args, out):
            if len(args[0]) == tokens:
                last["exit"], last["layer"] = time.perf_counter(), l
                inside.append(last["exit"] - last["enter"])
        return hook

    handles = [h for l, layer in enumerate(layers) for h in (layer.experts.register_forward_pre_hook(pre(l)),
                                                             layer.experts.register_forward_hook(post(l)))]
    try:
        yield inside, between
    finally:
        for h in handles:
            h.remove()


def setup(s: BenchSettings, batch_size: int, device: torch.device, expert_dtype: str = "model") -> tuple:
    """The model of ``s`` on ``device``, its experts stored in ``expert_dtype`` in (pinned, on CUDA) host memory as
    ``run_policy`` takes them, and a random B x prompt prompt: (model, stores, ids)."""
    model = build_model(s, device)
    stores = {expert_dtype: take_experts(find_moe_layers(model),
                                         lambda p: make_store(p, expert_dtype, pin=device.type == "cuda"))}
    model.to(device)
    ids = torch.randint(model.get_input_embeddings().num_embeddings, (batch_size, s.prompt_lens[0])).to(device)
    return model, stores, ids


def run_stored(model, stores, policy, predictor: str, s: BenchSettings, ids: torch.Tensor) -> dict:
    """``run_policy`` on the one expert dtype ``setup`` stored."""
    return run_policy(model, stores, policy, predictor, s, ids, s.new_tokens, expert_dtype=next(iter(stores)))


def split_run(model, stores, s: BenchSettings, ids: torch.Tensor, policy: str, predictor: str = "none") -> tuple:
    """One warm-up, then one timed run of ``policy`` (settings ``s``) under ``experts_host_times``: (run, host ms
    per layer inside experts calls, host ms per layer between them), decode steps only."""
    run_stored(model, stores, get_policy(policy), predictor, s, ids)
    with experts_host_times(find_moe_layers(model), len(ids)) as (inside, between):
        run = run_stored(model, stores, get_policy(policy), predictor, s, ids)
    return run, 1e3 * sum(inside) / max(len(inside), 1), 1e3 * sum(between) / max(len(between), 1)


def host_split(model, stores, s: BenchSettings, ids: torch.Tensor, specs: list[str]) -> None:
    """Print, per policy[:predictor][+eager] spec, TPOT and a decode step's host ms per layer inside and between
    experts calls (means over the timed run)."""
    for spec in specs:
        name, _, predictor = spec.removesuffix("+eager").partition(":")
        eager = replace(s, engine=replace(s.engine, eager=spec.endswith("+eager")))
        run, inside, between = split_run(model, stores, eager, ids, name, predictor or "none")
        print(f"{spec}: TPOT {run['tpot_ms']:.2f} ms; per layer, ms: inside experts {inside:.3f}, between {between:.3f}"
              f"; host {run['host_op_us']:.1f} us/op")


def _busy(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of ``spans`` (start, end)."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def _overlaps(idle: list[tuple[float, float]], sections: list[dict]) -> dict[str, float]:
    """What the host was doing while the copy stream sat idle: ms of the ``idle`` spans inside each engine section,
    the rest as "outside the engine" (the model's own code: attention, norms, the router)."""
    spent = defaultdict(float)
    for a, b in idle:
        inside = 0.0
        for s in sections:
            overlap = min(b, s["ts"] + s["dur"]) - max(a, s["ts"])
            if overlap > 0:
                spent[s["name"]] += overlap / 1e3
                inside += overlap
        spent["outside the engine"] += (b - a - inside) / 1e3
    return dict(spent)


def timeline(trace: dict) -> list[dict]:
    """Per forward pass: host ms, GPU span ms, copy/compute stream busy ms in it, H2D GB/s, host ms per section."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    passes = sorted((e for e in events if e["name"] in ("prefill", "decode") and e.get("cat") == "user_annotation"),
                    key=lambda e: e["ts"])
    launches = [e for e in events if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})]
    gpu = {e["args"]["correlation"]: e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
           and "correlation" in e.get("args", {})}
    sections = [e for e in events if e["name"] in SECTIONS and e.get("cat") == "user_annotation"]
    h2d = [e for e in gpu.values() if e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]]
    by_stream = defaultdict(float)
    for e in h2d:
        by_stream[e["args"].get("stream")] += e["dur"]
    copy_stream = max(by_stream, key=by_stream.get) if by_stream else None
    rows = []
    for p in passes:
        lo, hi = p["ts"], p["ts"] + p["dur"]
        mine = [gpu[e["args"]["correlation"]] for e in launches
                if lo <= e["ts"] <= hi and e["args"]["correlation"] in gpu]
        if not mine:
            continue
        start, end = min(e["ts"] for e in mine), max(e["ts"] + e["dur"] for e in mine)
        copies = [e for e in mine if e["args"].get("stream") == copy_stream and e.get("cat") == "gpu_memcpy"]
        compute = [e for e in mine if e["args"].get("stream") != copy_stream]
        nbytes = sum(e["args"].get("bytes", 0) for e in copies)
        ends = sorted((e["ts"], e["ts"] + e["dur"]) for e in copies)
        idle = [(a[1], b[0]) for a, b in itertools.pairwise(ends) if b[0] - a[1] > 200]  # idle > 0.2 ms
        gaps = [(b - a) / 1e3 for a, b in idle]
        copy_ms = _busy([(e["ts"], e["ts"] + e["dur"]) for e in copies]) / 1e3
        host = defaultdict(float)
        for s in sections:
            if lo <= s["ts"] <= hi:
                host[s["name"]] += s["dur"] / 1e3
        rows.append({"pass": p["name"], "host_ms": p["dur"] / 1e3, "gpu_span_ms": (end - start) / 1e3,
                     "copy_busy_ms": copy_ms, "copy_gbps": nbytes / copy_ms / 1e6 if copy_ms else None,
                     "compute_busy_ms": _busy([(e["ts"], e["ts"] + e["dur"]) for e in compute]) / 1e3,
                     "copy_gaps_ms": gaps, "gap_host_ms": _overlaps(idle, [s for s in sections if lo <= s["ts"] <= hi]),
                     "section_ms": {k: round(v, 3) for k, v in host.items()}})
    return rows


def print_timeline(rows: list[dict]) -> None:
    decode = [r for r in rows if r["pass"] == "decode"][1:]  # the first decode step warms its shapes
    for name, group in (("prefill", [r for r in rows if r["pass"] == "prefill"]), ("decode (mean)", decode)):
        if not group:
            continue
        mean = {k: sum(r[k] or 0 for r in group) / len(group) for k in
                ("host_ms", "gpu_span_ms", "copy_busy_ms", "compute_busy_ms")}
        rate = [r["copy_gbps"] for r in group if r["copy_gbps"]]
        sections = defaultdict(float)
        for r in group:
            for k, v in r["section_ms"].items():
                sections[k] += v / len(group)
        print(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in mean.items())
              + (f", copy GB/s {sum(rate) / len(rate):.1f}" if rate else ""))
        print("  host sections ms: " + ", ".join(f"{k} {v:.2f}" for k, v in sections.items()))
        gaps = [g for r in group for g in r["copy_gaps_ms"]]
        if gaps:
            print(f"  copy stream idle > 0.2 ms between copies: {len(gaps) / len(group):.1f} times a pass, "
                  f"{min(gaps):.2f}-{max(gaps):.2f} ms, mean {sum(gaps) / len(gaps):.2f} ms")
            doing = defaultdict(float)
            for r in group:
                for k, v in r.get("gap_host_ms", {}).items():
                    doing[k] += v / len(group)
            print("  host meanwhile, ms a pass: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                            sorted(doing.items(), key=lambda item: -item[1])))


def contention(trace: dict, names: int = 4) -> list[dict]:
    """How much slower the busiest kernels of each stream ran while a kernel of another stream ran beside them: per
    (stream, kernel name), the median microseconds alone and overlapped (a fetch kernel that holds every SM shows
    up as the compute stream's kernels waiting for SMs); streams with under 1% of all kernel time are left out."""
    kernels = sorted((e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"),
                     key=lambda e: e["ts"])
    total, by_stream = defaultdict(float), defaultdict(float)  # (stream, name) -> us, stream -> us
    spans = defaultdict(list)  # stream -> its kernels' (start, end), in start order
    for e in kernels:
        stream = e["args"].get("stream")
        total[stream, e["name"]] += e["dur"]
        by_stream[stream] += e["dur"]
        spans[stream].append((e["ts"], e["ts"] + e["dur"]))
    everything = sum(by_stream.values())
    ranked = sorted((key for key in total if by_stream[key[0]] >= everything / 100),  # not a capture's side stream
                    key=lambda key: (key[0], -total[key]))
    chosen = [key for _, keys in itertools.groupby(ranked, key=lambda key: key[0])
              for key in itertools.islice(keys, names)]  # each stream's busiest

    def beside(e) -> bool:
        a, b = e["ts"], e["ts"] + e["dur"]
        return any(lo < b and hi > a for stream, other in spans.items() if stream != e["args"].get("stream")
                   for lo, hi in other[max(bisect.bisect_left(other, (a,)) - 1, 0):bisect.bisect_left(other, (b,))])

    split = {key: ([], []) for key in chosen}  # (stream, name) -> (alone, beside) durations
    for e in kernels:
        if (durations := split.get((e["args"].get("stream"), e["name"]))) is not None:
            durations[beside(e)].append(e["dur"])
    return [{"stream": stream, "kernel": name[:60], "total_ms": total[stream, name] / 1e3,
             **{side: (len(d), statistics.median(d) if d else None) for side, d in zip(("alone", "beside"), pair)}}
            for (stream, name), pair in split.items()]


def print_contention(rows: list[dict]) -> None:
    print("kernels beside another stream's (median us; n): stream, kernel, total ms, alone, beside")
    for r in rows:
        (na, alone), (nb, beside) = r["alone"], r["beside"]
        fmt = lambda v, n: f"{v:8.1f} ({n})" if v is not None else "       - (0)"
        print(f"  {r['stream']:>4} {r['kernel']:60} {r['total_ms']:9.2f} {fmt(alone, na)} {fmt(beside, nb)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="model folder (not needed with --timeline)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--policy", default="duoserve")
    ap.add_argument("--predictor", default="none")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--gpu-expert-budget", type=parse_budget, help="a size (8GiB), a share of the experts (10%%) or 2k")
    ap.add_argument("--expert-dtype", default="model", choices=EXPERT_DTYPES, help="how the experts are stored")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--trace", help="also write the Chrome trace (CPU and CUDA activity) to this file (.gz: gzipped)")
    ap.add_argument("--stack", action="store_true", help="record Python frames too (the trace shows engine functions)")
    ap.add_argument("--timeline", metavar="TRACE", help="only print the timeline of a trace saved by --trace")
    ap.add_argument("--host-split", nargs="+", metavar="POLICY[:PREDICTOR]",
                    help="no profiler: split each run's decode host time per layer (see above)")
    a = ap.parse_args()
    if a.timeline:
        with (gzip.open if a.timeline.endswith(".gz") else open)(a.timeline, "rt") as f:
            trace = json.load(f)
        print_timeline(timeline(trace))
        print_contention(contention(trace))
        return
    if a.model is None:
        ap.error("a model folder is needed to profile (or --timeline TRACE)")
    s = BenchSettings(model=a.model, config_only=True, layers=a.layers, routing="random", new_tokens=a.new_tokens,
                      engine=EngineSettings(gpu_expert_budget=a.gpu_expert_budget))
    device = resolve_device("auto")
    model, stores, ids = setup(s, a.batch_size, device, a.expert_dtype)
    if a.host_split:
        host_split(model, stores, s, ids, a.host_split)
        return
    policy = get_policy(a.policy)
    run_stored(model, stores, policy, a.predictor, s, ids)  # warm the process
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, with_stack=a.stack) as prof, named_passes(model):
        run = run_stored(model, stores, policy, a.predictor, s, ids)
    print({k: run.get(k) for k in ("ttft_s", "tpot_ms", "stall_ms", "predictor_ms")})
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
    if cuda or a.trace:
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(f"{tmp}/trace.json")
            with open(f"{tmp}/trace.json") as f:
                trace = json.load(f)
        if a.trace:
            with (gzip.open if a.trace.endswith(".gz") else open)(a.trace, "wt") as f:
                json.dump(trace, f)
        if cuda:
            print_timeline(timeline(trace))
            print_contention(contention(trace))


if __name__ == "__main__":
    main()
