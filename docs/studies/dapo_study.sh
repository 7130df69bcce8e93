#!/usr/bin/env bash
# DAPO's options in grpo.py against the default run: dynamic sampling (--dynamic-sampling, at most 10 rounds) and
# equal-reward groups out of the loss (--zero-variance mask), 3 seeds, the default task and flags otherwise
# (embedded SmolLM2-135M-Instruct on arith, 12 steps of 8 prompts x 8 rollouts, 2 updates per step, lr 1e-5).
#
# Budget per run: the default run (about 6 min on the 2 idle cores: docs/results.md); dynamic sampling adds the
# generation of its extra rounds (each round 8 more prompts x 8 rollouts). 3 arms x 3 seeds = 9 runs.
#
# Usage (from anywhere): bash docs/studies/dapo_study.sh
#   PYTHON=/path/to/python  SEEDS="1 2 3"  ARMS="default dynamic zvmask"  OUT=runs/study_dapo
# Finished runs (marker .done) are skipped on a rerun; an unfinished one is removed and run again. The final
# model folder of each run is deleted after the run (KEEP_MODELS=1 keeps it).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
SEEDS=${SEEDS:-"1 2 3"}
OUT=${OUT:-runs/study_dapo}
LOCK=${LOCK:-/tmp/cpu.lock}
DOCS=docs/studies
PLOTS=$DOCS/plots

declare -A ARM=(
  [default]=""
  [dynamic]="--dynamic-sampling"
  [zvmask]="--zero-variance mask"
)
ARMS=${ARMS:-"default dynamic zvmask"}

for seed in $SEEDS; do
  for arm in $ARMS; do
    name=${arm}_s${seed}
    [ -e "$OUT/$name/.done" ] && { echo "skip $name (done)"; continue; }
    rm -rf "${OUT:?}/$name"
    echo "=== $name: ${ARM[$arm]:-(defaults)}"
    # shellcheck disable=SC2086  # word splitting of the flag strings is intended
    flock "$LOCK" "$PYTHON" grpo.py ${ARM[$arm]} --seed "$seed" --exp-name "grpo_$arm" --output-dir "$OUT" \
      --run-name "$name"
    [ "${KEEP_MODELS:-0}" = 1 ] || rm -rf "${OUT:?}/$name/final"
    touch "$OUT/$name/.done"
  done
done

mkdir -p "$DOCS" "$PLOTS"
"$PYTHON" compare.py "$OUT"/* --baseline grpo_default \
  --metric rollout/zero_adv_group_frac --metric 'dynamic/*' --metric rollout/in_loss_frac \
  --plot-dir "$PLOTS" --plot-name dapo > "$DOCS/dapo.md"
echo "tables and plots in $DOCS/dapo.md, $PLOTS/dapo*"
