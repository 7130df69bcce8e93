"""Each prompt computed once per group: the trainer's packed groups ([prompt | c_1 | ... | c_G], a block mask,
positions restarting after the prompt) give the log-probs and gradients of the per-row path, for every loss
aggregation and each method's loss, with uneven lengths, EOS inside, groups split over micro-batches, gradient
checkpointing, eager attention and a Qwen2 model. The HF engine's sampling loop (prompts prefilled once, ended rows
out of the batch) against the exact distribution and transformers' generate: tests/test_sampler.py."""

import os
import tempfile

import pytest
import torch

import codapo
import common
import gapo
import grpo
import models
import mugrpo
import run
from tests import references, tiny

G, T_MAX = 4, 7


@pytest.fixture(scope="module")
def tiny_path():
    return tiny.make_tiny_model(tempfile.mkdtemp(prefix="shared_prefix_"))


def _qwen_path():
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = tiny.make_tokenizer()
    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    path = tempfile.mkdtemp(prefix="qwen_tiny_")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def rollout_of(vocab: int, eos: int, seed: int = 0) -> common.RolloutBatch:
    """3 groups of G rows: prompts of 9-12 tokens, completions of 1-T_MAX tokens, some ending in EOS."""
    gen = torch.Generator().manual_seed(seed)
    batch = common.RolloutBatch()
    for g in range(3):
        prompt = torch.randint(3, vocab, (9 + g,), generator=gen).tolist()
        for j in range(G):
            n = [1, T_MAX, 3, 5][(g + j) % G]
            c = torch.randint(3, vocab, (n,), generator=gen).tolist()
            if j % 2:
                c[-1] = eos  # the completion stopped at EOS
            batch.append_row(prompt, c, "", "stop" if j % 2 else "length")
    return batch


def logps_and_grads(model, rollout, micros, pad_id, loss_fn=None):
    """Per-token log-probs (B, T) and the parameter gradient of loss_fn (default: a weighted sum of log-probs)."""
    model.zero_grad(set_to_none=True)
    B, T = len(rollout), int(rollout.completion_lengths.max())
    out = torch.zeros(B, T)
    for micro in micros:
        tb = common.token_batch_of(rollout, micro, pad_id)
        lp, _ = common.completion_logps(model, tb, 1.0)
        if loss_fn is None:
            loss = (lp * torch.arange(1, lp.shape[1] + 1) * tb.completion_mask).sum()
        else:
            loss = loss_fn(lp, micro, tb.completion_mask)
        loss.backward()
        for j, r in enumerate(micro):
            out[r, : lp.shape[1]] = lp[j].detach()
    return out, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def assert_same(a, b):
    (lp_a, g_a), (lp_b, g_b) = a, b
    assert (lp_a - lp_b).abs().max() < 1e-4
    assert ((g_a - g_b).abs().max() / g_b.abs().max()) < 1e-4


def test_packed_groups_match_rows(tiny_path):
    tok = tiny.make_tokenizer()
    model = models.load_model(tiny_path, torch.device("cpu"))
    ro = rollout_of(len(tok), tok.eos_token_id)
    rows = list(range(len(ro)))
    packed = common.micro_batches(ro, rows, 1024, model)
    assert all(m.packs for m in packed) and sum(len(p) for m in packed for p in m.packs) == len(ro)
    plain = common.micro_batches(ro, rows, 1024)  # no model: padded rows, as before packing existed
    assert all(m.packs is None for m in plain)
    tb = common.token_batch_of(ro, packed[0], tok.pad_token_id)
    tokens_packed, tokens_rows = tb.input_ids.numel(), common.token_batch_of(ro, plain[0], tok.pad_token_id).input_ids.numel()
    assert tokens_packed < tokens_rows  # each prompt once
    assert_same(logps_and_grads(model, ro, packed, tok.pad_token_id), logps_and_grads(model, ro, plain, tok.pad_token_id))


