"""An honest CPU-bound program (LOOP additions, about 0.8 s of CPU at the default 22,000,000 on this machine; 1.5 s
timeout), run one per core this process sees, twice over: alone (`python bench/sandbox_ranks.py`) and as every rank
of a torchrun (`torchrun --nproc-per-node 2 bench/sandbox_ranks.py`). Prints each rank's rewards and times: with
the node's run permits the torchrun's match the lone run's (docs/verifiers.md, round five)."""

import os
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sandbox  # noqa: E402
import verifiers  # noqa: E402

ADD = {"prompt": "def add(a, b):\n", "entry_point": "add", "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}
LOOP = int(os.environ.get("LOOP", "22000000"))
PROGRAM = f"def add(a, b):\n    n = 0\n    for i in range({LOOP}):\n        n += i\n    return a + b\n"

if __name__ == "__main__":
    with ThreadPoolExecutor(sandbox.num_cores()) as pool:  # this process's share: one run per core it sees
        runs = range(2 * sandbox.num_cores())
        verdicts = list(pool.map(lambda _: verifiers.code_verdict(PROGRAM, ADD, timeout=1.5), runs))
    rewards, seconds = [v.reward for v in verdicts], [round(v.elapsed_s, 2) for v in verdicts]
    print("RANK", os.environ.get("RANK", "-"), "rewards", rewards, "elapsed", seconds, flush=True)
