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
