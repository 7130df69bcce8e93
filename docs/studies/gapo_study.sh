#!/usr/bin/env bash
# GAPO study: GAPO's adaptive upper bound against a fixed symmetric clip and a fixed clip-higher
# (asymmetric) clip, at token level and at sequence level (GSPO ratio), 3 seeds, identical budget and seeds.
#
# Regime and why. Clipping acts only off-policy, and at the shared default (2 updates per batch, lr 1e-5) it
# clips 0.2-0.4% of tokens, so GAPO equals clip-higher there (docs/gapo.md, run A). Here every arm makes
# 4 updates per rollout batch (mini-batches of 2 whole groups; updates 2-4 run on a moved policy) at lr 5e-5,
# where docs/gapo.md run B measured (one seed) a token clip fraction of about 2%, and 4-7% of the tokens of
# correct rollouts in c = 1 groups under the symmetric clip. Token level uses the paper's (0.2, 0.28), sequence
# level its (3e-3, 5e-3); at lr 5e-5 the sequence ratio moves far more than 3e-3, so expect most sequences of the
# later mini-batches clipped there (report it). All arms share --scale-rewards none (GAPO's advantages), so
# only the clip differs. Read losses/clipfrac of seed 1 first: if the token-level clip fraction is far below 1%,
# rerun with LR=1e-4 (the choice and the fraction reached go into the write-up).
#
# Budget per run: 4 steps x 8 prompts x 8 rollouts (256 rollouts, 16 updates), 32 new tokens; held-out eval
# before and after on the first 40 arith problems x 2 samples at T = 0.6 (pass@1, pass@2, pass@1 per tier).
# CPU time estimate (docs/results.md default run on 2 cores: 513 s for 768 rollouts + 24 updates + 2 x 400 eval
# samples, i.e. about 0.16 s per generated sample, 21 s of training per 64-rollout step, about 10 s load):
# 10 s load + 40 s rollout + 90 s train + 2 x 13 s eval = about 170 s per run; 6 arms x 3 seeds = 18 runs,
# about 50 min on an otherwise idle 2-core machine (longer when the lock is shared).
# Measured 2026-12-01, idle machine: 234-278 s per run (rollout about 60 s, training 145 s, load and evaluations
# 45 s), so the 18 runs take about 77 min; the token-level half about 40 min.
#
# SMOKE=1 checked 2026-12-01 on the 2 cores while another session's CI shared them (so about 1.5-2x
# slower per step than the idle figures above): 54 s wall (1 step: rollout 14 s, train 34 s), exit 0, compare table printed.
#
# Usage (from anywhere): bash docs/studies/gapo_study.sh
#   PYTHON=/path/to/python  SEEDS="1 2 3"  ARMS="gapo_tok sym_tok ..."  LR=5e-5  OUT=runs/study_gapo
#   TAG=_lr3e-6: tables docs/studies/gapo_seq_lr3e-6.md etc. (another regime's runs, in their own OUT)
#   SMOKE=1: only the first arm, seed 1, --total-steps 1 --eval-limit 2, into $OUT_smoke; no tables.
# Finished runs (marker .done) are skipped on a rerun; an unfinished one is removed and run again. The final
# model folder of each run is deleted after the run (KEEP_MODELS=1 keeps it): 18 x 0.5 GB otherwise.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
SEEDS=${SEEDS:-"1 2 3"}
LR=${LR:-5e-5}
OUT=${OUT:-runs/study_gapo}
LOCK=${LOCK:-/tmp/cpu.lock}
SMOKE=${SMOKE:-0}
TAG=${TAG:-}  # suffix of the table and plot names (a second regime's tables next to the first's)
DOCS=docs/studies
PLOTS=$DOCS/plots  # one PNG per --metric key: many files

