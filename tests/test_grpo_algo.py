"""grpo.py's ALGO LOGIC against numbers computed by hand, and the shared log-prob / batching plumbing."""

import math

import pytest
import torch

import common
import engines
import grpo
import models
import run
import verifiers
from tests import references
from tests import tiny as tiny_mod


def test_advantages_group_scale_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = grpo.compute_advantages(rewards, group_size=4, scale="group")
    # group 1: mean 0.25, centred (0.75, -0.25, -0.25, -0.25), unbiased std sqrt(0.75/3) = 0.5
    expected = torch.tensor([0.75 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, 0, 0, 0, 0])
    assert torch.allclose(adv, expected, atol=1e-6)
    assert torch.equal(adv[4:], torch.zeros(4))  # all-equal group: exactly zero


def test_advantages_no_scale_is_dr_grpo():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.0, 1.0, 0.5])
    adv = grpo.compute_advantages(rewards, group_size=4, scale="none")
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, -0.5, 0.5, 0.0]))


def _loss_case():
    # B=2, T=2; old_logp = 0 so ratio = exp(logp)
    logp = torch.log(torch.tensor([[1.5, 0.5], [1.1, 0.7]])).requires_grad_(True)
    old = torch.zeros(2, 2)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    return logp, old, adv, mask


def test_policy_loss_token_mean_by_hand():
    logp, old, adv, mask = _loss_case()
    loss, stats = grpo.compute_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2, loss_agg="token-mean")
    # row 0 (A=1): r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped); r=0.5 -> max(-0.5, -0.8) = -0.5
    # row 1 (A=-1): r=1.1 -> 1.1; second token masked. token-mean: (-1.2 - 0.5 + 1.1) / 3 = -0.2
    assert loss.item() == pytest.approx(-0.2, abs=1e-6)
    assert stats["clipfrac"] == pytest.approx(1 / 3)
    assert stats["clipfrac_high"] == pytest.approx(1 / 3) and stats["clipfrac_low"] == 0.0
    kl = ((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5)) + (0.1 - math.log(1.1))) / 3
    assert stats["approx_kl"] == pytest.approx(kl, rel=1e-5)
    loss.backward()
    # d/dlogp of -A*r is -A*r; zero where the clip is active and on padding
    expected_grad = torch.tensor([[0.0, -0.5 / 3], [1.1 / 3, 0.0]])
    assert torch.allclose(logp.grad, expected_grad, atol=1e-6)


def test_policy_loss_other_aggregations_by_hand():
    logp, old, adv, mask = _loss_case()
    loss, _ = grpo.compute_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2, loss_agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(((-1.2 - 0.5) / 2 + 1.1) / 2, abs=1e-6)  # 0.125
    loss, _ = grpo.compute_policy_loss(
        logp, old, adv, mask, eps_low=0.2, eps_high=0.2, loss_agg="seq-mean-token-sum-norm", max_tokens=4
    )
    assert loss.item() == pytest.approx(-0.6 / (2 * 4), abs=1e-6)


def test_policy_loss_low_clip_gradient_zero_exactly_where_active():
    logp = torch.log(torch.tensor([[0.7, 0.9, 1.3]])).requires_grad_(True)
    adv = torch.tensor([-2.0])
    loss, stats = grpo.compute_policy_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), eps_low=0.2, eps_high=0.2)
    # A<0: r=0.7 < 0.8 -> max(1.4, 1.6) = 1.6 clipped (grad 0); r=0.9 -> 1.8; r=1.3 -> max(2.6, 2.4) = 2.6
    assert loss.item() == pytest.approx((1.6 + 1.8 + 2.6) / 3, abs=1e-6)
    assert stats["clipfrac_low"] == pytest.approx(1 / 3)
    loss.backward()
    assert logp.grad[0, 0] == 0.0
    assert logp.grad[0, 1] == pytest.approx(2 * 0.9 / 3, abs=1e-6)
    assert logp.grad[0, 2] == pytest.approx(2 * 1.3 / 3, abs=1e-6)


def test_policy_loss_kl_term_k3():
    logp = torch.log(torch.tensor([[1.5]]))
    loss, _ = grpo.compute_policy_loss(
        logp, logp.clone(), torch.tensor([0.0]), torch.ones(1, 1), ref_logp=torch.zeros(1, 1), beta=0.5
    )
    k3 = 1 / 1.5 + math.log(1.5) - 1  # exp(ref - logp) - (ref - logp) - 1
    assert loss.item() == pytest.approx(0.5 * k3, rel=1e-5)


