#!/usr/bin/env bash
# The offload runtime on the H200: `duoserve-run bench` on real model configs (Qwen3-30B-A3B, Mixtral-8x7B) with
# random bf16 weights, fewer layers than the real models so that two host copies of the experts (pinned packed,
# pageable per module) fit in the machine's 128 GiB, and uniform random top-k routing (random weights make routers
# degenerate). Defaults: prompt 512, 128 new tokens, B=1 and 8, two interleaved rounds. One device call of 10
# minutes fits Mixtral (6 min) or one Qwen batch size (3 and 5.5 min); SUFFIX names the result file:
#   MODELS=mixtral-8x7b bash benchmarks/runtime_h200.sh                           -> runtime_mixtral-8x7b_h200.json
#   SUFFIX=_b1 BATCHES=1 MODELS=qwen3-30b-a3b bash benchmarks/runtime_h200.sh     -> runtime_qwen3-30b-a3b_b1_h200.json
#   SUFFIX=_b8 BATCHES=8 MODELS=qwen3-30b-a3b bash benchmarks/runtime_h200.sh     -> runtime_qwen3-30b-a3b_b8_h200.json
# B1_REPEATS=N: only Qwen's B=1 duoserve-vs-bound comparison, over N rounds (host-bound ratios drift between
#   rounds; QWEN_PREDICTORS=oracle:1 pairs just the bound and the oracle) -> runtime_qwen3-30b-a3b_b1_repeats_h200.json;
#   python benchmarks/runtime_rounds.py FILES pools the rounds of one or more such files.
# PREDICTOR_COST=1: Qwen with a predictor artifact of the paper's widths and random weights (a trained predictor's
#   device cost, at chance accuracy on random routing) beside none and oracle:1, B=1 and 8
#   -> runtime_qwen3-30b-a3b_predictor_cost${SUFFIX}_h200.json; PREDICTOR_FAMILY (default paper) its family
#   (hybrid and residual read the next-gate: the model's routers on the run's own hidden states).
# `per-module` is the engine's imitation of a per-module offload hook (named `accelerate` in the committed results,
# made before Accelerate's own hooks became the `accelerate` policies); `accelerate-pinned` is Accelerate's own
# offload from pinned memory (its pageable form, `--policy accelerate`, moves every expert each call at ~6 GB/s:
# seconds a token at 16 layers). Needs `accelerate` on the machine (carry its wheel).
# Run from the repository root with duoserve importable (PYTHONPATH=. or installed).
set -euo pipefail
OUT=${OUT:-benchmarks/results}
QWEN_LAYERS=${QWEN_LAYERS:-16}
MIXTRAL_LAYERS=${MIXTRAL_LAYERS:-4}
NEW_TOKENS=${NEW_TOKENS:-128}
BASELINE_TOKENS=${BASELINE_TOKENS:-16}
BATCHES=${BATCHES:-"1 8"}
QWEN_PREDICTORS=${QWEN_PREDICTORS:-"oracle:1 oracle:0.5 none"}
MIXTRAL_PREDICTORS=${MIXTRAL_PREDICTORS:-"oracle:1 none"}
# Mixtral's cache: top-k = 2 experts (the paper's size; on-demand holds as many), not the default 2k
MIXTRAL_BUDGET=${MIXTRAL_BUDGET:-705MB}
MODELS=${MODELS:-"qwen3-30b-a3b mixtral-8x7b"}
SHAPES=$(mktemp -d)
for name in qwen3-30b-a3b mixtral-8x7b; do python3 -m duoserve.bench.shapes "$name" "$SHAPES/$name"; done
args=(--config-only --routing random --prompt-len 512 --new-tokens "$NEW_TOKENS" --repeats "${REPEATS:-2}"
      --baseline-new-tokens "$BASELINE_TOKENS" --policy duoserve --policy on-demand --policy per-module --policy accelerate-pinned
      --policy lru --policy full-layer --policy all-resident --policy all-resident-compiled)
for b in $BATCHES; do args+=(--batch-size "$b"); done
bench() { python3 -m duoserve.cli.run bench "$@"; }
if [ -n "${B1_REPEATS:-}" ]; then
    extra=(); for p in $QWEN_PREDICTORS; do extra+=(--predictor "$p"); done
    bench --model "$SHAPES/qwen3-30b-a3b" --config-only --layers "$QWEN_LAYERS" --routing random --prompt-len 512 \
        --new-tokens "$NEW_TOKENS" --repeats "$B1_REPEATS" --policy duoserve --policy all-resident --batch-size 1 \
        "${extra[@]}" --out "$OUT/runtime_qwen3-30b-a3b_b1_repeats${SUFFIX:-}_h200.json"
    exit
fi
if [ -n "${PREDICTOR_COST:-}" ]; then
    predictor=$SHAPES/random-weights-predictor
    python3 - "$predictor" "$QWEN_LAYERS" "${PREDICTOR_FAMILY:-paper}" <<'PY'
import sys
from duoserve.bench.shapes import random_predictor
from duoserve.predictor.artifact import save_predictor
save_predictor(random_predictor(int(sys.argv[2]), 128, 8, family=sys.argv[3]), sys.argv[1],
               {"note": "random weights: a trained predictor's cost in the runtime, not its accuracy"}, [])
PY
    bench --model "$SHAPES/qwen3-30b-a3b" --config-only --layers "$QWEN_LAYERS" --routing random --prompt-len 512 \
        --new-tokens "$NEW_TOKENS" --repeats "${REPEATS:-2}" --policy duoserve --policy all-resident --batch-size 1 \
        --batch-size 8 --predictor "$predictor" --predictor none --predictor oracle:1 \
        --out "$OUT/runtime_qwen3-30b-a3b_predictor_cost${SUFFIX:-}_h200.json"
    exit
fi
for model in $MODELS; do
    if [ "$model" = qwen3-30b-a3b ]; then
        extra=(--layers "$QWEN_LAYERS"); for p in $QWEN_PREDICTORS; do extra+=(--predictor "$p"); done
    else
        extra=(--layers "$MIXTRAL_LAYERS" --gpu-expert-budget "$MIXTRAL_BUDGET")
        for p in $MIXTRAL_PREDICTORS; do extra+=(--predictor "$p"); done
    fi
    bench --model "$SHAPES/$model" "${args[@]}" "${extra[@]}" --out "$OUT/runtime_${model}${SUFFIX:-}_h200.json"
done
