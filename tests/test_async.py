"""Asynchronous rollouts (--async-lag, async_rollouts.py, docs/async.md), one test per trap of issue 52: lag 0 is the
synchronous run (every script), the lag stays within S and reaches it, every group is trained once (a resume
included), mu is the stamped version's, the stamp of a row that straddles an update, the loss choices on a toy
categorical policy, a producer that fails stops the run, bad input."""

import gc
import json
import math
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import async_rollouts
import common
import grpo
import models
import outputs
import run
from tests import tiny
from tests.test_e2e import method_overrides
from verifiers import RunError, UserError

pytestmark = pytest.mark.slow  # whole runs and producer processes: about 3 minutes on 2 cores

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(method, toy, out, name, steps, *flags):
    """A run of `method` on the toy task in a subprocess. Returns (training rows, rollouts.jsonl rows)."""
    overrides = {k: v for k, v in method_overrides(method).items() if k != "total_steps"}
    if method == "opd":
        overrides["teacher"] = tiny.teacher_model(toy)
    settings = tiny.run_settings(toy, out, name, total_steps=steps, log_rollouts_every=1, **overrides)
    cmd = [sys.executable, os.path.join(ROOT, f"{method}.py"), *tiny.as_flags(settings), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(out, name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(out, name, "rollouts.jsonl")) as f:
        rollouts = [json.loads(line) for line in f]
    return [r for r in rows if "losses/policy_loss" in r], rollouts


def _same(row):
    """What a run computes, without timings and the keys only an async run has."""
    return {k: v for k, v in row.items() if not k.startswith(("perf/", "async/", "mismatch/")) and k != "wall_s"}


@pytest.mark.parametrize("method", ["grpo", "gapo", "mugrpo", "codapo", "opd"])
def test_lag_zero_reproduces_the_synchronous_run(method, toy, tmp_path):
    """--async-lag 0 goes through the producer process, paced to wait for each step's weights: the same rows,
    rewards, losses and weights as the synchronous run, to the last bit, for 3 steps (CoDaPO's focused step among
    them): at lag 0 the two sides take turns, so each uses every core, as the synchronous run does. (With
    --rollout-threads each side sums in its own order: docs/async.md, "Lag 0".)"""
    sync_rows, sync_rollouts = _script(method, toy, tmp_path, "sync", 3)
    async_rows, async_rollouts_ = _script(method, toy, tmp_path, "lag0", 3, "--async-lag", "0")
    assert [r["completion"] for r in async_rollouts_] == [r["completion"] for r in sync_rollouts]
    assert [r["reward"] for r in async_rollouts_] == [r["reward"] for r in sync_rollouts]
    assert len(async_rows) == len(sync_rows)
    for a, s in zip(async_rows, sync_rows):
        assert {k: a.get(k) for k in _same(s)} == _same(s)
        # what an async row has beyond: its own keys, and what the engine's log-probs mu give (the producer's engine
        # always returns them; the synchronous HF engine only for a correction)
        assert {k for k in _same(a) if k not in s} <= {"mugrpo/mismatch_trigger_frac"}
    lags = [r["async/lag_max"] for r in async_rows if "async/lag_max" in r]
    assert lags == [0.0] * 3
    final = {}
    for name in ("sync", "lag0"):
        from safetensors.torch import load_file

        final[name] = load_file(os.path.join(tmp_path, name, "final", "model.safetensors"))
    assert final["sync"].keys() == final["lag0"].keys()
    assert all(torch.equal(final["sync"][k], final["lag0"][k]) for k in final["sync"])


def _prompts_per_step(rollouts):
    """{step: the step's prompts, one per group, in row order}."""
    steps = {}
    for r in rollouts:
        groups = steps.setdefault(r["step"], {})
        groups.setdefault(r["group"], r["prompt"])
    return {s: [g[k] for k in sorted(g)] for s, g in steps.items()}


def test_lag_two_stays_within_two_reaches_it_and_trains_every_group_once(toy, tmp_path):
    """S = 2 (one step ahead at 2 updates per step): no batch older than 2 updates, batches at exactly 2 in steady
    state, and the prompts trained are the synchronous run's, each group once, none dropped (conservation)."""
    rows, rollouts = _script("grpo", toy, tmp_path, "lag2", 8, "--async-lag", "2")
    lags = [r["async/lag_max"] for r in rows if "async/lag_max" in r]
    assert len(lags) == 8 and max(lags) <= 2 and lags[0] == 0
    assert lags.count(2.0) >= 4, lags  # the producer waits at the bound: steady state is the bound
    assert all(r["async/lag_mean"] == r["async/lag_max"] for r in rows if "async/lag_max" in r)
    for key in ("async/queue_depth", "perf/weight_publish_s", "perf/overlap_frac"):
        assert key in rows[0]
    _, sync_rollouts = _script("grpo", toy, tmp_path, "sync", 8)
    assert _prompts_per_step(rollouts) == _prompts_per_step(sync_rollouts)  # every group once, in order
    assert sorted({r["step"] for r in rollouts}) == list(range(1, 9))
    assert len(rollouts) == len(sync_rollouts) == 8 * 4 * 8


def test_resume_with_batches_in_flight_trains_every_group_once(toy, tmp_path, monkeypatch):
    """A run stopped after its step-2 checkpoint with the batches of steps 3 to 5 in flight (lag 4): the resumed
    run draws them again with their seeds; the prompts of steps 1..6 are the uninterrupted run's, each once."""
    settings = tiny.run_settings(toy, tmp_path, "full", total_steps=6, save_every=2, log_rollouts_every=1)
    grpo.main(grpo.Args(**settings, async_lag="4"))

    class Stop(Exception):
        pass

    save = outputs.save_checkpoint

    def save_then_stop(args, run_dir, step, *a, **kw):
        save(args, run_dir, step, *a, **kw)
        raise Stop  # the batches of steps 3 to 5 are out: dispatched, not taken

    monkeypatch.setattr(outputs, "save_checkpoint", save_then_stop)
    part = dict(settings, run_name="part")
    with pytest.raises(Stop):
        grpo.main(grpo.Args(**part, async_lag="4"))
    gc.collect()  # the stopped run's producer goes with its run: no process is left behind (pytest would wait on it)
    assert not multiprocessing.active_children()
    monkeypatch.setattr(outputs, "save_checkpoint", save)
    grpo.main(grpo.Args(**part, async_lag="4", resume=str(tmp_path / "part")))

    def prompts(name):
        with open(tmp_path / name / "rollouts.jsonl") as f:
            return _prompts_per_step([json.loads(line) for line in f])

    full, resumed = prompts("full"), prompts("part")
    assert sorted(resumed) == list(range(1, 7)) and resumed == full
    with open(tmp_path / "part" / "metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f if "rollout/reward_mean" in line]
    assert steps == list(range(1, 7))  # no step trained twice


def _tiny_args(toy, tmp_path, **kw):
    return grpo.Args(**tiny.run_settings(toy, tmp_path, "unit", **kw))


def test_mu_is_the_stamped_versions_log_probs_and_a_dead_producer_stops_the_run(toy, tmp_path):
    """The producer samples version v (published after the trainer changed its weights) and says so: its mu equals
    the trainer's forward pass under version v's weights (the engine's tolerance: CPU fp32, 1e-5), not version 0's."""
    args = _tiny_args(toy, tmp_path, async_lag="1", total_steps=3, temperature=1.0)
    model = models.load_policy(args, toy["model"], torch.device("cpu"))
    tok = models.load_tokenizer(toy["model"])
    prompts = [common.format_prompt(tok, f"Say two {w}") for w in "ab"]
    sampler = common.PromptSampler(2, 0)
    threads = torch.get_num_threads()  # the producer takes half of them from this process: given back below
    producer = async_rollouts.start(args, model, toy["model"], None, 64, lambda s, k: ([0, 1], prompts, 7 + s), sampler, 0)
    try:
        original = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        producer.publish(model, 1)  # version 1: the first update's weights
        _, rollout = producer.take(2, 2)  # step 2 trains from version 2; at lag 1 it may be sampled under version 1
        assert rollout.version == 1 and rollout.lag == 1
        pad = tok.pad_token_id
        mask = common.completion_mask_of(rollout)
        trainer = common.no_grad_logps(model, rollout, rollout.rows, pad, 1.0, 4096)  # (B, T) under version 1
        mu = torch.zeros_like(mask)
        mu[mask.bool()] = rollout.engine_logps_flat()
        assert torch.allclose(mu * mask, trainer * mask, atol=1e-5)
        with torch.no_grad():  # the same tokens under version 0's weights are far from mu
            for n, p in model.named_parameters():
                p.copy_(original[n])
        old = common.no_grad_logps(model, rollout, rollout.rows, pad, 1.0, 4096)
        assert ((old - mu).abs() * mask).max() > 1e-2
    finally:
        producer.close()
    # a producer that cannot start (its model is not there) stops the run with its reason, it does not hang
    broken = async_rollouts.start(
        args, model, str(tmp_path / "missing"), None, 64, lambda s, k: ([0], prompts[:1], s), sampler, 0
    )
    try:
        with pytest.raises(RunError, match="rollout producer failed"):
            broken.take(1, 0)
    finally:
        broken.close()
        torch.set_num_threads(threads)


def test_a_row_that_straddles_an_update_keeps_the_version_of_its_first_token(toy, tmp_path):
    """The trainer publishes version 2 while the producer is generating a batch under version 1 (the fake engine
    publishes from inside generate(), where the lock is free): the batch says version 1 (read before its first
    token, as the weights it was sampled with), not the version at its completion (rllm#622)."""
    args = _tiny_args(toy, tmp_path)
    policy = models.load_policy(args, toy["model"], torch.device("cpu")).requires_grad_(False)
    params = dict(policy.named_parameters())
    shared = {n: p.detach().clone() + 1.0 for n, p in params.items()}  # version 1: every weight + 1
    version_1 = {n: t.clone() for n, t in shared.items()}
    published, stopping, lock = type("V", (), {"value": 1})(), type("V", (), {"value": 0})(), threading.Lock()
    jobs, results = queue.Queue(), queue.Queue()
    seen = {}

    class Engine:
        name = "hf"

        def wake(self, model, version):
            seen["woken"] = version

        def generate(self, prompt_ids, n, max_new_tokens, temperature, seed=None, progress=True):
            seen["weights"] = {k: v.clone() for k, v in params.items()}  # what sampling reads: the copy's weights
            with lock:  # the trainer's update lands mid-batch
                for t in shared.values():
                    t.add_(1.0)
                published.value = 2
            batch = common.RolloutBatch(with_engine_logps=True)
            batch.append_row(prompt_ids[0], [5], "x", "stop", [-0.5])
            return batch

    jobs.put((3, [[1, 2]], 0, 1))
    jobs.put(None)
    async_rollouts.serve(SimpleArgs(), Engine(), policy, shared, published, lock, stopping, jobs, results, os.getppid())
    kind, step, batch, version, _ = results.get_nowait()
    assert (kind, step, version, seen["woken"]) == ("batch", 3, 1, 1)
    assert all(torch.equal(seen["weights"][n], version_1[n]) for n in shared)  # version 1's weights, not 2's
    assert not any(torch.equal(seen["weights"][n], shared[n]) for n in shared)


def test_a_producer_killed_while_it_waits_stops_the_run_and_never_hangs_the_trainer(toy, tmp_path):
    """The producer waits for a version the trainer has not published yet and is SIGKILLed there (the OOM killer):
    the trainer's next publish returns, and its next take stops the run with the exit code, within seconds."""
    args = _tiny_args(toy, tmp_path, async_lag="1", total_steps=4)
    model = models.load_policy(args, toy["model"], torch.device("cpu"))
    tok = models.load_tokenizer(toy["model"])
    prompts = [common.format_prompt(tok, "Say two a")]
    threads = torch.get_num_threads()
    producer = async_rollouts.start(args, model, toy["model"], None, 64, lambda s, k: ([0], prompts, s), None, 0)
    try:
        producer.base = 0  # as the first take sets it
        producer.sampler = common.PromptSampler(1, 0)
        producer.dispatch(3)  # step 3 may be sampled from version 3 on: the producer waits for it
        _wait_until_idle(producer.process.pid)  # started (its model loaded) and waiting for version 3
        os.kill(producer.process.pid, signal.SIGKILL)
        producer.process.join(10)
        publisher = threading.Thread(target=producer.publish, args=(model, 1), daemon=True)
        publisher.start()
        publisher.join(10)
        assert not publisher.is_alive(), "publish() hangs after the producer died"
        with pytest.raises(RunError, match="rollout producer died"):
            producer.take(3, 4)
    finally:
        producer.close()
        torch.set_num_threads(threads)


def _wait_until_idle(pid: int, timeout: float = 60.0) -> None:
    """Until process `pid` spends under a tenth of a core for a second (after its start): it is waiting. Not zero: a
    producer waiting for a version polls it every VERSION_POLL_S (1 to 3 clock ticks a second, measured: the test
    waited for a second of none, which came by chance); loading its model takes a whole core."""

    def cpu_ticks():
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    idle_ticks = os.sysconf("SC_CLK_TCK") // 10  # a tenth of a core for a second
    deadline, last = time.monotonic() + timeout, None
    time.sleep(1.0)
    while time.monotonic() < deadline:
        now = cpu_ticks()
        if last is not None and now - last <= idle_ticks:
            return
        last = now
        time.sleep(1.0)
    raise AssertionError(f"process {pid} kept working for {timeout} s")


class SimpleArgs:
    num_generations, max_new_tokens, temperature = 1, 1, 1.0


def test_toy_categorical_policy_stale_samples(toy):
    """Samples from a stale policy mu of a 4-way categorical pi_theta, advantages A(a) fixed. The exact on-policy
    gradient is sum_a pi(a) A(a) grad log pi(a). Through grpo.compute_policy_loss (the ratio to pi_old = pi_theta,
    the decoupled form): with the rollout correction's weights pi_old / mu (--rollout-is token-tis, C above every
    rho) it matches; the ratio taken against mu itself (bypass) matches as well; with no correction the gradient is
    E_mu's, and drifts by the distance between the two."""
    torch.manual_seed(0)
    theta = torch.tensor([0.5, -0.2, 0.1, -0.4], requires_grad=True)
    stale = torch.tensor([-0.3, 0.4, 0.2, 0.0])  # mu's logits: a few updates old
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])  # A(a)
    pi, mu = torch.softmax(theta, 0), torch.softmax(stale, 0)
    exact = torch.autograd.grad((pi.detach() * adv * torch.log_softmax(theta, 0)).sum(), theta)[0]
    n = 400_000
    a = torch.multinomial(mu, n, replacement=True)  # (n,) stale samples, one token each
    log_mu = torch.log(mu)[a].unsqueeze(1)  # (n, 1) the engine's log-probs
    mask = torch.ones(n, 1)

    def grad(mode):
        logp = torch.log_softmax(theta, 0)[a].unsqueeze(1)  # (n, 1)
        old = logp.detach()  # pi_old: the trainer's pass under the weights the step starts from
        w = common.rollout_is_weights(mode, old - log_mu, mask, cap=100.0) if mode != "bypass" else None
        ref = log_mu if mode == "bypass" else old
        loss, _ = grpo.compute_policy_loss(logp, ref, adv[a], mask, eps_low=100.0, eps_high=100.0, is_weights=w)
        return torch.autograd.grad(-loss, theta)[0]  # the surrogate's ascent direction

    corrected, bypass, uncorrected = grad("token-tis"), grad("bypass"), grad("none")
    on_mu = torch.autograd.grad((mu * adv * torch.log_softmax(theta, 0)).sum(), theta)[0]  # E_mu, what none estimates
    assert torch.allclose(corrected, exact, atol=5e-3), (corrected, exact)
    assert torch.allclose(bypass, exact, atol=5e-3), (bypass, exact)
    assert torch.allclose(uncorrected, on_mu, atol=5e-3)
    assert (uncorrected - exact).norm() > 10 * (corrected - exact).norm()
    assert (uncorrected - exact).norm() > 0.05


