#!/usr/bin/env bash
# The GPU benchmarks whose results are committed as benchmarks/results/*_h200.json, exactly as run
# on the H200 machine (python3 there has torch and transformers; PYTHONPATH holds this repo).
set -euo pipefail
OUT=${OUT:-benchmarks/results}
python3 benchmarks/trace_overhead.py --shape qwen3-30b-a3b --device cuda --dtype bfloat16 \
    --out "$OUT/trace_overhead_h200.json"
python3 benchmarks/predictor_latency.py --device cuda --out "$OUT/predictor_latency_h200.json"
