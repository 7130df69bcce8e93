"""Evaluation: a run's evaluation sets, how each is run and scored, and what it writes, in the order a run uses them
(docs/evaluation.md). A reader following one step skips it.

protocols     EvalProtocol, EVAL_PRESETS (a registry set's protocol, naming its public source), protocols(args): the
              run-wide flags, a preset, --eval-protocol SET.FIELD=VALUE, checked before anything loads
sets          EvalSet, load_sets(args, train_task): every set whole (a hold-out only from the training source) with its
              protocol; make_prompts
evaluation    run_evaluation -> evaluate_sets -> evaluate: pass@1 (avg@n), pass@k, maj@k, each with its standard error
              over problems; its row, every completion (write_completions), one line per set; eval_seed,
              print_summary, rescore (a kept evaluation scored again by another grader, nothing generated)

Each function a script calls reads its own flags from `args`.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import common
import verifiers
from verifiers import UserError

# ----- protocols: how an evaluation set is run and scored

GRADERS = ("auto", *verifiers.ANSWER_GRADERS, "code")
TEMPLATES = ("chat", "plain")


@dataclass(frozen=True)
class EvalProtocol:
    """How one evaluation set is run and scored. A set without a preset takes the run-wide flags (--eval-samples,
    --eval-temperature, ...); a registry set takes its preset (EVAL_PRESETS); `--eval-protocol SET.FIELD=VALUE`
    overrides any field of one set (`*.FIELD=VALUE`: of every set)."""

    n: int = 4  # samples per problem (pass@1 is their mean: avg@n)
    temperature: float = 0.6  # 0: greedy decoding (then n is 1)
    top_p: float = 1.0  # nucleus sampling (1: off)
    max_new_tokens: int = 32  # the answer's token budget (not the training one)
    k: tuple[int, ...] = (4,)  # pass@k reported, each <= n (pass@1 always)
    maj: tuple[int, ...] = ()  # maj@k (cons@k) reported: the majority answer of the first k samples, each <= n
    limit: int = 0  # the first N problems (0: all)
    question_field: str = ""  # "": the registry's, else question
    answer_field: str = ""  # "": the registry's, else answer
    answer_format: str = "auto"  # how the gold is read from the answer field (read_answer)
    template: str = "chat"  # chat: the model's chat template (plain text for a model without one); plain: plain text
    instruction: str | None = None  # after the question, or around it at "{question}"; None: the task's own
    system_prompt: str = ""
    grader: str = "auto"  # auto: the task's reward kind; else one of GRADERS
    preset: str = ""  # the registry preset it started from ("": the run-wide flags)
    source: str = ""  # where the preset's numbers come from

    @property
    def estimator(self) -> str:
        """What pass@1 is: the mean over n samples per problem (avg@n), or the one greedy answer."""
        return "greedy" if self.temperature == 0 else f"avg@{self.n}"

    def describe(self) -> str:
        """n, T, top-p, the token budget, the grader: what is printed beside a set's numbers."""
        decoding = "greedy" if self.temperature == 0 else f"n {self.n}, T {self.temperature:g}, top-p {self.top_p:g}"
        return f"{decoding}, {self.max_new_tokens} tokens, grader {self.grader}"


