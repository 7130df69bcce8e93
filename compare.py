"""Put runs side by side: a markdown table per evaluation set under its protocol (each score with its 95 % t-interval
over seeds; one seed: its standard error over problems), a table of times and memory (mean +- std over seeds), and
PNG curves.

    python compare.py runs/*                      # every run folder under runs/
    python compare.py runs/grpo__s1 runs/gapo__s1 --plot-dir plots --plot-name study
    python compare.py runs/study_* --metric 'gapo/clipfrac_c*' --metric mugrpo/vetoed_token_frac --baseline grpo

Runs are grouped by method (`exp_name` in args.json) and configuration (every argument except the seed and
the bookkeeping ones such as run name and output folder). Runs of different configurations are never
averaged together: they become separate rows, and the table lists the settings that differ between rows. A row's
label (in tables and legends) is the method, the LoRA rank, and the values of the settings that differ between the
rows shown ("grpo LoRA r1 lr 1e-4"), so no two rows share one.
Plots (reward and eval pass@1 against optimizer updates and against wall time, one colour per row, a band over seeds)
need matplotlib; without it the table still prints and the script says so. Runs that evaluate during training
(--eval-every) get eval curves; an evaluation before and after training only is two points, not a line.
--metric NAME_OR_GLOB adds a curve and a final-value column per matching logged key; --baseline NAME adds paired
per-seed differences (method - baseline) of the final values and, per evaluation set, a paired bootstrap over
problems of the final evaluation (the same problems and evaluation seed in both runs, from their kept completions).
Runs whose protocol for a set differs (samples, temperature, top-p, token budget, grader, problems, prompt) are never
averaged or paired: one line says so and they stand in rows of their own. See docs/compare.md.
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import glob
import json
import math
import os
import random
import re
import sys
from dataclasses import dataclass, field

ABSENT = "<absent>"
BANDS = {"minmax": "min-max over seeds", "std": "mean +- sample std over seeds"}
# arguments that do not change what a run computes, so runs differing only in these are seeds of one config
BOOKKEEPING = {
    "seed",
    "run_name",
    "output_dir",
    "resume",
    "track",
    "wandb_project",
    "save_every",
    "eval_only",
    "config",
    "log_rollouts_every",
    "keep_last",
}


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
        return [r for r in self.rows if any(is_eval_key(k) for k in r)]

    def training(self) -> list[dict]:
        return [r for r in self.rows if "rollout/reward_mean" in r]


@dataclass
class Group:
    method: str
    config: tuple
    runs: list[Run] = field(default_factory=list)
    label: str = ""  # set by group_runs (label_groups): the name and the settings that tell it from the others shown

    def __post_init__(self):
        self.label = self.label or self.name

    @property
    def name(self) -> str:
        """The method, and the LoRA rank of a LoRA run (--lora-rank > 0), so LoRA and full fine-tuning stand apart."""
        rank = dict(self.config).get("lora_rank")
        rank = json.loads(rank) if rank is not None else 0
        return f"{self.method} LoRA r{rank}" if rank else self.method


def is_eval_key(key: str) -> bool:
    """eval/pass@k, and per-set or per-tier variants such as eval/<set>/pass@k or eval/pass@1/tier3."""
    return key.startswith("eval/") and "pass@" in key


def number(v) -> float | None:
    """A plottable value; None for a missing, null, non-numeric or NaN entry."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


def load_run(path: str) -> Run | None:
    metrics = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(metrics):
        return None
    args = {}
    if os.path.isfile(os.path.join(path, "args.json")):
        with open(os.path.join(path, "args.json")) as f:
            args = json.load(f)
    if isinstance(args.get("eval_dataset"), str):  # runs before several eval sets recorded one name ("" = held-out)
        args["eval_dataset"] = [args["eval_dataset"]] if args["eval_dataset"] else []
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return Run(path, args, rows)


def group_runs(runs: list[Run]) -> list[Group]:
    groups: dict[tuple, Group] = {}
    for run in runs:
        key = (run.method, run.config)
        groups.setdefault(key, Group(run.method, run.config)).runs.append(run)
    out = list(groups.values())
    label_groups(out)
    return out


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


