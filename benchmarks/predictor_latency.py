"""Predictor latency and memory for one token's next-layer prediction (batch 1).

    python benchmarks/predictor_latency.py                       # CPU
    python benchmarks/predictor_latency.py --device cuda         # + CUDA graphs (fp32, bf16) and GPU memory
    python benchmarks/predictor_latency.py --device cuda --family residual   # another family (paper, hybrid, residual)
    python benchmarks/predictor_latency.py --device cuda --lookahead 3       # heads for depths 1..3, timed at 3

Geometry L=48, E=128, k=8, hidden size 2048 (Qwen3-30B-A3B's) with the paper's widths and random weights
and statistics (latency does not depend on training). Variants: eager, BatchNorm folded, folded with the sparse
(embedding-bag) first layer, and on CUDA: CUDA graphs of the folded one (fp32, bf16, fp32 through torch.compile)
and of the sparse one (plain, compiled, and compiled with Inductor's ``max-autotune-no-cudagraphs``, which
the runtime does not use: its compilation takes tens of seconds), and the call the runtime makes (``runtime``:
the deployed ``TrainedPredictor``'s compiled graph of the scores and their top k, ``top``, for one target layer
and depth, with the sparse first layer and the routing history in its own buffer, as the engine calls it;
``runtime_dense`` the same with the dense first layer). Hybrid and residual
predictors read the next-gate's 2k ids and scores: every variant computes them from a random bf16 router of the
target layer on the hidden states (eagerly in the eager ones, inside the graph in the graphed ones), as the
runtime does. With ``--lookahead A`` the predictor has A heads and is called at depth A (the affinity chain's
A-1 steps run at every depth: the cost does not depend on it). Reports the median per-call latency, each
variant's speed-up over eager in the same run, and on CUDA the GPU memory the predictor holds, with one graph
and with the graphs of every target layer the runtime captures (``runtime_all_targets``).
Targets (issue): at most 0.1 ms and 100 MB on the H200; paper: about 0.6 ms and 300 MB.
"""

from __future__ import annotations

import platform
import statistics
import time

import torch

from duoserve.bench.results import parser, write_result
from duoserve.bench.shapes import random_predictor
from duoserve.discovery import Gate, next_gate_fn
from duoserve.predictor.fast import (
    GraphedPredictor,
    SparseHistoryPredictor,
    TrainedPredictor,
    deployable,
    fold_batchnorm,
    graph_call,
)
from duoserve.predictor.model import FAMILIES, PAPER_WIDTHS