# The instructions of the public evaluations the presets follow, verbatim ({question}: where the problem goes)
LIGHTEVAL_MATH = (
    "Solve the following math problem efficiently and clearly.  The last line of your response should be of the "
    "following format: 'Therefore, the final answer is: $\\boxed{ANSWER}$. I hope it is correct' (without quotes) "
    "where ANSWER is just the final number or expression that solves the problem. Think step by step before "
    "answering.\n\n{question}"
)  # lighteval 0.9.0, default_prompts.py (math_500, aime24): the prompt of open-r1's DeepSeek-R1 reproduction
DEEPSCALER_MATH = "{question} Let's think step by step and output the final answer within \\boxed{}."  # deepscaler_dataset.py
EVALPLUS_CODE = (
    "Please provide a self-contained Python script that solves the following problem in a markdown code block:\n"
    "```\n{question}\n```"
)  # evalplus, provider/utility.py (its chat prompt; evalplus also prefills the answer, which is not done here)
R1 = (
    "open-r1's reproduction of DeepSeek-R1's evaluation (arXiv:2501.12948; huggingface/open-r1 README, lighteval "
    "0.9.0): zero-shot, chat template, T 0.6, top-p 0.95, 32768 new tokens, pass@1 from {n} samples, math-verify"
)
DEEPSCALER = (
    "DeepScaleR (agentica-project/deepscaler, scripts/eval/eval_model.sh): zero-shot, chat template, avg@16 at T 0.6, "
    "top-p 0.95, 32768 response tokens; its grader also requires a </think> (not here: the last \\boxed{}, math-verify)"
)
SAMPLED = dict(temperature=0.6, top_p=0.95, max_new_tokens=32768, k=(1,), maj=(), template="chat", grader="math")
GREEDY = dict(n=1, temperature=0.0, top_p=1.0, k=(1,), maj=(), template="chat")
# registry name -> its preset: the EvalProtocol fields of the public evaluation named in `source`. The field's other
# convention is one override away: greedy (Qwen2.5-Math, verl's validation) is `SET.temperature=0 SET.n=1`.
EVAL_PRESETS: dict[str, dict] = {
    "aime24": dict(SAMPLED, n=64, instruction=LIGHTEVAL_MATH, source=R1.format(n=64)),
    "aime25": dict(SAMPLED, n=64, instruction=LIGHTEVAL_MATH, source=R1.format(n=64)),
    "math500": dict(SAMPLED, n=4, instruction=LIGHTEVAL_MATH, source=R1.format(n=4)),
    "amc23": dict(SAMPLED, n=16, instruction=DEEPSCALER_MATH, source=DEEPSCALER),
    "minerva": dict(SAMPLED, n=16, instruction=DEEPSCALER_MATH, source=DEEPSCALER),
    "olympiadbench": dict(SAMPLED, n=16, instruction=DEEPSCALER_MATH, source=DEEPSCALER),
    "gsm8k": dict(
        GREEDY,
        max_new_tokens=256,
        instruction="Question: {question}\nAnswer:",
        grader="gsm8k-flexible",
        source="lm-evaluation-harness gsm8k.yaml: greedy, 256 new tokens (its default max_gen_toks), 'Question: ... "
        "Answer:', its flexible-extract answer (strict-match: grader=gsm8k-strict), exact match; zero-shot here, "
        "where lm-eval prompts 5-shot, and through the chat template of a model that has one",
    ),
    **{
        name: dict(
            GREEDY,
            max_new_tokens=768,
            instruction=EVALPLUS_CODE,
            grader="code",
            source="evalplus (evalplus/evalplus, codegen.py --greedy): greedy pass@1, 768 new tokens, its chat prompt",
        )
        for name in ("humaneval", "openai_humaneval", "humanevalplus", "mbpp")
    },
}
PROTOCOL_FIELDS = {f.name: f for f in dataclasses.fields(EvalProtocol)}
SET_FIELDS = tuple(n for n in PROTOCOL_FIELDS if n != "source")  # what --eval-protocol may set
RUN_WIDE = {  # protocol field -> the run-wide flag that is its default in a set without a preset
    "n": "eval_samples",
    "temperature": "eval_temperature",
    "top_p": "eval_top_p",
    "max_new_tokens": "eval_max_new_tokens",
    "k": "eval_k",
    "limit": "eval_limit",
    "question_field": "question_field",
    "answer_field": "answer_field",
    "answer_format": "answer_format",
    "system_prompt": "system_prompt",
}
PRESET_KEEPS = ("limit", "system_prompt")  # run-wide flags a preset set still takes


def overrides(items: Sequence[str], labels: Sequence[str]) -> dict[str, dict[str, Any]]:
    """--eval-protocol SET.FIELD=VALUE ... -> {label: {field: typed value}}; SET * is every set of the run. One
    UserError line for a malformed item, an unknown field, a bad value or a set that is not in the run."""
    out: dict[str, dict[str, Any]] = {label: {} for label in labels}
    for item in items:
        key, eq, raw = item.partition("=")
        label, dot, name = key.rpartition(".")
        name = name.replace("-", "_")
        if not eq or not dot or not label:
            raise UserError(f"--eval-protocol {item}: write SET.FIELD=VALUE, e.g. aime24.n=16 or *.max_new_tokens=4096")
        if name not in SET_FIELDS:
            raise UserError(
                f"--eval-protocol {item}: {name!r} is not a field of an evaluation set; its fields: {', '.join(SET_FIELDS)}"
            )
        if label != "*" and label not in out:
            raise UserError(
                f"--eval-protocol {item}: {label} is not an evaluation set of this run (its sets: {', '.join(labels)}; "
                "name them with --eval-dataset)"
            )
        value = _protocol_value(item, name, raw)
        for target in labels if label == "*" else [label]:
            out[target][name] = value
    return out


def _protocol_value(item: str, name: str, raw: str) -> Any:
    kind = PROTOCOL_FIELDS[name].type
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            value = float(raw)
            if not math.isfinite(value):
                raise ValueError
            return value
        if kind == "tuple[int, ...]":
            return tuple(int(v) for v in raw.replace(" ", "").split(",") if v) if raw.strip() else ()
    except ValueError:
        what = {"int": "a whole number", "float": "a number", "tuple[int, ...]": "whole numbers separated by commas"}[kind]
        raise UserError(f"--eval-protocol {item}: {name} must be {what}, not {raw!r}") from None
    return raw  # str fields (instruction: "" is no instruction)


