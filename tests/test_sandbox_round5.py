"""Round five of the code sandbox (issue 51): one test per class that got through, each with real hostile programs
through the real sandbox, each followed by `clean_sandbox` (nothing of a run outlives it).

1. a run that cannot be killed behind its own read queue (readahead, MADV_WILLNEED): the calls do nothing, and a
   slot's read throttle is lifted when a run is over and set again before the slot serves;
2. limits the kernel charges to the trainer's user on the host (inotify, queued signals, message queues): bounded
   per run, the trainer keeps its own;
3. a fork after the first slot was made (preflight) shares no slot with its parent;
4. feedback inside one expression: all/any however they are reached, a lambda `check`; a test that runs a string
   (eval, exec) is refused in one line;
5. the OOM killer takes a run's processes, never the trainer; the pool's memory is stated and checked at start;
6. the ranks of a node run at most one run per core together."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import sandbox as S
import verifiers as V
from tests.test_sandbox_round4 import _needs_cgroups, _report, _resident_pages, _uncached  # round four's probes
from tests.test_verifiers import clean_sandbox  # noqa: F401 - the fixture, used below

pytestmark = [pytest.mark.usefixtures("clean_sandbox"), pytest.mark.slow]  # slow: the sandbox's attacks

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADD = {"prompt": "def add(a, b):\n", "entry_point": "add", "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}
RIGHT = "def add(a, b):\n    return a + b\n"


@pytest.fixture
def uncached_files():
    """Two 64 MiB files in /var/tmp (the namespace modes hide the host's /tmp), not in the page cache."""
    folder = tempfile.mkdtemp(prefix="verifiers-r5-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    os.chmod(folder, 0o755)
    yield _uncached(folder, "queued.bin", 64), _uncached(folder, "faulted.bin", 64)
    shutil.rmtree(folder)


# ---------------------------------------------------------------------------------------------
# 1. A run that cannot be killed, behind its own read queue
# ---------------------------------------------------------------------------------------------

# Thousands of single-page reads queued in the slot's read throttle (1,000 requests/s), half by readahead, half by
# madvise(MADV_WILLNEED), both returning at once; then three children fault one page of another uncached file
# through /proc/self/mem: a wait behind the whole queue that SIGKILL does not end.
READ_QUEUE = r"""
import ctypes, mmap, os, random, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
fd = os.open(QUEUED, os.O_RDONLY)
size, R = os.path.getsize(QUEUED), {"readahead": set(), "willneed": set()}
for offset in range(0, size // 2, 8192):
    R["readahead"].add(libc.syscall(187, fd, ctypes.c_long(offset), ctypes.c_size_t(4096)))
queued = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
for offset in range(size // 2, size, 8192):
    try:
        queued.madvise(mmap.MADV_WILLNEED, offset, 4096)
        R["willneed"].add(0)
    except OSError as exc:
        R["willneed"].add(exc.errno)
print("R=" + repr(R), file=sys.stderr, flush=True)
for _ in range(3):
    if os.fork() == 0:
        faulted = mmap.mmap(os.open(FAULTED, os.O_RDONLY), 0, access=mmap.ACCESS_COPY)
        address = ctypes.addressof(ctypes.c_char.from_buffer(faulted)) + 4096 * random.randrange(len(faulted) // 4096)
        mem = os.open("/proc/self/mem", os.O_RDONLY)
        os.pread(mem, 1, address)
        time.sleep(60)
time.sleep(60)
"""


@pytest.mark.parametrize("mode", S.NAMESPACE_MODES[:1])
def test_attack_a_read_queue_does_not_outlive_the_run(mode, uncached_files):
    """The old code returned this 2 s run after 11 s, the children in D state behind ~8,000 queued reads (the slot
    out of the pool while the queue drained), and the file it queued was read into the page cache after the run.
    Now readahead and MADV_WILLNEED are answered 0 without being run: nothing is queued, nothing read, the run ends
    at its deadline, and the slot serves an honest run at once."""
    _needs_cgroups()
    queued, faulted = uncached_files
    program = f"QUEUED, FAULTED = {queued!r}, {faulted!r}\n" + READ_QUEUE + RIGHT
    verdict = V.code_verdict(program, ADD, timeout=2.0, mode=mode)
    assert verdict.status == "timeout", verdict
    assert _report(verdict) == {"readahead": {0}, "willneed": {0}}, verdict.stderr_tail
    assert verdict.elapsed_s < 2.0 + 2.5, f"the run held the trainer {verdict.elapsed_s:.1f} s past a 2 s timeout"
    resident = _resident_pages(queued)
    assert resident < 64, f"{resident} pages the run only queued were read after it (readahead/WILLNEED ran)"
    honest = [V.code_verdict(RIGHT, ADD, timeout=5.0, mode=mode) for _ in range(S.num_cores() + 1)]
    assert [v.status for v in honest] == ["passed"] * len(honest), honest


# Run B queues ~320 MB of reads in its own slot (40 processes, 8 MiB each, one uncached file each); run A, beside it,
# faults a page of B's last file through /proc/self/mem: A's child waits behind B's queue, not its own.
NEIGHBOUR_QUEUE = r"""
import os, time
for k in range(len(FILES)):
    if os.fork() == 0:
        os.pread(os.open(FILES[k], os.O_RDONLY), 8 << 20, 0)
        os._exit(0)
time.sleep(30)
"""
BEHIND_THE_NEIGHBOUR = r"""
import ctypes, mmap, os, time
time.sleep(0.3)
if os.fork() == 0:
    faulted = mmap.mmap(os.open(FILES[-1], os.O_RDONLY), 0, access=mmap.ACCESS_COPY)
    mem = os.open("/proc/self/mem", os.O_RDONLY)
    os.pread(mem, 1, ctypes.addressof(ctypes.c_char.from_buffer(faulted)) + (6 << 20))
    time.sleep(60)
time.sleep(60)
"""


@pytest.mark.parametrize("mode", S.NAMESPACE_MODES[:1])
def test_attack_a_read_queue_of_the_run_beside_it_does_not_hold_a_run(mode):
    """A review's find after the first fix: lifting a run's own throttle at its deadline does not free a child that
    waits behind the queue of the run beside it; the first version returned that 1 s run after 4.3-6.4 s. Now, when a
    run is not gone NEIGHBOUR_LIFT_AFTER_S after its own lift, the trainer lifts its other slots' throttles until it
    is (then sets them again)."""
    _needs_cgroups()
    folder = tempfile.mkdtemp(prefix="verifiers-r5-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    os.chmod(folder, 0o755)
    try:
        files = [_uncached(folder, f"f{k}.bin", 8) for k in range(40)]
        head = f"FILES = {files!r}\n"
        verdicts = {}

        def judge(name, program, timeout):
            verdicts[name] = V.code_verdict(head + program + RIGHT, ADD, timeout=timeout, mode=mode)

        neighbour = threading.Thread(target=judge, args=("neighbour", NEIGHBOUR_QUEUE, 8.0))
        neighbour.start()
        time.sleep(0.1)
        judge("behind", BEHIND_THE_NEIGHBOUR, 1.0)
        neighbour.join()
    finally:
        shutil.rmtree(folder)
    assert verdicts["behind"].status == "timeout", verdicts
    # here: 1.6 s now, 3.2 s with only the run's own throttle lifted
    assert verdicts["behind"].elapsed_s < 1.0 + 1.5, f"held {verdicts['behind'].elapsed_s:.1f} s past a 1 s timeout"
    for slot in S._cgroup_pool:  # every slot back in the pool with its read limit
        for path, limited, _ in slot.throttles:
            with open(path) as f:
                assert limited.split()[0] in f.read(), path
    assert V.code_verdict(RIGHT, ADD, timeout=5.0, mode=mode).status == "passed"


def test_a_slots_read_throttle_is_lifted_when_a_run_is_over_and_set_before_it_serves():
    """`_stop` lifts the throttle at a run's deadline (a process waiting for a page behind the run's queued reads
    gets it and dies), `_return_cgroups` lifts it while the slot empties and sets it again before the slot goes back
    to the pool: the next run starts with its own limit and no queue of the last one's."""
    _needs_cgroups()
    if S._cgroup_missing:
        pytest.skip(f"no read throttle here: {S._cgroup_missing}")
    slot = S._borrow_cgroups()
    try:
        assert slot.throttles, "a slot without its read throttle"
        limits = {path: limited.split()[0] for path, limited, _ in slot.throttles}

        def rules():
            found = {}
            for path in limits:
                with open(path) as f:
                    found[path] = f.read().strip()
            return found

        assert S._set_throttle(slot, lifted=True)
        lifted = rules()
        for path, device in limits.items():
            line = lifted[path]
            assert device not in line or "max" in line, f"{path} still limits {device}: {line!r}"
        S._set_throttle(slot, lifted=False)
        for path, text in rules().items():
            assert limits[path] in text, f"{path} lost its limit: {text!r}"
    finally:
        S._set_throttle(slot, lifted=True)  # as a finished run leaves it: _return_cgroups must set it again
        S._return_cgroups(slot)
    again = S._borrow_cgroups()
    try:
        assert again is slot
        for path, limited, _ in slot.throttles:
            with open(path) as f:
                assert limited.split()[0] in f.read(), f"a slot went back to the pool without its read limit: {path}"
    finally:
        S._return_cgroups(again)


# ---------------------------------------------------------------------------------------------
# 2. Limits the kernel charges to the trainer's user on the host
# ---------------------------------------------------------------------------------------------

HOARDER = r"""
import ctypes, os, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mq_open.restype = ctypes.c_int
R = {"inotify": 0, "queues": 0, "signals": 0}
while R["inotify"] < 200 and libc.inotify_init1(0) >= 0:
    R["inotify"] += 1
while R["queues"] < 40 and libc.mq_open(f"/q{R['queues']}".encode(), os.O_CREAT | os.O_RDWR, 0o600, None) >= 0:
    R["queues"] += 1
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
info = ctypes.create_string_buffer(128)
ctypes.memmove(info, (ctypes.c_int * 3)(int(signal.SIGRTMIN), 0, -1), 12)  # si_signo, si_errno, si_code SI_QUEUE
while R["signals"] < 3000 and libc.syscall(129, os.getpid(), int(signal.SIGRTMIN), info) == 0:  # rt_sigqueueinfo
    R["signals"] += 1
print("R=" + repr(R), file=sys.stderr, flush=True)
time.sleep(3)
"""


def _trainer_can_still(what: str) -> int:
    """0 if the trainer's own call works now, else its errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    if what == "inotify":
        fd = libc.inotify_init1(0)
    else:
        libc.mq_open.restype = ctypes.c_int
        name = f"/verifiers-r5-{os.getpid()}".encode()
        fd = libc.mq_open(name, os.O_CREAT | os.O_RDWR, 0o600, None)
        libc.mq_unlink(name)
    if fd < 0:
        return ctypes.get_errno()
    os.close(fd)
    return 0


@pytest.mark.parametrize("mode", S.NAMESPACE_MODES[:1])
def test_attack_a_run_cannot_take_its_users_host_wide_limits(mode):
    """The old code let a run take all 128 inotify instances of the trainer's user (root), 18 message queues and
    ~96,000 queued signals: while it lived the trainer's own inotify_init1 and mq_open failed with EMFILE. Now a run
    has SANDBOX_INOTIFY_INSTANCES, no message queue and SANDBOX_SIGNALS_QUEUED, and the trainer keeps its own."""
    verdict = {}
    thread = threading.Thread(target=lambda: verdict.update(v=V.code_verdict(HOARDER + RIGHT, ADD, timeout=2.0, mode=mode)))
    thread.start()
    try:
        time.sleep(1.2)  # the run holds what it took until its deadline
        trainer = {what: _trainer_can_still(what) for what in ("inotify", "queue")}
    finally:
        thread.join()
    report = _report(verdict["v"])
    assert report["inotify"] <= getattr(S, "SANDBOX_INOTIFY_INSTANCES", 2), report  # getattr: fails as it should on old code
    assert report["queues"] == 0, report
    assert report["signals"] <= getattr(S, "SANDBOX_SIGNALS_QUEUED", 64), report
    assert trainer == {"inotify": 0, "queue": 0}, f"the trainer lost its own ({errno.errorcode}): {trainer}"


def test_a_runs_inotify_share_leaves_the_users_host_limit_to_the_trainer(monkeypatch):
    """A review's find: 2 instances a run, x 64 runs at once, is the host's 128: on a node of many cores the runs
    together took the trainer's user's whole limit again. Now a run gets an equal share of what that limit leaves
    beside INOTIFY_RESERVE, 0 where nothing is left."""
    host = int(open("/proc/sys/fs/inotify/max_user_instances").read())
    for runs, expected in ((2, 2), (64, (host - S.INOTIFY_RESERVE) // 64), (host, 0)):
        monkeypatch.setattr(S, "runs_at_once", lambda runs=runs: runs)
        assert S.inotify_share() == max(0, min(S.SANDBOX_INOTIFY_INSTANCES, expected)), runs
    monkeypatch.setattr(S, "runs_at_once", lambda: host)  # the run's own namespace then allows none
    program = (
        "import ctypes, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print('R=' + repr({'made': libc.inotify_init1(0) >= 0}), file=sys.stderr)\n" + RIGHT
    )
    assert _report(V.code_verdict(program, ADD, timeout=5.0)) == {"made": False}


# ---------------------------------------------------------------------------------------------
# 3. A fork after the first slot was made
# ---------------------------------------------------------------------------------------------

FORK_AFTER_PREFLIGHT = r"""
import os, sys, time
import sandbox as S, verifiers as V
ADD = {"prompt": "def add(a, b):\n", "entry_point": "add", "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}
SLOW = "import time\ndef add(a, b):\n    time.sleep(1.5)\n    return a + b\n"
V.check_code_sandbox()  # what load_task does: preflight makes slot 0 (free in the pool), before any run
child = os.fork()  # a fork-start reward worker
if child == 0:  # one quick run of its own while its parent's run goes on
    time.sleep(0.7)
    verdict = V.code_verdict("def add(a, b):\n    return a + b\n", ADD, timeout=10.0)
    os._exit(0 if verdict.status == "passed" else 1)
parent = V.code_verdict(SLOW, ADD, timeout=10.0)
_, status = os.waitpid(child, 0)
print("PARENT", parent.status, "CHILD", os.waitstatus_to_exitcode(status))
"""


def test_attack_a_fork_after_preflight_shares_no_slot():
    """The old code registered the at-fork reset at the first run, after preflight had made slot 0: a child forked
    in between took the same slot as its parent, and its return of it killed the parent's honest run (failed)."""
    _needs_cgroups()
    done = subprocess.run(
        [sys.executable, "-c", FORK_AFTER_PREFLIGHT], cwd=HERE, env=dict(os.environ, PYTHONPATH=HERE),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "PARENT passed CHILD 0" in done.stdout, done.stdout + done.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# 4. Feedback inside one expression
# ---------------------------------------------------------------------------------------------

# wrong at its first call only; logs every call's first argument on its stderr
COUNTING = (
    "import sys\nCALLS = []\n"
    "def add(a, b):\n"
    "    CALLS.append(a)\n"
    "    print('call', len(CALLS), 'with', a, file=sys.stderr, flush=True)\n"
    "    return 0 if len(CALLS) == 1 else a + b\n"
)
GENERATOR = "add(x, 1) == x + 1 for x in (1, 2, 3)"
ONE_EXPRESSION = {
    "alias": f"every = all\nassert every({GENERATOR})",
    "module": f"import builtins\nassert builtins.all({GENERATOR})",
    "getattr": f"assert getattr(__builtins__, 'all')({GENERATOR})",
    "vars": f"assert vars(__builtins__)['all']({GENERATOR})",
    "map": "test = any\nassert not test(map(lambda x: add(x, 1) != x + 1, (1, 2, 3)))",
    "call": f"assert all.__call__({GENERATOR})",  # a review's find: the bound __call__ of the builtin
}


@pytest.mark.parametrize("name", list(ONE_EXPRESSION))
@pytest.mark.parametrize("kind", ["humaneval", "mbpp"])
def test_attack_no_feedback_through_all_and_any_however_reached(name, kind):
    """The old rewrite knew all() and any() only by their names: bound to another name, reached through the
    builtins module or a lookup, they stopped at the first wrong answer (one call of three). Now what is called is
    looked at when it is called."""
    source = ONE_EXPRESSION[name]
    if kind == "humaneval":
        body = "".join(f"    {line}\n" for line in source.replace("add(", "candidate(").split("\n"))
        problem = dict(ADD, test="def check(candidate):\n" + body)
    else:
        problem = {"test_list": source.split("\n")}
    verdict = V.code_verdict(COUNTING, problem, timeout=10.0)
    assert verdict.status == "failed", verdict
    assert "call 3 with 3" in verdict.stderr_tail, f"the calls stopped at the first failed check: {verdict.stderr_tail}"
    assert V.code_verdict(RIGHT, problem, timeout=10.0).status == "passed"


LAMBDA_CHECKS = {
    "plain": "check = lambda candidate: ({chain}) or 1 / 0",
    "annotated": "check: object = lambda candidate: ({chain}) or 1 / 0",
    "tuple": "check, unused = (lambda candidate: ({chain}) or 1 / 0), 0",
}


@pytest.mark.parametrize("form", list(LAMBDA_CHECKS))
def test_attack_no_feedback_inside_a_lambda_check(form):
    """A `check` written as a lambda was not guarded: its `and` chain stopped at the first wrong answer (the
    annotated and tuple forms: a review's find, after the plain one was closed)."""
    chain = "candidate(1, 1) == 2 and candidate(2, 1) == 3 and candidate(3, 1) == 4"
    problem = dict(ADD, test=LAMBDA_CHECKS[form].format(chain=chain) + "\n")
    verdict = V.code_verdict(COUNTING, problem, timeout=10.0)
    assert verdict.status == "failed", verdict
    assert "call 3 with 3" in verdict.stderr_tail, verdict.stderr_tail
    assert V.code_verdict(RIGHT, problem, timeout=10.0).status == "passed"


STRING_TESTS = {
    "eval": "assert eval('add(1, 1) == 2 and add(2, 1) == 3')",
    "imported": "from builtins import eval as run\nassert run('add(1, 1) == 2 and add(2, 1) == 3')",
    "exec": "exec('assert add(1, 1) == 2 and add(2, 1) == 3')",
    "module": "import builtins\nassert builtins.eval('add(1, 1) == 2 and add(2, 1) == 3')",
    "lookup": "assert getattr(__builtins__, 'eval')('add(1, 1) == 2 and add(2, 1) == 3')",
    "compile": "assert eval(compile('add(1, 1) == 2 and add(2, 1) == 3', 't', 'eval'))",
}


@pytest.mark.parametrize("name", list(STRING_TESTS))
def test_a_test_that_runs_a_string_is_refused_in_one_line(name):
    """A string's expressions are never rewritten: `eval('c(1) == 2 and c(2) == 3')` stopped at its first failed
    check on the old code and scored. Now the problem is refused (ValueError, one line) and a dataset with such
    problems loses them with one warning; `re.compile` is not refused."""
    problem = {"test_list": STRING_TESTS[name].split("\n")}
    with pytest.raises(ValueError, match=r"runs a string through (eval|exec|compile)") as caught:
        V.code_verdict(COUNTING, problem, timeout=10.0)
    assert "\n" not in str(caught.value)
    humaneval = dict(ADD, test="def check(candidate):\n" + "".join(f"    {x}\n" for x in STRING_TESTS[name].split("\n")))
    with pytest.raises(ValueError, match="runs a string"):
        V.code_verdict(RIGHT, humaneval, timeout=10.0)
    fine = {"test_list": ["import re", "assert re.compile('a+').match('aa') and add(1, 1) == 2"]}
    assert V.code_verdict(RIGHT, fine, timeout=10.0).status == "passed"


HONEST_TESTS = [
    "assert reverse_word('eval') == 'lave'",
    "assert sorted(['exec', 'ls']) == ['exec', 'ls']",
    "assert {'exec': False}['exec'] is False",
    "from re import compile\nassert compile('a+').match('aa')",
    "import re\nassert re.compile('a+').match('aa')",
    "import ast\nassert ast.literal_eval('[1]') == [1]",
    "class Expr:\n    def eval(self):\n        return 3\nassert Expr().eval() == 3",
]


@pytest.mark.parametrize("source", HONEST_TESTS)
def test_a_test_that_only_names_eval_is_not_refused(source):
    """The word in a string, a dict key, `re.compile` (also imported by name), a method named eval: none runs a
    string, none is refused (a review found the first version refused several)."""
    assert S.unjudgeable_test((source,)) is None


def test_a_dataset_loses_the_problems_it_cannot_judge_with_one_warning(capsys):
    good = {"test_list": ["assert add(1, 1) == 2"]}
    bad = {"test_list": [STRING_TESTS["eval"]]}
    task = V.Task("mine", "code", [good, bad, good], "", where=["mine.jsonl:1", "mine.jsonl:2", "mine.jsonl:3"])
    V.check_code_tests(task)
    assert task.problems == [good, good] and task.where == ["mine.jsonl:1", "mine.jsonl:3"]
    warning = capsys.readouterr().err.strip()
    assert warning.count("\n") == 0 and "dropped 1 of 3" in warning and "mine.jsonl:2" in warning, warning
    with pytest.raises(V.UserError, match="none of its 1 code problems"):
        V.check_code_tests(V.Task("mine", "code", [bad], ""))


# ---------------------------------------------------------------------------------------------
# 5. The OOM killer and the pool's memory
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", S.NAMESPACE_MODES[:1] + ("fallback",))
def test_a_runs_processes_are_the_oom_killers_first_choice(mode):
    """Every process of a run has oom_score_adj 1000 (the old code: 0, the trainer's) and, in the namespace modes,
    cannot lower it (the fallback's program, the trainer's user, can where the trainer lacks CAP_SYS_RESOURCE, as in
    this container: a documented limit of the fallback)."""
    program = (
        "import os, sys\n"
        "R = {'adj': open('/proc/self/oom_score_adj').read().strip()}\n"
        "if os.fork() == 0:\n"
        "    print('C=' + open('/proc/self/oom_score_adj').read().strip(), file=sys.stderr, flush=True)\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "try:\n    open('/proc/self/oom_score_adj', 'w').write('0')\n    R['lowered'] = True\n"
        "except OSError:\n    R['lowered'] = False\n"
        "R['after'] = open('/proc/self/oom_score_adj').read().strip()\n"
        "print('R=' + repr(R), file=sys.stderr, flush=True)\n" + RIGHT
    )
    verdict = V.code_verdict(program, ADD, timeout=10.0, mode=mode)
    assert verdict.status == "passed", verdict
    report = _report(verdict)
    assert report["adj"] == "1000", verdict.stderr_tail
    if mode != "fallback":
        assert report == {"adj": "1000", "lowered": False, "after": "1000"}, verdict.stderr_tail
    assert "C=1000" in verdict.stderr_tail, verdict.stderr_tail


OOM_TRAINER = r"""
import os, sys
cgroup = sys.argv[1]
with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
ballast = bytearray(700 << 20)  # the trainer: its model and optimizer
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
import verifiers as V
ADD = {"prompt": "def add(a, b):\n", "entry_point": "add", "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}
# a run within its own 1.5 GiB: three processes of 350 MiB, none as big as the trainer
HOG = (
    "import os, time\n"
    "for _ in range(2):\n"
    "    if os.fork() == 0:\n        break\n"
    "block = bytearray(350 << 20)\n"
    "for i in range(0, len(block), 4096):\n    block[i] = 1\n"
    "time.sleep(20)\n"
    "def add(a, b):\n    return a + b\n"
)
verdict = V.code_verdict(HOG, ADD, timeout=4.0)
print("TRAINER ALIVE", verdict.status, flush=True)
"""


def test_attack_a_run_that_fills_the_trainers_cgroup_is_killed_not_the_trainer():
    """The trainer in a memory cgroup of 1,400 MiB, using 700 MiB; a run within its own limit takes three processes
    of 350 MiB: the cgroup is over, and the kernel kills a process. The old code: the trainer (the largest), while
    the run lived on. Now: a process of the run (oom_score_adj 1000); the trainer reports its verdict."""
    folders = S._cgroup_folders()
    if os.geteuid() != 0 or "memory" not in folders or not os.access(folders["memory"], os.W_OK):
        pytest.skip("needs root and a cgroup v1 memory hierarchy")
    cgroup = os.path.join(folders["memory"], f"verifiers-r5-oom-{os.getpid()}")
    os.mkdir(cgroup)
    try:
        for name, value in (("memory.limit_in_bytes", 1400 << 20), ("memory.memsw.limit_in_bytes", 1400 << 20)):
            if os.path.exists(os.path.join(cgroup, name)):
                with open(os.path.join(cgroup, name), "w") as f:
                    f.write(str(value))
        done = subprocess.run(
            [sys.executable, "-c", OOM_TRAINER, cgroup], cwd=HERE, env=dict(os.environ, PYTHONPATH=HERE),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0 and "TRAINER ALIVE" in done.stdout, (
            f"the trainer died ({done.returncode}, {signal.Signals(-done.returncode).name if done.returncode < 0 else ''}): "
            f"{done.stdout} {done.stderr[-1500:]}"
        )
    finally:
        S._remove_cgroup(cgroup, wait_s=5.0)


def test_a_trainer_whose_cgroup_cannot_hold_the_pool_is_told_in_one_line(monkeypatch, caplog):
    """preflight states the pool's memory (runs at once x per-run memory) once, and refuses (one line, what to do)
    a trainer whose memory cgroup cannot hold that beside what it uses now."""
    monkeypatch.setattr(S, "_pool_stated", False)
    monkeypatch.setattr(S, "_memory_room", lambda: (8 << 30, 1 << 30, "/sys/fs/cgroup/memory/job"))
    with caplog.at_level(logging.INFO, logger="verifiers.sandbox"):
        S.preflight()
    stated = [r.getMessage() for r in caplog.records if "runs at once" in r.getMessage()]
    pool = S.runs_at_once() * S.SANDBOX_RUN_MEMORY_BYTES / 2**30
    assert len(stated) == 1 and f"up to {pool:.1f} GiB beside the trainer" in stated[0], stated
    monkeypatch.setattr(S, "_memory_room", lambda: (int(1.4 * 2**30), 700 << 20, "/sys/fs/cgroup/memory/job"))
    monkeypatch.setenv(S.SANDBOX_RUNS_ENV, "1")
    with pytest.raises(V.UserError) as caught:
        V.check_code_sandbox()
    message = str(caught.value)
    assert "\n" not in message and "allows 1.4 GiB" in message and S.SANDBOX_RUNS_ENV in message, message
    monkeypatch.setenv(S.SANDBOX_RUNS_ENV, "none")
    with pytest.raises(V.UserError, match="whole number"):
        V.check_code_sandbox()


# ---------------------------------------------------------------------------------------------
# 6. One run per core across the ranks of a node
# ---------------------------------------------------------------------------------------------

RANK = r"""
import sys
from concurrent.futures import ThreadPoolExecutor
import sandbox as S, verifiers as V
ADD = {"prompt": "def add(a, b):\n", "entry_point": "add", "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}
program = (
    "import sys, time\n"
    "def add(a, b):\n"
    "    start = time.monotonic()\n"  # one clock for every process of the machine
    "    time.sleep(0.6)\n"
    "    print('SPAN', start, time.monotonic(), file=sys.stderr)\n"
    "    return a + b\n"
)
with ThreadPoolExecutor(S.num_cores()) as pool:  # this rank's own share: one run per core it sees
    verdicts = list(pool.map(lambda _: V.code_verdict(program, ADD, timeout=20.0), range(2 * S.num_cores())))
print("STATUSES", sorted({v.status for v in verdicts}))
for v in verdicts:
    print(*[line for line in v.stderr_tail.splitlines() if line.startswith("SPAN")])
"""


def test_a_run_that_gets_no_permit_is_an_error_not_a_hang(monkeypatch):
    """Every permit of the node held (by a stopped rank, say): a run waits NODE_CORE_WAIT_S in the node's queue, then
    is "error" (reward None: the caller retries, then stops the run), never a hang."""
    monkeypatch.setattr(S, "NODE_CORE_WAIT_S", 0.5)
    held = [S.take_node_core() for _ in range(S.runs_at_once())]
    try:
        start = time.monotonic()
        verdict = V.code_verdict(RIGHT, ADD, timeout=5.0)
        waited = time.monotonic() - start
    finally:
        for fd in held:
            S.give_node_core(fd)
    assert verdict.status == "error" and "no run permit" in verdict.stderr_tail, verdict
    assert 0.5 <= waited < 3.0, waited
    assert V.code_verdict(RIGHT, ADD, timeout=5.0).status == "passed"


def test_the_ranks_of_a_node_run_at_most_one_run_per_core_together():
    """Two trainer processes (two ranks of a torchrun on one node), each running one run per core it sees: the old
    code ran 2 x cores at once (an honest CPU-bound program beside another rank's then timed out: 0.0). Now they
    share the node's permits: never more programs running at once than cores."""
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK],
            cwd=HERE,
            env=dict(os.environ, PYTHONPATH=HERE, LOCAL_WORLD_SIZE="2"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    spans = []
    for out, err in outputs:
        assert "STATUSES ['passed']" in out, out + err[-1500:]
        spans += [tuple(map(float, line.split()[1:3])) for line in out.splitlines() if line.startswith("SPAN")]
    assert len(spans) == 4 * S.num_cores(), outputs
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    alive = most = 0
    for _, change in events:  # an end before a start at the same instant
        alive += change
        most = max(most, alive)
    assert most <= S.num_cores(), f"{most} programs ran at once on {S.num_cores()} cores"
