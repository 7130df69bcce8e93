"""Tool calls inside a rollout (--tools, docs/tools.md): the model writes a call in its answer, the engine stops at
the call's closing tag, runs the tool, appends the tool's result as tokens and goes on from the exact token ids so
far. The format (stated in the prompt of a task that uses it, `--dataset arith-tools`):

    calculator   <calc>17*23</calc>                     an arithmetic expression, evaluated without eval()
    python       <python>print(2**10)</python>          a program, run in the code sandbox; its output is the result
    the result   <output>391</output>                   tokenized once, on its own, and forced into the row

Token in, token out: a row's tokens are the model's sampled ids and the result's ids, in order, and nothing of the
model's is decoded and encoded again. The result's tokens are the tool's, not the policy's: each row keeps their
spans (RolloutBatch.tool_turns), and completion_mask_of / token_batch_of (common.py) mask them out of the loss,
the log-prob comparisons and every token denominator. The reward and the graders read the policy's own text (the
tool's results left out, its calls kept), so an answer is the model's: a bare call scores nothing.
"""

from __future__ import annotations

import ast
import concurrent.futures
import importlib.util
import math
import operator
import re

import torch

import sandbox
import verifiers
from verifiers import UserError

TOOLS = {"calculator": "calc", "python": "python"}  # --tools name -> its tag
OUTPUT_OPEN, OUTPUT_CLOSE = "<output>", "</output>"
MAX_RESULT_CHARS = 200  # a longer result is cut, with "..." (the token budget counts its tokens)
MAX_EXPRESSION_CHARS = 300
MAX_INT_DIGITS = 100  # a calculator number or result beyond this: an error text
PYTHON_TIMEOUT_S = 5.0  # the sandbox's limit on one python call (its CPU, memory and process limits: docs/verifiers.md)


