"""What issue 42 added for the GPU that runs on the CPU too: --compile (the same numbers as eager, and a compiler
that fails stops the run before training with its cause), the resolution of --engine-dtype auto and
--gen-batch-size 0. The static KV cache's loop is tested in tests/test_sampler.py, the GPU check's dry run in
tests/test_gpu_check.py; what only a GPU shows is bench/gpu_check.py's (docs/performance.md)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import engines
import grpo
import models
import run
import verifiers
from tests import tiny

pytestmark = pytest.mark.slow  # --compile and the GPU path on the CPU: left out of the quick tier, pytest -m "not slow"


def _rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_compile_trains_as_eager_does(toy, tmp_path):
    """grpo.py --compile against the same run without it: the layers and the LM head's chunk compiled by inductor
    (here its CPU backend) give the same losses, gradient norms and rewards, within float rounding."""
    settings = dict(total_steps=1, eval_limit=1, eval_samples=1, eval_k=[1])
    grpo.main(grpo.Args(**tiny.run_settings(toy, tmp_path, "eager", **settings)))
    grpo.main(grpo.Args(**tiny.run_settings(toy, tmp_path, "compiled", compile=True, **settings)))
    eager, compiled = ([r for r in _rows(tmp_path / n) if "losses/policy_loss" in r] for n in ("eager", "compiled"))
    assert len(eager) == len(compiled) == 2
    for a, b in zip(eager, compiled):
        for key in ("losses/policy_loss", "losses/grad_norm", "losses/entropy", "rollout/reward_mean"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_gen_batch_size_zero_is_sized_per_engine_and_left_zero_in_args(toy, tmp_path):
    """make_engine sizes --gen-batch-size 0 for its own model's device (64 on the CPU, the free memory on a GPU) and
    leaves args at 0: an async producer on another GPU gets the args and sizes its batch from its own device's
    memory, not from the trainer's (the old code wrote the trainer's rows into args, and the producer took them)."""
    args = grpo.Args(**tiny.run_settings(toy, tmp_path, "zero"))
    model = models.load_model(toy["model"], torch.device("cpu"))
    engine = models.make_engine(args, model, models.load_tokenizer(toy["model"]), toy["model"], 64)
    assert engine.gen_batch_size == models.GEN_BATCH_CPU and args.gen_batch_size == 0


def test_a_compiler_that_fails_stops_the_run_before_training_with_its_cause(toy, tmp_path, monkeypatch, capsys):
    def broken(graph_module, example_inputs):
        raise RuntimeError("no working C++ compiler on this machine")

    monkeypatch.setattr(models, "COMPILE_BACKEND", broken)
    with pytest.raises(verifiers.UserError) as error:
        grpo.main(grpo.Args(**tiny.run_settings(toy, tmp_path, "broken", compile=True)))
    assert str(error.value) == (
        "--compile: torch.compile failed on this model and device (RuntimeError: no working C++ compiler on this "
        "machine); run without --compile"
    )
    assert not os.path.exists(tmp_path / "broken" / "metrics.jsonl")  # stopped before the run's first row


def test_engine_dtype_auto_and_gen_batch_size_zero_on_the_cpu(toy, tmp_path):
    """--engine-dtype auto is a bf16 copy (StaticHFEngine) only on a GPU in one process: on the CPU the HF engine
    generates from the trainer's own model; --gen-batch-size 0 resolves to 64 here (args.json records it)."""
    args = grpo.Args(**tiny.run_settings(toy, tmp_path, "auto"))
    assert args.engine_dtype == "auto" and args.gen_batch_size == 0
    _, device = run.setup(args)
    assert args.gen_batch_size == 64
    model = models.load_model(toy["model"], device)
    tok = models.load_tokenizer(toy["model"])
    for engine_dtype, bf16_copy in (("auto", False), ("bf16", True), ("trainer", False)):
        args.engine_dtype = engine_dtype
        engine = models.make_engine(args, model, tok, toy["model"], 64)
        assert type(engine) is engines.HFEngine and (engine.sampler is not model) == bf16_copy
        assert engine.return_logps == bf16_copy  # the copy's log-probs measure its rounding; the trainer's: none asked
        assert next(engine.sampler.parameters()).dtype == (torch.bfloat16 if bf16_copy else torch.float32)