def protocols(args, notes: bool = False) -> dict[str, EvalProtocol]:
    """The protocol of every evaluation set of a run (label -> EvalProtocol), from its flags alone (no data is read):
    the run-wide flags, a registry set's preset in their place, the set's --eval-protocol fields over both. One
    UserError line for a protocol that cannot be run (greedy with n > 1, a k > n, a top-p outside (0, 1], ...).
    `notes`: one line for each run-wide flag given that a preset set does not take."""
    names = list(args.eval_dataset) or [args.dataset]
    labels = [verifiers.eval_set_label(n) for n in names]
    per_set = overrides(args.eval_protocol, labels)
    run_wide = {field: getattr(args, flag) for field, flag in RUN_WIDE.items()}
    run_wide.update(max_new_tokens=args.eval_max_new_tokens or args.max_new_tokens, k=tuple(args.eval_k))
    flag_of = {f: "--" + RUN_WIDE[f].replace("_", "-") for f in RUN_WIDE}
    out, ignored = {}, {}
    for name, label in zip(names, labels):
        own = per_set[label]
        named = name in EVAL_PRESETS or (
            verifiers.eval_set_source(name) != name and label in EVAL_PRESETS
        )  # NAME or NAME=FILE
        preset = own.get("preset", label if named else "")
        if preset and preset not in EVAL_PRESETS:
            raise UserError(f"--eval-protocol {label}.preset={preset}: no such preset; the presets: {', '.join(EVAL_PRESETS)}")
        if preset:
            fields = {f: run_wide[f] for f in PRESET_KEEPS} | EVAL_PRESETS[preset]
            origin = {f: f"preset {preset}" for f in SET_FIELDS} | {f: flag_of[f] for f in PRESET_KEEPS}
            ignored[label] = [f for f in RUN_WIDE if f not in PRESET_KEEPS]
        else:
            fields, origin = dict(run_wide), {f: flag_of.get(f, f"{label}'s default {f}") for f in SET_FIELDS}
        origin |= {f: f"--eval-protocol {label}.{f}" for f in own}
        protocol = EvalProtocol(**{**fields, **own, "preset": preset})
        if preset and own:
            changed = ", ".join(f"{f}={v}" for f, v in own.items() if f != "preset")
            protocol = dataclasses.replace(
                protocol, source=protocol.source + (f"; changed here: {changed}" if changed else "")
            )
        problem = protocol_problem(protocol, origin)
        if problem:
            raise UserError(f"evaluation set {label}: {problem}")
        out[label] = protocol
    defaults = {  # the flags' defaults (a list's: its factory's)
        f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        for f in (dataclasses.fields(type(args)) if dataclasses.is_dataclass(args) else ())
    }
    for name, flag in RUN_WIDE.items():
        given = getattr(args, flag) != defaults.get(flag, getattr(args, flag))
        sets = [label for label, fields in ignored.items() if name in fields]
        if notes and given and sets:
            print(
                f"note: {flag_of[name]} applies to evaluation sets without a preset; {', '.join(sets)} keep their "
                f"preset's {name} (set it with --eval-protocol {sets[0]}.{name}=...)",
                file=sys.stderr,
            )
    return out


def protocol_problem(p: EvalProtocol, origin: dict[str, str]) -> str | None:
    """What makes a protocol impossible to run, naming where each value came from (`origin`); None if it can run."""
    flag = origin.__getitem__
    if p.n < 1:
        return f"{flag('n')} {p.n}: must be >= 1 (samples per problem)"
    if p.temperature < 0:
        return f"{flag('temperature')} {p.temperature:g}: must be >= 0 (0: greedy decoding)"
    if p.temperature == 0 and p.n > 1:
        return (
            f"{flag('temperature')} 0 is greedy decoding, which gives one answer per problem: {flag('n')} is {p.n}, "
            "it must be 1 (or sample with a temperature > 0)"
        )
    if not 0 < p.top_p <= 1:
        return f"{flag('top_p')} {p.top_p:g}: must be in (0, 1] (1: no nucleus cut)"
    if p.max_new_tokens < 1:
        return f"{flag('max_new_tokens')} {p.max_new_tokens}: must be >= 1"
    for what in ("k", "maj"):
        if any(k < 1 for k in getattr(p, what)):
            return f"{flag(what)} {','.join(map(str, getattr(p, what)))}: values must be >= 1"
        bad = [k for k in getattr(p, what) if k > p.n]
        if bad:
            return f"{flag(what)} values must be <= {flag('n')} ({bad[0]} > {p.n}; {what}@k needs n >= k samples)"
    if p.limit < 0:
        return f"{flag('limit')} {p.limit}: must be >= 0 (0: every problem)"
    for what, allowed in (("template", TEMPLATES), ("grader", GRADERS), ("answer_format", verifiers.ANSWER_FORMATS)):
        if getattr(p, what) not in allowed:
            return f"{flag(what)} {getattr(p, what)}: must be one of {', '.join(allowed)}"
    return None


