"""The HF engines raced against what transformers maintains, on the same prompts, shapes and seeds: what
bench/gpu_check.py measures to decide the engine a GPU run without vLLM builds (docs/performance.md).

    python bench/gpu_engines.py                    # on a GPU: the 0.5B shape, random bf16 weights (a few minutes)
    python bench/gpu_engines.py --device cpu       # the tiny config, a few tokens: checks the script itself

The engines, each generating from the same bf16 copy of the fp32 weights on CUDA (the trainer's fp32 weights on
the CPU), every row to the full length (no EOS ends one early):
  hf               engines.HFEngine: transformers' dynamic cache grown a token at a time (the default)
  static           engines.StaticHFEngine: a static KV cache, its decode step CUDA graphs (--hf-decode static)
  static-eager     the same without graphs (--hf-decode static-eager)
  generate-static  transformers' generate(cache_implementation="static"): it compiles the decode step itself
  generate-batch   transformers' continuous batching, generate_batch (paged cache, its own CUDA graphs)
Only hf and static (and static-eager) return the sampled tokens' log-probs *and* draw group k's rows from a
generator of its own (seed, k): generate-batch returns log-probs under one seed for the whole batch; generate
neither (torch's global generator; log-probs only at the cost of every step's scores). They are the anchors the
project's engines have to beat, not candidates: the decision is between hf and static.

The costs a run pays: the first call of each engine (compiles, captures, allocator) is timed apart; a run calls
the static engine's sleep() after every rollout, so each of its timed calls follows a sleep() and captures its
graphs again (static_replay: the same without the sleep, graphs replayed); `--batch` smaller than the rows gives
a recipe's two chunk shapes (the full chunks, then the rest), each shape a cache and graphs of its own.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402

import common  # noqa: E402
import engines  # noqa: E402
from tests import references  # noqa: E402

# engine -> (returns the sampled tokens' log-probs, draws each group from its own seeded generator)
TRAITS = {
    "hf": (True, True),
    "static": (True, True),
    "static-eager": (True, True),
    "generate-static": (False, False),
    "generate-batch": (True, False),
}
OURS = ("hf", "static")  # the candidates for the default; the rest are anchors
SEED = 0


class GenerateStatic(references.ReferenceHFEngine):
    """transformers' generate with its static cache (cache_implementation="static"; on CUDA it compiles the decode
    step, once per batch shape), plain sampling as ReferenceHFEngine's, torch's global generator."""

    def sampling_config(self, max_new_tokens: int, temperature: float, top_p: float = 1.0):
        config = super().sampling_config(max_new_tokens, temperature, top_p)
        config.cache_implementation = "static"
        return config


class GenerateBatch(engines.HFEngine):
    """transformers' continuous batching (generate_batch): every row of the chunk a request (its prompt without the
    padding), its log-probs returned, one seed for the call (ContinuousBatchingConfig.seed)."""

    def _sample(self, input_ids, attention, n: int, max_new_tokens: int, temperature: float, generators=None, top_p=1.0):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention)]
        config = GenerationConfig(
            do_sample=True, temperature=temperature, top_k=0, top_p=top_p, max_new_tokens=max_new_tokens,
            eos_token_id=sorted(self.eos_ids) or None, pad_token_id=self.pad_id,
        )  # fmt: skip
        page = ContinuousBatchingConfig.page_size  # its cache sized to the chunk's work, as HFEngine's is (left to
        # itself it takes 0.9 of the free memory: 20 GB of host memory for this script's CPU dry run)
        blocks = sum(-(-(len(r) + max_new_tokens) // page) for r in rows) + 1
        cb = ContinuousBatchingConfig(
            return_logprobs=True, seed=SEED, num_blocks=blocks, max_batch_tokens=max(sum(map(len, rows)), page)
        )
        with torch.inference_mode(False):  # HFEngine.generate's mode: the manager's tensors would be inference
            # tensors, which its generation thread (outside the mode) may not update in place
            out = self.sampler.generate_batch(rows, generation_config=config, continuous_batching_config=cb)
        out = list(out.values())
        if len(out) != len(rows) or any(o.error for o in out):
            raise RuntimeError(
                f"generate_batch returned {len(out)} of {len(rows)} rows: {[o.error for o in out if o.error][:1]}"
            )
        longest = max(len(o.generated_tokens) for o in out)
        tokens = torch.full((len(rows), longest), self.pad_id, dtype=torch.long)
        logps = torch.zeros((len(rows), longest))
        for i, o in enumerate(out):
            tokens[i, : len(o.generated_tokens)] = torch.tensor(o.generated_tokens)
            logps[i, : len(o.logprobs)] = torch.tensor(o.logprobs)
        return tokens.to(input_ids.device), logps.to(input_ids.device)


def build(name: str, model, tokenizer, batch: int, dtype):
    """The engine `name` of TRAITS over `model` (a copy in `dtype` where it is not the model's), every row to the
    full length."""
    kw = dict(gen_batch_size=batch, return_logps=TRAITS[name][0], dtype=dtype)
    restore = references.full_length_rows()  # HFEngine's eos set emptied: every engine gets the same work
    try:
        if name in ("static", "static-eager"):
            return engines.StaticHFEngine(model, tokenizer, **kw, cuda_graphs=name == "static")
        return {"hf": engines.HFEngine, "generate-static": GenerateStatic, "generate-batch": GenerateBatch}[name](
            model, tokenizer, **kw
        )
    finally:
        restore()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(engine, prompts, n, tokens, device, sleep_first: bool):
    """(seconds, tokens generated) of one call as a run makes it: the static engine's sleep() before it (its graphs
    captured again) where `sleep_first`; torch's global generator seeded for the engines without seeds of their own."""
    if sleep_first:
        engine.sleep()
    torch.manual_seed(SEED)
    _sync(device)
    t0 = time.perf_counter()
    rollout = engine.generate(prompts, n, tokens, 1.0, seed=SEED, progress=False)
    _sync(device)
    return time.perf_counter() - t0, int(rollout.completion_lengths.sum())


