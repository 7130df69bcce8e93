"""The default run's training phase on one real sampled rollout, packed groups against padded rows.

grpo.py's training phase at its defaults (P 8 x G 8, at most 32 new tokens, 2 mini-batches of 4 groups): the no-grad
old-log-prob pass over the second mini-batch (the first reuses its own first forward), the forward + backward of both
mini-batches, and per mini-batch the gradient clip and the fused AdamW step. The rollout is sampled by the HF engine
from the arith task's first 8 training prompts (natural EOS, so uneven lengths and truncated rows, unlike the fixed
lengths of bench/shared_prefix.py). Packed: common.micro_batches with the model (the cost rule packs each group);
per-row: without it (every row padded, as before packing). Interleaved, median of --repeats.

    flock /tmp/cpu.lock python bench/train_phase.py          # about 4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import common  # noqa: E402
import engines  # noqa: E402
import grpo  # noqa: E402
import models  # noqa: E402
import run  # noqa: E402
import verifiers  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--micro-batch-tokens", type=int, default=1024)
    a = p.parse_args()
    run.set_cpu_threads()
    tokenizer = models.load_tokenizer(models.EMBEDDED_MODEL)
    model = models.load_model(models.EMBEDDED_MODEL, torch.device("cpu"))
    pad = tokenizer.pad_token_id
    task = verifiers.load_task("arith", "train", 1)
    prompts = [common.format_prompt(tokenizer, q["question"], task.instruction) for q in task.problems[:8]]
    torch.manual_seed(1)
    rollout = engines.HFEngine(model, tokenizer).generate(prompts, 8, 32, 1.0, progress=False)
    lengths = rollout.completion_lengths
    optimizer, _ = models.make_optimizer(model, run.Args(learning_rate=1e-5, weight_decay=0.0, warmup_updates=1))
    minibatches = [list(range(0, 32)), list(range(32, 64))]  # 4 whole groups each

    def phase(packed: bool) -> tuple[float, float, float, int]:
        """(old-log-prob pass s, forward + backward s, clip + AdamW s, tokens through the body)"""
        layout = model if packed else None  # micro_batches packs groups only when given the model
        t0 = time.perf_counter()
        with torch.no_grad():
            model.eval()
            for micro in common.micro_batches(rollout, minibatches[1], a.micro_batch_tokens, layout):
                common.completion_logps(model, common.token_batch_of(rollout, micro, pad), 1.0, with_entropy=False)
            model.train()
        old_s, train_s, step_s, tokens = time.perf_counter() - t0, 0.0, 0.0, 0
        for rows in minibatches:
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            for micro in common.micro_batches(rollout, rows, a.micro_batch_tokens, layout):
                batch = common.token_batch_of(rollout, micro, pad)
                tokens += batch.input_ids.numel()
                logp, _ = common.completion_logps(model, batch, 1.0)
                advantages = torch.linspace(-1.0, 1.0, len(micro))
                loss, _ = grpo.compute_policy_loss(logp, logp.detach(), advantages, batch.completion_mask)
                (loss * len(micro) / len(rows)).backward()
            t1 = time.perf_counter()
            common.clip_grad_norm(model, 1.0)
            optimizer.step()
            train_s, step_s = train_s + t1 - t0, step_s + time.perf_counter() - t1
        return old_s, train_s, step_s, tokens

    results = {False: [], True: []}
    for _ in range(a.repeats):
        for packed in (False, True):  # interleaved: background load hits both alike
            results[packed].append(phase(packed))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; 8 x 8 rows, completions mean "
        f"{lengths.float().mean():.1f} / longest {int(lengths.max())} tokens, {int((lengths == 32).sum())}/64 "
        f"truncated; --micro-batch-tokens {a.micro_batch_tokens}; median of {a.repeats}\n"
    )
    print("| layout | tokens through the body | old log-probs s | forward + backward s | clip + AdamW s | total s |")
    print("|---|---|---|---|---|---|")
    totals = {}
    for packed in (False, True):
        old_s, train_s, step_s = (statistics.median(r[i] for r in results[packed]) for i in range(3))
        totals[packed] = old_s + train_s + step_s
        print(
            f"| {'packed groups' if packed else 'padded rows'} | {results[packed][0][3]} | {old_s:.2f} | {train_s:.2f} | "
            f"{step_s:.2f} | {totals[packed]:.2f} |"
        )
    print(f"\npacked / padded, whole phase: {totals[True] / totals[False]:.2f}")


if __name__ == "__main__":
    main()