# ----- the sets: every set whole (a hold-out only from the training source), with its protocol and prompts


@dataclass
class EvalSet:
    """One evaluation set of a run: its problems (a verifiers.Task), its protocol, its prompts (token ids, one per
    problem), how many problems it had before its limit (`n_source`) and, when it is the training source's hold-out,
    how many the training run kept (`training_problems`)."""

    label: str  # its name in metric keys (eval/<label>/pass@1) and file names
    task: verifiers.Task
    protocol: EvalProtocol
    n_source: int
    prompts: list[list[int]] = field(default_factory=list)
    training_problems: int = 0

    def scope(self) -> str:
        """`30 of 30 problems`, `100 of 500 problems (limit 100)`, `200 of 200 problems held out of the training
        source`: what was scored of what the source holds."""
        scored = len(self.task.problems)
        text = f"{scored} of {self.n_source} problems"
        if scored < self.n_source:
            text += f" (limit {self.protocol.limit})"
        if self.training_problems:
            text += f", held out of {self.task.name} (its other {self.training_problems} train)"
        return text


def load_sets(args, train_task: verifiers.Task | None = None) -> list[EvalSet]:
    """The run's evaluation sets (`--eval-dataset a b c`; none: the held-out split of --dataset), each with its protocol
    (protocols), cut to its limit (0: all); make_prompts makes their prompts. `NAME=FILE` is a registry set's copy in
    a local file: its label, preset and field names, the file's rows. A named set is used whole; the hold-out is
    carved only from --dataset itself when the run trains on it (verifiers.training_holdout), and then one line says
    how many problems each side got. Two sets with the same label are one error."""
    by_label = protocols(args, notes=True)
    holdout = verifiers.training_holdout(args)
    sets, seen = [], {}
    for name in list(args.eval_dataset) or [args.dataset]:
        label, source = verifiers.eval_set_label(name), verifiers.eval_set_source(name)
        if label in seen:
            raise UserError(
                f"--eval-dataset: {seen[label]!r} and {name!r} both log as eval/{label}/...; "
                "give each evaluation set once (rename a local file if two share a name)"
            )
        seen[label] = name
        protocol = by_label[label]
        registry = verifiers.HUB_DATASETS.get(protocol.preset, {}) if source not in verifiers.HUB_DATASETS else {}
        fields = dict(  # a copy of a registry set: the registry's field names, unless the protocol names others
            question_field=protocol.question_field or registry.get("q"),
            answer_field=protocol.answer_field or registry.get("a"),
        )
        answer_format = protocol.answer_format
        if answer_format == "auto" and registry:
            answer_format = registry.get("answer_format", "auto")
        own = verifiers.same_dataset(source, args.dataset)
        task = verifiers.load_task(
            source, "eval", args.seed, **fields, holdout=holdout if own else 0, reward=args.reward, answer_format=answer_format
        )
        grader = (
            {"code": "code", "custom": "custom"}.get(task.kind, task.kind) if protocol.grader == "auto" else protocol.grader
        )
        if (grader == "code") != (task.kind == "code"):
            raise UserError(
                f"evaluation set {label}: grader {grader} does not fit its {task.kind} problems (grader auto: the set's own)"
            )
        if protocol.maj and grader in ("code", "custom"):
            raise UserError(f"evaluation set {label}: maj@k votes over extracted answers; the {grader} grader extracts none")
        instruction = task.instruction if protocol.instruction is None else protocol.instruction
        protocol = dataclasses.replace(protocol, grader=grader, instruction=instruction)
        eval_set = EvalSet(label, task, protocol, len(task.problems))
        if protocol.limit:
            task.problems, task.where = task.problems[: protocol.limit], task.where[: protocol.limit]
        carved = own and holdout and train_task is not None and verifiers.HUB_DATASETS.get(source, {}).get("eval") is None
        if carved and source not in verifiers.BUILTIN_DATASETS:
            eval_set.training_problems = len(train_task.problems)
            print(
                f"dataset {args.dataset}: {eval_set.n_source} problems held out for evaluation, {eval_set.training_problems} "
                "for training (a source named in --eval-dataset is used whole)",
                flush=True,
            )
        sets.append(eval_set)
    return sets


def make_prompts(eval_sets: Sequence[EvalSet], tokenizer) -> None:
    """Each set's prompt token ids (EvalSet.prompts), in its protocol's template, instruction and system prompt."""
    for s in eval_sets:
        p = s.protocol
        s.prompts = [
            common.format_prompt(tokenizer, q["question"], p.instruction, p.system_prompt or None, p.template)
            for q in s.task.problems
        ]


# ----- evaluation: the scores of every set, their errors, every completion, one line per set


def eval_seed(seed: int) -> int:
    return seed + common.EVAL_SEED_OFFSET


