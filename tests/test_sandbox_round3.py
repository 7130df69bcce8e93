"""Round three of the code sandbox (issue 33): one test per attack class that got through, each checking the
class's cause, each followed by `clean_sandbox` (nothing of a run outlives it).

1. the judge's import path: a venv under /tmp (as .ci/run makes it) cannot be replaced by the program;
2. no feedback: the judge makes every call (and runs every stdin/stdout case) whatever the earlier ones returned,
   so the calls a program sees say nothing of a verdict (the page-cache oracle needs exactly that signal);
3. fail closed: runs reuse a bounded pool of cgroups, and where none can be had they do not run without limits
   unless the user opted in;
4. CPU: a run's CPU quota keeps a spinner from starving an honest run beside it;
5. and 6. allow-lists: socket families (vsock, netlink, packet, ...) and system calls (memfd_secret, ...);
7. fallback: a program of the trainer's uid cannot read the trainer's memory."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
import threading
import time

import pytest

import verifiers as V
from tests.test_verifiers import MODES, clean_sandbox  # noqa: F401 - the fixture, used below

try:
    import sandbox as S
except ImportError:  # the code before round three kept the sandbox in verifiers.py (how these tests ran on it)
    S = V

pytestmark = [pytest.mark.usefixtures("clean_sandbox"), pytest.mark.slow]  # slow: the sandbox's attacks

# ---------------------------------------------------------------------------------------------
# 2. No feedback: every case runs, the verdict comes only at the end
# ---------------------------------------------------------------------------------------------

THREE = {
    "prompt": "def add(a, b):\n",
    "entry_point": "add",
    "test": (
        "def check(candidate):\n"
        "    assert candidate(1, 1) == 2\n"
        "    for a in (2, 3):\n"
        "        assert candidate(a, 1) == a + 1\n"
    ),
}
# a program that logs every call it gets on its stderr (the run's stderr, which the verdict's tail shows)
COUNTING = (
    "import sys\nCALLS = []\n"
    "def add(a, b):\n"
    "    CALLS.append(a)\n"
    "    print('call', len(CALLS), file=sys.stderr, flush=True)\n"
    "    return 0 if len(CALLS) == 1 else a + b\n"
)


@pytest.mark.parametrize("mode", MODES)
def test_attack_no_feedback_humaneval_calls_go_on_after_a_failed_check(mode):
    verdict = V.code_verdict(COUNTING, THREE, timeout=10.0, mode=mode)
    assert verdict.status == "failed", verdict
    assert "call 3" in verdict.stderr_tail, f"the judge stopped calling after the first failure: {verdict.stderr_tail}"


@pytest.mark.parametrize("mode", MODES)
def test_attack_no_feedback_mbpp_lines_go_on_after_a_failed_one(mode):
    problem = {"test_list": ["assert add(1, 1) == 2", "assert add(2, 1) == 3", "assert add(3, 1) == 4"]}
    verdict = V.code_verdict(COUNTING, problem, timeout=10.0, mode=mode)
    assert verdict.status == "failed", verdict
    assert "call 3" in verdict.stderr_tail, f"the judge stopped calling after the first failure: {verdict.stderr_tail}"


@pytest.mark.parametrize("mode", MODES)
def test_attack_no_feedback_a_raising_call_does_not_stop_the_tests(mode):
    program = COUNTING.replace(
        "return 0 if len(CALLS) == 1", "if len(CALLS) == 1:\n        raise ValueError\n    return 0 if 0"
    )
    verdict = V.code_verdict(program, THREE, timeout=10.0, mode=mode)
    assert verdict.status == "failed", verdict
    assert "call 3" in verdict.stderr_tail, verdict.stderr_tail


@pytest.mark.parametrize("mode", MODES)
def test_attack_no_feedback_stdio_runs_the_next_case_after_a_wrong_one(mode):
    """Case 1 answers wrong; case 2 then sleeps past the deadline. A judge that stops at the first wrong case
    says "failed" at once; one that runs every case reaches case 2 and times out."""
    program = "import time\nx = input()\nif x == '2':\n    time.sleep(60)\nprint('wrong' if x == '1' else x)\n"
    problem = {"inputs": ["1\n", "2\n", "3\n"], "outputs": ["1\n", "2\n", "3\n"]}
    verdict = V.code_verdict(program, problem, timeout=2.0, mode=mode)
    assert verdict.status == "timeout", f"case 2 never ran after case 1 failed: {verdict}"


@pytest.mark.parametrize("mode", MODES)
def test_a_case_cut_at_the_runs_deadline_is_a_timeout_however_late_the_trainer_looks(mode, monkeypatch):
    """The run's deadline counts from when the trainer reads "started"; a loaded trainer reads it late, so the judge's
    own clock runs out first. A judge that then ended the run itself made it "failed" (the race behind the test
    above failing under load: 2.05 s, "failed", in a CI run of this suite); the judge waits for the trainer, whose
    deadline makes it a timeout. The trainer here looks 0.5 s late, every time."""
    real = S._watch

    def late(*args, **kwargs):
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(S, "_watch", late)
    program = "import time\nx = input()\nif x == '2':\n    time.sleep(60)\nprint('wrong' if x == '1' else x)\n"
    problem = {"inputs": ["1\n", "2\n", "3\n"], "outputs": ["1\n", "2\n", "3\n"]}
    verdict = V.code_verdict(program, problem, timeout=2.0, mode=mode)
    assert verdict.status == "timeout", verdict


@pytest.mark.parametrize("mode", MODES)
def test_each_stdio_case_has_its_own_time_limit(mode, monkeypatch):
    """Every case hangs: each is stopped at the case limit (1 s) and the next one runs, so the run fails after
    about three case limits, long before its own 20 s deadline. A judge with only the run's deadline times out."""
    monkeypatch.setattr(S, "CASE_TIMEOUT_S", 1.0)
    problem = {"inputs": ["1\n", "2\n", "3\n"], "outputs": ["1\n", "2\n", "3\n"]}
    verdict = V.code_verdict("import time\ntime.sleep(60)\n", problem, timeout=20.0, mode=mode)
    assert verdict.status == "failed", f"a hung case held the run to its deadline: {verdict}"
    assert 2.9 < verdict.elapsed_s < 10.0, f"not every case ran to its own limit: {verdict.elapsed_s:.2f} s"
    honest = V.code_verdict("print(input())\n", problem, timeout=20.0, mode=mode)
    assert honest.status == "passed", honest


