#!/usr/bin/env bash
# The decode step's step graphs (duoserve/runtime/stepgraph.py) on the H200: Qwen3-30B-A3B shape, random bf16
# weights, uniform random routing, prompt 512, duoserve with oracle:1, B=1 and 8. One device call each:
#   PART=ab    16 layers, on-demand beside duoserve, with and without step graphs (two processes, one machine)
#              -> runtime_stepgraphs_qwen3-30b-a3b_h200.json, runtime_stepgraphs_off_qwen3-30b-a3b_h200.json
#   PART=full  all 48 layers, bf16 experts (58 GB), then fp8 (29 GB), then int4 (16 GB), a process each (FORMATS
#              picks among model fp8 int4; 128 GiB of host memory holds one pinned copy at a time: two in one
#              process were killed for memory); BATCHES (default "1 8") and NEW_TOKENS (default 24) narrow it
#              -> runtime_full_stepgraphs{,_fp8,_int4}_qwen3-30b-a3b_h200.json
# Run from the repository root with duoserve importable; DUOSERVE_COMMIT names the commit of a copied tree.
set -euo pipefail
OUT=${OUT:-benchmarks/results}
SHAPES=$(mktemp -d)
python3 -m duoserve.bench.shapes qwen3-30b-a3b "$SHAPES/q" >/dev/null
bench() { python3 -m duoserve.cli.run bench --config-only --routing random --model "$SHAPES/q" --prompt-len 512 \
          --predictor oracle:1 $(for b in ${BATCHES:-1 8}; do echo --batch-size "$b"; done) "$@"; }
case "${PART:?set PART to ab or full}" in
ab)
    bench --layers 16 --new-tokens 32 --policy duoserve --policy on-demand --step-graphs \
        --out "$OUT/runtime_stepgraphs_qwen3-30b-a3b_h200.json"
    bench --layers 16 --new-tokens 32 --policy duoserve --policy on-demand --no-step-graphs \
        --out "$OUT/runtime_stepgraphs_off_qwen3-30b-a3b_h200.json" ;;
full)
    for fmt in ${FORMATS:-model fp8 int4}; do
        suffix=${fmt/#model/}
        bench --new-tokens "${NEW_TOKENS:-24}" --policy duoserve --expert-dtype $fmt \
            --out "$OUT/runtime_full_stepgraphs${suffix:+_$suffix}_qwen3-30b-a3b_h200.json"
    done ;;
*) echo "unknown PART $PART" >&2; exit 2 ;;
esac