TIER_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a string "tier" value usable in a metric key
ID_FIELDS = ("id", "task_id", "unique_id", "idx", "problem_idx")  # a problem's own id in its dataset, if it has one


def is_tier_key(key: str) -> bool:
    """eval/tier<t>/... or eval/<set>/tier<t>/...: the per-difficulty-band keys of `evaluate`."""
    return re.search(r"/tier[^/]+/[^/]+$", key) is not None


def standard_error(values: Sequence[float]) -> float | None:
    """The standard error of the mean of per-problem scores: their sample standard deviation / sqrt(N) (None below
    two problems)."""
    N = len(values)
    if N < 2:
        return None
    mean = sum(values) / N
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (N - 1) / N)


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """maj@k (cons@k) of one problem from its first k samples: the answer most of them gave (spaces ignored; a tie:
    the one given first) is right. Samples without an answer do not vote; none with one: wrong."""
    keys = [re.sub(r"\s+", "", a) if a else None for a in answers]
    votes = collections.Counter(k for k in keys if k)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(k for k in keys if k and votes[k] == top)  # the first answer given among the most frequent
    return bool(correct[keys.index(winner)])


def protocol_id(eval_set: EvalSet) -> str:
    """One string that differs when two evaluations of a set are not comparable: decoding, budget, grader, problems,
    and a hash of the prompt and the answer fields (compare.py keeps runs whose ids differ apart)."""
    p = eval_set.protocol
    prompt = json.dumps([p.template, p.instruction, p.system_prompt, p.question_field, p.answer_field, p.answer_format])
    digest = hashlib.sha1(prompt.encode()).hexdigest()[:8]
    return (
        f"n={p.n} T={p.temperature:g} top_p={p.top_p:g} max_new_tokens={p.max_new_tokens} grader={p.grader} "
        f"problems={len(eval_set.task.problems)}/{eval_set.n_source} prompt={digest}"
    )


def problem_id(task: verifiers.Task, i: int):
    """Problem i's own id in its dataset (its id field), else where it comes from (file:line), else its index."""
    problem = task.problems[i]
    own = next((problem[f] for f in ID_FIELDS if f in problem and isinstance(problem[f], (str, int))), None)
    return own if own is not None else (task.where[i] if i < len(task.where) else i)


