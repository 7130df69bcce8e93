"""The engine against the trainer: the rollout corrections (token-tis, seq-mask, icepop) against numbers computed by
hand, the identity case, their composition with each method's clip, the raw mismatch/ metrics, the stale-engine
check (an engine that skips a weight push stops the run at the next step), and the fp16 option's loss scaling."""

import copy
import importlib
import math

import pytest
import torch

import codapo
import common
import engines
import gapo
import grpo
import models
import mugrpo
import run
import verifiers
from tests import tiny

LOG_RHO = torch.log(torch.tensor([[1.0, 3.0, 0.25], [1.5, 1.0, 7.0]]))  # rho_t of two sequences
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the last token of row 2 is padding


# ----- the corrections, by hand


def test_token_tis_caps_each_rho():
    w = common.rollout_is_weights("token-tis", LOG_RHO, MASK)  # C = 2
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 0.25], [1.5, 1.0, 0.0]]))
    w = common.rollout_is_weights("token-tis", LOG_RHO, MASK, cap=1.2)
    assert torch.allclose(w, torch.tensor([[1.0, 1.2, 0.25], [1.2, 1.0, 0.0]]))


def test_seq_mask_weights_by_the_sequence_ratio_or_drops_it():
    # rho_seq: 1 * 3 * 0.25 = 0.75 and 1.5 * 1 = 1.5 (padding does not count): both <= 3
    w = common.rollout_is_weights("seq-mask", LOG_RHO, MASK)
    assert torch.allclose(w, torch.tensor([[0.75, 0.75, 0.75], [1.5, 1.5, 0.0]]))
    w = common.rollout_is_weights("seq-mask", LOG_RHO, MASK, cap=1.0)  # 1.5 > 1: the second sequence is dropped
    assert torch.allclose(w, torch.tensor([[0.75, 0.75, 0.75], [0.0, 0.0, 0.0]]))
    long = torch.full((1, 400), math.log(2.0))  # rho_seq = 2^400 overflows float32: compared in log space
    assert common.rollout_is_weights("seq-mask", long, torch.ones(1, 400)).sum() == 0


def test_icepop_keeps_rho_inside_the_band():
    w = common.rollout_is_weights("icepop", LOG_RHO, MASK)  # [0.5, 5]: 0.25 and 7 (padding anyway) are zeroed
    assert torch.allclose(w, torch.tensor([[1.0, 3.0, 0.0], [1.5, 1.0, 0.0]]))


@pytest.mark.parametrize("mode", ["token-tis", "seq-mask", "icepop"])
def test_rho_one_is_no_correction(mode):
    w = common.rollout_is_weights(mode, torch.zeros(2, 3), MASK)
    assert torch.equal(w, MASK)
    assert common.rollout_is_weights("none", LOG_RHO, MASK) is None


# ----- composition with each method's clipped term (w after the clip; the denominator unchanged)


def _ratio_batch():
    logp = torch.log(torch.tensor([[1.5, 1.0], [0.5, 4.0]])).requires_grad_()  # pi_theta / pi_old with old = 0
    old = torch.zeros(2, 2)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 2)
    w = torch.tensor([[0.5, 2.0], [1.0, 0.25]])
    return logp, old, adv, mask, w


def test_grpo_loss_times_the_weights():
    logp, old, adv, mask, w = _ratio_batch()
    # clipped terms l = max(-A r, -A clip(r, 0.8, 1.2)): row 1 (A=1): -1.2, -1.0; row 2 (A=-1): 0.8, 4.0
    loss, _ = grpo.compute_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2, is_weights=w)
    assert loss.item() == pytest.approx((0.5 * -1.2 + 2.0 * -1.0 + 1.0 * 0.8 + 0.25 * 4.0) / 4)
    plain, _ = grpo.compute_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    assert plain.item() == pytest.approx((-1.2 - 1.0 + 0.8 + 4.0) / 4)
    loss.backward()  # the clipped tokens (r = 1.5 > 1.2 with A > 0; r = 0.5 < 0.8 with A < 0) keep a zero gradient
    assert logp.grad[0, 0] == 0 and logp.grad[1, 0] == 0 and logp.grad[1, 1] == pytest.approx(0.25 * 4.0 / 4)


def test_gapo_loss_times_the_weights():
    logp, old, adv, mask, w = _ratio_batch()
    eps_high = torch.tensor([0.6, 0.2])  # the correct row's widened bound: r = 1.5 inside 1.6, unclipped
    loss, _ = gapo.compute_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=eps_high, level="token", is_weights=w)
    assert loss.item() == pytest.approx((0.5 * -1.5 + 2.0 * -1.0 + 1.0 * 0.8 + 0.25 * 4.0) / 4)


