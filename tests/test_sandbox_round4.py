"""Round four of the code sandbox (issue 43): one test per class that got through around the judge, each with
real hostile programs through the real sandbox, each followed by `clean_sandbox` (nothing of a run outlives it).

1. a trainer that is PID 1 (a container's entry process): nothing is orphaned to it, no slot is dropped;
2. another trainer's sweep (another pid namespace, the same cgroup parent) leaves this trainer's slots alone;
3. I/O a run cannot be killed out of (legacy AIO, O_DIRECT) is refused, and a slot that does not empty is not
   replaced while its processes live;
4. a run that evicts the interpreter's pages and floods the disk does not turn an honest run beside it into an
   error (reward None); a run's disk reads are bounded;
5. a run cannot take the host's AIO events (fs.aio-max-nr);
6. no state across runs through the pool's cgroup files (hidden, and reset where the kernel allows);
7. no forged pass by collusion in a batch through those files; the page cache's channel, measured;
8. no feedback inside one assert (all/any, and/or chains, assert messages);
and the judge's HOME and /proc entries out of the program's reach, and a run that cannot start says why."""

from __future__ import annotations

import ast
import ctypes
import errno
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import sandbox as S
import verifiers as V
from tests.test_verifiers import MODES, NAMESPACE_MODES, clean_sandbox  # noqa: F401 - the fixture, used below