def test_groups_split_over_micro_batches_and_sub_packs(tiny_path):
    tok = tiny.make_tokenizer()
    model = models.load_model(tiny_path, torch.device("cpu"))
    ro = rollout_of(len(tok), tok.eos_token_id, seed=1)
    rows = list(range(len(ro)))
    small = common.micro_batches(ro, rows, 24, model)  # a group's pack does not fit: sub-packs, several micro-batches
    assert len(small) > 1 and any(m.packs and len(m.packs[0]) < G for m in small)
    for m in small:  # the budget counts the tokens computed: packs x longest pack
        if m.packs:
            assert common.token_batch_of(ro, m, tok.pad_token_id).input_ids.numel() <= 24 or len(m.packs) == 1
    split = [half for m in common.micro_batches(ro, rows, 1024, model) for half in run._split_micro_batch(m)]
    one_pack = common.MicroBatch.of_packs([list(range(G))])
    assert [list(h) for h in run._split_micro_batch(one_pack)] == [[0, 1], [2, 3]]  # sub-packs repeat the prompt
    reference = logps_and_grads(model, ro, common.micro_batches(ro, rows, 1024), tok.pad_token_id)
    assert_same(logps_and_grads(model, ro, small, tok.pad_token_id), reference)
    assert_same(logps_and_grads(model, ro, split, tok.pad_token_id), reference)


def test_packing_with_gradient_checkpointing_eager_and_qwen2(tiny_path):
    tok = tiny.make_tokenizer()
    for path, ckpt, impl in ((tiny_path, True, "sdpa"), (tiny_path, False, "eager"), (_qwen_path(), False, "sdpa")):
        model = models.load_model(path, torch.device("cpu"), gradient_checkpointing=ckpt)
        model.config._attn_implementation = impl  # eager adds the mask to the scores: it must be a float mask
        ro = rollout_of(len(tok), tok.eos_token_id, seed=2)
        rows = list(range(len(ro)))
        packed = common.micro_batches(ro, rows, 1024, model)
        assert packed[0].packs, (path, impl)
        assert_same(
            logps_and_grads(model, ro, packed, tok.pad_token_id),
            logps_and_grads(model, ro, common.micro_batches(ro, rows, 1024), tok.pad_token_id),
        )


def _losses(rollout):
    """Each method's loss of a micro-batch, times its accumulation weight (the share of the mini-batch of every row),
    so that the sum over any split into micro-batches is the same mini-batch loss."""
    B = len(rollout)
    adv = torch.linspace(-1.0, 1.5, B)
    offset = torch.linspace(-0.4, 0.4, B * T_MAX).view(B, T_MAX)  # old = logp - offset: ratios reach the clips
    total = float(rollout.completion_lengths.sum())

    def wrap(fn, agg):
        def loss(lp, micro, mask):
            old = (lp - offset[micro, : lp.shape[1]]).detach()
            return fn(lp, old, adv[micro], mask) * common.accumulation_weight(
                "token" if agg == "token-mean" else "sequence", mask, total, len(micro), B
            )

        return loss

    out = {
        f"grpo/{agg}": wrap(
            lambda lp, old, a, m, agg=agg: grpo.compute_policy_loss(
                lp, old, a, m, eps_low=0.2, eps_high=0.28, loss_agg=agg, max_tokens=T_MAX
            )[0],
            agg,
        )
        for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    }
    out["gapo/sequence"] = wrap(
        lambda lp, old, a, m: gapo.compute_policy_loss(lp, old, a, m, eps_low=0.02, eps_high=0.05, level="sequence")[0],
        "seq-mean-token-mean",
    )
    out["mugrpo/veto"] = wrap(
        lambda lp, old, a, m: mugrpo.compute_policy_loss(lp, old, a, m, keep=mugrpo.veto_mask(lp.detach(), old, a, m, -0.3))[
            0
        ],
        "token-mean",
    )
    out["codapo/dual-clip"] = wrap(
        lambda lp, old, a, m: codapo.compute_policy_loss(lp, old, a, m, dual_clip_c=1.2)[0], "token-mean"
    )
    return out


