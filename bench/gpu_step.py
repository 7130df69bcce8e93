"""Tokens/s, peak GPU memory and MFU of grpo.py's training step for a 0.5B-1.5B model.

The device machine has no network and the working tree travels with at most 64 MiB, so no real checkpoint can
reach it. The model is therefore built from its published config (Qwen2.5-0.5B / -1.5B, written out below) with
random bf16 weights. Time and memory of a forward/backward do not depend on the weight values, and the random
model almost never samples its EOS, so every completion has the full length (the script counts them anyway).
`--model PATH` uses a real local checkpoint instead.

What runs is the code path of every method script:
- generation: `engines.HFEngine` (its sampling loop over the model's forward, batched, KV cache);
- training: `common.micro_batches` + `common.completion_logps` (chunked, checkpointed LM head) +
  `grpo.compute_policy_loss` (token-mean, clip 0.2) + backward;
- the optimizer: `models.make_optimizer` (fused AdamW) + grad clipping.

MFU = model FLOPs of the forward+backward / (time x peak bf16 dense FLOP/s of the device). Model FLOPs per
training token: 6 x (parameters of all linear layers of the decoder) + 6 x n_layers x d_attn x L
(causal attention: the QK^T and AV products over the L-token row, halved for the causal mask, x3 for the
backward), plus 6 x vocab x hidden per *completion* token for the LM head (only completion positions go
through it). Recomputation (the checkpointed LM head, --gradient-checkpointing) is not counted, as in the
PaLM definition of MFU.

    python bench/gpu_step.py                                  # both configs, defaults below (about 4 minutes on an H200)
    python bench/gpu_step.py --configs tiny --device cpu      # a few seconds: checks the script itself
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import memory_plan  # noqa: E402 - bench/memory_plan.py
import torch  # noqa: E402

import common  # noqa: E402
import engines  # noqa: E402
import grpo  # noqa: E402
import models  # noqa: E402
import run  # noqa: E402
from tests import references  # noqa: E402

CONFIGS = {  # published configs (config.json of the hub repos): memory_plan's shape fields, and the rest a model needs
    "qwen2.5-0.5b": dict(memory_plan.SHAPES["qwen2.5-0.5b"], **memory_plan.QWEN25_REST),
    "qwen2.5-1.5b": dict(memory_plan.SHAPES["qwen2.5-1.5b"], **memory_plan.QWEN25_REST),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
    ),
}

SUMMARY_KEYS = (
    "config",
    "params_M",
    "gen_tokens_per_s_static",
    "gen_tokens_per_s_hf",
    "gen_tokens_per_s_generate",
    "gen_speedup_static_vs_generate",
    "train_tokens_per_s",
    "padded_train_tokens_per_s",
    "achieved_tflops",
    "mfu",
    "train_peak_gb",
    "train_peak_gb_planned",
)

# bf16 dense peak TFLOP/s (vendor data sheets, no sparsity), by the card's exact torch.cuda.get_device_name(): a
# part would match another card (an "NVIDIA L40" holds "L4"); a card not listed has no MFU (None), never a guess.
# The PCIe and NVL forms of the H100 and H200 run at lower clocks and power than the SXM form.
PEAK_TFLOPS = {
    "NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H100": 989.4, "NVIDIA H100 PCIe": 756.5, "NVIDIA H100 NVL": 835.5,
    "NVIDIA H200": 989.4, "NVIDIA H200 NVL": 835.5,
    "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A100-SXM4-40GB": 312.0, "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0, "NVIDIA L40S": 362.05, "NVIDIA L40": 181.05, "NVIDIA L4": 121.0,
    "NVIDIA A10G": 70.0,
}  # fmt: skip


def peak_tflops(device_name: str) -> float | None:
    """The bf16 dense peak of the card named exactly `device_name` (torch.cuda.get_device_name()); None: not known."""
    return PEAK_TFLOPS.get(device_name.strip())


class RandomIdTokenizer:
    """What HFEngine needs from a tokenizer, for a model without one: ids in, a placeholder text out."""

    def __init__(self, vocab_size: int):
        self.eos_token_id = vocab_size - 1
        self.pad_token_id = vocab_size - 2

    def decode(self, ids, skip_special_tokens=True) -> str:
        return f"<{len(ids)} tokens>"


def build_model(name: str, model_path: str, device: torch.device, dtype: torch.dtype, grad_ckpt: bool):
    from transformers import AutoModelForCausalLM, Qwen2Config

    if model_path:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
        tokenizer = models.load_tokenizer(model_path)
    else:
        config = Qwen2Config(**CONFIGS[name], use_cache=False)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        tokenizer = RandomIdTokenizer(config.vocab_size)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.to(device)
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, tokenizer


def linear_params(model) -> tuple[int, int]:
    """(parameters of the decoder's linear layers, parameters of the LM head)."""
    head = model.get_output_embeddings()
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    return body, head.weight.numel()


def train_flops(model, prompt_len: int, completion_len: int, rows: int) -> float:
    cfg = model.config
    body, head = linear_params(model)
    L = prompt_len + completion_len
    d_attn = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    per_token = 6 * body + 6 * cfg.num_hidden_layers * d_attn * L
    return rows * (L * per_token + completion_len * 6 * head)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def generation_figures(model, tokenizer, prompts, n: int, tokens: int, engines_: list[str], batch: int) -> dict:
    """Tokens/s of each engine on the same work (every row runs to `tokens`: no EOS ends a row early): `static`
    (StaticHFEngine: static KV cache, CUDA graphs), `hf` (HFEngine's dynamic cache), `generate` (transformers'
    generate, ReferenceHFEngine), all from a bf16 copy of the fp32 weights on CUDA (what make_engine makes there;
    bench/gpu_engines.py races more engines, with a run's costs),
    the trainer's fp32 weights elsewhere. A warm-up call of each first (kernels, graphs, allocator); then two
    alternating rounds, the median reported."""
    device = next(model.parameters()).device
    dtype = torch.bfloat16 if device.type == "cuda" else None
    make = {"static": engines.StaticHFEngine, "hf": engines.HFEngine, "generate": references.ReferenceHFEngine}
    restore = references.full_length_rows()  # no row ends at an EOS: the same tokens for every engine
    try:
        built = {e: make[e](model, tokenizer, gen_batch_size=batch, dtype=dtype) for e in engines_}
    finally:
        restore()
    times = {e: [] for e in engines_}
    out = {}
    for engine in built.values():  # warm-up: the full shape once (graph capture, compilation, allocator)
        engine.generate(prompts, n, tokens, 1.0, progress=False)
    for _ in range(2):
        for e, engine in built.items():
            sync(device)
            t0 = time.perf_counter()
            rollout = engine.generate(prompts, n, tokens, 1.0, progress=False)
            sync(device)
            times[e].append(time.perf_counter() - t0)
            out[f"gen_tokens_{e}"] = int(rollout.completion_lengths.sum())
    for e in engines_:
        out[f"gen_tokens_per_s_{e}"] = round(out[f"gen_tokens_{e}"] / statistics.median(times[e]), 1)
    if "generate" in engines_:
        for e in engines_:
            if e != "generate":
                out[f"gen_speedup_{e}_vs_generate"] = round(out[f"gen_tokens_per_s_{e}"] / out["gen_tokens_per_s_generate"], 2)
    out["gen_peak_gb"] = round(common.peak_memory_gb(device), 2)
    return out


def training_figures(model, tokenizer, a, peak_tflops: float | None, packed: bool) -> dict:
    """One training step's forward/backward and optimizer time, tokens/s, MFU and peak memory: `a.train_rows` rows
    of prompt + completion tokens; with `a.group_size` > 1 the rows come in groups sharing one prompt (as a GRPO
    batch does) and `packed` lets micro_batches pack them (its cost rule decides), else every row is padded."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(2)
    rows, G = a.train_rows, max(1, a.group_size)
    prompts = [torch.randint(0, vocab - 2, (a.prompt_len,), generator=gen).tolist() for _ in range(-(-rows // G))]
    prompt_ids = [prompts[r // G] for r in range(rows)]  # G consecutive rows share a prompt
    # --ragged: completions of unequal length, uniform in [completion_len / 4, completion_len], as a rollout's are
    # (padded rows, masks); else every row completion_len tokens (the headline shape: no padding)
    lengths = [a.completion_len] * rows
    if getattr(a, "ragged", False):
        low = max(1, a.completion_len // 4)
        lengths = torch.randint(low, a.completion_len + 1, (rows,), generator=gen).tolist()
    completion_ids = [torch.randint(0, vocab - 2, (n,), generator=gen).tolist() for n in lengths]
    batch = references.rollout_from_rows(prompt_ids, completion_ids)
    advantages = torch.randn(rows, generator=gen)
    optimizer, _ = models.make_optimizer(model, run.Args(learning_rate=1e-6, weight_decay=0.0, warmup_updates=1))
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    fwd_bwd, opt_s = [], []
    for rep in range(a.repeats + 1):  # the first pass warms up (and compiles, with --compile) and is not counted
        sync(device)
        t0 = time.perf_counter()
        micro = common.micro_batches(batch, list(range(rows)), a.micro_batch_tokens, model if packed else None)
        for mb in micro:
            tb = common.token_batch_of(batch, mb, tokenizer.pad_token_id)
            logp, _ = common.completion_logps(model, tb, 1.0, a.logp_chunk_tokens, with_entropy=False)
            mask = tb.completion_mask.to(logp.device)
            loss, _ = grpo.compute_policy_loss(logp, logp.detach(), advantages[mb].to(logp.device), mask)
            (loss * len(mb) / rows).backward()
        sync(device)
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        t2 = time.perf_counter()
        if rep:
            fwd_bwd.append(t1 - t0)
            opt_s.append(t2 - t1)
    t_fb = statistics.median(fwd_bwd)
    flops = sum(train_flops(model, a.prompt_len, n, 1) for n in lengths)  # the rows' tokens: padding is not counted
    train_tokens = rows * a.prompt_len + sum(lengths)
    out = dict(
        train_rows=rows,
        group_size=G,
        packed_groups=sum(len(m.packs or []) for m in micro),
        micro_batches=len(micro),
        row_tokens=a.prompt_len + max(lengths),
        ragged=bool(getattr(a, "ragged", False)),
        logp_chunk_tokens=a.logp_chunk_tokens,
        fwd_bwd_s=round(t_fb, 3),
        fwd_bwd_s_min=round(min(fwd_bwd), 3),
        fwd_bwd_s_max=round(max(fwd_bwd), 3),
        optimizer_s=round(statistics.median(opt_s), 3),
        train_tokens_per_s=round(train_tokens / t_fb, 1),
        step_tokens_per_s=round(train_tokens / (t_fb + statistics.median(opt_s)), 1),
        model_tflop_per_step=round(flops / 1e12, 2),
        achieved_tflops=round(flops / t_fb / 1e12, 1),
        train_peak_gb=round(common.peak_memory_gb(device), 2),
    )
    out["mfu"] = round(flops / t_fb / (peak_tflops * 1e12), 4) if peak_tflops else None
    if not a.model:  # bench/memory_plan.py's estimate of the same update (docs/performance.md, "GPU memory")
        cfg = dict(CONFIGS[a.config_name], attention_bias=True)
        plan = memory_plan.plan(
            cfg,
            micro_batch_tokens=min(a.micro_batch_tokens, train_tokens),
            logp_chunk_tokens=a.logp_chunk_tokens,
            gradient_checkpointing=a.gradient_checkpointing,
        )
        out["train_peak_gb_planned"] = round(sum(plan["update"].values()) / 1e9, 2)
    del optimizer
    return out


def run_config(name: str, a, device: torch.device, peak_tflops: float | None) -> dict:
    # the method scripts' precision (models.model_dtypes): fp32 master weights, bf16 autocast compute on CUDA
    dtype, autocast_dtype = models.model_dtypes(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model, tokenizer = build_model(name, a.model, device, dtype, a.gradient_checkpointing)
    models.set_model_traits(model, autocast_dtype=autocast_dtype)  # read by common.autocast_context
    a.config_name = name
    out = {
        "config": name if not a.model else a.model,
        "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "dtype": f"{dtype} weights, {autocast_dtype or 'no'} autocast",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "gradient_checkpointing": a.gradient_checkpointing,
        "compile": a.compile,
    }
    vocab = model.config.vocab_size
    if a.engines:
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, vocab - 2, (a.prompt_len,), generator=gen).tolist() for _ in range(a.gen_prompts)]
        out |= generation_figures(model, tokenizer, prompts, a.num_generations, a.gen_tokens, a.engines, a.gen_batch_size)
    if a.compile:
        models.compile_model(model)
    if a.train_rows:
        for packed in (False, True) if a.compare_packing else (True,):
            figures = training_figures(model, tokenizer, a, peak_tflops, packed)
            out |= figures if packed else {f"padded_{k}": v for k, v in figures.items()}
    del model
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"], choices=sorted(CONFIGS))
    p.add_argument("--model", default="", help="a local checkpoint folder instead of a random-weight config")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gen-prompts", type=int, default=16)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--gen-tokens", type=int, default=256)
    p.add_argument("--gen-batch-size", type=int, default=128)
    p.add_argument(
        "--engines",
        nargs="*",
        default=["static", "hf", "generate"],
        choices=["static", "hf", "generate"],
        help="generation engines to time on the same work (none: no generation)",
    )
    p.add_argument("--train-rows", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=512)
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--logp-chunk-tokens", type=int, default=4096)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--compile", action="store_true", help="models.compile_model: what --compile does in the scripts")
    p.add_argument("--group-size", type=int, default=1, help="training rows sharing one prompt (8: a GRPO group)")
    p.add_argument("--compare-packing", action="store_true", help="time the step padded too (padded_* keys)")
    p.add_argument(
        "--ragged", action="store_true", help="completions of unequal length (1/4 to all of --completion-len): masks"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=None, help="device bf16 dense peak; detected for known GPUs")
    p.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for gpu_step.json (default $OUT)")
    a = p.parse_args()

    device = torch.device(a.device)
    peak = a.peak_tflops
    if peak is None and device.type == "cuda":
        gpu = torch.cuda.get_device_name()
        peak = peak_tflops(gpu)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M')} torch {torch.__version__}, device "
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, peak bf16 {peak} TFLOP/s",
        flush=True,
    )
    results = []
    for name in [a.model] if a.model else a.configs:
        r = run_config(name, a, device, peak)
        results.append(r)
        print(json.dumps(r), flush=True)
    keys = [k for k in results[0] if k in SUMMARY_KEYS] if results else []
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in results:
        print("| " + " | ".join(str(r.get(k)) for k in keys) + " |")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gpu_step.json"), "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