def evaluate(engine, eval_set: EvalSet, seed: int | None = None) -> tuple[dict, list[dict]]:
    """One set under its protocol: pass@1 (the mean of the n samples' verdicts, avg@n), pass@k, maj@k, each with its
    standard error over problems, the protocol's fields and the share of answers cut at the token budget. Returns
    (metrics, one record per completion: its problem, text, token count, finish reason, answer read off, verdict)."""
    p, task, prompts = eval_set.protocol, eval_set.task, eval_set.prompts
    n = p.n
    # own RNG stream: the same eval samples before and after training, and training's stream is untouched
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    w, N = common.world(), len(task.problems)
    # several processes: problems r, r+W, ... on rank r, padded with repeats to the same count on every rank
    # (synced generation), the padding dropped; rewards, lengths and texts gathered, the metrics computed on all
    mine = list(range(w.rank, math.ceil(N / w.world_size) * w.world_size, w.world_size)) if w.enabled else None
    sampling = dict(seed=seed, desc=f"eval {eval_set.label}", top_p=p.top_p)
    with torch.random.fork_rng(devices=devices):
        if seed is not None:
            torch.manual_seed(seed + common.RANK_SEED_STRIDE * w.rank)  # run.rank_seed
        try:
            if mine is None:
                rollout = engine.generate(prompts, n, p.max_new_tokens, p.temperature, **sampling)
            else:  # a rank whose engine fails stops every rank (World.agree)
                ids = [i % N for i in mine]
                gen = [[prompts[i] for i in ids], n, p.max_new_tokens, p.temperature]
                rollout = w.agree(engine.generate, *gen, group_ids=ids, **sampling)
        except common.NonFiniteError as exc:
            error = verifiers.RunError(f"{exc}, in the evaluation of {eval_set.label}; the last checkpoint is intact")
            error.on_every_rank = getattr(exc, "on_every_rank", False)
            raise error from None
    if mine is None:
        problems = [q for q in task.problems for _ in range(n)]
        rewards, answers = verifiers.grade(task, p.grader, problems, rollout.texts)
        lengths, texts, finish = rollout.completion_lengths.tolist(), list(rollout.texts), list(rollout.finish_reasons)
    else:
        mine_problems = [task.problems[i % N] for i in mine for _ in range(n)]
        mine_rewards, mine_answers = w.agree(verifiers.grade, task, p.grader, mine_problems, rollout.texts)
        local = (mine, mine_rewards, mine_answers, rollout.completion_lengths.tolist(), list(rollout.texts))
        rewards, answers, lengths, texts = [0.0] * (N * n), [None] * (N * n), [0] * (N * n), [""] * (N * n)
        finish = ["length"] * (N * n)
        for idx, rw, an, ln, tx, fr in w.gather_objects((*local, list(rollout.finish_reasons))):
            for j, i in enumerate(idx):
                if i < N:  # padding repeats dropped
                    span, theirs = slice(i * n, (i + 1) * n), slice(j * n, (j + 1) * n)
                    rewards[span], answers[span], lengths[span] = rw[theirs], an[theirs], ln[theirs]
                    texts[span], finish[span] = tx[theirs], fr[theirs]
    rewards = torch.tensor(rewards, dtype=torch.float32)
    correct = (rewards >= 1.0).view(N, n)  # (N, n)
    counts = correct.sum(1).tolist()  # correct samples per problem
    metrics = {
        "eval/n_samples": n,
        "eval/temperature": p.temperature,
        "eval/top_p": p.top_p,
        "eval/max_new_tokens": p.max_new_tokens,
        "eval/n_problems": N,
        "eval/n_source_problems": eval_set.n_source,
        "eval/reward_mean": rewards.mean().item(),
        "eval/response_len_mean": sum(lengths) / len(lengths),
        "eval/truncated_frac": sum(f == "length" for f in finish) / len(finish),
        "eval/grader": p.grader,
        "eval/protocol": protocol_id(eval_set),
    }
    for k in sorted({1, *p.k}):
        vals = [verifiers.pass_at_k(n, int(c), k) for c in counts]  # per problem: the unbiased pass@k estimate
        metrics[f"eval/pass@{k}"] = sum(vals) / len(vals)
        if (se := standard_error(vals)) is not None:
            metrics[f"eval/pass@{k}_se"] = se
    for k in p.maj:
        vals = [float(majority_correct(answers[i * n : i * n + k], correct[i, :k].tolist())) for i in range(N)]
        metrics[f"eval/maj@{k}"] = sum(vals) / len(vals)
        if (se := standard_error(vals)) is not None:
            metrics[f"eval/maj@{k}_se"] = se
    # difficulty bands: problems with a "tier" field (the built-in arith task) also get pass@1 per tier,
    # eval/tier<t>/pass@1 and eval/tier<t>/n_problems (evaluate_sets prefixes them per set like every key)
    tiers = [
        t if isinstance(t, int) and not isinstance(t, bool) or isinstance(t, str) and TIER_NAME.fullmatch(t) else None
        for t in (q.get("tier") for q in task.problems)
    ]  # other values: no tier
    if any(t is not None for t in tiers):
        per_problem = correct.float().mean(1).tolist()  # pass@1 of each problem: its share of correct samples
        for t in sorted({t for t in tiers if t is not None}, key=str):
            vals = [v for v, pt in zip(per_problem, tiers) if pt == t]
            metrics[f"eval/tier{t}/pass@1"] = sum(vals) / len(vals)
            metrics[f"eval/tier{t}/n_problems"] = len(vals)
    records = []
    for i in range(N):
        problem = task.problems[i]
        head = {
            "problem": i,
            "id": problem_id(task, i),
            "question": problem.get("question", ""),
            "answer": problem.get("answer"),
        }
        for j in range(n):
            r = i * n + j
            records.append(
                head
                | {"sample": j, "text": texts[r], "tokens": lengths[r], "finish_reason": finish[r], "extracted": answers[r]}
                | {"correct": bool(correct[i, j]), "reward": rewards[r].item()}
                | ({"tier": tiers[i]} if tiers[i] is not None else {})
            )
    return metrics, records


PER_RUN_KEYS = ()  # keys of a set's metrics not repeated per set in a suite (none: every set has its own protocol)


def evaluate_sets(engine, eval_sets: Sequence[EvalSet], seed: int | None = None) -> tuple[dict, dict[str, list[dict]]]:
    """`evaluate` on every set (the same seed for each, so a set's numbers do not depend on the others).

    One set: its metrics exactly as `evaluate` returns them (eval/pass@1, ...). Several: every set's metrics
    as eval/<label>/pass@1, ... and, in addition, the unprefixed eval/... keys hold the FIRST set's numbers
    (compare.py and plots read eval/pass@1). Returns (metrics, {label: records})."""
    metrics, per_set = {}, {}
    for i, eval_set in enumerate(eval_sets):
        m, records = evaluate(engine, eval_set, seed=seed)
        per_set[eval_set.label] = records
        if i == 0:
            metrics.update(m)
        if len(eval_sets) > 1:
            metrics.update({f"eval/{eval_set.label}/{k[len('eval/') :]}": v for k, v in m.items()})
    return metrics, per_set