@pytest.mark.parametrize("mode", MODES)
def test_a_call_past_the_case_limit_fails_and_the_tests_go_on(mode, monkeypatch):
    """The first call hangs: it fails at the case limit (the runner is stopped), the later calls fail at once,
    and the verdict comes well before the run's deadline."""
    monkeypatch.setattr(S, "CASE_TIMEOUT_S", 1.0)
    program = COUNTING.replace(
        "return 0 if len(CALLS) == 1", "if len(CALLS) == 1:\n        while True: pass\n    return 0 if 0"
    )
    verdict = V.code_verdict(program, THREE, timeout=20.0, mode=mode)
    assert verdict.status == "failed", f"a hung call held the run to its deadline: {verdict}"
    assert 0.9 < verdict.elapsed_s < 8.0, verdict
    assert "call 1" in verdict.stderr_tail and "call 2" not in verdict.stderr_tail, verdict.stderr_tail


@pytest.mark.parametrize("mode", MODES)
def test_no_feedback_keeps_the_verdicts(mode):
    """The rewrite keeps what the tests mean: an expected exception, a failure in the middle, a right program."""
    raising = {
        "prompt": "def f(x):\n",
        "entry_point": "f",
        "test": (
            "def check(candidate):\n"
            "    assert candidate(1) == 1\n"
            "    try:\n"
            "        candidate(-1)\n"
            "        assert False, 'no ValueError'\n"
            "    except ValueError:\n"
            "        pass\n"
        ),
    }
    right = "def f(x):\n    if x < 0:\n        raise ValueError\n    return x\n"
    assert V.code_verdict(right, raising, mode=mode).status == "passed"
    assert V.code_verdict("def f(x):\n    return x\n", raising, mode=mode).status == "failed"
    middle = "def add(a, b):\n    return 0 if a == 2 else a + b\n"
    assert V.code_verdict(middle, THREE, mode=mode).status == "failed"
    assert V.code_verdict("def add(a, b):\n    return a + b\n", THREE, mode=mode).status == "passed"
    stdio = {"inputs": ["1\n", "2\n"], "outputs": ["1\n", "2\n"]}
    assert V.code_verdict("x = input()\nprint(x if x == '1' else 0)\n", stdio, mode=mode).status == "failed"
    assert V.code_verdict("print(input())\n", stdio, mode=mode).status == "passed"


