"""How fast the offload simulator runs: seconds to simulate one million token-layers (tokens x MoE layers) on one
CPU core, Qwen3-30B-A3B's shape (48 layers) on the shipped H200 profile, uniform random routing.

Cases: prompt 512 + 32 new tokens at B=1 (mostly prefill token-layers, one call per layer for a whole prompt),
the same at B=8, and the worst case, decode only (prompt 1, 64 new tokens, B=1: every token-layer is one engine
call; B=8 too with the trained predictor), with an oracle, with no predictor and with a trained predictor of the
paper's widths for this geometry (random weights: its cost, not its accuracy; its scores computed ahead in
batches, as the simulator does; the seconds of that scoring, the predictor's own inference on the host, are
reported beside the total). The routing is drawn before the clock starts.

    python benchmarks/simulate_speed.py --out benchmarks/results/simulate_speed_cpu.json
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from duoserve.bench.drivers import RandomRouting
from duoserve.bench.results import parser, write_result
from duoserve.bench.shapes import random_predictor
from duoserve.bench.costs import Costs, resolve_profile
from duoserve.bench.simulate import ModelShape, Simulator, generation_passes, run
from duoserve.predictor.artifact import save_predictor
from duoserve.runtime.policies import POLICIES

TARGET = 1_000_000  # token-layers per case


def case(shape: ModelShape, costs: Costs, policy: str, predictor: str, batch: int, prompt: int, new: int) -> dict:
    routing = RandomRouting(shape.num_layers, shape.num_experts, shape.top_k, seed=0)
    per_generation = batch * (prompt + new - 1) * shape.num_layers
    generations = -(-TARGET // per_generation)
    passes = [(g, p) for g in range(generations) for p in generation_passes(routing, batch, prompt, new)]
    start = time.perf_counter()
    sim = Simulator(shape, costs, POLICIES[policy], predictor)
    result = run(sim, passes)
    seconds = time.perf_counter() - start
    per_million = 1e6 / result["token_layers"]
    return {"policy": policy, "predictor": predictor, "batch_size": batch, "prompt_len": prompt, "new_tokens": new,
            "token_layers": result["token_layers"], "seconds": seconds, "seconds_per_million": seconds * per_million,
            "predictor_seconds_per_million": result["predictor_seconds"] * per_million}


def main(argv: list[str] | None = None) -> dict:
    args = parser(__doc__, geometry=None).parse_args(argv)
    torch.set_num_threads(1)  # one core
    profile = resolve_profile("h200-qwen3-30b-a3b")
    shape, costs = ModelShape.of("qwen3-30b-a3b"), Costs(profile)
    cases = [("duoserve", "oracle:0.9", 1, 512, 32), ("on-demand", "none", 1, 512, 32),
             ("duoserve", "oracle:0.9", 8, 512, 32), ("duoserve", "oracle:0.9", 1, 1, 64),
             ("lru", "none", 1, 1, 64), ("duoserve", "trained", 1, 1, 64), ("duoserve", "trained", 8, 1, 64),
             ("duoserve", "trained", 1, 512, 32)]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        trained = str(save_predictor(random_predictor(shape.num_layers, shape.num_experts, shape.top_k),
                                     Path(folder) / "predictor", {}, []))
        for policy, predictor, *sizes in cases:
            spec = trained if predictor == "trained" else predictor
            rows.append({**case(shape, costs, policy, spec, *sizes), "predictor": predictor})
            r = rows[-1]
            print(f"{r['policy']:>9} {r['predictor'][:10]:>10} B={r['batch_size']:<2} prompt {r['prompt_len']:>4} + "
                  f"{r['new_tokens']:>2}: {r['token_layers']:>8} token-layers in {r['seconds']:.1f} s "
                  f"= {r['seconds_per_million']:.1f} s per million (target: under 30), of which the predictor's "
                  f"scoring {r['predictor_seconds_per_million']:.1f}")
    result = {"shape": "qwen3-30b-a3b", "profile": "h200-qwen3-30b-a3b", "threads": 1, "cases": rows}
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
