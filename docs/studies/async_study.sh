#!/usr/bin/env bash
# Asynchronous rollouts (--async-lag, docs/async.md) against the synchronous default run: lag 0 / 1 / 2 / 4 optimizer
# updates x {no correction, bypass (the ratio against mu), the rollout correction (--rollout-is token-tis, AReaL's
# decoupled loss)}, with Mu-GRPO's staleness (3 stages x 8 updates, no overlap) beside them; the default task and
# flags otherwise (embedded SmolLM2-135M-Instruct on arith, 12 steps of 8 prompts x 8 rollouts, 2 updates per step,
# lr 1e-5), evaluated every 4 steps on 50 held-out problems (4 samples each) for the curves against updates and wall.
#
# Budget per run: about 6 to 7 minutes on the 2 idle cores (the producer takes one core, the trainer the other).
# 12 arms x 3 seeds = 36 runs, about 4 hours; arms run in the order of ARMS, seed by seed, so a cut-short study still
# has every arm of its first seed.
#
# Usage (from anywhere): bash docs/studies/async_study.sh
#   PYTHON=/path/to/python  SEEDS="1 2 3"  ARMS="sync lag2_none ..."  OUT=runs/study_async
# Finished runs (marker .done) are skipped on a rerun; an unfinished one is removed and run again. The final
# model folder of each run is deleted after the run (KEEP_MODELS=1 keeps it).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
SEEDS=${SEEDS:-"1 2 3"}
OUT=${OUT:-runs/study_async}
LOCK=${LOCK:-/tmp/cpu.lock}
DOCS=docs/studies
PLOTS=$DOCS/plots
EVAL="--eval-every 4 --eval-limit 50"

declare -A ARM=(
  [sync]="grpo.py"
  [lag0]="grpo.py --async-lag 0"
  [mugrpo]="mugrpo.py"
)
for lag in 1 2 4; do
  ARM[lag${lag}_none]="grpo.py --async-lag $lag"
  ARM[lag${lag}_bypass]="grpo.py --async-lag $lag --rollout-is bypass"
  ARM[lag${lag}_tis]="grpo.py --async-lag $lag --rollout-is token-tis"
done
ARMS=${ARMS:-"sync lag2_none lag2_bypass lag2_tis lag4_none lag4_bypass lag4_tis lag0 lag1_none lag1_bypass lag1_tis mugrpo"}

for seed in $SEEDS; do
  for arm in $ARMS; do
    name=${arm}_s${seed}
    [ -e "$OUT/$name/.done" ] && { echo "skip $name (done)"; continue; }
    rm -rf "${OUT:?}/$name"
    echo "=== $name: ${ARM[$arm]}"
    # shellcheck disable=SC2086  # word splitting of the flag strings is intended
    flock "$LOCK" "$PYTHON" ${ARM[$arm]} $EVAL --seed "$seed" --exp-name "async_$arm" --output-dir "$OUT" \
      --run-name "$name"
    [ "${KEEP_MODELS:-0}" = 1 ] || rm -rf "${OUT:?}/$name/final"
    touch "$OUT/$name/.done"
  done
done

mkdir -p "$DOCS" "$PLOTS"
"$PYTHON" compare.py "$OUT"/* --baseline async_sync \
  --metric 'async/lag_mean' --metric perf/overlap_frac --metric perf/weight_publish_s \
  --metric 'async/*_idle_frac' --metric mismatch/abs_log_rho_mean \
  --plot-dir "$PLOTS" --plot-name async > "$DOCS/async.md"
"$PYTHON" "$DOCS/async_runs.py" "$OUT" > "$DOCS/async_runs.md"  # pass@1 at equal updates and at equal wall clock
echo "tables and plots in $DOCS/async.md, $DOCS/async_runs.md, $PLOTS/async*"
