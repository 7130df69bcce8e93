"""Per-run table of the OPD study (docs/studies/opd_study.sh): on-policy distillation against GRPO from the same start.

    python docs/studies/opd_runs.py runs/study_opd > docs/studies/opd_runs.md

Reads each finished run's args.json and metrics.jsonl (runs without the .done marker are left out). The teacher is
the run named by --teacher (default grpo__s1): its pass@1 after training is the bar, and a run reaches it at the first
evaluation whose held-out pass@1 is at least --bar (0.9) of it. Per run: pass@1 at every evaluation (before training,
then every --eval-every steps), the step and the wall-clock seconds (wall_s of that evaluation row) at which it first
reaches the bar, the mean rollout and training seconds of a step (perf/rollout_s, perf/train_s; OPD's train_s holds
its teacher forward) and its mean completion length (rollout/response_len_mean), and OPD's reverse KL at the first and
the last step. Per arm: the mean pass@1 at each
evaluation step over seeds, and the mean step cost.
"""

import argparse
import glob
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from compare import load_run  # noqa: E402  (the repository's run reader: args.json + metrics.jsonl)


def fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def summarise(run_dir: str, bar_value: float) -> dict:
    run = load_run(run_dir)
    args, rows = run.args, run.rows
    evals = [r for r in rows if "eval/pass@1" in r]
    steps = [r for r in rows if "rollout/reward_mean" in r]  # each step's first update row
    if not evals:
        sys.exit(f"{run_dir}: no evaluation rows in metrics.jsonl")
    reached = next((e for e in evals if e["eval/pass@1"] >= bar_value), None)
    kls = [r["opd/reverse_kl"] for r in steps if "opd/reverse_kl" in r]
    return {
        "name": os.path.basename(os.path.normpath(run_dir)),
        "arm": args["exp_name"],
        "seed": args["seed"],
        "pass1": [(e["step"], e["eval/pass@1"]) for e in evals],
        "reached_step": reached["step"] if reached else None,
        "reached_wall_s": reached["wall_s"] if reached else None,
        "rollout_s": statistics.mean(r["perf/rollout_s"] for r in steps) if steps else None,
        "train_s": statistics.mean(r["perf/train_s"] for r in steps) if steps else None,
        "length": statistics.mean(r["rollout/response_len_mean"] for r in steps) if steps else None,
        "kl": (kls[0], kls[-1]) if kls else None,
    }


def mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.mean(values):.3f}" + (f" +- {statistics.stdev(values):.3f}" if len(values) > 1 else "")


def main(root: str, teacher: str = "grpo__s1", bar: float = 0.9) -> None:
    done = sorted(d for d in glob.glob(os.path.join(root, "*")) if os.path.isfile(os.path.join(d, ".done")))
    if not done:
        sys.exit(f"{root}: no finished run (a run folder with a .done marker)")
    names = {os.path.basename(d): d for d in done}
    if teacher not in names:
        sys.exit(f"{root}: the teacher run {teacher} is not among the finished runs")
    teacher_pass1 = summarise(names[teacher], 0.0)["pass1"][-1][1]
    bar_value = bar * teacher_pass1
    runs = [summarise(d, bar_value) for d in done]
    print(
        f"Teacher: {teacher}, held-out pass@1 {teacher_pass1:.3f} after training; the bar: {bar:g} of it = {bar_value:.4f}.\n"
    )
    eval_steps = sorted({s for r in runs for s, _ in r["pass1"]})
    head = ["run", "arm", "seed", *(f"pass@1 step {s}" for s in eval_steps), "reaches the bar at step"]
    head += ["wall s at the bar", "rollout s / step", "train s / step", "completion tokens", "reverse KL first -> last"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in runs:
        by_step = dict(r["pass1"])
        kl = f"{r['kl'][0]:.3f} -> {r['kl'][1]:.3f}" if r["kl"] else "-"
        cells = [r["name"], r["arm"], str(r["seed"]), *(fmt(by_step.get(s)) for s in eval_steps)]
        cells += [str(r["reached_step"]) if r["reached_step"] is not None else "not reached"]
        cells += [fmt(r["reached_wall_s"], 0), fmt(r["rollout_s"], 1), fmt(r["train_s"], 1), fmt(r["length"], 1), kl]
        print("| " + " | ".join(cells) + " |")
    print("\nPer arm, mean +- sample std over seeds:\n")
    head = ["arm", "seeds", *(f"pass@1 step {s}" for s in eval_steps), "reaches the bar at step (per seed)"]
    head += ["rollout s / step", "train s / step", "completion tokens"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for arm in sorted({r["arm"] for r in runs}):
        mine = [r for r in runs if r["arm"] == arm]
        cells = [arm, str(len(mine))]
        cells += [mean_std([dict(r["pass1"]).get(s) for r in mine]) for s in eval_steps]
        cells += [", ".join(str(r["reached_step"]) if r["reached_step"] is not None else "-" for r in mine)]
        cells += [mean_std([r["rollout_s"] for r in mine]), mean_std([r["train_s"] for r in mine])]
        cells += [mean_std([r["length"] for r in mine])]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", help="the study's folder of run folders (OUT of opd_study.sh)")
    parser.add_argument("--teacher", default="grpo__s1", help="the teacher's run folder name")
    parser.add_argument("--bar", type=float, default=0.9, help="the share of the teacher's pass@1 a run must reach")
    a = parser.parse_args()
    main(a.root, a.teacher, a.bar)