def run_evaluation(
    args, engine, eval_sets: Sequence[EvalSet], logger: common.RunLogger, step: int, update: int, t_start: float
) -> dict:
    """The run's evaluation at `step`: evaluate_sets under each set's protocol with the evaluation's own seed, its row in
    metrics.jsonl, every completion kept (write_completions), one console line per set (and one when most answers
    were cut at the token budget). Returns its metrics."""
    metrics, per_set = evaluate_sets(engine, eval_sets, seed=eval_seed(args.seed))
    logger.log({"step": step, "update": update, "wall_s": time.time() - t_start, **metrics})
    write_completions(logger, step, per_set, eval_sets)
    for eval_set in eval_sets:
        own = set_metrics(metrics, "eval/" if len(eval_sets) == 1 else f"eval/{eval_set.label}/")
        line = eval_console_line(None if args.eval_only else step, args.total_steps, eval_set, own)
        toolbox = getattr(engine, "toolbox", None)  # --tools: the answers could call them (docs/tools.md)
        common.CONSOLE.info(line if toolbox is None else line.replace(", grader ", f", {toolbox.describe()}, grader ", 1))
        cut = own["eval/truncated_frac"]
        if cut > 0.5:
            fix = (
                "--eval-max-new-tokens"
                if not eval_set.protocol.preset
                else f"--eval-protocol {eval_set.label}.max_new_tokens=N"
            )
            common.CONSOLE.warning(
                f"warning: eval {eval_set.label}: {100 * cut:.0f}% of the answers were cut at "
                f"{eval_set.protocol.max_new_tokens} tokens (mean length {own['eval/response_len_mean']:.1f}): their "
                f"scores say little; raise {fix}"
            )
    return metrics


def set_metrics(metrics: dict | None, prefix: str) -> dict:
    """One set's keys of an evaluation's metrics as eval/...: eval/<label>/pass@1 -> eval/pass@1 (prefix eval/: all)."""
    return {f"eval/{k[len(prefix) :]}": v for k, v in (metrics or {}).items() if k.startswith(prefix)}


def score_text(metrics: dict, key: str) -> str:
    """`0.3075 ± 0.0321` (± one standard error over problems), the value alone where there is none, n/a without it."""
    if key not in metrics:
        return "n/a"
    se = metrics.get(f"{key}_se")
    return f"{metrics[key]:.4f}" + (f" ± {se:.4f}" if se is not None else "")


def score_keys(metrics: dict) -> list[str]:
    """eval/pass@k and eval/maj@k keys of one set's metrics, pass@1 first (standard errors and tiers left out)."""
    keys = [k for k in metrics if re.fullmatch(r"eval/(pass|maj)@\d+", k)]
    return sorted(keys, key=lambda k: (k.split("@")[0] != "eval/pass", int(k.split("@")[1])))


def eval_console_line(step: int | None, total: int, eval_set: EvalSet, metrics: dict) -> str:
    """`eval step 0/12 | arith: 100 of 100 problems, n 4, T 0.6, top-p 1, 32 tokens, grader arith | pass@1 (avg@4)
    0.3075 ± 0.0321 | ... | length 12.3, cut 0%`: a set's scores beside its protocol (± a standard error over problems).
    `step` None: an evaluation alone (--eval-only)."""
    p = eval_set.protocol
    names = {"eval/pass@1": f"pass@1 ({p.estimator})"}
    scores = [f"{names.get(k, k[len('eval/') :])} {score_text(metrics, k)}" for k in score_keys(metrics)]
    where = "eval" if step is None else f"eval step {step}/{total}"
    cut = f"length {metrics['eval/response_len_mean']:.1f}, cut {100 * metrics['eval/truncated_frac']:.0f}%"
    return " | ".join([where, f"{eval_set.label}: {eval_set.scope()}, {p.describe()}", *scores, cut])


def write_completions(
    logger: common.RunLogger, step: int, per_set: dict[str, list[dict]], eval_sets: Sequence[EvalSet]
) -> None:
    """Every completion of the evaluation at `step`, one file per set: eval_completions_step<step>_<set>.jsonl (its
    problem and id, question, gold, text, token count, finish reason, the answer read off, verdict), enough to score
    it again (rescore) or take another estimator. samples.jsonl keeps each set's first 4 problems' first sample (a
    quick look)."""
    if not logger.enabled:
        return
    for eval_set in eval_sets:
        records = per_set[eval_set.label]
        with open(os.path.join(logger.run_dir, f"eval_completions_step{step}_{eval_set.label}.jsonl"), "w") as f:
            for r in records:
                f.write(json.dumps(r, default=str) + "\n")
        extra = {"eval_set": eval_set.label} if len(eval_sets) > 1 else {}
        n = eval_set.protocol.n
        with open(os.path.join(logger.run_dir, "samples.jsonl"), "a") as f:
            for r in records[: 4 * n : n]:
                sample = {
                    "question": r["question"][:500],
                    "answer": r["answer"],
                    "completion": r["text"],
                    "reward": r["reward"],
                }
                f.write(json.dumps({"step": step, "tag": "eval", **extra, **sample}, default=str) + "\n")
    with open(os.path.join(logger.run_dir, "eval_protocols.json"), "w") as f:
        json.dump({s.label: dataclasses.asdict(s.protocol) | {"problems": s.scope()} for s in eval_sets}, f, indent=2)


