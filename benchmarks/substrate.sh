#!/usr/bin/env bash
# The larger substrate end to end on a CUDA machine: train it (scripts/train_substrate_moe.py), trace it with
# next-gate guesses 2 layers deep, and check its routing's health. Run from the repository root with duoserve
# importable (`pip install -e .`, or PYTHONPATH=$PWD as on the GPU machine, which also needs the `datasets` package:
# carry the wheels of datasets, dill, multiprocess and xxhash and install them with `python3 -m pip install
# --no-deps`, as its `pip` is not its `python3`'s).
#
#   bash benchmarks/substrate.sh [WORK]     # WORK default: out/substrate (model/, traces/, health.txt)
#
# The trace settings are the committed trace's (benchmarks/data/substrate/traces): 150 requests of each built-in
# task, prompts cut to their last 64 tokens, 48 greedy decode steps, next-gate ids and scores of width k = 8 for
# the next two layers. COUNT=N traces N requests of each task instead (the committed trace is at its ~20 MB cap: a
# longer one is for fitting and evaluating on the machine that traced it, or brought back in pieces: COUNT=300
# gives 38 MB).
set -euo pipefail
WORK=${1:-out/substrate}
mkdir -p "$WORK"
[ -e "$WORK/model/model.safetensors" ] || python3 scripts/train_substrate_moe.py --out "$WORK/model" --max-seconds "${MAX_SECONDS:-420}"
python3 -m duoserve.cli.trace collect --model "$WORK/model" --count "${COUNT:-150}" --max-prompt-tokens 64 \
    --max-new-tokens 48 --lookahead 2 --nextgate-width 8 --batch-size 32 --out "$WORK/traces"
python3 -m duoserve.cli.trace info "$WORK/traces"
python3 -m duoserve.cli.evaluate health "$WORK/traces" | tee "$WORK/health.txt"
