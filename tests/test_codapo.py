"""codapo.py's ALGO LOGIC against numbers computed by hand (weights, advantages, selection, focused slots),
the focus state in the prompt sampler, and short toy runs: resume between a broad and its focused step,
the skipped focused step, and the ablation with both pieces off against grpo.py.

tests/test_e2e.py runs codapo.py's smoke, learning and resume tests with its default toy settings (no
E2E_OVERRIDES needed: at P = 4 the percentile 0.75 selects the best learnable group, cycled over 4 slots)."""

import json
import math
import os

import pytest
import torch

import codapo
import common
import grpo
import run
import verifiers
from tests import tiny

# ----- weights: w_q = exp(mean_i mean_t old_logp) * 4 p (1 - p) + offset


def test_weights_by_hand():
    rewards = torch.tensor(
        [
            1.0,
            0.0,
            0.0,
            0.0,  # p = 1/4 -> V_d = 4 * 1/4 * 3/4 = 0.75
            1.0,
            1.0,
            0.0,
            0.0,  # p = 1/2 -> V_d = 1
            1.0,
            1.0,
            1.0,
            1.0,  # p = 1   -> V_d = 0
            0.0,
            0.0,
            0.0,
            0.0,
        ]
    )  # p = 0   -> V_d = 0
    seq_mean_logp = torch.tensor(
        [
            -0.1,
            -0.2,
            -0.3,
            -0.4,  # mean -0.25
            -1.0,
            -1.0,
            -0.5,
            -0.5,  # mean -0.75
            -0.05,
            -0.05,
            -0.05,
            -0.05,
            -2.0,
            -2.0,
            -2.0,
            -2.0,
        ]
    )
    w = codapo.codapo_weights(rewards, seq_mean_logp, group_size=4, offset=0.1)
    expected = torch.tensor(
        [
            math.exp(-0.25) * 0.75 + 0.1,  # 0.684060...
            math.exp(-0.75) * 1.0 + 0.1,  # 0.572366...
            0.1,
            0.1,
        ]
    )
    assert w.shape == (4,)
    assert torch.allclose(w, expected, atol=1e-6)
    assert w[2].item() == pytest.approx(0.1) and w[3].item() == pytest.approx(0.1)  # saturated -> offset exactly
    # the paper's form (no offset) and the [offset, 1 + offset] range
    w0 = codapo.codapo_weights(rewards, seq_mean_logp, group_size=4, offset=0.0)
    assert torch.allclose(w0, expected - 0.1, atol=1e-6)


def test_confidence_is_exp_of_the_mean_over_all_rollouts():
    # exp(mean of the rollouts' mean log-probs), not the mean of exp: exp(-1) != (exp(0) + exp(-2)) / 2
    c = codapo.codapo_confidence(torch.tensor([0.0, -2.0]), group_size=2)
    assert c.item() == pytest.approx(math.exp(-1.0), rel=1e-6)
    # right and wrong rollouts alike: the weight does not depend on which rollout is right
    w_a = codapo.codapo_weights(torch.tensor([1.0, 0.0]), torch.tensor([0.0, -2.0]), 2)
    w_b = codapo.codapo_weights(torch.tensor([0.0, 1.0]), torch.tensor([0.0, -2.0]), 2)
    assert w_a.item() == pytest.approx(math.exp(-1.0) * 1.0 + 0.1, rel=1e-6) and torch.equal(w_a, w_b)


def test_weights_group_size_one_is_offset():
    # G = 1: p is 0 or 1, V_d = 0 -> every weight is the offset, whatever the confidence
    w = codapo.codapo_weights(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([-0.1, -3.0, 0.0]), 1, offset=0.1)
    assert torch.allclose(w, torch.full((3,), 0.1))
    adv = codapo.compute_advantages(torch.tensor([1.0, 0.0, 1.0]), 1, w)
    assert torch.equal(adv, torch.zeros(3))


def test_success_rate_counts_only_fully_right_rollouts():
    p = codapo.success_rate(torch.tensor([1.0, 0.5, 0.0, 1.0]), group_size=4)
    assert p.item() == pytest.approx(0.5)


