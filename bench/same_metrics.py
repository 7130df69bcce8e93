"""Short runs of all five scripts, and the comparison of two sets of them: does a refactor change a number?

    flock /tmp/cpu.lock python bench/same_metrics.py run --root /path/to/checkout --out /tmp/before
    flock /tmp/cpu.lock python bench/same_metrics.py run --root . --out /tmp/after
    python bench/same_metrics.py compare /tmp/before /tmp/after

`run` starts each script of RUNS from the checkout `--root` (the embedded model, a few steps, small batches; one
run under torchrun with 2 gloo ranks) and keeps its metrics.jsonl; `compare` reads two such folders and prints,
per run and key, the largest relative difference of every non-timing metric (perf/*_s, perf/tokens_per_s,
perf/peak_mem_gb and wall_s are timings) and every key present in one set only. Exit 1 when a difference exceeds
--tol (keys named with --except are reported, not counted).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

SHORT = [
    "--total-steps", "2", "--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "24",
    "--eval-limit", "8", "--eval-samples", "2", "--eval-k", "2",
]  # fmt: skip
RUNS = {  # name: (script, extra flags, processes)
    "grpo": ("grpo", [], 1),
    "grpo_seq_beta_tis": ("grpo", ["--loss-agg", "seq-mean-token-mean", "--beta", "0.05", "--rollout-is", "token-tis"], 1),
    "grpo_drgrpo_seqmask": ("grpo", ["--loss-agg", "seq-mean-token-sum-norm", "--rollout-is", "seq-mask"], 1),
    "gapo_token": ("gapo", [], 1),
    "gapo_sequence_focal": (
        "gapo",
        ["--clip-level", "sequence", "--clip-low", "3e-3", "--clip-high-max", "5e-3", "--focal-gamma", "1"],
        1,
    ),  # fmt: skip
    "mugrpo_icepop": ("mugrpo", ["--prompts-per-step", "8", "--updates-per-batch", "4", "--rollout-is", "icepop"], 1),
    "mugrpo_behav_engine": ("mugrpo", ["--prompts-per-step", "8", "--updates-per-batch", "4", "--behav-logp", "engine"], 1),
    "codapo": ("codapo", ["--total-steps", "3"], 1),
    "codapo_dual_drgrpo": ("codapo", ["--total-steps", "3", "--dual-clip-c", "3", "--loss-agg", "seq-mean-token-sum-norm"], 1),
    "grpo_two_ranks": ("grpo", ["--beta", "0.05"], 2),
    "opd": ("opd", ["--teacher", "smollm2-135m"], 1),  # the embedded model as its own teacher: every number still computed
}
TIMING = ("wall_s",)


def is_timing(key: str) -> bool:
    return key in TIMING or (
        key.startswith("perf/") and (key.endswith("_s") or key in ("perf/tokens_per_s", "perf/peak_mem_gb"))
    )


def run(root: str, out: str, only: list[str]) -> None:
    os.makedirs(out, exist_ok=True)
    for name, (script, extra, nproc) in RUNS.items():
        if only and name not in only:
            continue
        flags = [*SHORT, *extra, "--output-dir", out, "--run-name", name]
        # a later flag wins in argparse: the run's own --total-steps / --prompts-per-step override SHORT's
        path = os.path.join(root, f"{script}.py")
        if nproc == 1:
            cmd = [sys.executable, path, *flags]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", path, *flags]
        env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2" if nproc == 1 else "1"))
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-3000:])
            raise SystemExit(f"{name} failed with exit code {proc.returncode}")


def rows(folder: str, name: str) -> list[dict]:
    with open(os.path.join(folder, name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def compare(a: str, b: str, tol: float, excepted: list[str]) -> int:
    worst_all, bad = 0.0, 0
    names = sorted(set(os.listdir(a)) & set(os.listdir(b)))
    for name in names:
        ra, rb = rows(a, name), rows(b, name)
        if len(ra) != len(rb):
            print(f"{name}: {len(ra)} rows vs {len(rb)}")
            bad += 1
            continue
        worst: dict[str, float] = {}
        only_a, only_b = set(), set()
        for x, y in zip(ra, rb):
            only_a |= {k for k in x if k not in y and not is_timing(k)}
            only_b |= {k for k in y if k not in x and not is_timing(k)}
            for k in x.keys() & y.keys():
                if is_timing(k) or not isinstance(x[k], (int, float)) or isinstance(x[k], bool):
                    if x[k] != y[k] and not is_timing(k):
                        worst[k] = math.inf
                    continue
                d = abs(x[k] - y[k]) / max(abs(x[k]), abs(y[k]), 1e-12)
                worst[k] = max(worst.get(k, 0.0), d if x[k] != y[k] else 0.0)
        counted = {k: v for k, v in worst.items() if k not in excepted}
        top = max(counted.items(), key=lambda kv: kv[1], default=("-", 0.0))
        line = f"{name}: {len(ra)} rows, {len(worst)} keys, largest relative difference {top[1]:.2g} ({top[0]})"
        for k in excepted:
            if k in worst:
                line += f"; {k} (excepted) {worst[k]:.2g}"
        if only_a:
            line += f"; only in the first: {sorted(only_a)}"
        if only_b:
            line += f"; only in the second: {sorted(only_b)}"
        print(line)
        worst_all = max(worst_all, top[1])
        bad += top[1] > tol
        bad += bool({k for k in only_a | only_b if k not in excepted})
    print(
        f"{len(names)} runs; largest relative difference {worst_all:.2g}; {bad} problem(s) (over {tol:g}, or one-sided keys)"
    )
    return 1 if bad else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--root", default=".", help="the checkout whose scripts run")
    r.add_argument("--out", required=True, help="folder of the run folders")
    r.add_argument("--only", nargs="*", default=[], help="names of RUNS (default: all)")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--tol", type=float, default=0.0, help="largest relative difference allowed (default: none)")
    c.add_argument("--except", dest="excepted", nargs="*", default=[], help="keys reported but not counted")
    args = p.parse_args()
    if args.cmd == "run":
        run(os.path.abspath(args.root), os.path.abspath(args.out), args.only)
    else:
        raise SystemExit(compare(args.a, args.b, args.tol, args.excepted))


if __name__ == "__main__":
    main()
