"""A math worker process: math-verify on one (gold, prediction) pair per request.

Trusted code, run by verifiers.py as `python -I -S -c <this file's text, read once at import> <site folders>`: a
worker never reads this file from disk, so a program that rewrote it (where writes are not stopped) changes no
later reward. Protocol: one JSON request `[id, gold, pred, question]` per stdin line (pred null: does the gold
parse?; question null: not known), one `id 0|1 recycle` line back (recycle 1: the worker holds over RESIDENT_LIMIT
and should be replaced); the worker exits at the end of its input (the parent closed the pipe or died)."""

import json
import logging
import os
import re
import resource
import signal
import sys

PARSE_CPU_S = 1.0  # the CPU time of a parse (ITIMER_PROF: not the wall clock, so not the neighbours' load)
VERIFY_CPU_S = 2.0  # of a verify; the caller keeps a wall-clock backstop (sandbox/math_pool.py)
WORKER_MEMORY = 4294967296  # address-space limit of a worker: 4 GiB
RESIDENT_LIMIT = 536870912  # 512 MiB: a worker that holds more after a request is replaced (its reply says so)


class CPULimit(BaseException):
    """A request's CPU time ran out (ITIMER_PROF): not an Exception, so no library's `except Exception` swallows it."""


def _on_cpu_limit(signum, frame):
    raise CPULimit()


def within_cpu(seconds: float, fn, *args, **kwargs):
    """fn(*args) stopped by CPULimit after `seconds` of this process's CPU time (user and system), whatever the
    machine's load: a verdict does not depend on the neighbours."""
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        return fn(*args, **kwargs)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)


def _parse(latex: str, gold: bool):
    from math_verify import LatexExtractionConfig, parse

    if gold:
        config = dict(extraction_config=[LatexExtractionConfig(boxed_match_priority=0)], fallback_mode="no_fallback")
    else:
        config = dict(
            extraction_config=[LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)],
            fallback_mode="no_fallback",
            extraction_mode="first_match",
        )
    return within_cpu(PARSE_CPU_S, parse, latex, parsing_timeout=0, **config)  # 0: no alarm of math-verify's own


def verify_pair(gold_latex: str, pred_latex: str, question: str | None = None) -> bool:
    """math-verify: gold first, boxed-only extraction of the prediction, no string fallbacks; then the answer's rules
    (not_an_answer). Each parse and the verify within its CPU time."""
    from math_verify import verify

    gold = _parse(gold_latex, gold=True)
    if not gold:
        return False
    pred = _parse(pred_latex, gold=False)
    if not pred or not_an_answer(unboxed(pred_latex), unboxed(gold_latex), gold, question):
        return False
    return bool(within_cpu(VERIFY_CPU_S, verify, gold, pred, timeout_seconds=None))


def gold_parses(gold_latex: str) -> bool:
    """Does the gold parse as verify_pair parses it? (No prediction can match a gold that does not.)"""
    return bool(_parse(gold_latex, gold=True))


# ----- a final answer is an answer: not the problem restated, not an operation left to carry out

# commands whose presence in an answer to a numeric gold is an operation left to carry out
OPERATIONS = set(
    "binom dbinom tbinom choose sum prod int iint iiint oint lim limsup liminf gcd lcm operatorname lfloor lceil "
    "rfloor rceil floor ceil log ln lg exp det sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh coth max "
    "min mod bmod pmod partial nabla div ast times cdot prime over atop".split()
)
SPACING = re.compile(r"\\left|\\right|\\[!,;: ]|\\displaystyle|\\textstyle|~|\$|\s+")
UNITS = re.compile(r"\\(?:text|mathrm|textbf|mbox|operatorname\*?)\{[^{}]*\}|\^\{?\\circ\}?|\\%|\\degree")
RATIONAL = re.compile(r"-?\d+(?:\.\d+)?|-?\d+/\d+|-?\\frac\{-?\d+\}\{-?\d+\}")  # a number a problem's answer may be
SCIENTIFIC = re.compile(r"-?\d+(?:\.\d+)?(?:\\times|\\cdot|\*)10\^\{?-?\d+\}?")  # 3.2\times10^{8}
MAX_DEPTH = 40  # nesting deeper than this is not an answer's


