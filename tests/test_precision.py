"""Precision, training mode and sampling config of the policy (issue 14, items 1-3; docs/precision.md).

1. fp32 master weights + bf16 compute: a lr-1e-6 AdamW update that bf16 weights round away is kept.
2. --gradient-checkpointing: the trainable model is in training mode, so decoder layers are checkpointed.
3. HFEngine samples from softmax(logits / T), whatever the model's generation_config says."""

import pytest
import torch

import common
import engines
import models
import run
from tests import tiny as tiny_mod

PROMPTS = [[2, 10, 11, 12, 13], [2, 14, 15]]
COMPLETIONS = [[20, 21, 22, 23, 24, 25, 1], [26, 27, 28, 29, 30, 31, 32]]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return tiny_mod.make_tiny_model(str(tmp_path_factory.mktemp("tiny_precision")))


def _loss(model, tb):
    logp, _ = common.completion_logps(model, tb, 1.0, chunk_tokens=4)
    adv = torch.tensor([1.0, -1.0]).unsqueeze(1)
    return -(adv * logp * tb.completion_mask).sum() / tb.completion_mask.sum()


def _train(model, steps: int, lr: float) -> None:
    tb = common.pad_batch(PROMPTS, COMPLETIONS, pad_id=0)
    optimizer, scheduler = models.make_optimizer(model, run.Args(learning_rate=lr, weight_decay=0.0, warmup_updates=1))
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        _loss(model, tb).backward()
        optimizer.step()
        scheduler.step()


def _changed(before: dict, after: dict) -> tuple[float, float]:
    """Fraction of weights that changed and mean |dw| in fp32, over the decoder's linear weights."""
    n = changed = 0
    total = 0.0
    for name, p in after.items():
        if name.endswith("proj.weight"):
            dw = p.detach().float() - before[name].float()
            n += dw.numel()
            changed += int((dw != 0).sum())
            total += dw.abs().sum().item()
    return changed / n, total / n


def test_model_dtypes_per_device():
    cuda, cpu, bf16, fp32 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16, torch.float32
    assert models.model_dtypes(cuda) == (fp32, bf16)  # policy: fp32 master weights, bf16 compute
    assert models.model_dtypes(cuda, trainable=False) == (bf16, bf16)  # frozen reference: bf16 weights
    assert models.model_dtypes(cpu) == (fp32, None) == models.model_dtypes(cpu, trainable=False)  # CPU unchanged
    assert models.model_dtypes(cpu, compute_dtype=bf16) == (fp32, bf16)


def test_load_model_dtypes_and_autocast(tiny_path):
    cpu = torch.device("cpu")
    default = models.load_model(tiny_path, cpu)
    assert common.model_traits(default).autocast_dtype is None and all(p.dtype == torch.float32 for p in default.parameters())
    mixed = models.load_model(tiny_path, cpu, compute_dtype=torch.bfloat16)  # what CUDA gets by default
    assert common.model_traits(mixed).autocast_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in mixed.parameters())
    ref = models.load_model(tiny_path, cpu, trainable=False, compute_dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in ref.parameters()) and not ref.training
    # completion_logps runs the decoder's linear layers in bf16 under autocast; the log-probs come out fp32
    seen = []
    hook = mixed.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    tb = common.pad_batch(PROMPTS, COMPLETIONS, pad_id=0)
    logp_mixed, _ = common.completion_logps(mixed, tb, 1.0)
    logp_fp32, _ = common.completion_logps(default, tb, 1.0)
    hook.remove()
    assert seen == [torch.bfloat16] and logp_mixed.dtype == torch.float32
    diff = (logp_mixed - logp_fp32).abs().max().item()
    assert 0 < diff < 0.05  # bf16 rounding, nothing more
    # the HF engine generates under the same autocast
    tok = models.load_tokenizer(tiny_path)
    hook = mixed.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    engines.HFEngine(mixed, tok).generate(PROMPTS, 1, 3, 1.0, progress=False)
    hook.remove()
    assert set(seen[1:]) == {torch.bfloat16} and len(seen) > 1


