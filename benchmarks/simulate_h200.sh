#!/usr/bin/env bash
# The offload simulator's H200 inputs, and the engine measured on what the simulator replays (PART: any of
# profiles, qwen, qwen-budget, embedded, slots, space-separated; all but slots by default; each a device call of a
# few minutes):
#   profiles     device profiles (duoserve-run profile) of Qwen3-30B-A3B's shape and of the embedded model
#                -> duoserve/bench/profiles/h200-{qwen3-30b-a3b,embedded}.json (shipped with the package)
#   qwen         the engine on Qwen3-30B-A3B (16 of its 48 layers, random bf16 weights, uniform random routing):
#                duoserve with oracle:0, 0.5, 0.9 and 1, on-demand, lru, full-layer and per-module at the default
#                cache; B = 1 and 8, prompt 512, 32 new tokens (about 8 minutes)
#                -> benchmarks/results/simulate_bench_qwen3-30b-a3b_h200.json
#   qwen-waiting, qwen-recall  the two halves of qwen, each about 4 minutes, so that one device call holds the
#                profiles and a half: on-demand, lru, per-module and duoserve oracle:1; duoserve oracle:0, 0.5 and
#                0.9 and full-layer (same file name: run each half with its own OUT and PROFILES, then validate
#                each folder with simulate_validation.py --results DIR --profiles DIR)
#   qwen-budget  duoserve (oracle:0.9) and lru at a 2 GB cache, the same shape and sizes
#                -> benchmarks/results/simulate_bench_qwen3-30b-a3b_2gb_h200.json
#   embedded     the embedded model on its own trace replayed with a history-only predictor trained on it (make demo's
#                out/traces and PREDICTOR from duoserve-train fit out/traces --family paper --epochs 4 --out DIR,
#                carried: make demo's own is a next-gate family, whose guesses the engine would take from the bench's
#                prompts, not the trace's tokens), in bf16 as its profile: duoserve (trained, none),
#                on-demand, lru; B = 1 and 8, prompt 64, 16 new tokens -> benchmarks/results/simulate_bench_embedded_h200.json
#   replay-profiles  device profiles of Qwen3-30B-A3B's widths at the larger substrate's and FLAME-MoE's geometry
#                (``duoserve.bench.shapes.REPLAY_SHAPES``) -> duoserve/bench/profiles/h200-qwen3-30b-a3b-{substrate,flame}.json
#   substrate, flame  the engine replaying a real routing trace through a config-only model of that shape, with a
#                paper-family predictor fitted on the trace (carried): the substrate's committed trace
#                (SUBSTRATE_PREDICTOR from duoserve-train fit benchmarks/data/substrate/traces --family paper --epochs 3 --out DIR)
#                and FLAME-MoE's 64-token sequences (FLAME_TRACE from python benchmarks/flame_moe.py --import-to DIR,
#                FLAME_PREDICTOR from duoserve-train fit FLAME_TRACE --family paper --epochs 5 --out DIR): duoserve (trained, none),
#                on-demand, lru; B = 1 and 8, prompt 64, 16 new tokens, 3 rounds
#                -> benchmarks/results/simulate_bench_qwen3-30b-a3b-{substrate,flame}_h200.json
#   slots        (not in the default set) the engine's one-group expert compute of a B = 1 and B = 8 decode call by
#                the cache's size, 16 to 1,024 slots: benchmarks/slot_compute_probe.py, for the 2 GB rows that the
#                simulator puts 20% under the engine -> benchmarks/results/slot_compute_probe_h200.json
# Rounds: 3 of every Qwen configuration and 5 of the embedded one, interleaved (the bench's --repeats; the host's
# speed drifts from run to run on a shared machine, by 10-40% in its per-op cost; the validation takes each
# point's median). Profiles and benches belong on one machine instance: host costs differ between instances, and
# a machine may be replaced between device calls, so put the profiles in every call. With single-round profiles
# (version 4) PART="profiles qwen-waiting embedded" took 538 s on an H200; version 5 measures the engine's host costs
# in three rounds (one took 43 s for the embedded model on an H100), so run PART="profiles embedded" in one call and
# qwen-waiting, qwen-recall in the next ones, on the same warm machine (on an H100: 244, 409 and 235 s).
# Then, on any machine: python benchmarks/simulate_validation.py (simulated against measured, the 10% table).
# Run from the repository root with duoserve importable (PYTHONPATH=. or installed).
set -euo pipefail
OUT=${OUT:-benchmarks/results}
PROFILES=${PROFILES:-duoserve/bench/profiles}
TRACE=${TRACE:-out/traces}
PREDICTOR=${PREDICTOR:-out/validation/embedded-predictor}
SUBSTRATE_PREDICTOR=${SUBSTRATE_PREDICTOR:-out/validation/substrate-predictor}
FLAME_TRACE=${FLAME_TRACE:-out/validation/flame-trace}
FLAME_PREDICTOR=${FLAME_PREDICTOR:-out/validation/flame-predictor}
SHAPES=$(mktemp -d)
for shape in qwen3-30b-a3b qwen3-30b-a3b-substrate qwen3-30b-a3b-flame; do
    python3 -m duoserve.bench.shapes "$shape" "$SHAPES/$shape"
