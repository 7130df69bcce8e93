"""mugrpo.py's ALGO LOGIC against hand-made tensors (veto scopes, log-space triggers, relaxed clip, pre-veto
denominator), the degenerate settings that reduce to grpo.py, and the stage loop: behaviour log-probs are the
stage-start ones and stay fixed while the policy moves (staleness grows within a stage)."""

import copy
import json
import math
import os
import subprocess
import sys
import typing

import pytest
import torch

import common
import engines
import grpo
import models
import mugrpo
from tests import references, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# tests/test_e2e.py's toy runs (4 prompts x 8 rollouts, lr 3e-3) as stages: 16 prompts per stage, mu = 8 updates of
# 2 prompts each, 12 stages for the learning test (the smoke and resume tests keep their own step counts).
E2E_OVERRIDES = {"prompts_per_step": 16, "updates_per_batch": 8, "total_steps": 12}

LOG_DELTA = math.log(1e-4)
TRIG, OK = -12.0, -1.0  # log-ratios below / above log(1e-4) = -9.21


# ----------------------------------------------------------------------------------------------
# advantages


def test_advantages_by_hand_std_plus_1e6():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = mugrpo.compute_advantages(rewards, group_size=4)
    s = math.sqrt(0.75 / 3) + 1e-6  # unbiased std 0.5
    assert torch.allclose(adv[:4], torch.tensor([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s]), atol=1e-6)
    assert torch.equal(adv[4:], torch.zeros(4))  # all-equal group: exactly zero


# ----------------------------------------------------------------------------------------------
# veto


def _veto_case():
    """Rows: 0 A<0 with triggers at t=1 and t=3 (and a trigger-like value on padding t=5); 1 A>0 with
    trigger-like log-ratios; 2 A<0 without triggers; 3 A=0 with trigger-like log-ratios."""
    log_ratio = torch.tensor(
        [
            [OK, TRIG, OK, TRIG, 0.3, -50.0],
            [TRIG, TRIG, OK, 0.0, 0.0, 0.0],
            [OK, OK, 0.2, OK, -50.0, -50.0],
            [TRIG, OK, TRIG, 0.0, 0.0, 0.0],
        ]
    )
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.float32)
    behav = torch.full((4, 6), -3.0)
    logp = behav + log_ratio
    adv = torch.tensor([-1.0, 1.0, -0.5, 0.0])
    return logp, behav, adv, mask


EXPECTED_ROW0 = {
    "none": [1, 1, 1, 1, 1, 0],
    "trigger": [1, 0, 1, 0, 1, 0],  # the triggers only
    "suffix": [1, 1, 0, 0, 0, 0],  # t > kappa = 1; kappa itself kept
    "suffix_nontrigger": [1, 1, 0, 1, 0, 0],  # H_kappa: after kappa and not a trigger (t = 2, 4)
    "sequence": [0, 0, 0, 0, 0, 0],
}


VETO_SCOPES = typing.get_args(typing.get_type_hints(mugrpo.Args)["veto_scope"])  # the flag's choices


@pytest.mark.parametrize("scope", VETO_SCOPES)
def test_veto_mask_each_scope_by_hand(scope):
    logp, behav, adv, mask = _veto_case()
    keep = mugrpo.veto_mask(logp, behav, adv, mask, LOG_DELTA, scope)
    assert keep.shape == mask.shape and keep.dtype == logp.dtype
    assert keep[0].tolist() == EXPECTED_ROW0[scope]
    for row in (1, 2, 3):  # A > 0, A < 0 without trigger, A = 0: nothing vetoed, padding stays 0
        assert keep[row].tolist() == mask[row].tolist(), (scope, row)
    assert ((keep == 0) | (mask == 1)).all()  # keep <= mask: padding is never a kept token


def test_veto_triggers_only_real_tokens_of_negative_rows():
    logp, behav, adv, mask = _veto_case()
    trig = mugrpo.veto_triggers(logp, behav, adv, mask, LOG_DELTA)
    assert trig.nonzero().tolist() == [[0, 1], [0, 3]]  # not the padded -50, not rows with A >= 0
    # the threshold is strict and uses delta itself
    exact = mugrpo.veto_triggers(
        torch.tensor([[LOG_DELTA, LOG_DELTA - 1e-3]]), torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2), LOG_DELTA
    )
    assert exact.tolist() == [[False, True]]