# ----- advantages: grpo.py's times w


def test_advantages_equal_grpo_times_w():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    weights = torch.tensor([0.5, 0.1, 1.1])
    adv = codapo.compute_advantages(rewards, 4, weights, eps=1e-4)
    base = grpo.compute_advantages(rewards, 4, scale="group")
    assert torch.allclose(adv, base * weights.repeat_interleave(4), atol=1e-7)
    assert torch.equal(codapo.compute_advantages(rewards, 4, None, eps=1e-4), base)  # w = 1: grpo.py exactly
    assert torch.equal(adv[4:8], torch.zeros(4))  # all-equal group: exactly zero


def test_advantages_by_hand_default_eps():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    adv = codapo.compute_advantages(rewards, 4, torch.tensor([0.5, 2.0]))  # eps 1e-6 (official)
    # group 0: mean 0.25, unbiased std 0.5 -> (0.75, -0.25, -0.25, -0.25) / 0.500001, times 0.5
    # group 1: mean 0.5, unbiased std sqrt(1/3) -> (-0.5, 0.5, 0.5, -0.5) / (0.57735 + 1e-6), times 2
    s1 = math.sqrt(1 / 3) + 1e-6
    expected = torch.tensor(
        [0.375 / 0.500001, -0.125 / 0.500001, -0.125 / 0.500001, -0.125 / 0.500001, -1.0 / s1, 1.0 / s1, 1.0 / s1, -1.0 / s1]
    )
    assert torch.allclose(adv, expected, atol=1e-6)


# ----- selection for the focused step


def test_selection_by_hand():
    # 4 groups of G = 2: saturated (p = 1), learnable, saturated (p = 0), learnable
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    weights = torch.tensor([0.1, 0.6, 0.1, 1.0])
    # sorted w = (0.1, 0.1, 0.6, 1.0); quantile 0.75 at position 0.75 * 3 = 2.25 -> 0.6 + 0.25 * 0.4 = 0.7
    assert codapo.select_for_resampling(rewards, weights, 2, 0.75) == [3]
    # quantile 0.5 at position 1.5 -> 0.35: groups 1 and 3, highest weight first
    assert codapo.select_for_resampling(rewards, weights, 2, 0.5) == [3, 1]


def test_selection_ties_keep_batch_order_after_weight():
    rewards = torch.tensor([1.0, 0.0] * 8)  # 8 learnable groups of G = 2
    weights = torch.tensor([0.3, 0.9, 0.9, 0.2, 0.9, 0.1, 0.1, 0.1])
    # sorted (0.1, 0.1, 0.1, 0.2, 0.3, 0.9, 0.9, 0.9); position 0.75 * 7 = 5.25 lies between two 0.9 -> 0.9:
    # every tied 0.9 passes (>=), in batch order
    assert codapo.select_for_resampling(rewards, weights, 2, 0.75) == [1, 2, 4]
    # all equal: the quantile equals the common value and every group passes, in batch order
    assert codapo.select_for_resampling(rewards[:8], torch.full((4,), 0.5), 2, 0.75) == [0, 1, 2, 3]
    # ties below the top one: highest first, equal weights in batch order
    assert codapo.select_for_resampling(rewards[:8], torch.tensor([0.4, 0.8, 0.4, 0.4]), 2, 0.0) == [1, 0, 2, 3]


def test_selection_saturated_batch_takes_only_learnable_groups():
    # 7 saturated groups (w = offset = 0.1) and one learnable group (index 5, w = 0.4): the quantile is the
    # offset, so the official rule (w >= threshold) passes all 8 groups and would re-roll the first ones in
    # batch order, saturated included; here only the learnable group is selected.
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    weights = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1, 0.4, 0.1, 0.1])
    threshold = torch.quantile(weights, 0.75)
    assert threshold.item() == pytest.approx(0.1) and int((weights >= threshold).sum()) == 8  # the official weakness
    assert codapo.select_for_resampling(rewards, weights, 2, 0.75) == [5]
    # 6 saturated, 2 learnable: sorted (0.1 x 6, 0.3, 0.5), position 5.25 -> 0.1 + 0.25 * 0.2 = 0.15: both pass
    weights2 = torch.tensor([0.1, 0.3, 0.1, 0.1, 0.1, 0.5, 0.1, 0.1])
    rewards2 = rewards.clone()
    rewards2[2:4] = torch.tensor([1.0, 0.0])  # group 1 learnable too
    assert codapo.select_for_resampling(rewards2, weights2, 2, 0.75) == [5, 1]


