"""Per-arm table of the async study (docs/studies/async_study.sh): pass@1 at equal updates and at equal wall clock.

    python docs/studies/async_runs.py runs/study_async > docs/studies/async_runs.md

Reads each finished run (the .done marker) of the study folder; an arm is the run name without its _s<seed>. Per
arm, mean over its seeds: held-out pass@1 at each evaluation (before training, then every --eval-every steps), the
standard deviation of the last one across seeds, the wall clock of the last evaluation, and pass@1 at equal wall
clock: the last evaluation each run finished by W(seed), the smallest final wall among that seed's runs; then each
run's final wall by seed. Then the run's means over its steps: the lag in updates, the weight publishes per step
(seconds), the trainer's wait for batches (perf/rollout_s) and its training time (perf/train_s) per step, and the
final overlap and idle shares.
"""

import glob
import json
import os
import statistics
import sys


def rows_of(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def main(folder: str) -> None:
    arms: dict[str, list[list[dict]]] = {}
    seeds: dict[str, list[int]] = {}
    for run_dir in sorted(glob.glob(os.path.join(folder, "*"))):
        if os.path.exists(os.path.join(run_dir, ".done")):
            arm, seed = os.path.basename(run_dir).rsplit("_s", 1)
            arms.setdefault(arm, []).append(rows_of(run_dir))
            seeds.setdefault(arm, []).append(int(seed))
    if not arms:
        sys.exit(f"no finished run in {folder}")
    evals = {arm: [[r for r in rows if "eval/pass@1" in r] for rows in runs] for arm, runs in arms.items()}
    # equal wall clock per seed: W(seed) = the fastest arm's wall at its last evaluation, among that seed's runs (a
    # seed's runs share a session; the machines of two sessions may differ in speed)
    walls = {(arm, seed): e[-1]["wall_s"] for arm, ev in evals.items() for seed, e in zip(seeds[arm], ev)}
    all_seeds = sorted({seed for _, seed in walls})
    W = {seed: min(w for (_, s), w in walls.items() if s == seed) for seed in all_seeds}
    steps = sorted({r["step"] for ev in evals.values() for e in ev for r in e})
    print("Equal wall clock W per seed (the fastest run's wall at its last evaluation, among that seed's runs):")
    print(", ".join(f"seed {seed} {w:.0f} s" for seed, w in W.items()) + ".\n")
    head = ["arm", "seeds"] + [f"pass@1 step {s}" for s in steps] + ["final sd", "wall s", "pass@1 at W"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for arm, ev in evals.items():
        by_step = [mean([next((r["eval/pass@1"] for r in e if r["step"] == s), None) for e in ev]) for s in steps]
        at_w = mean([[r for r in e if r["wall_s"] <= W[seed] + 1e-6][-1]["eval/pass@1"] for seed, e in zip(seeds[arm], ev)])
        wall = mean([e[-1]["wall_s"] for e in ev])
        final = [e[-1]["eval/pass@1"] for e in ev]  # the spread of the last evaluation across seeds
        sd = statistics.stdev(final) if len(final) > 1 else None
        cells = " | ".join(fmt(v) for v in by_step)
        print(f"| {arm} | {len(ev)} | {cells} | {fmt(sd)} | {wall:.0f} | {fmt(at_w)} |")
    print()
    head = ["arm"] + [f"wall s, seed {seed}" for seed in all_seeds]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for arm in evals:
        print(f"| {arm} | " + " | ".join(fmt(walls.get((arm, seed)), 0) for seed in all_seeds) + " |")
    print()
    head = ["arm", "lag mean", "publish s/step", "wait s/step", "train s/step", "overlap", "producer idle", "trainer idle"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for arm, runs in arms.items():
        train = [[r for r in rows if "rollout/reward_mean" in r] for rows in runs]

        def per_step(key, train=train):
            return mean([mean([r.get(key) for r in t]) for t in train])

        def final(key, train=train):
            return mean([t[-1].get(key) for t in train])

        cells = [per_step("async/lag_mean"), per_step("perf/weight_publish_s"), per_step("perf/rollout_s")]
        cells += [per_step("perf/train_s"), final("perf/overlap_frac")]
        cells += [final("async/producer_idle_frac"), final("async/trainer_idle_frac")]
        print(f"| {arm} | " + " | ".join(fmt(v, 2) for v in cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/study_async")
