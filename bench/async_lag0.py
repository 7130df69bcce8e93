"""--async-lag 0 against the synchronous run on this machine's cores: the same prompts and seeds, the same weights
published before each batch, but the producer and the trainer each have their own torch threads (on 2 cores one
each, where the synchronous run uses both), so their sums round differently. Prints, per step, whether the
completions and rewards are the same and the largest relative difference of every other non-timing metric.

    flock /tmp/cpu.lock python bench/async_lag0.py [--script grpo] [--steps 4] [--out /tmp/async_lag0] [extra flags]

Measured figures: docs/async.md ("Lag 0 with more threads").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script: str, out: str, name: str, steps: int, extra: list[str]) -> tuple[list[dict], list[dict]]:
    flags = ["--total-steps", str(steps), "--eval-limit", "8", "--log-rollouts-every", "1"]
    flags += ["--output-dir", out, "--run-name", name, *extra]
    subprocess.run([sys.executable, os.path.join(ROOT, f"{script}.py"), *flags], check=True, cwd=ROOT)
    with open(os.path.join(out, name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if "losses/policy_loss" in line]
    with open(os.path.join(out, name, "rollouts.jsonl")) as f:
        rollouts = [json.loads(line) for line in f]
    return rows, rollouts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--script", default="grpo")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="/tmp/async_lag0")
    args, extra = parser.parse_known_args()
    sync_rows, sync_rollouts = run(args.script, args.out, "sync", args.steps, extra)
    lag_rows, lag_rollouts = run(args.script, args.out, "lag0", args.steps, ["--async-lag", "0", *extra])
    for step in range(1, args.steps + 1):
        a = [r for r in sync_rollouts if r["step"] == step]
        b = [r for r in lag_rollouts if r["step"] == step]
        same_rows = [r["completion"] for r in a] == [r["completion"] for r in b]
        same_rewards = [r["reward"] for r in a] == [r["reward"] for r in b]
        worst, key = 0.0, None
        for x, y in zip((r for r in sync_rows if r["step"] == step), (r for r in lag_rows if r["step"] == step)):
            for k, v in x.items():
                if k.startswith("perf/") or k == "wall_s" or not isinstance(v, float) or k not in y:
                    continue
                rel = abs(v - y[k]) / max(abs(v), 1e-12)
                if rel > worst:
                    worst, key = rel, k
        print(f"step {step}: completions same {same_rows}, rewards same {same_rewards}, ", end="")
        print(f"largest relative difference {worst:.2e} ({key})")


if __name__ == "__main__":
    main()
