"""How one step of grpo.py's code path grows with the work: G in (4, 8, 16) x completion length (32, 64, 128)
at a fixed number of prompts, on CPU with the HF engine and the embedded model.

All cells run in one process after a small warm-up call, one `grpo.main` call per cell (fresh model,
fresh optimizer, one update per rollout batch); the timed step is the cell's step(s) from its metrics
rows (perf/rollout_s + perf/train_s + reward + sync; the tiny evaluation before/after is not in them).
With --steps 2 the first step of each cell is dropped as a warm-up. Completions are forced to the full
length (references.full_length_rows: no row ends at EOS, bench-only) unless --natural, so that "length 128" means 128
generated tokens per row; the actual mean completion length and the truncated fraction are printed
anyway. Peak resident memory per cell: VmHWM, reset before each cell through /proc/self/clear_refs.

    flock /tmp/cpu.lock python bench/scaling.py                    # all 9 cells, 1 step each
    flock /tmp/cpu.lock python bench/scaling.py --cells 4:64,8:64,16:64,8:32,8:128   # the cross only
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def proc_status_gb(field: str) -> float:
    """A memory field of /proc/self/status in GB: VmHWM (peak resident, resettable) or VmRSS (current)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def peak_rss_gb() -> float:
    return proc_status_gb("VmHWM")


def _busy_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)  # (busy, total), idle and iowait excluded from busy


class OthersLoad:
    """Average number of cores kept busy by OTHER processes while the block runs (machine busy time minus
    this process's own CPU time), so that a contended measurement shows itself in the table."""

    def __enter__(self):
        self.busy0, self.t0, self.own0 = _busy_jiffies()[0], time.time(), sum(os.times()[:2])
        return self

    def __exit__(self, *exc):
        busy = (_busy_jiffies()[0] - self.busy0) / os.sysconf("SC_CLK_TCK")
        self.cores = max(0.0, busy - (sum(os.times()[:2]) - self.own0)) / max(time.time() - self.t0, 1e-9)
        return False


def wait_quiet(max_wait_s: float = 300.0, threshold: float = 0.3) -> float:
    """Wait (at most max_wait_s) until other processes use less than `threshold` cores; returns their load."""
    deadline = time.time() + max_wait_s
    while True:
        with OthersLoad() as load:
            time.sleep(3)
        if load.cores < threshold or time.time() > deadline:
            return load.cores


def run_cell(G: int, T: int, o, force: bool) -> dict:
    import grpo
    import models
    from tests import references

    restore = references.full_length_rows() if force else None  # bench-only: every row runs T tokens
    out_dir = tempfile.mkdtemp(prefix="bench_scaling_")
    args = grpo.Args(
        model=models.EMBEDDED_MODEL,
        dataset="arith",
        engine="hf",
        seed=o.seed,
        total_steps=o.steps,
        prompts_per_step=o.prompts,
        num_generations=G,
        max_new_tokens=T,
        updates_per_batch=1,
        eval_limit=1,
        eval_samples=1,
        eval_k=[1],
        output_dir=out_dir,
        run_name="run",
    )
    gc.collect()
    try:  # hand freed heap back to the OS so the previous cell's memory does not count in this one
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    wait_quiet(o.wait_quiet)
    reset_peak_rss()
    try:
        with OthersLoad() as others:
            grpo.main(args)
    finally:
        if restore:
            restore()
    peak = peak_rss_gb()
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "run", "metrics.jsonl")) if line.strip()]
    rows = [r for r in rows if "perf/rollout_s" in r]
    rows = rows[1:] if len(rows) > 1 else rows  # drop the warm-up step when there is more than one
    n = len(rows)
    B = o.prompts * G

    def mean(key):
        return sum(r[key] for r in rows) / n

    step_s = sum(r["perf/rollout_s"] + r["perf/train_s"] + r["perf/sync_s"] + r.get("perf/reward_s", 0.0) for r in rows) / n
    tokens = mean("rollout/response_len_mean") * B
    return {
        "G": G,
        "T": T,
        "B": B,
        "steps_measured": n,
        "step_s": step_s,
        "gen_s": mean("perf/rollout_s"),
        "train_s": mean("perf/train_s"),
        "completion_len": mean("rollout/response_len_mean"),
        "truncated_frac": mean("rollout/truncated_frac"),
        "tokens": tokens,
        "tok_per_s": tokens / step_s,
        "peak_rss_gb": peak,
        "others_load_cores": others.cores,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--G", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--cells", default="", help="explicit cells G:T,G:T,... instead of the --G x --lengths grid")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--steps", type=int, default=1, help="steps per cell; with 2+ the first is dropped")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--natural", action="store_true", help="let completions stop at EOS (no full_length_rows)")
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=300.0,
        help="before each cell, wait up to this many seconds for other processes to go quiet",
    )
    p.add_argument("--results", default=os.path.join(ROOT, "bench", "results"))
    o = p.parse_args()
    os.makedirs(o.results, exist_ok=True)
    print("warm-up call (not reported)", flush=True)
    warm = argparse.Namespace(**{**vars(o), "steps": 1, "prompts": 2})
    run_cell(2, 8, warm, force=not o.natural)
    grid = (
        [tuple(int(x) for x in c.split(":")) for c in o.cells.split(",")]
        if o.cells
        else [(G, T) for G in o.G for T in o.lengths]
    )
    cells = []
    for G, T in grid:
        t0 = time.time()
        cell = run_cell(G, T, o, force=not o.natural)
        cells.append(cell)
        print(
            f"cell G={G} T={T}: step {cell['step_s']:.1f}s (gen {cell['gen_s']:.1f}s, train {cell['train_s']:.1f}s), "
            f"{cell['completion_len']:.1f} tokens/row, peak RSS {cell['peak_rss_gb']:.2f} GB, "
            f"others' load {cell['others_load_cores']:.2f} cores, "
            f"cell wall {time.time() - t0:.0f}s",
            flush=True,
        )
    base = next((c for c in cells if c["G"] == 8 and c["T"] == 64), cells[0])
    lines = [
        "| G | max completion | B = P x G | mean completion tokens | truncated | step s | generation s | train s | "
        "completion tokens/s | s per 1k tokens | step vs G=8,T=64 | peak RSS GB | others' load (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        lines.append(
            f"| {c['G']} | {c['T']} | {c['B']} | {c['completion_len']:.1f} | {c['truncated_frac']:.2f} | "
            f"{c['step_s']:.1f} | {c['gen_s']:.1f} | {c['train_s']:.1f} | {c['tok_per_s']:.1f} | "
            f"{1000 * c['step_s'] / max(c['tokens'], 1):.1f} | {c['step_s'] / base['step_s']:.2f}x | "
            f"{c['peak_rss_gb']:.2f} | {c['others_load_cores']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with open(os.path.join(o.results, f"scaling_{stamp}.json"), "w") as f:
        json.dump({"args": vars(o), "cells": cells, "table": table}, f, indent=1)
    with open(os.path.join(o.results, f"scaling_{stamp}.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