def row_settings(groups: list[Group], diff: dict[str, list] | None = None) -> list[list[tuple[str, str]]]:
    """Per group, the differing settings it shows as [(key, JSON value or ABSENT)]: the ones it has, and a missing
    one only when another group of the same method has it (a setting only some methods have is not a difference)."""
    diff = differing_settings(groups) if diff is None else diff
    out = []
    for i, g in enumerate(groups):
        same_method = [j for j, h in enumerate(groups) if h.method == g.method]
        out.append([(k, v[i]) for k, v in diff.items() if v[i] != ABSENT or any(v[j] != ABSENT for j in same_method)])
    return out


LABEL_NAMES = {"learning_rate": "lr"}  # a setting shown as "<short name> <value>" in a label; others as key=value


def short_value(raw: str) -> str:
    """A setting's JSON value for a label: floats in their shorter form (3e-4, not 0.0003; 0.2, not 2e-1)."""
    if raw == ABSENT:
        return ABSENT
    v = json.loads(raw)
    if isinstance(v, float) and math.isfinite(v):
        fixed = f"{v:.12g}"
        mantissa, exponent = f"{v:.12e}".split("e")
        sci = f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
        return sci if len(sci) < len(fixed) else fixed
    if isinstance(v, (list, dict)):
        return json.dumps(v, separators=(",", ":"))
    return str(v)


def label_groups(groups: list[Group]) -> None:
    """Give every group a label: its name (method, LoRA rank) and the values of the settings that differ between
    the groups shown (learning rate first, as "lr 3e-4", then key=value), so whatever tells two groups apart is in
    their labels. Groups that would still share a label (e.g. a setting absent in one and at its default in the
    other) spell every differing setting as key=<JSON value>; no two groups ever get the same label."""
    settings = row_settings(groups)

    def order(setting: tuple[str, str]) -> tuple:  # the short-named ones (the learning rate) first, then by name
        return setting[0] not in LABEL_NAMES, setting[0]

    def short(i: int) -> str:
        parts = [
            f"{LABEL_NAMES[k]} {short_value(v)}" if k in LABEL_NAMES else f"{k}={short_value(v)}"
            for k, v in sorted(settings[i], key=order)
            if k != "lora_rank"  # in the name (LoRA rN); rank 0 = full fine-tuning: the method alone
        ]
        return " ".join([groups[i].name, *parts])

    def raw(i: int) -> str:
        return " ".join([groups[i].name, *(f"{k}={v}" for k, v in sorted(settings[i], key=order))])

    def with_folder(i: int) -> str:  # a last resort; raw labels of different configurations always differ
        return f"{labels[i]} ({os.path.basename(groups[i].runs[0].path)})"

    labels = [short(i) for i in range(len(groups))]
    for spell in (raw, with_folder):
        clash = [i for i, lab in enumerate(labels) if labels.count(lab) > 1]
        for i in clash:
            labels[i] = spell(i)
    for g, lab in zip(groups, labels):
        g.label = lab


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
                keys.update(k for k in row if re.fullmatch(r"eval/pass@\d+", k) and k != "eval/pass@1")
    return sorted(keys, key=lambda k: int(k.split("@")[1]))


# ----- uncertainty: the t-interval over seeds, the paired bootstrap over problems


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (Numerical Recipes, betacf)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
            c = 1.0 + aa / c if abs(1.0 + aa / c) > 1e-300 else 1e-300
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom, from the regularized incomplete beta function."""
    x = df / (df + t * t)
    a, b = df / 2.0, 0.5
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    ibeta = front * _betacf(a, b, x) / a if x < (a + 1) / (a + b + 2) else 1.0 - front * _betacf(b, a, 1 - x) / b
    return 1.0 - 0.5 * ibeta if t >= 0 else 0.5 * ibeta


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t (p in (0.5, 1)), by bisection of t_cdf: t_quantile(0.975, 2) = 4.3027."""
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        mid = (low + high) / 2.0
        low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2.0


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """(mean, half-width) of the `level` t-interval of the mean over seeds: t_{(1+level)/2, n-1} * s / sqrt(n) (None
    for no value; half-width None for one)."""
    values = [v for v in values if v is not None and v == v]
    if not values:
        return None
    ms = mean_std(values)
    if len(values) == 1:
        return ms[0], None
    return ms[0], t_quantile((1 + level) / 2, len(values) - 1) * ms[1] / math.sqrt(len(values))


BOOTSTRAP_RESAMPLES = 2000