def time_calls(fn, device: torch.device, iters: int) -> float:
    """Median seconds per call, each call synchronised (the latency a caller waiting on it sees)."""
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times[iters // 10:])


def routed_ids(g: torch.Generator, L: int, E: int, k: int) -> torch.Tensor:
    """1 x L x k expert ids, distinct within a layer as a router picks them."""
    return torch.rand(1, L, E, generator=g).argsort(-1)[..., :k]


def target_gate(model, hidden_size: int, device) -> Gate | None:
    """The next-gate of the target layer, over a random bf16 router (as the runtime's), for a family that reads it;
    None for one that does not."""
    s = model.spec
    if not s.uses_nextgate:
        return None
    router = torch.nn.Linear(hidden_size, s.num_experts, bias=False).to(device, torch.bfloat16)
    return next_gate_fn(router, s.top_k, s.width, s.uses_scores)


def agreement_with_eager(model, graphed, gate: Gate | None, hidden_size: int, L: int, E: int, k: int, device,
                         samples: int = 500) -> float:
    """Share of random inputs on which the graphed predictor picks the same top-k set as eager float32."""
    A = model.spec.lookahead
    g = torch.Generator().manual_seed(1)
    same = 0
    for _ in range(samples):
        history = routed_ids(g, L, E, k).to(device)
        target = torch.randint(A, L, (1,), generator=g).to(device)
        depth = torch.randint(1, A + 1, (1,), generator=g).to(device)
        hidden = torch.randn(1, hidden_size, generator=g).to(device, torch.bfloat16)
        extra = gate(hidden) if gate is not None else ()
        same += torch.equal(graphed(history, target, depth=depth, hidden=hidden).sort().values,
                            model.predict(history, target, *extra, depth=depth).sort().values)
    return same / samples


def replay_gpu_ms(graphed, device, iters: int = 1000) -> float:
    """GPU milliseconds per replay, back to back (CUDA events), without host synchronisation per call."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graphed.graph.replay()
    start.record()
    for _ in range(iters):
        graphed.graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / iters


@torch.no_grad()
def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--family", choices=FAMILIES, default="paper")
    ap.add_argument("--lookahead", type=int, default=1, help="Heads for depths 1..A; calls are timed at depth A.")
    ap.add_argument("--hidden-size", type=int, default=2048, help="The next-gate router's input width.")
    args = ap.parse_args()
    device = torch.device(args.device)
    L, E, k, A = args.layers, args.experts, args.top_k, args.lookahead

    base_mem = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    model = random_predictor(L, E, k, PAPER_WIDTHS, args.family, A).to(device)
    params = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    history = routed_ids(torch.Generator().manual_seed(0), L, E, k).to(device)
    target = torch.tensor([L // 2], device=device)
    depth = torch.tensor([A], device=device)
    eager_mb = (torch.cuda.memory_allocated(device) - base_mem) / 2**20 if device.type == "cuda" else 0.0
    gate = target_gate(model, args.hidden_size, device)
    hidden = torch.randn(1, args.hidden_size, generator=torch.Generator().manual_seed(2)).to(device, torch.bfloat16)

    def eager(m) -> torch.Tensor:
        return m.predict(history, target, *(gate(hidden) if gate is not None else ()), depth=depth)

    folded, sparse = fold_batchnorm(model), SparseHistoryPredictor(model)
    variants = {"eager": lambda: eager(model), "bn_folded": lambda: eager(folded),
                "bn_folded_sparse": lambda: eager(sparse)}
    memory, agreement, gpu_time, capture_s = {"eager_model": eager_mb}, {}, {}, {}
    if device.type == "cuda":
        autotune = "max-autotune-no-cudagraphs"
        for name, dtype, sparse_graph, mode in (("cuda_graph", torch.float32, False, None),
                                                ("cuda_graph_sparse", torch.float32, True, None),
                                                ("cuda_graph_bf16", torch.bfloat16, False, None),
                                                ("cuda_graph_compiled", torch.float32, False, "default"),
                                                ("cuda_graph_sparse_compiled", torch.float32, True, "default"),
                                                ("cuda_graph_sparse_max_autotune", torch.float32, True, autotune)):
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            module = deployable(model, sparse_graph, device, dtype)
            compiled = torch.compile(graph_call(module, "ids", k), fullgraph=True, mode=mode) if mode else None
            start = time.perf_counter()
            graphed = GraphedPredictor(model, batch_size=1, device=device, module=module, compiled=compiled,
                                       gate=gate, hidden=hidden)
            capture_s[name] = {"seconds": time.perf_counter() - start, "compiled": graphed.compiled_ok}
            graphed(history, target, depth=depth, hidden=hidden)
            torch.cuda.synchronize(device)
            memory[name] = {"held": (torch.cuda.memory_allocated(device) - before) / 2**20,
                            "peak": (torch.cuda.max_memory_allocated(device) - before) / 2**20}
            variants[name] = lambda g=graphed: g(history, target, depth=depth, hidden=hidden)
            agreement[name] = agreement_with_eager(model, graphed, gate, args.hidden_size, L, E, k, device)
            gpu_time[name] = replay_gpu_ms(graphed, device)
        # what the engine deploys: the compiled graph of the scores and their top k, the next-gate inside it
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)

        def deployed_call(predictor: TrainedPredictor, t: int = L // 2):
            own = predictor.history(1, device).copy_(history)  # the buffer its graphs read, as the engine fills it
            return lambda: predictor.top(own, t, k, hidden, gate, depth=A)

        deployed = TrainedPredictor(model, device, compile=True)
        variants["runtime"] = deployed_call(deployed)
        start = time.perf_counter()
        variants["runtime"]()
        capture_s["runtime"] = {"seconds": time.perf_counter() - start,
                                "compiled": all(g.compiled_ok for g in deployed._graphs.values())}
        torch.cuda.synchronize(device)
        memory["runtime"] = {"held": (torch.cuda.memory_allocated(device) - before) / 2**20}
        for t in range(A, L):  # every target layer's graph, as a decode step captures them
            deployed_call(deployed, t)()
        torch.cuda.synchronize(device)
        memory["runtime_all_targets"] = {"held": (torch.cuda.memory_allocated(device) - before) / 2**20,
                                         "graphs": len(deployed._graphs)}
        variants["runtime_dense"] = deployed_call(TrainedPredictor(model, device, sparse=False, compile=True))
    results = {}
    for name, fn in variants.items():
        for _ in range(20):
            fn()
        results[name] = time_calls(fn, device, args.iters)
    report = {
        "benchmark": "predictor_latency", "family": args.family, "lookahead": args.lookahead,
        "geometry": {"L": L, "E": E, "k": k, "hidden_size": args.hidden_size},
        "widths": list(PAPER_WIDTHS), "input_dim": model.spec.input_dim, "parameters_and_buffers": params,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "threads": torch.get_num_threads(), "torch": torch.__version__, "batch_size": 1,
        "latency_ms": {n: t * 1e3 for n, t in results.items()},
        "speedup_vs_eager": {n: results["eager"] / t for n, t in results.items()},
    }
    if device.type == "cuda":
        report.update(gpu_memory_mb=memory, topk_set_agreement_with_eager_fp32=agreement,
                      gpu_ms_per_replay_back_to_back=gpu_time, seconds_to_compile_and_capture=capture_s)
    for name, t in results.items():
        print(f"{name:10s} {t * 1e3:8.3f} ms/call  ({results['eager'] / t:.2f}x vs eager)")
    for name in agreement:
        print(f"{name}: holds {memory[name]['held']:.1f} MB GPU memory (peak {memory[name]['peak']:.1f} MB), "
              f"{gpu_time[name]:.3f} ms GPU time per replay, top-k sets equal to eager fp32 on "
              f"{agreement[name]:.1%} of random inputs")
    if device.type == "cuda":
        every = memory["runtime_all_targets"]
        print(f"runtime: holds {memory['runtime']['held']:.1f} MB GPU memory with one target layer's graph, "
              f"{every['held']:.1f} MB with the graphs of all {every['graphs']} target layers")
    write_result(args.out, report)


if __name__ == "__main__":
    main()
