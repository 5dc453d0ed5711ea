#!/usr/bin/env bash
# The predictor families side by side on one trace folder: decode exact-top-k on held-out requests, within and
# across tasks, at look-ahead depths 1..D. CPU is enough: about 25 minutes on 2 cores for the embedded default,
# an hour for the larger substrate (benchmarks/data/substrate/traces).
#
#   bash benchmarks/families.sh [TRACES] [OUT]      # TRACES default: a fresh trace of the embedded default
#   LOOKAHEAD=2 (default) sets D; the trace must record next-gate guesses that deep (duoserve-trace collect
#   --lookahead D).
#   FAMILIES="hybrid residual" fits only those (default: paper hybrid residual); FIT_ARGS adds arguments to each
#   fit (e.g. "--accelerator gpu"), EVAL_ARGS to each scoring (e.g. "--learning-curve 0.25,0.5,1 --baseline
#   next-gate"). Without BIN's entry points (no .venv, as on the GPU machine) the CLI modules run under python3.
#
# Each family is fitted as `make demo` fits the paper's (4 epochs, default widths) with heads for depths 1..D and
# scored by `duoserve-eval accuracy --cross-task` (which refits it on each task alone, 3 epochs).
set -euo pipefail
OUT=${2:-out/families}
TRACES=${1:-$OUT/traces}
BIN=${BIN:-.venv/bin}
D=${LOOKAHEAD:-2}
FAMILIES=${FAMILIES:-paper hybrid residual}
cli() {  # cli trace|train|eval ARGS...: an entry point, or its module where none is installed
  local tool=$1 module=$1
  shift
  [ "$module" = eval ] && module=evaluate
  if [ -x "$BIN/duoserve-$tool" ]; then "$BIN/duoserve-$tool" "$@"; else python3 -m "duoserve.cli.$module" "$@"; fi
}
[ -e "$TRACES" ] || cli trace collect --out "$TRACES" --lookahead "$D"
for family in $FAMILIES; do
  # shellcheck disable=SC2086  # FIT_ARGS and EVAL_ARGS are word lists
  cli train fit "$TRACES" --out "$OUT/p-$family" --epochs 4 --family "$family" --lookahead "$D" --clean \
      ${FIT_ARGS:-} >/dev/null
  # shellcheck disable=SC2086
  cli eval accuracy "$TRACES" --predictor "$OUT/p-$family" --out "$OUT/r-$family" --cross-task ${EVAL_ARGS:-} \
      >/dev/null
done
for family in $FAMILIES; do
  echo "== $family ($OUT/r-$family/report.md)"
  sed -n '/^## decode tokens/,/^## prefill/p' "$OUT/r-$family/report.md" | grep -E "^\| (trained MLP|next-gate) "
  sed -n '/^## Look-ahead depth/,/^## Scorers/p' "$OUT/r-$family/report.md" | grep -E "^(- d=|\| (trained MLP|next-gate) )"
  grep -E "^\| (trained MLP|next-gate) / trained on" "$OUT/r-$family/report.md"
  sed -n '/^## Learning curve/,$p' "$OUT/r-$family/report.md"
done