def test_mugrpo_loss_times_the_weights_and_the_veto():
    logp, old, adv, mask, w = _ratio_batch()
    keep = torch.tensor([[1.0, 1.0], [1.0, 0.0]])  # the veto removed the last token
    loss, _ = mugrpo.compute_policy_loss(logp, old, adv, mask, eps_low=1.0, eps_high=4.0, keep=keep, is_weights=w)
    # relaxed clip [0, 5]: nothing clips; l = -A r: -1.5, -1.0, 0.5, (4.0 vetoed); denominator: 4 tokens before the veto
    assert loss.item() == pytest.approx((0.5 * -1.5 + 2.0 * -1.0 + 1.0 * 0.5) / 4)


def test_codapo_loss_times_the_weights_after_the_dual_clip():
    logp, old, adv, mask, w = _ratio_batch()
    loss, st = codapo.compute_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2, dual_clip_c=3.0, is_weights=w)
    # dual clip caps the A<0 token with r = 4 at c |A| = 3: l = -1.2, -1.0, 0.8, 3.0
    assert loss.item() == pytest.approx((0.5 * -1.2 + 2.0 * -1.0 + 1.0 * 0.8 + 0.25 * 3.0) / 4)
    assert st["clipfrac_dual"] == pytest.approx(0.25)


# ----- the raw metrics


class _Rollout:
    def __init__(self, engine_logps):
        self.engine_logps, self.rows, self.has_engine_logps, self.lag = engine_logps, [0, 1], True, 0

    def engine_logps_flat(self):
        return torch.tensor([x for row in self.engine_logps for x in row])