def test_trigger_test_does_not_underflow_at_tiny_probabilities():
    # fp32 probabilities exp(-200), exp(-190) underflow to 0: a ratio taken after exponentiating is 0/0 = nan
    logp = torch.tensor([[-200.0, -200.0, -300.0]])
    behav = torch.tensor([[-190.0, -195.0, -299.0]])  # log-ratios -10 (trigger), -5, -1
    naive = torch.exp(logp) / torch.exp(behav)
    assert torch.isnan(naive).all()
    adv, mask = torch.tensor([-1.0]), torch.ones(1, 3)
    assert mugrpo.veto_triggers(logp, behav, adv, mask, LOG_DELTA).tolist() == [[True, False, False]]
    keep = mugrpo.veto_mask(logp, behav, adv, mask, LOG_DELTA, "suffix_nontrigger")
    assert keep.tolist() == [[1.0, 0.0, 0.0]]
    # a delta far below fp32's range (1e-60) still works in log space
    tiny_delta = math.log(1e-60)
    trig = mugrpo.veto_triggers(
        torch.tensor([[-400.0, -400.0]]), torch.tensor([[-200.0, -300.0]]), adv, torch.ones(1, 2), tiny_delta
    )
    assert trig.tolist() == [[True, False]]  # -200 < -138.2 < -100


# ----------------------------------------------------------------------------------------------
# loss


def test_loss_scope_none_tight_clip_equals_grpo_token_mean():
    torch.manual_seed(0)
    B, T = 6, 7
    base = torch.randn(B, T) * 0.3 - 2.0
    old = base + torch.randn(B, T) * 0.4  # ratios spread on both sides of [0.8, 1.2]
    adv = torch.tensor([1.2, -0.7, 0.0, -1.5, 0.4, 2.0])
    mask = (torch.arange(T).unsqueeze(0) < torch.tensor([[7], [3], [5], [1], [6], [4]])).float()
    ref = base + torch.randn(B, T) * 0.2
    for beta in (0.0, 0.1):
        a = base.clone().requires_grad_(True)
        keep = mugrpo.veto_mask(a.detach(), old, adv, mask, LOG_DELTA, "none")
        loss_mu, st_mu = mugrpo.compute_policy_loss(
            a, old, adv, mask, eps_low=0.2, eps_high=0.2, keep=keep, ref_logp=ref, beta=beta
        )
        loss_mu.backward()
        b = base.clone().requires_grad_(True)
        loss_g, st_g = grpo.compute_policy_loss(
            b, old, adv, mask, eps_low=0.2, eps_high=0.2, loss_agg="token-mean", ref_logp=ref, beta=beta
        )
        loss_g.backward()
        assert loss_mu.item() == pytest.approx(loss_g.item(), rel=1e-6, abs=1e-7)
        assert torch.allclose(a.grad, b.grad, atol=1e-7)
        assert st_g["clipfrac"] > 0  # the case exercises the clip
        for k in st_g:
            assert st_mu[k] == pytest.approx(st_g[k], rel=1e-6, abs=1e-9), k


def test_relaxed_clip_and_keep_mask_by_hand():
    # behav = 0, so ratio = exp(logp). Row 0 A = +1, row 1 A = -1.
    logp = torch.log(torch.tensor([[7.0, 0.01, 2.0], [7.0, 0.01, 3.0]])).requires_grad_(True)
    behav = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    keep = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # token (1, 1) vetoed, (1, 2) is padding
    loss, stats = mugrpo.compute_policy_loss(logp, behav, adv, mask, eps_low=1.0, eps_high=4.0, keep=keep)
    # A>0: r=7 -> max(-7, -5) = -5 (clipped high); r=0.01 -> -0.01 (lower bound 0 never clips); r=2 -> -2
    # A<0: r=7 -> max(7, 5) = 7 (never clipped); r=0.01 vetoed. Denominator: 5 real tokens (before the veto).
    assert loss.item() == pytest.approx((-5 - 0.01 - 2 + 7) / 5, abs=1e-6)
    assert stats["clipfrac"] == pytest.approx(1 / 5) and stats["clipfrac_low"] == 0.0
    assert stats["vetoed_tokens"] == 1.0 and stats["neg_tokens"] == 2.0
    assert stats["neg_ratio_sum"] == pytest.approx(7.01, rel=1e-5)
    loss.backward()
    expected = torch.tensor([[0.0, -0.01 / 5, -2 / 5], [7 / 5, 0.0, 0.0]])  # d(-A r)/dlogp = -A r
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_loss_with_veto_keeps_denominator_and_drops_only_vetoed_gradient():
    logp, behav, adv, mask = _veto_case()
    logp = logp.clone().requires_grad_(True)
    keep = mugrpo.veto_mask(logp.detach(), behav, adv, mask, LOG_DELTA, "suffix_nontrigger")
    loss_v, _ = mugrpo.compute_policy_loss(logp, behav, adv, mask, keep=keep)
    loss_v.backward()
    g_v = logp.grad.clone()
    logp.grad = None
    loss_n, _ = mugrpo.compute_policy_loss(logp, behav, adv, mask, keep=None)
    loss_n.backward()
    vetoed = (mask == 1) & (keep == 0)
    assert vetoed.sum() == 2
    assert (g_v[vetoed] == 0).all() and (logp.grad[vetoed] != 0).all()
    assert torch.allclose(g_v[keep == 1], logp.grad[keep == 1])  # the rest is not re-weighted


