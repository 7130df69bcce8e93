"""Per-run table of the Mu-GRPO study: one row per run, then per-arm means over seeds.

    python docs/studies/mugrpo_runs.py runs/study_mugrpo > docs/studies/mugrpo_runs.md

Reads each finished run's args.json and metrics.jsonl (runs without the .done marker are left out). Columns:
held-out pass@1 before -> after and pass@k after (the largest k evaluated); updates whose gradient norm was
non-zero (the rest had all-equal rewards in their groups); the largest clip fraction; the updates where a veto
trigger occurred (rho < delta on a token of an A < 0 response) with the mean triggered / vetoed fractions there;
KL from the behaviour policy (mean and max over updates); entropy of the first and last update; training reward
per stage; held-out response length before -> after.
"""

import glob
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from compare import load_run  # noqa: E402  (the repository's run reader: args.json + metrics.jsonl)


def load(run_dir):
    run = load_run(run_dir)
    return run.args, run.rows


def values(rows, key):
    return [r[key] for r in rows if isinstance(r.get(key), (int, float))]


def fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def summarise(args, rows):
    evals = [r for r in rows if "eval/pass@1" in r]
    updates = [r for r in rows if "losses/grad_norm" in r]
    with_grad = [r for r in updates if r["losses/grad_norm"] > 0]
    triggered = [r for r in updates if r.get("mugrpo/triggered_frac", 0) > 0]
    kl = values(updates, "losses/approx_kl")
    entropy = values(updates, "losses/entropy")
    return {
        "arm": args["exp_name"],
        "seed": args["seed"],
        "pass1_before": evals[0]["eval/pass@1"],
        "pass1_after": evals[-1]["eval/pass@1"],
        "pass2_after": evals[-1].get(f"eval/pass@{max(args['eval_k'])}"),  # the largest k evaluated
        "with_grad": len(with_grad),
        "updates": len(updates),
        "clipfrac_max": max(values(updates, "losses/clipfrac"), default=None),
        "triggers": [r["update"] for r in triggered],
        "triggered_frac": statistics.mean(values(triggered, "mugrpo/triggered_frac")) if triggered else 0.0,
        "vetoed_frac": statistics.mean(values(triggered, "mugrpo/vetoed_token_frac") or [0.0]) if triggered else 0.0,
        "kl_mean": statistics.mean(kl) if kl else None,
        "kl_max": max(kl, default=None),
        "entropy_first": entropy[0] if entropy else None,
        "entropy_last": entropy[-1] if entropy else None,
        "reward": values(rows, "rollout/reward_mean"),
        "truncated": values(rows, "rollout/truncated_frac"),
        "len_before": evals[0].get("eval/response_len_mean"),
        "len_after": evals[-1].get("eval/response_len_mean"),
    }


def main(out_dir):
    runs = [
        summarise(*load(d)) for d in sorted(glob.glob(os.path.join(out_dir, "*"))) if os.path.exists(os.path.join(d, ".done"))
    ]
    if not runs:
        sys.exit(f"no finished runs (with a .done marker) under {out_dir}: run docs/studies/mugrpo_study.sh first")
    print(
        "| arm | seed | pass@1 before -> after | pass@k after | updates with gradient | max clipfrac "
        "| trigger updates (triggered / vetoed frac there) | KL mean / max | entropy first -> last "
        "| train reward per stage | truncated per stage | eval len before -> after |"
    )
    print("|---" * 12 + "|")
    for r in sorted(runs, key=lambda r: (r["arm"], r["seed"])):
        trig = (
            f"{len(r['triggers'])}: u{','.join(map(str, r['triggers'][:6]))}"
            f"{'...' if len(r['triggers']) > 6 else ''} ({r['triggered_frac']:.2f} / {r['vetoed_frac']:.2f})"
            if r["triggers"]
            else "0"
        )
        print(
            f"| {r['arm']} | {r['seed']} | {fmt(r['pass1_before'])} -> {fmt(r['pass1_after'])} "
            f"| {fmt(r['pass2_after'])} | {r['with_grad']} of {r['updates']} | {fmt(r['clipfrac_max'])} | {trig} "
            f"| {fmt(r['kl_mean'], 2)} / {fmt(r['kl_max'], 2)} | {fmt(r['entropy_first'], 2)} -> "
            f"{fmt(r['entropy_last'], 2)} | {' '.join(fmt(v) for v in r['reward'])} "
            f"| {' '.join(fmt(v, 2) for v in r['truncated'])} | {fmt(r['len_before'], 1)} -> {fmt(r['len_after'], 1)} |"
        )
    print("\nPer arm, mean +- std over seeds (n = seeds):\n")
    print("| arm | n | pass@1 after | pass@1 after - before | updates with a trigger | KL mean | entropy last |")
    print("|---" * 7 + "|")
    arms = sorted({r["arm"] for r in runs})
    for arm in arms:
        rs = [r for r in runs if r["arm"] == arm]

        def ms(xs):
            xs = [x for x in xs if x is not None]
            if not xs:
                return "-"
            return f"{statistics.mean(xs):.3f} +- {statistics.stdev(xs) if len(xs) > 1 else 0.0:.3f}"

        print(
            f"| {arm} | {len(rs)} | {ms([r['pass1_after'] for r in rs])} "
            f"| {ms([r['pass1_after'] - r['pass1_before'] for r in rs])} | {ms([len(r['triggers']) for r in rs])} "
            f"| {ms([r['kl_mean'] for r in rs])} | {ms([r['entropy_last'] for r in rs])} |"
        )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python docs/studies/mugrpo_runs.py RUNS_DIR  (e.g. runs/study_mugrpo)")
    main(sys.argv[1])