def test_selection_nothing_learnable_is_empty():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    assert codapo.select_for_resampling(rewards, torch.full((4,), 0.1), 2, 0.75) == []
    assert codapo.select_for_resampling(torch.tensor([1.0, 0.0]), torch.full((2,), 0.1), 1, 0.75) == []  # G = 1


# ----- the focused step: slots, separate groups, sampler state


def test_focused_prompt_slots():
    assert codapo.focused_prompt_slots([7, 3], 4, 8) == [7, 7, 7, 7, 3, 3, 3, 3]
    assert codapo.focused_prompt_slots([5], 4, 8) == [5] * 8  # cycled to fill the batch
    assert codapo.focused_prompt_slots([1, 2, 3], 4, 8) == [1, 1, 1, 1, 2, 2, 2, 2]  # lowest-weight one falls off
    assert codapo.focused_prompt_slots([1, 2], 1, 5) == [1, 2, 1, 2, 1]
    assert codapo.focused_prompt_slots([1, 2], 2, 6) == [1, 1, 2, 2, 1, 1]


def test_resampled_copies_form_separate_groups():
    # focused batch: question 7 in 2 slots, question 3 in 2 slots, G = 2; rows [g*G:(g+1)*G] belong to slot g
    slots = codapo.focused_prompt_slots([7, 3], 2, 4)
    assert slots == [7, 7, 3, 3]
    rewards = torch.tensor(
        [
            1.0,
            0.0,  # copy 1 of q7: p = 1/2
            1.0,
            1.0,  # copy 2 of q7: p = 1 -> its own group: zero advantage, w = offset
            0.0,
            0.0,  # copy 1 of q3: p = 0
            0.0,
            1.0,
        ]
    )  # copy 2 of q3: p = 1/2
    logp = torch.tensor([-0.2, -0.4, -0.1, -0.1, -1.0, -1.0, -0.6, -0.2])
    w = codapo.codapo_weights(rewards, logp, 2)
    assert torch.allclose(w, torch.tensor([math.exp(-0.3) + 0.1, 0.1, 0.1, math.exp(-0.4) + 0.1]), atol=1e-6)
    adv = codapo.compute_advantages(rewards, 2, w)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert torch.allclose(adv, torch.tensor([a * w[0], -a * w[0], 0, 0, 0, 0, -a * w[3], a * w[3]]), atol=1e-6)
    # pooled over the question instead (q7 as one group of 4) the second copy's rows would not be zero
    assert grpo.compute_advantages(rewards[:4], 4)[2] != 0


def test_focus_sampler_pending_focus_and_state():
    plain, s = common.PromptSampler(10, 3), codapo.FocusSampler(10, 3, repeat_count=2)
    first = s.sample(4)
    assert first == plain.sample(4) and not s.last_focused
    s.set_focus([9, 1])
    state = s.state_dict()
    assert state["focus"] == [9, 1]
    assert s.sample(4) == [9, 9, 1, 1] and s.last_focused and s.focus == []
    assert s.sample(4) == plain.sample(4) and not s.last_focused  # the fresh stream did not move
    restored = codapo.FocusSampler(10, 3, repeat_count=2)
    restored.load_state_dict(state)  # a checkpoint taken between the broad and the focused step
    assert restored.sample(4) == [9, 9, 1, 1]
    assert restored.sample(4) == common.PromptSampler(10, 3).sample(8)[4:]  # then the second fresh batch
    # the state of a sampler without focus still loads (grpo.py-style checkpoint)
    restored.load_state_dict({"epoch": 0, "pos": 0})
    assert restored.focus == [] and restored.sample(4) == first