def paired_bootstrap(diffs: list[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0, level: float = 0.95):
    """(mean, low, high): the mean of per-problem differences and the percentile interval of its bootstrap
    distribution (`resamples` resamples of the problems with replacement, seeded)."""
    rng, N = random.Random(seed), len(diffs)
    means = sorted(sum(rng.choices(diffs, k=N)) / N for _ in range(resamples))
    low = means[int(math.floor((1 - level) / 2 * resamples))]
    high = means[int(math.ceil((1 + level) / 2 * resamples)) - 1]
    return sum(diffs) / N, low, high


# ----- evaluation sets: one table per set and protocol


def run_sets(run: Run) -> list[tuple[str, str]]:
    """(label, key prefix) of every evaluation set of a run: eval/<label>/... in a suite, eval/... for one set (its
    label from eval_protocols.json, else from args.json)."""
    rows = run.evals()
    suite = sorted({k.split("/")[1] for row in rows for k in row if k.count("/") == 2 and k.endswith("/protocol")})
    order = []
    path = os.path.join(run.path, "eval_protocols.json")
    if os.path.isfile(path):
        with open(path) as f:
            order = list(json.load(f))
    if suite:
        return [(label, f"eval/{label}/") for label in sorted(suite, key=lambda s: order.index(s) if s in order else 99)]
    if not rows:
        return []
    names = run.args.get("eval_dataset") or [run.args.get("dataset", "eval")]
    label = order[0] if order else os.path.splitext(os.path.basename(str(names[0]).split("=")[0]))[0] or "eval"
    return [(label, "eval/")]


def set_protocol(run: Run, prefix: str) -> str:
    """The protocol id a run evaluated a set under (its rows' <prefix>protocol; an older run's: its samples and
    temperature)."""
    rows = [row for row in run.evals() if f"{prefix}pass@1" in row]
    if not rows:
        return ABSENT
    row = rows[-1]
    if f"{prefix}protocol" in row:
        return str(row[f"{prefix}protocol"])
    n, t = (
        row.get(f"{prefix}n_samples", row.get("eval/n_samples")),
        row.get(f"{prefix}temperature", row.get("eval/temperature")),
    )
    return f"n={n} T={t} (an older run: no protocol recorded)"


def describe_protocol(run: Run, prefix: str) -> str:
    """`100 of 100 problems, n 4, T 0.6, top-p 1, 32 tokens, grader arith (pass@1 = avg@4)` from a run's eval row."""
    row = next((r for r in reversed(run.evals()) if f"{prefix}pass@1" in r), {})
    get = lambda k: row.get(prefix + k, row.get("eval/" + k) if prefix == "eval/" else None)
    parts = []
    if get("n_problems") is not None:
        parts.append(f"{get('n_problems')} of {get('n_source_problems') or get('n_problems')} problems")
    n, t = get("n_samples"), get("temperature")
    if t == 0:
        parts.append("greedy")
    elif n is not None:
        parts.append(
            f"n {n}"
            + (f", T {t:g}" if t is not None else "")
            + (f", top-p {get('top_p'):g}" if get("top_p") is not None else "")
        )
    if get("max_new_tokens") is not None:
        parts.append(f"{get('max_new_tokens')} tokens")
    if get("grader") is not None:
        parts.append(f"grader {get('grader')}")
    estimator = "greedy" if t == 0 else f"avg@{n}" if n is not None else "?"
    return ", ".join(parts) + f" (pass@1 = {estimator})"


def set_score_keys(runs: list[Run], prefix: str) -> list[str]:
    """The set's pass@k and maj@k keys (without the prefix: pass@1 first), as logged by any of the runs."""
    found = {k[len(prefix) :] for r in runs for row in r.evals() for k in row if k.startswith(prefix)}
    keys = [k for k in found if re.fullmatch(r"(pass|maj)@\d+", k)]
    return sorted(keys, key=lambda k: (not k.startswith("pass"), int(k.split("@")[1])))


def score_cell(values: list[float | None], errors: list[float | None]) -> str:
    """Seeds' values of one score: `mean ± half-width of the 95 % t-interval`; one seed: `value ± SE` (its standard
    error over problems, where logged)."""
    present = [(v, e) for v, e in zip(values, errors) if v is not None]
    if not present:
        return "-"
    if len(present) == 1:
        v, e = present[0]
        return f"{v:.3f} ± {e:.3f} (SE)" if e is not None else f"{v:.3f}"
    mean, half = t_interval([v for v, _ in present])
    return f"{mean:.3f} ± {half:.3f}"


def before_after(run: Run, key: str) -> tuple[dict | None, dict | None]:
    """The run's evaluation row before training (step 0) and its last one after (step > 0) that hold `key`."""
    rows = [row for row in run.evals() if key in row]
    before = rows[0] if rows and rows[0].get("step", 0) == 0 else None
    after = rows[-1] if rows and rows[-1].get("step", 0) > 0 else None
    return before, after


def eval_tables(groups: list[Group]) -> list[tuple[str, str, str, list[Group]]]:
    """(label, prefix, protocol id, groups restricted to the runs of that protocol) for every evaluation set and
    protocol among the runs, in the order the sets appear."""
    seen: dict[tuple[str, str], None] = {}
    for g in groups:
        for r in g.runs:
            for label, prefix in run_sets(r):
                seen.setdefault((label, prefix), None)
    out = []
    for label, prefix in seen:
        by_protocol: dict[str, list[Group]] = {}
        for g in groups:
            runs = [r for r in g.runs if (label, prefix) in run_sets(r)]
            for proto in dict.fromkeys(set_protocol(r, prefix) for r in runs):
                part = [r for r in runs if set_protocol(r, prefix) == proto]
                by_protocol.setdefault(proto, []).append(Group(g.method, g.config, part, g.label))
        for proto, gs in by_protocol.items():
            out.append((label, prefix, proto, gs))
    return out


def protocol_notes(tables) -> list[str]:
    """One line per set evaluated under more than one protocol: those runs are kept apart (never averaged or paired)."""
    count: dict[str, int] = {}
    for label, _, _, _ in tables:
        count[label] = count.get(label, 0) + 1
    return [
        f"note: {label} was evaluated under {n} different protocols; each has its own table, and runs of different "
        "protocols are never averaged or paired"
        for label, n in count.items()
        if n > 1
    ]


def eval_table(label: str, prefix: str, groups: list[Group]) -> str:
    """One evaluation set under one protocol: its description, then a row per group, each score before and after
    training (± the 95 % t-interval over seeds; one seed: ± its standard error over problems)."""
    runs = [r for g in groups for r in g.runs]
    keys = set_score_keys(runs, prefix)
    diff = differing_settings(groups)
    header = ["method", "seeds"] + [f"{k} {when}" for k in keys for when in ("before", "after")]
    if diff:
        header.append("settings that differ")
    settings = row_settings(groups, diff)
    lines = [
        f"{label}: {describe_protocol(runs[0], prefix)}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for i, g in enumerate(groups):
        cells = [g.label, f"{len(g.runs)} ({','.join(str(r.args.get('seed', '?')) for r in g.runs)})"]
        for k in keys:
            rows = [before_after(r, prefix + k) for r in g.runs]
            for j in (0, 1):
                values = [row[j].get(prefix + k) if row[j] else None for row in rows]
                errors = [row[j].get(prefix + k + "_se") if row[j] else None for row in rows]
                cells.append(score_cell(values, errors))
        if diff:
            cells.append(", ".join(f"{k}={json.loads(v) if v != ABSENT else ABSENT}" for k, v in settings[i]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


SCORE_LEGEND = (
    "scores: mean ± the half-width of the 95 % t-interval over seeds (t_{0.975, n-1} s / sqrt(n)); one seed: ± one "
    "standard error over problems (SE)"
)


def table(groups: list[Group]) -> str:
    """Times and memory per group: mean +- sample std over seeds."""
    diff = differing_settings(groups)
    header = ["method", "seeds", "wall s", "rollout s", "train s", "sync s", "other s (load, eval, scoring)", "peak mem GiB"]
    if diff:
        header.append("settings that differ")
    settings = row_settings(groups, diff)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, g in enumerate(groups):
        n = len(g.runs)
        seeds = ",".join(str(r.args.get("seed", "?")) for r in g.runs)
        cells = [g.label, f"{n} ({seeds})"]
        walls = [max((row.get("wall_s", 0.0) for row in r.rows), default=0.0) for r in g.runs]
        phases = {
            p: [sum(row.get(f"perf/{p}_s", 0.0) for row in r.training()) for r in g.runs]
            for p in ("rollout", "train", "sync", "reward")
        }
        other = [w - sum(phases[p][j] for p in ("rollout", "train", "sync")) for j, w in enumerate(walls)]
        cells += [
            fmt(mean_std(walls), n, 0),
            fmt(mean_std(phases["rollout"]), n, 0),
            fmt(mean_std(phases["train"]), n, 0),
            fmt(mean_std(phases["sync"]), n, 1),
            fmt(mean_std(other), n, 0),
            fmt(mean_std([peak_memory(r) for r in g.runs]), n, 2),
        ]
        if diff:
            cells.append(", ".join(f"{k}={json.loads(v) if v != ABSENT else ABSENT}" for k, v in settings[i]))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def problem_scores(run: Run, label: str, prefix: str) -> tuple[list, list[float]] | None:
    """(problem ids, each problem's share of correct samples) of the run's final evaluation of a set, from its kept
    completions (eval_completions_step<step>_<label>.jsonl); None where the file is not there."""
    _, after = before_after(run, prefix + "pass@1")
    if after is None:
        return None
    path = os.path.join(run.path, f"eval_completions_step{after['step']}_{label}.jsonl")
    if not os.path.isfile(path):
        return None
    per: dict[int, list] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                per.setdefault(r["problem"], [r.get("id"), []])[1].append(bool(r["correct"]))
    order = sorted(per)
    return [per[i][0] for i in order], [sum(per[i][1]) / len(per[i][1]) for i in order]


def bootstrap_table(tables, base: Group) -> str:
    """Per evaluation set and protocol, each group against the baseline: the mean over problems of the per-problem
    pass@1 difference (its seeds paired, averaged), with its paired bootstrap interval over problems."""
    lines = [
        f"Paired bootstrap over problems of the final evaluation, method - {base.label} (per-problem pass@1 differences, "
        f"averaged over the seeds paired; 95 % percentile interval of {BOOTSTRAP_RESAMPLES} resamples of the problems):",
        "",
        "| method - baseline | set | pass@1 diff | 95 % bootstrap interval | problems | seeds paired | not paired |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, prefix, _, groups in tables:
        base_part = next((g for g in groups if g.label == base.label), None)
        if base_part is None:
            continue
        base_runs = {r.args.get("seed"): r for r in base_part.runs}
        for g in groups:
            if g is base_part:
                continue
            per_seed, unpaired, ids = [], [], None
            for r in g.runs:
                s = r.args.get("seed")
                other = base_runs.get(s)
                a = problem_scores(r, label, prefix)
                b = problem_scores(other, label, prefix) if other is not None else None
                if other is None:
                    unpaired.append(f"{s} ({g.label} only)")
                elif a is None or b is None:
                    unpaired.append(f"{s} (no kept completions)")
                elif a[0] != b[0] or (ids is not None and a[0] != ids):
                    unpaired.append(f"{s} (other problems)")
                else:
                    ids = a[0]
                    per_seed.append([x - y for x, y in zip(a[1], b[1])])
            if not per_seed:
                row = ["-", "-", "-", "0"]
            else:
                diffs = [sum(col) / len(col) for col in zip(*per_seed)]
                mean, low, high = paired_bootstrap(diffs)
                row = [g4(mean, "+"), f"[{g4(low, '+')}, {g4(high, '+')}]", str(len(diffs)), str(len(per_seed))]
            lines.append(f"| {g.label} - {base.label} | {label} | " + " | ".join(row) + f" | {', '.join(unpaired) or '-'} |")
    return "\n".join(lines)


def peak_memory(run: Run) -> float | None:
    """The run's largest perf/peak_mem_gb (GPU memory allocated, or the process's resident memory on CPU)."""
    values = [v for row in run.rows if (v := number(row.get("perf/peak_mem_gb"))) is not None]
    return max(values) if values else None


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


def logged_keys(groups: list[Group]) -> list[str]:
    return sorted({k for g in groups for r in g.runs for row in r.rows for k, v in row.items() if number(v) is not None})


def nan_notes(groups: list[Group], keys: list[str]) -> list[str]:
    """NaN entries are left out of curves and final values; say where, so a broken run is not hidden."""
    out = []
    for k in keys:
        bad = [
            f"{r.path} ({sum(1 for row in r.rows if row.get(k) != row.get(k))} rows)"
            for g in groups
            for r in g.runs
            if any(row.get(k) != row.get(k) for row in r.rows)
        ]
        if bad:
            out.append(f"note: {k} is NaN in {', '.join(bad)}; those rows are left out")
    return out


def eval_keys(groups: list[Group]) -> list[str]:
    """Every evaluation key: eval/pass@1, eval/pass@k by k, then per-set / per-tier keys by name."""
    found = {k for k in logged_keys(groups) if is_eval_key(k)}
    top = [k for k in ["eval/pass@1"] + pass_keys(groups) if k in found]
    return top + sorted(found - set(top))


def select_metrics(groups: list[Group], patterns: list[str]) -> list[str]:
    """Logged keys named exactly, or matching a glob (fnmatch: * also matches '/'); a pattern matching nothing fails."""
    keys, out = logged_keys(groups), []
    for pattern in patterns:
        matched = [pattern] if pattern in keys else [k for k in keys if fnmatch.fnmatchcase(k, pattern)]
        if not matched:
            close = difflib.get_close_matches(pattern, keys, n=3, cutoff=0.5)
            raise ValueError(
                f"--metric {pattern!r} matches no logged key" + (f" (close: {', '.join(close)})" if close else "")
            )
        out += [k for k in matched if k not in out]
    return out


def curve(group: Group, key: str, band: str = "minmax") -> list[tuple]:
    """`key` against updates for one group: at each update, the mean over the seeds that logged the key there, and
    the band (min-max, or mean +- sample std) over those seeds. Rows without the key are skipped.
    Returns [(update, mean wall_s, mean, low, high, n seeds)]."""
    at: dict[int, list[tuple[float, float]]] = {}
    for r in group.runs:
        points = {
            row["update"]: (row["wall_s"], number(row.get(key)))
            for row in r.rows
            if "update" in row and "wall_s" in row and number(row.get(key)) is not None
        }  # a repeat: the last wins
        for u, p in points.items():
            at.setdefault(u, []).append(p)
    out = []
    for u in sorted(at):
        walls, vals = [p[0] for p in at[u]], [p[1] for p in at[u]]
        m, s = mean_std(vals)
        low, high = (min(vals), max(vals)) if band == "minmax" else (m - s, m + s)
        out.append((u, sum(walls) / len(walls), m, low, high, len(vals)))
    return out


def points_only(group: Group, key: str) -> bool:
    """An evaluation that every run of the group took at no more than two updates (before and after training,
    --eval-every 0): drawn as points, since a line between them would picture a learning curve nobody measured."""
    return key.startswith("eval/") and all(
        len({row["update"] for row in r.rows if "update" in row and number(row.get(key)) is not None}) <= 2 for r in group.runs
    )


def draw(plt, groups: list[Group], keys: list[str], band: str):
    """The figure of `figure` (not saved): one row of panels per key, one colour per group, one legend below."""
    # x = optimizer updates, not steps: a Mu-GRPO stage or a CoDaPO focused step holds a different number of
    # updates than a grpo.py step, and updates are the budget the methods are compared at
    fig, axes = plt.subplots(len(keys), 2, figsize=(11, 3.5 * len(keys) + 0.6), squeeze=False, layout="constrained")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    seeds: dict[int, int] = {}  # group index -> the most seeds at one point of any panel (the legend's n)
    for key, row in zip(keys, axes):
        curves = [curve(g, key, band) for g in groups]
        dots = [i for i, g in enumerate(groups) if curves[i] and points_only(g, key)]
        for ax, xi, xlabel in ((row[0], 0, "optimizer updates"), (row[1], 1, "wall time (s)")):
            span = max((p[xi] for pts in curves for p in pts), default=0.0) or 1.0
            for i, g in enumerate(groups):
                pts = curves[i]
                if not pts:
                    continue
                colour = colours[i % len(colours)]
                xs, ys = [p[xi] for p in pts], [p[2] for p in pts]
                n = max(p[5] for p in pts)
                seeds[i] = max(seeds.get(i, 0), n)
                if i in dots:  # before and after: two points with the band as error bars, no line
                    # groups evaluated at the same update would hide each other: each is moved sideways by 1% of
                    # the axis per group, the groups centred on the true x
                    xs = [x + (dots.index(i) - (len(dots) - 1) / 2) * 0.01 * span for x in xs]
                    ax.plot(xs, ys, color=colour, linestyle="none", marker="o", label=f"{g.label} (n={n})")
                    if n > 1:
                        spread = [[max(0.0, p[2] - p[3]) for p in pts], [max(0.0, p[4] - p[2]) for p in pts]]
                        ax.errorbar(xs, ys, yerr=spread, fmt="none", ecolor=colour, capsize=4, alpha=0.6)
                    continue
                ax.plot(xs, ys, color=colour, label=f"{g.label} (n={n})", marker="o" if key.startswith("eval") else None)
                if n > 1:
                    ax.fill_between(xs, [p[3] for p in pts], [p[4] for p in pts], color=colour, alpha=0.2)
            ax.set_xlabel(xlabel)
            ax.set_title(f"{key} vs {'updates' if xi == 0 else 'wall time'}", fontsize=9)
            ax.grid(alpha=0.3)
    if seeds:  # below the panels, where long labels cover no curve
        labels = [f"{groups[i].label} (n={seeds[i]})" for i in sorted(seeds)]
        handles = [plt.Line2D([], [], color=colours[i % len(colours)], lw=2) for i in sorted(seeds)]
        ncol = max(1, min(len(labels), 130 // (max(map(len, labels)) + 8)))
        fig.legend(handles, labels, loc="outside lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.suptitle(f"mean over seeds, band: {BANDS[band]}", fontsize=10)
    return fig


def figure(plt, groups: list[Group], keys: list[str], band: str, path: str) -> str:
    """One row of panels per key: against optimizer updates (left) and wall time (right), one colour per group.
    An evaluation taken only before and after training is two points per group (with error bars over seeds);
    one taken during training too is a curve with a band."""
    fig = draw(plt, groups, keys, band)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot(groups: list[Group], out_dir: str, name: str, metrics: list[str] = (), band: str = "minmax") -> list[str]:
    """<name>.png (reward and eval pass@1); <name>_eval.png (every eval key) when a run has more than two eval rows;
    <name>_<metric>.png per --metric key."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib); the table above is complete")
        return []
    os.makedirs(out_dir, exist_ok=True)
    paths = [figure(plt, groups, ["rollout/reward_mean", "eval/pass@1"], band, os.path.join(out_dir, f"{name}.png"))]
    if any(len(r.evals()) > 2 for g in groups for r in g.runs):
        paths.append(figure(plt, groups, eval_keys(groups), band, os.path.join(out_dir, f"{name}_eval.png")))
    for key in metrics:
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", key)
        paths.append(figure(plt, groups, [key], band, os.path.join(out_dir, f"{name}_{safe}.png")))
    return paths


def final_value(run: Run, key: str) -> float | None:
    """The value in the last row that has the key, after training started (step > 0: not the eval before training)."""
    vals = [number(row.get(key)) for row in run.rows if row.get("step", 0) > 0 and number(row.get(key)) is not None]
    return vals[-1] if vals else None


def g4(x: float, sign: str = "") -> str:
    return f"{x:{sign}.4g}"


def final_table(groups: list[Group], keys: list[str]) -> str:
    """Final value of each key, mean +- sample std over seeds (4 significant digits); n = seeds that have it."""
    lines = ["| method | seeds | " + " | ".join(f"{k} final" for k in keys) + " |", "|" + "---|" * (len(keys) + 2)]
    for g in groups:
        cells = [g.label, str(len(g.runs))]
        for k in keys:
            vals = [v for v in (final_value(r, k) for r in g.runs) if v is not None]
            ms = mean_std(vals)
            cells.append(
                "-"
                if ms is None
                else g4(ms[0])
                + (f" +- {g4(ms[1])}" if len(vals) > 1 else "")
                + (f" (n={len(vals)})" if len(vals) != len(g.runs) else "")
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def find_baseline(groups: list[Group], name: str) -> Group:
    # the label, else the name (method, LoRA rank: `grpo` is the full fine-tuning run), else the method
    matches = (
        [g for g in groups if g.label == name]
        or [g for g in groups if g.name == name]
        or [g for g in groups if g.method == name]
    )
    if not matches:
        raise ValueError(f"--baseline {name!r} is none of the groups: {', '.join(sorted({g.label for g in groups}))}")
    if len(matches) > 1:
        raise ValueError(f"--baseline {name!r} matches {len(matches)} configurations; pass only the runs of one of them")
    for g in groups:
        seeds = [r.args.get("seed") for r in g.runs]
        dup = sorted({str(s) for s in seeds if seeds.count(s) > 1})
        if dup:
            raise ValueError(f"{g.label} has more than one run with seed {', '.join(dup)}: cannot pair by seed")
    return matches[0]


def paired(method: Group, base: Group, key: str) -> dict:
    """Per-seed differences method - baseline of the final value of `key`, matched by seed."""
    a = {r.args.get("seed"): final_value(r, key) for r in method.runs}
    b = {r.args.get("seed"): final_value(r, key) for r in base.runs}
    both = [s for s in sorted(a, key=str) if s in b and a[s] is not None and b[s] is not None]
    diffs = {s: a[s] - b[s] for s in both}
    unmatched = [f"{s} ({method.label} only)" for s in sorted(a, key=str) if s not in b]
    unmatched += [f"{s} ({base.label} only)" for s in sorted(b, key=str) if s not in a]
    unmatched += [
        f"{s} (no value in {', '.join(lab for lab, d in ((method.label, a), (base.label, b)) if d[s] is None)})"
        for s in sorted(a, key=str)
        if s in b and s not in diffs
    ]
    return {
        "diffs": diffs,
        "interval": t_interval(list(diffs.values())),
        "positive": sum(d > 0 for d in diffs.values()),
        "negative": sum(d < 0 for d in diffs.values()),
        "unmatched": unmatched,
    }


def paired_table(groups: list[Group], base: Group, keys: list[str]) -> str:
    lines = [
        f"Paired per-seed differences of final values, method - {base.label} (mean ± the half-width of its 95 % "
        "t-interval over the seeds paired):",
        "",
        "| method - baseline | metric | mean diff | per seed (seed: diff) | sign count | unmatched seeds |",
        "|---|---|---|---|---|---|",
    ]
    for g in groups:
        if g is base:
            continue
        for k in keys:
            p = paired(g, base, k)
            n, ms = len(p["diffs"]), p["interval"]
            mean = "-" if ms is None else g4(ms[0], "+") + (f" ± {g4(ms[1])}" if n > 1 else "")
            per_seed = ", ".join(f"{s}: {g4(d, '+')}" for s, d in p["diffs"].items()) or "-"
            ties = n - p["positive"] - p["negative"]
            sign = f"{p['positive']}/{n} positive" + (f", {ties} tied" if ties else "") if n else "-"
            lines.append(
                f"| {g.label} - {base.label} | {k} | {mean} | {per_seed} | {sign} | {', '.join(p['unmatched']) or '-'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("runs", nargs="+", help="run folders (or globs) holding metrics.jsonl and args.json")
    parser.add_argument("--plot-dir", default="plots", help="where PNG curves go")
    parser.add_argument("--plot-name", default="compare", help="PNG file name (without .png)")
    parser.add_argument("--no-plot", action="store_true", help="table only")
    parser.add_argument(
        "--metric",
        action="append",
        default=[],
        metavar="NAME_OR_GLOB",
        help="logged key, exact or glob (e.g. 'gapo/clipfrac_c*'); repeatable: a curve and a final value each",
    )
    parser.add_argument(
        "--baseline",
        metavar="NAME",
        help="group label, name (method and LoRA rank, e.g. 'grpo LoRA r8') or exp_name: paired per-seed differences "
        "of final values against it",
    )
    parser.add_argument("--band", choices=sorted(BANDS), default="minmax", help="band over seeds drawn around the mean")
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
    try:
        metrics = select_metrics(groups, args.metric)
        base = find_baseline(groups, args.baseline) if args.baseline else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tables = eval_tables(groups)
    print(table(groups))
    for label, prefix, _, set_groups in tables:
        print("\n" + eval_table(label, prefix, set_groups))
    if tables:
        print("\n" + SCORE_LEGEND)
    for w in protocol_notes(tables) + warnings_for(groups) + nan_notes(groups, eval_keys(groups) + metrics):
        print(w)
    if metrics:
        print("\n" + final_table(groups, metrics))
    if base is not None:
        print("\n" + paired_table(groups, base, eval_keys(groups) + [k for k in metrics if not is_eval_key(k)]))
        print("\n" + bootstrap_table(tables, base))
    if not args.no_plot:
        for path in plot(groups, args.plot_dir, args.plot_name, metrics, args.band):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