# ---------------------------------------------------------------------------------------------
# 1. The judge's import path: nothing on it is the program's
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [m for m in MODES if m != "fallback"])
def test_attack_judge_imports_from_a_venv_under_tmp_that_the_program_rebuilt(mode, monkeypatch):
    """A site-packages folder under /tmp in a 0700 folder (what .ci/run's venv looks like): the program renames
    the folder above it in its own /tmp and rebuilds it with a module of its own, which the test then imports."""
    top = tempfile.mkdtemp(prefix="r3venv-", dir="/tmp")  # 0700, root's
    site_dir = os.path.join(top, "venv", "lib", "site-packages")
    os.makedirs(site_dir)
    with open(os.path.join(site_dir, "r3probe_mod.py"), "w") as f:
        f.write("VALUE = 1\n")
    name = "SITE_DIRS" if hasattr(S, "SITE_DIRS") else "_SITE_DIRS"
    monkeypatch.setattr(S, name, [*getattr(S, name), site_dir])
    monkeypatch.setattr(S, "_sandbox_view_cache", None)
    program = (
        "import os, sys\n"
        f"TOP, SITE = {top!r}, {site_dir!r}\n"
        "try:\n"
        "    os.rename(TOP, '/tmp/moved')\n"
        "    os.makedirs(SITE)\n"
        "    open(os.path.join(SITE, 'r3probe_mod.py'), 'w').write('VALUE = -1\\n')\n"
        "    print('planted', file=sys.stderr)\n"
        "except OSError as exc:\n"
        "    print('refused', exc.errno, file=sys.stderr)\n"
        "def add(a, b):\n    return 0\n"
    )
    problem = {
        "test_setup_code": "import r3probe_mod",
        "test_list": ["assert add(r3probe_mod.VALUE, 1) == r3probe_mod.VALUE + 1"],
    }
    try:
        verdict = V.code_verdict(program, problem, timeout=10.0, mode=mode)
        assert verdict.status != "passed", f"the judge imported the program's module: {verdict}"
        assert "planted" not in verdict.stderr_tail, verdict.stderr_tail
        assert f"refused {errno.EBUSY}" in verdict.stderr_tail, verdict.stderr_tail  # a mount point: not renamed
        honest = V.code_verdict("def add(a, b):\n    return a + b\n", problem, timeout=10.0, mode=mode)
        assert honest.status == "passed", honest  # the venv under /tmp still serves the judge
    finally:
        shutil.rmtree(top)


# ---------------------------------------------------------------------------------------------
# 3. Fail closed: a bounded pool of cgroups, no run without limits unless asked for
# ---------------------------------------------------------------------------------------------