def print_summary(
    title: str, before: dict | None, after: dict | None, timers: dict, wall: float, eval_sets: Sequence[EvalSet] = ()
) -> None:
    """The end of a run: per set its protocol, then each score before and after (± a standard error over problems),
    and the wall time by phase."""
    common.CONSOLE.info(f"\n===== {title} =====")
    shown = after or before or {}
    sets = list(eval_sets) or [None]
    for eval_set in sets:
        prefix = "eval/" if eval_set is None or len(sets) == 1 else f"eval/{eval_set.label}/"
        b, a = set_metrics(before, prefix), set_metrics(after, prefix)
        if eval_set is not None:
            common.CONSOLE.info(f"{eval_set.label}: {eval_set.scope()}, {eval_set.protocol.describe()}")
        names = {k: prefix + k[len("eval/") :] for k in score_keys(set_metrics(shown, prefix))}
        if eval_set is not None:
            names["eval/pass@1"] = f"{prefix}pass@1 ({eval_set.protocol.estimator})"
        width = max([14, *map(len, names.values())])
        for key, name in names.items():
            if before is None:  # an evaluation alone: one value per metric
                common.CONSOLE.info(f"{name:{width}s} {score_text(a, key)}")
            else:
                common.CONSOLE.info(f"{name:{width}s} before {score_text(b, key)}  after {score_text(a, key)}")
    if any(k.endswith("_se") for k in shown):
        common.CONSOLE.info("(± one standard error over problems; compare.py: intervals over seeds)")
    common.CONSOLE.info(
        f"wall time {wall:.1f}s: " + ", ".join(f"{k} {v:.1f}s ({100 * v / max(wall, 1e-9):.0f}%)" for k, v in timers.items())
    )


def rescore(path: str, grader: str, k: Sequence[int] = (), maj: Sequence[int] = ()) -> dict:
    """A kept evaluation (an eval_completions_*.jsonl) scored again by an answer grader (verifiers.ANSWER_GRADERS), from
    its texts and golds alone: nothing is generated. Returns pass@1, pass@k and maj@k with their standard errors, as
    evaluate does (`python evaluation.py rescore FILE --grader gsm8k-strict`)."""
    if grader not in verifiers.ANSWER_GRADERS:
        raise UserError(
            f"rescore: --grader must be one of {', '.join(verifiers.ANSWER_GRADERS)} (the code grader needs the tests)"
        )
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        raise UserError(f"rescore: {path} holds no completion")
    by_problem: dict[int, list[dict]] = {}
    for r in records:
        by_problem.setdefault(r["problem"], []).append(r)
    n = len(next(iter(by_problem.values())))
    if any(len(rs) != n for rs in by_problem.values()):
        raise UserError(f"rescore: {path}: the problems do not all have the same number of samples")
    kind = "arith" if grader == "arith" else "math"
    task = verifiers.Task("rescore", kind, [], "")
    problems = [{"question": r["question"], "answer": r["answer"]} for r in records]
    rewards, answers = verifiers.grade(task, grader, problems, [r["text"] for r in records])
    N = len(by_problem)
    correct = (torch.tensor(rewards) >= 1.0).view(N, n)
    out = {"eval/n_samples": n, "eval/n_problems": N, "eval/grader": grader}
    for kk in sorted({1, *k}):
        vals = [verifiers.pass_at_k(n, int(c), kk) for c in correct.sum(1).tolist()]
        out[f"eval/pass@{kk}"] = sum(vals) / N
        if (se := standard_error(vals)) is not None:
            out[f"eval/pass@{kk}_se"] = se
    for kk in maj:
        vals = [float(majority_correct(answers[i * n : i * n + kk], correct[i, :kk].tolist())) for i in range(N)]
        out[f"eval/maj@{kk}"] = sum(vals) / N
        if (se := standard_error(vals)) is not None:
            out[f"eval/maj@{kk}_se"] = se
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="score a kept evaluation again: python evaluation.py rescore FILE --grader G")
    sub = parser.add_subparsers(dest="cmd", required=True)
    again = sub.add_parser("rescore", help="an eval_completions_*.jsonl of a run folder, by another answer grader")
    again.add_argument("file")
    again.add_argument("--grader", required=True, choices=verifiers.ANSWER_GRADERS)
    again.add_argument("--k", type=int, nargs="*", default=[], help="pass@k values (each <= the samples per problem)")
    again.add_argument("--maj", type=int, nargs="*", default=[], help="maj@k values")
    cli = parser.parse_args()
    try:
        for key, value in rescore(cli.file, cli.grader, cli.k, cli.maj).items():
            print(f"{key} {value:.4f}" if isinstance(value, float) else f"{key} {value}")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