@pytest.mark.parametrize(
    "flags,needle",
    [
        ({"async_lag": "-1"}, "--async-lag -1: must be off or a whole number"),
        ({"async_lag": "two"}, "--async-lag two: must be off or a whole number"),
        ({"async_lag": "1", "dynamic_sampling": True}, "--async-lag with --dynamic-sampling is not supported"),
        ({"async_lag": "1", "rollout_device": "cuda:7"}, "--rollout-device cuda:7"),
        ({"async_lag": "1", "rollout_device": "tpu"}, "--rollout-device tpu"),
        ({"rollout_threads": -1}, "--rollout-threads -1"),
    ],
)
def test_bad_input_is_one_line_before_anything_loads(flags, needle, toy, tmp_path):
    with pytest.raises(UserError) as e:
        run.validate_args(_tiny_args(toy, tmp_path, **flags))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_async_refuses_torchrun_and_codapo_refuses_a_lag_past_its_focused_step(toy, tmp_path, monkeypatch):
    import codapo

    settings = tiny.run_settings(toy, tmp_path, "c")
    with pytest.raises(UserError, match="must be below --updates-per-batch with the focused step"):
        codapo.Args(**settings, async_lag="2", updates_per_batch=2)
    codapo.Args(**settings, async_lag="1", updates_per_batch=2)  # the focus is drawn after its broad step: runs
    codapo.Args(**settings, async_lag="4", focused_step=False)
    args = _tiny_args(toy, tmp_path, async_lag="0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="under torchrun it is not supported"):
        run.validate_args(args)


def test_bypass_takes_the_ratio_against_mu_and_needs_it():
    """--rollout-is bypass: no weights; the ratio's reference is the engine's mu of the micro-batch's rows."""

    class Rollout:
        rows, has_engine_logps, lag = [0, 1], True, 3

        def engine_logps_flat(self):
            return torch.tensor([-1.0, -2.0, -3.0])

    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    c = common.RolloutCorrection(Rollout(), mask, "bypass", 0.0, 0.1)
    old = torch.full((2, 2), -0.5)
    assert c.weights([0, 1], old, mask) is None
    assert torch.equal(c.ratio_reference([1], old[:1]), torch.tensor([[-3.0, 0.0]]))
    assert "rollout_is/weight_mean" not in c.metrics() and "mismatch/abs_log_rho_mean" in c.metrics()
    c.check_engine(1)  # a batch 3 updates old is not the stale-engine check's business: no error at any mismatch
    assert math.isclose(c.metrics()["mismatch/abs_log_rho_mean"], (0.5 + 1.5 + 2.5) / 3)
    c_none = common.RolloutCorrection(Rollout(), mask, "none", 0.0, 0.1)
    assert torch.equal(c_none.ratio_reference([1], old[:1]), old[:1])

    class NoLogps:
        rows, has_engine_logps, lag = [0, 1], False, 0

    with pytest.raises(RunError, match="bypass"):
        common.RolloutCorrection(NoLogps(), mask, "bypass", 0.0, 0.1)