ADD = {"prompt": "def add(a, b):\n", "entry_point": "add", "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}
RIGHT = "def add(a, b):\n    return a + b\n"


def _needs_cgroups():
    if not S._cgroup_parents():
        pytest.skip("no cgroups on this machine")


def test_attack_runs_reuse_a_bounded_pool_of_cgroups(monkeypatch):
    """Every run used to make (and remove) a cgroup of its own, each leaving a dying one in the kernel until it
    refuses new ones; now runs after the first reuse the pool's."""
    _needs_cgroups()
    made = []
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        if S._SANDBOX_CGROUP_PREFIX in os.path.basename(str(path)) and str(path).startswith("/sys/fs/cgroup"):
            made.append(path)
        return real_mkdir(path, *args, **kwargs)

    assert V.code_verdict(RIGHT, ADD, timeout=10.0).status == "passed"  # the pool's first slot, if not there yet
    monkeypatch.setattr(os, "mkdir", mkdir)
    for _ in range(4):
        assert V.code_verdict(RIGHT, ADD, timeout=10.0).status == "passed"
    assert made == [], f"runs made cgroups of their own: {made}"


def test_a_dropped_slot_never_hands_out_a_cgroup_that_another_run_holds(monkeypatch):
    """A slot that does not empty in time is dropped and a fresh one takes its place. The fresh one used to be
    named after the count of live slots, which after a drop is a live slot's name, and it reused that folder:
    two runs then shared one cgroup, and a spinner's 60 processes filled the honest run's pids limit."""
    _needs_cgroups()
    S._close_cgroup_pool()
    first, second = S._borrow_cgroups(), S._borrow_cgroups()  # slots 0 and 1
    monkeypatch.setattr(S, "_empty_cgroup", lambda path, wait_s=1.0: False)
    S._return_cgroups(first)  # slot 0 does not empty: dropped
    monkeypatch.undo()
    third = S._borrow_cgroups()  # a fresh slot
    try:
        assert not set(third[0]) & set(second[0]), f"two live slots share a cgroup: {third[0]} and {second[0]}"
    finally:
        S._return_cgroups(second)
        S._return_cgroups(third)
        S._close_cgroup_pool()


@pytest.fixture
def refused_cgroups(monkeypatch):
    """The kernel refuses every new cgroup (as once too many dying ones are left) and the pool is empty."""
    _needs_cgroups()
    if hasattr(S, "_close_cgroup_pool"):
        S._close_cgroup_pool()
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        if S._SANDBOX_CGROUP_PREFIX in os.path.basename(str(path)) and str(path).startswith("/sys/fs/cgroup"):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(S, "_cgroup_warned", False)
    yield
    monkeypatch.undo()
    if hasattr(S, "_close_cgroup_pool"):
        S._close_cgroup_pool()


FORKS = (
    "import os, sys\nN = 0\n"
    "for _ in range(100):\n"
    "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
    "    if pid == 0:\n        import time; time.sleep(3); os._exit(0)\n"
    "    N += 1\n"
    "print('forked', N, file=sys.stderr)\n"
    "def add(a, b):\n    return a + b\n"
)


@pytest.mark.parametrize("mode", MODES)
def test_attack_no_cgroup_means_no_run(mode, refused_cgroups, caplog, monkeypatch):
    monkeypatch.delenv("VERIFIERS_ALLOW_NO_CGROUP", raising=False)
    with caplog.at_level(logging.WARNING, logger="verifiers"):
        first = V.code_verdict(FORKS, ADD, timeout=10.0, mode=mode)
        second = V.code_verdict(FORKS, ADD, timeout=10.0, mode=mode)
    assert first.status == second.status == "error", f"a run went on without its cgroup: {first}"
    assert "forked" not in first.stderr_tail + second.stderr_tail  # the program never ran
    said = [r for r in caplog.records if "cgroup" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]  # said once


@pytest.mark.parametrize("mode", MODES)
def test_no_cgroup_runs_only_when_the_user_asks(mode, refused_cgroups, monkeypatch):
    monkeypatch.setenv("VERIFIERS_ALLOW_NO_CGROUP", "1")
    verdict = V.code_verdict(RIGHT, ADD, timeout=10.0, mode=mode)
    assert verdict.status == "passed", verdict


def test_no_cgroup_is_one_line_before_anything_slow(monkeypatch):
    monkeypatch.delenv("VERIFIERS_ALLOW_NO_CGROUP", raising=False)
    monkeypatch.setattr(S, "_cgroup_parents", lambda: [])
    monkeypatch.setattr(S, "_cgroup_slots_made", 0)
    with pytest.raises(V.UserError) as info:
        V.load_task("humaneval", "eval")
    assert "\n" not in str(info.value) and "VERIFIERS_ALLOW_NO_CGROUP=1" in str(info.value)
    monkeypatch.setenv("VERIFIERS_ALLOW_NO_CGROUP", "1")
    assert V.load_task("humaneval", "eval").kind == "code"


# ---------------------------------------------------------------------------------------------
# 4. CPU: one run's spinners do not starve an honest run beside it
# ---------------------------------------------------------------------------------------------

SPINNER = (
    "import os\ndef add(a, b):\n    return a + b\n"
    "for _ in range(59):\n    if os.fork() == 0:\n        break\nwhile True:\n    pass\n"
)
BUSY_HONEST = "X = sum(range(6_000_000))\ndef add(a, b):\n    return a + b\n"  # ~0.3 s of one core


@pytest.mark.parametrize("mode", MODES)
def test_attack_spinner_beside_an_honest_run(mode):
    _needs_cgroups()
    spin = {}
    spinner = threading.Thread(target=lambda: spin.update(v=V.code_verdict(SPINNER, ADD, timeout=6.0, mode=mode)))
    spinner.start()
    try:
        import time

        time.sleep(1.0)  # the spinner's 60 processes are running
        honest = V.code_verdict(BUSY_HONEST, ADD, timeout=3.0, mode=mode)
    finally:
        spinner.join()
    assert spin["v"].status in ("timeout", "failed"), spin  # it spins until its deadline or its CPU limit
    assert honest.status == "passed", f"a spinning run starved an honest one: {honest}"


# ---------------------------------------------------------------------------------------------
# 5. and 6. Allow-lists: socket families and system calls
# ---------------------------------------------------------------------------------------------

SYSCALLS = (
    "import ctypes, errno, os, socket, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
    "def family(f, t=socket.SOCK_STREAM):\n"
    "    try:\n        socket.socket(f, t).close()\n        return 0\n"
    "    except OSError as exc:\n        return exc.errno\n"
    "def call(nr, *args):\n"
    "    r = libc.syscall(nr, *args)\n    return 0 if r >= 0 else ctypes.get_errno()\n"
    "R = {'vsock': family(40), 'netlink': family(16, socket.SOCK_RAW), 'packet': family(17, socket.SOCK_RAW),\n"
    "     'alg': family(38, socket.SOCK_SEQPACKET), 'inet': family(2), 'inet6': family(10),\n"
    "     'memfd_secret': call(447, 0), 'io_uring_setup': call(425, 1, ctypes.create_string_buffer(120)),\n"
    "     'pidfd_getfd': call(438, 0, 0, 0), 'process_vm_readv': call(310, 1, 0, 0, 0, 0, 0)}\n"
    "print('R=' + repr(R), file=sys.stderr)\n"
    "def add(a, b):\n    return a + b\n"
)


def _results(mode):
    verdict = V.code_verdict(SYSCALLS, ADD, timeout=10.0, mode=mode)
    assert verdict.status == "passed", verdict
    line = [x for x in verdict.stderr_tail.splitlines() if x.startswith("R=")][-1]
    return eval(line[2:])  # noqa: S307 - our own program's dict of ints


@pytest.mark.parametrize("mode", MODES)
def test_attack_socket_families_outside_the_allow_list_are_refused(mode):
    results = _results(mode)
    for name in ("vsock", "netlink", "packet", "alg"):
        assert results[name] == errno.EPERM, f"socket family {name} not refused by the filter: {results}"
    assert results["inet"] == 0, results  # the allowed families still work (an empty network namespace)


@pytest.mark.parametrize("mode", MODES)
def test_attack_system_calls_outside_the_allow_list_are_refused(mode):
    results = _results(mode)
    for name in ("memfd_secret", "io_uring_setup", "pidfd_getfd", "process_vm_readv"):
        assert results[name] == errno.EPERM, f"{name} not refused by the filter: {results}"


# ---------------------------------------------------------------------------------------------
# 7. Fallback: the trainer's memory is out of a same-uid program's reach
# ---------------------------------------------------------------------------------------------


def test_attack_fallback_program_reads_the_trainer_memory():
    trainer = os.getpid()
    program = (
        "import os, sys\n"
        "GOT = []\n"
        "try:\n"
        f"    maps = open('/proc/{trainer}/maps').read().split('\\n')\n"
        "    start = int([m for m in maps if ' r' in m][0].split('-')[0], 16)\n"
        f"    with open('/proc/{trainer}/mem', 'rb') as f:\n"
        "        f.seek(start)\n        GOT.append(len(f.read(16)))\n"
        "except OSError as exc:\n    print('refused', exc.errno, file=sys.stderr)\n"
        "try:\n"
        f"    fds = os.listdir('/proc/{trainer}/fd')\n"
        "except OSError:\n    fds = []\n"
        "for n in fds:  # the trainer's pipes, its status pipe among them\n"
        "    try:\n"
        f"        os.close(os.open('/proc/{trainer}/fd/' + n, os.O_WRONLY | os.O_NONBLOCK))\n"
        "        GOT.append(n)\n"
        "    except OSError:\n        pass\n"
        "print('GOT', GOT, file=sys.stderr)\n"
        "def add(a, b):\n    return 0 if GOT else a + b\n"
    )
    verdict = V.code_verdict(program, ADD, timeout=10.0, mode="fallback")
    assert verdict.status == "passed", f"the program read the trainer: {verdict}"
    assert "GOT []" in verdict.stderr_tail, verdict.stderr_tail


def test_attack_fallback_program_reads_a_non_root_trainer():
    """The case that got through: a trainer without capabilities, so the kernel's capability check does not stop
    a program of its uid; only the trainer being undumpable does."""
    import subprocess

    from tests.test_sandbox_isolation import NON_ROOT_UID, _system_python

    python = _system_python()
    if os.geteuid() != 0 or shutil.which("setpriv") is None or python is None:
        pytest.skip("needs root (to become another user), setpriv and a system python3 any user can run")
    workdir = tempfile.mkdtemp(prefix="verifiers-r3-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    try:
        shutil.copy(V.__file__, workdir)  # verifiers.py and the sandbox/ folder beside it
        shutil.copytree(os.path.join(os.path.dirname(V.__file__), "sandbox"), os.path.join(workdir, "sandbox"))
        for root, dirs, files in os.walk(workdir):
            for name in dirs + files:
                os.chown(os.path.join(root, name), NON_ROOT_UID, NON_ROOT_UID)
        os.chown(workdir, NON_ROOT_UID, NON_ROOT_UID)
        os.chmod(workdir, 0o755)
        program = (
            "import os, sys\nGOT = []\n"
            "trainer = os.getppid()\n"
            "while trainer > 1 and 'import verifiers as V' not in open(f'/proc/{trainer}/cmdline').read():\n"
            "    trainer = int(open(f'/proc/{trainer}/stat').read().rsplit(')', 1)[1].split()[1])\n"
            "try:\n"
            "    maps = open(f'/proc/{trainer}/maps').read().split('\\n')\n"
            "    start = int([m for m in maps if ' r' in m][0].split('-')[0], 16)\n"
            "    with open(f'/proc/{trainer}/mem', 'rb') as f:\n"
            "        f.seek(start)\n        GOT.append(len(f.read(16)))\n"
            "except OSError as exc:\n    print('refused', exc.errno, file=sys.stderr)\n"
            "def add(a, b):\n    return 0 if GOT else a + b\n"
        )
        script = (
            "import verifiers as V\n"
            f"v = V.code_verdict({program!r}, {ADD!r}, timeout=10.0, mode='fallback')\n"
            "print(v.status, v.stderr_tail[-300:])\n"
        )
        env = {"HOME": workdir, "PATH": "/usr/bin:/bin", "PYTHONPATH": workdir, "VERIFIERS_ALLOW_NO_CGROUP": "1"}
        result = subprocess.run(
            ["setpriv", f"--reuid={NON_ROOT_UID}", f"--regid={NON_ROOT_UID}", "--clear-groups", python, "-c", script],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.split()[:1] == ["passed"], f"the program read the trainer: {result.stdout}"
        assert "refused" in result.stdout, result.stdout
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_attack_a_run_gets_one_core_of_cpu():
    """The cause of class 4: a run's CPU is bounded as a whole. Two processes of one run spin for 1.5 s of wall
    time each; with the run's quota of one core they get about 1.5 s of CPU together, without it about 3 s."""
    _needs_cgroups()
    program = (
        "import os, sys, time\n"
        "for _ in range(2):\n"
        "    if os.fork() == 0:\n"
        "        end = time.monotonic() + 1.5\n"
        "        while time.monotonic() < end:\n            pass\n"
        "        os._exit(0)\n"
        "os.wait(); os.wait()\n"
        "t = os.times()\n"
        "print('CPU', t.children_user + t.children_system, file=sys.stderr)\n"
        "def add(a, b):\n    return a + b\n"
    )
    verdict = V.code_verdict(program, ADD, timeout=10.0)
    assert verdict.status == "passed", verdict
    cpu = float([x for x in verdict.stderr_tail.splitlines() if x.startswith("CPU")][-1].split()[1])
    assert cpu < 2.2, f"the run's two spinning processes used {cpu:.2f} s of CPU in 1.5 s: no per-run quota"
