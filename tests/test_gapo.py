"""gapo.py's ALGO LOGIC against numbers computed by hand, and against grpo.py in the degenerate setting."""

import math

import pytest
import torch

import gapo
import grpo

K = 8


def _group(c: int, k: int = K) -> list[float]:
    return [1.0] * c + [0.0] * (k - c)


# ---------------------------------------------------------------------------------------------- eps table (eq. 11)


def test_eps_high_table_k8_token_pair():
    # one group per c = 0..8; eq. 11: correct -> 0.2 + 0.08 * (8 - c)/7, everything else -> 0.2
    rewards = torch.tensor([r for c in range(K + 1) for r in _group(c)])
    eps = gapo.gapo_eps_high(rewards, K, 0.2, 0.28).view(K + 1, K)
    for c in range(K + 1):
        for i in range(K):
            correct = i < c
            expected = 0.2 + 0.08 * (K - c) / (K - 1) if correct and 0 < c < K else 0.2
            assert eps[c, i].item() == pytest.approx(expected, abs=1e-7), (c, i)
    assert eps[1, 0].item() == pytest.approx(0.28, abs=1e-7)  # the single correct rollout of a hard group
    assert eps[7, 0].item() == pytest.approx(0.2 + 0.08 / 7, abs=1e-7)  # one of seven correct: barely widened
    assert eps[1, 1].item() == pytest.approx(0.2)  # incorrect rollout
    assert torch.allclose(eps[0], torch.full((K,), 0.2)) and torch.allclose(eps[K], torch.full((K,), 0.2))


def test_eps_high_general_form_and_edge_cases():
    # rewards in [0,1]: eps_low + (max - low) * A / A_max, A_max = (k-1)/k; raw statistics only
    rewards = torch.tensor([1.0, 0.5, 0.0, 0.5])  # mean 0.5: A = (0.5, 0, -0.5, 0), A_max = 0.75
    eps = gapo.gapo_eps_high(rewards, 4, 3e-3, 5e-3)
    assert torch.allclose(eps, torch.tensor([3e-3 + 2e-3 * 0.5 / 0.75, 3e-3, 3e-3, 3e-3]), atol=1e-9)
    # k = 1: nothing to widen
    assert torch.equal(gapo.gapo_eps_high(torch.tensor([1.0, 0.0]), 1, 0.2, 0.28), torch.full((2,), 0.2))
    # eps_high_max == eps_low: constant
    assert torch.allclose(gapo.gapo_eps_high(torch.tensor(_group(3)), K, 0.2, 0.2), torch.full((K,), 0.2))


def test_group_correct_counts():
    rewards = torch.tensor(_group(1, 4) + _group(3, 4) + [0.5, 1.0, 0.9, 0.0])
    assert gapo.group_correct_counts(rewards, 4).tolist() == [1] * 4 + [3] * 4 + [1] * 4


# ---------------------------------------------------------------------------------------------- advantages


def test_advantages_default_no_std_division():
    rewards = torch.tensor(_group(1) + _group(8))
    adv = gapo.compute_advantages(rewards, K)  # default scale="none"
    assert torch.allclose(adv[:K], torch.tensor([7 / 8] + [-1 / 8] * 7))  # (k-c)/k and -c/k
    assert torch.equal(adv[K:], torch.zeros(K))


def test_advantages_group_scale_equals_grpo():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.0, 1.0, 0.5])
    for scale in ("group", "none"):
        assert torch.equal(gapo.compute_advantages(rewards, 4, scale), grpo.compute_advantages(rewards, 4, scale))


def test_focal_advantage_shaping_by_hand():
    rewards = torch.tensor(_group(1, 4) + _group(3, 4))
    adv = gapo.compute_advantages(rewards, 4, "none", focal_gamma=2.0)
    # c=1: A = (0.75, -0.25...) * (1 - 1/4)^2 = 0.5625; c=3: A = (0.25.., -0.75) * (1/4)^2
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) * 0.5625
    expected = torch.cat([expected, torch.tensor([0.25, 0.25, 0.25, -0.75]) * 0.0625])
    assert torch.allclose(adv, expected, atol=1e-7)
    assert torch.equal(
        gapo.compute_advantages(rewards, 4, "none", focal_gamma=0.0), gapo.compute_advantages(rewards, 4, "none")
    )


# ---------------------------------------------------------------------------------------------- loss


