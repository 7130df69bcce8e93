"""The smallest prompt that common.micro_batches packs, per completion length, at the published Qwen2.5 shapes: where
packing shared prompts can help and where it cannot (docs/performance.md, "When packing helps"). Arithmetic only
(the cost rule on the configs' shapes), no model runs.

    python bench/packing_rule.py                      # groups of 8, --micro-batch-tokens 16384
    python bench/packing_rule.py --group-size 16 --micro-batch-tokens 8192
"""

from __future__ import annotations

import argparse
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import memory_plan  # noqa: E402

import common  # noqa: E402
from tests import references  # noqa: E402


def packed_rows(config: dict, group_size: int, prompt_len: int, completion_len: int, budget: int, groups: int = 8) -> int:
    """Rows micro_batches puts in packs, of `groups` groups of `group_size` rows of the shape."""
    model = types.SimpleNamespace(config=types.SimpleNamespace(**config, _attn_implementation="sdpa"))
    rows = groups * group_size
    prompts = [[3 + g] * prompt_len for g in range(groups)]
    ro = references.rollout_from_rows([prompts[r // group_size] for r in range(rows)], [[5] * completion_len] * rows)
    return sum(len(pack) for m in common.micro_batches(ro, range(rows), budget, model) for pack in (m.packs or []))


def smallest_packed_prompt(config: dict, group_size: int, completion_len: int, budget: int) -> int | None:
    return next((p for p in range(16, 8192, 16) if packed_rows(config, group_size, p, completion_len, budget)), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--completion-lens", type=int, nargs="+", default=[128, 256, 512, 1024])
    a = ap.parse_args()
    names = ("qwen2.5-0.5b", "qwen2.5-1.5b")
    print("| completion tokens | " + " | ".join(f"{n}: smallest packed prompt (share of the row)" for n in names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for c in a.completion_lens:
        cells = []
        for n in names:
            p = smallest_packed_prompt(memory_plan.SHAPES[n], a.group_size, c, a.micro_batch_tokens)
            cells.append(f"{p} ({p / (p + c):.2f})" if p else "none")
        print(f"| {c} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
