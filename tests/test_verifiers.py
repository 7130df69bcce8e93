"""Tests of verifiers.py: extraction, the arithmetic and math rewards (equivalences, rejections,
pathological inputs, threads and processes), pass@k against exact binomials, the code sandbox
against hostile programs (in every sandbox mode this machine offers) and HumanEval's canonical
solutions. No network, no files outside pytest's temporary folders."""

from __future__ import annotations

import glob
import math
import multiprocessing
import os
import re
import secrets
import socket
import tempfile
import threading
import time

import pytest

import sandbox as S
import verifiers as V
from sandbox import math_pool

pytestmark = pytest.mark.slow  # the verifiers and the sandbox at length: left out of the quick tier, pytest -m "not slow"

# ---------------------------------------------------------------------------------------------
# Sandbox modes: the detected one, plus the fallback where namespaces work (both must hold).
# ---------------------------------------------------------------------------------------------

DETECTED_MODE = V.sandbox_mode()
MODES = [DETECTED_MODE] + (["fallback"] if DETECTED_MODE != "fallback" else [])
NAMESPACE_MODES = [m for m in MODES if m != "fallback"]
# the attack tests also run without /proc where the private one works (both must hold)
ATTACK_MODES = MODES + (["namespaces-noproc"] if DETECTED_MODE == "namespaces" else [])


@pytest.fixture(scope="module", autouse=True)
def report_sandbox_mode(request):
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\nverifiers sandbox: detected mode {DETECTED_MODE!r}; hostile tests run in {MODES}")
    yield


def _sandbox_pids() -> list[int]:
    """Live processes started by any sandbox run (tagged through their environment)."""
    prefix = (S._SANDBOX_MARKER + "=").encode()
    return [pid for pid in _all_pids() if _environ_has_prefix(pid, prefix)]


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _environ_has_prefix(pid: int, prefix: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return any(entry.startswith(prefix) for entry in f.read().split(b"\0"))
    except OSError:
        return False


def _pids_with_cmdline(fragment: str) -> list[int]:
    found = []
    for pid in _all_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if fragment.encode() in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


def _sandbox_dirs() -> set[str]:
    parents = {tempfile.gettempdir(), getattr(V, "_sandbox_parent", lambda: None)() or tempfile.gettempdir()}
    return {d for parent in parents for d in glob.glob(os.path.join(parent, S._SANDBOX_TMP_PREFIX + "*"))}


def _sandbox_cgroups() -> set[str]:
    """The runs' cgroups with something of a run in them: a cgroup of the bounded pool (reused from run to run)
    counts only while a process is in it; any other cgroup of the prefix counts."""
    found = set()
    for parent, _ in S._cgroup_parents():
        for name in os.listdir(parent):
            path = os.path.join(parent, name)
            if not name.startswith(S._SANDBOX_CGROUP_PREFIX):
                continue
            if "-pool" in name:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    if not f.read().split():
                        continue
            found.add(path)
    return found


def _ipc_objects() -> set[str]:
    """The host's SysV shared memory segments, message queues and semaphore sets (key and id)."""
    found = set()
    for kind in ("shm", "msg", "sem"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                found |= {f"{kind} " + " ".join(line.split()[:2]) for line in f.readlines()[1:]}
        except OSError:
            pass
    return found


@pytest.fixture
def clean_sandbox():
    """After the test: no sandboxed process is alive, and nothing of a run outlives it: no sandbox
    folder, no cgroup, no IPC object, the host's name unchanged."""
    before = _sandbox_dirs(), _sandbox_cgroups(), _ipc_objects(), socket.gethostname()
    yield
    assert _sandbox_pids() == [], "sandboxed processes survived the run"
    assert _sandbox_dirs() - before[0] == set(), "a sandbox temporary folder was left behind"
    assert _sandbox_cgroups() - before[1] == set(), "a run's cgroup was left behind"
    assert _ipc_objects() - before[2] == set(), "an IPC object outlived its run"
    assert socket.gethostname() == before[3], "a run changed the host's name"


# A HumanEval-style problem whose test passes unless the sandbox catches the hostile behaviour.
ADD = {
    "prompt": "def add(a, b):\n",
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
}


def _closed_local_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not count
        ("\\boxed {x^{2}}", "x^{2}"),
        ("\\boxed{1} and \\boxed{2", None),  # the last box is never closed
        ("no box", None),
        ("", None),
        (None, None),
        ("\\boxed{}", ""),
    ],
)
def test_extract_boxed(text, expected):
    assert V.extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Here:\n```python\ndef f():\n    return 1\n```\nDone.", "def f():\n    return 1\n"),
        ("```\na = 1\n```\nthen\n```py\nb = 2\n```\n", "b = 2\n"),
        ("    return x + 1\n", "    return x + 1\n"),  # a HumanEval body, indentation kept
        ("```python\nprint(1)\n", "print(1)\n"),  # truncated: the unclosed last block
        ("```python\na = 1\n```\n```python\nb = 2", "b = 2"),
        ("", ""),
        (None, ""),
    ],
)
def test_extract_code(text, expected):
    assert V.extract_code(text) == expected


# ---------------------------------------------------------------------------------------------
# Arithmetic task
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("3 + 4 = 7. The answer is 7.", "7", 1.0),
        ("The answer is 7, or maybe 8", "7", 0.0),  # the LAST number counts
        ("12 - 19 = -7", "-7", 1.0),
        ("12-19", "-7", 0.0),  # "-19" after a digit is an operator: the last number is 19
        ("x = \u22127", "-7", 1.0),  # unicode minus
        ("Total: 1,234 apples", "1234", 1.0),
        ("7.0", "7", 1.0),
        ("2.50", "2.5", 1.0),
        ("\\boxed{-42}", "-42", 1.0),
        ("\\boxed{1{,}234}", "1234", 1.0),
        ("\\boxed{x = 7}", "7", 1.0),
        ("\\boxed{7} and later 8", "7", 1.0),  # a box wins over later numbers
        ("\\boxed{3+4}", "7", 0.0),  # a box must hold exactly one number
        ("\\boxed{seven}", "7", 0.0),
        ("no number here", "7", 0.0),
        ("", "7", 0.0),
        (None, "7", 0.0),
        ("7", None, 0.0),
        ("#### 7", "7", 1.0),
    ],
)
def test_arith_reward(completion, answer, expected):
    assert V.arith_reward(completion, answer) == expected