def test_flags_ablations_parse():
    args = run.parse_args(codapo.Args, [])
    assert args.codapo_weighting and args.focused_step and args.codapo_offset == 0.1
    assert args.codapo_percentile == 0.75 and args.repeat_count == 4 and args.codapo_std_eps == 1e-6
    args = run.parse_args(codapo.Args, ["--no-codapo-weighting", "--no-focused-step", "--repeat-count", "2"])
    assert not args.codapo_weighting and not args.focused_step and args.repeat_count == 2
    args = run.parse_args(codapo.Args, ["--codapo-weighting", "false", "--focused_step", "true"])
    assert not args.codapo_weighting and args.focused_step
    for bad in (["--repeat-count", "0"], ["--codapo-percentile", "1.5"]):
        with pytest.raises(verifiers.UserError):
            run.parse_args(codapo.Args, bad)


# ----- dual clip (official verl loss, clip_ratio_c = 3): A < 0 tokens capped at c |A|


def _dual_case():
    # row 0: A = -2, ratios 5 and 2; row 1: A = +1, ratio 5 and a padding slot. old_logp = 0, so r = exp(logp).
    logp = torch.log(torch.tensor([[5.0, 2.0], [5.0, 1.0]])).requires_grad_(True)
    return logp, torch.zeros(2, 2), torch.tensor([-2.0, 1.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])


