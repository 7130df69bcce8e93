"""The math-verify workers, the trainer's side: a pool of worker processes (sandbox/math_worker.py), at most one busy
per core of the node (the code sandbox's run permits), one request answered within a wall-clock backstop (the
worker's own limits are CPU time). verifiers.math_reward calls `ask`; `close` stops the idle workers (also done at
exit); `state_limits` says the workers' limits once."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import sandbox
from sandbox import SITE_DIRS as _SITE_DIRS
from sandbox import num_cores as _num_cores

log = logging.getLogger("verifiers")

# The math worker (math_worker.py), read once here: a worker runs this copy with `python -I -S -c` and never reads
# the file from disk (which a sandboxed program could have rewritten where writes are not stopped).
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "math_worker.py"), encoding="utf-8") as _f:
    _MATH_WORKER_SRC = _f.read()
del _f
WORKER_LIMITS = {  # the worker's own constants, read off its text (it is never imported here)
    name: float(re.search(rf"^{constant} = ([\d.]+)", _MATH_WORKER_SRC, re.M).group(1))
    for name, constant in (
        ("address_space", "WORKER_MEMORY"),
        ("resident", "RESIDENT_LIMIT"),
        ("parse_cpu_s", "PARSE_CPU_S"),
        ("verify_cpu_s", "VERIFY_CPU_S"),
    )
}


class _MathWorker:
    """Handle on one worker process; used by one thread at a time."""

    STARTUP_TIMEOUT_S = 120.0  # importing sympy and math-verify, on a busy machine

    def __init__(self) -> None:
        self.owner_pid = os.getpid()
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _MATH_WORKER_SRC, json.dumps(_SITE_DIRS)],
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
            if remaining <= 0:
                raise TimeoutError("math worker timed out")
            if not poller.poll(min(remaining, 60.0) * 1000):  # poll() refuses huge timeouts
                continue
            chunk = os.read(stdout_fd, 4096)
            if not chunk:
                raise EOFError("math worker exited")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line

    def ask(self, gold_latex: str, pred_latex: str | None, question: str | None, timeout: float) -> tuple[bool, bool]:
        """(verdict, whether the worker should be replaced: it holds more memory than math_worker.RESIDENT_LIMIT).
        Raises TimeoutError / EOFError / OSError when the worker is stuck or gone."""
        if not self.ready:
            if self._read_line(self.STARTUP_TIMEOUT_S) != b"ready":
                raise OSError("math worker did not start")
            self.ready = True
        self.request_id += 1
        data = (json.dumps([self.request_id, gold_latex, pred_latex, question]) + "\n").encode()
        while data:
            data = data[os.write(self.proc.stdin.fileno(), data) :]
        reply_id, verdict, recycle = self._read_line(timeout).split()
        if int(reply_id) != self.request_id:
            raise OSError("math worker out of sync")
        return verdict == b"1", recycle == b"1"

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


def close() -> None:
    """Stop the idle math worker processes (also done at exit)."""
    with _math_pool_lock:
        workers = _math_pool[:]
        _math_pool.clear()
    for worker in workers:
        worker.close()


def _after_fork_in_child() -> None:
    """A forked child starts with no workers and free slots (the inherited ones are the parent's)."""
    global _math_pool, _math_pool_lock, _math_slots
    _math_pool, _math_pool_lock = [], threading.Lock()
    _math_slots = threading.BoundedSemaphore(_num_cores())


_math_hooks_registered = False


def _register_math_hooks() -> None:
    """At the first request, not at import: the fork hook (a child starts with no workers and free slots)
    and the exit hook (the idle workers are stopped)."""
    global _math_hooks_registered
    with _math_pool_lock:
        if not _math_hooks_registered:
            _math_hooks_registered = True
            os.register_at_fork(after_in_child=_after_fork_in_child)
            atexit.register(close)


def ask(gold_latex: str, pred_latex: str | None, timeout: float, question: str | None = None) -> bool:
    """One request to a free math worker, answered within `timeout` seconds of wall clock from the moment a worker and
    one of the node's run permits are this request's (the wait for them is not counted: a verdict does not depend
    on the neighbours' load; the worker's own limits are CPU time, math_worker.PARSE_CPU_S and VERIFY_CPU_S). At
    most one busy worker per core of this process, and per core of the node with every rank's code runs and math
    requests together (sandbox.take_node_core). False when none is free within sandbox.NODE_CORE_WAIT_S, the worker
    times out (killed and replaced) or fails. Never raises."""
    worker = None
    _register_math_hooks()
    try:
        slots = _math_slots
        if not slots.acquire(timeout=sandbox.NODE_CORE_WAIT_S):
            log.warning("math worker: none free within %.0f s, answered False", sandbox.NODE_CORE_WAIT_S)
            return False
        try:
            with node_permit():
                worker = _borrow_math_worker()
                ok, recycle = worker.ask(gold_latex, pred_latex, question, timeout)
                (worker.close if recycle else lambda: _return_math_worker(worker))()
                worker = None
        finally:
            slots.release()
        return ok
    except TimeoutError:
        log.info("math worker timed out after %.1f s, answered False; worker replaced", timeout)
        return False
    except (EOFError, OSError) as exc:
        log.warning("math worker failed, answered False: %r", exc)
        return False
    except Exception:  # noqa: BLE001 - never raises
        log.debug("math worker request failed", exc_info=True)
        return False
    finally:
        if worker is not None:  # timed out, died or interrupted mid-request: never reuse it
            worker.close()


_held = threading.local()  # the node permit this thread holds (node_permit), if any


@contextlib.contextmanager
def node_permit():
    """One of the node's run permits for this thread, from sandbox.take_node_core (inside another: the one held)."""
    if getattr(_held, "fd", None) is not None:
        yield
        return
    _held.fd = sandbox.take_node_core()
    try:
        yield
    finally:
        sandbox.give_node_core(_held.fd)
        _held.fd = None


def run_all(fn, calls: list[tuple], workers: int) -> list:
    """[fn(*call) for call in calls], `workers` threads at a time, in order; each thread holds one node permit for its
    whole share (a permit per request would cost every request a lock and an open)."""
    if workers <= 1:
        with node_permit():
            return [fn(*call) for call in calls]
    results, todo, lock = [None] * len(calls), iter(enumerate(calls)), threading.Lock()

    def share(_) -> None:
        with node_permit():
            while True:
                with lock:
                    item = next(todo, None)
                if item is None:
                    return
                results[item[0]] = fn(*item[1])

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(share, range(workers)))
    return results


_stated = False


def state_limits() -> None:
    """One line, once, when a math task loads: how many workers, their memory and time limits (the memory beside the
    trainer they may hold)."""
    global _stated
    if not _stated:
        _stated = True
        runs = sandbox.runs_at_once()
        log.info(
            "math workers: up to %d at once on this node (the code sandbox's run permits, every rank together), each "
            "bounded to %.0f GiB of address space and replaced once it holds over %.0f MiB (up to %.1f GiB beside the "
            "trainer between requests); %.0f s of CPU a parse, %.0f s a verify; the OOM killer's first choice",
            runs,
            WORKER_LIMITS["address_space"] / 2**30,
            WORKER_LIMITS["resident"] / 2**20,
            runs * WORKER_LIMITS["resident"] / 2**30,
            WORKER_LIMITS["parse_cpu_s"],
            WORKER_LIMITS["verify_cpu_s"],
        )
