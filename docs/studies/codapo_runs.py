"""Per-run table of the CoDaPO study: one row per run, per-arm means over seeds, and the 2 x 2's two
main effects paired per seed.

    python docs/studies/codapo_runs.py runs/study_codapo > docs/studies/codapo_runs.md

Reads each finished run's args.json and metrics.jsonl (runs without the .done marker are left out). Per run:
held-out pass@1 at every evaluation (before training, then every --eval-every steps), pass@k after (the largest k
evaluated), pass@1 per difficulty tier after training, and from the steps' rollouts: training reward, confidence of
correct / incorrect rollouts and the unweighted mean |A|, each at the first and the last step. Per step, mean over
seeds: training reward, confidence of correct / incorrect rollouts, mean |A| as it enters the loss (weighted when the
weighting is on) and unweighted, the mean weight w, and the learnable fraction (groups with 0 < p < 1).

Main effects (a 2 x 2 of --codapo-weighting and --focused-step, one run per cell and seed): the effect of the
focused step in one seed is the mean over the two weighting settings of pass@1(focused step on) - pass@1(off), and
the effect of the weighting likewise; the table gives both per seed, their mean and how many seeds are positive.
"""

import glob
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from compare import load_run  # noqa: E402  (the repository's run reader: args.json + metrics.jsonl)

STEP_KEYS = [
    "rollout/reward_mean",
    "codapo/confidence_correct_mean",
    "codapo/confidence_incorrect_mean",
    "codapo/adv_abs_mean",
    "codapo/adv_abs_mean_unweighted",
    "codapo/weight_mean",
    "codapo/learnable_frac",
]
TIERS = range(5)  # arith's difficulty tiers (verifiers.py): 0 = one-digit sums ... 4 = two-digit sums


def fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def first_last(rows, key):
    """The key's value at the first and the last step that logged it (rollout keys: each step's first update row)."""
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return (vals[0], vals[-1]) if vals else (None, None)


def summarise(run_dir):
    run = load_run(run_dir)
    args, rows = run.args, run.rows
    evals = [r for r in rows if "eval/pass@1" in r]
    step_rows = [r for r in rows if "rollout/reward_mean" in r]  # each step's first update row
    if not evals:
        sys.exit(f"{run_dir}: no evaluation rows in metrics.jsonl (the study evaluates before and during training)")
    last = evals[-1]
    return {
        "arm": args["exp_name"],
        "seed": args["seed"],
        "weighting": args["codapo_weighting"],
        "focused": args["focused_step"],
        "pass1": [(e["step"], e["eval/pass@1"]) for e in evals],
        "passk_after": last.get(f"eval/pass@{max(args['eval_k'])}"),
        "k": max(args["eval_k"]),
        "tiers_before": [evals[0].get(f"eval/tier{t}/pass@1") for t in TIERS],
        "tiers_after": [last.get(f"eval/tier{t}/pass@1") for t in TIERS],
        "reward": first_last(rows, "rollout/reward_mean"),
        "conf_correct": first_last(rows, "codapo/confidence_correct_mean"),
        "conf_incorrect": first_last(rows, "codapo/confidence_incorrect_mean"),
        "adv_abs": first_last(rows, "codapo/adv_abs_mean_unweighted"),
        "per_step": {key: [r.get(key) for r in step_rows] for key in STEP_KEYS},
    }


def signed(x):
    """+0.050 style; a difference that rounds to zero prints as +0.000, not -0.000."""
    return f"{round(x, 3) or 0.0:+.3f}"


def arrow(pair, digits=2):
    return f"{fmt(pair[0], digits)} -> {fmt(pair[1], digits)}"


