"""Round six of the rewards (issue 62): one test per class that got through, each through the real entry points.

1. an answer that restates the question (or leaves an operation to carry out on a numeric gold) scores 0, the forms
   a correct answer takes keep scoring 1, in training and in evaluation's math grader;
2. the explosive-number pre-check runs in linear time in the caller's thread;
3. the math workers are bounded per node with the code sandbox's run permits, their limits are CPU time (the wait
   for a permit is not counted), their memory is bounded, the OOM killer's first choice, and stated;
4. the node's run permits are out of a run's reach: masked in the namespace modes, flock refused in every mode."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time

import pytest

import sandbox as S
import verifiers as V
from sandbox import math_pool
from tests.test_verifiers import ATTACK_MODES, clean_sandbox  # noqa: F401 - the fixture, used below

pytestmark = [pytest.mark.usefixtures("clean_sandbox"), pytest.mark.slow]  # slow: the sandbox's attacks

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADD = {"prompt": "def add(a, b):\n", "entry_point": "add", "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}


def boxed(answer: str) -> str:
    return f"So the answer is $\\boxed{{{answer}}}$."


# ----- 1. a final answer is an answer

# (question, gold, the question's own expression copied into the box): 08e5dbc scored every one 1.0
RESTATED = [
    ("Compute $\\dbinom{16}{5}$.", "4368", "\\dbinom{16}{5}"),
    ("Simplify $\\sqrt{245}$.", "7\\sqrt{5}", "\\sqrt{245}"),
    ("Expand the product $(x+2)(x+5)$.", "x^2+7x+10", "(x+2)(x+5)"),
    ("Expand the product $(x+2)(x+5)$.", "x^2+7x+10", "(x + 5)(x + 2)"),  # the neighbouring form: factors swapped
    ("What is $\\sum_{k=1}^{10} k$?", "55", "\\sum_{k=1}^{10} k"),
    ("Evaluate $\\int_0^1 2x\\,dx$.", "1", "\\int_0^1 2x\\,dx"),
    ("Find $\\lim_{x\\to 0} \\frac{\\sin x}{x}$.", "1", "\\lim_{x\\to 0}\\frac{\\sin x}{x}"),
    ("Find $\\gcd(12, 18)$.", "6", "\\gcd(12, 18)"),
    (
        "Compute $\\det\\begin{pmatrix} 2 & 1 \\\\ 1 & 3 \\end{pmatrix}$.",
        "5",
        "\\det\\begin{pmatrix} 2 & 1 \\\\ 1 & 3 \\end{pmatrix}",
    ),
    ("What is $2^{10}$?", "1024", "2^{10}"),
    ("What is $17 \\cdot 23$?", "391", "17 \\cdot 23"),
    ("What is $3+4+5$?", "12", "3+4+5"),
    ("Compute $5!$.", "120", "5!"),
    ("Compute $\\lfloor 7.5 \\rfloor$.", "7", "\\lfloor 7.5 \\rfloor"),
    ("Compute $\\log_2 64$.", "6", "\\log_2 64"),
    ("Rationalize $\\frac{1}{\\sqrt{2}}$.", "\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
]
# an operation left to carry out, without the question (every caller of math_reward, the question not given)
UNDONE = [
    ("4368", "\\binom{16}{5}"),
    ("1024", "2^{10}"),
    ("7", "3+4"),
    ("120", "5!"),
    ("6", "\\gcd(12,18)"),
    ("4", "\\sqrt{16}"),
]
# the forms a correct answer takes: they keep scoring 1
CORRECT = [
    ("Find the value.", "\\frac{3}{4}", "\\frac{6}{8}"),  # an unreduced fraction
    ("Find the value.", "\\frac{3}{4}", "6/8"),
    ("Find the value.", "7\\sqrt{5}", "7\\sqrt{5}"),  # a simplified radical
    ("Find the value.", "\\frac{\\sqrt{6}}{3}", "\\frac{\\sqrt{6}}{3}"),
    ("Find the area.", "3\\pi", "3\\pi"),
    ("Find the interval.", "[1,3)", "[1, 3)"),
    ("Solve for $x$.", "5", "x = 5"),
    ("What share?", "50\\%", "50\\%"),
    ("Find it.", "1+\\sqrt{2}", "1 + \\sqrt{2}"),
    ("Find the length.", "1.6", "1.6 \\text{ cm}"),
    ("Find the speed.", "3\\times 10^{8}", "3 \\times 10^{8}"),
    ("Find the angle.", "30", "30^\\circ"),
    ("Find it.", "-\\frac{1}{2}", "-\\dfrac{1}{2}"),
    ("Find the roots.", "1, -2", "-2, 1"),
    ("Find $x$ if $x+1=8$.", "7", "7"),  # a plain number the question holds is no restatement
    ("Which is larger, $\\sqrt{2}+\\sqrt{3}$ or $\\sqrt{10}$?", "\\sqrt{2}+\\sqrt{3}", "\\sqrt{2}+\\sqrt{3}"),
    ("Simplify $\\frac{x^2-1}{x-1}$.", "x+1", "x+1"),
]


@pytest.mark.parametrize("question,gold,pred", RESTATED)
def test_an_answer_that_restates_the_question_scores_0(question, gold, pred):
    assert V.math_reward(boxed(pred), gold, question=question) == 0.0


@pytest.mark.parametrize("gold,pred", UNDONE)
def test_an_operation_left_to_carry_out_scores_0_without_the_question(gold, pred):
    assert V.math_reward(boxed(pred), gold) == 0.0


@pytest.mark.parametrize("question,gold,pred", CORRECT)
def test_the_forms_a_correct_answer_takes_keep_scoring_1(question, gold, pred):
    assert V.math_reward(boxed(pred), gold, question=question) == 1.0


def test_every_caller_passes_the_question():
    """compute_rewards (training) and evaluation's math grader both score with the question."""
    task = V.Task("t", "math", [], "")
    problems = [{"question": q, "answer": g} for q, g, _ in RESTATED[:3]] + [{"question": "Find it.", "answer": "7\\sqrt{5}"}]
    completions = [boxed(p) for _, _, p in RESTATED[:3]] + [boxed("7\\sqrt{5}")]
    assert V.compute_rewards(task, problems, completions) == [0.0, 0.0, 0.0, 1.0]
    assert V.grade(task, "math", problems, completions)[0] == [0.0, 0.0, 0.0, 1.0]