def test_beta_kl_term_applies_to_vetoed_tokens_too():
    """--beta > 0: the veto masks the policy term only; the k3 KL penalty stays on every real token."""
    # one A < 0 row, rho = 1 on both tokens (logp = behav); token 1 vetoed; ref - logp = [0, log 2]
    logp = torch.tensor([[-1.0, -2.0]]).requires_grad_(True)
    behav = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.0, -2.0 + math.log(2.0)]])
    adv, mask, keep = torch.tensor([-1.0]), torch.ones(1, 2), torch.tensor([[1.0, 0.0]])
    loss, _ = mugrpo.compute_policy_loss(logp, behav, adv, mask, eps_low=1.0, eps_high=4.0, keep=keep, ref_logp=ref, beta=0.5)
    # policy: -A rho = 1 on token 0 only (token 1 vetoed); KL k3 = e^d - d - 1 = [0, 1 - ln 2]; both over n = 2
    assert loss.item() == pytest.approx(1.0 / 2 + 0.5 * (1.0 - math.log(2.0)) / 2, abs=1e-6)
    loss.backward()
    # d/dlogp: policy -A rho = 1 on token 0; KL 1 - e^d = [0, -1] times beta; all / 2
    assert torch.allclose(logp.grad, torch.tensor([[0.5, -0.25]]), atol=1e-6)


# ----------------------------------------------------------------------------------------------
# packed rollout storage (common.RolloutBatch; Mu-GRPO's stages hold hundreds of thousands of rollouts)


def _packed_batch():
    rb = common.RolloutBatch(with_engine_logps=True)  # as the vLLM engine builds it
    rows = [
        ([5, 6, 7], [300, 301, 2], "a", "stop", [-0.5, -1.25, -0.125]),
        ([5, 6, 7], [40000], "b", "length", torch.tensor([-2.0])),  # HF: a tensor slice
        ([9], [], "", "length", []),
        ([9], [1, 70000], "c", "stop", [-3.0, -0.1]),
    ]
    for row in rows:
        rb.append_row(*row)
    return rb, rows


def test_rollout_batch_rows():
    rb, rows = _packed_batch()
    assert len(rb) == 4 and rb.has_engine_logps
    assert rb.prompt(1) == [5, 6, 7] and rb.prompt(3) == [9]
    assert rb.completion(0) == [300, 301, 2] and rb.completion(2) == [] and len(rb.completion(3)) == 2
    assert all(isinstance(t, int) for t in rb.completion(3))
    assert tiny.completions(rb) == [r[1] for r in rows] and tiny.prompts(rb) == [r[0] for r in rows]
    assert rb.engine_logp(0) == [-0.5, -1.25, -0.125] and rb.engine_logp(3) == pytest.approx([-3.0, -0.1])
    assert rb.engine_logp(3)[1] == float(torch.tensor(-0.1, dtype=torch.float32))  # stored as float32
    assert rb.texts == ["a", "b", "", "c"] and rb.finish_reasons == ["stop", "length", "length", "stop"]
    assert rb.completion_lengths.tolist() == [3, 1, 0, 2] and rb.prompt_lengths.tolist() == [3, 3, 1, 1]
    assert torch.equal(rb.engine_logps_flat(), torch.tensor([-0.5, -1.25, -0.125, -2.0, -3.0, -0.1]))
    for bad in (4, -1):
        with pytest.raises(IndexError):
            rb.completion(bad)
    # pad_batch and the mask of the rows
    tb = common.token_batch_of(rb, range(4), 0)
    assert tb.input_ids[0].tolist() == [5, 6, 7, 300, 301, 2] and tb.input_ids[3].tolist() == [0, 0, 9, 1, 70000, 0]
    assert common.completion_mask_of(rb).tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]]
    # the constructor of lists of rows gives the same batch
    again = references.rollout_from_rows(
        [r[0] for r in rows], [r[1] for r in rows], rb.texts, rb.finish_reasons, [list(map(float, r[4])) for r in rows]
    )
    assert tiny.prompts(again) == tiny.prompts(rb) and tiny.completions(again) == tiny.completions(rb)
    assert tiny.engine_logps(again) == tiny.engine_logps(rb)
    assert not references.rollout_from_rows([[1]], [[2]], [], []).has_engine_logps