def ms(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{statistics.mean(xs):.3f} +- {statistics.stdev(xs) if len(xs) > 1 else 0.0:.3f}"


def main(out_dir):
    runs = [summarise(d) for d in sorted(glob.glob(os.path.join(out_dir, "*"))) if os.path.exists(os.path.join(d, ".done"))]
    if not runs:
        sys.exit(f"no finished runs (with a .done marker) under {out_dir}: run docs/studies/codapo_study.sh first")
    runs.sort(key=lambda r: (r["arm"], r["seed"]))
    k = runs[0]["k"]
    print(
        f"| arm | seed | weighting | focused step | pass@1 at eval steps | pass@{k} after "
        "| pass@1 per tier after (0-4) | train reward first -> last step "
        "| confidence correct first -> last | confidence incorrect first -> last | mean \\|A\\| first -> last |"
    )
    print("|---" * 11 + "|")
    for r in runs:
        evals = " / ".join(f"{fmt(p)} (s{s})" for s, p in r["pass1"])
        print(
            f"| {r['arm']} | {r['seed']} | {'on' if r['weighting'] else 'off'} | {'on' if r['focused'] else 'off'} "
            f"| {evals} | {fmt(r['passk_after'])} | {' '.join(fmt(v, 2) for v in r['tiers_after'])} "
            f"| {arrow(r['reward'])} | {arrow(r['conf_correct'])} | {arrow(r['conf_incorrect'])} "
            f"| {arrow(r['adv_abs'])} |"
        )

    print("\nPer arm, mean +- std over seeds (n = seeds):\n")
    print(
        f"| arm | n | pass@1 after | pass@1 after - before | pass@{k} after | "
        + " | ".join(f"tier {t} after" for t in TIERS)
        + " |"
    )
    print("|---" * (5 + len(TIERS)) + "|")
    for arm in sorted({r["arm"] for r in runs}):
        rs = [r for r in runs if r["arm"] == arm]
        print(
            f"| {arm} | {len(rs)} | {ms([r['pass1'][-1][1] for r in rs])} "
            f"| {ms([r['pass1'][-1][1] - r['pass1'][0][1] for r in rs])} | {ms([r['passk_after'] for r in rs])} | "
            + " | ".join(ms([r["tiers_after"][t] for r in rs]) for t in TIERS)
            + " |"
        )

    # the paper's dynamics per step, mean over seeds (rollout keys are on each step's first update row; a
    # confidence class with no rollout in a step is left out of that step's mean)
    steps = max(len(r["per_step"]["rollout/reward_mean"]) for r in runs)
    print("\nDynamics per step, mean over seeds (from each step's rollouts):\n")
    print("| arm | metric | " + " | ".join(f"step {i + 1}" for i in range(steps)) + " |")
    print("|---" * (steps + 2) + "|")
    for arm in sorted({r["arm"] for r in runs}):
        rs = [r for r in runs if r["arm"] == arm]
        for key in STEP_KEYS:
            cells = []
            for i in range(steps):
                xs = [r["per_step"][key][i] for r in rs if i < len(r["per_step"][key])]
                xs = [x for x in xs if x is not None]
                cells.append(f"{statistics.mean(xs):.2f}" if xs else "-")
            print(f"| {arm} | {key} | " + " | ".join(cells) + " |")

    # main effects of the 2 x 2, paired per seed: only seeds with all four cells finished
    cell = {(r["seed"], r["weighting"], r["focused"]): r["pass1"][-1][1] for r in runs}
    seeds = sorted({s for s, _, _ in cell if all((s, w, f) in cell for w in (True, False) for f in (True, False))})
    print("\nMain effects on pass@1 after training, paired per seed (seeds with all four cells):\n")
    if not seeds:
        print("(no seed has all four cells yet)")
        return
    print("| effect | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | seeds positive / negative / tied |")
    print("|---" * (len(seeds) + 3) + "|")
    effects = {
        "focused step on - off (mean over weighting)": [
            statistics.mean(cell[(s, w, True)] - cell[(s, w, False)] for w in (True, False)) for s in seeds
        ],
        "weighting on - off (mean over focused step)": [
            statistics.mean(cell[(s, True, f)] - cell[(s, False, f)] for f in (True, False)) for s in seeds
        ],
    }
    for name, diffs in effects.items():
        pos, neg = sum(d > 1e-9 for d in diffs), sum(d < -1e-9 for d in diffs)
        print(
            f"| {name} | "
            + " | ".join(signed(d) for d in diffs)
            + f" | {signed(statistics.mean(diffs))} | {pos} / {neg} / {len(diffs) - pos - neg} |"
        )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python docs/studies/codapo_runs.py RUNS_DIR  (e.g. runs/study_codapo)")
    main(sys.argv[1])
