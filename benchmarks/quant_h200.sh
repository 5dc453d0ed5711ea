#!/usr/bin/env bash
# Quantized experts on the H200: `duoserve-run bench` with the experts stored as the model's bf16, fp8 and int4 in
# one run (so every ratio is from one process), random bf16 weights, uniform random top-k routing, prompt 512,
# 64 new tokens (NEW_TOKENS), B=1 and 8 (BATCHES); duoserve (oracle:1 and no predictor), on-demand and all-resident.
#   bash benchmarks/quant_h200.sh qwen3-30b-a3b      # 16 of 48 layers  -> runtime_quant_qwen3-30b-a3b_h200.json
#   bash benchmarks/quant_h200.sh mixtral-8x7b       # 4 of 32 layers, cache of top-k = 2 experts (705MB)
# Run from the repository root with duoserve importable (PYTHONPATH=. or installed).
set -euo pipefail
OUT=${OUT:-benchmarks/results}
model=$1
SHAPES=$(mktemp -d)
python3 -m duoserve.bench.shapes "$model" "$SHAPES/$model"
case $model in
    qwen3-30b-a3b) extra=(--layers "${LAYERS:-16}") ;;
    mixtral-8x7b) extra=(--layers "${LAYERS:-4}" --gpu-expert-budget 705MB) ;;
    *) echo "unknown model $model" >&2; exit 2 ;;
esac
python3 -m duoserve.cli.run bench --model "$SHAPES/$model" --config-only "${extra[@]}" --routing random \
    --prompt-len 512 --new-tokens "${NEW_TOKENS:-64}" --policy duoserve --policy on-demand --policy all-resident \
    --predictor oracle:1 --predictor none --expert-dtype model --expert-dtype fp8 --expert-dtype int4 \
    $(for b in ${BATCHES:-1 8}; do echo --batch-size "$b"; done) --out "$OUT/runtime_quant_${model}_h200.json"