done
run() { python3 -m duoserve.cli.run "$@"; }
grid=(--layers 4 --batch-size 1 --batch-size 4 --batch-size 8 --batch-size 16 --context 64 --context 512
      --context 2048 --tokens 1 --tokens 4 --tokens 16 --tokens 64 --tokens 256 --tokens 1024 --tokens 4096)
qwen=(--model "$SHAPES/qwen3-30b-a3b" --config-only --layers 16 --routing random --prompt-len 512 --new-tokens 32
      --batch-size 1 --batch-size 8 --repeats 3)
part=" ${PART:-profiles qwen qwen-budget embedded replay-profiles substrate flame} "
want() { [[ "$part" == *" $1 "* ]]; }
if want profiles; then
    run profile --model "$SHAPES/qwen3-30b-a3b" "${grid[@]}" --out "$PROFILES/h200-qwen3-30b-a3b.json"
    run profile --model embedded "${grid[@]}" --out "$PROFILES/h200-embedded.json"
fi
if want replay-profiles; then
    for shape in qwen3-30b-a3b-substrate qwen3-30b-a3b-flame; do
        run profile --model "$SHAPES/$shape" "${grid[@]}" --out "$PROFILES/h200-$shape.json"
    done
fi
replay() {  # SHAPE TRACE PREDICTOR: the engine on a replayed trace, as the embedded bench below runs it
    run bench --model "$SHAPES/$1" --config-only --routing "$2" --predictor "$3" --predictor none --policy duoserve \
        --policy on-demand --policy lru --batch-size 1 --batch-size 8 --prompt-len 64 --new-tokens 16 --repeats 3 \
        --out "$OUT/simulate_bench_$1_h200.json"
}
if want substrate; then
    replay qwen3-30b-a3b-substrate benchmarks/data/substrate/traces "$SUBSTRATE_PREDICTOR"
fi
if want flame; then
    replay qwen3-30b-a3b-flame "$FLAME_TRACE" "$FLAME_PREDICTOR"
fi
if want qwen; then
    run bench "${qwen[@]}" --policy duoserve --policy on-demand --policy lru --policy full-layer --policy per-module \
        --predictor oracle:0 --predictor oracle:0.5 --predictor oracle:0.9 --predictor oracle:1 \
        --out "$OUT/simulate_bench_qwen3-30b-a3b_h200.json"
fi
if want qwen-waiting; then
    run bench "${qwen[@]}" --policy on-demand --policy lru --policy duoserve --policy per-module --predictor oracle:1 \
        --out "$OUT/simulate_bench_qwen3-30b-a3b_h200.json"
fi
if want qwen-recall; then
    run bench "${qwen[@]}" --policy duoserve --policy full-layer --predictor oracle:0 --predictor oracle:0.5 \
        --predictor oracle:0.9 --out "$OUT/simulate_bench_qwen3-30b-a3b_h200.json"
fi
if want qwen-budget; then
    run bench "${qwen[@]}" --policy duoserve --policy lru --predictor oracle:0.9 --gpu-expert-budget 2GB \
        --out "$OUT/simulate_bench_qwen3-30b-a3b_2gb_h200.json"
fi
if want slots; then
    python3 benchmarks/slot_compute_probe.py --out "$OUT/slot_compute_probe_h200.json"
fi
if want embedded; then
    run bench --model embedded --dtype bfloat16 --routing "$TRACE" --predictor "$PREDICTOR" --predictor none \
        --policy duoserve \
        --policy on-demand --policy lru --batch-size 1 --batch-size 8 --prompt-len 64 --new-tokens 16 --repeats 5 \
        --out "$OUT/simulate_bench_embedded_h200.json"
fi