def test_mismatch_metrics_by_hand():
    mask = MASK.clone()
    engine = [[-1.0, -2.0, -0.5], [-1.0, -3.0]]  # mu; pi_old = mu + log rho
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -3.0, 0.0]]) + LOG_RHO * MASK
    m = common.RolloutCorrection(_Rollout(engine), mask, "token-tis", 0.0, 0.0)
    w = m.weights([0, 1], old, mask)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 0.25], [1.5, 1.0, 0.0]]), atol=1e-6)
    out = m.metrics()
    lr = [0.0, math.log(3), math.log(0.25), math.log(1.5), 0.0]
    assert out["mismatch/abs_log_rho_mean"] == pytest.approx(sum(map(abs, lr)) / 5)
    assert out["mismatch/abs_log_rho_max"] == pytest.approx(math.log(4))
    assert out["mismatch/kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in lr) / 5)
    assert out["mismatch/rho_out_frac"] == pytest.approx(2 / 5)  # 3 and 0.25 are outside [0.5, 2]
    g1, g2 = math.exp(sum(lr[:3]) / 3), math.exp(sum(lr[3:]) / 2)
    assert out["mismatch/seq_rho_gmean_min"] == pytest.approx(min(g1, g2))
    assert out["mismatch/seq_rho_gmean_max"] == pytest.approx(max(g1, g2))
    assert out["mismatch/seq_rho_gmean_mean"] == pytest.approx((g1 + g2) / 2)
    assert out["rollout_is/token_changed_frac"] == pytest.approx(3 / 5)  # 3 -> 2, 0.25 and 1.5 kept but not 1
    assert out["rollout_is/token_zeroed_frac"] == 0 and out["rollout_is/seq_changed_frac"] == pytest.approx(1.0)


def test_no_engine_log_probs_is_inert():
    class NoLogps:
        has_engine_logps, rows, lag = False, [0, 1], 0

    m = common.RolloutCorrection(NoLogps(), MASK, "token-tis", 0.0, 0.1)
    assert not m.available and m.weights([0, 1], torch.zeros(2, 3), MASK) is None and m.metrics() == {}
    m.check_engine(1)  # nothing to check


# ----- a stale engine stops the run


class CopyEngine(engines.HFEngine):
    """A separate engine: its own copy of the model, updated by push_weights (as vLLM is); `skip` names the wake
    (counted from 1) whose push it skips, as a colocated engine that silently kept its old weights would."""

    def __init__(self, model, tokenizer, skip: int):
        super().__init__(copy.deepcopy(model), tokenizer, gen_batch_size=64, return_logps=True)
        self.skip, self.wakes = skip, 0

    def wake(self, model=None, version=None):
        if model is not None:
            self.wakes += 1
            if self.wakes != self.skip:
                self.model.load_state_dict(model.state_dict())


def _run(method, toy, tmp_path, monkeypatch, skip, extra=()):
    mod = importlib.import_module(method)
    monkeypatch.setattr(models, "make_engine", lambda args, model, tokenizer, *a, **kw: CopyEngine(model, tokenizer, skip))
    settings = dict(total_steps=3, max_new_tokens=4, learning_rate=0.05, warmup_updates=0)
    argv = [*tiny.run_flags(toy, tmp_path, f"{method}_{skip}", **settings), *extra]
    if method == "mugrpo":
        argv += ["--updates-per-batch", "2"]
    mod.main(run.parse_args(mod.Args, argv))


@pytest.mark.parametrize("method", ["grpo", "gapo", "mugrpo", "codapo"])
def test_engine_that_skips_a_push_stops_the_run(method, toy, tmp_path, monkeypatch):
    # wakes: 1 = the evaluation before training, 2 = step 1's rollout, 3 = step 2's: its push is skipped, so step 2
    # samples from the weights before step 1's updates
    with pytest.raises(verifiers.RunError, match="not sampling from the trainer's weights.*at step 2"):
        _run(method, toy, tmp_path, monkeypatch, skip=3)


def test_engine_that_gets_every_push_passes_and_logs_the_mismatch(toy, tmp_path, monkeypatch):
    _run("grpo", toy, tmp_path, monkeypatch, skip=0, extra=["--rollout-is", "icepop"])
    import json

    rows = [json.loads(line) for line in open(tmp_path / "grpo_0" / "metrics.jsonl")]
    first = [r for r in rows if "mismatch/abs_log_rho_mean" in r]
    assert len(first) == 3 and all(r["mismatch/abs_log_rho_mean"] < 1e-3 for r in first)  # same weights: rho ~ 1
    assert all(r["rollout_is/token_zeroed_frac"] == 0 for r in first)


# ----- fp16: the flag and the loss scaler's skip of a non-finite step


def test_fp16_is_refused_on_cpu(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("sys.argv", ["grpo.py", "--dtype", "fp16", "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        run.command_line(grpo.main, grpo.Args)
    assert exc.value.code == 2 and "--dtype fp16 needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(verifiers.UserError, match="invalid choice"):
        run.parse_args(grpo.Args, ["--dtype", "fp8"])
    assert models.model_dtypes(torch.device("cuda"), compute_dtype="fp16") == (torch.float32, torch.float16)
    assert models.model_dtypes(torch.device("cpu"), compute_dtype="fp16") == (torch.float32, None)


def _scripts_update(model, opt, scaler, x, step, update):
    """One optimizer update as the scripts' template makes it (scale, backward, unscale, clip and check, step)."""
    opt.zero_grad()
    scaler.scale(model(x).sum()).backward()
    scaler.unscale_(opt)
    norm = common.clip_grad_norm(model, 1.0, scaler, step, update)
    scaler.step(opt)
    scaler.update()
    return norm


def test_loss_scale_skips_a_non_finite_update_and_keeps_a_finite_one():
    model = torch.nn.Linear(3, 1)
    opt, _ = models.make_optimizer(model, run.Args(learning_rate=0.1, weight_decay=0.0, warmup_updates=0))
    scaler = torch.amp.GradScaler("cpu", enabled=True)  # --dtype fp16
    before = model.weight.detach().clone()
    norm = _scripts_update(model, opt, scaler, torch.tensor([[1.0, float("inf"), 0.0]]), 1, 1)  # no RunError: skipped
    assert not torch.isfinite(norm) and torch.equal(model.weight, before)
    assert common.grad_metrics(norm, scaler) == {"charts/loss_scale": 32768.0, "losses/update_skipped": 1.0}  # halved
    norm = _scripts_update(model, opt, scaler, torch.ones(1, 3), 1, 2)
    assert torch.isfinite(norm) and not torch.equal(model.weight, before)
    assert common.grad_metrics(norm, scaler)["losses/update_skipped"] == 0.0
    plain = torch.amp.GradScaler("cpu", enabled=False)  # bf16 / fp32: nothing scaled, a NaN stops the run
    with pytest.raises(verifiers.RunError, match="non-finite gradient norm"):
        _scripts_update(model, opt, plain, torch.tensor([[float("nan"), 0.0, 0.0]]), 3, 4)
    assert set(common.grad_metrics(torch.tensor(2.0), plain)) == {"losses/grad_norm"}
