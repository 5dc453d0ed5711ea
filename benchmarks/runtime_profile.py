"""Where one offload run spends its CPU time: torch.profiler over `duoserve-run bench`'s run of one policy.

    python3 benchmarks/runtime_profile.py MODEL_DIR --layers 4 --policy duoserve --predictor oracle:1
prints the profiler's table (self CPU time; waits show up as cudaStreamSynchronize / cudaEventSynchronize).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from duoserve.runtime.bench import BenchSettings, build_model, run_policy
from duoserve.runtime.policies import get_policy
from duoserve.runtime.store import HostExperts, take_experts
from duoserve.trace.collect import resolve_device
from duoserve.trace.hooks import find_moe_layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--policy", default="duoserve")
    ap.add_argument("--predictor", default="none")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--trace", help="also write a Chrome trace (CPU and CUDA activity) to this file")
    ap.add_argument("--stack", action="store_true", help="record Python frames too (the trace shows engine functions)")
    a = ap.parse_args()
    s = BenchSettings(model=a.model, config_only=True, layers=a.layers, routing="random", new_tokens=a.new_tokens)
    device = resolve_device("auto")
    model = build_model(s, device)
    policy = get_policy(a.policy)
    stores = take_experts(find_moe_layers(model), lambda p: HostExperts.pack(p, pin=device.type == "cuda"))
    model.to(device)
    ids = torch.randint(model.get_input_embeddings().num_embeddings, (a.batch_size, s.prompt_len)).to(device)
    run_policy(model, {True: stores}, policy, a.predictor, s, ids, a.new_tokens)  # warm the process
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.trace and device.type == "cuda" else [])
    with profile(activities=activities, with_stack=a.stack) as prof:
        run = run_policy(model, {True: stores}, policy, a.predictor, s, ids, a.new_tokens)
    print({k: run.get(k) for k in ("ttft_s", "tpot_ms", "stall_ms", "predictor_ms")})
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
    if a.trace:
        prof.export_chrome_trace(a.trace)


if __name__ == "__main__":
    main()
