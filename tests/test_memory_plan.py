"""bench/memory_plan.py against the models themselves: its parameter count against the modules transformers builds
from each config, its activation bytes against what autograd really keeps for backward under bf16 autocast
(saved_tensors_hooks on the CPU), its trainer state against outputs.checkpoint_bytes. A GPU run checks the whole
estimate against torch.cuda.max_memory_allocated (bench/gpu_check.py; docs/performance.md)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import models
import outputs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import memory_plan  # noqa: E402


@pytest.mark.parametrize("name", sorted(memory_plan.SHAPES))
def test_parameter_count_is_that_of_the_module_transformers_builds(name):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = memory_plan.SHAPES[name]
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**cfg))
    assert memory_plan.param_count(cfg) == sum(p.numel() for p in model.parameters())  # a tied head counted once


def saved_bytes_per_token_layer(cfg: dict, tokens: int, checkpointing: bool) -> float:
    """What autograd keeps for backward through the decoder under bf16 autocast, per token and layer: every saved
    tensor once (by storage), weights and their cast copies left out."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg, attn_implementation="sdpa")).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape[::-1]) for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights and tuple(t.shape) not in weight_shapes:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, cfg["vocab_size"], (2, tokens // 2))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model.model(input_ids=ids, use_cache=False)
    return sum(saved.values()) / tokens / cfg["num_hidden_layers"]


SMALL = [
    dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    dict(hidden_size=192, intermediate_size=1344, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1),
]


@pytest.mark.parametrize("shape", SMALL, ids=["h256", "h192-gqa3"])
def test_activation_bytes_are_what_autograd_keeps(shape):
    cfg = {**shape, "vocab_size": 500, "max_position_embeddings": 2048}
    full = saved_bytes_per_token_layer(cfg, 512, checkpointing=False)
    assert full == pytest.approx(memory_plan.activation_bytes_per_token_layer(cfg), rel=0.05)
    kept = saved_bytes_per_token_layer(cfg, 512, checkpointing=True)
    assert kept == pytest.approx(memory_plan.activation_bytes_per_token_layer(cfg, gradient_checkpointing=True), rel=0.1)


def test_the_trainer_state_is_what_a_checkpoint_holds(toy):
    model = models.load_model(toy["model"], torch.device("cpu"))
    cfg = model.config.to_dict()
    cfg["attention_bias"] = False  # Llama: no q/k/v biases
    p = memory_plan.plan(cfg, gpus=1)
    assert p["params"] == sum(x.numel() for x in model.parameters())
    state = p["update"]["fp32 weights (4P/W)"] + p["update"]["AdamW moments (8P/W)"]
    assert state == outputs.checkpoint_bytes(model) and p["update"]["fp32 weights (4P/W)"] == outputs.model_bytes(model)
    eight = memory_plan.plan(cfg, gpus=8)
    assert eight["update"]["AdamW moments (8P/W)"] == p["update"]["AdamW moments (8P/W)"] / 8  # sharded by FSDP2
    assert eight["host (per node)"]["load: fp32 model per rank (4P x ranks, transient)"] == 8 * outputs.model_bytes(model)


# ----- the HF engine's batch (issue 50): what a default run generates together, and what the plan says of it


def test_the_engines_row_bytes_are_its_static_caches():
    """models.engine_row_bytes' KV part is what StaticHFEngine's cache holds for one row at the context (rounded up
    to 256 keys), in bf16; its sampler part is dtype + 20 bytes a vocabulary entry."""
    from transformers import Qwen2Config

    import engines

    config = Qwen2Config(**memory_plan.SHAPES["qwen2.5-1.5b"])
    cache = engines.StaticKV.allocate(config, 3, engines._cache_length(4100), torch.bfloat16, torch.device("meta"))
    per_row = sum(t.numel() * t.element_size() for t in (*cache.keys, *cache.values)) / 3
    assert models.engine_row_bytes(config, 4100, 2) == per_row + 22 * config.vocab_size
    assert per_row == 4352 * memory_plan.kv_bytes_per_token(memory_plan.SHAPES["qwen2.5-1.5b"])
    assert models.gen_batch_from_memory(10e9, 10**8) == 80 and models.gen_batch_from_memory(-1.0, 10**8) == 1
    assert models.gen_batch_from_memory(1e15, 10**8) == models.GEN_BATCH_MAX


def test_a_default_hf_run_on_one_gpu_is_planned_as_it_runs():
    """bench/memory_plan.py plans a default run: on one GPU the bf16 copy make_engine makes (--engine-dtype auto)
    and the batch --gen-batch-size 0 picks from the memory left; under FSDP2 no copy. The SimpleRL 1.5B rollout
    (8,192 new tokens) fits an 80 GB GPU then (84 GB planned at 256 rows before issue 50)."""
    cfg = memory_plan.SHAPES["qwen2.5-1.5b"]
    one = memory_plan.plan(cfg, gpus=1, engine="hf", max_model_len=8704)
    rollout = one["rollout (HF engine)"]
    assert rollout["HF engine bf16 copy (2P)"] == 2 * one["params"]
    left = 80e9 - rollout["fp32 weights (4P/W)"] - rollout["AdamW moments (8P/W)"] - 2 * one["params"]
    assert one["gen_batch_size"] == models.gen_batch_from_memory(left, models.engine_row_bytes(cfg, 8704, 2)) == 184
    assert sum(rollout.values()) < 80e9
    eight = memory_plan.plan(cfg, gpus=8, engine="hf", max_model_len=8704)
    assert "HF engine bf16 copy (2P)" not in eight["rollout (HF engine)"]
    fixed = memory_plan.plan(cfg, gpus=1, engine="hf", max_model_len=8704, gen_batch_size=256)
    assert fixed["gen_batch_size"] == 256 and sum(fixed["rollout (HF engine)"].values()) > 80e9  # what 256 rows needed


