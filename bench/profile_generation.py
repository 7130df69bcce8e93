"""Where the HF engine's generation spends its time on CPU: torch.profiler over one engine.generate at
bench/vs_trl.py's shape (4 arith prompts x 8 rows, at most 64 new tokens, T = 1, seed 1), operators by self CPU.

    flock /tmp/cpu.lock python bench/profile_generation.py
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import common  # noqa: E402
import engines  # noqa: E402
import models  # noqa: E402
import verifiers  # noqa: E402


def main() -> None:
    torch.manual_seed(1)
    model_path = models.resolve_model_path("smollm2-135m")
    model = models.load_model(model_path, torch.device("cpu"))
    tokenizer = models.load_tokenizer(model_path)
    task = verifiers.load_task("arith", "train", 1)
    prompts = [common.format_prompt(tokenizer, p["question"], task.instruction) for p in task.problems[:4]]
    engine = engines.HFEngine(model, tokenizer)
    engine.generate(prompts[:1], 2, 8, 1.0, seed=0, progress=False)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        out = engine.generate(prompts, 8, 64, 1.0, seed=1, progress=False)
        seconds = time.perf_counter() - t0
    tokens = int(out.completion_lengths.sum())
    print(f"generation 4 x 8 x <=64 tokens: {seconds:.2f} s, {tokens} completion tokens, {tokens / seconds:.1f} tokens/s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
