"""What each phase of a run holds in GPU and host memory, computed from a model's config and the flags.

    python bench/memory_plan.py                          # 0.5B, 1.5B, 7B on 1 and 8 GPUs of 80 GB: the table
    python bench/memory_plan.py --config path/to/config.json --gpus 8 --gradient-checkpointing --micro-batch-tokens 8192
    python bench/memory_plan.py --recipe recipes/grpo_simplerl_qwen2.5-1.5b.yaml   # the GPUs its default needs
    python bench/memory_plan.py --engine hf --gpus 1 --beta 1e-4 --teacher qwen2.5-7b   # with a reference, a teacher

Per GPU, GiB (2^30 bytes). P parameters, W processes (FSDP2 shards the trainer's state over them), T tokens of one
micro-batch, L layers, H hidden, I intermediate, d head dim, Hq / Hkv heads, V vocabulary:
- trainer, always: fp32 master weights 4P/W and AdamW's two fp32 moments 8P/W;
- trainer, in an update: fp32 gradients 4P/W (freed after each optimizer step); autocast's cache of bf16 copies of
  the weights one forward uses, 2P (the whole model: the cast copy of an FSDP2 layer outlives its reshard until the
  forward's autocast region ends); activations kept for backward, T * L * (32H + 8I + 2 Hq d + 4 Hkv d) bytes, or
  with --gradient-checkpointing T * L * 8H plus one layer's full set (the per-token sum is what
  torch.autograd.graph.saved_tensors_hooks sees under bf16 autocast: tests/test_memory_plan.py); the LM head's
  chunk, --logp-chunk-tokens * V * 4 bytes three times (fp32 logits, their log-softmax, the gradient);
- vLLM, awake: --gpu-memory-utilization of the GPU (its bf16 weights 2P, CUDA graphs, activations, the KV cache in
  what is left: 2 * L * Hkv * d * 2 bytes a token); asleep: level 2 frees it all, level 1 too (the weights to pinned
  host memory);
- every other model the run holds, in every phase: --beta's frozen reference in the compute dtype (2P/W; a LoRA
  run's reference is its own base: nothing more), OPD's teacher in the compute dtype (2P_T/W), the HF engine's bf16
  copy of the weights (2P) where a run makes one (--engine-dtype auto on one GPU in one process, or bf16);
- the HF engine: --gen-batch-size rows (0, the default: the rows a default run picks, models.gen_batch_from_memory
  of the GPU's memory less all of the above), each its KV cache over the context (bf16) and the sampler's
  temporaries over the vocabulary (models.engine_row_bytes); the context is the longest of training's and every eval
  set's (its protocol's budget): one cache at a time (the engine's sleep() gives it back before another);
- host, per node: every rank loads the fp32 model on the host before moving it to its GPU (4P each, while loading),
  vLLM level-1 sleep keeps 2P pinned per rank, rank 0 assembles the fp32 state dict at each checkpoint (4P).
Measured on an H200 (docs/performance.md): 0.5B, no checkpointing, 16,000-token micro-batches, --logp-chunk-tokens
4096: 44.5 GB peak allocated (this estimate 43.3 GB); 1.5B with checkpointing: 38.9 GB (estimate 42.8 GB).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import models  # noqa: E402 - the engine's bytes a row and its batch rule: what a run computes

GIB = 2**30
# the fields of config.json the estimate reads, for the models the recipes train (their config.json files)
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}  # fmt: skip
# the fields of the same config.json files (the -Instruct models the recipes name) a model needs beside its shape:
# the same for the three sizes
QWEN25_REST = dict(max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6)


def dims(cfg: dict) -> tuple[int, int, int, int, int, int, int]:
    H, FF, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hq = cfg["num_attention_heads"]
    hkv = cfg.get("num_key_value_heads") or hq
    d = cfg.get("head_dim") or H // hq
    return H, FF, L, hq, hkv, d, cfg["vocab_size"]


def param_count(cfg: dict) -> int:
    """Parameters of a Qwen2/Llama-style decoder: q/k/v with biases (Qwen2; `attention_bias` false: none), o, a
    gated MLP, two norms a layer, the final norm, the embedding, the LM head unless tied."""
    H, FF, L, hq, hkv, d, V = dims(cfg)
    bias = cfg.get("attention_bias", True)
    attn = H * hq * d + 2 * H * hkv * d + hq * d * H + (hq * d + 2 * hkv * d if bias else 0)
    layer = attn + 3 * H * FF + 2 * H
    return V * H + L * layer + H + (0 if cfg.get("tie_word_embeddings", False) else V * H)


def activation_bytes_per_token_layer(cfg: dict, gradient_checkpointing: bool = False) -> int:
    """Bytes autograd keeps for backward per token and decoder layer under bf16 autocast (fp32 weights and residual
    stream, bf16 matmul outputs); with checkpointing, what a checkpointed layer keeps (its fp32 input and the
    rotary tables)."""
    H, FF, L, hq, hkv, d, V = dims(cfg)
    if gradient_checkpointing:
        return 8 * H
    return 32 * H + 8 * FF + 2 * hq * d + 4 * hkv * d


def kv_bytes_per_token(cfg: dict, dtype_bytes: int = 2) -> int:
    H, FF, L, hq, hkv, d, V = dims(cfg)
    return 2 * L * hkv * d * dtype_bytes


def plan(
    cfg: dict,
    *,
    gpus: int = 1,
    gpu_gb: float = 80.0,
    micro_batch_tokens: int = 16384,
    logp_chunk_tokens: int = 256,
    gradient_checkpointing: bool = False,
    engine: str = "vllm",
    gpu_memory_utilization: float = 0.35,
    vllm_sleep_level: int = 2,
    max_model_len: int = 4096,
    gen_batch_size: int = 0,
    engine_dtype: str = "auto",
    reference: bool = False,
    teacher: dict | None = None,
) -> dict:
    """{phase: {item: bytes}} per GPU (and "host" per node) for the flags. `reference`: --beta > 0 on a full
    fine-tuning run (its frozen reference); `teacher`: OPD's teacher's config (its shape's fields)."""
    P = param_count(cfg)
    H, FF, L, hq, hkv, d, V = dims(cfg)
    W = gpus
    state = {"fp32 weights (4P/W)": 4 * P / W, "AdamW moments (8P/W)": 8 * P / W}
    if reference:  # models.reference_model: the initial model, frozen, in the compute dtype (FSDP2-sharded)
        state["--beta reference, bf16 (2P/W)"] = 2 * P / W
    if teacher is not None:  # opd.load_teacher: models.load_frozen, the same
        state["OPD teacher, bf16 (2P_T/W)"] = 2 * param_count(teacher) / W
    copy = 2 * P if engine != "vllm" and (engine_dtype == "bf16" or (engine_dtype == "auto" and W == 1)) else 0
    if copy:  # make_engine's copy of the weights for generation: held from the start to the end of the run
        state["HF engine bf16 copy (2P)"] = copy
    per_layer = activation_bytes_per_token_layer(cfg, False)
    if gradient_checkpointing:
        acts = micro_batch_tokens * (L * activation_bytes_per_token_layer(cfg, True) + per_layer)
    else:
        acts = micro_batch_tokens * L * per_layer
    update = {
        **state,
        "fp32 gradients (4P/W)": 4 * P / W,
        "autocast bf16 weight copies (2P)": 2 * P,
        "activations": acts,
        "LM head chunk": 3 * logp_chunk_tokens * V * 4,
    }
    if W > 1:  # FSDP2: a layer all-gathered for compute and the next one prefetched, fp32
        update["FSDP2 gathered layers"] = 2 * 4 * (P - V * H) / L
    out = {"update": update}
    if engine == "vllm":
        budget = gpu_memory_utilization * gpu_gb * 1e9
        kv = budget - 2 * P - 0.1 * budget  # ~10 % of it: activations, CUDA graphs, workspaces (a rough share)
        out["rollout (vLLM awake)"] = {
            **state,
            "vLLM: weights bf16 (2P)": 2 * P,
            "vLLM: KV cache and the rest": budget - 2 * P,
        }
        out["update"]["vLLM asleep"] = 0
        out["kv_tokens"] = max(kv, 0) / kv_bytes_per_token(cfg)
    else:
        row = models.engine_row_bytes(cfg, max_model_len, 2)
        rows = gen_batch_size or models.gen_batch_from_memory(gpu_gb * 1e9 - sum(state.values()), row)
        kv = rows * models.engine_row_bytes({**cfg, "vocab_size": 0}, max_model_len, 2)  # the row's KV part
        out["rollout (HF engine)"] = {**state, "HF engine KV cache": kv, "HF engine sampler temporaries": rows * row - kv}
        out["gen_batch_size"] = rows
    host = {"load: fp32 model per rank (4P x ranks, transient)": 4 * P * W, "checkpoint: rank 0's fp32 state dict": 4 * P}
    if engine == "vllm" and vllm_sleep_level == 1:
        host["vLLM level-1 sleep: pinned bf16 weights (2P x ranks)"] = 2 * P * W
    out["host (per node)"] = host
    out["params"] = P
    return out


def totals(p: dict) -> dict[str, float]:
    return {phase: sum(items.values()) for phase, items in p.items() if isinstance(items, dict)}


# ----- a recipe's default on GPUs of one size without vLLM (the HF engine): what its header states

PROMPT_TOKENS = 512  # a recipe's prompt in the planned context (its longest may be more: the batch then shrinks)


def recipe_flags(path: str) -> dict:
    """The recipe's model shape and the flags the plan reads, as its script parses them (run.load_config; a flag it
    leaves out at the script's default; --micro-batch-tokens 0: 16384 on a GPU, run.resolve_micro_batch_tokens):
    the context is the longest budget of training (--max-new-tokens) and of its eval sets (each set's protocol,
    evaluation.protocols) plus PROMPT_TOKENS; --beta > 0 holds a reference, opd.py a teacher. KeyError for a model
    of no known shape."""
    import importlib

    import evaluation
    import run

    script = importlib.import_module(os.path.basename(path).split("_")[0])
    args = script.Args(**run.load_config(path, script.Args))

    def shape(model: str) -> str:
        return f"qwen2.5-{next(s for s in ('0.5b', '1.5b', '7b') if f'-{s}' in model.lower())}"

    budgets = [args.max_new_tokens, *(p.max_new_tokens for p in evaluation.protocols(args).values())]
    teacher = getattr(args, "teacher", "")
    return dict(
        shape=shape(args.model),
        lora=args.lora_rank > 0,
        micro_batch_tokens=args.micro_batch_tokens or 16384,
        logp_chunk_tokens=args.logp_chunk_tokens,
        gradient_checkpointing=args.gradient_checkpointing,
        gen_batch_size=args.gen_batch_size,
        engine_dtype=args.engine_dtype,
        max_model_len=max(budgets) + PROMPT_TOKENS,
        reference=args.beta > 0,
        teacher=SHAPES[shape(teacher)] if teacher else None,
    )


def recipe_fit(path: str, gpu_gb: float = 80.0, most_gpus: int = 8) -> dict:
    """The fewest GPUs of `gpu_gb` (1, 2, 4, 8) on which the recipe's default fits without vLLM (the trainer's update
    and the HF engine's rollout each within the GPU's bytes), with that plan's peaks: {"gpus", "update_gib",
    "rollout_gib", "rows"}; gpus None where none fits. A LoRA recipe is not planned here (docs/lora.md): None."""
    flags = recipe_flags(path)
    if flags.pop("lora"):
        return None
    cfg = SHAPES[flags.pop("shape")]
    gpus = 1
    while gpus <= most_gpus:
        p = plan(cfg, gpus=gpus, gpu_gb=gpu_gb, engine="hf", **flags)
        t = totals(p)
        if max(t["update"], t["rollout (HF engine)"]) <= gpu_gb * 1e9:
            break
        gpus *= 2
    fits = gpus <= most_gpus
    return {
        "gpus": gpus if fits else None,
        "update_gib": round(t["update"] / GIB, 1),
        "rollout_gib": round(t["rollout (HF engine)"] / GIB, 1),
        "rows": p["gen_batch_size"],
    }


def recipe_memory_line(path: str, gpu_gb: float = 80.0) -> str:
    """The header line a recipe carries (tests/test_recipes.py checks it against recipe_fit)."""
    fit = recipe_fit(path, gpu_gb)
    where = f"bench/memory_plan.py --recipe {os.path.relpath(path, os.path.dirname(os.path.dirname(path)))}"
    plan_line = f"update {fit['update_gib']} GiB, rollout {fit['rollout_gib']} GiB at {fit['rows']} rows a chunk"
    if fit["gpus"] == 1:
        return f"# Memory: fits one {gpu_gb:g} GB GPU without vLLM ({where}): {plan_line}."
    return f"# Memory: needs {fit['gpus']} GPUs of {gpu_gb:g} GB without vLLM (torchrun, FSDP2; {where}): per GPU {plan_line}."


def table(configs: dict, gpus_list=(1, 8), **flags) -> str:
    lines = [
        "| model | GPUs | update (trainer) | rollout | host peak (node) | KV tokens (vLLM) or rows generated (HF) |",
        "|---|---|---|---|---|---|",
    ]
    for name, cfg in configs.items():
        for gpus in gpus_list:
            p = plan(cfg, gpus=gpus, **flags)
            t = totals(p)
            rollout = next(v for k, v in t.items() if k.startswith("rollout"))
            kv = f"{p['kv_tokens'] / 1e3:.0f}k" if "kv_tokens" in p else f"{p['gen_batch_size']} rows (HF)"
            lines.append(
                f"| {name} ({p['params'] / 1e9:.2f} B) | {gpus} | {t['update'] / GIB:.1f} GiB | {rollout / GIB:.1f} GiB | "
                f"{t['host (per node)'] / GIB:.0f} GiB | {kv} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="", help="a model's config.json (default: the Qwen2.5 0.5B / 1.5B / 7B shapes)")
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--gpu-gb", type=float, default=80.0)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--logp-chunk-tokens", type=int, default=256)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    ap.add_argument("--vllm-sleep-level", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gen-batch-size", type=int, default=0, help="0: what a default run picks from the memory")
    ap.add_argument("--engine-dtype", choices=["auto", "bf16", "trainer"], default="auto")
    ap.add_argument("--beta", type=float, default=0.0, help="> 0: the run holds --beta's frozen reference")
    ap.add_argument("--teacher", default="", choices=["", *SHAPES], help="opd.py: its teacher's shape")
    ap.add_argument("--json", action="store_true", help="print every item of every phase as JSON")
    ap.add_argument("--recipe", default="", help="a recipe: the GPUs its default needs without vLLM (its header line)")
    a = ap.parse_args()
    if a.recipe:
        fit = recipe_fit(a.recipe, a.gpu_gb)
        print(recipe_memory_line(a.recipe, a.gpu_gb) if fit else f"{a.recipe}: a LoRA recipe (docs/lora.md, its header)")
        return
    configs = SHAPES
    if a.config:
        with open(a.config) as f:
            configs = {a.config: json.load(f)}
    flags = dict(
        gpu_gb=a.gpu_gb,
        micro_batch_tokens=a.micro_batch_tokens,
        logp_chunk_tokens=a.logp_chunk_tokens,
        gradient_checkpointing=a.gradient_checkpointing,
        engine=a.engine,
        gpu_memory_utilization=a.gpu_memory_utilization,
        vllm_sleep_level=a.vllm_sleep_level,
        max_model_len=a.max_model_len,
        gen_batch_size=a.gen_batch_size,
        engine_dtype=a.engine_dtype,
        reference=a.beta > 0,
        teacher=SHAPES[a.teacher] if a.teacher else None,
    )
    if a.json:
        out = {f"{n}/{g}": plan(c, gpus=g, **flags) for n, c in configs.items() for g in a.gpus}
        print(json.dumps(out, indent=1, default=lambda v: v if not isinstance(v, float) else math.floor(v)))
        return
    print(table(configs, tuple(a.gpus), **flags))


if __name__ == "__main__":
    main()