class Toolbox:
    """The tools of a run (--tools) and their call budget (--max-tool-calls): what the engines ask while they decode.

    after(turns, completion): the row's last token was a closer (its piece holds ">"); when it completed a call, the
    tool runs and the result's token ids come back to be forced into the row (None: go on sampling)."""

    def __init__(self, names, max_calls: int, tokenizer):
        self.names, self.max_calls, self.tokenizer = tuple(names), int(max_calls), tokenizer
        tags = "|".join(TOOLS[n] for n in self.names)
        self._call = re.compile(rf"<({tags})>(.*?)</\1>", re.DOTALL)  # the first complete call of a segment
        special = set(tokenizer.all_special_ids)
        vocab = range(len(tokenizer))
        self.closer_ids = frozenset(i for i in vocab if i not in special and ">" in tokenizer.decode([i]))

    def describe(self) -> str:
        return f"tools {' '.join(self.names)}, at most {self.max_calls} calls"

    def after(self, turns: list[dict], completion: list[int]) -> list[int] | None:
        """A row whose last token (a closer) may end a call: its forced result's ids, or None. `turns`: the row's
        calls so far (appended to); the policy's segment starts after the last result."""
        return self.answer([(turns, completion)])[0]

    def answer(self, rows: list[tuple[list[dict], list[int]]]) -> list[list[int] | None]:
        """after() for several rows at once (their python calls run side by side in the sandbox)."""
        calls = []
        for turns, completion in rows:
            start = turns[-1]["end"] if turns else 0
            found = self._call.search(self.tokenizer.decode(completion[start:], skip_special_tokens=True))
            if found is None or len(turns) >= self.max_calls:  # over budget: not run, the call stays plain text
                calls.append(None)
                continue
            calls.append((found.group(1), found.group(2)))
        with concurrent.futures.ThreadPoolExecutor(max(1, sum(c is not None and c[0] == "python" for c in calls))) as pool:
            results = list(pool.map(lambda c: run_tool(*c) if c is not None else None, calls))
        out = []
        for (turns, completion), call, result in zip(rows, calls, results):
            if call is None:
                out.append(None)
                continue
            text, ok = result
            ids = self.result_ids(text)
            at = len(completion)  # the result's tokens follow the call's closing token
            turns.append(dict(tool=call[0], call=call[1], output=text, ok=ok, start=at, end=at + len(ids)))
            out.append(ids)
        return out

    def policy_text(self, completion: list[int], turns: list[dict], decodable: int | None = None) -> str:
        """The text of the policy's own tokens: the completion without its results' spans (what rewards read)."""
        tool = {i for t in turns for i in range(t["start"], t["end"])}
        ids = [tok for i, tok in enumerate(completion) if i not in tool and (decodable is None or tok < decodable)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def result_ids(self, text: str) -> list[int]:
        """The result as tokens, tokenized once and on its own (split_special_tokens: a result holding "<|im_end|>"
        gets plain-text tokens, never the EOS)."""
        if len(text) > MAX_RESULT_CHARS:
            text = text[:MAX_RESULT_CHARS] + "..."
        return self.tokenizer(OUTPUT_OPEN + text + OUTPUT_CLOSE, add_special_tokens=False, split_special_tokens=True).input_ids


def run_tool(tag: str, body: str) -> tuple[str, bool]:
    """(the result text, True) or (an error text, False): a tool never raises into the engine."""
    try:
        return (calculate(body) if tag == "calc" else run_python(body)), True
    except ToolError as exc:
        return f"error: {exc}", False


class ToolError(Exception):
    """A call the tool could not answer: its message is the result the model reads."""


# ----- the calculator: + - * / // % ** and parentheses over numbers, by walking the expression's syntax tree

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text: integers exact, other numbers to 12 significant digits. A
    name, a call, an attribute, a string or any other syntax is refused (ToolError), never evaluated."""
    text = expression.strip().replace("×", "*").replace("^", "**")
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolError("not an arithmetic expression") from None
    value = _value(tree.body)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ToolError("the result is not a finite number")
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else format(value, ".12g")
    return str(value)


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or (isinstance(right, int) and abs(left) > 10**6 and right > 8)):
            raise ToolError("exponent too large")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except (OverflowError, ValueError, TypeError):
            raise ToolError("the result is not a number the calculator holds") from None
    raise ToolError(f"only numbers, + - * / // % ** and parentheses are allowed, not {type(node).__name__}")


def _bounded(value):
    if isinstance(value, complex):
        raise ToolError("the result is not a real number")
    if isinstance(value, int) and abs(value) >= 10**MAX_INT_DIGITS:
        raise ToolError(f"a number of more than {MAX_INT_DIGITS} digits")
    return value


# ----- python: the code sandbox of the code rewards (sandbox.run, mode "tool"), its output as the result


def run_python(code: str) -> str:
    if not code.strip():
        raise ToolError("no code")
    result = sandbox.run({"mode": "tool", "program": code, "secret": {}}, PYTHON_TIMEOUT_S)
    if result.status == "error":
        raise ToolError("the sandbox could not run the code")
    if result.status == "timeout":
        raise ToolError(f"timed out after {PYTHON_TIMEOUT_S:.0f} s")
    if result.status == "failed":  # a non-zero exit: its output holds the traceback's last line
        lines = result.output.strip().splitlines()
        raise ToolError(lines[-1] if lines else "the program failed")
    return result.output.strip()


# ----- what the trainer does with the spans: the tool's tokens out of the masks


def spans(rollout, rows) -> list[list[tuple[int, int]]]:
    """Each row's result spans (start, end) in its completion."""
    return [[(t["start"], t["end"]) for t in rollout.tool_turns[r]] for r in rows]


def masked(mask, rollout, rows=None):
    """completion_mask_of's mask (R, T) with 0 on the tools' tokens (in place)."""
    for i, row_spans in enumerate(spans(rollout, range(len(rollout)) if rows is None else rows)):
        for a, b in row_spans:
            mask[i, a:b] = 0
    return mask


def without_tool_tokens(batch, rollout, rows):
    """A TokenBatch whose completion_mask is 0 on the tools' tokens (they stay in input_ids, the context the policy's
    tokens see): completion_logps computes no log-prob for them (a packed batch's gather drops them too)."""
    real = batch.completion_mask.bool()  # (b, T) every token the batch holds, row-major as the gather
    masked(batch.completion_mask, rollout, rows)
    if batch.gather is not None:
        batch.gather = batch.gather[batch.completion_mask.bool()[real]]
    return batch


def rollout_metrics(rollout) -> dict:
    """tools/: calls per completion, the share of completions that call, errors per call, the tools' tokens."""
    turns = rollout.tool_turns
    B = max(len(turns), 1)
    calls = sum(len(t) for t in turns)
    tokens = sum(c["end"] - c["start"] for t in turns for c in t)
    return {
        "tools/calls_per_completion": calls / B,
        "tools/call_frac": sum(bool(t) for t in turns) / B,
        "tools/error_frac": sum(not c["ok"] for t in turns for c in t) / max(calls, 1),
        "tools/tokens_per_completion": tokens / B,
        "tools/token_frac": tokens / max(int(rollout.completion_lengths.sum()), 1),
    }


def check_args(args) -> None:
    """Before anything loads (run.validate_args): the static loop, which runs no tool; python's sandbox limits."""
    if not args.tools:
        return
    if args.hf_decode != "dynamic":
        raise UserError(f"--tools runs in the dynamic hf loop, not --hf-decode {args.hf_decode}: drop it")
    vllm = args.engine == "vllm" or (args.engine == "auto" and torch.cuda.is_available() and importlib.util.find_spec("vllm"))
    if vllm:  # the stop-and-continue loop of vLLM is not built yet (docs/tools.md): never a run without its tools
        raise UserError("--tools runs in the hf engine only for now (vLLM's loop is not built yet): add --engine hf")
    if "python" in args.tools:
        verifiers.check_code_sandbox()  # the code rewards' sandbox, with its limits, or a one-line refusal


def check_tasks(args, tasks) -> None:
    """Before the weights load (models.fit_context): a tool that cannot serve a task of the run."""
    for task in tasks:
        if task is not None and task.kind == "code" and "calculator" in args.tools:
            raise UserError(f"--tools calculator cannot serve {task.name}, a code task: use --tools python")
