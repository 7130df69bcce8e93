"""The reward of bench/gpu_check.py's runs: a random-weight model never solves the arithmetic task, and all-zero
rewards would leave every advantage 0 (no gradient, nothing checked). The parity of the completion's characters
gives mixed groups, so the runs train with real, non-zero gradients. Loaded by the scripts as a custom reward
(`--reward bench/gpu_reward.py:parity`)."""


def parity(completion: str, problem: dict) -> float:
    return float(sum(map(ord, completion)) % 2)