pytestmark = [pytest.mark.usefixtures("clean_sandbox"), pytest.mark.slow]  # slow: the sandbox's attacks

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADD = {"prompt": "def add(a, b):\n", "entry_point": "add", "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}
RIGHT = "def add(a, b):\n    return a + b\n"


def _needs_cgroups():
    if not S._cgroup_parents():
        pytest.skip("no cgroups on this machine")


def _needs_root_and(tool: str):
    if os.geteuid() != 0 or shutil.which(tool) is None:
        pytest.skip(f"needs root and {tool}")


def _report(verdict, prefix: str = "R="):
    """The dict a program printed on its stderr as `R=...` (its last such line)."""
    lines = [line for line in verdict.stderr_tail.splitlines() if line.startswith(prefix)]
    assert lines, verdict
    return ast.literal_eval(lines[-1][len(prefix) :])


def _in_new_pid_namespace(script: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run `script` as a trainer of its own: PID 1 of a fresh pid namespace (with its own /proc), this checkout's
    modules, the same cgroups as this process."""
    return subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script],
        cwd=HERE,
        env=dict(os.environ, PYTHONPATH=HERE),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---------------------------------------------------------------------------------------------
# 1. A trainer that is PID 1
# ---------------------------------------------------------------------------------------------

PID1_TRAINER = """
import logging, os, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
import sandbox as S
import verifiers as V
assert os.getpid() == 1
ADD = {add!r}
SLEEPER = (  # a child in a session of its own too: in the fallback it is orphaned when the runner dies
    "import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n    time.sleep(60)\\n"
    "def add(a, b):\\n    time.sleep(60)\\n"
)
statuses, slots = [], set()
for _ in range(3):
    statuses.append(V.code_verdict(SLEEPER, ADD, timeout=1.0, mode={mode!r}).status)
    slots |= {{slot[0][0] for slot in S._cgroup_pool}}
statuses.append(V.code_verdict("def add(a, b):\\n    return a + b\\n", ADD, timeout=5.0, mode={mode!r}).status)
zombies = []
for name in os.listdir("/proc"):
    if name.isdigit():
        try:
            if open(f"/proc/{{name}}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                zombies.append(int(name))
        except OSError:
            pass
print("OUT=" + repr(dict(statuses=statuses, zombies=zombies, slots=len(slots), made=S._cgroup_slots_made)))
"""


@pytest.mark.parametrize("mode", MODES)
def test_attack_a_trainer_that_is_pid_1_reaps_every_run(mode):
    """The trainer is PID 1 of its pid namespace (a container's entry process), so every process orphaned by a
    run becomes its child. Three runs time out, each with a child that left its session. The old code killed
    the run's process group at once: stage 1 and the judge were orphaned to the trainer, never reaped (2 zombies
    per run for good), and each slot waited 5 s for a reaping that never came and was dropped."""
    _needs_root_and("unshare")
    _needs_cgroups()
    result = _in_new_pid_namespace(PID1_TRAINER.format(add=ADD, mode=mode))
    assert result.returncode == 0, result.stderr[-3000:]
    out = ast.literal_eval([line for line in result.stdout.splitlines() if line.startswith("OUT=")][-1][4:])
    assert out["statuses"] == ["timeout"] * 3 + ["passed"], out
    assert out["zombies"] == [], f"runs left zombies to a trainer that is PID 1: {out}"
    assert "did not empty" not in result.stderr, result.stderr[-2000:]
    assert out["made"] == out["slots"] == 1, f"slots were dropped and remade: {out}"


DYING_TRAINER = """
import sys
import verifiers as V
V.sandbox_mode()
print("ready", flush=True)
V.code_verdict("import time\\ntime.sleep(60)\\n" + {right!r}, {add!r}, timeout=100.0, mode={mode!r})
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_trainer_that_dies_takes_its_runs_with_it(mode):
    """The trainer is killed (SIGKILL) while a run sleeps: its runs end too (the life pipe closes with the trainer,
    and stage 0 kills and reaps what is below it). The old code's runs lived on until their program ended."""
    from tests.test_verifiers import _sandbox_pids

    trainer = subprocess.Popen(
        [sys.executable, "-c", DYING_TRAINER.format(right=RIGHT, add=ADD, mode=mode)],
        cwd=HERE,
        env=dict(os.environ, PYTHONPATH=HERE),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while not _sandbox_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _sandbox_pids(), "the run never started"
    finally:
        trainer.kill()
        trainer.wait()
        trainer.stdout.close()
    deadline = time.monotonic() + 3
    while _sandbox_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _sandbox_pids()
    for pid in left:  # this test's own run, which must not linger into the next test
        os.kill(pid, 9)
    assert left == [], "a run outlived its trainer"


def test_a_child_forked_during_a_run_does_not_hold_it_open(monkeypatch):
    """A child forked while a run goes on (a multiprocessing worker) gets a copy of the run's life pipe; it closes
    it, so the run still ends through its own chain at its deadline, not through the trainer's backstop 5 s later."""
    backstop = []
    monkeypatch.setattr(S, "_kill_run", lambda *args, **kwargs: backstop.append(args), raising=False)
    got = {}
    slow = "import time\ntime.sleep(60)\n" + RIGHT
    thread = threading.Thread(target=lambda: got.update(v=V.code_verdict(slow, ADD, timeout=1.0)))
    thread.start()
    time.sleep(0.5)
    child = os.fork()
    if child == 0:
        time.sleep(30)
        os._exit(0)
    try:
        thread.join()
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
    assert got["v"].status == "timeout", got
    assert backstop == [], "the run outlived its deadline until the trainer's backstop"


# ---------------------------------------------------------------------------------------------
# 2. Another trainer's sweep
# ---------------------------------------------------------------------------------------------

OTHER_TRAINER = """
import sandbox as S
import verifiers as V
S._cgroup_parents()  # the sweep of slots left by trainers that are gone
print("OTHER", V.code_verdict({right!r}, {add!r}, timeout=10.0).status)
"""


def test_attack_another_trainers_sweep_leaves_this_trainers_slots():
    """A second trainer in another pid namespace, on the same cgroup parent, starts while this one has a busy and
    an idle slot. The old sweep judged a slot's owner alive by the pid in its name, looked up in the sweeper's own
    pid namespace: it removed both (killing the busy run's processes), and this trainer's next run was an error
    (ENODEV). A slot whose trainer is gone (nobody holds its lock) is still swept."""
    _needs_root_and("unshare")
    _needs_cgroups()
    assert V.code_rewards_batch([RIGHT, RIGHT], [ADD, ADD]) == [1.0, 1.0]  # two slots, idle
    gone = [os.path.join(parent, f"{S._SANDBOX_CGROUP_PREFIX}{'0' * 16}-pool0") for parent, _ in S._cgroup_parents()]
    for path in gone:
        os.mkdir(path)
    busy = {}
    slow = "import time\ntime.sleep(4)\n" + RIGHT
    thread = threading.Thread(target=lambda: busy.update(v=V.code_verdict(slow, ADD, timeout=20.0)))
    thread.start()
    try:
        time.sleep(0.5)
        other = _in_new_pid_namespace(OTHER_TRAINER.format(right=RIGHT, add=ADD))
        left = [path for path in gone if os.path.isdir(path)]
    finally:
        thread.join()
        for path in gone:
            if os.path.isdir(path):
                os.rmdir(path)
    assert "OTHER passed" in other.stdout, other.stdout + other.stderr[-2000:]
    assert busy["v"].status == "passed", f"the other trainer's sweep killed a run of this one: {busy['v']}"
    after = V.code_rewards_batch([RIGHT, RIGHT], [ADD, ADD])
    assert after == [1.0, 1.0], f"the other trainer's sweep removed this one's idle slot: {after}"
    assert S._SLOT_NAME.fullmatch(os.path.basename(gone[0])) and left == [], f"a slot nobody holds was not swept: {left}"


# ---------------------------------------------------------------------------------------------
# 3. I/O a run cannot be killed out of
# ---------------------------------------------------------------------------------------------


def _largest_library() -> str:
    """The largest shared library of this interpreter and its environment (torch's, in a venv): the file the
    flood reads. Found here, once, not by the program under test: a walk of a fresh venv with a cold page cache
    can outlast that program's 1 s deadline before it reports what was refused."""
    paths = (
        os.path.join(folder, name)
        for top in dict.fromkeys((sys.base_prefix, sys.prefix))
        for folder, _, names in os.walk(top)
        for name in names
        if name.endswith(".so")
    )
    return max(paths, key=lambda p: os.path.getsize(p) if os.path.isfile(p) else 0)


# Legacy AIO with O_DIRECT reads of a big file the program can read, never reaped: at its deadline a killed
# process waits, uninterruptibly, for every read in flight. Without AIO: openat2 and fcntl(F_SETFL, O_DIRECT).
AIO_FLOOD = (
    f"BIG = {_largest_library()!r}\n"
    + r"""
import ctypes, mmap, os, random, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def syscall(nr, *args):
    return 0 if libc.syscall(nr, *args) >= 0 else ctypes.get_errno()
R, size, n = {}, 1 << 20, 256
end = max(1, os.path.getsize(BIG) // size - 1)
ctx = ctypes.c_ulong(0)
R["io_setup"] = syscall(206, 4096, ctypes.byref(ctx))
try:
    fd = os.open(BIG, os.O_RDONLY | os.O_DIRECT)
    R["open_direct"] = 0
except OSError as exc:
    fd, R["open_direct"] = os.open(BIG, os.O_RDONLY), exc.errno
how = struct.pack("QQQ", os.O_RDONLY | os.O_DIRECT, 0, 0)  # struct open_how: flags, mode, resolve
R["openat2_direct"] = syscall(437, -100, BIG.encode(), how, len(how))
try:
    import fcntl
    fcntl.fcntl(os.open(BIG, os.O_RDONLY), fcntl.F_SETFL, os.O_DIRECT)
    R["setfl_direct"] = 0
except OSError as exc:
    R["setfl_direct"] = exc.errno
print("R=" + repr(R), file=sys.stderr, flush=True)
if R["io_setup"] == 0:
    bufs = mmap.mmap(-1, size * n)
    base = ctypes.addressof(ctypes.c_char.from_buffer(bufs))
    iocbs, ptrs, events = ctypes.create_string_buffer(64 * n), (ctypes.c_void_p * n)(), ctypes.create_string_buffer(32 * n)
    while True:
        for i in range(n):  # struct iocb: data, key, rw_flags, opcode (PREAD), prio, fd, buf, nbytes, offset, ...
            offset = size * random.randrange(end)
            struct.pack_into("QIIHhIQQqQII", iocbs, 64 * i, 0, 0, 0, 0, 0, fd, base + size * i, size, offset, 0, 0, 0)
            ptrs[i] = ctypes.addressof(iocbs) + 64 * i
        libc.syscall(209, ctx, n, ptrs)  # io_submit (EAGAIN once the ring is full)
        libc.syscall(208, ctx, 0, n, events, None)  # io_getevents, min 0
"""
)


@pytest.mark.parametrize("mode", MODES)
def test_attack_io_a_run_cannot_be_killed_out_of_is_refused(mode):
    """Legacy AIO and O_DIRECT by every way in (open, openat2, fcntl): each is refused, so nothing of the run is
    left in uninterruptible I/O at its deadline (the old code returned a 1 s run after 2.3 s here, 3.3-7.5 s on
    a slower disk, its processes in D state after SIGKILL)."""
    verdict = V.code_verdict(AIO_FLOOD + "import time\ntime.sleep(60)\n" + RIGHT, ADD, timeout=1.0, mode=mode)
    assert verdict.status == "timeout", verdict
    report = _report(verdict)
    expected = {"io_setup": errno.EPERM, "open_direct": errno.EPERM, "openat2_direct": errno.ENOSYS}
    assert report == dict(expected, setfl_direct=errno.EPERM), f"I/O that cannot be killed was allowed: {report}"


def test_a_slot_that_does_not_empty_counts_until_it_is_empty(monkeypatch, caplog):
    """A slot that holds a process that cannot be ended (here a zombie of ours, which holds the slot's pid count
    and no SIGKILL removes) stays out of the pool and counted: no fresh slot takes its place while it lives (the
    old code dropped it from the count at once, and made a fresh slot beside it). Once it is empty it serves
    again."""
    _needs_cgroups()
    monkeypatch.setattr(S, "SLOT_EMPTY_WAIT_S", 0.3)
    monkeypatch.setattr(S, "QUARANTINE_POLL_S", 0.05, raising=False)
    S._close_cgroup_pool()
    slot = S._borrow_cgroups()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.read(go_r, 1)
        os._exit(0)
    borrowed = []
    try:
        S._join_run_cgroups(slot[1], pid)
        os.write(go_w, b"1")
        while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        made = S._cgroup_slots_made
        with caplog.at_level(logging.WARNING, logger="verifiers"):
            S._return_cgroups(slot)
        assert S._cgroup_slots_made == made, "a slot whose process lives no longer counts against the pool"
        assert any("did not empty" in r.getMessage() for r in caplog.records)
        while S._cgroup_slots_made < S.num_cores() + 1:
            borrowed.append(S._borrow_cgroups(wait_s=0.2))
        with pytest.raises(S.CgroupsUnavailable):
            borrowed.append(S._borrow_cgroups(wait_s=0.3))  # the pool is full: the live slot is not replaced
    finally:
        os.waitpid(pid, 0)  # reaped: the slot is empty now
        os.close(go_r)
        os.close(go_w)
    again = S._borrow_cgroups(wait_s=5.0)
    assert again[0] == slot[0], "the slot did not come back once empty"
    for taken in [again, *borrowed]:
        S._return_cgroups(taken)
    S._close_cgroup_pool()


# ---------------------------------------------------------------------------------------------
# 4. Starving an honest run beside it into an error
# ---------------------------------------------------------------------------------------------

# Drop the interpreter's files from the page cache, then keep the disk busy: AIO with O_DIRECT where it is
# allowed, else plain reads of the largest library from 8 processes.
STARVER = (
    r"""
import os, sys
DROPPED = 0
for folder, _, names in os.walk(sys.base_prefix):
    for name in names:
        try:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            DROPPED += 1
        except OSError:
            pass
        os.close(fd)
"""
    + AIO_FLOOD
    + r"""
for _ in range(7):
    if os.fork() == 0:
        break
fd = os.open(BIG, os.O_RDONLY)
while True:
    os.pread(fd, size, size * random.randrange(end))
"""
)


def _resident_pages(path: str) -> int:
    """How many pages of `path` are in the page cache: mincore on a mapping of it (the trainer owns the file or is
    root, so the kernel reports the cache, not only this process's mappings)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        assert address not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        vector = ctypes.create_string_buffer((size + 4095) // 4096)
        try:
            assert libc.mincore(address, size, vector) == 0, ctypes.get_errno()
        finally:
            libc.munmap(address, size)
        return sum(b & 1 for b in vector.raw)
    finally:
        os.close(fd)


@pytest.mark.parametrize("mode", NAMESPACE_MODES[:1])
def test_attack_starving_a_run_beside_it_does_not_make_its_reward_none(mode):
    """One run drops the interpreter's pages from the page cache and floods the disk; an honest run started
    beside it must still be judged (1.0). On the old code it could not start before its deadline: status error,
    reward None (which stops training after a retry). Checked too: the interpreter's files stay cached."""
    probe = os.path.join(os.path.dirname(os.path.realpath(os.__file__)), "json", "decoder.py")
    with open(probe, "rb") as f:
        f.read()
    starver = {}
    thread = threading.Thread(target=lambda: starver.update(v=V.code_verdict(STARVER + RIGHT, ADD, timeout=6.0, mode=mode)))
    thread.start()
    try:
        time.sleep(1.5)
        honest = V.code_verdict("import json, fractions, statistics\n" + RIGHT, ADD, timeout=2.0, mode=mode)
    finally:
        thread.join()
    assert starver["v"].status in ("timeout", "failed"), starver["v"]
    assert honest.status == "passed", f"an honest run beside a starving one: {honest}"
    assert _resident_pages(probe) > 0, "a run dropped the interpreter's files from the page cache"


def _uncached(folder: str, name: str, mib: int) -> str:
    """A file of `mib` MiB any run can read, written, synced and dropped from the page cache (root trainer)."""
    path = os.path.join(folder, name)
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    os.chmod(path, 0o644)
    return path


@pytest.fixture
def uncached_file():
    """A 64 MiB file any run can read (in /var/tmp: the namespace modes hide the host's /tmp), not in the page
    cache: written, synced and dropped from the cache (`posix_fadvise` of the trainer, root)."""
    folder = tempfile.mkdtemp(prefix="verifiers-r4-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    os.chmod(folder, 0o755)
    yield _uncached(folder, "data.bin", 64)
    shutil.rmtree(folder)


@pytest.mark.parametrize("mode", NAMESPACE_MODES[:1])
def test_a_runs_disk_reads_are_bounded(mode, uncached_file):
    """What one run reads from the disk is bounded per slot (blkio.throttle / io.max), so it leaves the disk to a
    run beside it: a program reads an uncached file as fast as it can for half a second (the old code: the disk's
    full speed, 1.7 GB/s here)."""
    _needs_cgroups()
    program = (
        "import os, sys, time\n"
        f"fd = os.open({uncached_file!r}, os.O_RDONLY)\n"
        "start, n = time.monotonic(), 0\n"
        "while time.monotonic() < start + 0.5:\n"
        "    chunk = os.read(fd, 1 << 20)\n    if not chunk:\n        break\n    n += len(chunk)\n"
        "print('R=' + repr({'bytes': n, 'seconds': time.monotonic() - start}), file=sys.stderr)\n" + RIGHT
    )
    report = _report(V.code_verdict(program, ADD, timeout=10.0, mode=mode))
    rate, bound = report["bytes"] / report["seconds"], getattr(S, "SANDBOX_READ_BPS", 64 << 20)
    assert rate < 2 * bound, f"a run read {rate / 2**20:.0f} MiB/s from the disk: {report}"


# ---------------------------------------------------------------------------------------------
# 5. A host-wide limit taken: fs.aio-max-nr
# ---------------------------------------------------------------------------------------------

AIO_HOLDER = r"""
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
ctx, R = ctypes.c_ulong(0), {"events": 0, "errno": 0}
for n in (65536, 32768, 16384, 4096, 128):
    if libc.syscall(206, n, ctypes.byref(ctx)) == 0:
        R["events"] = n
        break
    R["errno"] = ctypes.get_errno()
print("R=" + repr(R), file=sys.stderr, flush=True)
time.sleep(1.5)
"""


def _host_io_setup_works() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ctx = ctypes.c_ulong(0)
    if libc.syscall(206, 1, ctypes.byref(ctx)) != 0:
        return False
    libc.syscall(207, ctx)  # io_destroy
    return True


@pytest.mark.parametrize("mode", MODES)
def test_attack_a_run_cannot_take_the_hosts_aio_events(mode):
    """fs.aio-max-nr is one limit for the whole host (not namespaced): the old code let one run take all 65,536
    events, and the host's own io_setup failed while it lived."""
    with open("/proc/sys/fs/aio-nr") as f:
        before = int(f.read())
    got = {}
    thread = threading.Thread(target=lambda: got.update(v=V.code_verdict(AIO_HOLDER + RIGHT, ADD, timeout=10.0, mode=mode)))
    thread.start()
    seen, host_ok = [], []
    while thread.is_alive():
        with open("/proc/sys/fs/aio-nr") as f:
            seen.append(int(f.read()))
        host_ok.append(_host_io_setup_works())
        time.sleep(0.05)
    thread.join()
    report = _report(got["v"])
    assert report == {"events": 0, "errno": errno.EPERM}, f"a run set up AIO contexts: {report}"
    assert max(seen) <= before + 1 and all(host_ok), f"the host's AIO events were taken: {max(seen)} of them"


# ---------------------------------------------------------------------------------------------
# 6. and 7. State across runs and collusion through the pool's cgroup files
# ---------------------------------------------------------------------------------------------

# The run's own slot is the one whose cgroup.procs lists the program (pids seen from its own pid namespace).
OWN_SLOT = r"""
import glob, os, sys, time
def slots():
    return glob.glob("/sys/fs/cgroup/pids/" + "verifiers-sbx-*")
def own_slot():
    for folder in slots():
        try:
            if str(os.getpid()) in open(folder + "/cgroup.procs").read().split():
                return folder
        except OSError:
            pass
def refused(folder):  # pids.events: "max <forks refused at the slot's limit>"
    return int(open(folder + "/pids.events").read().split()[1])
def publish(value):
    # fill the slot's pids limit with sleepers, then fork until the count of refused forks is value mod 4096
    folder, children = own_slot(), []
    if folder is None:
        return False
    try:
        while True:
            pid = os.fork()
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            children.append(pid)
    except OSError:
        pass
    while refused(folder) % 4096 != value:
        try:
            pid = os.fork()
        except OSError:
            continue
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    for pid in children:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    return True
"""


def test_attack_state_across_runs_through_the_slots_counters():
    """One run writes 12 bits into its slot's counters by refused forks; the next run in that slot reads them. The
    old code showed /sys/fs/cgroup read-only in the run and kept a reused slot's counters: the next run read the
    bits exactly. Now the folder is empty in the run, and what the kernel lets us reset is reset."""
    _needs_cgroups()
    value = random.randrange(1, 4096)
    problem = {"test_list": [f"assert secret() == {value}"]}
    sender = OWN_SLOT + f"SENT = publish({value})\nprint('R=' + repr({{'sent': SENT}}), file=sys.stderr)\n"
    sender += "block = bytearray(b'x') * (200 << 20)\n" + f"def secret():\n    return {value}\n"
    receiver = OWN_SLOT + (
        "SLOT = own_slot()\nGOT = refused(SLOT) % 4096 if SLOT else None\n"
        "SEEN = sorted(os.listdir('/sys/fs/cgroup')) if os.path.isdir('/sys/fs/cgroup') else []\n"
        "print('R=' + repr({'got': GOT, 'seen': SEEN}), file=sys.stderr)\n"
        "def secret():\n    return GOT\n"
    )
    first = V.code_verdict(sender, problem, timeout=10.0)
    assert first.status == "passed", first
    memory = [f for f in S._cgroup_pool[-1][0] if os.path.exists(os.path.join(f, "memory.max_usage_in_bytes"))]
    second = V.code_verdict(receiver, problem, timeout=10.0)
    report = _report(second)
    assert second.reward == 0.0 and report["got"] != value, f"the next run read the bits: {report}"
    assert report["seen"] == [], f"the pool's cgroup files are visible in a run: {report}"
    for folder in memory:  # cgroup v1 (v2's memory.peak cannot be reset)
        with (
            open(os.path.join(folder, "memory.max_usage_in_bytes")) as f,
            open(os.path.join(folder, "memory.usage_in_bytes")) as g,
        ):
            peak, now = int(f.read()), int(g.read())
        assert peak - now < 100 << 20, f"a reused slot kept a run's memory peak: {peak >> 20} MiB, now {now >> 20} MiB"


COLLUDE_PROBLEM = {"test_list": ["assert f(31337) == 31337 * 7919 % 4093"]}
PUBLISHER = OWN_SLOT + (  # a correct program that publishes each answer in its slot's counters
    "def f(x):\n    value = x * 7919 % 4093\n    publish(value)\n    time.sleep(1.5)\n    return value\n"
)
COPIER = OWN_SLOT + (  # no solution logic: it answers what a busy slot beside it shows
    "def busy_others():\n"
    "    own = own_slot()\n"
    "    return [s for s in slots() if s != own and open(s + '/pids.current').read().strip() != '0']\n"
    "def f(x):\n"  # wait for a change of a busy slot's count, then for it to hold still; answer it mod 4096
    "    first, last, stable, deadline = None, {}, 0, time.monotonic() + 3\n"
    "    while time.monotonic() < deadline:\n"
    "        try:\n            now = {s: refused(s) for s in busy_others()}\n"
    "        except OSError:\n            return 0\n"
    "        first = now if first is None else first\n"
    "        stable = stable + 1 if now == last and now != first else 0\n"
    "        if stable >= 20:\n            break\n"
    "        last = now\n        time.sleep(0.01)\n"
    "    return next(iter(last.values()), 0) % 4096\n"
)


def test_attack_collusion_in_a_batch_through_the_slots_counters():
    """A program with no solution logic, judged beside a correct one in the same batch (as a GRPO group is),
    answers what the correct one publishes through its slot's counters: the old code scored the pair [1.0, 1.0]
    (alone the copier scores 0.0)."""
    _needs_cgroups()
    rewards = V.code_rewards_batch([PUBLISHER, COPIER], [COLLUDE_PROBLEM, COLLUDE_PROBLEM])
    assert rewards == [1.0, 0.0], f"a copier passed beside a correct program: {rewards}"


PAGE_STRIDE = 1 << 20  # one bit per MiB of the file: the readahead around one page never reaches the next bit's
CACHE_PROBES = r"""
import ctypes, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
fd = os.open(FILE, os.O_RDONLY)
R = {}
address = libc.mmap(None, 4096, 1, 1, fd, CONTROL)
R["mincore"] = 0 if libc.mincore(address, 4096, ctypes.create_string_buffer(1)) == 0 else ctypes.get_errno()
try:
    os.preadv(fd, [bytearray(1)], CONTROL, os.RWF_NOWAIT)
    R["nowait"] = 0
except OSError as exc:
    R["nowait"] = exc.errno
os.posix_fadvise(fd, CONTROL, 4096, os.POSIX_FADV_DONTNEED)
print("R=" + repr(R), file=sys.stderr)
"""


def test_page_cache_channel_between_runs_is_measured(uncached_file):
    """The channel that stays (docs/verifiers.md, "What is not enforced"): one run reads pages of a file that both
    runs can read and that is not in the page cache; a later (or concurrent) run times its own reads of those
    pages. What is closed: asking the cache without reading (mincore, preadv2 RWF_NOWAIT: EPERM; cachestat was
    already refused) and dropping pages from it (fadvise is answered without being run; MADV_PAGEOUT/COLD are
    refused), which also made the receiver's probe repeatable. Measured here: how many of 63 bits cross."""
    control = 63 * PAGE_STRIDE + (PAGE_STRIDE // 2)  # a page the trainer caches: a run must not evict it
    with open(uncached_file, "rb") as f:
        os.pread(f.fileno(), 1, control)
    bits = [random.getrandbits(1) for _ in range(63)]
    header = f"FILE, CONTROL = {uncached_file!r}, {control}\n"
    sender = (
        header
        + CACHE_PROBES
        + f"for i, bit in enumerate({bits!r}):\n    if bit:\n        os.pread(fd, 1, i * {PAGE_STRIDE})\n"
    )
    receiver = header + (
        "import os, sys, time\nfd, T = os.open(FILE, os.O_RDONLY), []\n"
        f"for i in range({len(bits)}):\n"
        f"    start = time.perf_counter_ns()\n    os.pread(fd, 1, i * {PAGE_STRIDE})\n"
        "    T.append(time.perf_counter_ns() - start)\n"
        "print('R=' + repr(T), file=sys.stderr)\n"
    )
    report = _report(V.code_verdict(sender + RIGHT, ADD, timeout=10.0))
    assert report == {"mincore": errno.EPERM, "nowait": errno.EPERM}, f"a run asked the page cache: {report}"
    assert _resident_pages_at(uncached_file, control), "a run dropped a page of another's from the page cache"
    times = _report(V.code_verdict(receiver + RIGHT, ADD, timeout=10.0))
    threshold = (min(times) * max(times)) ** 0.5  # cached: a few microseconds; from the disk: ten times that or more
    decoded = [int(t < threshold) for t in times]
    right = sum(a == b for a, b in zip(decoded, bits))
    cached = sorted(t for t, b in zip(times, bits) if b)
    uncached = sorted(t for t, b in zip(times, bits) if not b)
    print(
        f"\npage-cache channel: {right}/{len(bits)} bits crossed; read of a page the sender read: median "
        f"{cached[len(cached) // 2] / 1000:.1f} us, of one it did not: median {uncached[len(uncached) // 2] / 1000:.1f} us"
    )
    assert right >= 0.9 * len(bits), "the page cache no longer carries bits between runs: update docs/verifiers.md"


def _resident_pages_at(path: str, offset: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, 4096, 1, 1, fd, offset)
        vector = ctypes.create_string_buffer(1)
        assert libc.mincore(address, 4096, vector) == 0, ctypes.get_errno()
        libc.munmap(address, 4096)
        return bool(vector.raw[0] & 1)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# 8. No feedback inside one assert
# ---------------------------------------------------------------------------------------------

# wrong at its first call only; logs every call's first argument on its stderr
COUNTING = (
    "import sys\nCALLS = []\n"
    "def add(a, b):\n"
    "    CALLS.append(a)\n"
    "    print('call', len(CALLS), 'with', a, file=sys.stderr, flush=True)\n"
    "    return 0 if len(CALLS) == 1 else a + b\n"
)
ONE_ASSERT = {
    "all": "assert all(add(x, 1) == x + 1 for x in (1, 2, 3))",
    "any": "assert not any(add(x, 1) != x + 1 for x in (1, 2, 3))",
    "and": "assert add(1, 1) == 2 and add(2, 1) == 3 and add(3, 1) == 4",
    "or": "assert add(1, 1) != 2 or add(2, 1) != 3 or add(3, 1) != 5",
    "message": "assert add(1, 1) == 2, f'wrong: {add(9, 9)}'\n    assert add(2, 1) == 3 and add(3, 1) == 4",
}


@pytest.mark.parametrize("name", list(ONE_ASSERT))
@pytest.mark.parametrize("kind", ["humaneval", "mbpp"])
def test_attack_no_feedback_inside_one_assert(name, kind):
    """Round three rewrote statements, not expressions: all()/any() over a generator and an `and` chain stopped
    calling the program at its first wrong answer, and an assert's message called it only when the check had
    failed (the page-cache oracle then passed from run 5). Every call now happens whatever the earlier ones
    returned; the verdicts stay what they were."""
    source = ONE_ASSERT[name]
    if kind == "humaneval":
        problem = dict(ADD, test="def check(candidate):\n    " + source.replace("add(", "candidate(") + "\n")
    else:
        problem = {"test_list": source.replace("\n    ", "\n").split("\n")}
    verdict = V.code_verdict(COUNTING, problem, timeout=10.0)
    assert verdict.status == ("passed" if name == "or" else "failed"), verdict  # `or`: its first operand holds
    assert "call 3 with 3" in verdict.stderr_tail, f"the calls stopped at the first failed check: {verdict.stderr_tail}"
    assert "with 9" not in verdict.stderr_tail, f"an assert's message called the program: {verdict.stderr_tail}"
    assert V.code_verdict(RIGHT, problem, timeout=10.0).status == "passed"


# ---------------------------------------------------------------------------------------------
# The judge's HOME and /proc entries; a run that cannot start says why
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_attack_the_judges_home_is_not_the_programs(mode):
    """The judge ran with HOME and TMPDIR set to the program's tmpfs: a module it imports later that reads a
    config from $HOME would have read the program's file. The program's own HOME is still its writable folder."""
    program = "import os\nwith open(os.path.join(os.environ['HOME'], '.r4config'), 'w') as f:\n    f.write('x')\n" + RIGHT
    problem = {
        "test_setup_code": (
            "import os\nHOME = os.path.expanduser('~')\nPLANTED = os.path.exists(os.path.join(HOME, '.r4config'))\n"
            "EMPTY = not os.path.isdir(HOME) or os.listdir(HOME) == []\nSAME = os.environ.get('TMPDIR') == HOME\n"
        ),
        "test_list": ["assert add(1, 2) == 3", "assert not PLANTED and EMPTY and SAME"],
    }
    verdict = V.code_verdict(program, problem, timeout=10.0, mode=mode)
    assert verdict.status == "passed", f"the judge's HOME holds the program's files: {verdict}"


def test_attack_the_judge_is_hidden_from_the_programs_proc():
    """The judge's /proc/1/sched, stat and cmdline were readable from the run (a timing oracle on them held at
    54-64 %): the run's /proc now shows a process only to those who may ptrace it (hidepid)."""
    if "namespaces" not in NAMESPACE_MODES:
        pytest.skip("no private /proc in this sandbox mode")
    program = (
        "import os\nSEEN = [p for p in os.listdir('/proc') if p == '1']\n"
        "for name in ('sched', 'stat', 'cmdline', 'status', 'schedstat'):\n"
        "    try:\n        open('/proc/1/' + name).read()\n        SEEN.append(name)\n    except OSError:\n        pass\n"
        "print('R=' + repr(SEEN), file=__import__('sys').stderr)\n"
        "def add(a, b):\n    return a + b if not SEEN else 0\n"
    )
    verdict = V.code_verdict(program, ADD, timeout=10.0, mode="namespaces")
    assert verdict.status == "passed", f"the program read the judge's /proc entries: {_report(verdict)}"


def test_a_run_that_cannot_start_says_why(monkeypatch, caplog):
    """A run whose sandbox is not up in time (a starved disk or CPU) is an error, reward None, as before; its
    verdict and the log now say so (the old code said nothing). Its set-up has START_TIMEOUT_S of its own, apart
    from the program's timeout."""
    monkeypatch.setattr(S, "START_TIMEOUT_S", 0.0, raising=False)
    with caplog.at_level(logging.WARNING, logger="verifiers"):
        verdict = V.code_verdict(RIGHT, ADD, timeout=10.0)
    assert verdict.status == "error" and verdict.reward is None, verdict
    assert "did not start within" in verdict.stderr_tail, verdict
    assert any("did not start within" in r.getMessage() for r in caplog.records)
