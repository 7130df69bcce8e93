"""The math-verify workers, the trainer's side: a pool of worker processes (sandbox/math_worker.py), at most one busy
per core, and one request answered within a deadline. verifiers.math_reward calls `ask`; `close` stops the idle
workers (also done at exit)."""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time

from sandbox import SITE_DIRS as _SITE_DIRS
from sandbox import num_cores as _num_cores

log = logging.getLogger("verifiers")

# The math worker (math_worker.py), read once here: a worker runs this copy with `python -I -S -c` and never reads
# the file from disk (which a sandboxed program could have rewritten where writes are not stopped).
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "math_worker.py"), encoding="utf-8") as _f:
    _MATH_WORKER_SRC = _f.read()
del _f


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

    def ask(self, gold_latex: str, pred_latex: str | None, timeout: float) -> bool:
        """Raises TimeoutError / EOFError / OSError when the worker is stuck or gone."""
        if not self.ready:
            if self._read_line(self.STARTUP_TIMEOUT_S) != b"ready":
                raise OSError("math worker did not start")
            self.ready = True
        self.request_id += 1
        data = (json.dumps([self.request_id, gold_latex, pred_latex]) + "\n").encode()
        while data:
            data = data[os.write(self.proc.stdin.fileno(), data) :]
        reply_id, verdict = self._read_line(timeout).split()
        if int(reply_id) != self.request_id:
            raise OSError("math worker out of sync")
        return verdict == b"1"

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


def ask(gold_latex: str, pred_latex: str | None, timeout: float, deadline: float) -> bool:
    """One request to a free math worker (at most one busy worker per core), answered by `deadline`; False when
    none is free in time, it times out (killed and replaced) or fails. Never raises."""
    worker = None
    _register_math_hooks()
    try:
        slots = _math_slots
        if not slots.acquire(timeout=min(max(deadline - time.monotonic(), 0.0), threading.TIMEOUT_MAX)):
            log.warning("math worker: none free within %.1f s, answered False", timeout)
            return False
        try:
            worker = _borrow_math_worker()
            ok = worker.ask(gold_latex, pred_latex, max(deadline - time.monotonic(), 1e-3))
            _return_math_worker(worker)
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
