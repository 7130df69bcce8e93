"""The learning loop on CPU: does each method raise its training accuracy on a small fixed problem set?

    flock /tmp/cpu.lock python bench/learning_loop.py                         # every arm, then the table
    flock /tmp/cpu.lock python bench/learning_loop.py --arms grpo --steps 4   # a quick look

The problem set is built in (PROBLEMS: 10 one-digit sums and 10 differences, fixed; the scripts hold out 4 of them
for evaluation, so 16 are trained on), chosen so that the embedded SmolLM2-135M-Instruct solves them between 20%
and 80% of the time before training: step 1's rollouts come from the untrained model, so step 1's training
accuracy is the start, and an arm whose start falls outside the band stops the benchmark. Each arm trains on the
set at T = 0.6 with the script's defaults otherwise (8 prompts x 8 rollouts per step, lr 1e-5), and its training accuracy
(rollout/reward_mean: arith rewards are 0 or 1) is reported per step, with the means of the first and last three
steps. Arms: the four scripts and grpo with --dynamic-sampling. The table goes to bench/results/learning_loop.md,
the runs to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBLEMS = [(a, "+", b) for a, b in ((2, 3), (4, 5), (6, 2), (7, 1), (3, 3), (8, 1), (5, 4), (6, 3), (2, 7), (4, 4))]
PROBLEMS += [(a, "-", b) for a, b in ((9, 4), (7, 2), (8, 5), (6, 1), (9, 7), (5, 3), (8, 2), (7, 4), (6, 4), (9, 1))]
ARMS = {
    "grpo": ("grpo", []),
    "gapo": ("gapo", []),
    "mugrpo": ("mugrpo", ["--prompts-per-step", "8", "--updates-per-batch", "2"]),
    "codapo": ("codapo", []),
    "grpo_dynamic": ("grpo", ["--dynamic-sampling"]),
}
BAND = (0.2, 0.8)
TEMPERATURE = 0.6  # sampling and trainer log-prob temperature (at T = 1 the default arith run starts near 5%)


def write_problems(path: str) -> str:
    with open(path, "w") as f:
        for a, op, b in PROBLEMS:
            answer = a + b if op == "+" else a - b
            f.write(json.dumps({"question": f"What is {a} {op} {b}?", "answer": str(answer)}) + "\n")
    return path


def train(arm: str, data: str, out: str, steps: int, seed: int, python: str) -> list[float]:
    script, extra = ARMS[arm]
    flags = ["--dataset", data, "--reward", "arith", "--total-steps", str(steps), "--temperature", str(TEMPERATURE)]
    flags += ["--seed", str(seed), "--eval-samples", "2", "--eval-k", "2", "--output-dir", out]
    flags += ["--run-name", f"{arm}_s{seed}", "--exp-name", arm, *extra]
    subprocess.run([python, os.path.join(ROOT, f"{script}.py"), *flags], check=True, cwd=ROOT)
    with open(os.path.join(out, f"{arm}_s{seed}", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "learning_loop"))
    p.add_argument("--results", default=os.path.join(ROOT, "bench", "results", "learning_loop.md"))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    data = write_problems(os.path.join(a.out, "problems.jsonl"))
    curves = {}
    for arm in a.arms:
        curves[arm] = train(arm, data, a.out, a.steps, a.seed, sys.executable)
        if not BAND[0] <= curves[arm][0] <= BAND[1]:
            sys.exit(f"{arm}: start accuracy {curves[arm][0]:.3f} is outside {BAND}: change PROBLEMS")
    start = {arm: curve[0] for arm, curve in curves.items()}
    lines = [
        f"Training accuracy (rollout/reward_mean) per step on the {len(PROBLEMS)} built-in problems (16 trained on); "
        f"step 1 is the untrained model's (start: {', '.join(f'{k} {v:.2f}' for k, v in start.items())}); "
        f"seed {a.seed}, {a.steps} steps. Command: python bench/learning_loop.py --steps {a.steps} --seed {a.seed}",
        "",
        "| arm | " + " | ".join(str(s + 1) for s in range(a.steps)) + " | first 3 | last 3 |",
        "|---|" + "---|" * (a.steps + 2),
    ]
    for arm, curve in curves.items():
        first, last = sum(curve[:3]) / 3, sum(curve[-3:]) / 3
        lines.append(f"| {arm} | " + " | ".join(f"{v:.2f}" for v in curve) + f" | {first:.2f} | {last:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(a.results, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