def test_arith_reward_is_fast():
    completions = [f"Step by step: {i} + {i} = {2 * i}. The answer is {2 * i}." for i in range(5000)]
    start = time.perf_counter()
    rewards = [V.arith_reward(c, str(2 * i)) for i, c in enumerate(completions)]
    elapsed = time.perf_counter() - start
    assert sum(rewards) == 5000
    assert elapsed < 2.5, f"{5000 / elapsed:.0f} calls/s"


# ---------------------------------------------------------------------------------------------
# Math
# ---------------------------------------------------------------------------------------------

MATH_CASES = [
    # fractions and decimals
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\frac{2}{4}}", "1/2", 1.0),
    ("\\boxed{0.333333}", "\\frac{1}{3}", 1.0),  # math-verify rounds floats to 6 decimals
    ("\\boxed{0.33}", "\\frac{1}{3}", 0.0),
    ("\\boxed{-3}", "-3", 1.0),
    ("\\boxed{3}", "-3", 0.0),
    ("\\boxed{1,000}", "1000", 1.0),
    # units and percent
    ("\\boxed{10\\text{ cm}}", "10", 1.0),
    ("\\boxed{10 \\mathrm{cm}}", "10", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{50}", "50\\%", 1.0),
    ("\\boxed{50\\%}", "0.5", 1.0),
    ("\\boxed{40\\%}", "50", 0.0),
    # intervals and sets
    ("\\boxed{(1, 2]}", "(1,2]", 1.0),
    ("\\boxed{(1, 2)}", "(1,2]", 0.0),
    ("\\boxed{[1, 2]}", "(1,2]", 0.0),
    ("\\boxed{\\{3, 1, 2\\}}", "\\{1,2,3\\}", 1.0),
    ("\\boxed{\\{1, 2\\}}", "\\{1,2,3\\}", 0.0),
    # symbolic forms
    ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", 0.0),  # a radical left unsimplified: an operation (issue 62's rule)
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),  # the gold written so: no rule
    ("\\boxed{2}", "2\\sqrt{3}", 0.0),  # bare gold is wrapped in \boxed{} (unwrapped it parses as 2)
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    ("\\boxed{x^2+2x}", "x^2+2x+1", 0.0),
    ("\\boxed{x = 2}", "2", 1.0),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", 1.0),
    # gold already delimited
    ("\\boxed{3}", "\\boxed{3}", 1.0),
    ("\\boxed{\\frac12}", "$\\frac{1}{2}$", 1.0),
    # multiple boxes, hedging, missing box
    ("First \\boxed{1}, finally \\boxed{2}", "2", 1.0),
    ("First \\boxed{1}, finally \\boxed{2}", "1", 0.0),
    ("\\boxed{1, 2}", "1", 0.0),
    ("\\boxed{1 \\text{ or } 2}", "1", 0.0),
    ("The answer is 2.", "2", 0.0),
    ("$2$", "2", 0.0),
    ("\\boxed{2} and then \\boxed{3", "2", 0.0),
    # known false positives and failures of math-verify 0.9.0, kept visible (not papered over)
    ("\\boxed{\\frac{1}{2^{99}}}", "\\frac{1}{2^{98}}", 1.0),
    ("\\boxed{\\{1, 2\\}}", "(1,2)", 1.0),
    ("\\boxed{\\frac{e}{2}}", "\\frac{\\mathrm{e}}{2}", 0.0),  # that gold does not parse
]


@pytest.mark.parametrize("completion, answer, expected", MATH_CASES)
def test_math_reward(completion, answer, expected):
    assert V.math_reward(completion, answer) == expected


PATHOLOGICAL = [
    "\\boxed{9^{9^{9^{9}}}}",
    "\\boxed{10^{10^{10}}}",
    "\\boxed{2^{123456789}}",
    "\\boxed{1000000!}",
    "x" * 100_000,
    "{" * 50_000 + "\\boxed{" + "{" * 50_000,
    "\\boxed{" + "\\frac{1}{" * 60 + "2" + "}" * 61,
    "\\boxed{" + "1+" * 600 + "1}",
    "\\boxed{}}}{{{",
    "\\boxed{\\left( \\right.}",
    "",
    None,
]


@pytest.mark.parametrize("completion", PATHOLOGICAL, ids=range(len(PATHOLOGICAL)))
def test_math_reward_pathological_is_zero_and_bounded(completion):
    start = time.monotonic()
    assert V.math_reward(completion, "5") == 0.0
    assert time.monotonic() - start < V.MATH_TIMEOUT_S + 2


def test_math_reward_long_completion_with_box():
    start = time.monotonic()
    assert V.math_reward("blah " * 20_000 + "\\boxed{\\frac{14}{2}}", "7") == 1.0
    assert time.monotonic() - start < 2


def test_math_worker_bounds_explosive_answers_without_the_precheck(monkeypatch):
    """With the cheap pre-check off, math-verify's alarms and the outer timeout still bound it."""
    monkeypatch.setattr(V, "_EXPLOSIVE_RE", re.compile(r"(?!)"))
    start = time.monotonic()
    assert V.math_reward("\\boxed{9^{9^{9^{9}}}}", "5") == 0.0
    assert time.monotonic() - start < V.MATH_TIMEOUT_S + 2
    start = time.monotonic()
    assert V.math_reward("\\boxed{9^{9^{9^{9}}}}", "5", timeout=0.5) == 0.0  # worker killed
    assert time.monotonic() - start < 2
    assert V.math_reward("\\boxed{0.5}", "1/2") == 1.0  # a fresh worker takes over


