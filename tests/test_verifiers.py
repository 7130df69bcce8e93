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

import verifiers as V

# ---------------------------------------------------------------------------------------------
# Sandbox modes: the detected one, plus the fallback where namespaces work (both must hold).
# ---------------------------------------------------------------------------------------------

DETECTED_MODE = V.sandbox_mode()
MODES = [DETECTED_MODE] + (["fallback"] if DETECTED_MODE != "fallback" else [])
NAMESPACE_MODES = [m for m in MODES if m != "fallback"]


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
    prefix = (V._SANDBOX_MARKER + "=").encode()
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
    return set(glob.glob(os.path.join(tempfile.gettempdir(), V._SANDBOX_TMP_PREFIX + "*")))


@pytest.fixture
def clean_sandbox():
    """After the test: no sandboxed process is alive and no sandbox folder remains."""
    before = _sandbox_dirs()
    yield
    assert _sandbox_pids() == [], "sandboxed processes survived the run"
    assert _sandbox_dirs() - before == set(), "a sandbox temporary folder was left behind"


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
    ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", 1.0),
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
    pairs = [("\\boxed{0.5}", "1/2"), ("\\boxed{0.4}", "1/2"), ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}")]
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
    always_equal = (
        "class E(tuple):\n    def __eq__(self, other):\n        return True\n\n"
        "def similar(a, b):\n    return E()\n"
    )
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
    monkeypatch.setattr(V, "_HARNESS_SRC", "import sys\nsys.exit(3)\n")  # never reports "started"
    assert V.code_verdict("    return a + b\n", ADD).status == "error"
    assert V.code_reward("    return a + b\n", ADD) is None

    def no_tmp(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(V.tempfile, "mkdtemp", no_tmp)
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
    "sys_exit_before_tests": (
        "import sys\n\ndef add(a, b):\n    return a + b\n\nprint('all tests passed')\nsys.exit(0)\n"
    ),
    "os_exit_before_tests": "import os\n\ndef add(a, b):\n    return a + b\n\nprint('all tests passed')\nos._exit(0)\n",
    "exit_inside_call": "import sys\n\ndef add(a, b):\n    sys.exit(0)\n",
    "always_equal": (
        "class AlwaysEqual:\n    def __eq__(self, other):\n        return True\n\n"
        "def add(a, b):\n    return AlwaysEqual()\n"
    ),
    "int_subclass_equal": (
        "class Sneaky(int):\n    def __eq__(self, other):\n        return True\n\n"
        "def add(a, b):\n    return Sneaky(0)\n"
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


@pytest.mark.parametrize("mode", MODES)
def test_setsid_grandchild_never_writes_after_timeout(mode, tmp_path, clean_sandbox):
    before, after = tmp_path / "before.txt", tmp_path / "after.txt"
    grandchild = f"import time; time.sleep(1.5); open({str(after)!r}, 'w').write('escaped')"
    program = (
        "import subprocess, sys, time\n"
        f"open({str(before)!r}, 'w').write('written in time')\n"
        f"subprocess.Popen(['setsid', sys.executable, '-c', {grandchild!r}],\n"
        "                 start_new_session=True, stdin=subprocess.DEVNULL)\n"
        "\ndef add(a, b):\n    time.sleep(600)\n"
    )
    verdict = V.code_verdict(program, ADD, timeout=1.0, mode=mode)
    assert verdict.status == "timeout"
    assert before.exists()  # the file system is writable: the grandchild was stopped, not blocked
    time.sleep(2.0)
    assert not after.exists(), "a setsid grandchild outlived the sandbox"


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
