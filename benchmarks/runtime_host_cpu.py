"""The engine's host time per decode layer, on the CPU stand-in: what a host-bound B=1 step pays the engine.

At batch 1 a decode step on the GPU is host-bound, so every microsecond the engine's Python spends per
layer is paid 16-48 times a token. This runs ``duoserve-run bench``'s own code on the CPU with Qwen3-30B-A3B's
routing geometry (128 experts, top-8, 16 MoE layers) at tiny widths (hidden 64), so the engine's bookkeeping,
not the experts' arithmetic, is what the sections measure: duoserve with an oracle at recall 1, random
routing, prompt 32, B=1, several rounds. It prints each round's time per token (on the CPU that includes the
experts' arithmetic: no bound to compare with) and the engine's host sections (``host_ms``) per decode layer, in
microseconds. First it times reading and sorting one call's routing (``Routing`` and its ``rows``) both ways,
in lists and in numpy, by pairs per call: where ``duoserve.runtime.experts.SMALL_CALL`` switches between them.

    python benchmarks/runtime_host_cpu.py [--rounds 3] [--new-tokens 64] [--layers 16] [--out FILE.json]

To compare two versions, run it in a worktree of each, alternately: the machine's pace drifts.
"""

from __future__ import annotations

import tempfile
import timeit

from duoserve.bench.drivers import RandomRouting
from duoserve.bench.harness import BenchSettings, bench
from duoserve.bench.results import parser, write_result
from duoserve.bench.shapes import shape_config
from duoserve.runtime.experts import SMALL_CALL, Routing

TINY_WIDTHS = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def sort_us(tokens: int, num_experts: int, top_k: int, small_call: int) -> float:
    """Microseconds to read and sort one call's routing into its pair rows, every expert in its own slot, sorting
    in lists up to ``small_call`` pairs."""
    idx = RandomRouting(1, num_experts, top_k, seed=tokens).begin(tokens)[0]  # T x k
    slots = {e: s for s, e in enumerate(Routing(idx, num_experts).needed)}
    num_slots = max(2 * top_k, len(slots))
    runs = timeit.repeat(lambda: Routing(idx, num_experts, small_call).rows(slots, num_slots), number=500, repeat=3)
    return min(runs) / 500 * 1e6


def main() -> None:
    ap = parser(__doc__, geometry=None)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    config = shape_config("qwen3-30b-a3b", args.layers, **TINY_WIDTHS)
    E, k = config.num_experts, config.num_experts_per_tok
    for tokens in (1, 8, 16, 24, 32):
        lists, arrays = sort_us(tokens, E, k, small_call=1 << 30), sort_us(tokens, E, k, small_call=0)
        print(f"routing of {tokens * k:3d} pairs: lists {lists:6.1f} us, numpy {arrays:6.1f} us"
              f"{'  <- lists (SMALL_CALL)' if tokens * k <= SMALL_CALL else ''}")
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        report = bench(BenchSettings(model=folder, config_only=True, device="cpu", dtype="float32",
                                     policies=["duoserve"], predictors=["oracle:1"], routing="random",
                                     prompt_lens=[32], new_tokens=args.new_tokens, repeats=args.rounds))
    for run in report["runs"]:
        # host_ms covers the prefill too: one forward pass of the new_tokens
        per_layer = {name: ms / args.new_tokens / args.layers * 1e3 for name, ms in run["host_ms"].items()}
        print(f"round {run['round']}: {run['tpot_ms']:.2f} ms a token; host us per layer: "
              + ", ".join(f"{name} {us:.1f}" for name, us in per_layer.items()))
    write_result(args.out, report)


if __name__ == "__main__":
    main()