def test_math_reward_from_threads():
    cases = MATH_CASES[:12]
    results = [None] * len(cases)

    def score(i):
        results[i] = V.math_reward(cases[i][0], cases[i][1])

    threads = [threading.Thread(target=score, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [e for _, _, e in cases]


def _score_in_child(pair):
    return V.math_reward(*pair)


def test_math_reward_from_forked_pool_processes():
    assert V.math_reward("\\boxed{0.5}", "1/2") == 1.0  # the parent holds a worker when forking
    pairs = [("\\boxed{0.5}", "1/2"), ("\\boxed{0.4}", "1/2"), ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}")]
    with multiprocessing.get_context("fork").Pool(2) as pool:  # daemonic processes
        assert pool.map(_score_in_child, pairs) == [1.0, 0.0, 1.0]


def test_math_rewards_batch():
    completions = [c for c, _, _ in MATH_CASES]
    answers = [a for _, a, _ in MATH_CASES]
    assert V.math_rewards_batch(completions, answers, workers=2) == [e for _, _, e in MATH_CASES]
    with pytest.raises(ValueError):
        V.math_rewards_batch(["\\boxed{1}"], [])


# ---------------------------------------------------------------------------------------------
# pass@k
# ---------------------------------------------------------------------------------------------


def test_pass_at_k_matches_exact_binomials():
    for n in range(1, 31):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert V.pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
    for n, c, k in [(200, 3, 1), (200, 3, 100), (1000, 1, 10), (500, 250, 50)]:
        exact = 1.0 - math.comb(n - c, k) / math.comb(n, k)
        assert V.pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12, abs=1e-15)


def test_pass_at_k_edges():
    assert V.pass_at_k(10, 0, 5) == 0.0
    assert V.pass_at_k(10, 10, 1) == 1.0
    assert V.pass_at_k(10, 6, 5) == 1.0  # n - c < k
    assert V.pass_at_k(10, 3, 1) == pytest.approx(0.3)
    for bad in [(5, 6, 1), (5, 1, 0), (5, 1, 6), (5, -1, 1)]:
        with pytest.raises(ValueError):
            V.pass_at_k(*bad)


# ---------------------------------------------------------------------------------------------
# Code: the problem formats
# ---------------------------------------------------------------------------------------------


def test_code_reward_humaneval_formats(clean_sandbox):
    body = "    return a + b\n"
    full = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    assert V.code_rewards_batch([body, full, wrong, "", None], [ADD] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_code_reward_humaneval_keeps_prompt_helpers(clean_sandbox):
    problem = {
        "prompt": 'import math\n\ndef helper(x):\n    return 2 * x\n\ndef f(x: float) -> float:\n    """Doc."""\n',
        "entry_point": "f",
        "test": (
            "import math\n\ndef check(candidate):\n"
            "    assert candidate(4.0) == 8.0 + math.sqrt(4.0)\n    assert helper(1) == 2\n"
        ),
    }
    full = "```python\ndef f(x: float) -> float:\n    return helper(x) + math.sqrt(x)\n```"
    assert V.code_reward(full, problem) == 1.0


def test_code_reward_mbpp(clean_sandbox):
    problem = {
        "test_list": ["assert similar((3, 4, 5), (5, 7, 4)) == (4, 5)", "assert similar((1,), (2,)) == ()"],
        "test_setup_code": "import math",
    }
    good = "```python\ndef similar(a, b):\n    return tuple(sorted(set(a) & set(b)))\n```"
    wrong = "```python\ndef similar(a, b):\n    return tuple(set(a) | set(b))\n```"
    always_equal = "class E(tuple):\n    def __eq__(self, other):\n        return True\n\ndef similar(a, b):\n    return E()\n"
    assert V.code_rewards_batch([good, wrong, always_equal], [problem] * 3) == [1.0, 0.0, 0.0]


def test_code_reward_stdio(clean_sandbox):
    problem = {"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7"]}
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    via_fd = "import sys\na, b = map(int, open(0).read().split())\nsys.stdout.write(str(a + b))\n"
    wrong = "a, b = map(int, input().split())\nprint(a - b)\n"
    crash = "a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1)\n"
    loop = "while True:\n    pass\n"
    rewards = V.code_rewards_batch([good, via_fd, wrong, crash, loop], [problem] * 5, timeout=2)
    assert rewards == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_code_reward_rejects_malformed_problem():
    with pytest.raises(ValueError):
        V.code_reward("print(1)", {"question": "?"})


def test_code_reward_reports_infrastructure_failure(monkeypatch, clean_sandbox):
    monkeypatch.setattr(S, "_HARNESS_SRC", "import sys\nsys.exit(3)\n")  # never reports "started"
    assert V.code_verdict("    return a + b\n", ADD).status == "error"
    assert V.code_reward("    return a + b\n", ADD) is None

    def no_file(*args, **kwargs):
        raise OSError("out of memory")

    monkeypatch.setattr(S, "_anonymous_file", no_file)
    assert V.code_reward("    return a + b\n", ADD) is None


# ---------------------------------------------------------------------------------------------
# Code: hostile programs, through the real sandbox, in every available mode
# ---------------------------------------------------------------------------------------------

HOSTILE_TIMEOUT = 1.5

HOSTILE = {
    "endless_loop": "def add(a, b):\n    while True:\n        pass\n",
    "long_sleep": "import time\n\ndef add(a, b):\n    time.sleep(600)\n    return a + b\n",
    "alloc_10GB": "def add(a, b):\n    block = bytearray(10 * 2**30)\n    return a + b\n",
    "output_flood": "import sys\n\ndef add(a, b):\n    while True:\n        sys.stdout.write('x' * 65536)\n",
    "stderr_flood": "import os\n\ndef add(a, b):\n    while True:\n        os.write(2, b'y' * 65536)\n",
    "sys_exit_before_tests": ("import sys\n\ndef add(a, b):\n    return a + b\n\nprint('all tests passed')\nsys.exit(0)\n"),
    "os_exit_before_tests": "import os\n\ndef add(a, b):\n    return a + b\n\nprint('all tests passed')\nos._exit(0)\n",
    "exit_inside_call": "import sys\n\ndef add(a, b):\n    sys.exit(0)\n",
    "always_equal": (
        "class AlwaysEqual:\n    def __eq__(self, other):\n        return True\n\ndef add(a, b):\n    return AlwaysEqual()\n"
    ),
    "int_subclass_equal": (
        "class Sneaky(int):\n    def __eq__(self, other):\n        return True\n\ndef add(a, b):\n    return Sneaky(0)\n"
    ),
    "patched_builtins": (
        "import builtins\nbuiltins.AssertionError = type('Nope', (Exception,), {})\n"
        "builtins.abs = lambda x: 0\nabs = lambda x: 0\n\ndef add(a, b):\n    return 0\n"
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_program_scores_zero(mode, name, clean_sandbox):
    start = time.monotonic()
    verdict = V.code_verdict(HOSTILE[name], ADD, timeout=HOSTILE_TIMEOUT, mode=mode)
    elapsed = time.monotonic() - start
    assert verdict.mode == mode
    assert verdict.reward == 0.0, verdict
    assert elapsed < HOSTILE_TIMEOUT + 3, elapsed
    if name in ("endless_loop", "long_sleep"):
        assert verdict.status == "timeout"
    else:
        assert verdict.status == "failed", verdict  # caught before the wall clock


def test_builtins_shadowing_is_not_inherited_by_tests(clean_sandbox):
    problem = dict(ADD, test="def check(candidate):\n    assert abs(candidate(2, 3) - 5) < 1e-9\n")
    honest = "    return a + b\n"
    cheat = "import builtins\nbuiltins.abs = lambda x: 0\nabs = lambda x: 0\n\ndef add(a, b):\n    return 0\n"
    assert V.code_rewards_batch([honest, cheat], [problem, problem]) == [1.0, 0.0]


@pytest.fixture
def witness_fifo():
    """A FIFO any uid may write, where a program can see it: the namespace modes hide the host's
    /tmp (pytest's tmp_path), so it lives in /var/tmp."""
    folder = tempfile.mkdtemp(prefix="verifiers-witness-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    os.chmod(folder, 0o755)
    fifo = os.path.join(folder, "witness")
    os.mkfifo(fifo, 0o666)
    os.chmod(fifo, 0o666)
    yield fifo
    os.unlink(fifo)
    os.rmdir(folder)


@pytest.mark.parametrize("mode", MODES)
def test_setsid_grandchild_never_writes_after_timeout(mode, witness_fifo, clean_sandbox):
    """The witness is a FIFO (a special file: writable even on the read-only file system of the
    namespace modes): the program writes to it in time, a setsid grandchild would write later."""
    fifo = witness_fifo
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    write = f"import os; fd = os.open({str(fifo)!r}, os.O_WRONLY | os.O_NONBLOCK); os.write(fd, b'%s')"
    grandchild = "import time; time.sleep(1.5); " + write % "escaped"
    program = (
        "import subprocess, sys, time\n" + write % "written in time" + "\n"
        f"subprocess.Popen(['setsid', sys.executable, '-c', {grandchild!r}],\n"
        "                 start_new_session=True, stdin=subprocess.DEVNULL)\n"
        "\ndef add(a, b):\n    time.sleep(600)\n"
    )
    try:
        verdict = V.code_verdict(program, ADD, timeout=1.0, mode=mode)
        assert verdict.status == "timeout", verdict
        assert os.read(reader, 100) == b"written in time"  # the grandchild was stopped, not blocked
        time.sleep(2.0)
        assert os.read(reader, 100) == b"", "a setsid grandchild outlived the sandbox"
    finally:
        os.close(reader)


@pytest.mark.parametrize("mode", MODES)
def test_fifty_sleeping_children_are_killed(mode, clean_sandbox):
    token = f"600.{secrets.randbelow(10**9):09d}"
    program = (
        "import subprocess\n"
        f"children = [subprocess.Popen(['sleep', '{token}']) for _ in range(50)]\n"
        "\ndef add(a, b):\n    return a + b\n"
    )
    verdict = V.code_verdict(program, ADD, timeout=5.0, mode=mode)
    assert verdict.status == "passed", verdict  # the tests pass; the children must still die
    assert _pids_with_cmdline(token) == []


@pytest.mark.parametrize("mode", MODES)
def test_network_connection_fails(mode, clean_sandbox):
    """A connection to a closed local port always fails; in the namespace modes the network
    namespace has no usable interface at all, so even a public address is unreachable (ENETUNREACH).
    The fallback mode does not isolate the network (documented), so no public address is tried."""
    targets = [("127.0.0.1", _closed_local_port())]
    if mode != "fallback":
        targets.append(("1.1.1.1", 53))
    for host, port in targets:
        expect_unreachable = mode != "fallback"
        program = (
            "import errno, socket\n\ndef add(a, b):\n"
            "    s = socket.socket()\n    s.settimeout(2)\n"
            f"    try:\n        s.connect(({host!r}, {port}))\n        return 0\n"
            "    except OSError as exc:\n"
            f"        if {expect_unreachable} and exc.errno != errno.ENETUNREACH:\n            return 0\n"
            "        return a + b\n"
        )
        verdict = V.code_verdict(program, ADD, timeout=5.0, mode=mode)
        assert verdict.status == "passed", (host, verdict)


def test_concurrent_sandboxes(clean_sandbox):
    completions = ["    return a + b\n", "    return a * b\n"] * 4
    assert V.code_rewards_batch(completions, [ADD] * 8, workers=4) == [1.0, 0.0] * 4


# ---------------------------------------------------------------------------------------------
# HumanEval
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def humaneval():
    problems = V.load_humaneval()
    assert len(problems) == 164
    assert set(problems[0]) == {"task_id", "prompt", "canonical_solution", "test", "entry_point"}
    return problems


def test_humaneval_canonical_solutions_all_pass(humaneval, clean_sandbox):
    start = time.monotonic()
    rewards = V.code_rewards_batch([p["canonical_solution"] for p in humaneval], humaneval)
    elapsed = time.monotonic() - start
    failed = [p["task_id"] for p, r in zip(humaneval, rewards) if r != 1.0]
    assert failed == [], failed
    print(f"164 HumanEval canonical solutions in {elapsed:.1f} s ({DETECTED_MODE})")


def test_humaneval_wrong_solutions_fail(humaneval, clean_sandbox):
    shifted = [humaneval[(i + 1) % len(humaneval)]["canonical_solution"] for i in range(len(humaneval))]
    rewards = V.code_rewards_batch(shifted, humaneval)
    passed = [p["task_id"] for p, r in zip(humaneval, rewards) if r != 0.0]
    assert passed == [], passed


# ---------------------------------------------------------------------------------------------
# Attacks: programs that try to score 1.0 without solving the problem, or to poison
# every later reward. Each one scored 1.0 or left a file behind before the fix.
# ---------------------------------------------------------------------------------------------


def _persistence_targets() -> list[str]:
    """Folders a program could plant code in that a later interpreter (or the trainer) reads."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    folders = [*site.getsitepackages(), paths["purelib"], paths["stdlib"], os.path.dirname(os.path.abspath(V.__file__))]
    folders += [tempfile.gettempdir(), "/dev/shm", os.path.expanduser("~"), os.getcwd()]
    return sorted({os.path.realpath(f) for f in folders if os.path.isdir(f)})


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_persistence_leaves_no_file(mode, clean_sandbox):
    """A program writes a .pth into site-packages, a module next to verifiers.py and files into
    /tmp, /dev/shm, $HOME, the stdlib: nothing it writes outside its own folder may outlive the run."""
    if mode == "fallback":
        pytest.skip("fallback mode cannot stop writes as the trainer's user (documented limit, warned once)")
    name = f"verifiers-attack-{secrets.token_hex(6)}"
    targets = [os.path.join(folder, name + suffix) for folder in _persistence_targets() for suffix in (".pth", ".py")]
    program = (
        "import os\n"
        f"for path in {targets!r}:\n"
        "    try:\n        with open(path, 'w') as f:\n            f.write('import os\\n')\n"
        "    except OSError:\n        pass\n"
        "\ndef add(a, b):\n    return a + b\n"
    )
    try:
        verdict = V.code_verdict(program, ADD, timeout=5.0, mode=mode)
        left = [path for path in targets if os.path.exists(path)]
    finally:
        for path in targets:
            if os.path.exists(path):
                os.unlink(path)
    assert verdict.status == "passed", verdict  # the program itself is correct and ran
    assert left == [], f"files written by a sandboxed program outlived it: {left}"


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_persistence_stdio_leaves_no_file(mode, clean_sandbox):
    if mode == "fallback":
        pytest.skip("fallback mode cannot stop writes as the trainer's user (documented limit, warned once)")
    name = f"verifiers-attack-{secrets.token_hex(6)}"
    targets = [os.path.join(folder, name + ".pth") for folder in _persistence_targets()]
    program = (
        f"for path in {targets!r}:\n"
        "    try:\n        open(path, 'w').write('import os\\n')\n    except OSError:\n        pass\n"
        "print(sum(map(int, input().split())))\n"
    )
    try:
        verdict = V.code_verdict(program, {"inputs": ["1 2\n"], "outputs": ["3"]}, timeout=5.0, mode=mode)
        left = [path for path in targets if os.path.exists(path)]
    finally:
        for path in targets:
            if os.path.exists(path):
                os.unlink(path)
    assert verdict.status == "passed", verdict
    assert left == [], left


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_sandbox_interpreters_skip_site_processing(mode, clean_sandbox):
    """Neither the program's interpreter nor the harness processes site-packages' .pth files
    (`-S`): a planted .pth can never run inside a sandbox. The program still imports from
    site-packages (the harness adds those folders itself)."""
    program = (
        "import sys\nimport numpy\n\ndef add(a, b):\n"
        "    return a + b if sys.flags.no_site == 1 and sys.flags.isolated == 1 else 0\n"
    )
    stdio = "import sys, numpy\nprint(3 if sys.flags.no_site == 1 and sys.flags.isolated == 1 else 0)\n"
    assert V.code_verdict(program, ADD, timeout=10.0, mode=mode).status == "passed"
    assert V.code_verdict(stdio, {"inputs": [""], "outputs": ["3"]}, timeout=10.0, mode=mode).status == "passed"


def test_attack_math_worker_does_not_load_code_from_disk(monkeypatch, tmp_path):
    """Math workers run code held in memory: a rewritten math_worker.py on disk (which a program
    could write where the file system is not protected) does not change any math reward."""
    source = math_pool._MATH_WORKER_SRC
    tampered = source.replace("def verify_pair(", "def verify_pair(*a):\n    return True\n\n\ndef _x(")
    assert tampered != source
    (tmp_path / "sandbox").mkdir()
    (tmp_path / "sandbox" / "math_worker.py").write_text(tampered)
    (tmp_path / "sandbox" / "math_pool.py").write_text(open(math_pool.__file__, encoding="utf-8").read())
    math_pool.close()
    monkeypatch.setattr(math_pool, "__file__", str(tmp_path / "sandbox" / "math_pool.py"))
    try:
        assert V.math_reward("\\boxed{3}", "4") == 0.0
        assert V.math_reward("\\boxed{0.5}", "\\frac{1}{2}") == 1.0
        math_pool.close()
        monkeypatch.setattr(math_pool, "_MATH_WORKER_SRC", tampered)  # the tampered code, were it run, passes anything
        assert V.math_reward("\\boxed{3}", "4") == 1.0
    finally:
        math_pool.close()


def test_math_worker_skips_site_processing():
    math_pool.close()
    worker = math_pool._MathWorker()
    try:
        argv = worker.proc.args
        assert "-S" in argv and "-I" in argv, argv
        assert V.__file__ not in " ".join(argv) and "math_worker.py" not in " ".join(argv[:-1])
        assert worker.ask("\\boxed{1}", "\\boxed{1}", None, 60) == (True, False)  # (verdict, recycle)
    finally:
        worker.close()


# A program that looks for the run's secret tokens (32 hex digits) in the memory of a process
# (its own, or its ancestors' through /proc/<pid>/mem) and writes every candidate to every pipe
# it can open, its own and its ancestors' (through /proc/<pid>/fd).
_FORGER = (
    f"TEST_PID = {os.getpid()}\n"
    + r"""
import os, re, sys

def _ancestors():
    pids, pid = [], os.getpid()
    for _ in range(6):
        if pid == TEST_PID:  # never the test process itself or its ancestors (the test's shell)
            break
        pids.append(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if pid <= 0:
            break
    return pids

def _tokens(pid):
    found = []
    try:
        maps = open(f"/proc/{pid}/maps").read().splitlines()
        mem = open(f"/proc/{pid}/mem", "rb", 0)
    except OSError:
        return found
    for line in maps:
        fields = line.split()
        if "r" not in fields[1] or (len(fields) > 5 and fields[5].startswith("/")):
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if hi - lo > 256 << 20:
            continue
        try:
            mem.seek(lo)
            found += re.findall(rb"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])", mem.read(hi - lo))
        except (OSError, OverflowError, ValueError):
            pass
    return found

def _pipes(pid):
    fds = []
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return fds
    for name in names:
        path = f"/proc/{pid}/fd/{name}"
        try:
            if os.readlink(path).startswith("pipe:"):
                fds.append(int(name) if pid == os.getpid() else os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    return fds

def forge():
    pids = _ancestors()
    tokens = []
    for pid in pids:
        tokens += _tokens(pid)
    tokens = list(dict.fromkeys(tokens))[:1500]
    fds = [fd for pid in pids for fd in _pipes(pid)]
    for fd in fds:
        try:
            os.set_blocking(fd, False)
        except OSError:
            pass
        for token in tokens:
            try:
                os.write(fd, token + b"\n")
            except OSError:
                break
    return len(tokens), len(fds)
"""
)

_FRAME_FORGER = r"""
import gc, os, sys

def forge_from_frames():
    frame = sys._getframe()
    while frame is not None:
        names = frame.f_locals
        if "pass_token" in names and "status_fd" in names:
            os.write(names["status_fd"], names["pass_token"] + b"\n")
            os._exit(0)
        frame = frame.f_back
    for obj in gc.get_objects():
        if isinstance(obj, dict) and "pass_token" in obj and "status_fd" in obj:
            os.write(obj["status_fd"], str(obj["pass_token"]).encode() + b"\n")
            os._exit(0)
"""

FORGERIES = {
    "frames": _FRAME_FORGER + "forge_from_frames()\n\ndef add(a, b):\n    return 0\n",
    "memory_at_load": _FORGER + "forge()\nos._exit(0)\n\ndef add(a, b):\n    return 0\n",
    "memory_in_call": _FORGER + "\ndef add(a, b):\n    forge()\n    os._exit(0)\n",
    "memory_then_wrong": _FORGER + "forge()\n\ndef add(a, b):\n    return 0\n",
}


@pytest.mark.parametrize("mode", ATTACK_MODES)
@pytest.mark.parametrize("name", list(FORGERIES))
def test_attack_forged_verdict_humaneval(mode, name, clean_sandbox):
    verdict = V.code_verdict(FORGERIES[name], ADD, timeout=10.0, mode=mode)
    assert verdict.reward == 0.0, verdict


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_forged_verdict_mbpp(mode, clean_sandbox):
    problem = {"test_list": ["assert add(2, 3) == 5"]}
    for program in FORGERIES.values():
        verdict = V.code_verdict(program, problem, timeout=10.0, mode=mode)
        assert verdict.reward == 0.0, (program[-60:], verdict)


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_forged_verdict_stdio(mode, clean_sandbox):
    """A stdin/stdout program reads its ancestors' memory through /proc/<pid>/mem for the tokens
    and writes them into the status pipe through /proc/<pid>/fd."""
    problem = {"inputs": ["1 2\n"], "outputs": ["3"]}
    for tail in ("forge()\nos._exit(0)\n", "forge()\nprint(0)\n"):
        verdict = V.code_verdict(_FORGER + tail, problem, timeout=10.0, mode=mode)
        assert verdict.reward == 0.0, (tail, verdict)


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_expected_output_not_in_reach(mode, clean_sandbox):
    """The expected outputs must not be readable by a stdin/stdout program: it scans the memory of
    every process it can see for a 31-digit number (the expected output) and prints it."""
    secret = str(10**30 + secrets.randbelow(10**29))
    program = (
        "import os, re\n"
        "found = b''\n"
        "for pid in os.listdir('/proc'):\n"
        "    if not pid.isdigit() or int(pid) == os.getpid():\n        continue\n"
        "    try:\n"
        "        mem = open(f'/proc/{pid}/mem', 'rb', 0)\n"
        "        maps = open(f'/proc/{pid}/maps').read().splitlines()\n"
        "    except OSError:\n        continue\n"
        "    for line in maps:\n"
        "        lo, hi = (int(x, 16) for x in line.split()[0].split('-'))\n"
        "        if hi - lo < 256 << 20 and 'r' in line.split()[1]:\n"
        "            try:\n"
        "                mem.seek(lo)\n"
        "                m = re.search(rb'(?<![0-9])1[0-9]{30}(?![0-9])', mem.read(hi - lo))\n"
        "                found = m.group() if m else found\n"
        "            except (OSError, OverflowError, ValueError):\n"
        "                pass\n"
        "print(found.decode() or 0)\n"
    )
    verdict = V.code_verdict(program, {"inputs": ["x\n"], "outputs": [secret]}, timeout=10.0, mode=mode)
    assert verdict.reward == 0.0, verdict


def _humaneval_problem(task_id: str) -> dict:
    return next(p for p in V.load_humaneval() if p["task_id"] == task_id)


GLOBAL_REDEFINITIONS = {
    # full functions (chat format): the prompt's helper is redefined next to the entry point
    "HumanEval/38": "```python\ndef encode_cyclic(s):\n    return s\n\ndef decode_cyclic(s):\n    return s\n```",
    "HumanEval/50": "```python\ndef encode_shift(s):\n    return s\n\ndef decode_shift(s):\n    return s\n```",
    "HumanEval/32": "```python\ndef poly(xs, x):\n    return 0\n\ndef find_zero(xs):\n    return 0.0\n```",
}
GLOBAL_REDEFINITION_BODIES = {
    # HumanEval's own format: a body continuing the prompt, then a redefinition of the helper
    "HumanEval/38": "    return s\n\n\ndef encode_cyclic(s):\n    return s\n",
    "HumanEval/32": "    return 0.0\n\n\ndef poly(xs, x):\n    return 0\n",
    "HumanEval/32-global": "    global poly\n    poly = lambda xs, x: 0\n    return 0.0\n",
}


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_redefined_prompt_helpers_humaneval(mode, clean_sandbox):
    for task_id, completion in [*GLOBAL_REDEFINITIONS.items(), *GLOBAL_REDEFINITION_BODIES.items()]:
        problem = _humaneval_problem(task_id.split("-")[0])
        verdict = V.code_verdict(completion, problem, timeout=10.0, mode=mode)
        assert verdict.reward == 0.0, (task_id, verdict)
        assert V.code_verdict(problem["canonical_solution"], problem, timeout=10.0, mode=mode).reward == 1.0


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_redefined_modules(mode, clean_sandbox):
    """Tests call modules (math) and the completion patches or replaces them."""
    mbpp_setup = {"test_list": ["assert math.isclose(area(2), 12.566370614359172)"], "test_setup_code": "import math"}
    mbpp_bare = {"test_list": ["assert math.floor(area(2)) == 12"]}
    humaneval = dict(ADD, test="import math\n\ndef check(candidate):\n    assert math.isclose(candidate(2, 3), 5.0)\n")
    attacks = [
        (mbpp_setup, "import math\nmath.isclose = lambda *a, **k: True\n\ndef area(r):\n    return 0\n"),
        (mbpp_setup, "import sys\nsys.modules['math'].isclose = lambda *a, **k: True\n\ndef area(r):\n    return 0\n"),
        (mbpp_bare, "class math:\n    @staticmethod\n    def floor(x):\n        return 12\n\ndef area(r):\n    return 0\n"),
        (mbpp_bare, "import math\nmath.floor = lambda x: 12\n\ndef area(r):\n    return 0\n"),
        (humaneval, "import math\nmath.isclose = lambda *a, **k: True\n\ndef add(a, b):\n    return 0\n"),
    ]
    for problem, program in attacks:
        verdict = V.code_verdict(program, problem, timeout=10.0, mode=mode)
        assert verdict.reward == 0.0, (program, verdict)
    honest = "import math\n\ndef area(r):\n    return math.pi * r * r\n"
    assert V.code_verdict(honest, mbpp_setup, timeout=10.0, mode=mode).reward == 1.0
    assert V.code_verdict(honest, mbpp_bare, timeout=10.0, mode=mode).reward == 1.0


@pytest.mark.parametrize("mode", [m for m in ATTACK_MODES if m != "fallback"])
def test_attack_cannot_signal_host_processes(mode, clean_sandbox):
    import subprocess
    import sys

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        program = (
            "import os, signal\n"
            f"for pid in ({victim.pid}, {os.getpid()}, 1):\n"
            "    try:\n        os.kill(pid, signal.SIGKILL) if pid != 1 else None\n    except OSError:\n        pass\n"
            "\ndef add(a, b):\n    return a + b\n"
        )
        V.code_verdict(program, ADD, timeout=5.0, mode=mode)
        time.sleep(0.2)
        assert victim.poll() is None, "a sandboxed program killed a host process"
    finally:
        victim.kill()
        victim.wait()


def test_fallback_limits_are_printed_once(monkeypatch, caplog):
    monkeypatch.setenv("VERIFIERS_SANDBOX", "fallback")
    monkeypatch.setattr(S, "_sandbox_mode", None)
    with caplog.at_level("WARNING", logger=V.__name__):
        assert V.sandbox_mode() == "fallback"
        assert V.sandbox_mode() == "fallback"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    for words in ("kill", "loopback", "write"):
        assert words in warnings[0], warnings[0]
    monkeypatch.setattr(S, "_sandbox_mode", None)


# ---------------------------------------------------------------------------------------------
# Edges
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [1e9, math.inf, 10**12])
def test_math_reward_huge_timeout_scores_correct_answers(timeout):
    assert V.math_reward("\\boxed{0.5}", "\\frac{1}{2}", timeout=timeout) == 1.0
    assert V.math_reward("\\boxed{0.4}", "\\frac{1}{2}", timeout=timeout) == 0.0


@pytest.mark.parametrize("timeout", [math.nan, -1.0, 0.0, "5"])
def test_math_reward_rejects_bad_timeout(timeout):
    with pytest.raises(ValueError):
        V.math_reward("\\boxed{0.5}", "\\frac{1}{2}", timeout=timeout)


def test_math_reward_timeout_does_not_count_the_wait_for_a_worker(monkeypatch):
    """Issue 62 turned this round: the wait for a free worker is not counted in `timeout` (a verdict must not depend
    on the neighbours' load); the request gets its own 0.5 s once a worker is its own (tests/test_sandbox_round6.py
    holds the node's permits side)."""
    V.math_reward("\\boxed{1}", "1")  # a worker started before the wait (its start is not what is measured)
    slots = threading.BoundedSemaphore(1)
    slots.acquire()  # every worker slot is busy
    monkeypatch.setattr(math_pool, "_math_slots", slots)
    releaser = threading.Timer(2.0, slots.release)
    releaser.start()
    try:
        start = time.monotonic()
        assert V.math_reward("\\boxed{0.5}", "\\frac{1}{2}", timeout=0.5) == 1.0
        assert time.monotonic() - start >= 2.0
    finally:
        releaser.cancel()


@pytest.mark.parametrize("timeout", [math.inf, math.nan, -1.0, 0.0, 1e30])
def test_code_reward_rejects_bad_timeout(timeout):
    with pytest.raises(ValueError):
        V.code_reward("    return a + b\n", ADD, timeout=timeout)


@pytest.mark.parametrize(
    "problem",
    [
        None,
        "def f(): pass",
        {"test_list": 5},
        {"test_list": ["assert f() == 1"], "test_setup_code": 3},
        {"entry_point": 3, "test": "def check(c): pass", "prompt": ""},
        {"entry_point": "f", "test": None, "prompt": ""},
        {"entry_point": "f", "test": "def check(c): pass", "prompt": None},
        {"inputs": 5, "outputs": 5},
        {"inputs": ["1"], "outputs": None},
    ],
)
def test_code_reward_malformed_problem_is_value_error(problem):
    with pytest.raises(ValueError):
        V.code_reward("def f():\n    return 1\n", problem)


def test_arith_reward_long_integers():
    big = "9" * 5000
    assert V.arith_reward(f"The answer is \\boxed{{{big}}}", big) == 1.0
    assert V.arith_reward(f"so {big}", big) == 1.0
    assert V.arith_reward(f"\\boxed{{{big[:-1]}8}}", big) == 0.0
    assert V.arith_reward(f"\\boxed{{{big}.50}}", big + ".5") == 1.0
    assert V.arith_reward(f"\\boxed{{-{big}}}", big) == 0.0
    assert V.arith_reward("\\boxed{-0.0}", "0") == 1.0


@pytest.mark.parametrize("mode", [m for m in ATTACK_MODES if m != "fallback"])
def test_attack_other_runs_folders_are_hidden(mode, clean_sandbox):
    """Sibling samples of the same problem run at the same time: nothing of another run (or of the
    host's temporary folder) is in a program's sight, and nothing of the run's secrets exists as a
    file: its /tmp starts empty and is its own."""
    decoy = os.path.join(tempfile.gettempdir(), f"decoy-{secrets.token_hex(6)}")
    os.mkdir(decoy)
    try:
        # only an interpreter that lives under /tmp (a CI's fresh venv) is bound back there, read-only
        expected = sorted({p.split("/")[2] for p in S._sandbox_view()["tmp_bind_back"]})
        program = (
            "import os\n"
            f"TMP = sorted(os.listdir('/tmp')) != {expected!r}\n"
            f"CWD = sorted(os.listdir(os.getcwd())) != ({expected!r} if os.getcwd() == '/tmp' else [])\n"
            f"SEEN = os.path.exists({decoy!r}) or TMP or CWD\n"
            "\ndef add(a, b):\n    return 0 if SEEN else a + b\n"
        )
        verdict = V.code_verdict(program, ADD, timeout=5.0, mode=mode)
        assert verdict.status == "passed", verdict
    finally:
        os.rmdir(decoy)


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_judge_is_out_of_reach(mode, clean_sandbox):
    """From the program, every way into the judge (its parent) fails: /proc/<judge>/fd links and
    mem, ptrace, pidfd_getfd of the status pipe."""
    program = (
        "import ctypes, os\n"
        "judge = os.getppid()\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\n"
        "reached = []\n"
        "for name, attempt in [\n"
        "    ('readlink', lambda: os.readlink(f'/proc/{judge}/fd/1')),\n"
        "    ('open fd', lambda: os.open(f'/proc/{judge}/fd/1', os.O_WRONLY)),\n"
        "    ('mem', lambda: open(f'/proc/{judge}/mem', 'rb').read(1)),\n"
        "    ('environ', lambda: open(f'/proc/{judge}/environ', 'rb').read(1)),\n"
        "]:\n"
        "    try:\n        attempt()\n        reached.append(name)\n    except OSError:\n        pass\n"
        "if libc.ptrace(16, judge, 0, 0) == 0:\n    reached.append('ptrace')\n"
        "pidfd = libc.syscall(434, judge, 0)\n"
        "if pidfd >= 0 and any(libc.syscall(438, pidfd, fd, 0) >= 0 for fd in range(3, 64)):\n"
        "    reached.append('pidfd_getfd')\n"
        "os.write(2, repr(reached).encode())\n"
        "\ndef add(a, b):\n    return 0 if reached else a + b\n"
    )
    verdict = V.code_verdict(program, ADD, timeout=5.0, mode=mode)
    assert verdict.status == "passed", verdict
