"""A reward for the DAPO-option tests (`--reward tests/dapo_rewards.py:reward`): rows of kind "zero" always score
0 (a group whose rewards are all equal), rows of kind "varied" score the parity of the completion's length."""


def reward(completion: str, problem: dict) -> float:
    return 0.0 if problem["kind"] == "zero" else float(len(completion) % 2)
