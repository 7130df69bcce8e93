#!/usr/bin/env bash
# On-policy distillation against GRPO from the same start (docs/opd.md, docs/studies/opd.md). The default task and
# budget (embedded SmolLM2-135M-Instruct on arith, 12 steps of 8 prompts x 8 rollouts, 2 updates per step, 32 new
# tokens, lr 1e-5), with an evaluation every 2 steps (100 held-out problems x 4 samples at T = 0.6) for the curves:
#   grpo  grpo.py, seeds 1 2 3; seed 1's final/ is the teacher (the default grpo.py run with --eval-every 2: the
#         evaluations draw from their own generator, so its training is the default run's)
#   opd   opd.py --teacher <grpo seed 1>/final, seeds 1 2 3: the student starts from the same embedded model
# Each run under the CPU lock, one after the other (about 7-8 min a run on the 2 idle cores; 6 runs).
#
# Usage (from anywhere): bash docs/studies/opd_study.sh
#   PYTHON=/path/to/python  SEEDS="1 2 3"  OUT=runs/study_opd  LOCK=/tmp/cpu.lock  EVAL_EVERY=2
# Finished runs (marker .done) are skipped on a rerun; an unfinished one is removed and run again. Then the tables and
# plots: python compare.py $OUT/grpo__s*/ $OUT/opd__s*/ --baseline grpo (the commands
# docs/studies/opd.md gives).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-runs/study_opd}
LOCK=${LOCK:-/tmp/cpu.lock}
SEEDS=${SEEDS:-1 2 3}
EVAL_EVERY=${EVAL_EVERY:-2}
mkdir -p "$OUT"

run() {  # name, script, flags...: one run under the lock, skipped when done
  local name=$1 script=$2
  shift 2
  if [ -f "$OUT/$name/.done" ]; then echo "done: $name"; return; fi
  rm -rf "${OUT:?}/$name"
  echo "run: $name"
  flock "$LOCK" "$PYTHON" "$script" --output-dir "$OUT" --run-name "$name" --eval-every "$EVAL_EVERY" "$@" > "$OUT/$name.log" 2>&1
  touch "$OUT/$name/.done"
}

for s in $SEEDS; do
  run "grpo__s$s" grpo.py --seed "$s"
done
TEACHER="$OUT/grpo__s1/final"
for s in $SEEDS; do
  run "opd__s$s" opd.py --seed "$s" --teacher "$TEACHER"
done