def _random_case(seed=0, B=6, T=5):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, T, generator=g) * 0.3 - 1.0
    old = base + torch.randn(B, T, generator=g) * 0.25  # ratios spread around 1, some beyond 0.2
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    adv = torch.tensor([0.875, -0.125, 0.5, -0.5, 0.25, -0.75])
    return base, old, adv, mask


@pytest.mark.parametrize("eps_high_as_tensor", [False, True])
def test_token_level_equals_grpo_when_max_equals_low(eps_high_as_tensor):
    base, old, adv, mask = _random_case()
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    eps = gapo.gapo_eps_high(rewards, 2, 0.2, 0.2) if eps_high_as_tensor else 0.2
    a = base.clone().requires_grad_(True)
    loss_a, stats_a = gapo.compute_policy_loss(a, old, adv, mask, eps_low=0.2, eps_high=eps, level="token")
    loss_a.backward()
    b = base.clone().requires_grad_(True)
    loss_b, stats_b = grpo.compute_policy_loss(b, old, adv, mask, eps_low=0.2, eps_high=0.2, loss_agg="token-mean")
    loss_b.backward()
    assert stats_b["clipfrac"] > 0  # the case exercises the clip
    assert loss_a.item() == pytest.approx(loss_b.item(), abs=1e-7)
    assert torch.allclose(a.grad, b.grad, atol=1e-8)
    for k in ("clipfrac", "clipfrac_low", "clipfrac_high", "approx_kl"):
        assert stats_a[k] == pytest.approx(stats_b[k], abs=1e-7), k


def test_token_level_per_rollout_bound_by_hand():
    # two correct rollouts (A=0.5) at the same ratios, bounds 0.2 and 0.3; old_logp = 0 so ratio = exp(logp)
    logp = torch.log(torch.tensor([[1.25, 0.9], [1.25, 0.9]])).requires_grad_(True)
    loss, stats = gapo.compute_policy_loss(
        logp,
        torch.zeros(2, 2),
        torch.tensor([0.5, 0.5]),
        torch.ones(2, 2),
        eps_low=0.2,
        eps_high=torch.tensor([0.2, 0.3]),
        level="token",
    )
    # row 0: 1.25 > 1.2 -> -0.5*1.2 = -0.6 (clipped), 0.9 -> -0.45; row 1: -0.625, -0.45; token mean
    assert loss.item() == pytest.approx((-0.6 - 0.45 - 0.625 - 0.45) / 4, abs=1e-6)
    assert stats["clipfrac"] == pytest.approx(0.25) and stats["clipfrac_high"] == pytest.approx(0.25)
    assert stats["rows"]["clipped"].tolist() == [1.0, 0.0] and stats["rows"]["units"].tolist() == [2.0, 2.0]
    assert stats["rows"]["abs_dev"][0].item() == pytest.approx(0.35, abs=1e-6)
    loss.backward()
    assert logp.grad[0, 0] == 0.0
    assert logp.grad[1, 0].item() == pytest.approx(-0.5 * 1.25 / 4, abs=1e-6)
    assert logp.grad[0, 1].item() == pytest.approx(-0.5 * 0.9 / 4, abs=1e-6)


def test_sequence_ratio_is_exp_of_masked_mean_log_ratio():
    base, old, _, mask = _random_case()
    log_s = gapo.sequence_log_ratio(base, old, mask)
    for i in range(base.shape[0]):
        n = int(mask[i].sum())
        expected = math.exp(sum(base[i, t].item() - old[i, t].item() for t in range(n)) / n)
        assert math.exp(log_s[i].item()) == pytest.approx(expected, rel=1e-6)
    # padding values do not leak in
    garbage = base.clone()
    garbage[mask == 0] = 123.0
    assert torch.allclose(gapo.sequence_log_ratio(garbage, old, mask), log_s)


