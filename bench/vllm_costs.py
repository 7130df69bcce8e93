"""What the vLLM engine costs the trainer's process, with the CPU build of vLLM (docs/vllm.md, "Hidden costs"):

1. torch's intra-op threads before the engine is built, after, and inside a generate call;
2. the host memory a generate call's outputs hold per sampled token (a deep sizeof of their Python objects), the
   sampled tokens' log-probs as vLLM's default list of {token_id: Logprob} per position and as FlatLogprobs
   (SamplingParams(flat_logprobs=True), what the engine asks for);
3. the weight pushes of a run's wakes (an evaluation after every step): one per weight version.

    VLLM_CPU_CI_ENV=1 flock /tmp/cpu.lock /path/to/vllm-venv/bin/python bench/vllm_costs.py [--prompts 8 --n 8 --tokens 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import common  # noqa: E402
import models  # noqa: E402
import run  # noqa: E402


def deep_size(obj, seen: set | None = None) -> int:
    """Bytes of `obj` and every Python object it reaches (lists, dicts, tuples, instance attributes, dataclass
    fields), each counted once; tensors and modules are not expected here."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        size += sum(deep_size(v, seen) for v in obj)
    elif hasattr(obj, "__dict__"):
        size += deep_size(vars(obj), seen)
    elif hasattr(obj, "__slots__"):
        size += sum(deep_size(getattr(obj, k), seen) for k in obj.__slots__ if hasattr(obj, k))
    return size


def held_bytes(engine, prompts, n: int, tokens: int, flat: bool) -> tuple[int, int, int]:
    """(bytes of the outputs' log-prob objects, bytes of the whole outputs, sampled tokens) of one generate call of
    the engine's LLM, every row running to `tokens`."""
    params = engine._sampling_params(n, tokens, 1.0, seed=None)
    params.flat_logprobs = flat
    params.ignore_eos = True  # every row runs to `tokens`: the same work in both forms
    outputs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sampled = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    assert all(hasattr(c.logprobs, "start_indices") == flat for o in outputs for c in o.outputs)
    logprobs = deep_size([c.logprobs for o in outputs for c in o.outputs])
    return logprobs, deep_size(outputs), sampled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    run.set_cpu_threads()
    before = torch.get_num_threads()
    tokenizer = models.load_tokenizer(models.EMBEDDED_MODEL)
    model = models.load_model(models.EMBEDDED_MODEL, torch.device("cpu"))
    engine = models.make_engine(
        run.Args(engine="vllm", seed=0, gen_batch_size=64, gpu_memory_utilization=0.35),
        model,
        tokenizer,
        models.EMBEDDED_MODEL,
        512,
    )
    after = torch.get_num_threads()
    seen = []
    original = engine.llm.generate

    def generate(*args, **kw):
        seen.append(torch.get_num_threads())
        return original(*args, **kw)

    engine.llm.generate = generate
    engine.generate([common.format_prompt(tokenizer, "What is 1 + 1?")], 1, 4, 1.0, progress=False)
    engine.llm.generate = original
    print(f"threads: trainer {before} before the engine, {after} after it; inside generate {seen[0]}")
    print(f"  (engine.trainer_threads {engine.trainer_threads}, engine.engine_threads {engine.engine_threads})")

    questions = [f"Compute {i} plus {3 * i} and explain." for i in range(a.prompts)]
    prompts = [common.format_prompt(tokenizer, q) for q in questions]
    print(f"\nhost memory of the outputs, {a.prompts} prompts x {a.n} x {a.tokens} tokens, logprobs=0 (deep sizeof):")
    print("| log-probs as | log-prob objects | whole outputs | sampled tokens | log-probs per token | generate s |")
    print("|---|---|---|---|---|---|")
    for flat in (False, True):
        t = time.time()
        logprobs, whole, sampled = held_bytes(engine, prompts, a.n, a.tokens, flat)
        name = "FlatLogprobs" if flat else "dict per position"
        print(
            f"| {name} | {logprobs / 2**20:.2f} MiB | {whole / 2**20:.2f} MiB | {sampled} | {logprobs / sampled:.0f} B | "
            f"{time.time() - t:.1f} |",
            flush=True,
        )

    pushes = engine.pushes
    update = 0
    for _ in range(3):  # the wakes of a run with --eval-every 1, 2 updates a step
        engine.wake(model, version=update)  # the step's rollout
        engine.sleep()
        update += 2
        engine.wake(model, version=update)  # the evaluation after it
    print(f"\nweight pushes for 3 steps with an evaluation after each (6 wakes): {engine.pushes - pushes}")


if __name__ == "__main__":
    main()
