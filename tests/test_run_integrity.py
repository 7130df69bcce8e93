"""A run never silently does something other than what was asked (issue 60): --resume keeps the run's own settings, a
run that cannot learn says so, non-finite numbers stop the run where they appear, the command line takes only what
it was given, progress bars follow tqdm's own switch-off and files the user's umask. Each test fails on 08e5dbc."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import subprocess
import sys

import pytest
import torch

import common
import engines
import grpo
import models
import outputs
import run
import verifiers
from tests import references, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    rows = [{"question": f"Say two {w}", "answer": "2"} for w in "abcdefghij"]
    return tiny.toy_task(tmp_path_factory.mktemp("integrity_toy"), rows=rows)


def cli(toy, out, name, *extra):
    """A tiny run's command line on the toy file (not the default arith), checkpoints every step."""
    flags = tiny.as_flags(
        tiny.run_settings(toy, out, name, total_steps=3, prompts_per_step=2, num_generations=4, eval_samples=1, eval_k=[1])
    )
    return [*flags, "--save-every", "1", *extra]


def main(argv):
    grpo.main(run.parse_args(grpo.Args, argv))


# ----- resume keeps the run


def test_resume_takes_the_runs_own_settings(toy, tmp_path, capsys):
    """08e5dbc: `--resume run --total-steps 4` trained step 4 on the default arith task at the default sizes, rewrote
    args.json to arith and dropped --save-every (no step-4 checkpoint)."""
    main(cli(toy, tmp_path, "a"))
    run_dir = tmp_path / "a"
    main(["--resume", str(run_dir), "--total-steps", "4"])
    recorded = json.loads((run_dir / "args.json").read_text())
    assert recorded["dataset"] == toy["data"] and recorded["prompts_per_step"] == 2 and recorded["save_every"] == 1
    assert recorded["total_steps"] == 4
    assert (run_dir / "checkpoints" / "step_000004").is_dir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "rollout/reward_mean" in r][-1] == 4
    assert {r.get("eval/protocol") for r in rows if "eval/protocol" in r} == {rows[0]["eval/protocol"]}  # one evaluation
    (resumed,) = [json.loads(line) for line in (run_dir / "resumes.jsonl").read_text().splitlines()]
    assert resumed["step"] == 3 and resumed["changed"] == {"total_steps": [3, 4]}
    assert "resumed with total_steps 3 -> 4 from step 3 (resumes.jsonl)" in capsys.readouterr().out


@pytest.fixture(scope="module")
def finished(toy, tmp_path_factory):
    out = tmp_path_factory.mktemp("finished")
    main(cli(toy, out, "r"))
    return out / "r"


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--learning-rate", "0.1"], "--learning-rate 0.1: the run {run} was started with --learning-rate 0.003"),
        (["--dataset", "arith"], "--dataset arith: the run {run} was started with --dataset"),
        (["--num-generations", "8"], "--num-generations 8: the run {run} was started with --num-generations 4"),
        (["--eval-samples", "4"], "--eval-samples 4: the run {run} was started with --eval-samples 1"),
        (["--seed", "2"], "--seed 2: the run {run} was started with --seed 1"),
        (["--clip-high", "0.28"], "--clip-high 0.28: the run {run} was started with --clip-high 0.2"),
    ],
)
def test_a_flag_that_changes_the_run_is_refused_on_resume(finished, flags, needle):
    with pytest.raises(verifiers.UserError) as exc:
        run.parse_args(grpo.Args, ["--resume", str(finished), "--total-steps", "5", *flags])
    assert needle.format(run=finished) in str(exc.value) and "drop the flag, or start a new run" in str(exc.value)