def test_accumulation_weight_reproduces_full_minibatch_gradient():
    torch.manual_seed(0)
    base = torch.randn(4, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([0.5, -1.0, 2.0, -0.3])
    old = torch.randn(4, 5) * 0.1
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        full = base.clone().requires_grad_(True)
        loss, _ = grpo.compute_policy_loss(full, old, adv, mask, loss_agg=agg, max_tokens=5)
        loss.backward()
        acc = base.clone().requires_grad_(True)
        for rows in ([0, 2], [1, 3]):
            part, _ = grpo.compute_policy_loss(acc[rows], old[rows], adv[rows], mask[rows], loss_agg=agg, max_tokens=5)
            (
                part
                * common.accumulation_weight(
                    "token" if agg == "token-mean" else "sequence", mask[rows], mask.sum().item(), 2, 4
                )
            ).backward()
        assert torch.allclose(full.grad, acc.grad, atol=1e-6), agg


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests import tiny as tiny_mod

    path = tiny_mod.make_tiny_model(str(tmp_path_factory.mktemp("tiny")))
    return models.load_tokenizer(path), models.load_model(path, torch.device("cpu"))


def _naive_logps(model, tb, temperature):
    pos = (tb.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=tb.input_ids, attention_mask=tb.attention_mask, position_ids=pos).logits.float()
    T = tb.completion_ids.shape[1]
    logp = torch.log_softmax(logits[:, -T - 1 : -1] / temperature, dim=-1)
    return logp.gather(-1, tb.completion_ids.unsqueeze(-1)).squeeze(-1) * tb.completion_mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logps_equal_naive_log_softmax(tiny, temperature):
    tok, model = tiny
    prompts = [[2, 10, 11, 12], [2, 13], [2, 14, 15]]
    completions = [[20, 21, 22, 1], [23], [24, 25, 26, 27, 28]]
    tb = common.pad_batch(prompts, completions, tok.pad_token_id)
    naive = _naive_logps(model, tb, temperature)
    chunked, entropy = common.completion_logps(model, tb, temperature, chunk_tokens=3)  # several chunks
    assert torch.allclose(chunked, naive, atol=1e-5)
    assert (chunked[tb.completion_mask == 0] == 0).all()
    assert (entropy[tb.completion_mask == 1] > 0).all() and not entropy.requires_grad
    # gradients through the checkpointed chunks equal the naive ones
    model.zero_grad()
    common.completion_logps(model, tb, temperature, chunk_tokens=3)[0].sum().backward()
    g_chunk = model.get_output_embeddings().weight.grad.clone()
    model.zero_grad()
    _naive_logps(model, tb, temperature).sum().backward()
    assert torch.allclose(g_chunk, model.get_output_embeddings().weight.grad, atol=1e-5)
    model.zero_grad()


def test_pad_batch_layout():
    tb = common.pad_batch([[5, 6, 7], [8]], [[9, 1], [10, 11, 12]], pad_id=0)
    assert tb.input_ids.tolist() == [[5, 6, 7, 9, 1, 0], [0, 0, 8, 10, 11, 12]]
    assert tb.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert tb.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1]]


