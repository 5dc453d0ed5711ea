#!/usr/bin/env bash
# The offload runtime at the models' real depth on the H200 (Qwen3-30B-A3B: 48 layers, 58 GB of bf16 experts;
# Mixtral-8x7B: 32 layers, 90 GB), random weights, uniform random routing, one pinned host copy per process
# (128 GiB of host memory holds one). Each PART is one device call of at most 10 minutes; results are written
# after every run, so a stopped part keeps what it measured ("complete": false):
#   PART=qwen        duoserve (oracle:1), on-demand, lru and both all-resident references; batch 1, 8, 4, 16 at
#                    prompt 512, then prompt 128 and 2048 at B=1 (--grid axes)
#                    -> runtime_full_qwen3-30b-a3b_h200.json
#   PART=accelerate  Accelerate's pinned offload and the eager all-resident reference, B=1 and 8, prompt 512, for
#                    Qwen (bf16) and Mixtral (bf16: its 90 GB per-module copy is the process's only one); MODELS
#                    picks one of them (default both, in that order)
#                    -> runtime_full_accelerate_{qwen3-30b-a3b,mixtral-8x7b}_h200.json
#   PART=mixtral     Mixtral with experts stored fp8 (45 GB; bf16 and a second copy would not fit beside it):
#                    duoserve (oracle:1), on-demand, lru and both all-resident references (put back dequantized:
#                    90 GB, on an H200 only; an 80 GB card's result lists them under "skipped"), B=1 and 8, prompt
#                    512, a 2-expert cache as on-demand holds -> runtime_full_mixtral-8x7b_h200.json
#   PART=qwen-fp8    Qwen with experts stored fp8 (29 GB): duoserve (oracle:1) and on-demand, B=1 and 8, prompt
#                    512, beside the bf16 accelerate part: the precision in which the TTFT target can be tried
#                    -> runtime_full_fp8_qwen3-30b-a3b_h200.json
#   PART=dtypes      issue 27's ratios: duoserve (oracle:1) on Qwen's experts stored bf16 beside each quantized format
#                    in one process (FORMATS, default "int4 fp8": one process each, bf16 + int4 = 58 + 15 GB, bf16 + fp8
#                    = 58 + 29 GB of pinned host memory; all three in one process were killed on a 125 GB H200 host),
#                    B=1 and 8, prompt 512, 16 tokens, two rounds interleaved (REPEATS); BUDGET gives both stores'
#                    caches that --gpu-expert-budget (equal GPU memory), SUFFIX goes into the file's name
#                    -> runtime_full_dtypes_{int4,fp8}${SUFFIX}_qwen3-30b-a3b_h200.json
#   PART=int4-cache  int4 experts' prefill against the cache's size: duoserve (oracle:1) on Qwen's experts stored int4
#                    with a cache of 16 slots (2k) and of 32 (288MiB of bf16 rows; SLOTS lists others), one process each,
#                    B=1 and 8, prompt 512, 16 tokens, two rounds (the quantized prefill's groups take the whole cache;
#                    each costs the host about as much as its int4 copies take)
#                    -> runtime_full_int4_cache_{16,32}_qwen3-30b-a3b_h200.json
#   PART=ttft-pair   the TTFT target's two sides in one device call, one process each: duoserve (oracle:1) on fp8
#                    experts (16 tokens) and Accelerate's pinned offload (bf16, 8 tokens), B=1 and 8, prompt 512
#                    -> runtime_full_pair_{fp8,accelerate}_qwen3-30b-a3b_h200.json
#   PART=mixtral-pair  issue 21's ratios on Mixtral at full depth in one device call, one process each: duoserve
#                    (oracle:1, a 2-expert cache) on fp8 experts (45 GB, 16 tokens) and Accelerate's pinned offload
#                    of the bf16 model (90 GB, 4 tokens), B=1 and 8, prompt 512
#                    -> runtime_full_pair_{fp8,accelerate}_mixtral-8x7b_h200.json
#   PART=pageable    Accelerate's pageable offload (as from_pretrained(device_map=...) leaves it) at full depth,
#                    Qwen then Mixtral, B=1 and 8, prompt 512, 3 tokens (seconds a token)
#                    -> runtime_full_pageable_{qwen3-30b-a3b,mixtral-8x7b}_h200.json
#   PART=cpu         Qwen's routed experts computed on the host CPU (cpu-experts, in place in the packed store)
#                    beside duoserve and on-demand on that one copy, B=1 and 8, prompt 512 (llama.cpp itself on
#                    Qwen's shape, 16 layers: llama_cpp_h200.sh) -> runtime_full_cpu_qwen3-30b-a3b_h200.json
# python benchmarks/runtime_sweep.py merges a model's files (ratios against the accelerate part's runs come from
# a second process on the same machine) and draws TPOT versus batch and TTFT versus prompt length.
set -euo pipefail
OUT=${OUT:-benchmarks/results}
NEW_TOKENS=${NEW_TOKENS:-32}
SHAPES=$(mktemp -d)
for name in qwen3-30b-a3b mixtral-8x7b; do python3 -m duoserve.bench.shapes "$name" "$SHAPES/$name"; done
bench() { python3 -m duoserve.cli.run bench --config-only --routing random "$@"; }
case "${PART:?set PART to qwen, qwen-fp8, dtypes, int4-cache, accelerate, mixtral, ttft-pair, mixtral-pair, pageable or cpu}" in
qwen)
    bench --model "$SHAPES/qwen3-30b-a3b" --grid axes --batch-size 1 --batch-size 8 --batch-size 4 --batch-size 16 \
        --prompt-len 512 --prompt-len 128 --prompt-len 2048 --new-tokens "$NEW_TOKENS" --baseline-new-tokens 8 \
        --predictor oracle:1 --policy duoserve --policy on-demand --policy lru --policy all-resident \
        --policy all-resident-compiled --out "$OUT/runtime_full_qwen3-30b-a3b_h200.json" ;;
