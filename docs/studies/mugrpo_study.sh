#!/usr/bin/env bash
# Mu-GRPO study: large stages of stale data. Naive reuse (standard clip [0.8, 1.2], no veto) against
# the relaxed clip [0, 5] without a veto and with each veto scope (trigger, suffix, suffix_nontrigger = the
# paper's H_kappa, sequence), 3 seeds, identical budget and seeds.
#
# Regime and why. The paper's failure modes need many updates on one batch: mu = 16 updates per stage here (the
# issue asks for 16-64), 1 prompt x 8 rollouts per update, at lr 5e-5. docs/mugrpo.md measured at mu = 8 and
# lr 2e-5: naive clip fraction up to 12% (tight clip discards stale gradient), relaxed-clip KL from the
# behaviour policy 0.22, and no veto trigger (rho < 1e-4 never happened). Twice the staleness and 2.5x the lr
# aim at the regime where naive reuse degrades and triggers occur. Read seed 1 first: if mugrpo/triggered_frac
# stays 0 in relaxed_noveto, the veto arms equal it; rerun with LR=1e-4 (and say so in the write-up).
#
# Sampling temperature (TEMP, default 0.6 since the second run). The first run (2026-12-01, TEMP=1.0, the
# scripts' default) measured a stage-1 training reward of 2.3% at T = 1.0: 88% of the groups had all-equal
# rewards, so 27-30 of the 32 updates had no gradient and AdamW's momentum alone moved the policy (docs/mugrpo.md).
# At T = 0.6 (the evaluation temperature, where the base model's pass@1 is about 0.36) 38-56% of the stage-1
# groups of 8 have mixed rewards (measured in the 3 seeds), so 7-21 of the 32 updates carry a gradient instead of
# 2-5, and the comparison is about stale data more than about empty updates. The
# trainer's log-probs use the same temperature (--temperature), so the ratios are those of the sampling policy.
#
# Budget per run: 2 stages x 16 prompts x 8 rollouts (256 rollouts, 32 updates), 32 new tokens; held-out eval
# before and after on the first 40 arith problems x 2 samples at T = 0.6. Curves over updates: staleness,
# losses/approx_kl (KL from the behaviour policy), triggered / vetoed fractions, neg_ratio_mean, entropy;
# response length is per stage (rollout/response_len_mean) and per evaluation (eval/response_len_mean).
# CPU time estimate (docs/mugrpo.md: 256 rollouts at mu = 8 took 39 s rollout + 93 s train; docs/results.md:
# about 0.16 s per eval sample, about 10 s load): 10 + 40 + 100 + 2 x 13 = about 175 s per run; 6 arms x 3 seeds
# = 18 runs, about 53 min on an otherwise idle 2-core machine (longer when the lock is shared).
# Measured 2026-12-01, idle machine, T = 0.6: 197-304 s per run, so the 18 runs take about 70 min; the 4 main
# arms (ARMS="naive relaxed_noveto veto_hkappa veto_sequence") about 48 min.
#
# SMOKE=1 checked 2026-12-01 on the 2 cores while another session's CI shared them (so about 1.5-2x
# slower per step than the idle figures above): 102 s wall (1 stage: rollout 27 s, train 70 s), exit 0, compare table printed.
#
# Usage (from anywhere): bash docs/studies/mugrpo_study.sh
#   PYTHON=/path/to/python  SEEDS="1 2 3"  ARMS="naive relaxed_noveto ..."  LR=5e-5  MU=16  TEMP=0.6  OUT=runs/study_mugrpo
#   TAG=_lr2e-5: tables docs/studies/mugrpo_lr2e-5.md etc. (another regime's runs, in their own OUT)
#   SMOKE=1: only the first arm, seed 1, --total-steps 1 --eval-limit 2, into $OUT_smoke; no tables.
# Finished runs (marker .done) are skipped on a rerun; an unfinished one is removed and run again. The final
# model folder of each run is deleted after the run (KEEP_MODELS=1 keeps it).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
SEEDS=${SEEDS:-"1 2 3"}
LR=${LR:-5e-5}
MU=${MU:-16}
TEMP=${TEMP:-0.6}
OUT=${OUT:-runs/study_mugrpo}
LOCK=${LOCK:-/tmp/cpu.lock}
SMOKE=${SMOKE:-0}
TAG=${TAG:-}  # suffix of the table and plot names (a second regime's tables next to the first's)
DOCS=docs/studies
PLOTS=$DOCS/plots  # one PNG per --metric key: many files

RELAXED="--clip-low 1.0 --clip-high 4.0"
declare -A ARM=(
  [naive]="--clip-low 0.2 --clip-high 0.2 --veto-scope none"
  [relaxed_noveto]="$RELAXED --veto-scope none"
  [veto_trigger]="$RELAXED --veto-scope trigger"
  [veto_suffix]="$RELAXED --veto-scope suffix"
  [veto_hkappa]="$RELAXED --veto-scope suffix_nontrigger"
  [veto_sequence]="$RELAXED --veto-scope sequence"
)
ARMS=${ARMS:-"naive relaxed_noveto veto_trigger veto_suffix veto_hkappa veto_sequence"}
C="--total-steps 2 --updates-per-batch $MU --prompts-per-step $MU --num-generations 8 --learning-rate $LR
   --temperature $TEMP --veto-delta 1e-4 --behav-logp trainer --max-new-tokens 32 --eval-limit 40 --eval-samples 2 --eval-k 2"
if [ "$SMOKE" = 1 ]; then
  SEEDS=1; ARMS=${ARMS%% *}; OUT=${OUT}_smoke; C="$C --total-steps 1 --eval-limit 2"  # later flags win
fi

for seed in $SEEDS; do
  for arm in $ARMS; do
    name=${arm}_s${seed}
    [ -e "$OUT/$name/.done" ] && { echo "skip $name (done)"; continue; }
    rm -rf "${OUT:?}/$name"
    echo "=== $name: ${ARM[$arm]}"
    # shellcheck disable=SC2086  # word splitting of the flag strings is intended
    flock "$LOCK" "$PYTHON" mugrpo.py $C ${ARM[$arm]} --seed "$seed" --exp-name "$arm" \
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
# every arm against naive reuse: held-out accuracy (paired per seed), curves over updates of the stale-data
# diagnostics (a key with no data in a row is absent there, so curves skip it)
"$PYTHON" compare.py "$OUT"/* --baseline naive \
  --metric mugrpo/staleness --metric losses/approx_kl --metric mugrpo/triggered_frac \
  --metric mugrpo/vetoed_token_frac --metric mugrpo/neg_ratio_mean --metric losses/entropy \
  --metric losses/clipfrac --metric rollout/response_len_mean --metric eval/response_len_mean \
  --metric 'eval/tier*/pass@1' --plot-dir "$PLOTS" --plot-name mugrpo${TAG} > "$DOCS/mugrpo${TAG}.md"
# the veto's own effect: every veto scope against the relaxed clip alone
"$PYTHON" compare.py "$OUT"/* --baseline relaxed_noveto --metric losses/entropy --metric losses/approx_kl \
  --no-plot > "$DOCS/mugrpo${TAG}_vs_relaxed_noveto.md"
# one row per run (pass@1, updates with gradient, triggers, KL, entropy, reward per stage), then per-arm means
"$PYTHON" docs/studies/mugrpo_runs.py "$OUT" > "$DOCS/mugrpo${TAG}_runs.md"
echo "tables and plots in $DOCS/mugrpo*"
