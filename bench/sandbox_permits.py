"""CPU a trainer spends waiting for the node's code-run permits: 128 permits (as on a node of 128 cores), all held by
another process, 16 threads waiting for one, 2 s. `python bench/sandbox_permits.py [checkout]` (default: this one)
prints the cores the waiting process used (docs/verifiers.md, round five)."""

import os
import subprocess
import sys
import threading
import time

ROOT = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import sandbox  # noqa: E402

PERMITS, WAITERS, SECONDS = 128, 16, 2.0
HOLDER = f"""
import sys, time
sys.path.insert(0, {ROOT!r})
import sandbox
sandbox.cpus, sandbox.runs_at_once = (lambda: list(range({PERMITS}))), (lambda: {PERMITS})
held = [sandbox._take_node_core() for _ in range({PERMITS})]
print("held", flush=True)
time.sleep({SECONDS} + 4)
"""

if __name__ == "__main__":
    sandbox.cpus, sandbox.runs_at_once = (lambda: list(range(PERMITS))), (lambda: PERMITS)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    if hasattr(sandbox, "NODE_CORE_WAIT_S"):
        sandbox.NODE_CORE_WAIT_S = SECONDS + 1  # the waiters give up after the measurement
    for _ in range(WAITERS):
        threading.Thread(target=sandbox._take_node_core, daemon=True).start()
    start, cpu = time.monotonic(), time.process_time()
    time.sleep(SECONDS)
    used = (time.process_time() - cpu) / (time.monotonic() - start)
    print(f"{ROOT}: {WAITERS} threads waiting for one of {PERMITS} held permits used {used:.2f} cores")
    holder.kill()
    os._exit(0)  # the waiting threads are left behind