def race(model, tokenizer, prompts, n: int, tokens: int, batch: int, names, rounds: int = 2) -> dict:
    """Tokens/s of each engine of `names` on the same work: a first call timed apart (first_s_<e>), then `rounds`
    alternated rounds (the median); static each time after a sleep(), and static_replay without one. An engine that
    fails gets error_<e> (its first line), the others go on. decision: the faster of hf and static, by how much."""
    device = next(model.parameters()).device
    dtype = torch.bfloat16 if device.type == "cuda" else None
    out, built, times = {"rows": len(prompts) * n, "batch": batch, "new_tokens": tokens}, {}, {}
    for name in names:
        try:
            built[name] = build(name, model, tokenizer, batch, dtype)
            out[f"first_s_{name}"] = round(_timed(built[name], prompts, n, tokens, device, False)[0], 2)
        except Exception as exc:  # noqa: BLE001 - an engine this transformers lacks or that fails: said, not fatal
            out[f"error_{name}"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
            built.pop(name, None)
    runs = [(name, name == "static") for name in built] + ([("static_replay", False)] if "static" in built else [])
    for _ in range(rounds):
        for label, sleep_first in runs:
            engine = built["static" if label == "static_replay" else label]
            seconds, generated = _timed(engine, prompts, n, tokens, device, sleep_first)
            times.setdefault(label, []).append(seconds)
            out[f"gen_tokens_{label}"] = generated
    for label, seconds in times.items():
        out[f"tokens_per_s_{label}"] = round(out[f"gen_tokens_{label}"] / statistics.median(seconds), 1)
    for engine in built.values():
        engine.sleep()
    ours = {e: out[f"tokens_per_s_{e}"] for e in OURS if f"tokens_per_s_{e}" in out}
    if len(ours) == 2:
        best = max(ours, key=ours.get)
        out["decision"] = f"{best} ({ours[best] / min(ours.values()):.2f}x the other)"
    out["peak_gb"] = round(common.peak_memory_gb(device), 2)
    return out


def sleep_memory(model, tokenizer, prompts, n: int, tokens: int, batch: int) -> dict:
    """The static engine's memory at sleep() and at a change of chunk shape, the cyclic garbage collector off (the
    CUDA allocator never runs it): after sleep() nothing of the cache is left (CUDA: the bytes allocated are back
    to what they were; CPU: no tensor of it alive), and two chunk shapes peak at one cache, not two (CUDA: the
    peak of a call of both shapes against a call of the larger alone)."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    engine = build("static", model, tokenizer, batch, torch.bfloat16 if cuda else None)
    whole = prompts[: max(1, batch // n)]  # one chunk of the full shape
    out = {}
    gc.collect()
    gc.disable()
    try:
        base = torch.cuda.memory_allocated(device) if cuda else 0
        for label, work in (("one_shape", whole), ("two_shapes", prompts)):
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            engine.generate(work, n, tokens, 1.0, seed=SEED, progress=False)
            cache = weakref.ref(engine.decode_state.cache.keys[0])
            if cuda:
                out[f"peak_mb_{label}"] = round((torch.cuda.max_memory_allocated(device) - base) / 2**20, 1)
            engine.sleep()
            out[f"cache_alive_after_sleep_{label}"] = cache() is not None
            if cuda:
                out[f"left_mb_after_sleep_{label}"] = round((torch.cuda.memory_allocated(device) - base) / 2**20, 1)
    finally:
        gc.enable()
    freed = not out["cache_alive_after_sleep_one_shape"] and not out["cache_alive_after_sleep_two_shapes"]
    if cuda:  # 1 MiB of slack: the allocator's rounding of small buffers
        freed = freed and out["left_mb_after_sleep_two_shapes"] <= 1.0
        out["one_cache_at_a_time"] = out["peak_mb_two_shapes"] <= 1.02 * out["peak_mb_one_shape"] + 1.0
    out["finite"] = freed and out.get("one_cache_at_a_time", True)
    return out


def sdpa_backend(model, tokenizer, prompts, n: int, tokens: int) -> dict:
    """The attention kernels the static loop's decode runs (eagerly, under the profiler): the op names with their
    counts (the decode step's are the most numerous: one a layer a token, the prefill's one a layer) and the
    backend that name says (flash, mem-efficient, cudnn, math)."""
    from torch.profiler import ProfilerActivity, profile

    device = next(model.parameters()).device
    engine = build("static-eager", model, tokenizer, 64, torch.bfloat16 if device.type == "cuda" else None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        engine.generate(prompts[:2], n, tokens, 1.0, seed=SEED, progress=False)
    engine.sleep()
    ops = {
        e.key: e.count
        for e in prof.key_averages()
        if e.key.startswith("aten::") and any(w in e.key for w in ("attention", "flash", "efficient", "cudnn"))
    }
    kernels = {k: c for k, c in ops.items() if k != "aten::scaled_dot_product_attention"}  # the dispatcher's own op
    top = max(kernels, key=kernels.get) if kernels else ""
    kinds = (("flash", "flash"), ("efficient", "mem-efficient"), ("cudnn", "cudnn"), ("math", "math"))
    backend = next((kind for word, kind in kinds if word in top), top or "none")
    return {"attention_ops": ops, "decode_backend": backend}


def graphs_match_eager(model, tokenizer, prompts, n: int, tokens: int, batch: int) -> dict:
    """The static engine with CUDA graphs against the same loop eagerly, one seed: the same tokens (the graphs replay
    the eager step's kernels); on the CPU both run eagerly."""
    device = next(model.parameters()).device
    dtype = torch.bfloat16 if device.type == "cuda" else None
    drawn = {}
    for name in ("static", "static-eager"):
        engine = build(name, model, tokenizer, batch, dtype)
        rollout = engine.generate(prompts, n, tokens, 1.0, seed=SEED, progress=False)
        drawn[name] = [rollout.completion(r) for r in range(len(rollout))]
        engine.sleep()
    pairs = [(a, b) for ra, rb in zip(drawn["static"], drawn["static-eager"]) for a, b in zip(ra, rb)]
    same = sum(a == b for a, b in pairs) / max(len(pairs), 1)
    return {"tokens_compared": len(pairs), "same_token_share": round(same, 4), "finite": same == 1.0}


def main() -> None:
    import gpu_step

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="qwen2.5-0.5b", choices=sorted(gpu_step.CONFIGS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=64, help="rows a chunk; less than prompts x n: two chunk shapes")
    p.add_argument("--engines", nargs="+", default=list(TRAITS), choices=list(TRAITS))
    a = p.parse_args()
    if a.device == "cpu":
        a.config, a.prompts, a.n, a.tokens, a.prompt_len, a.batch = "tiny", 3, 2, 8, 8, 4
    device = torch.device(a.device)
    model, tokenizer = gpu_step.build_model(a.config, "", device, torch.float32, False)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab - 2, (a.prompt_len,), generator=gen).tolist() for _ in range(a.prompts)]
    print(json.dumps(race(model, tokenizer, prompts, a.n, a.tokens, a.batch, a.engines), indent=1))


if __name__ == "__main__":
    main()
