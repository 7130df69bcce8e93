"""Run folder outputs: `final/` after every training run, the checkpoint layout (HF folder without optimizer state
+ trainer_state.pt), --keep-last, removal of half-written `.tmp_*` folders, checks of a checkpoint before any model
is loaded with fallback to the newest complete one, and a torn last line of metrics.jsonl on resume."""

import json
import os
import shutil

import pytest
import torch

import grpo
import models
import outputs
import run
import verifiers
from tests import tiny


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    rows = [{"question": f"Say two {w}", "answer": "2"} for w in "abcdefghij"]
    return tiny.toy_task(tmp_path_factory.mktemp("ckpt_toy"), rows=rows)


def _args(toy, out, name, steps, **kw):
    settings = dict(total_steps=steps, prompts_per_step=2, num_generations=4, updates_per_batch=2, eval_samples=1, eval_k=[1])
    return grpo.Args(**tiny.run_settings(toy, out, name, **{**settings, **kw}))


def _rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]  # every line parses


def _train(rows):
    return [
        {k: v for k, v in r.items() if not k.startswith("perf/") and k != "wall_s"} for r in rows if "losses/policy_loss" in r
    ]


@pytest.fixture(scope="module")
def trained(toy, tmp_path_factory):
    """One grpo run of 3 steps, a checkpoint every step, --keep-last 2."""
    out = tmp_path_factory.mktemp("ckpt_runs")
    grpo.main(_args(toy, out, "run", 3, save_every=1, keep_last=2))
    return out / "run"


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def test_final_model_is_a_complete_hf_folder_without_optimizer_state(trained, toy):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = trained / "final"
    names = set(os.listdir(final))
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names, names
    assert not [n for n in names if n.endswith((".pt", ".bin", ".pth")) or "optim" in n], names
    assert models.hf_folder_problem(str(final)) is None
    model = AutoModelForCausalLM.from_pretrained(str(final))
    assert model.config.use_cache is True  # training switches it off; the saved model generates with the KV cache
    assert AutoTokenizer.from_pretrained(str(final)).chat_template == tiny.CHAT_TEMPLATE
    # the trained weights: those of the last step's checkpoint, not the initial model's
    final_w, last_w, init_w = (
        _weights(final),
        _weights(trained / "checkpoints" / "step_000003" / "model"),
        _weights(toy["model"]),
    )
    assert final_w.keys() == last_w.keys() == init_w.keys()
    assert all(torch.equal(final_w[k], last_w[k]) for k in final_w)
    assert any(not torch.equal(final_w[k], init_w[k]) for k in final_w)


def test_final_model_path_is_printed_and_written_without_save_every(toy, tmp_path, capsys):
    grpo.main(_args(toy, tmp_path, "plain", 1))
    out = capsys.readouterr().out
    assert f"final model: {tmp_path / 'plain' / 'final'}" in out
    assert models.hf_folder_problem(str(tmp_path / "plain" / "final")) is None
    assert not os.path.exists(tmp_path / "plain" / "checkpoints")
    assert not [n for n in os.listdir(tmp_path / "plain") if n.startswith(".tmp")]


