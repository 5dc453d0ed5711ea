#!/usr/bin/env bash
# llama.cpp beside duoserve on the H200, same shapes: MODEL's config (mixtral-8x7b, the default, or qwen3-30b-a3b) with
# random bf16 weights, LAYERS decoder layers (default 4, as runtime_mixtral-8x7b_h200.json), prompt 512, B = 1 and 8.
#
# Source: llama.cpp as vendored in the PyPI sdist of llama-cpp-python 0.3.36 (vendor/llama.cpp, commit
# 0c1e57098bba43ac29e6e3b677cdceebdd22334f), packed without models/, docs/, media/, tests/, benches/ and the server
# into LLAMA_SRC (a .tar.gz that travels with the device call; nothing can be fetched there):
#   pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
#   tar czf .carry/llama.cpp.tar.gz -C llama_cpp_python-0.3.36/vendor --exclude=llama.cpp/models \
#       --exclude=llama.cpp/docs --exclude=llama.cpp/media --exclude=llama.cpp/tools/server \
#       --exclude=llama.cpp/tools/ui --exclude=llama.cpp/tests --exclude=llama.cpp/benches llama.cpp
# Steps: build llama-batched-bench with CUDA for sm_90; write the random checkpoint with a generated SentencePiece
# tokenizer (llama_cpp_checkpoint.py); convert it with llama.cpp's own convert_hf_to_gguf.py (bf16; through
# llama_cpp_convert.py, which reads the generated tokenizer as SentencePiece for every architecture); run
# llama-batched-bench with every layer on the GPU and (a) the experts of all layers on the CPU (--n-cpu-moe LAYERS,
# llama.cpp's offload for MoE models too large for the GPU) and (b) everything on the GPU; then duoserve's bench on
# the same shape (duoserve, cpu-experts, on-demand, all-resident, all-resident-compiled). Results:
#   $OUT/llama_cpp_<MODEL>_<GPU>.json (llama.cpp's jsonl rows, parsed) and $OUT/runtime_vs_llama_cpp_<GPU>.json (Mixtral;
#   runtime_vs_llama_cpp_qwen3-30b-a3b_<GPU>.json for Qwen), GPU h200, or h100 where an H100 ran it.
# DUOSERVE=0 stops after llama.cpp (the build takes minutes of a 10-minute call).
# The model's own routers run in llama.cpp (random weights make them degenerate: a few experts take every token),
# uniform random routing in duoserve's bench; at B=1 each token computes k experts either way.
set -euo pipefail
OUT=${OUT:-benchmarks/results}
LLAMA_SRC=${LLAMA_SRC:-.carry/llama.cpp.tar.gz}
MODEL=${MODEL:-mixtral-8x7b}
LAYERS=${LAYERS:-4}
PROMPT=${PROMPT:-512}
NEW=${NEW:-32}
WORK=${WORK:-/tmp/llama-work}
mkdir -p "$WORK" "$OUT"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 && echo h100 || echo h200)
if [ ! -x "$WORK/build/bin/llama-batched-bench" ]; then
    tar xzf "$LLAMA_SRC" -C "$WORK"
    start=$(date +%s)
    cmake -S "$WORK/llama.cpp" -B "$WORK/build" -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF > "$OUT/llama_cpp_cmake.log" 2>&1
    cmake --build "$WORK/build" -j "$(nproc)" --target llama-batched-bench > "$OUT/llama_cpp_build.log" 2>&1
    echo "llama.cpp built in $(( $(date +%s) - start )) s"
fi
case $MODEL in
    mixtral-8x7b) cache=(--gpu-expert-budget 705MB); vs="$OUT/runtime_vs_llama_cpp_$GPU.json" ;;  # a 2-expert cache
    qwen3-30b-a3b) cache=(); vs="$OUT/runtime_vs_llama_cpp_${MODEL}_$GPU.json" ;;
    *) echo "unknown MODEL $MODEL" >&2; exit 2 ;;
esac
gguf="$WORK/$MODEL-$LAYERS.gguf"
if [ ! -f "$gguf" ]; then
    python3 benchmarks/llama_cpp_checkpoint.py "$MODEL" "$WORK/ckpt" --layers "$LAYERS" --device cuda
    python3 benchmarks/llama_cpp_convert.py "$WORK/llama.cpp" "$WORK/ckpt" --outtype bf16 --outfile "$gguf" \
        > "$OUT/llama_cpp_convert.log" 2>&1
    rm -rf "$WORK/ckpt"
fi
ctx=$(( (PROMPT + NEW) * 8 ))
run() {  # $1: placement name, rest: llama.cpp placement flags
    local name=$1; shift
    "$WORK/build/bin/llama-batched-bench" -m "$gguf" -ngl 99 "$@" -c "$ctx" -b 2048 -ub 512 \
        -npp "$PROMPT" -ntg "$NEW" -npl 1,8 --output-format jsonl 2> "$OUT/llama_cpp_$name.log" \
        | sed -n "s/^{/{\"placement\": \"$name\", /p"
}
{ run cpu-moe --n-cpu-moe "$LAYERS"; run all-gpu; } > "$WORK/rows.jsonl"
python3 - "$WORK/rows.jsonl" "$OUT/llama_cpp_${MODEL}_$GPU.json" "$LAYERS" "$MODEL" "$0" <<'PY'
import json, sys
from pathlib import Path
from duoserve.bench.results import write_result
rows = [json.loads(line) for line in open(sys.argv[1])]
out, layers, model = Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
sys.argv = sys.argv[5:]  # the provenance's command: this script
runs = [{"placement": r["placement"], "batch_size": r["pl"], "prompt_len": r["pp"], "new_tokens": r["tg"],
         "ttft_s": r["t_pp"], "tpot_ms": r["t_tg"] / r["tg"] * 1e3, "raw": r} for r in rows]
write_result(out, {"peer": "llama.cpp llama-batched-bench (CUDA, sm_90), bf16 GGUF from convert_hf_to_gguf.py",
                           "source": "llama-cpp-python 0.3.36 sdist, vendor/llama.cpp 0c1e570",
                           "model": f"{model} shape, random weights", "layers": layers,
                           "note": "ttft_s = t_pp (prefill of B prompts); tpot_ms = t_tg / new tokens (one step "
                                   "of all B sequences)", "runs": runs})
for r in runs:
    print(f"llama.cpp {r['placement']:8s} B={r['batch_size']}: TTFT {r['ttft_s']:.3f} s, TPOT {r['tpot_ms']:.2f} ms")
PY
[ "${DUOSERVE:-1}" = 0 ] && exit  # llama.cpp only (DUOSERVE=0): the duoserve side in another call
shapes=$(mktemp -d)
python3 -m duoserve.bench.shapes "$MODEL" "$shapes/$MODEL"
python3 -m duoserve.cli.run bench --model "$shapes/$MODEL" --config-only --layers "$LAYERS" --routing random \
    --prompt-len "$PROMPT" --new-tokens "$NEW" --baseline-new-tokens 8 --batch-size 1 --batch-size 8 \
    "${cache[@]}" --predictor oracle:1 --policy duoserve --policy cpu-experts --policy on-demand \
    --policy all-resident --policy all-resident-compiled --out "$vs"