def test_resume_takes_the_same_values_and_the_flags_that_may_change(finished):
    args = run.parse_args(
        grpo.Args,
        ["--resume", str(finished / "checkpoints" / "step_000002"), "--learning-rate", "0.003", "--total-steps", "6"]
        + ["--eval-every", "2", "--keep-last", "3", "--micro-batch-tokens", "512"],
    )
    assert (args.total_steps, args.eval_every, args.keep_last, args.micro_batch_tokens) == (6, 2, 3, 512)
    assert args.prompts_per_step == 2 and args.save_every == 1  # the rest: as the run was started
    with pytest.raises(verifiers.UserError, match="a resumed run keeps the settings it was started with"):
        run.parse_args(grpo.Args, ["--resume", str(finished), "--config", str(finished / "args.json")])


def test_a_run_of_another_script_is_refused(finished):
    import gapo

    with pytest.raises(verifiers.UserError, match="the run was made by grpo.py; resume it with that script"):
        run.parse_args(gapo.Args, ["--resume", str(finished)])


def test_the_trainer_state_is_read_without_unpickling_objects(finished, tmp_path):
    """08e5dbc read trainer_state.pt with weights_only=False: a pickle from a folder the user names ran its code."""
    ckpt = finished / "checkpoints" / "step_000003"
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)  # what the scripts write loads without objects
    assert state["step"] == 3 and "sampler" in state
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({**state, "rng": Payload()}, ckpt / "trainer_state.pt")
    try:
        with pytest.raises(ValueError, match="trainer_state.pt is unreadable"):
            outputs.read_checkpoint(str(ckpt))
        assert not marker.exists()
    finally:
        torch.save(state, ckpt / "trainer_state.pt")


# ----- a run that cannot learn says so


def test_learning_signal_by_hand(capsys):
    common.SIGNAL_SAID.clear()
    varied = {"rollout/truncated_frac": 0.5, "rollout/zero_adv_group_frac": 0.5, "rollout/reward_mean": 0.3}
    moved = [{"losses/policy_loss": 0.1, "losses/grad_norm": 0.5}]
    assert common.learning_signal(1, varied, moved) == dict.fromkeys(
        ("signal/all_truncated", "signal/equal_rewards", "signal/zero_update"), 0.0
    )
    assert capsys.readouterr().err == ""
    stuck = {"rollout/truncated_frac": 1.0, "rollout/zero_adv_group_frac": 1.0, "rollout/reward_mean": 0.0}
    still = [{"losses/policy_loss": 0.0, "losses/grad_norm": 0.0}] * 2
    assert set(common.learning_signal(2, stuck, still).values()) == {1.0}
    err = capsys.readouterr().err
    assert (
        "warning: step 2 cannot learn: every completion was cut at --max-new-tokens" in err and "raise --max-new-tokens" in err
    )
    assert "every group's rewards were equal, so every advantage is 0" in err and "--num-generations" in err
    assert "the policy loss and the gradient were exactly 0 at every update" in err
    common.learning_signal(3, stuck, still)
    assert capsys.readouterr().err == ""  # once each per run
    # a method whose signal is not the reward (opd.py without --opd-reward): equal rewards are no cause
    common.SIGNAL_SAID.clear()
    assert (
        common.learning_signal(1, {"rollout/zero_adv_group_frac": 1.0}, moved, rewards_matter=False)["signal/equal_rewards"]
        == 0.0
    )
    common.SIGNAL_SAID.clear()


def test_runs_built_to_learn_nothing_say_so(toy, tmp_path, capsys):
    common.SIGNAL_SAID.clear()
    zero = tmp_path / "zero.py"
    zero.write_text("def reward(completion, problem):\n    return 0.0\n")
    main(cli(toy, tmp_path, "zero", "--reward", f"{zero}:reward", "--save-every", "0"))
    err = capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "zero" / "metrics.jsonl").read_text().splitlines()]
    first = [r for r in rows if "signal/equal_rewards" in r]
    assert first and all(r["signal/equal_rewards"] == 1.0 and r["signal/zero_update"] == 1.0 for r in first)
    assert err.count("cannot learn: every group's rewards were equal") == 1 and err.count("exactly 0 at every update") == 1
    assert "warning: step 1 cannot learn" in err
    common.SIGNAL_SAID.clear()
    main(cli(toy, tmp_path, "cut", "--max-new-tokens", "1", "--save-every", "0", "--eval-max-new-tokens", "4"))
    err = capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    cut = [r["step"] for r in rows if r.get("rollout/truncated_frac") == 1.0]
    assert cut, "the tiny model ended a 1-token completion: pick another seed"
    assert f"warning: step {cut[0]} cannot learn: every completion was cut at --max-new-tokens" in err
    assert all(
        r["signal/all_truncated"] == float(r["rollout/truncated_frac"] == 1.0) for r in rows if "signal/all_truncated" in r
    )
    common.SIGNAL_SAID.clear()