# ----- 2. nothing non-linear on a completion in the caller's thread


def test_the_explosive_precheck_is_linear():
    """A box of `^`, spaces, a digit and spaces cost 08e5dbc's regex ~a^2 c^3 steps: 203 characters took 2.87 s,
    holding the GIL. Now the pre-check is linear, and the 1000-character box scores 0.0."""
    shape = lambda n: "^" * (n // 4) + " " * (n // 4) + "9" + " " * (n // 2)
    assert V.math_reward(boxed(shape(996)), "9") == 0.0

    def cost(n: int) -> float:
        text = shape(n)
        start = time.perf_counter()
        for _ in range(20):
            V._EXPLOSIVE_RE.search(V._squash(text))
        return time.perf_counter() - start

    cost(1000)
    ratio = cost(16000) / max(cost(1000), 1e-6)  # 16x the length: ~16x the time when linear, ~4096x when cubic
    assert ratio < 100, ratio
    assert V._EXPLOSIVE_RE.search(V._squash("9^{ 9 ^ {9}}")) and V._EXPLOSIVE_RE.search("10^{1234567}")


# ----- 3. the math workers: bounded per node, CPU-time limits, memory


def load_worker_module():
    spec = importlib.util.spec_from_file_location("math_worker_under_test", os.path.join(HERE, "sandbox", "math_worker.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_workers_limits_are_cpu_time_not_the_wall_clock():
    """08e5dbc used math-verify's SIGALRM: an honest answer that took 1.3-1.9 s scored 0 beside a busy rank."""
    import signal

    worker = load_worker_module()
    old = signal.signal(signal.SIGPROF, worker._on_cpu_limit)
    try:
        assert worker.within_cpu(0.3, time.sleep, 1.0) is None  # a second of wall clock, no CPU: not stopped

        def spin():
            while True:
                pass

        start = time.process_time()
        with pytest.raises(worker.CPULimit):
            worker.within_cpu(0.3, spin)
        assert 0.25 < time.process_time() - start < 2.0
    finally:
        signal.signal(signal.SIGPROF, old)


def test_the_math_workers_hold_the_nodes_run_permits_and_the_wait_is_not_counted():
    """Every permit of the node held (another rank's runs, say): a math request waits without running, and the wait
    (longer than its timeout) does not make an honest answer 0 once a permit is free."""
    V.math_reward(boxed("1"), "1")  # a worker started
    held = [S.take_node_core() for _ in range(S.runs_at_once())]
    result = {}
    asker = threading.Thread(target=lambda: result.setdefault("r", V.math_reward(boxed("\\frac{2}{4}"), "1/2", timeout=1.0)))
    try:
        asker.start()
        asker.join(2.5)
        assert asker.is_alive() and not result  # waiting for a permit: nothing ran
    finally:
        for fd in held:
            S.give_node_core(fd)
    asker.join(30)
    assert result["r"] == 1.0


def worker_pids() -> list[int]:
    with math_pool._math_pool_lock:
        return [w.proc.pid for w in math_pool._math_pool]


def test_a_workers_memory_is_bounded_it_is_the_oom_killers_first_choice_and_stated(monkeypatch, caplog):
    math_pool.close()
    assert V.math_reward(boxed("2"), "2.0") == 1.0
    (pid,) = worker_pids()[:1]
    with open(f"/proc/{pid}/oom_score_adj") as f:
        assert f.read().strip() == "1000"
    with open(f"/proc/{pid}/limits") as f:
        line = next(x for x in f if x.startswith("Max address space"))
    assert str(int(math_pool.WORKER_LIMITS["address_space"])) in line
    # a worker that holds more than RESIDENT_LIMIT after a request is replaced (here: the limit set to 1 byte)
    math_pool.close()
    small = math_pool._MATH_WORKER_SRC.replace("RESIDENT_LIMIT = 536870912", "RESIDENT_LIMIT = 1")
    assert small != math_pool._MATH_WORKER_SRC
    monkeypatch.setattr(math_pool, "_MATH_WORKER_SRC", small)
    assert V.math_reward(boxed("3"), "3.0") == 1.0
    assert worker_pids() == []  # replaced, not kept idle
    math_pool.close()
    monkeypatch.setattr(math_pool, "_stated", False)
    with caplog.at_level(logging.INFO, logger="verifiers"):
        V.check_golds(V.Task("t", "math", [{"question": "q", "answer": "1"}], ""))
    assert (
        "math workers: up to" in caplog.text
        and "the OOM killer's first choice" in caplog.text
        and "of CPU a parse" in caplog.text
    )


# ----- 4. the node's run permits are out of a run's reach


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_flock_is_refused_to_a_run(mode):
    """flock on any file (a run permit it found, or its own): EPERM in every mode (seccomp; x86_64)."""
    program = (
        "import fcntl, os\nTOOK = []\n"
        "fd = os.open('/tmp/mine', os.O_RDWR | os.O_CREAT)\n"
        "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n    TOOK.append(1)\nexcept OSError:\n    pass\n"
        "def add(a, b):\n    return 0 if TOOK else a + b\n"
    )
    verdict = V.code_verdict(program, ADD, timeout=10.0, mode=mode)
    assert verdict.status == "passed", verdict


def test_attack_a_non_root_trainers_permits_are_hidden_from_its_runs():
    """A non-root trainer whose TMPDIR is a scratch folder outside /tmp and its home (a cluster's): 08e5dbc's run saw
    <tmp>/verifiers-cores-<uid> and could flock every free permit with a read-only descriptor."""
    from tests.test_sandbox_isolation import NON_ROOT_UID, _system_python

    python = _system_python()
    if os.geteuid() != 0 or shutil.which("setpriv") is None or python is None:
        pytest.skip("needs root (to become another user), setpriv and a system python3 any user can run")
    workdir = tempfile.mkdtemp(prefix="verifiers-r6-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    try:
        home, scratch = os.path.join(workdir, "home"), os.path.join(workdir, "scratch")  # the scratch: not in the home
        os.mkdir(home)
        os.mkdir(scratch)
        shutil.copy(V.__file__, workdir)  # verifiers.py and the sandbox/ folder beside it
        shutil.copytree(os.path.join(HERE, "sandbox"), os.path.join(workdir, "sandbox"))
        for root, dirs, files in os.walk(workdir):
            for name in dirs + files:
                os.chown(os.path.join(root, name), NON_ROOT_UID, NON_ROOT_UID)
        os.chown(workdir, NON_ROOT_UID, NON_ROOT_UID)
        os.chmod(workdir, 0o755)
        permits = os.path.join(scratch, f"verifiers-cores-{NON_ROOT_UID}")
        program = (
            "import os\nSEEN = []\n"
            f"try:\n    SEEN += os.listdir({permits!r})\n"
            f"    os.open({permits!r} + '/cpu0', os.O_RDONLY)\n    SEEN.append('opened')\n"
            "except OSError:\n    pass\n"
            "def add(a, b):\n    return 0 if SEEN else a + b\n"
        )
        script = (
            "import verifiers as V\n"
            f"v = V.code_verdict({'def add(a, b):' + chr(10) + '    return a + b' + chr(10)!r}, {ADD!r}, timeout=10.0)\n"
            f"w = V.code_verdict({program!r}, {ADD!r}, timeout=10.0)\n"
            "print(V.sandbox_mode(), v.status, w.status, w.stderr_tail[-200:])\n"
        )
        env = {
            "HOME": home,
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": workdir,
            "TMPDIR": scratch,
            "VERIFIERS_ALLOW_NO_CGROUP": "1",
        }
        proc = subprocess.run(
            ["setpriv", f"--reuid={NON_ROOT_UID}", f"--regid={NON_ROOT_UID}", "--clear-groups", python, "-c", script],
            capture_output=True,
            text=True,
            env=env,
            cwd=workdir,
            timeout=180,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        mode, honest, attack = proc.stdout.split()[:3]
        if mode == "fallback":
            pytest.skip("no user namespaces for a non-root user here: the masking is the namespace modes'")
        assert os.path.isdir(permits)  # the trainer's permits are there, on the host
        assert (honest, attack) == ("passed", "passed"), proc.stdout
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