def test_lr_1e6_update_lost_by_bf16_weights_kept_by_fp32_master(tiny_path):
    """10 AdamW steps at lr 1e-6 with the same loss: bf16 weights (the old CUDA path) keep almost none of the
    update; fp32 master weights with bf16 compute (the new CUDA path, here with CPU bf16 autocast) keep all of it,
    as much as pure fp32 does."""
    cpu = torch.device("cpu")
    steps, lr = 10, 1e-6
    old = models.load_model(tiny_path, cpu).to(torch.bfloat16)  # what load_model gave on CUDA before
    init = {k: v.detach().clone() for k, v in old.named_parameters()}  # Llama init: std 0.02, a trained size
    assert 0.015 < init["model.layers.0.mlp.up_proj.weight"].float().std().item() < 0.025
    new = models.load_model(tiny_path, cpu, compute_dtype=torch.bfloat16)
    ref = models.load_model(tiny_path, cpu)
    for m in (new, ref):
        m.load_state_dict({k: v.float() for k, v in init.items()}, strict=False)
    with pytest.warns(UserWarning, match="AdamW on torch.bfloat16 parameters"):
        _train(old, steps, lr)
    _train(new, steps, lr)
    _train(ref, steps, lr)
    old_frac, old_dw = _changed(init, dict(old.named_parameters()))
    new_frac, new_dw = _changed(init, dict(new.named_parameters()))
    ref_frac, ref_dw = _changed(init, dict(ref.named_parameters()))
    # Adam moves a weight by about lr per step (|m_hat / sqrt(v_hat)| <= 1, = 1 at step 1): ~1e-5 after 10 steps.
    # A bf16 weight of size 0.02 has a spacing of 2^-13 = 1.2e-4: a 1e-6 step is far below half of it.
    assert ref_frac > 0.99 and 3e-6 < ref_dw < 1e-5
    assert old_frac < 0.05 and old_dw < 0.1 * ref_dw  # the old path loses the update
    assert new_frac > 0.99 and new_dw == pytest.approx(ref_dw, rel=0.1)  # the new path keeps it
    # what a bf16 rollout engine receives (the master cast to bf16) moves more than the bf16 weights did
    pushed_frac, _ = _changed(init, {k: v.detach().to(torch.bfloat16) for k, v in new.named_parameters()})
    assert pushed_frac > 2 * old_frac


def _count_checkpoint_calls(monkeypatch):
    """Count calls of the function transformers' decoder layers checkpoint through (modeling_utils binds
    torch.utils.checkpoint.checkpoint into gradient_checkpointing_enable's partial at enable time)."""
    import transformers.modeling_utils as mu

    calls = []
    real = mu.checkpoint

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(mu, "checkpoint", counting)
    return calls


@pytest.mark.parametrize("flag", [False, True])
def test_gradient_checkpointing_recomputes_decoder_layers(tiny_path, monkeypatch, flag):
    calls = _count_checkpoint_calls(monkeypatch)
    model = models.load_model(tiny_path, torch.device("cpu"), gradient_checkpointing=flag)
    assert model.training  # from_pretrained's eval mode would silently disable checkpointing
    layers = model.model.layers
    forwards = []
    hooks = [layer.register_forward_pre_hook(lambda m, i: forwards.append(1)) for layer in layers]
    tb = common.pad_batch(PROMPTS, COMPLETIONS, pad_id=0)
    loss = _loss(model, tb)
    assert len(calls) == (len(layers) if flag else 0)
    loss.backward()
    for h in hooks:
        h.remove()
    # checkpointed layers run their forward once more in backward (a pre-hook: the recompute stops early)
    assert len(forwards) == (2 if flag else 1) * len(layers)
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    # same gradients as without checkpointing (dropout is 0 in the tiny config, so training mode changes nothing)
    plain = models.load_model(tiny_path, torch.device("cpu"))
    plain.eval()
    _loss(plain, tb).backward()
    for k, p in plain.named_parameters():
        assert torch.allclose(grads[k], p.grad, atol=1e-6), k


def test_training_mode_and_dropout_note(tiny_path, tmp_path, capsys):
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tiny_path).attention_dropout == 0.0
    models.load_model(tiny_path, torch.device("cpu"))
    assert "dropout" not in capsys.readouterr().out
    path = tiny_mod.make_tiny_model(str(tmp_path / "dropout"))
    config = AutoConfig.from_pretrained(path)
    config.attention_dropout = 0.1
    config.save_pretrained(path)
    model = models.load_model(path, torch.device("cpu"))
    assert model.training and "trains with dropout" in capsys.readouterr().out
    frozen = models.load_model(path, torch.device("cpu"), trainable=False)
    assert not frozen.training


def test_gradient_checkpointing_help_text_is_readable():
    import importlib

    from transformers import HfArgumentParser

    for script in ("grpo", "gapo", "mugrpo", "codapo"):
        args_cls = importlib.import_module(script).Args
        text = "".join(HfArgumentParser(args_cls).format_help().split())
        assert "option_strings" not in text, script  # a bare % in a help string garbles argparse's output
        for f in args_cls.__dataclass_fields__.values():
            assert "".join(f.metadata["help"].split()) in text, (script, f.name)


