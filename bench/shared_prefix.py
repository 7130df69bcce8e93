"""Each prompt once per group, against once per row: the training pass and generation, ratios in one run.

Training pass: the forward + backward of grpo.py's update (micro_batches at --micro-batch-tokens, completion_logps,
grpo.compute_policy_loss, backward per micro-batch) over P groups of G rows, packed groups (micro_batches with the
model: the cost rule decides per group) against padded rows (micro_batches without the model: today's layout).
Generation: HFEngine.generate of P prompts x G, the engine's sampling loop (each prompt prefilled once, ended rows
out of the batch) against transformers' generate on every row (references.ReferenceHFEngine: every row prefilled and
stepped until the chunk's longest row ends); the two draw from the same distribution, not the same tokens, so the
table gives both mean lengths. Embedded SmolLM2-135M, the arith task's real prompts (~51
tokens); completions of T random tokens for the training shapes (EOS never sampled: every completion has exactly T
tokens), real sampled completions for generation (natural EOS, at most T tokens).

    flock /tmp/cpu.lock python bench/shared_prefix.py                     # every shape below, ~25 min on 2 cores
    flock /tmp/cpu.lock python bench/shared_prefix.py --quick             # the default shape only
    flock /tmp/cpu.lock python bench/shared_prefix.py --only generation   # generation only
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
from tests import references  # noqa: E402


def train_pass(model, rollout, budget: int, packed: bool) -> tuple[float, int, int]:
    """(seconds, micro-batches, tokens through the body) of one forward + backward of the whole batch."""
    rows = list(range(len(rollout)))
    adv = torch.linspace(-1.0, 1.0, len(rows))
    micros = common.micro_batches(rollout, rows, budget, model if packed else None)
    model.zero_grad(set_to_none=True)
    tokens = 0
    t0 = time.perf_counter()
    for micro in micros:
        tb = common.token_batch_of(rollout, micro, model.rlvr_pad_id)
        tokens += tb.input_ids.numel()
        logp, _ = common.completion_logps(model, tb, 1.0)
        loss, _ = grpo.compute_policy_loss(logp, logp.detach(), adv[micro], tb.completion_mask)
        (loss * len(micro) / len(rows)).backward()
    return time.perf_counter() - t0, len(micros), tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--micro-batch-tokens", type=int, default=1024)
    p.add_argument("--only", choices=["training", "generation"], help="one of the two tables")
    a = p.parse_args()
    run.set_cpu_threads()
    cpu = torch.device("cpu")
    tokenizer = models.load_tokenizer(models.EMBEDDED_MODEL)
    model = models.load_model(models.EMBEDDED_MODEL, cpu)
    model.rlvr_pad_id = tokenizer.pad_token_id
    task = verifiers.load_task("arith", "train", 1)
    prompts = [common.format_prompt(tokenizer, p["question"], task.instruction) for p in task.problems[:16]]
    gen = torch.Generator().manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; prompts {len(prompts[0])}-"
        f"{max(map(len, prompts))} tokens; --micro-batch-tokens {a.micro_batch_tokens}; median of {a.repeats}"
    )

    shapes = [] if a.only == "generation" else [(4, 8, 20)] if a.quick else TRAIN_SHAPES
    if shapes:
        print("\n| groups x G | T | tokens per row / packed | micro-batches | per-row s | packed s | ratio |")
        print("|---|---|---|---|---|---|---|")
    for P, G, T in shapes:
        rollout = references.rollout_from_rows(
            [prompts[g] for g in range(P) for _ in range(G)],
            [torch.randint(3, len(tokenizer) - 1, (T,), generator=gen).tolist() for _ in range(P * G)],
        )
        times = {False: [], True: []}
        info = {}
        for _ in range(a.repeats):
            for packed in (False, True):  # interleaved: background load hits both alike
                s, n_micro, tokens = train_pass(model, rollout, a.micro_batch_tokens, packed)
                times[packed].append(s)
                info[packed] = (n_micro, tokens)
        rows_s, pack_s = statistics.median(times[False]), statistics.median(times[True])
        print(
            f"| {P} x {G} | {T} | {info[False][1]} / {info[True][1]} | {info[False][0]} / {info[True][0]} | "
            f"{rows_s:.2f} | {pack_s:.2f} | {pack_s / rows_s:.2f} |",
            flush=True,
        )
    model.zero_grad(set_to_none=True)

    gen_shapes = [] if a.only == "training" else [(8, 8, 32)] if a.quick else GEN_SHAPES
    gen_engines = {False: engines.HFEngine(model, tokenizer, gen_batch_size=64)}  # True: transformers' generate
    gen_engines[True] = references.ReferenceHFEngine(model, tokenizer, gen_batch_size=64)
    if gen_shapes:
        print("\n| prompts x G | max new tokens | mean / longest completion | generate s | loop s | ratio | generate's mean |")
        print("|---|---|---|---|---|---|---|")
    for P, G, T in gen_shapes:
        times, outs = {True: [], False: []}, {}
        for _ in range(a.repeats):
            for use_generate in (True, False):  # interleaved: background load hits both alike
                torch.manual_seed(1)
                t0 = time.perf_counter()
                outs[use_generate] = gen_engines[use_generate].generate(prompts[:P], G, T, 1.0, progress=False)
                times[use_generate].append(time.perf_counter() - t0)
        theirs = outs[True].completion_lengths.float().mean()
        lengths = outs[False].completion_lengths.float()
        generate_s, loop_s = statistics.median(times[True]), statistics.median(times[False])
        print(
            f"| {P} x {G} | {T} | {lengths.mean():.1f} / {int(lengths.max())} | {generate_s:.2f} | {loop_s:.2f} | "
            f"{loop_s / generate_s:.2f} | {theirs:.1f} |",
            flush=True,
        )


TRAIN_SHAPES = [(4, 8, 20), (4, 4, 20), (4, 16, 20), (4, 8, 64), (2, 8, 256), (1, 8, 1024)]
GEN_SHAPES = [(8, 8, 32), (8, 4, 32), (8, 16, 32), (4, 8, 64), (2, 8, 256), (1, 8, 1024)]

if __name__ == "__main__":
    main()