def test_the_gen_batch_on_a_gpu_comes_from_its_free_memory(toy, monkeypatch):
    """--gen-batch-size 0 on a GPU (models.gen_batch_for_device, the CUDA queries stubbed here): the free memory, the
    allocator's cached blocks added, less AdamW's moments and the engine's copy, at engine_row_bytes a row; one line."""
    model = models.load_model(toy["model"], torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2_000_000_000, 80_000_000_000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 300_000_000)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 100_000_000)
    lines = []
    monkeypatch.setattr(models.common.CONSOLE, "info", lines.append)
    rows = models.gen_batch_for_device(model, 1000, torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    free = 2_000_000_000 + 200_000_000 - 8 * n - 2 * n  # AdamW's two fp32 moments, the bf16 copy
    assert rows == models.gen_batch_from_memory(free, models.engine_row_bytes(model.config, 1000, 2))
    assert len(lines) == 1 and lines[0].startswith(f"--gen-batch-size 0: {rows} rows generated together")


def test_the_gpu_check_fits_its_speed_steps_to_the_device():
    """bench/gpu_check.py's speed steps against the device's memory and the plan: an H200 (143.8 GB) runs them as
    published, an H100 of 80 GB (85.0 GB) runs step-1.5b with micro-batches of 8,192 tokens (92.6 GB planned at
    16,384), a 48 GB card skips it."""
    import types

    import gpu_check
    import gpu_step

    a = types.SimpleNamespace(**gpu_check.SPEED_DEFAULTS)
    cfg = dict(gpu_step.CONFIGS["qwen2.5-1.5b"], attention_bias=True)
    assert gpu_check.planned_bytes(cfg, a) == pytest.approx(92.6e9, rel=1e-3)
    same, line = gpu_check.fit_to_memory("step-1.5b", cfg, a, 143_771_287_552)
    assert same is a and line.endswith("runs as planned")
    smaller, line = gpu_check.fit_to_memory("step-1.5b", cfg, a, 85_029_158_912)
    assert smaller.micro_batch_tokens == 8192 and a.micro_batch_tokens == 16384 and "--micro-batch-tokens 8192" in line
    skipped = "step-1.5b: planned 92.6 GB, over 0.9 of the device's 48.0 GB at any micro-batch: skipped"
    assert gpu_check.fit_to_memory("step-1.5b", cfg, a, 48_000_000_000) == (None, skipped)


def test_the_plan_counts_every_model_a_run_holds_in_every_phase():
    """Issue 61: --beta's frozen reference (2P/W in the compute dtype), OPD's teacher (2P_T/W) and the HF engine's
    bf16 copy (2P, one process) are held from the start to the end of a run: in the update as in the rollout, and
    the rows the HF engine generates together come from what they leave (1.0 GB at 0.5B, 3.1 GB at 1.5B)."""
    cfg, teacher = memory_plan.SHAPES["qwen2.5-1.5b"], memory_plan.SHAPES["qwen2.5-7b"]
    P, PT = memory_plan.param_count(cfg), memory_plan.param_count(teacher)
    bare = memory_plan.plan(cfg, gpus=1, engine="hf", max_model_len=8704)
    held = memory_plan.plan(cfg, gpus=1, engine="hf", max_model_len=8704, reference=True, teacher=teacher)
    for phase in ("update", "rollout (HF engine)"):
        assert held[phase]["--beta reference, bf16 (2P/W)"] == 2 * P
        assert held[phase]["OPD teacher, bf16 (2P_T/W)"] == 2 * PT
        assert held[phase]["HF engine bf16 copy (2P)"] == 2 * P
    assert round(2 * memory_plan.param_count(memory_plan.SHAPES["qwen2.5-0.5b"]) / 1e9, 1) == 1.0
    assert round(2 * P / 1e9, 1) == 3.1
    left = 80e9 - 12 * P - 2 * P - 2 * P - 2 * PT
    assert held["gen_batch_size"] == models.gen_batch_from_memory(left, models.engine_row_bytes(cfg, 8704, 2))
    assert held["gen_batch_size"] < bare["gen_batch_size"]
    eight = memory_plan.plan(cfg, gpus=8, engine="hf", reference=True, teacher=teacher)
    assert eight["update"]["--beta reference, bf16 (2P/W)"] == 2 * P / 8  # FSDP2-sharded like the policy
    assert "HF engine bf16 copy (2P)" not in eight["update"]
    vllm = memory_plan.plan(cfg, gpus=1, reference=True)
    assert "HF engine bf16 copy (2P)" not in vllm["update"] and vllm["update"]["--beta reference, bf16 (2P/W)"] == 2 * P


def test_a_recipes_plan_reads_its_reference_and_its_eval_budgets():
    """recipe_flags parses the recipe as its script does: SimpleRL's --beta holds a reference; DAPO's AIME budget
    (20,480 new tokens) is the context the HF engine's rows are sized for, not training's 8,192."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    simplerl = memory_plan.recipe_flags(os.path.join(root, "recipes", "grpo_simplerl_qwen2.5-1.5b.yaml"))
    assert simplerl["reference"] and simplerl["teacher"] is None and simplerl["max_model_len"] == 8192 + 512
    dapo = memory_plan.recipe_flags(os.path.join(root, "recipes", "grpo_dapo_qwen2.5-math-7b.yaml"))
    assert dapo["max_model_len"] == 20480 + memory_plan.PROMPT_TOKENS and not dapo["reference"]