def test_checkpoint_layout_and_keep_last(trained):
    ckpts = trained / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["step_000002", "step_000003"]  # --keep-last 2 removed step 1
    assert sorted(os.listdir(ckpts / "step_000003")) == ["model", "optimizer", "trainer_state.pt"]
    model_files = os.listdir(ckpts / "step_000003" / "model")
    assert "model.safetensors" in model_files and not [n for n in model_files if n.endswith(".pt")]
    state = torch.load(ckpts / "step_000003" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 3 and state["update"] == 6 and "optimizer" not in state
    assert (ckpts / "step_000003" / "optimizer" / ".metadata").is_file()  # Adam moments: a Distributed Checkpoint


def test_resume_skips_a_broken_checkpoint_removes_tmp_and_tolerates_a_torn_metrics_line(trained, toy, tmp_path, capsys):
    run_path = tmp_path / "killed"
    shutil.copytree(trained, run_path)
    original = _train(_rows(run_path))
    ckpts = run_path / "checkpoints"
    # what a kill leaves: half-written folders, a cut-off trainer_state.pt, a torn last metrics line
    (ckpts / ".tmp_step_000004_999999" / "model").mkdir(parents=True)
    (ckpts / ".tmp_step_000004_999999" / "model" / "model.safetensors").write_bytes(b"\0" * 100)
    (run_path / ".tmp_final_999999").mkdir()
    state_file = ckpts / "step_000003" / "trainer_state.pt"
    state_file.write_bytes(state_file.read_bytes()[:1000])
    with open(run_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "update": 7, "losses/pol')
    capsys.readouterr()

    grpo.main(_args(toy, tmp_path, "ignored", 4, save_every=1, keep_last=2, resume=str(run_path)))
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning:") and "were cut at" not in line]
    assert len(warnings) == 2, captured.err  # (the tiny model's 3-token answers are cut: a warning of evaluation's)
    assert "step_000003 (trainer_state.pt is unreadable" in warnings[0] and "resuming from step_000002" in warnings[0]
    assert "metrics.jsonl: dropped 1 unparsable line" in warnings[1]
    assert "removed 1 half-written" in captured.out
    assert not [p for d in (run_path, ckpts) for p in os.listdir(d) if p.startswith(".tmp")]
    assert sorted(os.listdir(ckpts)) == ["step_000003", "step_000004"]
    resumed = _train(_rows(run_path))  # every line parses
    assert [r["update"] for r in resumed] == list(range(1, 9))  # each update exactly once
    # the re-run step 3 (from step 2's checkpoint) reproduces the original step 3
    for a, b in zip(original[4:6], resumed[4:6]):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k
    assert models.hf_folder_problem(str(run_path / "final")) is None


# ----- unit level: no training


@pytest.fixture
def saved(toy, tmp_path):
    """A run folder with checkpoints at steps 1, 2, 3 of the tiny model (optimizer state non-empty)."""
    device = torch.device("cpu")
    model = models.load_model(toy["model"], device)
    tokenizer = models.load_tokenizer(toy["model"])
    optimizer, scheduler = models.make_optimizer(model, run.Args(learning_rate=1e-3, weight_decay=0.0, warmup_updates=1))
    run_path = tmp_path / "run"
    for step in (1, 2, 3):
        model(torch.tensor([[3, 4, 5]])).logits.mean().backward()
        optimizer.step()
        scheduler.step()
        outputs.save_checkpoint(
            run.Args(keep_last=0),
            str(run_path),
            step,
            model,
            tokenizer,
            optimizer,
            scheduler,
            {"update": step, "sampler": {"epoch": 0, "pos": step}},
        )
    return {"run": run_path, "model": model, "tokenizer": tokenizer, "optimizer": optimizer, "scheduler": scheduler}


def _ck(run_path, step):
    return run_path / "checkpoints" / f"step_{step:06d}"


def _cut(path, n=10):
    path.write_bytes(path.read_bytes()[:-n])


def test_find_resume_falls_back_to_the_newest_complete_checkpoint(saved, capsys):
    run_path = saved["run"]
    run_dir, model_dir, state = outputs.find_resume(str(run_path))
    assert (run_dir, model_dir, state["step"]) == (str(run_path), str(_ck(run_path, 3) / "model"), 3)
    _cut(_ck(run_path, 3) / "model" / "model.safetensors")
    _, model_dir, state = outputs.find_resume(str(run_path))
    assert model_dir == str(_ck(run_path, 2) / "model") and state["step"] == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step_000003 (model.safetensors is truncated" in err[0], err
    (_ck(run_path, 2) / "trainer_state.pt").write_bytes(b"not a zip")
    _, model_dir, state = outputs.find_resume(str(run_path))
    assert state["step"] == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step_000003" in err[0] and "step_000002 (trainer_state.pt is unreadable" in err[0]
    _cut(_ck(run_path, 1) / "model" / "config.json")
    with pytest.raises(
        verifiers.UserError,
        match="no complete checkpoint: step_000003 .*; step_000002 .*; step_000001 "
        r"\(config.json .* is unreadable or cut off",
    ):
        outputs.find_resume(str(run_path))


def test_find_resume_explicit_checkpoint_and_finished_run(saved):
    run_path = saved["run"]
    for path in (_ck(run_path, 2), _ck(run_path, 2) / "model", str(_ck(run_path, 2)) + "/"):
        run_dir, model_dir, state = outputs.find_resume(str(path))
        assert (run_dir, model_dir, state["step"]) == (str(run_path), str(_ck(run_path, 2) / "model"), 2)
    with pytest.raises(verifiers.UserError, match="checkpoint is at step 3, --total-steps is 3: nothing left"):
        outputs.find_resume(str(run_path), total_steps=3)
    assert outputs.find_resume(str(run_path), total_steps=4)[2]["step"] == 3
    _cut(_ck(run_path, 2) / "trainer_state.pt", 100)
    with pytest.raises(verifiers.UserError, match="broken checkpoint .*trainer_state.pt is unreadable.*pass the run folder"):
        outputs.find_resume(str(_ck(run_path, 2)))
    with pytest.raises(verifiers.UserError, match="no checkpoint found"):
        outputs.find_resume(str(run_path / "nothing"))


def test_model_flag_takes_a_checkpoint_folder(saved, tmp_path):
    ck = _ck(saved["run"], 2)
    assert models.resolve_model_path(str(ck)) == str(ck / "model")
    run.validate_args(grpo.Args(model=str(ck), output_dir=str(tmp_path / "runs")))
    _cut(ck / "model" / "model.safetensors")
    with pytest.raises(verifiers.UserError, match="model.safetensors is truncated"):
        run.validate_args(grpo.Args(model=str(ck), output_dir=str(tmp_path / "runs")))


def test_checkpoints_of_the_old_layout_still_resume(saved):
    """Before `model/` existed, the HF files and trainer_state.pt shared step_N/."""
    ck = _ck(saved["run"], 3)
    for name in os.listdir(ck / "model"):
        os.replace(ck / "model" / name, ck / name)
    os.rmdir(ck / "model")
    _, model_dir, state = outputs.find_resume(str(saved["run"]))
    assert model_dir == str(ck) and state["step"] == 3


def test_trainer_state_restores_optimizer_and_rng(saved):
    _, _, state = outputs.find_resume(str(saved["run"]))
    model = models.load_model(str(_ck(saved["run"], 3) / "model"), torch.device("cpu"))
    optimizer, scheduler = models.make_optimizer(model, run.Args(learning_rate=1e-3, weight_decay=0.0, warmup_updates=1))
    torch.manual_seed(123)
    outputs.load_trainer_state(state, optimizer, scheduler, model)
    a, b = optimizer.state_dict()["state"], saved["optimizer"].state_dict()["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[i]["exp_avg"], b[i]["exp_avg"]) for i in a)
    assert scheduler.state_dict()["last_epoch"] == 3
    assert torch.equal(torch.get_rng_state(), state["rng"]["torch"])


def test_keep_last_never_removes_the_new_or_a_newer_checkpoint(saved):
    run_path, s = saved["run"], saved
    outputs.save_checkpoint(
        run.Args(keep_last=0), str(run_path), 4, s["model"], s["tokenizer"], s["optimizer"], s["scheduler"], {}
    )
    # resumed from an older checkpoint: rewriting step 2 keeps steps 3 and 4 (the run will overwrite them)
    outputs.save_checkpoint(
        run.Args(keep_last=2), str(run_path), 2, s["model"], s["tokenizer"], s["optimizer"], s["scheduler"], {}
    )
    assert sorted(os.listdir(run_path / "checkpoints")) == ["step_000001", "step_000002", "step_000003", "step_000004"]
    outputs.save_checkpoint(
        run.Args(keep_last=2), str(run_path), 5, s["model"], s["tokenizer"], s["optimizer"], s["scheduler"], {}
    )
    assert sorted(os.listdir(run_path / "checkpoints")) == ["step_000004", "step_000005"]


def _save(s, step, **kw):
    outputs.save_checkpoint(
        run.Args(**kw), str(s["run"]), step, s["model"], s["tokenizer"], s["optimizer"], s["scheduler"], {}
    )


def test_keep_last_retires_old_checkpoints_before_the_write(saved, monkeypatch):
    """--keep-last 2: the checkpoints the write would retire go first (the newest stays intact), so the disk never
    holds more than two; --keep-last 1: the old one goes once the new one is complete. On the code before, each write
    sat beside every kept checkpoint (three at once with --keep-last 2)."""
    run_path, present = saved["run"], []
    write = outputs.save_hf_folder

    def counting(model, tokenizer, path):
        present.append(len(outputs.checkpoint_dirs(str(run_path))))
        write(model, tokenizer, path)

    monkeypatch.setattr(outputs, "save_hf_folder", counting)
    _save(saved, 4, keep_last=2)
    _save(saved, 5, keep_last=2)
    assert present == [1, 1] and sorted(os.listdir(run_path / "checkpoints")) == ["step_000004", "step_000005"]
    _save(saved, 6, keep_last=1)
    assert present[-1] == 2 and os.listdir(run_path / "checkpoints") == ["step_000006"]


def test_a_checkpoint_the_disk_cannot_hold_stops_the_run_before_it_is_written(saved, monkeypatch):
    run_path, model = saved["run"], saved["model"]
    usage = shutil.disk_usage(run_path)
    need = outputs.checkpoint_bytes(model)
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda path: usage._replace(free=need // 2))
    with pytest.raises(
        verifiers.RunError, match=rf"checkpoint of step 4 needs about .*, .* are free on .*--resume {run_path}"
    ):
        _save(saved, 4, keep_last=2)
    assert sorted(os.listdir(run_path / "checkpoints")) == ["step_000003"]  # retired by --keep-last 2; nothing half-written
    assert outputs.find_resume(str(run_path))[2]["step"] == 3
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda path: usage._replace(free=outputs.model_bytes(model) // 2))
    with pytest.raises(verifiers.RunError, match="the final model needs about .*step_000003 holds the trained model"):
        outputs.save_final_model(str(run_path), model, saved["tokenizer"])
    assert not os.path.exists(run_path / "final") and not [n for n in os.listdir(run_path) if n.startswith(".tmp")]


def test_the_checkpoint_size_is_said_when_a_run_starts_and_is_what_a_checkpoint_holds(saved, tmp_path, monkeypatch, capsys):
    model = saved["model"]
    weights = sum(p.numel() for p in model.parameters()) * 4  # fp32
    assert outputs.model_bytes(model) == weights and outputs.checkpoint_bytes(model) == 3 * weights  # + two AdamW moments
    # against the files of a real checkpoint, of a model large enough for the per-tensor headers not to count
    wide = models.load_model(tiny.make_tiny_model(str(tmp_path / "wide"), hidden=256), torch.device("cpu"))
    optimizer, scheduler = models.make_optimizer(wide, run.Args(learning_rate=1e-3, weight_decay=0.0, warmup_updates=1))
    wide(torch.tensor([[3, 4, 5]])).logits.mean().backward()
    optimizer.step()
    ckpt = outputs.save_checkpoint(
        run.Args(keep_last=0), str(tmp_path / "run"), 1, wide, saved["tokenizer"], optimizer, scheduler, {}
    )
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(ckpt) for f in files)
    assert 1.0 <= on_disk / outputs.checkpoint_bytes(wide) < 1.05, (on_disk, outputs.checkpoint_bytes(wide))
    capsys.readouterr()
    outputs.plan_checkpoints(run.Args(save_every=10, keep_last=2, total_steps=100), str(saved["run"]), model)
    out = capsys.readouterr().out
    size = f"{3 * weights / 1e6:.3g} MB"
    assert f"checkpoints: {size} each" in out and "10 in this run, the newest 2 kept" in out and "free" in out
    usage = shutil.disk_usage(saved["run"])
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda path: usage._replace(free=weights))
    with pytest.raises(verifiers.UserError, match="free on .*--output-dir"):
        outputs.plan_checkpoints(run.Args(save_every=10, keep_last=2, total_steps=100), str(saved["run"]), model)
    outputs.plan_checkpoints(
        run.Args(save_every=0, keep_last=2, total_steps=100), str(saved["run"]), model
    )  # the final model fits


def test_save_removes_half_written_tmp_folders(saved, capsys):
    run_path, s = saved["run"], saved
    stale = run_path / "checkpoints" / ".tmp_step_000009_424242"
    (stale / "model").mkdir(parents=True)
    capsys.readouterr()
    outputs.save_checkpoint(
        run.Args(keep_last=0), str(run_path), 4, s["model"], s["tokenizer"], s["optimizer"], s["scheduler"], {}
    )
    assert not [n for n in os.listdir(run_path / "checkpoints") if n.startswith(".")]
    assert "removed 1 half-written" in capsys.readouterr().out
    (run_path / ".tmp_final_424242").mkdir()
    outputs.save_final_model(str(run_path), s["model"], s["tokenizer"])
    assert not [n for n in os.listdir(run_path) if n.startswith(".")]


def test_safetensors_completeness_check(saved):
    path = _ck(saved["run"], 1) / "model" / "model.safetensors"
    assert models.safetensors_problem(str(path)) is None
    full = path.read_bytes()
    path.write_bytes(full[:-1])
    assert "truncated" in models.safetensors_problem(str(path))
    path.write_bytes(full[:6])
    assert "truncated or unreadable" in models.safetensors_problem(str(path))
    path.write_bytes(full[:8] + b"{not json" + full[17:])
    assert "unreadable" in models.safetensors_problem(str(path))


def test_torn_metrics_line_is_dropped_and_the_file_rewritten_atomically(tmp_path, capsys, monkeypatch):
    run_path = tmp_path / "run"
    run_path.mkdir()
    rows = [{"step": s, "update": 2 * s + i, "x": 1.0} for s in range(4) for i in range(2)]
    (run_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "upd')
    (run_path / "samples.jsonl").write_text(json.dumps({"step": 0, "c": "a"}) + "\n" + json.dumps({"step": 3}) + "\n")
    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append((a, b)), real_replace(a, b)))
    logger = outputs.open_run_logger(grpo.Args(), str(run_path), resume_from_step=2)
    logger.close()
    assert _rows(run_path) == [r for r in rows if r["step"] <= 2]
    with open(run_path / "samples.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [0]
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(err) == 1 and "metrics.jsonl: dropped 1 unparsable line(s) (line 9" in err[0]
    renamed = [(os.path.basename(a), os.path.basename(b)) for a, b in replaced if b.endswith(".jsonl")]
    assert [b for _, b in renamed] == ["metrics.jsonl", "samples.jsonl"]  # written to a tmp file, renamed into place
    assert all(a.startswith(".tmp_") for a, _ in renamed)
    assert not [n for n in os.listdir(run_path) if n.startswith(".tmp")]