GENERATION_CONFIGS = {
    "repetition_penalty": dict(repetition_penalty=1.5),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=1),
    "min_p": dict(do_sample=True, min_p=0.5),  # neutral value None: no generate() kwarg can undo it
    "suppress_tokens": dict(suppress_tokens=[20, 21, 22, 23, 24, 25]),
    "sampling_defaults": dict(do_sample=True, temperature=0.3, top_k=5, top_p=0.5, min_new_tokens=4),
}


@pytest.mark.parametrize("name", sorted(GENERATION_CONFIGS))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_engine_ignores_the_models_generation_config(tmp_path, name, temperature):
    """A model whose generation_config sets a repetition penalty (Qwen-Instruct) or another logits processor:
    the engine's log-probs of the sampled tokens still equal the trainer's at the same temperature."""
    from transformers import GenerationConfig

    path = tiny_mod.make_tiny_model(str(tmp_path / name), seed=3)
    tok = models.load_tokenizer(path)
    GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **GENERATION_CONFIGS[name]).save_pretrained(
        path
    )
    model = models.load_model(path, torch.device("cpu"))
    assert getattr(model.generation_config, next(iter(GENERATION_CONFIGS[name]))) is not None
    saved = model.generation_config.to_dict()
    engine = engines.HFEngine(model, tok, gen_batch_size=16, return_logps=True)
    prompts = [common.format_prompt(tok, "What is 1 + 2?"), common.format_prompt(tok, "Hi")]
    torch.manual_seed(0)
    ro = engine.generate(prompts, n=8, max_new_tokens=12, temperature=temperature, progress=False)
    assert model.generation_config.to_dict() == saved  # restored after the call
    trainer = common.no_grad_logps(model, ro, range(len(ro)), tok.pad_token_id, temperature, token_budget=512)
    for r, eng in enumerate(tiny_mod.engine_logps(ro)):
        assert torch.allclose(trainer[r, : len(eng)], torch.tensor(eng), atol=1e-4), (name, r)


def test_the_lm_heads_weight_is_cast_once_per_micro_batch(tiny_path):
    """Under autocast (bf16 here on the CPU, as on CUDA) completion_logps casts the LM head's fp32 weight to the
    compute dtype once per micro-batch, not once per chunk and again in each chunk's recompute in backward (issue
    50: 7.5 GB of traffic a chunk at 1.5B); the log-probs and gradients are those of one chunk."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = models.load_model(tiny_path, torch.device("cpu"), compute_dtype=torch.bfloat16)
    head = model.get_output_embeddings().weight
    tb = common.pad_batch(PROMPTS, COMPLETIONS, pad_id=0)

    class HeadCasts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ == "_to_copy" and tuple(args[0].shape) == tuple(head.shape):
                self.count += out.dtype == torch.bfloat16
            return out

    def per_chunk_autocast(model, batch, temperature, chunk_tokens, with_entropy):  # the code before issue 50
        body, mask = model.model, batch.completion_mask.bool()
        with common.autocast_context(model):
            position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
            inputs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids)
            hidden = body(**inputs, use_cache=False).last_hidden_state
        T = batch.completion_ids.shape[1]
        flat, targets, lps = hidden[:, -T - 1 : -1, :][mask], batch.completion_ids[mask], []
        for start in range(0, flat.shape[0], chunk_tokens):
            with common.autocast_context(model):
                lp, _ = torch.utils.checkpoint.checkpoint(
                    common.chunk_logp_entropy, flat[start : start + chunk_tokens], head, None,
                    targets[start : start + chunk_tokens], temperature, None, use_reentrant=False,
                )  # fmt: skip
            lps.append(lp)
        return torch.zeros(mask.shape).masked_scatter(mask, torch.cat(lps)), None

    results = []
    for logps_of in (common.completion_logps, per_chunk_autocast):
        model.zero_grad(set_to_none=True)
        with HeadCasts() as casts:
            logp, _ = logps_of(model, tb, 1.0, 4, True)  # 4 chunks
            (logp * tb.completion_mask).sum().backward()
        results.append((casts.count, logp.detach(), head.grad.clone()))
    (ours, logp, grad), (before, logp_before, grad_before) = results
    assert ours == 1 and before == 8  # before: once per chunk forward, once per chunk recompute
    assert torch.equal(logp, logp_before) and torch.allclose(grad, grad_before, rtol=0, atol=1e-7)
