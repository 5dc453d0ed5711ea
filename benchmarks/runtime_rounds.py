"""Decode over many rounds: duoserve against its all-resident bound, pooled over one or more bench results.

    python benchmarks/runtime_rounds.py benchmarks/results/runtime_qwen3-30b-a3b_b1_repeats_h200.json

Host-bound decode ratios drift with the machine's pace from round to round, so one round says little. Per
(batch size, predictor), over every round of the files given: the all-resident and duoserve time per token
(range and median), the ratio to the bound (range, median, rounds within the limit), "best": the fastest duoserve run
over the lowest bound, the engine's host time per decode layer by section (``host_ms`` over the decode steps
and MoE layers; prefill is included, as the engine counts it) and the compute stream's wait for copies per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

from duoserve.bench.targets import BOUND_LIMIT


def _span(values: list[float], digits: int = 1) -> str:
    return f"{min(values):.{digits}f}-{max(values):.{digits}f} (median {statistics.median(values):.{digits}f})"


def summarize(results: list[dict]) -> list[str]:
    """One block of lines per (batch size, predictor) of duoserve decode in ``results``."""
    bound, runs = defaultdict(list), defaultdict(list)  # batch -> all-resident runs; (batch, predictor) -> duoserve
    for result in results:
        layers = result["geometry"]["moe_layers"]
        for run in result["runs"]:
            if run["policy"] == "all-resident":
                bound[run["batch_size"]].append(run)
            elif run["policy"] == "duoserve":
                runs[run["batch_size"], run["predictor"]].append((run, layers))
    lines = []
    for (batch, predictor), group in sorted(runs.items(), key=str):
        ratios = [r["tpot_vs_bound"] for r, _ in group]
        resident = [r["tpot_ms"] for r in bound[batch]]
        if not resident:
            raise SystemExit(f"no all-resident run at B={batch}: the bound is missing")
        best = min(r["tpot_ms"] for r, _ in group) / min(r["decode_bound_ms"] for r, _ in group)
        per_layer = defaultdict(list)  # section -> us per decode layer, one per run
        for r, layers in group:
            scale = 1e3 / (r["new_tokens"] - 1) / layers
            for name, ms in r["host_ms"].items():
                per_layer[name].append(ms * scale)
            per_layer["all sections"].append(sum(r["host_ms"].values()) * scale)
        within = sum(x <= BOUND_LIMIT for x in ratios)
        sections = ", ".join(f"{name} {min(v):.0f}-{max(v):.0f}" for name, v in per_layer.items())
        waits = [r["stall_ms"] / (r["new_tokens"] - 1) for r, _ in group]
        lines += [f"B={batch} {predictor}: {len(group)} rounds",
                  f"  all-resident ms {_span(resident)}; duoserve ms {_span([r['tpot_ms'] for r, _ in group])}",
                  f"  x bound {_span(ratios, 2)}, {within} of {len(ratios)} within {BOUND_LIMIT}x; best {best:.2f}x",
                  f"  host us per decode layer: {sections}",
                  f"  wait for copies ms per step: {_span(waits, 2)}"]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="bench result JSON files (or files of pooled \"parts\"), pooled")
    results = []
    for path in ap.parse_args().results:
        with open(path) as f:
            result = json.load(f)
        results.extend(result.get("parts", [result]))
    print("\n".join(summarize(results)))


if __name__ == "__main__":
    main()