accelerate)
    for model in ${MODELS:-qwen3-30b-a3b mixtral-8x7b}; do
        bench --model "$SHAPES/$model" --batch-size 1 --batch-size 8 --prompt-len 512 --new-tokens 8 \
            --policy accelerate-pinned --policy all-resident --out "$OUT/runtime_full_accelerate_${model}_h200.json"
    done ;;
mixtral)
    bench --model "$SHAPES/mixtral-8x7b" --expert-dtype fp8 --gpu-expert-budget 705MB --batch-size 1 --batch-size 8 \
        --prompt-len 512 --new-tokens "$NEW_TOKENS" --baseline-new-tokens 8 --predictor oracle:1 --policy duoserve \
        --policy on-demand --policy lru --policy all-resident --policy all-resident-compiled \
        --out "$OUT/runtime_full_mixtral-8x7b_h200.json" ;;
qwen-fp8)
    bench --model "$SHAPES/qwen3-30b-a3b" --expert-dtype fp8 --batch-size 1 --batch-size 8 --prompt-len 512 \
        --new-tokens "$NEW_TOKENS" --baseline-new-tokens 8 --predictor oracle:1 --policy duoserve --policy on-demand \
        --policy all-resident-compiled --out "$OUT/runtime_full_fp8_qwen3-30b-a3b_h200.json" ;;
dtypes)
    for fmt in ${FORMATS:-int4 fp8}; do
        bench --model "$SHAPES/qwen3-30b-a3b" --expert-dtype model --expert-dtype "$fmt" --batch-size 1 --batch-size 8 \
            --prompt-len 512 --new-tokens 16 --repeats "${REPEATS:-2}" --predictor oracle:1 --policy duoserve \
            ${BUDGET:+--gpu-expert-budget "$BUDGET"} --out "$OUT/runtime_full_dtypes_${fmt}${SUFFIX:-}_qwen3-30b-a3b_h200.json"
    done ;;
int4-cache)
    for slots in ${SLOTS:-16 32}; do
        bench --model "$SHAPES/qwen3-30b-a3b" --expert-dtype int4 --gpu-expert-budget "$(( slots * 9 ))MiB" \
            --batch-size 1 --batch-size 8 --prompt-len 512 --new-tokens 16 --repeats "${REPEATS:-2}" \
            --predictor oracle:1 --policy duoserve --out "$OUT/runtime_full_int4_cache_${slots}_qwen3-30b-a3b_h200.json"
    done ;;
ttft-pair)
    bench --model "$SHAPES/qwen3-30b-a3b" --expert-dtype fp8 --batch-size 1 --batch-size 8 --prompt-len 512 \
        --new-tokens 16 --predictor oracle:1 --policy duoserve --out "$OUT/runtime_full_pair_fp8_qwen3-30b-a3b_h200.json"
    bench --model "$SHAPES/qwen3-30b-a3b" --batch-size 1 --batch-size 8 --prompt-len 512 --new-tokens 8 \
        --policy accelerate-pinned --out "$OUT/runtime_full_pair_accelerate_qwen3-30b-a3b_h200.json" ;;
mixtral-pair)
    bench --model "$SHAPES/mixtral-8x7b" --expert-dtype fp8 --gpu-expert-budget 705MB --batch-size 1 --batch-size 8 \
        --prompt-len 512 --new-tokens 16 --predictor oracle:1 --policy duoserve \
        --out "$OUT/runtime_full_pair_fp8_mixtral-8x7b_h200.json"
    bench --model "$SHAPES/mixtral-8x7b" --batch-size 1 --batch-size 8 --prompt-len 512 --new-tokens 4 \
        --policy accelerate-pinned --out "$OUT/runtime_full_pair_accelerate_mixtral-8x7b_h200.json" ;;
pageable)
    for model in ${MODELS:-qwen3-30b-a3b mixtral-8x7b}; do
        bench --model "$SHAPES/$model" --batch-size 1 --batch-size 8 --prompt-len 512 --new-tokens 3 \
            --policy accelerate --out "$OUT/runtime_full_pageable_${model}_h200.json"
    done ;;
cpu)
    bench --model "$SHAPES/qwen3-30b-a3b" --batch-size 1 --batch-size 8 --prompt-len 512 --new-tokens "$NEW_TOKENS" \
        --baseline-new-tokens 8 --predictor oracle:1 --policy duoserve --policy on-demand --policy cpu-experts \
        --out "$OUT/runtime_full_cpu_qwen3-30b-a3b_h200.json" ;;
*) echo "unknown PART $PART" >&2; exit 2 ;;
esac
