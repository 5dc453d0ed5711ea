#!/usr/bin/env bash
# The offload runtime on the H200, exactly as run for benchmarks/results/runtime_*_h200.json:
# real model configs (Qwen3-30B-A3B, Mixtral-8x7B) with random bf16 weights, fewer layers than the
# real models so that two host copies of the experts (pinned packed, pageable per module) fit in
# the machine's 128 GiB, uniform random top-k routing (random weights make routers degenerate).
# The defaults are the committed runs' settings (prompt 512, 128 new tokens, B=1 and 8). One call of the device's
# 10 minutes fits Mixtral (6 min) but one Qwen batch size only (3 and 5.5 min); SUFFIX names the result file:
#   MODELS=mixtral-8x7b bash benchmarks/runtime_h200.sh                           -> runtime_mixtral-8x7b_h200.json
#   SUFFIX=_b1 BATCHES=1 MODELS=qwen3-30b-a3b bash benchmarks/runtime_h200.sh     -> runtime_qwen3-30b-a3b_b1_h200.json
#   SUFFIX=_b8 BATCHES=8 MODELS=qwen3-30b-a3b bash benchmarks/runtime_h200.sh     -> runtime_qwen3-30b-a3b_b8_h200.json
# B1_REPEATS=6 bash benchmarks/runtime_h200.sh runs only Qwen's B=1 duoserve-vs-bound comparison, over that many
# rounds (benchmarks/results/runtime_qwen3-30b-a3b_b1_repeats_h200.json; SUFFIX is added to the name): host-bound
# ratios drift between rounds. QWEN_PREDICTORS=oracle:1 B1_REPEATS=10 SUFFIX=_oracle pairs only the all-resident bound
# and the oracle, so each round's two runs are seconds apart (runtime_qwen3-30b-a3b_b1_repeats_oracle_h200.json); the
# committed 915a69a rounds ran as four such runs of three rounds each, in one device command:
#   for i in 1 2 3 4; do QWEN_PREDICTORS=oracle:1 B1_REPEATS=3 SUFFIX=_oracle$i bash benchmarks/runtime_h200.sh; done
# and python benchmarks/runtime_rounds.py FILES... pools their rounds.
# PREDICTOR_COST=1 bash benchmarks/runtime_h200.sh runs Qwen with a predictor artifact of the paper's widths and random
# weights (a trained predictor's device cost, at chance accuracy on random routing) beside none and oracle:1, B=1 and 8
# (benchmarks/results/runtime_qwen3-30b-a3b_predictor_cost_h200.json, run with NEW_TOKENS=64).
# python3 there has torch and transformers; PYTHONPATH holds this repo.
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
python3 - "$SHAPES" <<'PY'
import sys
sys.path.insert(0, "benchmarks")
from common import shape_config
for name in ("qwen3-30b-a3b", "mixtral-8x7b"):
    shape_config(name).save_pretrained(f"{sys.argv[1]}/{name}")
PY
args=(--config-only --routing random --prompt-len 512 --new-tokens "$NEW_TOKENS" --repeats "${REPEATS:-2}"
      --baseline-new-tokens "$BASELINE_TOKENS" --policy duoserve --policy on-demand --policy accelerate
      --policy lru --policy full-layer --policy all-resident)
for b in $BATCHES; do args+=(--batch-size "$b"); done
bench() { python3 -c 'from duoserve.cli import run_app; run_app()' bench "$@"; }
if [ -n "${B1_REPEATS:-}" ]; then
    extra=(); for p in $QWEN_PREDICTORS; do extra+=(--predictor "$p"); done
    bench --model "$SHAPES/qwen3-30b-a3b" --config-only --layers "$QWEN_LAYERS" --routing random --prompt-len 512 \
        --new-tokens "$NEW_TOKENS" --repeats "$B1_REPEATS" --policy duoserve --policy all-resident --batch-size 1 \
        "${extra[@]}" --out "$OUT/runtime_qwen3-30b-a3b_b1_repeats${SUFFIX:-}_h200.json"
    exit
fi
if [ -n "${PREDICTOR_COST:-}" ]; then
    predictor=$SHAPES/random-weights-predictor
    python3 - "$predictor" "$QWEN_LAYERS" <<'PY'
import sys
sys.path.insert(0, "benchmarks")
from predictor_latency import random_predictor
from duoserve.predictor.artifact import save_predictor
from duoserve.predictor.model import PAPER_WIDTHS
save_predictor(random_predictor(int(sys.argv[2]), 128, 8, PAPER_WIDTHS), sys.argv[1],
               {"note": "random weights: a trained predictor's cost in the runtime, not its accuracy"}, [])
PY
    bench --model "$SHAPES/qwen3-30b-a3b" --config-only --layers "$QWEN_LAYERS" --routing random --prompt-len 512 \
        --new-tokens "$NEW_TOKENS" --repeats "${REPEATS:-2}" --policy duoserve --policy all-resident --batch-size 1 \
        --batch-size 8 --predictor "$predictor" --predictor none --predictor oracle:1 \
        --out "$OUT/runtime_qwen3-30b-a3b_predictor_cost_h200.json"
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
