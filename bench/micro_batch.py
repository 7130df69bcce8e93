"""Training-pass time and peak memory against --micro-batch-tokens, on one real rollout batch.

Generates one rollout batch with the HF engine (embedded model, P x G, natural EOS), then for each token
budget runs the forward+backward of grpo.py's update exactly as the loop does it (common.micro_batches:
rows sorted by length, each micro-batch padded to its own longest row; common.completion_logps; token-mean
accumulation). Reports padded tokens (rows x padded length, summed over micro-batches), time, and the
growth of peak resident memory over the state before the pass (VmHWM reset through /proc/self/clear_refs).

    flock /tmp/cpu.lock python bench/micro_batch.py              # budgets 4096 (default) 2048 1024 512, 4096 again
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from scaling import OthersLoad, peak_rss_gb, proc_status_gb, reset_peak_rss, wait_quiet  # noqa: E402

import common  # noqa: E402
import grpo  # noqa: E402
import models  # noqa: E402
import run  # noqa: E402
import verifiers  # noqa: E402
from tests import references  # noqa: E402


def train_pass(model, rollout, budget: int, pad_id: int, chunk: int, advantages) -> dict:
    B = len(rollout)
    rows = list(range(B))
    lengths = [len(rollout.prompt(r)) + len(rollout.completion(r)) for r in rows]
    mask = common.completion_mask_of(rollout)
    mb_tokens = mask.sum().item()
    micros = common.micro_batches(rollout, rows, budget)  # padded rows (no model: no packing), as measured
    padded = sum(len(m) * max(lengths[r] for r in m) for m in micros)
    model.zero_grad(set_to_none=True)
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    wait_quiet(300)
    base = proc_status_gb("VmRSS")
    reset_peak_rss()
    others = OthersLoad().__enter__()
    t0 = time.perf_counter()
    for micro in micros:
        tb = common.pad_batch([rollout.prompt(r) for r in micro], [rollout.completion(r) for r in micro], pad_id)
        logp, _ = common.completion_logps(model, tb, 1.0, chunk)
        loss, _ = grpo.compute_policy_loss(logp, logp.detach(), advantages[micro], tb.completion_mask)
        (loss * common.accumulation_weight("token", tb.completion_mask, mb_tokens, len(micro), B)).backward()
    seconds = time.perf_counter() - t0
    others.__exit__(None, None, None)
    return {
        "budget": budget,
        "micro_batches": len(micros),
        "padded_tokens": padded,
        "real_tokens": sum(lengths),
        "s": seconds,
        "peak_growth_gb": peak_rss_gb() - base,
        "others": others.cores,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[4096, 2048, 1024, 512, 4096])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=1)
    o = p.parse_args()
    run.set_cpu_threads()
    run.seed_everything(o.seed)
    tokenizer = models.load_tokenizer(models.EMBEDDED_MODEL)
    model = models.load_model(models.EMBEDDED_MODEL, torch.device("cpu"))
    engine = models.make_engine(
        run.Args(engine="hf", seed=o.seed, gen_batch_size=64, gpu_memory_utilization=0.3), model, tokenizer, "", 512
    )
    task = verifiers.load_task("arith", "train", o.seed)
    problems = [task.problems[i] for i in common.PromptSampler(len(task.problems), o.seed).sample(o.prompts)]
    prompts = [common.format_prompt(tokenizer, q["question"], task.instruction) for q in problems]
    rollout = engine.generate(prompts, o.G, o.max_new_tokens, 1.0, seed=o.seed, progress=False)
    B = len(rollout)
    advantages = torch.randn(B)
    pad_id = tokenizer.pad_token_id
    small = references.rollout_from_rows([rollout.prompt(r) for r in range(4)], [rollout.completion(r) for r in range(4)])
    train_pass(model, small, 4096, pad_id, o.chunk_tokens, advantages)  # warm-up
    print(
        f"{B} rows, mean completion {int(rollout.completion_lengths.sum()) / B:.1f} tokens, threads {torch.get_num_threads()}"
    )
    print(
        "| --micro-batch-tokens | micro-batches | padded tokens (real) | fwd+bwd s | peak RSS growth GB "
        "| others' load (cores) |"
    )
    print("|---|---|---|---|---|---|")
    for budget in o.budgets:
        r = train_pass(model, rollout, budget, pad_id, o.chunk_tokens, advantages)
        print(
            f"| {budget} | {r['micro_batches']} | {r['padded_tokens']} ({r['real_tokens']}) | {r['s']:.2f} | "
            f"{r['peak_growth_gb']:.2f} | {r['others']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