LOSSES = [
    "grpo/token-mean",
    "grpo/seq-mean-token-mean",
    "grpo/seq-mean-token-sum-norm",
    "gapo/sequence",
    "mugrpo/veto",
    "codapo/dual-clip",
]


@pytest.mark.parametrize("name", LOSSES)
def test_each_methods_loss_has_the_rows_gradient(tiny_path, name):
    tok = tiny.make_tokenizer()
    model = models.load_model(tiny_path, torch.device("cpu"))
    ro = rollout_of(len(tok), tok.eos_token_id, seed=3)
    rows, loss = list(range(len(ro))), _losses(ro)[name]
    assert_same(
        logps_and_grads(model, ro, common.micro_batches(ro, rows, 48, model), tok.pad_token_id, loss),
        logps_and_grads(model, ro, common.micro_batches(ro, rows, 48), tok.pad_token_id, loss),
    )


def test_batch_logps_packs_too(tiny_path):
    tok = tiny.make_tokenizer()
    model = models.load_model(tiny_path, torch.device("cpu"))
    ro = rollout_of(len(tok), tok.eos_token_id, seed=4)
    rows = list(range(len(ro)))
    packed = common.no_grad_logps(model, ro, rows, tok.pad_token_id, 1.0, 1024)
    lp, _ = logps_and_grads(model, ro, common.micro_batches(ro, rows, 1024), tok.pad_token_id)
    assert (packed - lp).abs().max() < 1e-4


class _Shapes:
    """A model stand-in with SmolLM2-135M's shapes (attention_break_even reads only the config)."""

    class config:
        _attn_implementation, hidden_size, num_attention_heads, num_key_value_heads = "sdpa", 576, 9, 3
        intermediate_size, head_dim, layer_types = 1536, 64, None


@pytest.mark.parametrize("T,packs", [(20, True), (64, True), (256, False), (1024, False)])
def test_rule_packs_short_completions_only(T, packs):
    """P = 50, G = 8 on SmolLM2's shapes: a dense pack of 8 x 256 tokens costs more than its rows (attention over
    the whole pack); the rule keeps those rows padded."""
    assert common.attention_break_even(_Shapes()) == pytest.approx(3072.0)
    ro = references.rollout_from_rows([[7] * 50] * 8, [[5] * T] * 8)
    micros = common.micro_batches(ro, range(8), 16384, _Shapes())
    assert bool(micros[0].packs) == packs


def test_the_gpu_checks_packed_step_has_a_shape_the_rule_packs():
    """bench/gpu_check.py's packed-0.5b step times packed against padded rows: at its shape (Qwen2.5-0.5B, 64 rows in
    groups of 8, its token budget) the cost rule packs every group, so the step times two different paths. The
    shape it had before issue 50 (a 128-token prompt, 512 completion tokens) packs nothing: attention over a pack of
    8 x 512 tokens costs more than the 7 prompts it saves."""
    import sys
    import types

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import gpu_check
    import memory_plan

    qwen = types.SimpleNamespace(
        config=types.SimpleNamespace(**memory_plan.SHAPES["qwen2.5-0.5b"], _attn_implementation="sdpa")
    )
    assert common.attention_break_even(qwen) == pytest.approx(8320.0)  # a / b of the rule for Qwen2.5-0.5B
    rows, budget = gpu_check.SPEED_DEFAULTS["train_rows"], gpu_check.SPEED_DEFAULTS["micro_batch_tokens"]

    def packed_groups(group_size, prompt_len, completion_len):
        prompts = [[3 + g] * prompt_len for g in range(rows // group_size)]
        ro = references.rollout_from_rows([prompts[r // group_size] for r in range(rows)], [[5] * completion_len] * rows)
        micros = common.micro_batches(ro, range(rows), budget, qwen)
        return [len(pack) for m in micros for pack in (m.packs or [])]

    assert packed_groups(**gpu_check.PACKED_SHAPE) == [8] * (rows // 8)  # every group one pack of its 8 rows
    assert packed_groups(group_size=8, prompt_len=128, completion_len=512) == []
