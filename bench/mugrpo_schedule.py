"""Mu-GRPO's headline, wall clock at equal updates, measured with engines whose switches cost something.

The same 24 optimizer updates on the same 96 prompts x 8 rollouts (4 prompts per update), run by mugrpo.py as
- GRPO's schedule: 12 steps x 8 prompts, 2 updates per step, clip [0.8, 1.2], no veto (many small steps);
- Mu-GRPO's schedule: 3 stages x 32 prompts, 8 updates per stage, clip [0, 5], the H_kappa veto (its defaults);
each with the HF engine (the trainer's own model: a switch costs nothing) and with the CPU build of vLLM (a
separate copy of the weights: every switch pushes them, and every generate call is one batch to its scheduler).
Both schedules draw the same prompts in the same order (PromptSampler with the same seed). Every run evaluates
before and after training on the same held-out problems. The table reads each run's metrics.jsonl: time per phase
(rollout, sync = wake + weight push + sleep, train, eval), rollout tokens and tokens/s, and the process time
including start-up (model load, vLLM's compile).

Runs in the vLLM venv (docs/vllm.md), one run at a time:

    flock /tmp/cpu.lock /path/to/vllm-venv/bin/python bench/mugrpo_schedule.py                 # ~50 min on 2 cores
    flock /tmp/cpu.lock /path/to/vllm-venv/bin/python bench/mugrpo_schedule.py --engines hf    # the HF engine only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCHEDULES = {
    "grpo": ["--total-steps", "12", "--prompts-per-step", "8", "--updates-per-batch", "2"]
    + ["--clip-low", "0.2", "--clip-high", "0.2", "--veto-scope", "none"],
    "mugrpo": ["--total-steps", "3", "--prompts-per-step", "32", "--updates-per-batch", "8"],
}
LABELS = {"grpo": "GRPO: 12 steps x mu 2", "mugrpo": "Mu-GRPO: 3 stages x mu 8"}


def read_run(run_dir: str) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    steps = [r for r in rows if "perf/rollout_s" in r]  # the first update row of each step
    evals = [r for r in rows if "eval/pass@1" in r]
    args = json.load(open(os.path.join(run_dir, "args.json")))
    process_file = os.path.join(run_dir, "process_s.txt")  # written by main() after the run
    B = args["prompts_per_step"] * args["num_generations"]
    tokens = sum(r["rollout/response_len_mean"] * B for r in steps)
    rollout_s = sum(r["perf/rollout_s"] for r in steps)
    return {
        "steps": len(steps),
        "updates": max(r["update"] for r in rows if "update" in r),
        "wall_s": max(r["wall_s"] for r in rows),
        "rollout_s": rollout_s,
        "sync_s": sum(r["perf/sync_s"] for r in steps),
        "train_s": sum(r["perf/train_s"] for r in steps),
        "reward_s": sum(r.get("perf/reward_s", 0.0) for r in steps),
        "rollout_tokens": tokens,
        "rollout_tok_s": tokens / rollout_s,
        "pass1": (evals[0]["eval/pass@1"], evals[-1]["eval/pass@1"]),
        "reward_mean": sum(r["rollout/reward_mean"] for r in steps) / len(steps),
        "process_s": float(open(process_file).read()) if os.path.exists(process_file) else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    p.add_argument("--output-dir", default=os.path.join(ROOT, "runs", "mugrpo_schedule"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--eval-limit", type=int, default=40, help="held-out problems per evaluation (2 samples each)")
    p.add_argument("--results", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--table-only", action="store_true", help="print the table of the runs already in --output-dir")
    o = p.parse_args()
    common = ["--seed", str(o.seed), "--eval-limit", str(o.eval_limit), "--eval-samples", "2", "--eval-k", "2"]
    runs = {}
    for engine in o.engines:
        for schedule in ("grpo", "mugrpo"):
            name = f"{schedule}_{engine}_s{o.seed}"
            if o.table_only:
                runs[(engine, schedule)] = read_run(os.path.join(o.output_dir, name))
                continue
            cmd = [sys.executable, "mugrpo.py", "--engine", engine, *common, *SCHEDULES[schedule]]
            cmd += ["--output-dir", o.output_dir, "--run-name", name]
            print(" ".join(cmd[1:]), flush=True)
            t0 = time.time()
            with open(os.path.join(o.results, f"mugrpo_schedule_{name}.log"), "w") as log:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                sys.exit(f"{name} failed (exit {rc}): see {log.name}")
            runs[(engine, schedule)] = {**read_run(os.path.join(o.output_dir, name)), "process_s": time.time() - t0}
            print(f"  done in {runs[(engine, schedule)]['process_s']:.0f} s", flush=True)
            with open(os.path.join(o.output_dir, name, "process_s.txt"), "w") as f:
                f.write(f"{runs[(engine, schedule)]['process_s']:.1f}\n")
    lines = [
        "| engine | schedule | process s | wall s | rollout s | sync s | train s | eval s | other s | "
        "rollout tokens | rollout tok/s | rollout / train s per 1k tokens | mean reward | pass@1 before -> after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (engine, schedule), r in runs.items():
        eval_s = r["wall_s"] - r["rollout_s"] - r["sync_s"] - r["train_s"] - r["reward_s"]  # the rest is evaluation
        lines.append(
            f"| {engine} | {LABELS[schedule]} | {r['process_s']:.0f} | {r['wall_s']:.0f} | {r['rollout_s']:.1f} | "
            f"{r['sync_s']:.1f} | {r['train_s']:.1f} | {eval_s:.1f} | {r['process_s'] - r['wall_s']:.0f} | "
            f"{r['rollout_tokens']:.0f} | {r['rollout_tok_s']:.1f} | {1000 * r['rollout_s'] / r['rollout_tokens']:.1f} / "
            f"{1000 * r['train_s'] / r['rollout_tokens']:.1f} | {r['reward_mean']:.3f} | "
            f"{r['pass1'][0]:.3f} -> {r['pass1'][1]:.3f} |"
        )
    lines.append("")
    lines.append(
        "process s: the whole `python mugrpo.py` (imports, model load, vLLM start-up and compile, checks); wall s: "
        "from the first evaluation to the end (metrics.jsonl wall_s); other s = process - wall; eval s = wall - "
        "rollout - sync - train - reward. Each run has "
        + ", ".join(f"{e}/{s}: {r['steps']} steps, {r['updates']} updates" for (e, s), r in runs.items())
        + "."
    )
    table = "\n".join(lines)
    print(table)
    if o.table_only:
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with open(os.path.join(o.results, f"mugrpo_schedule_{stamp}.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(o.results, f"mugrpo_schedule_{stamp}.json"), "w") as f:
        json.dump({f"{e}/{s}": r for (e, s), r in runs.items()}, f, indent=1)


if __name__ == "__main__":
    main()