def test_rollout_batch_is_packed():
    """int32 tokens + int64 offsets, each run of rows of one prompt stores the prompt once, float32 log-probs."""
    rb, rows = _packed_batch()
    n_tok = 3 + 1 + 0 + 2
    expected = (
        4 * (3 + 1)
        + 8 * (2 + 1)  # two stored prompts (3 and 1 tokens) and their offsets
        + 8 * 4  # row -> stored prompt
        + 4 * n_tok
        + 8 * (4 + 1)  # completion tokens and offsets
        + 4 * n_tok
    )  # log-probs (they share the completions' offsets)
    assert references.rollout_nbytes(rb) == expected
    with pytest.raises(ValueError, match="log-probs"):
        rb.append_row([1], [2, 3], "", "stop", [-1.0])  # one log-prob per completion token
    with pytest.raises(ValueError, match="every row or for none"):
        rb.append_row([1], [2], "", "stop", None)
    assert len(rb) == len(rb.texts) == 4  # a refused row leaves nothing behind
    with pytest.raises(ValueError):
        references.rollout_from_rows([[1], [2]], [[3]], [], [])


def test_rollout_batch_memory_per_token():
    """Retained host memory per completion token: about 8 bytes packed (token + log-prob), against ~68 for lists of
    Python ints (36 bytes each above 256) and floats (32 bytes each). Measured as bench/rollout_memory.py does."""
    import tracemalloc

    g = torch.Generator().manual_seed(0)
    comps = [torch.randint(257, 150000, (400,), generator=g) for _ in range(64)]
    logps = [-torch.rand(400, generator=g) for _ in range(64)]
    prompt = list(range(1000, 1100))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    rb = common.RolloutBatch(with_engine_logps=True)
    for c, lp in zip(comps, logps):
        rb.append_row(prompt, c.tolist(), "", "stop", lp)
    packed = tracemalloc.get_traced_memory()[0] - before
    old = {
        "prompt_ids": [list(prompt) for _ in comps],
        "completion_ids": [c.tolist() for c in comps],
        "engine_logps": [lp.tolist() for lp in logps],
    }
    lists = tracemalloc.get_traced_memory()[0] - before - packed
    tracemalloc.stop()
    n_tok = 64 * 400
    assert packed / n_tok < 9.0, packed / n_tok  # 8 bytes per token + the prompt once + offsets
    assert lists / n_tok > 60.0, lists / n_tok
    del old


# ----------------------------------------------------------------------------------------------
# stage loop


def _settings(toy, out, run_name, **kw):
    return tiny.run_settings(toy, out, run_name, **{"prompts_per_step": 8, "updates_per_batch": 4, **kw})


