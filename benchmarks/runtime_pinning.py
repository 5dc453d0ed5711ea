"""The expert cache on real routing: lru, duoserve, and duoserve with the most popular experts pinned, per budget,
without a predictor and with each trace's own trained one.

    python benchmarks/runtime_pinning.py --trace embedded=out/traces \\
        --trace substrate=benchmarks/data/substrate/traces --trace flame=DIR \\
        [--predictor substrate=ARTIFACT ...] --out benchmarks/results/runtime_pinning_h200.json

Each trace's token rows are replayed in file order as the routing (``duoserve-run bench --routing TRACE``) of a
config-only model of the trace's geometry (its layers, experts and top-k) with Qwen3-30B-A3B's widths (hidden
2048, expert 2048 x 768, its attention), so an expert's bytes and compute are a real one's. Budgets: k, 2k and
10%, 25%, 50% of the L x E experts; at each, ``lru`` and ``duoserve`` (no predictor: score eviction, the copy
stream and the prefill look-ahead) use the budget as one cache, and ``duoserve`` + pin keeps the most popular
experts (``duoserve-train stats`` counted on the replayed trace itself: the best a stats file of the same
workload can do) in the slots beyond the 2k its own work needs. Bytes and hit rates do not depend on the
device (the CPU stand-in gives the same); times do. ``--import-flame DIR`` writes the FLAME-MoE routing of
``../shared/data/flame-moe`` as a trace folder at DIR first (``benchmarks/flame_moe.py``).

``--predictor NAME=ARTIFACT`` adds, for that trace, ``duoserve`` with the predictor (its decode prefetch, copying
the experts it scores at least ``--prefetch-min-score``, the scores then ranking the cache's evictions) and the
same with the pins: the issue's "duoserve (predictor + score eviction)". The model's routers are random
(config-only), so its next-gate features would not match the replayed routing: give a history-only predictor
(``duoserve-train fit TRACE --family paper``).
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

import torch

from duoserve.bench.harness import BenchSettings, prepare, run_policy
from duoserve.bench.results import parser, write_result
from duoserve.bench.shapes import save_shape
from duoserve.features.stats import compute_stats
from duoserve.loading import resolve_device
from duoserve.predictor.artifact import load_predictor
from duoserve.runtime.cache import popular_keys
from duoserve.runtime.policies import get_policy
from duoserve.runtime.settings import EngineSettings, budget_slots
from duoserve.trace.format import open_trace

sys.path.insert(0, str(Path(__file__).parent))
from flame_moe import import_sequences  # noqa: E402  (a sibling script)

BUDGETS = ("k", "2k", "10%", "25%", "50%")
# --small: tiny widths for a check on the CPU (same hits and copies, expert bytes a tiny model's)
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
# (policy, pinned, predicted): the rows of each budget (the predicted ones where the trace has a predictor)
ROWS = (("lru", False, False), ("duoserve", False, False), ("duoserve", True, False), ("duoserve", False, True),
        ("duoserve", True, True))


def run_trace(name: str, trace: Path, predictor: str | None, args, device: torch.device, work: Path) -> list[dict]:
    opened = open_trace(trace)
    L, E, k = opened.meta.num_layers, opened.meta.num_experts, opened.meta.top_k
    config = save_shape("qwen3-30b-a3b", work / name, num_layers=L, num_experts=E, num_experts_per_tok=k,
                        **(SMALL if args.small else {}))
    keys = tuple(popular_keys(compute_stats(opened).popularity))
    s = BenchSettings(model=str(config), config_only=True, device=str(device), routing=str(trace),
                      policies=["lru", "duoserve"], prompt_lens=[args.prompt_len], new_tokens=args.new_tokens)
    model, stores, bandwidth = prepare(s, [get_policy(p) for p in s.policies], device, print)
    nbytes = stores["model"][0].layout.nbytes
    vocab = model.get_input_embeddings().num_embeddings
    input_ids = torch.randint(vocab, (1, s.prompt_lens[0]), generator=torch.Generator().manual_seed(0)).to(device)
    runs = []
    loaded = {predictor: load_predictor(predictor, device)} if predictor else {}
    run_policy(model, stores, get_policy("duoserve"), "none", s, input_ids, 2)  # untimed: kernels, allocator
    for spec in args.budgets.split(","):
        slots = budget_slots(spec, L, E, k)
        for policy, pinned, predicted in ROWS:
            if (pinned and slots <= 2 * k) or (predicted and predictor is None):
                continue  # nothing left to pin beyond the cache's own 2k; no predictor for this trace
            engine = EngineSettings(gpu_expert_budget=slots * nbytes, pin=keys if pinned else (),
                                    prefetch_min_score=args.prefetch_min_score)
            run = run_policy(model, stores, get_policy(policy), predictor if predicted else "none",
                             dataclasses.replace(s, engine=engine), input_ids, s.new_tokens, loaded)
            steps = run["new_tokens"] - 1
            run.update(trace=name, geometry=[L, E, k], budget=spec, budget_slots=slots, pinned=pinned,
                       predicted=predicted, decode_bytes_per_token=run["bytes_h2d"]["decode"] / steps)
            print(f"{name} {spec:>4} ({slots} slots) {who(run)}: "
                  f"hits {run['hit_rate']['decode']:.3f}, {run['decode_bytes_per_token'] / 1e6:.1f} MB/token, "
                  f"TPOT {run['tpot_ms']:.2f} ms, peak {(run['peak_gpu_bytes'] or 0) / 1e9:.2f} GB", flush=True)
            runs.append(run)
    del model, stores
    return runs + [{"trace": name, "bandwidth": bandwidth, "expert_mb": nbytes / 1e6}]


def who(run: dict) -> str:
    """A row's name: the policy, with its predictor and pins."""
    return run["policy"] + (" + predictor" if run.get("predicted") else "") + (" + pin" if run["pinned"] else "")


