"""The HF engine with fp32 weights against its bf16 copy (--engine-dtype bf16): generation tokens/s, and the
mismatch the bf16 copy brings (its log-probs of what it drew against the fp32 trainer's); and the sampler alone,
transformers' (softmax, torch.multinomial over every row of the chunk) against sample_from_logits (one uniform
per running row).

Embedded SmolLM2-135M, the arith task's real prompts, P prompts x G rows, every row run to --max-new-tokens
(references.full_length_rows: both sides generate the same number of tokens), median of --repeats, the two engines
interleaved.

    flock /tmp/cpu.lock python bench/engine_dtype.py
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
import models  # noqa: E402
import run  # noqa: E402
import verifiers  # noqa: E402
from tests import references  # noqa: E402


def multinomial_sampler(scores: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
    """transformers' GenerationMixin._sample step, as the engine had it: softmax over every row, multinomial."""
    probs = scores.new_zeros(scores.shape)
    probs[:, 0] = 1.0
    probs[running] = torch.softmax(scores[running], dim=-1)
    return torch.multinomial(probs, num_samples=1).squeeze(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    run.set_cpu_threads()
    cpu = torch.device("cpu")
    tokenizer = models.load_tokenizer(models.EMBEDDED_MODEL)
    model = models.load_model(models.EMBEDDED_MODEL, cpu)
    task = verifiers.load_task("arith", "train", 1)
    prompts = [common.format_prompt(tokenizer, q["question"], task.instruction) for q in task.problems[: a.prompts]]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16 kernels: "
        f"{torch.backends.cpu.get_cpu_capability()}; {a.prompts} x {a.G} rows x {a.max_new_tokens} tokens; "
        f"median of {a.repeats}"
    )

    # 1. the sampler alone, on the shapes of a step of the default run's chunk: 64 rows x the vocabulary
    V = model.config.vocab_size
    scores = torch.randn(a.prompts * a.G, V) * 3
    running = torch.arange(0, a.prompts * a.G, 2)  # half the rows still running
    timed = {"multinomial over every row": lambda: multinomial_sampler(scores, running)}
    timed["sample_from_logits, running rows"] = lambda: engines.sample_from_logits(scores[running], torch.rand(len(running)))
    print("\n| sampler, one step (64 rows, half running) | ms |\n|---|---|")
    for name, fn in timed.items():
        fn()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        print(f"| {name} | {(time.perf_counter() - t0) / 20 * 1e3:.1f} |")

    # 2. generation, fp32 weights against the bf16 copy, and the copy's log-probs against the trainer's
    references.full_length_rows()
    engines = {
        dtype: models.make_engine(
            run.Args(engine="hf", seed=0, gen_batch_size=64, gpu_memory_utilization=0.3, engine_dtype=dtype),
            model,
            tokenizer,
            models.EMBEDDED_MODEL,
            2048,
            engine_logps=True,
        )
        for dtype in ("auto", "bf16")
    }
    times = {dtype: [] for dtype in engines}
    outs = {}
    for r in range(a.repeats):
        for dtype, engine in engines.items():
            t0 = time.perf_counter()
            outs[dtype] = engine.generate(prompts, a.G, a.max_new_tokens, 1.0, seed=r, progress=False)
            times[dtype].append(time.perf_counter() - t0)
    tokens = a.prompts * a.G * a.max_new_tokens
    print("\n| engine weights | generate s | tokens/s | mean abs log rho | max abs log rho | rho outside [0.5, 2] |")
    print("|---|---|---|---|---|---|")
    for dtype, ro in outs.items():
        trainer = common.no_grad_logps(model, ro, range(len(ro)), tokenizer.pad_token_id, 1.0, token_budget=4096)
        log_rho = torch.cat(
            [trainer[i, : len(lp)] - torch.tensor(lp) for i, lp in enumerate(map(ro.engine_logp, range(len(ro))))]
        )
        s = statistics.median(times[dtype])
        outside = (log_rho.abs() > torch.log(torch.tensor(2.0))).float().mean().item()
        print(
            f"| {'fp32 (auto)' if dtype == 'auto' else 'bf16 copy'} | {s:.2f} | {tokens / s:.1f} | "
            f"{log_rho.abs().mean():.2e} | {log_rho.abs().max():.2e} | {outside:.4f} |",
            flush=True,
        )
    print(f"\nbf16 / fp32 generate time: {statistics.median(times['bf16']) / statistics.median(times['auto']):.2f}")


if __name__ == "__main__":
    main()