# ----- non-finite numbers stop the run


def nan_logits_model(model, every: bool = True):
    """The model's forward with NaN logits (every call, or only where grad is enabled: training, not generation)."""
    forward = model.forward

    def broken(*a, **kw):
        out = forward(*a, **kw)
        if every or torch.is_grad_enabled():
            out.logits = out.logits * float("nan")
        return out

    model.forward = broken
    return model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tiny.make_tiny_model(str(tmp_path_factory.mktemp("nan_model") / "m"))
    return path


def test_the_hf_engines_refuse_to_sample_from_broken_logits(tiny_model):
    """08e5dbc sampled token V-1 with a NaN log-prob from NaN logits (and trained on it)."""
    tok = models.load_tokenizer(tiny_model)
    prompts = [tok("ab", add_special_tokens=False)["input_ids"]]
    for cls in (engines.HFEngine, engines.StaticHFEngine):
        model = nan_logits_model(models.load_model(tiny_model, torch.device("cpu")))
        engine = cls(model, tok, return_logps=True)
        with pytest.raises(common.NonFiniteError, match="in the hf engine's logits at token 0"):
            engine.generate(prompts, 2, 4, 1.0, seed=0)
    with pytest.raises(verifiers.RunError, match="in the rollout of step 7"):
        common.generate_rollout(engine, prompts, 2, 4, 1.0, 0, [[0, 1]], 7)


@pytest.mark.parametrize(
    "name,values,where",
    [
        ("logp", {"logp": torch.tensor([[0.0, float("nan")]])}, "the trainer's log-probs"),
        ("old", {"logp": torch.zeros(1, 2), "old": torch.tensor([[float("inf"), 0.0]])}, "the old log-probs (pi_old)"),
        ("ref", {"logp": torch.zeros(1, 2), "ref": torch.tensor([[0.0, -float("inf")]])}, "the reference model's log-probs"),
        ("loss", {"logp": torch.zeros(1, 2), "loss": torch.tensor(float("nan"))}, "the policy loss"),
    ],
)
def test_check_finite_names_where_and_the_step(name, values, where):
    mask = torch.ones(1, 2)
    with pytest.raises(verifiers.RunError, match=re.escape(f"non-finite values (NaN or inf) in {where} at step 5 (update 9)")):
        common.check_finite(5, 9, mask, **values)
    # outside the mask (padding, rows out of the loss) a value is never read
    common.check_finite(5, 9, torch.tensor([[1.0, 0.0]]), logp=torch.tensor([[0.0, float("nan")]]))


def test_a_run_on_nan_log_probs_stops_with_one_line(toy, tmp_path, monkeypatch):
    """The trainer's log-probs broken (the LM head's chunk; the engine's intact): the run stops at step 1, before any
    backward (08e5dbc trained on them: only a non-finite gradient stopped it)."""
    chunk = common.chunk_logp_entropy

    def broken(*a, **kw):
        logp, entropy = chunk(*a, **kw)
        return logp * float("nan"), entropy

    monkeypatch.setattr(common, "chunk_logp_entropy", broken)
    backward = torch.Tensor.backward
    monkeypatch.setattr(torch.Tensor, "backward", lambda *a, **k: pytest.fail("a backward ran on broken numbers"))
    try:
        with pytest.raises(verifiers.RunError, match=re.escape("in the trainer's log-probs at step 1 (update 1)")):
            main(cli(toy, tmp_path, "nan", "--save-every", "0"))
    finally:
        monkeypatch.setattr(torch.Tensor, "backward", backward)