def _rows(out, run_name):
    with open(os.path.join(out, run_name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("behav_source", ["trainer", "engine"])
def test_behaviour_logps_are_from_the_stage_start(behav_source, toy, tmp_path, monkeypatch):
    """Every update's behav_logp equals the log-probs under a snapshot of the weights taken when the stage's
    rollouts were generated; the first update's equals its own current log-probs; later updates drift away."""
    real_generate, real_logps, real_batch = engines.HFEngine.generate, common.completion_logps, common.no_grad_logps
    real_loss, real_veto = mugrpo.compute_policy_loss, mugrpo.veto_mask
    snapshots, records, calls = [], [], {"no_grad_logps": 0, "veto": 0, "loss": 0}

    def generate(self, prompt_ids, n, *a, desc="generate", **kw):
        if desc == "generate":  # a training stage starts: freeze a copy of the weights
            snapshots.append(copy.deepcopy(self.model.state_dict()))
        return real_generate(self, prompt_ids, n, *a, desc=desc, **kw)

    def completion_logps(model, tb, *a, **kw):
        lp, ent = real_logps(model, tb, *a, **kw)
        if torch.is_grad_enabled():  # an update's forward pass (no_grad_logps runs without grad)
            records.append({"stage": len(snapshots) - 1, "tb": tb, "logp": lp.detach().clone()})
        return lp, ent

    def no_grad_logps(*a, **kw):
        calls["no_grad_logps"] += 1
        return real_batch(*a, **kw)

    def veto_mask(*a, **kw):
        calls["veto"] += 1
        return real_veto(*a, **kw)

    def compute_policy_loss(logp, behav, *a, **kw):
        calls["loss"] += 1
        records[-1]["behav"] = behav.detach().clone()
        return real_loss(logp, behav, *a, **kw)

    monkeypatch.setattr(engines.HFEngine, "generate", generate)
    monkeypatch.setattr(common, "completion_logps", completion_logps)
    monkeypatch.setattr(common, "no_grad_logps", no_grad_logps)
    monkeypatch.setattr(mugrpo, "veto_mask", veto_mask)
    monkeypatch.setattr(mugrpo, "compute_policy_loss", compute_policy_loss)
    mugrpo.main(mugrpo.Args(**_settings(toy, tmp_path, "stage", behav_logp=behav_source)))

    assert len(snapshots) == 2 and len(records) == calls["loss"] == calls["veto"] > 0  # veto at every update
    assert calls["no_grad_logps"] == (2 if behav_source == "trainer" else 0)  # once per stage, never recomputed
    model = models.load_model(toy["model"], torch.device("cpu"))
    for rec in records:
        model.load_state_dict(snapshots[rec["stage"]])
        with torch.no_grad():
            stage_start, _ = real_logps(model, rec["tb"], 1.0)
        m = rec["tb"].completion_mask.bool()
        assert torch.allclose(rec["behav"][m], stage_start[m], atol=1e-4)

    rows = [r for r in _rows(tmp_path, "stage") if "losses/policy_loss" in r]
    assert [r["mugrpo/staleness"] for r in rows] == [0, 1, 2, 3, 0, 1, 2, 3]
    for k in ("mugrpo/neg_ratio_mean", "mugrpo/triggered_frac"):  # absent where a mini-batch has no A<0 token
        assert any(k in r for r in rows), k
    for r in rows:
        for k in ("mugrpo/vetoed_token_frac", "losses/clipfrac"):
            assert k in r
        assert None not in r.values(), r  # a metric with no data is left out, never null
        if r["mugrpo/staleness"] == 0:
            assert "perf/wake_s" in r and "perf/sleep_s" in r and "perf/sync_s" in r
            assert r["perf/wake_s"] + r["perf/sleep_s"] == pytest.approx(r["perf/sync_s"], abs=1e-6)
    # staleness grows: the policy moves away from the frozen behaviour policy during a stage
    kl = [r["losses/approx_kl"] for r in rows]
    if behav_source == "trainer":
        assert kl[0] == 0.0 and kl[4] == 0.0  # first update of a stage: behav_logp == current log-probs
    # once an update had a gradient (a mini-batch whose rewards varied), AdamW moves the weights at every later
    # update (its momentum), so every later update of a stage sees the policy away from the stage's start
    moved = [any(r["losses/grad_norm"] > 0 for r in rows[:i]) for i in range(len(rows))]
    assert sum(moved[i] for i in range(8) if i % 4) >= 3, kl  # the setting trains: most updates have moved
    assert all(k > 1e-5 for i, k in enumerate(kl) if i % 4 and moved[i]), kl
    drift = [(rec["logp"] - rec["behav"]).abs()[rec["tb"].completion_mask.bool()].max().item() for rec in records]
    assert drift[-1] > 1e-3


def test_baseline_flags_reproduce_grpo_py(toy, tmp_path, monkeypatch):
    """Standard GRPO by flags (mu = 4, clip [0.8, 1.2], no veto): mugrpo.py's stage loop trains exactly like
    grpo.py once both use the same advantage epsilon (grpo 1e-4, Mu-GRPO 1e-6)."""
    monkeypatch.setattr(mugrpo, "compute_advantages", lambda r, G: grpo.compute_advantages(r, G, "group"))
    s = _settings(toy, tmp_path, "mu_as_grpo", clip_low=0.2, clip_high=0.2, veto_scope="none")
    mugrpo.main(mugrpo.Args(**s))
    s = {k: v for k, v in s.items() if k not in ("veto_scope",)} | {"run_name": "grpo"}
    grpo.main(grpo.Args(**s))
    mu_rows = [r for r in _rows(tmp_path, "mu_as_grpo") if "losses/policy_loss" in r]
    g_rows = [r for r in _rows(tmp_path, "grpo") if "losses/policy_loss" in r]
    assert len(mu_rows) == len(g_rows) == 8
    for a, b in zip(mu_rows, g_rows):
        for k, v in b.items():
            if k.startswith("perf/") or k == "wall_s":
                continue
            assert a[k] == pytest.approx(v, rel=1e-5, abs=1e-7), (k, a, b)
        assert a["mugrpo/vetoed_token_frac"] == 0.0


def test_veto_fires_when_the_policy_moves_far(toy, tmp_path):
    """A huge learning rate within a stage makes some sampled tokens collapse: triggers appear, and the default
    scope vetoes post-trigger tokens of A<0 responses (logged per update)."""
    mugrpo.main(
        mugrpo.Args(
            **_settings(
                toy,
                tmp_path,
                "far",
                learning_rate=0.3,
                total_steps=1,
                prompts_per_step=16,
                updates_per_batch=8,
                max_new_tokens=8,
                veto_delta=0.1,
            )
        )
    )
    rows = [r for r in _rows(tmp_path, "far") if "losses/policy_loss" in r]
    assert sum(r["mugrpo/vetoed_token_frac"] > 0 for r in rows) >= 2
    for r in rows:  # no veto without a triggered A<0 response; none at the stage's first update (ratio = 1)
        if not r.get("mugrpo/triggered_frac"):
            assert r["mugrpo/vetoed_token_frac"] == 0.0
    assert rows[0]["mugrpo/vetoed_token_frac"] == 0.0 and rows[0]["mugrpo/staleness"] == 0


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--prompts-per-step", "6", "--updates-per-batch", "4"], "multiple of --updates-per-batch"),
        (["--veto-scope", "everything"], "--veto-scope"),
        (["--behav-logp", "vllm"], "--behav-logp"),
        (["--veto-delta", "0"], "--veto-delta"),
    ],
)
def test_bad_stage_flags_one_clear_line(flags, needle, tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "mugrpo.py"), *flags, "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and needle in err[0] and "Traceback" not in proc.stderr