def main() -> None:
    ap = parser(__doc__, geometry=None)
    ap.add_argument("--trace", action="append", default=[], help="NAME=DIR, repeatable")
    ap.add_argument("--predictor", action="append", default=[],
                    help="NAME=ARTIFACT: a history-only predictor of trace NAME, repeatable")
    ap.add_argument("--prefetch-min-score", type=float, default=EngineSettings.prefetch_min_score,
                    help="the predictor rows' decode prefetch copies only experts scored at least this")
    ap.add_argument("--import-flame", type=Path, default=None, help="write FLAME-MoE as a trace folder here first")
    ap.add_argument("--budgets", default=",".join(BUDGETS))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--small", action="store_true", help="tiny widths (a CPU check: hits and copies only)")
    args = ap.parse_args()
    traces = dict(t.split("=", 1) for t in args.trace)
    predictors = dict(p.split("=", 1) for p in args.predictor)
    if unknown := set(predictors) - set(traces) - ({"flame"} if args.import_flame else set()):
        ap.error(f"--predictor names no --trace: {', '.join(sorted(unknown))}")
    if args.import_flame:
        import_sequences(args.import_flame)
        traces.setdefault("flame", str(args.import_flame))
    device = resolve_device(args.device)
    results = []
    with tempfile.TemporaryDirectory(prefix="duoserve-pinning-") as work:
        for name, trace in traces.items():
            results += run_trace(name, Path(trace), predictors.get(name), args, device, Path(work))
    runs = [r for r in results if "policy" in r]
    print(f"\n{'trace':<10} {'budget':>6} {'policy':<26} {'hits':>6} {'MB/token':>9} {'TPOT ms':>8} {'peak GB':>8}")
    for r in runs:
        peak = (r["peak_gpu_bytes"] or 0) / 1e9
        print(f"{r['trace']:<10} {r['budget']:>6} {who(r):<26} {r['hit_rate']['decode']:>6.3f} "
              f"{r['decode_bytes_per_token'] / 1e6:>9.1f} {r['tpot_ms']:>8.2f} {peak:>8.2f}")
    shape = "tiny widths (--small)" if args.small else "qwen3-30b-a3b widths"
    write_result(args.out, {"benchmark": "runtime_pinning", "shape": f"{shape}, the trace's L, E, k",
                            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                            "pin_stats": "popularity of the replayed trace itself", "predictors": predictors,
                            "prefetch_min_score": args.prefetch_min_score,
                            "traces": {r["trace"]: {k: r[k] for k in ("bandwidth", "expert_mb")}
                                       for r in results if "policy" not in r},
                            "runs": runs})


if __name__ == "__main__":
    main()