def test_the_drift_check_fails_on_nan(tmp_path):
    """08e5dbc's `mean > max_diff` passed a NaN mean: the engine's NaN log-probs were trained on."""
    rollout = references.rollout_from_rows([[1]], [[2, 3]], engine_logps=[[float("nan"), -1.0]])
    mask = common.completion_mask_of(rollout)
    correction = common.RolloutCorrection(rollout, mask, "none", 0.0, 0.1)
    correction.weights([0], torch.zeros(1, 2), mask)  # the update loop's first micro-batch
    with pytest.raises(verifiers.RunError, match="not sampling from the trainer's weights: mean .* nan nats"):
        correction.check_engine(3)


# ----- the command line takes only what it was given


@pytest.mark.parametrize(
    "token,meant",
    [("--num-generation", "--num-generations"), ("--resum", "--resume"), ("--eval-s", "--eval-samples")],
)
def test_no_abbreviated_flags(token, meant):
    """08e5dbc took --num-generation 4 for --num-generations and started a default run."""
    with pytest.raises(verifiers.UserError) as exc:
        run.parse_args(grpo.Args, [token, "4"])
    assert f"{token} is not a flag (flags are never abbreviated): did you mean {meant}" in str(exc.value)


def test_help_spells_flags_with_dashes_in_groups_the_methods_first():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "gapo.py"), "--help"], capture_output=True, text=True, cwd=ROOT)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and lines[0] == "usage: python gapo.py [--flag value ...]"
    flags = [line.split()[0] for line in lines if line.strip().startswith("--")]
    assert flags and not [f for f in flags if "_" in f]  # --num-generations, never --num_generations
    own = lines.index("gapo.py's own flags (the method):")
    assert own < 12 and any("--clip-high-max" in line for line in lines[own : own + 40])
    assert lines.index("model and data:") > own and "evaluation (docs/evaluation.md):" in lines
    every = {f.name for f in dataclasses.fields(run.Args)}
    grouped = {n for names in run.FLAG_GROUPS.values() for n in names.split()}
    assert every <= grouped, every - grouped  # every common flag in one group
    assert run.parse_args(grpo.Args, ["--num_generations", "4"]).num_generations == 4  # the alias still parses


# ----- logs and files


def test_progress_bars_follow_tqdm(monkeypatch):
    """08e5dbc passed disable=False on rank 0, which overrides tqdm's switch-off on a non-terminal and TQDM_DISABLE."""
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert common.bars_off() is None  # tqdm's own rule: off where the output is not a terminal
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert common.bars_off() is True


def test_a_runs_log_file_holds_no_bar_redraws(toy, tmp_path):
    flags = cli(toy, tmp_path, "log", "--total-steps", "2", "--save-every", "0")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "grpo.py"), *flags], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "step 2/2" in out and "it/s]" not in out and "seq/s]" not in out and "upd/s]" not in out and "step/s]" not in out


def test_the_run_folders_files_follow_the_umask(toy, tmp_path):
    """08e5dbc wrote model.safetensors 0600: a run folder shared with a group could not be read by it."""
    old = os.umask(0o027)
    try:
        main(cli(toy, tmp_path, "perm", "--total-steps", "1"))
    finally:
        os.umask(old)
    for path in [
        tmp_path / "perm" / "final" / "model.safetensors",
        tmp_path / "perm" / "checkpoints" / "step_000001" / "trainer_state.pt",
    ]:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o640, path
    weights = tmp_path / "perm" / "checkpoints" / "step_000001" / "model" / "model.safetensors"
    assert stat.S_IMODE(os.stat(weights).st_mode) == 0o640