declare -A ARM=(
  [gapo_tok]="--clip-level token --clip-mode adaptive --clip-low 0.2 --clip-high-max 0.28"
  [asym_tok]="--clip-level token --clip-mode fixed --clip-low 0.2 --clip-high-max 0.28"
  [sym_tok]="--clip-level token --clip-mode fixed --clip-low 0.2 --clip-high-max 0.2"
  [gapo_seq]="--clip-level sequence --clip-mode adaptive --clip-low 3e-3 --clip-high-max 5e-3"
  [asym_seq]="--clip-level sequence --clip-mode fixed --clip-low 3e-3 --clip-high-max 5e-3"
  [sym_seq]="--clip-level sequence --clip-mode fixed --clip-low 3e-3 --clip-high-max 3e-3"
)
ARMS=${ARMS:-"gapo_tok asym_tok sym_tok gapo_seq asym_seq sym_seq"}
C="--total-steps 4 --prompts-per-step 8 --num-generations 8 --updates-per-batch 4 --learning-rate $LR
   --scale-rewards none --max-new-tokens 32 --eval-limit 40 --eval-samples 2 --eval-k 2"
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
    flock "$LOCK" "$PYTHON" gapo.py $C ${ARM[$arm]} --seed "$seed" --exp-name "$arm" \
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
# main tables + paired per-seed differences against the symmetric clip; per-c clip fraction and |ratio - 1|
# (final values and curves over updates), overall and upper clip fraction, held-out pass@1 per tier
for level in tok seq; do
  # a level none of whose runs finished (ARMS= a subset) has no table
  compgen -G "$OUT/*_${level}_s*/.done" > /dev/null || { echo "no finished ${level} runs: no table"; continue; }
  "$PYTHON" compare.py "$OUT"/*_${level}_s* --baseline sym_${level} \
    --metric 'gapo/clipfrac_c*' --metric 'gapo/ratio_absdev_c*' --metric losses/clipfrac \
    --metric losses/clipfrac_high --metric 'eval/tier*/pass@1' \
    --plot-dir "$PLOTS" --plot-name gapo_${level}${TAG} > "$DOCS/gapo_${level}${TAG}.md"
  # the same runs against clip-higher (GAPO's c = 1 bound equals it; does widening only there help?)
  "$PYTHON" compare.py "$OUT"/*_${level}_s* --baseline asym_${level} --no-plot \
    > "$DOCS/gapo_${level}${TAG}_vs_asym.md"
done

# the paper's per-c view, over the whole run: for each arm and c, the mean over update rows of
# gapo/clipfrac_c{c} and gapo/ratio_absdev_c{c} (correct off-policy rollouts of groups with c correct),
# then mean +- std over seeds; small c = the rare correct answers of hard groups
"$PYTHON" - "$OUT" > "$DOCS/gapo_per_c${TAG}.md" <<'PY'
import glob, json, os, statistics, sys
runs = {}
for d in sorted(glob.glob(os.path.join(sys.argv[1], "*"))):
    if not os.path.exists(os.path.join(d, ".done")):
        continue
    arm = json.load(open(os.path.join(d, "args.json")))["exp_name"]
    rows = [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl")) if l.strip()]
    runs.setdefault(arm, []).append(rows)
def cell(values):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} +- {sd:.4f} (n={len(values)})"
def run_mean(rows, key):  # mean over the update rows that have the key (absent: no such rollout off-policy)
    v = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(v) / len(v) if v else None
for prefix, title in (("gapo/clipfrac_c", "clip fraction of correct off-policy rollouts"),
                      ("gapo/ratio_absdev_c", "mean |ratio - 1| of correct off-policy rollouts")):
    cs = sorted({int(k[len(prefix):]) for rs in runs.values() for rows in rs for r in rows for k in r
                 if k.startswith(prefix)})
    print(f"\n{title}, by group success count c (mean over updates, then mean +- std over seeds)\n")
    extra = prefix == "gapo/clipfrac_c"  # plus the clip fraction of all units (tokens or sequences)
    print("| arm | " + " | ".join(f"c={c}" for c in cs) + (" | all units (losses/clipfrac) |" if extra else " |"))
    print("|---" * (len(cs) + 1 + extra) + "|")
    for arm, rs in sorted(runs.items()):
        cells = [cell([run_mean(rows, f"{prefix}{c}") for rows in rs]) for c in cs]
        if extra:
            cells.append(cell([run_mean(rows, "losses/clipfrac") for rows in rs]))
        print(f"| {arm} | " + " | ".join(cells) + " |")
PY
echo "tables and plots in $DOCS/gapo_*"
