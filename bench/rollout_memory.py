"""Host memory of one rollout batch: the old lists of Python ints and floats against common.RolloutBatch's packed
buffers, measured with tracemalloc on synthetic rows shaped like the engines' output, then scaled to Mu-GRPO's
paper-scale stage (65536 prompts x 8 rollouts x up to 3072 tokens). Also prints the dense (B, T) tensors that the
shared blocks of the method scripts allocate per step, which the packing does not touch.

The old layout is rebuilt exactly as the engines built it: a fresh `list(prompt)` per row, the completion from
`tensor.tolist()` (a fresh int object per token id >= 257; CPython caches -5..256), the log-probs from
`tensor.tolist()` (a float object per token). Token ids are uniform over --vocab, so the old layout's per-token
cost is an upper bound by the share of ids below 257 (digits and punctuation in real math text).

    flock /tmp/cpu.lock python bench/rollout_memory.py                      # 4096 rows, mean 1000 tokens
    flock /tmp/cpu.lock python bench/rollout_memory.py --mean-len 3072      # every completion truncated
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import common  # noqa: E402
from tests import references  # noqa: E402


def synthetic_rows(rows: int, group: int, prompt_len: int, mean_len: int, max_len: int, vocab: int, seed: int):
    """(prompt tensor per group, completion tensors, log-prob tensors): lengths uniform in [1, 2 mean - 1] capped."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g) for _ in range(rows // group)]
    lengths = torch.randint(1, 2 * mean_len, (rows,), generator=g).clamp(max=max_len)
    if mean_len >= max_len:
        lengths.fill_(max_len)
    completions = [torch.randint(0, vocab, (int(n),), generator=g) for n in lengths]
    logps = [-torch.rand(int(n), generator=g) * 3 for n in lengths]  # float32, as the HF engine's step_logps
    return prompts, completions, logps


def retained(build):
    """Bytes still allocated (tracemalloc: Python objects and array buffers) after build() returns its result."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    out = build()
    seconds = time.perf_counter() - t0
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return out, after - before, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096, help="rollouts measured here (B)")
    ap.add_argument("--group", type=int, default=8, help="rollouts per prompt (G)")
    ap.add_argument("--prompt-len", type=int, default=150, help="prompt tokens")
    ap.add_argument("--mean-len", type=int, default=1000, help="mean completion tokens")
    ap.add_argument("--max-len", type=int, default=3072, help="maximum completion tokens (T)")
    ap.add_argument("--vocab", type=int, default=151936, help="token ids drawn uniformly below this (Qwen2.5)")
    ap.add_argument("--chars-per-token", type=int, default=4, help="length of each decoded text per token")
    ap.add_argument("--scale-rows", type=int, default=65536 * 8, help="rollouts to scale to (Mu-GRPO paper stage)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.rows % a.group:
        raise SystemExit("--rows must be a multiple of --group")
    prompts, completions, logps = synthetic_rows(a.rows, a.group, a.prompt_len, a.mean_len, a.max_len, a.vocab, a.seed)
    n_tokens = sum(len(c) for c in completions)
    reasons = ["length" if len(c) == a.max_len else "stop" for c in completions]

    def texts():
        return ["x" * (a.chars_per_token * len(c)) for c in completions]

    def old():  # the engines' former appends
        prompt_lists = [p.tolist() for p in prompts]  # the caller's prompt lists (shared by both layouts)
        out = {"prompt_ids": [], "completion_ids": [], "engine_logps": [], "texts": [], "finish_reasons": []}
        for r, (c, lp) in enumerate(zip(completions, logps)):
            out["texts"].append("")
            out["finish_reasons"].append(reasons[r])
            out["prompt_ids"].append(list(prompt_lists[r // a.group]))
            out["completion_ids"].append(c.tolist())
            out["engine_logps"].append(lp.tolist())
        return out, prompt_lists

    def packed():
        prompt_lists = [p.tolist() for p in prompts]
        out = common.RolloutBatch(with_engine_logps=True)
        for r, (c, lp) in enumerate(zip(completions, logps)):
            out.append_row(prompt_lists[r // a.group], c.tolist(), "", reasons[r], lp)
        return out, prompt_lists

    _, text_bytes, _ = retained(texts)
    (old_out, old_prompts), old_bytes, old_s = retained(old)
    prompt_list_bytes = sum(sys.getsizeof(p) + sum(sys.getsizeof(t) for t in p if t > 256) for p in old_prompts)
    old_bytes -= prompt_list_bytes  # the caller's own prompt lists exist in both layouts
    t0 = time.perf_counter()
    lengths_old = [len(old_out["prompt_ids"][r]) + len(old_out["completion_ids"][r]) for r in range(a.rows)]
    old_access = time.perf_counter() - t0
    del old_out, old_prompts
    (new_out, new_prompts), new_bytes, new_s = retained(packed)
    new_bytes -= prompt_list_bytes
    t0 = time.perf_counter()
    lengths_new = [len(new_out.prompt(r)) + len(new_out.completion(r)) for r in range(a.rows)]
    new_access = time.perf_counter() - t0
    assert lengths_new == lengths_old and references.rollout_nbytes(new_out) <= new_bytes + 4096

    B, T, scale = a.rows, a.max_len, a.scale_rows / a.rows
    gb = 1e9
    print(
        f"measured: B = {B} rollouts (G = {a.group}), prompt {a.prompt_len} tokens, {n_tokens} completion tokens "
        f"(mean {n_tokens / B:.0f}, max {T}), ids uniform below {a.vocab}"
    )
    print(
        f"{'layout':<34}{'bytes/rollout':>15}{'bytes/compl. token':>20}{'build s':>9}{'lengths pass s':>16}"
        f"{f'at {a.scale_rows} rollouts':>22}"
    )
    for name, nbytes, secs, acc in (
        ("old lists (ints, floats)", old_bytes, old_s, old_access),
        ("packed RolloutBatch", new_bytes, new_s, new_access),
    ):
        print(
            f"{name:<34}{nbytes / B:>15.0f}{nbytes / n_tokens:>20.2f}{secs:>9.2f}{acc:>16.3f}{nbytes * scale / gb:>19.1f} GB"
        )
    print(
        f"{'texts (same in both, str)':<34}{text_bytes / B:>15.0f}{text_bytes / n_tokens:>20.2f}{'':>25}"
        f"{text_bytes * scale / gb:>19.1f} GB"
    )
    dense = a.scale_rows * T * 4
    print(
        f"dense fp32 (B, T) tensor of the shared blocks at {a.scale_rows} x {T}: {dense / gb:.2f} GB each "
        f"(mask, old_logp, no_grad_logps' result while it is copied in, ref_logp with --beta > 0)"
    )


if __name__ == "__main__":
    main()
