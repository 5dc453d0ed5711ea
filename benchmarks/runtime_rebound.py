"""A runtime bench result's bounds recomputed at the copy rate its own fetch-bound runs reached.

    python benchmarks/runtime_rebound.py benchmarks/results/runtime_mixtral-8x7b_h200.json

The bench measures pinned bandwidth with a separate copy loop; the full-layer policy moves bytes
back to back at PCIe speed, so its decode rate (bytes per step / time per token) is the stricter
figure. Prints every duoserve run's prefill and decode ratio at both rates.
"""

from __future__ import annotations

import argparse
import copy
import json

from duoserve.runtime.bench import add_bounds


def achieved_gbps(runs: list[dict]) -> float:
    """The best decode copy rate of the result's full-layer runs, GB/s."""
    rates = [r["bytes_h2d"]["decode"] / (r["new_tokens"] - 1) / (r["tpot_ms"] / 1e3) / 1e9
             for r in runs if r["policy"] == "full-layer"]
    if not rates:
        raise SystemExit("the result has no full-layer run to take a copy rate from")
    return max(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result")
    result = json.load(open(ap.parse_args().result))
    measured, achieved = result["bandwidth"]["pinned_gbps"], achieved_gbps(result["runs"])
    strict = copy.deepcopy(result["runs"])
    add_bounds(strict, achieved, None)
    print(f"pinned bandwidth: measured {measured:.1f} GB/s, reached by full-layer {achieved:.1f} GB/s")
    print("predictor   B  round  prefill x bound (measured / reached)  decode x bound (measured / reached)")
    for run, tight in zip(result["runs"], strict):
        if run["policy"] == "duoserve":
            print(f"{run['predictor']:10s} {run['batch_size']:2d} {run['round']:5d}  "
                  f"{run['ttft_vs_bound']:.2f} / {tight['ttft_vs_bound']:.2f}{'':22s}"
                  f"{run['tpot_vs_bound']:.2f} / {tight['tpot_vs_bound']:.2f}")


if __name__ == "__main__":
    main()