def test_dual_clip_by_hand():
    logp, old, adv, mask = _dual_case()
    loss, stats = codapo.compute_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2, dual_clip_c=3.0)
    # (A=-2, r=5): PPO max(-A r, -A clip r) = max(10, 2.4) = 10, capped at 3 |A| = 6, gradient 0
    # (A=-2, r=2): max(4, 2.4) = 4 < 6, unaffected: d(-A r)/dlogp = -A r = 4
    # (A=+1, r=5): max(-5, -1.2) = -1.2 (upper clip, gradient 0); the dual clip never touches A > 0
    assert loss.item() == pytest.approx((6.0 + 4.0 - 1.2) / 3, abs=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 4.0 / 3], [0.0, 0.0]]), atol=1e-6)
    assert stats["clipfrac_dual"] == pytest.approx(1 / 3) and stats["clipfrac_high"] == pytest.approx(1 / 3)
    assert stats["clipfrac"] == pytest.approx(2 / 3) and stats["clipfrac_low"] == 0.0
    # off: the r = 5, A < 0 token keeps its full loss 10 and gradient -A r = 10
    logp_off = logp.detach().clone().requires_grad_(True)
    loss_off, stats_off = codapo.compute_policy_loss(logp_off, old, adv, mask, eps_low=0.2, eps_high=0.2, dual_clip_c=0.0)
    assert loss_off.item() == pytest.approx((10.0 + 4.0 - 1.2) / 3, abs=1e-6)
    loss_off.backward()
    assert torch.allclose(logp_off.grad, torch.tensor([[10.0 / 3, 4.0 / 3], [0.0, 0.0]]), atol=1e-6)
    assert stats_off["clipfrac_dual"] == 0.0 and stats_off["clipfrac"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_dual_clip_off_is_the_plain_loss_exactly(loss_agg):
    """c <= 0 (the default) and a c that never binds give grpo.py's loss and gradient bit for bit."""
    torch.manual_seed(0)
    B, T = 6, 5
    base = torch.randn(B, T) * 0.3 - 2.0
    old = base + torch.randn(B, T) * 1.5  # ratios from ~0.03 to ~20
    old[1, 0], old[5, 1] = base[1, 0] - math.log(5.0), base[5, 1] - math.log(10.0)  # A < 0 tokens with r = 5, 10
    adv = torch.tensor([1.2, -0.7, 0.0, -1.5, 0.4, -2.0])
    mask = (torch.arange(T).unsqueeze(0) < torch.tensor([[5], [3], [4], [1], [5], [2]])).float()
    ref = base + torch.randn(B, T) * 0.2
    b = base.clone().requires_grad_(True)
    loss_g, st_g = grpo.compute_policy_loss(
        b, old, adv, mask, eps_low=0.2, eps_high=0.28, loss_agg=loss_agg, ref_logp=ref, beta=0.05, max_tokens=8
    )
    loss_g.backward()
    ratio = torch.exp(base - old)
    assert bool(((ratio > 3) & (adv.unsqueeze(1) < 0) & mask.bool()).any())  # c = 3 would bind in this case
    for c in (0.0, -1.0, 1e6):
        a = base.clone().requires_grad_(True)
        loss_c, st_c = codapo.compute_policy_loss(
            a,
            old,
            adv,
            mask,
            eps_low=0.2,
            eps_high=0.28,
            loss_agg=loss_agg,
            ref_logp=ref,
            beta=0.05,
            max_tokens=8,
            dual_clip_c=c,
        )
        loss_c.backward()
        assert torch.equal(loss_c, loss_g) and torch.equal(a.grad, b.grad), c
        assert st_c["clipfrac_dual"] == 0.0 and all(st_c[k] == st_g[k] for k in st_g)
    a = base.clone().requires_grad_(True)
    loss_3, st_3 = codapo.compute_policy_loss(
        a,
        old,
        adv,
        mask,
        eps_low=0.2,
        eps_high=0.28,
        loss_agg=loss_agg,
        ref_logp=ref,
        beta=0.05,
        max_tokens=8,
        dual_clip_c=3.0,
    )
    assert loss_3.item() < loss_g.item() and st_3["clipfrac_dual"] > 0  # c = 3 caps some A < 0 tokens
    with pytest.raises(ValueError):
        codapo.compute_policy_loss(a, old, adv, mask, dual_clip_c=1.0)


def test_dual_clip_flag():
    assert run.parse_args(codapo.Args, []).dual_clip_c == 0.0  # off: the default run's loss is unchanged
    assert run.parse_args(codapo.Args, ["--dual-clip-c", "3"]).dual_clip_c == 3.0
    assert run.parse_args(codapo.Args, ["--dual-clip-c", "-1"]).dual_clip_c == -1.0  # also off
    for bad in ("1", "0.5", "nan"):
        with pytest.raises(verifiers.UserError, match="--dual-clip-c"):
            run.parse_args(codapo.Args, ["--dual-clip-c", bad])


def test_paper_scale_line_makes_the_official_number_of_updates():
    """The docstring's paper-scale line: 16 prompts x 8 rollouts, mini-batches of 16 trajectories as the official
    ppo_mini_batch_size=16 (rollout n = 1, prompts repeated): 8 updates per step, and the official dual clip c = 3."""
    doc = codapo.__doc__
    start = doc.index("python codapo.py --model Qwen/Qwen2.5-Math-1.5B")
    line = doc[start : doc.index("# GPU", start)].replace("\\\n", " ").split()[2:]
    args = run.parse_args(codapo.Args, line)
    assert (args.prompts_per_step, args.num_generations) == (16, 8)
    assert args.prompts_per_step * args.num_generations // args.updates_per_batch == 16  # trajectories per update
    assert args.dual_clip_c == 3.0 and args.learning_rate == 1e-6 and args.max_new_tokens == 3072


# ----- toy runs (tiny model built here; a few seconds each)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    toy = tiny.toy_task(tmp_path_factory.mktemp("codapo_toy"))
    never = [{"question": f"Say it {w}", "answer": "12345678"} for w in "abcdefgh"]  # 8 digits > 3 tokens: r = 0
    return {**toy, "never": tiny.write_jsonl(str(toy["dir"] / "never.jsonl"), never)}


def _run(mod, toy, out, run_name, steps, **overrides):
    mod.main(mod.Args(**tiny.run_settings(toy, out, run_name, total_steps=steps, **overrides)))
    with open(os.path.join(out, run_name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _train_rows(rows):
    return [
        {k: v for k, v in r.items() if not k.startswith("perf/") and k != "wall_s"} for r in rows if "losses/policy_loss" in r
    ]


def _step_rows(rows):
    return [r for r in rows if "rollout/reward_mean" in r]


def test_focused_step_rerolls_the_selection_and_resumes_between_the_two_steps(toy, tmp_path, monkeypatch):
    seen = []
    original = codapo.FocusSampler.sample
    monkeypatch.setattr(codapo.FocusSampler, "sample", lambda self, k: seen.append(original(self, k)) or seen[-1])
    full = _run(codapo, toy, tmp_path, "full", 3, save_every=1)
    steps = _step_rows(full)
    assert [r["codapo/focused_step"] for r in steps] == [0.0, 1.0, 0.0]  # broad, focused, broad
    n_selected = steps[0]["codapo/selected"]
    assert n_selected >= 1 and steps[0]["codapo/focused_skipped"] == 0.0
    focused_slots = seen[1]
    assert len(focused_slots) == 4 and set(focused_slots) <= set(seen[0])  # re-rolls questions of step 1
    assert len(set(focused_slots)) == 1  # P = 4 slots, repeat_count 4: only the best selected question fits
    assert "codapo/focused_reward_mean" in steps[1] and "codapo/broad_reward_mean" in steps[0]
    for key in ("codapo/weight_mean", "codapo/weight_max", "codapo/confidence_mean", "codapo/learnable_frac"):
        assert key in steps[0] and key in steps[1]
    assert 0.1 <= steps[0]["codapo/weight_mean"] <= steps[0]["codapo/weight_max"] <= 1.1
    # stop after the broad step (its selection pending), resume: the same focused step and the same numbers
    _run(codapo, toy, tmp_path, "part", 1, save_every=1)
    resumed = _run(codapo, toy, tmp_path, "part", 3, save_every=1, resume=str(tmp_path / "part"))
    a, b = _train_rows(full), _train_rows(resumed)
    assert len(a) == len(b) == 6
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-7), (k, ra, rb)


def test_nothing_learnable_skips_the_focused_step(toy, tmp_path, capsys):
    rows = _step_rows(_run(codapo, toy, tmp_path, "never", 3, dataset=toy["never"]))
    assert [r["codapo/focused_step"] for r in rows] == [0.0, 0.0, 0.0]  # every step broad
    assert all(r["codapo/focused_skipped"] == 1.0 and r["codapo/selected"] == 0 for r in rows)
    assert all(r["codapo/learnable_frac"] == 0.0 and r["codapo/weight_max"] == pytest.approx(0.1) for r in rows)
    assert "focused step skipped" in capsys.readouterr().out


def test_dual_clip_run_logs_its_fraction(toy, tmp_path):
    """A fast-moving toy run with --dual-clip-c 3 logs codapo/dual_clipfrac on every update (part of
    losses/clipfrac); the default run (c = 0) logs no such key."""
    # broad step, then the focused step: 4 groups of the learnable question, one per update (lr 0.3: fast moves)
    rows = _train_rows(
        _run(codapo, toy, tmp_path, "dual", 2, dual_clip_c=3.0, updates_per_batch=4, learning_rate=0.3, max_new_tokens=6)
    )
    assert len(rows) == 8 and all(0.0 <= r["codapo/dual_clipfrac"] <= r["losses/clipfrac"] for r in rows)
    assert rows[0]["codapo/dual_clipfrac"] == rows[4]["codapo/dual_clipfrac"] == 0.0  # first update of a step: r = 1
    assert any(r["codapo/dual_clipfrac"] > 0 for r in rows)  # some A < 0 tokens reach r > 3
    default = _train_rows(_run(codapo, toy, tmp_path, "nodual", 1))
    assert not any("codapo/dual_clipfrac" in r for r in default)


def test_both_pieces_off_is_grpo(toy, tmp_path):
    base = _train_rows(_run(grpo, toy, tmp_path, "grpo", 3))
    off_rows = _run(codapo, toy, tmp_path, "off", 3, codapo_weighting=False, focused_step=False, codapo_std_eps=1e-4)
    assert all(r["codapo/focused_step"] == 0.0 for r in _step_rows(off_rows))
    off = _train_rows(off_rows)
    assert len(base) == len(off) == 6
    for ra, rb in zip(base, off):
        for k in ra:  # old log-probs of the first mini-batch: a separate no-grad pass in codapo.py (same numbers)
            assert ra[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-6), (k, ra, rb)