def test_stage_defaults_are_redeclared_not_the_common_block():
    """`python mugrpo.py` runs Mu-GRPO stages by default: 3 stages x mu 8 x 4 prompts per update, the same budget
    as grpo.py's default (updates, rollouts, prompts per update), with the relaxed clip and the H_kappa veto."""
    a, g = mugrpo.Args(), grpo.Args()
    assert (a.total_steps, a.updates_per_batch, a.prompts_per_step) == (3, 8, 32)
    assert a.total_steps * a.updates_per_batch == g.total_steps * g.updates_per_batch  # optimizer updates
    assert a.total_steps * a.prompts_per_step == g.total_steps * g.prompts_per_step  # rollouts
    assert (a.clip_low, a.clip_high, a.veto_scope, a.behav_logp) == (1.0, 4.0, "suffix_nontrigger", "trainer")
    names = [f.name for f in mugrpo.Args.__dataclass_fields__.values()]
    assert names[: len(grpo.Args.__dataclass_fields__) - 4] == [f for f in grpo.Args.__dataclass_fields__][:-4]


def test_veto_scopes_are_the_flag_choices():
    assert set(VETO_SCOPES) == set(EXPECTED_ROW0)  # every choice of --veto-scope has a hand-computed mask above
    with pytest.raises(ValueError, match="unknown veto scope"):
        mugrpo.veto_mask(*_veto_case(), LOG_DELTA, "suffix-nontrigger")
