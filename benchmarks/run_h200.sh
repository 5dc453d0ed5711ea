#!/usr/bin/env bash
# The H200 benchmarks other than the runtime's (benchmarks/runtime_h200.sh): tracing overhead, predictor latency,
# and the host cost of queueing one expert copy. Run from the repository root with duoserve importable.
set -euo pipefail
OUT=${OUT:-benchmarks/results}
python3 benchmarks/trace_overhead.py --shape qwen3-30b-a3b --device cuda --dtype bfloat16 \
    --out "$OUT/trace_overhead_h200.json"
python3 benchmarks/predictor_latency.py --device cuda --out "$OUT/predictor_latency_h200.json"
python3 benchmarks/runtime_copy_issue.py --groups 200 --out "$OUT/runtime_copy_issue_h200.json"
