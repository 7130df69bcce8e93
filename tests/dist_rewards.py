"""Custom rewards for tests/test_distributed.py (--reward tests/dist_rewards.py:<name>)."""

import os


def fail_on_rank1(completion: str, problem: dict) -> float:
    """Raises on rank 1 only: one rank's failure must stop every rank with one line, never hang them."""
    if os.environ.get("RANK") == "1":
        raise RuntimeError("reward sandbox could not start on this rank")
    return 1.0 if completion.strip().endswith("2") else 0.0
