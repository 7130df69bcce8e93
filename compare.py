"""Put runs side by side: a markdown table (mean +- std over seeds) and PNG curves.

    python compare.py runs/*                      # every run folder under runs/
    python compare.py runs/grpo__s1 runs/gapo__s1 --plot-dir plots --plot-name study

Runs are grouped by method (`exp_name` in args.json) and configuration (every argument except the seed and
the bookkeeping ones such as run name and output folder). Runs of different configurations are never
averaged together: they become separate rows, and the table lists the settings that differ between rows.
Plots (reward and eval pass@1 against optimizer updates and against wall time, one colour per row, a band over seeds)
need matplotlib; without it the table still prints and the script says so.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from dataclasses import dataclass, field

ABSENT = "<absent>"
# arguments that do not change what a run computes, so runs differing only in these are seeds of one config
BOOKKEEPING = {"seed", "run_name", "output_dir", "resume", "track", "wandb_project", "save_every", "eval_only",
               "config", "log_rollouts_every"}


@dataclass
class Run:
    path: str
    args: dict
    rows: list[dict]

    @property
    def method(self) -> str:
        return self.args.get("exp_name", os.path.basename(self.path).split("__")[0])

    @property
    def config(self) -> tuple:
        return tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in self.args.items() if k not in BOOKKEEPING))

    def evals(self) -> list[dict]:
        return [r for r in self.rows if "eval/pass@1" in r]

    def training(self) -> list[dict]:
        return [r for r in self.rows if "rollout/reward_mean" in r]


@dataclass
class Group:
    method: str
    config: tuple
    runs: list[Run] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.method


def load_run(path: str) -> Run | None:
    metrics = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(metrics):
        return None
    args = {}
    if os.path.isfile(os.path.join(path, "args.json")):
        with open(os.path.join(path, "args.json")) as f:
            args = json.load(f)
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return Run(path, args, rows)


def group_runs(runs: list[Run]) -> list[Group]:
    groups: dict[tuple, Group] = {}
    for run in runs:
        key = (run.method, run.config)
        groups.setdefault(key, Group(run.method, run.config)).runs.append(run)
    return list(groups.values())


def differing_settings(groups: list[Group]) -> dict[str, list]:
    """Settings (excluding exp_name) whose value is not the same in every row, as {key: [value or ABSENT per row]}.

    A setting that only some methods have (e.g. GAPO's clip_high_max) is compared among the rows that have it:
    it is listed when those rows disagree, or when some runs of one method have it and others do not."""
    configs = [dict(g.config) for g in groups]
    keys = sorted(set().union(*configs)) if configs else []
    out = {}
    for k in keys:
        if k == "exp_name":
            continue
        values = [c.get(k, ABSENT) for c in configs]
        present = {v for v in values if v != ABSENT}
        has_key = {}  # method -> set of booleans "this row has the key"
        for g, v in zip(groups, values):
            has_key.setdefault(g.method, set()).add(v != ABSENT)
        if len(present) > 1 or any(len(flags) > 1 for flags in has_key.values()):
            out[k] = values
    return out


def mean_std(values: list[float]) -> tuple[float, float] | None:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return None
    m = sum(values) / len(values)
    s = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return m, s


def fmt(ms: tuple[float, float] | None, n: int, digits: int = 3) -> str:
    if ms is None:
        return "-"
    return f"{ms[0]:.{digits}f} +- {ms[1]:.{digits}f}" if n > 1 else f"{ms[0]:.{digits}f}"


def pass_keys(groups: list[Group]) -> list[str]:
    keys = set()
    for g in groups:
        for r in g.runs:
            for row in r.evals():
                keys.update(k for k in row if k.startswith("eval/pass@") and k != "eval/pass@1")
    return sorted(keys, key=lambda k: int(k.split("@")[1]))


def table(groups: list[Group]) -> str:
    ks = pass_keys(groups)
    diff = differing_settings(groups)
    header = ["method", "seeds", "pass@1 before", "pass@1 after"]
    for k in ks:
        header += [f"{k[5:]} before", f"{k[5:]} after"]
    header += ["wall s", "rollout s", "train s", "sync s", "other s (load, eval, scoring)"]
    if diff:
        header.append("settings that differ")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, g in enumerate(groups):
        n = len(g.runs)
        seeds = ",".join(str(r.args.get("seed", "?")) for r in g.runs)
        cells = [g.label, f"{n} ({seeds})"]
        for key in ["eval/pass@1"] + ks:
            before = [r.evals()[0].get(key) if r.evals() and r.evals()[0].get("step", 0) == 0 else None for r in g.runs]
            after = [r.evals()[-1].get(key) if r.evals() and r.evals()[-1].get("step", 0) > 0 else None for r in g.runs]
            cells += [fmt(mean_std(before), n), fmt(mean_std(after), n)]
        walls = [max((row.get("wall_s", 0.0) for row in r.rows), default=0.0) for r in g.runs]
        phases = {p: [sum(row.get(f"perf/{p}_s", 0.0) for row in r.training()) for r in g.runs]
                  for p in ("rollout", "train", "sync", "reward")}
        other = [w - sum(phases[p][j] for p in ("rollout", "train", "sync")) for j, w in enumerate(walls)]
        cells += [fmt(mean_std(walls), n, 0), fmt(mean_std(phases["rollout"]), n, 0), fmt(mean_std(phases["train"]), n, 0),
                  fmt(mean_std(phases["sync"]), n, 1), fmt(mean_std(other), n, 0)]
        if diff:
            # a row shows the settings it has; a missing one only when another run of the same method has it
            same_method = [j for j, h in enumerate(groups) if h.method == g.method]
            cells.append(", ".join(
                f"{k}={json.loads(v[i])}" if v[i] != ABSENT else f"{k}={ABSENT}" for k, v in diff.items()
                if v[i] != ABSENT or any(v[j] != ABSENT for j in same_method)))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def warnings_for(groups: list[Group]) -> list[str]:
    out = []
    methods = {}
    for g in groups:
        methods.setdefault(g.method, []).append(g)
    for m, gs in methods.items():
        if len(gs) > 1:
            out.append(f"note: {m} has {len(gs)} configurations; they are separate rows, not averaged together")
    diff = differing_settings(groups)
    if diff:
        out.append("note: rows differ in: " + ", ".join(sorted(diff)))
    return out


def plot(groups: list[Group], out_dir: str, name: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib); the table above is complete")
        return []
    os.makedirs(out_dir, exist_ok=True)
    # x = optimizer updates, not steps: a Mu-GRPO stage or a CoDaPO focused step holds a different number of
    # updates than a grpo.py step, and updates are the budget the methods are compared at
    panels = [("rollout/reward_mean", "update", "training reward"), ("rollout/reward_mean", "wall_s", "training reward"),
              ("eval/pass@1", "update", "eval pass@1"), ("eval/pass@1", "wall_s", "eval pass@1")]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, xkey, title) in zip(axes.flat, panels):
        for i, g in enumerate(groups):
            colour = colours[i % len(colours)]
            curves = []
            for r in g.runs:
                pts = [(row[xkey], row[key]) for row in r.rows if key in row and xkey in row]
                if pts:
                    curves.append(pts)
            if not curves:
                continue
            # align seeds by point index (same schedule within a configuration)
            length = min(len(c) for c in curves)
            xs = [sum(c[j][0] for c in curves) / len(curves) for j in range(length)]
            stats = [mean_std([c[j][1] for c in curves]) for j in range(length)]
            means = [s[0] for s in stats]
            ax.plot(xs, means, color=colour, label=f"{g.label} (n={len(curves)})", marker="o" if key.startswith("eval") else None)
            if len(curves) > 1:
                lows = [min(c[j][1] for c in curves) for j in range(length)]
                highs = [max(c[j][1] for c in curves) for j in range(length)]
                ax.fill_between(xs, lows, highs, color=colour, alpha=0.2)
        ax.set_xlabel("optimizer updates" if xkey == "update" else "wall time (s)")
        ax.set_title(f"{title} vs {'updates' if xkey == 'update' else 'wall time'}")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("band: min-max over seeds")
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return [path]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run folders (or globs) holding metrics.jsonl and args.json")
    parser.add_argument("--plot-dir", default="plots", help="where PNG curves go")
    parser.add_argument("--plot-name", default="compare", help="PNG file name (without .png)")
    parser.add_argument("--no-plot", action="store_true", help="table only")
    args = parser.parse_args(argv)
    paths = []
    for pattern in args.runs:
        paths += sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
    runs = [r for r in (load_run(p) for p in paths) if r is not None]
    skipped = [p for p in paths if load_run(p) is None]
    for p in skipped:
        print(f"skipping {p}: no metrics.jsonl", file=sys.stderr)
    if not runs:
        print("error: no run folder with a metrics.jsonl among the given paths", file=sys.stderr)
        return 2
    groups = group_runs(runs)
    print(table(groups))
    for w in warnings_for(groups):
        print(w)
    if not args.no_plot:
        for path in plot(groups, args.plot_dir, args.plot_name):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