def test_hf_engine_eos_masks_and_engine_logps_match_trainer(tiny):
    tok, model = tiny
    eos = tok.eos_token_id
    engine = engines.HFEngine(model, tok, gen_batch_size=8, return_logps=True)
    model.train()
    prompts = [common.format_prompt(tok, "What is 1 + 2?"), common.format_prompt(tok, "Hi")]
    torch.manual_seed(0)
    ro = engine.generate(prompts, n=6, max_new_tokens=5, temperature=1.0, progress=False)
    assert len(ro) == 12
    assert all(ro.prompt(i) == prompts[i // 6] for i in range(12))  # rows of a prompt contiguous
    reasons = set()
    for ids, reason in zip(tiny_mod.completions(ro), ro.finish_reasons):
        reasons.add(reason)
        assert 1 <= len(ids) <= 5
        if reason == "stop":
            assert ids[-1] == eos and eos not in ids[:-1]  # EOS kept, nothing after it
        else:
            assert reason == "length" and len(ids) == 5 and eos not in ids
    # with left-padded prompts and right-padded completions, trainer log-probs equal the sampler's
    trainer = common.no_grad_logps(model, ro, range(12), tok.pad_token_id, 1.0, token_budget=64)
    for r in range(12):
        n = len(ro.completion(r))
        assert torch.allclose(trainer[r, :n], torch.tensor(ro.engine_logp(r)), atol=1e-4)
        assert (trainer[r, n:] == 0).all()
    assert model.training  # generate and no_grad_logps restore the mode they found


def test_micro_batches_respect_budget_and_cover_rows():
    lengths = [10, 3, 7, 7, 2, 9]  # prompt + completion tokens of 6 rows with distinct prompts
    ro = references.rollout_from_rows([[r + 3] for r in range(6)], [[5] * (n - 1) for n in lengths])
    mbs = common.micro_batches(ro, range(6), token_budget=16)
    assert sorted(r for mb in mbs for r in mb) == list(range(6))
    for mb in mbs:
        assert len(mb) == 1 or max(lengths[r] for r in mb) * len(mb) <= 16


def test_group_shuffled_minibatches_keep_groups_whole():
    mbs = common.group_shuffled_minibatches(4, 3, 2, torch.Generator().manual_seed(0))
    assert len(mbs) == 2 and sorted(r for mb in mbs for r in mb) == list(range(12))
    for mb in mbs:
        groups = {r // 3 for r in mb}
        assert sorted(mb) == sorted(g * 3 + i for g in groups for i in range(3))


def test_prompt_sampler_state_roundtrip():
    a = common.PromptSampler(10, seed=3)
    first = a.sample(7)
    b = common.PromptSampler(10, seed=3)
    b.load_state_dict(a.state_dict())
    assert a.sample(9) == b.sample(9)
    assert sorted(first + common.PromptSampler(10, seed=3).sample(10)[7:]) == list(range(10))


def test_arith_train_and_eval_disjoint_and_tiers_mixed():
    train = verifiers.load_task("arith", "train", seed=0)
    test = verifiers.load_task("arith", "eval", seed=0)
    assert not {p["question"] for p in train.problems} & {p["question"] for p in test.problems}
    assert {p["tier"] for p in test.problems} == set(range(verifiers.ARITH_TIERS))
    for p in test.problems[:50]:
        assert eval(p["question"][len("What is ") : -1]) == int(p["answer"])


def test_batch_logps_of_a_subset_lines_up_with_the_whole_rollout(tiny):
    tok, model = tiny
    ro = references.rollout_from_rows(
        prompt_ids=[[2, 10], [2, 11], [2, 12]],
        completion_ids=[[20, 21, 22, 23], [24], [25, 1]],
        texts=["", "", ""],
        finish_reasons=["length", "stop", "stop"],
    )
    later = common.no_grad_logps(model, ro, [1, 2], tok.pad_token_id, 1.0, token_budget=64)  # longest row excluded
    assert later.shape == (2, common.completion_mask_of(ro).shape[1]) == (2, 4)
    full = common.no_grad_logps(model, ro, range(3), tok.pad_token_id, 1.0, token_budget=64)
    assert torch.allclose(full[1:], later, atol=1e-5)


def test_make_optimizer_is_fused_adamw_with_hand_computed_first_step():
    # One AdamW step (betas 0.9/0.99, eps 1e-8, no weight decay) from zero state moves every weight by
    # lr * m_hat / (sqrt(v_hat) + eps) = lr * g / (|g| + eps): about -lr * sign(g). Warm-up 2 -> lr/2 at update 0.
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0]]))
    optimizer, scheduler = models.make_optimizer(model, run.Args(learning_rate=0.1, weight_decay=0.0, warmup_updates=2))
    assert optimizer.defaults["fused"] is True  # CPU fp32 parameters take the fused kernel
    model.weight.grad = torch.tensor([[0.5, -4.0]])
    optimizer.step()
    scheduler.step()
    expected = torch.tensor([[1.0 - 0.05 * 0.5 / (0.5 + 1e-8), -2.0 + 0.05 * 4.0 / (4.0 + 1e-8)]])
    assert torch.allclose(model.weight.detach(), expected, atol=1e-7)
    assert scheduler.get_last_lr()[0] == pytest.approx(0.1)  # warm-up over after 2 updates


def test_micro_batch_tokens_auto_and_bad_value():
    assert run.resolve_micro_batch_tokens(0, torch.device("cpu")) == 1024
    assert run.resolve_micro_batch_tokens(0, torch.device("cuda")) == 16384  # only the device type is read
    assert run.resolve_micro_batch_tokens(512, torch.device("cpu")) == 512
    with pytest.raises(verifiers.UserError, match="--micro-batch-tokens -1: must be >= 0"):
        grpo.Args(micro_batch_tokens=-1)  # the flag is checked when the arguments are built, before any device


@pytest.mark.parametrize("logit_scale", [1.0, 20.0, 40.0])
def test_entropy_equals_a_float64_reference_also_for_large_logits(tiny, logit_scale):
    """losses/entropy per token against -sum p log p in float64. Large logits (the LM head scaled up 20x, 40x: low
    entropy under a large logsumexp) are where a form that subtracts numbers of the logits' size loses its digits:
    logz - sum(p * logits) was 1.5e-3 and 1.1 off relative there, p log p from logits - logz 1.6e-4 and 5.7e-2."""
    import copy

    tok, model = tiny
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(logit_scale)
    tb = common.pad_batch([[2, 10, 11, 12], [2, 13]], [[20, 21, 22, 1], [23, 24]], tok.pad_token_id)
    _, entropy = common.completion_logps(model, tb, 1.0, chunk_tokens=3)
    pos = (tb.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=tb.input_ids, attention_mask=tb.attention_mask, position_ids=pos).logits.double()
    logp = torch.log_softmax(logits[:, -tb.completion_ids.shape[1] - 1 : -1], dim=-1)
    reference = -(logp.exp() * logp).sum(-1)  # (B, T) float64
    real = tb.completion_mask == 1
    rel = ((entropy.double() - reference).abs() / reference.clamp(min=1e-12))[real]
    assert rel.max().item() < 1e-4, (logit_scale, rel.max().item(), reference[real].min().item())