def test_sequence_level_value_and_gspo_token_gradient():
    base, old, adv, mask = _random_case(seed=1)
    eps = torch.tensor([0.05, 0.02, 0.03, 0.02, 0.10, 0.02])
    x = base.clone().requires_grad_(True)
    loss, stats = gapo.compute_policy_loss(x, old, adv, mask, eps_low=0.02, eps_high=eps, level="sequence")
    loss.backward()
    # direct sequence-level objective with s_i carrying the gradient: same value and gradient
    y = base.clone().requires_grad_(True)
    s = torch.exp(((y - old) * mask).sum(1) / mask.sum(1))
    direct = torch.maximum(-adv * s, -adv * torch.minimum(torch.maximum(s, torch.tensor(0.98)), 1 + eps)).mean()
    direct.backward()
    assert loss.item() == pytest.approx(direct.item(), abs=1e-6)
    assert torch.allclose(x.grad, y.grad, atol=1e-6)
    assert (x.grad[mask == 0] == 0).all()
    # clip fraction is per sequence
    s = s.detach()
    clipped = ((s > 1 + eps) & (adv > 0)) | ((s < 0.98) & (adv < 0))
    assert 0 < clipped.sum() < 6  # the case has clipped and unclipped sequences
    assert stats["clipfrac"] == pytest.approx(clipped.float().mean().item())
    assert stats["rows"]["units"].tolist() == [1.0] * 6
    assert torch.allclose(stats["rows"]["abs_dev"], (s - 1).abs(), atol=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gradient_zero_above_own_bound_nonzero_for_harder_group(level):
    # k = 4, eps (0.2, 0.28): group 0 has c = 3 (easy), group 1 has c = 1 (hard)
    rewards = torch.tensor(_group(3, 4) + _group(1, 4))
    eps = gapo.gapo_eps_high(rewards, 4, 0.2, 0.28)
    adv = gapo.compute_advantages(rewards, 4)
    assert eps[0].item() == pytest.approx(0.2 + 0.08 / 3) and eps[4].item() == pytest.approx(0.28)
    # every row at ratio 1.25: above the easy correct rollout's 1.2267, below the hard one's 1.28
    logp = torch.full((8, 3), math.log(1.25)).requires_grad_(True)
    loss, stats = gapo.compute_policy_loss(
        logp, torch.zeros(8, 3), adv, torch.ones(8, 3), eps_low=0.2, eps_high=eps, level=level
    )
    loss.backward()
    assert (logp.grad[0] == 0).all()  # easy group's correct rollout: clipped, no gradient
    assert (logp.grad[4] < 0).all()  # hard group's correct rollout at the same ratio: still pushed up
    assert stats["rows"]["clipped"][0] > 0 and stats["rows"]["clipped"][4] == 0
    # the fixed baseline (0.2 for everyone) clips both
    logp.grad = None
    loss, _ = gapo.compute_policy_loss(logp, torch.zeros(8, 3), adv, torch.ones(8, 3), eps_low=0.2, eps_high=0.2, level=level)
    loss.backward()
    assert (logp.grad[0] == 0).all() and (logp.grad[4] == 0).all()


def test_on_policy_ratio_one_gapo_equals_fixed_baseline():
    # one update per batch: ratio = 1, no clip fires, the bound does not matter
    base, _, adv, mask = _random_case()
    grads = []
    for eps in (0.2, 0.28, torch.tensor([0.28, 0.2, 0.25, 0.2, 0.21, 0.2])):
        for level in ("token", "sequence"):
            x = base.clone().requires_grad_(True)
            loss, stats = gapo.compute_policy_loss(x, base.detach(), adv, mask, eps_low=0.2, eps_high=eps, level=level)
            loss.backward()
            assert stats["clipfrac"] == 0.0
            grads.append((level, loss.item(), x.grad))
    for level in ("token", "sequence"):
        same = [g for g in grads if g[0] == level]
        assert all(abs(g[1] - same[0][1]) < 1e-7 and torch.allclose(g[2], same[0][2]) for g in same)


def test_kl_term_k3_matches_grpo():
    logp = torch.log(torch.tensor([[1.5]]))
    loss, _ = gapo.compute_policy_loss(
        logp, logp.clone(), torch.tensor([0.0]), torch.ones(1, 1), ref_logp=torch.zeros(1, 1), beta=0.5
    )
    assert loss.item() == pytest.approx(0.5 * (1 / 1.5 + math.log(1.5) - 1), rel=1e-5)


def test_bad_settings_raise_user_error():
    import verifiers

    with pytest.raises(verifiers.UserError):
        gapo.Args(clip_low=0.2, clip_high_max=0.1)
    with pytest.raises(verifiers.UserError):
        gapo.Args(focal_gamma=-1.0)
    gapo.Args(clip_mode="fixed", clip_low=0.2, clip_high_max=0.1)  # a fixed bound may sit anywhere