def unboxed(latex: str) -> str:
    """The content of a `\\boxed{...}` (the whole text where there is none), spacing and markup removed."""
    start = latex.find("\\boxed{")
    inner = latex[start + 7 : latex.rfind("}")] if start >= 0 and latex.endswith("}") else latex
    inner = inner.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\dbinom", "\\binom")
    return SPACING.sub("", inner.replace("\\tbinom", "\\binom"))


def _groups(s: str, i: int) -> tuple[str, int]:
    """The balanced {...} group of `s` at index i (s[i] == '{') and the index after it."""
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1 : j], j + 1
    return s[i + 1 :], len(s)


def _split_top(s: str, seps: str) -> list[str]:
    """s cut at the characters of `seps` outside braces, brackets and parentheses (a leading or doubled one: a sign)."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(s):
        depth += 1 if c in "{([" else -1 if c in "})]" else 0
        if depth == 0 and c in seps and i > start and s[i - 1] not in "+-*/^_({[,=":
            parts.append(s[start:i])
            start = i + (c != "-")  # a minus stays with its term
    parts.append(s[start:])
    return [p for p in parts if p]


def _squarefree(n: int, power: int = 2) -> bool:
    k = 2
    while k**power <= n:
        if n % k**power == 0:
            return False
        k += 1
    return True


def holds_operation(s: str, depth: int = 0) -> bool:
    """Does an answer to a numeric question still hold an operation to carry out? Sums or products of numbers, a
    binomial, factorial, integral, limit, derivative, gcd/lcm, floor/ceiling, logarithm, determinant, a trigonometric
    or other function, a power of a number, a radical that is not simplified (sqrt of a number with a square
    factor, of a fraction): yes. A number, a fraction (unreduced too), a simplified radical with its coefficient,
    pi, e, i, infinity, a percentage, a unit, scientific notation, an interval, a list of these: no."""
    if depth > MAX_DEPTH or "!" in s:
        return True
    s = UNITS.sub("", s)
    if "=" in s:  # x = 5, or 2+3 = 5: every side an answer
        return any(holds_operation(side, depth + 1) for side in s.split("="))
    items = _split_top(s, ",;")
    if len(items) > 1:
        return any(holds_operation(item, depth + 1) for item in items)
    if SCIENTIFIC.fullmatch(s):
        return False
    terms = _split_top(s, "+-")
    if sum(bool(RATIONAL.fullmatch(t.lstrip("+"))) for t in terms) > 1:
        return True  # two numbers to add
    for term in terms:
        factors = _split_top(term.lstrip("+-"), "*")
        if sum(bool(RATIONAL.fullmatch(f)) for f in factors) > 1:
            return True
        if re.search(r"\d\(|\)\(|\)\d|\d/\d+/|\)/\(", term) or term.count("/") > 1:
            return True  # 2(3), (2)(3), a/b/c
        i = 0
        while i < len(term):
            c = term[i]
            if c == "\\":
                name = re.match(r"\\([A-Za-z]+)", term[i:])
                if not name:
                    i += 2
                    continue
                cmd, i = name.group(1), i + len(name.group(0))
                if cmd in OPERATIONS:
                    return True
                if cmd == "frac":
                    for _ in range(2):
                        if i < len(term) and term[i] == "{":
                            part, i = _groups(term, i)
                            if holds_operation(part, depth + 1):
                                return True
                elif cmd == "sqrt":
                    power = 2
                    if i < len(term) and term[i] == "[":
                        end = term.find("]", i)
                        index, i = term[i + 1 : end], end + 1
                        if not index.isdigit():
                            return True
                        power = int(index)
                    radicand, i = _groups(term, i) if i < len(term) and term[i] == "{" else (term[i : i + 1], i + 1)
                    if radicand.isdigit():
                        if len(radicand) > 12 or not _squarefree(int(radicand), power):
                            return True
                    elif RATIONAL.fullmatch(radicand) or holds_operation(radicand, depth + 1):
                        return True  # sqrt of a fraction or a decimal: not rationalised
            elif c == "^":
                base = term[:i]
                if re.search(r"[\d)}]$", base) and not re.search(r"\\(?:pi|infty)$", base):
                    return True  # a power of a number
                i += 1
            elif c in "({[" and c == "(":
                inner_end, depth_count = i, 0
                for j in range(i, len(term)):
                    depth_count += 1 if term[j] == "(" else -1 if term[j] == ")" else 0
                    if depth_count == 0:
                        inner_end = j
                        break
                if holds_operation(term[i + 1 : inner_end], depth + 1):
                    return True
                i = inner_end + 1
            else:
                i += 1
    return False


def canonical(s: str) -> str:
    """An expression's terms, and each term's parenthesised factors, in a sorted order: `(x+5)(x+2)` and
    `(x+2)(x+5)` are one expression restated."""
    terms = []
    for term in _split_top(s, "+-"):
        groups = re.findall(r"\([^()]*\)", term)
        rest = re.sub(r"\([^()]*\)", "", term)
        terms.append(rest + "".join(sorted(groups)))
    return "+".join(sorted(terms))


SEGMENT = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)


def question_expressions(question: str) -> set[str]:
    """The question's own expressions: each $...$, \\(...\\), \\[...\\] of it, and each side of an equation in one,
    spacing removed, in canonical order."""
    out = set()
    for m in SEGMENT.finditer(question[:20000]):
        segment = unboxed(next(g for g in m.groups() if g is not None))
        for part in [segment, *segment.split("=")]:
            if part:
                out.add(canonical(part))
    return out


def is_number(gold) -> bool:
    """A parsed gold that is one number (no free symbol, not a set, interval, tuple, matrix or equation)."""
    import sympy

    value = gold[0] if gold else None
    return isinstance(value, sympy.Expr) and not value.free_symbols and not isinstance(value, sympy.Tuple)


def not_an_answer(pred: str, gold_text: str, gold, question: str | None) -> bool:
    """The rule of a final answer (docs/verifiers.md): 0 for a prediction that, where the gold is a number, still holds
    an operation to carry out (holds_operation; unless the gold itself is written so), or that is the question's own
    expression restated (with an operation in it, not the gold's own form)."""
    if is_number(gold) and not holds_operation(gold_text) and holds_operation(pred):
        return True
    bare = re.fullmatch(r"-?\d+(?:\.\d+)?", pred)  # a plain number is no restatement (questions hold numbers)
    if question and not bare and canonical(pred) != canonical(gold_text):
        return canonical(pred) in question_expressions(question)
    return False


def main(site_folders: list[str]) -> None:
    sys.path.extend(site_folders)
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    if hard == resource.RLIM_INFINITY or hard > WORKER_MEMORY:
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # stray prints of any library cannot corrupt the protocol
    logging.disable(logging.CRITICAL)
    try:  # the OOM killer's first choice, before the trainer (raising one's own score needs no privilege)
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    signal.signal(signal.SIGPROF, _on_cpu_limit)
    import math_verify  # noqa: F401 - import before the first request
    import sympy  # noqa: F401

    replies.write(b"ready\n")
    for line in sys.stdin.buffer:
        try:
            request_id, gold, pred, question = json.loads(line)
        except ValueError:
            continue
        try:
            ok = gold_parses(gold) if pred is None else verify_pair(gold, pred, question)
        except BaseException:  # noqa: BLE001 - CPULimit, math-verify's TimeoutException: BaseExceptions
            ok = False
        replies.write(f"{request_id} {int(ok)} {int(resident() > RESIDENT_LIMIT)}\n".encode())


def resident() -> int:
    """This process's resident memory now, in bytes (read only once its peak passed the limit: a cheap test first)."""
    if resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 <= RESIDENT_LIMIT:
        return 0
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
