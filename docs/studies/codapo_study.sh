#!/usr/bin/env bash
# CoDaPO study: the paper's three training dynamics -- confidence of correct vs incorrect rollouts,
# mean |A| per step, accuracy by difficulty band over training -- with the weighting on/off and the focused step
# on/off (2 x 2 arms; both off is grpo.py's objective up to the std epsilon, kept at CoDaPO's 1e-6 in every arm
# so that only the two switches differ), 3 seeds, identical budget and seeds.
#
# Regime and why. The mechanism engages when a batch has learnable questions (0 < p < 1) whose weights differ:
# on arith at the default lr the five tiers give group success rates from about 0 to 0.4, and docs/codapo.md
# measured learnable_frac 0.12-1.0 and confidence_mean rising 0.20 -> 0.42 in 6 steps. So the shared defaults
# (lr 1e-5, 2 updates per step, 8 prompts x 8 rollouts), 6 steps = 3 broad + 3 focused, with evaluations
# before, after step 3 and after step 6 on 60 problems (about 12 per tier), pass@1 per tier logged as
# eval/tier<t>/pass@1 (tier 0: one-digit sums ... tier 4: two-digit sums).
#
# Budget per run: 6 steps x 8 prompts x 8 rollouts (384 rollouts, 12 updates), 32 new tokens; 3 evaluations of
# 60 problems x 2 samples at T = 0.6. CPU time estimate (docs/results.md default runs on 2 cores: codapo
# 12 steps = rollout 117 s + train 245 s, so half of that here; about 0.16 s per eval sample; about 10 s load):
# 10 + 60 + 125 + 3 x 20 = about 255 s per run; 4 arms x 3 seeds = 12 runs, about 51 min on an otherwise idle
# 2-core machine (longer when the lock is shared). Measured 2026-12-01, idle machine: 363-437 s per run (rollout
# 80-101 s, training 199-230 s, load and 3 evaluations 84-108 s), so the 12 runs take about 80 min; one switch at a time
# (ARMS="full nofocus": the focused step with the weighting on) about 40 min.
#
# SMOKE=1 checked 2026-12-01 on the 2 cores while another session's CI shared them (so about 1.5-2x
# slower per step than the idle figures above): 59 s wall (1 step: rollout 14 s, train 40 s), exit 0, compare table printed.
#
# Usage (from anywhere): bash docs/studies/codapo_study.sh
#   PYTHON=/path/to/python  SEEDS="1 2 3"  ARMS="full noweight nofocus neither"  LR=1e-5  OUT=runs/study_codapo
#   SMOKE=1: only the first arm, seed 1, --total-steps 1 --eval-limit 2, into $OUT_smoke; no tables.
# Finished runs (marker .done) are skipped on a rerun; an unfinished one is removed and run again. The final
# model folder of each run is deleted after the run (KEEP_MODELS=1 keeps it).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
SEEDS=${SEEDS:-"1 2 3"}
LR=${LR:-1e-5}
OUT=${OUT:-runs/study_codapo}
LOCK=${LOCK:-/tmp/cpu.lock}
SMOKE=${SMOKE:-0}
DOCS=docs/studies
PLOTS=$DOCS/plots  # one PNG per --metric key: many files

declare -A ARM=(
  [full]=""
  [noweight]="--no-codapo-weighting"
  [nofocus]="--no-focused-step"
  [neither]="--no-codapo-weighting --no-focused-step"
)
ARMS=${ARMS:-"full noweight nofocus neither"}
C="--total-steps 6 --prompts-per-step 8 --num-generations 8 --updates-per-batch 2 --learning-rate $LR
   --max-new-tokens 32 --eval-every 3 --eval-limit 60 --eval-samples 2 --eval-k 2"
if [ "$SMOKE" = 1 ]; then
  SEEDS=1; ARMS=${ARMS%% *}; OUT=${OUT}_smoke; C="$C --total-steps 1 --eval-limit 2"  # later flags win
fi

for seed in $SEEDS; do
  for arm in $ARMS; do
    name=${arm}_s${seed}
    [ -e "$OUT/$name/.done" ] && { echo "skip $name (done)"; continue; }
    rm -rf "${OUT:?}/$name"
    echo "=== $name: ${ARM[$arm]:-(defaults)}"
    # shellcheck disable=SC2086  # word splitting of the flag strings is intended
    flock "$LOCK" "$PYTHON" codapo.py $C ${ARM[$arm]} --seed "$seed" --exp-name "codapo_$arm" \
      --output-dir "$OUT" --run-name "$name"
    [ "${KEEP_MODELS:-0}" = 1 ] || rm -rf "${OUT:?}/$name/final"
    touch "$OUT/$name/.done"
  done
done

if [ "$SMOKE" = 1 ]; then
  "$PYTHON" compare.py "$OUT"/* --no-plot
  exit 0
fi

mkdir -p "$DOCS" "$PLOTS"
# against both switches off: held-out pass@1 / pass@2 and pass@1 per tier (paired per seed; the eval curves
# over training, per tier included, go to codapo_eval.png), and the dynamics over updates (rollout keys are on
# the first update row of each step; a confidence class with no rollout in a step is absent there)
"$PYTHON" compare.py "$OUT"/* --baseline codapo_neither \
  --metric 'eval/tier*/pass@1' --metric codapo/confidence_correct_mean --metric codapo/confidence_incorrect_mean \
  --metric codapo/confidence_mean --metric codapo/adv_abs_mean --metric codapo/adv_abs_mean_unweighted \
  --metric codapo/weight_mean --metric codapo/learnable_frac --metric codapo/selected \
  --plot-dir "$PLOTS" --plot-name codapo > "$DOCS/codapo.md"
# one row per run (pass@1 at each evaluation, per tier, the dynamics at the first and last step), per-arm means,
# and the 2 x 2's two main effects paired per seed
"$PYTHON" docs/studies/codapo_runs.py "$OUT" > "$DOCS/codapo_runs.md"
echo "tables and plots in $DOCS/codapo*"
