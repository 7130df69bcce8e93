"""End to end: every method script on a tiny model built here (no download, no network): smoke run with
all metric keys of docs/outputs.md's metrics table, a learning test (a sign error in a loss fails it), resume, and
bad input."""

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

import run
from tests import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = [m for m in ("grpo", "gapo", "mugrpo", "codapo") if os.path.exists(os.path.join(ROOT, f"{m}.py"))]
TRAIN_KEYS = [
    "step",
    "update",
    "wall_s",
    "rollout/reward_mean",
    "rollout/reward_std",
    "rollout/zero_adv_group_frac",
    "rollout/response_len_mean",
    "rollout/truncated_frac",
    "losses/policy_loss",
    "losses/clipfrac",
    "losses/approx_kl",
    "losses/entropy",
    "losses/grad_norm",
    "charts/learning_rate",
    "perf/rollout_s",
    "perf/train_s",
    "perf/sync_s",
    "perf/tokens_per_s",
    "perf/peak_mem_gb",
]
EVAL_KEYS = ["eval/pass@1", "eval/pass@2", "eval/n_samples", "eval/temperature"]


def method_overrides(method: str) -> dict:
    """A method whose toy run needs other settings (e.g. Mu-GRPO's stage sizes) declares them as
    `E2E_OVERRIDES = {field: value}` in tests/test_<method>.py."""
    try:
        return dict(importlib.import_module(f"tests.test_{method}").E2E_OVERRIDES)
    except (ImportError, AttributeError):
        return {}


def override_flags(method: str) -> list[str]:
    flags = []
    for key, value in method_overrides(method).items():
        if key == "total_steps":  # only the learning test takes it
            continue
        flags += [f"--{key.replace('_', '-')}"] + ([str(v) for v in value] if isinstance(value, list) else [str(value)])
    return flags


def common_flags(toy, out, run_name, steps):
    return tiny.run_flags(toy, out, run_name, total_steps=steps, eval_limit=3)


def read_rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_script(method, flags, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, f"{method}.py"), *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.parametrize("method", METHODS)
def test_smoke_two_steps_all_metric_keys(method, toy, tmp_path):
    proc = run_script(method, common_flags(toy, tmp_path, "smoke", 2) + override_flags(method))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_rows(tmp_path / "smoke")
    train_rows = [r for r in rows if "rollout/reward_mean" in r]
    eval_rows = [r for r in rows if "eval/pass@1" in r]
    assert len(train_rows) >= 2 and len(eval_rows) == 2  # before and after
    for key in TRAIN_KEYS:
        assert key in train_rows[0], key
    for row in rows:  # a metric with no data is left out of its row (docs/outputs.md, "Metrics"), never written as null
        assert None not in row.values(), row
    for key in EVAL_KEYS:
        assert key in eval_rows[0], key
    assert os.path.exists(tmp_path / "smoke" / "args.json")
    with open(tmp_path / "smoke" / "args.json") as f:  # --micro-batch-tokens 0 resolved and recorded (CPU: 1024)
        assert json.load(f)["micro_batch_tokens"] == run.resolve_micro_batch_tokens(0, torch.device("cpu")) == 1024
    assert os.path.exists(tmp_path / "smoke" / "samples.jsonl")
    assert "pass@1" in proc.stdout and "before" in proc.stdout and "after" in proc.stdout


def _run_in_process(method, toy, out, run_name, steps, **overrides):
    mod = importlib.import_module(method)
    settings = dict(
        model=toy["model"],
        dataset=toy["data"],
        reward="arith",
        total_steps=steps,
        prompts_per_step=4,
        num_generations=8,
        max_new_tokens=3,
        learning_rate=3e-3,
        warmup_updates=1,
        eval_limit=2,
        eval_samples=2,
        eval_k=[2],
        output_dir=str(out),
        run_name=run_name,
    )
    settings.update({k: v for k, v in method_overrides(method).items() if k != "total_steps"})
    settings.update(overrides)
    args = mod.Args(**settings)
    mod.main(args)
    return read_rows(os.path.join(out, run_name))


def _reward_curve(rows):
    return [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]


@pytest.mark.parametrize("method", METHODS)
def test_learning_raises_reward(method, toy, tmp_path):
    steps = method_overrides(method).pop("total_steps", 30)
    curve = _reward_curve(_run_in_process(method, toy, tmp_path, "learn", steps))
    first, last = sum(curve[:5]) / 5, sum(curve[-5:]) / 5
    # chance level is ~0.05; a sign error in the loss drives it to 0 (checked below for grpo)
    assert last >= 0.35 and last > first + 0.2, curve


def test_learning_test_fails_with_a_sign_error(toy, tmp_path, monkeypatch):
    import grpo

    original = grpo.compute_advantages
    monkeypatch.setattr(grpo, "compute_advantages", lambda *a, **k: -original(*a, **k))
    curve = _reward_curve(_run_in_process("grpo", toy, tmp_path, "flipped", 30))
    assert sum(curve[-5:]) / 5 < 0.1, curve


@pytest.mark.parametrize("method", METHODS)
def test_resume_reproduces_uninterrupted_run(method, toy, tmp_path):
    full = _run_in_process(method, toy, tmp_path, "full", 4, save_every=2)
    _run_in_process(method, toy, tmp_path, "part", 2, save_every=2)
    resumed = _run_in_process(method, toy, tmp_path, "part", 4, save_every=2, resume=str(tmp_path / "part"))

    def training(rows):
        return [
            {k: v for k, v in r.items() if not k.startswith("perf/") and k != "wall_s"}
            for r in rows
            if "losses/policy_loss" in r
        ]

    assert len(training(full)) == len(training(resumed)) > 0
    for a, b in zip(training(full), training(resumed)):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (k, a, b)
    assert os.path.isfile(tmp_path / "part" / "checkpoints" / "step_000004" / "model" / "config.json")
    assert os.path.isfile(tmp_path / "part" / "final" / "model.safetensors")
    # (checkpoint layout, final/, --keep-last, broken checkpoints, torn metrics lines: tests/test_checkpoints.py)


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--model", "/nonexistent/model-folder"], "cannot load model"),
        (["--model", "no-such-org/no-such-model"], "cannot load model"),
        (["--dataset", "nonsense"], "unknown dataset"),
        (["--dataset", "gsm8k"], "cannot load dataset"),
        (["--dataset", "BADFIELD"], "has no field 'question'"),
        (["--dataset", "/nonexistent/data.jsonl"], "does not exist"),
        (["--eval-k", "8"], "--eval-k"),
    ],
)
def test_bad_input_one_clear_line(flags, needle, toy, tmp_path):
    bad = tiny.write_jsonl(str(tmp_path / "bad.jsonl"), [{"prompt": "x", "solution": "1"}])
    flags = [bad if f == "BADFIELD" else f for f in flags]
    base = common_flags(toy, tmp_path, "bad", 1)
    for i in range(0, len(flags), 2):  # override the base flag of the same name
        j = base.index(flags[i]) if flags[i] in base else None
        if j is not None:
            base[j + 1] = flags[i + 1]
        else:
            base += flags[i : i + 2]
    env = dict(os.environ, HF_HUB_OFFLINE="1")  # what a machine without network sees (no retries)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "grpo.py"), *base], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    err_lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(err_lines) == 1 and needle in err_lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    if needle == "has no field 'question'":
        assert "'prompt'" in err_lines[0] and "'solution'" in err_lines[0]  # lists the fields it has


@pytest.mark.parametrize("method", [*METHODS, "opd"])  # opd.py evaluates its student with no --teacher
def test_eval_only_writes_eval_rows_and_per_sample_correctness(method, toy, tmp_path):
    flags = [
        "--model",
        toy["model"],
        "--eval-dataset",
        toy["data"],
        "--reward",
        "arith",
        "--eval-only",
        "--eval-limit",
        "3",
        "--eval-samples",
        "4",
        "--eval-k",
        "2",
        "4",
        "--output-dir",
        str(tmp_path),
        "--run-name",
        "ev",
    ]
    proc = run_script(method, flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_rows(tmp_path / "ev")
    assert len(rows) == 1 and rows[0]["eval/n_samples"] == 4 and rows[0]["eval/n_problems"] == 3
    assert {"eval/pass@1", "eval/pass@2", "eval/pass@4"} <= rows[0].keys()
    with open(tmp_path / "ev" / "eval_completions_step0_toy.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 12  # every completion kept: problems x n
    # pass@1 is the mean correctness; pass@4 (k = n) is the share of problems with any correct sample
    assert rows[0]["eval/pass@1"] == pytest.approx(sum(r["correct"] for r in records) / 12)
    solved = {r["problem"] for r in records if r["correct"]}
    assert rows[0]["eval/pass@4"] == pytest.approx(len(solved) / 3)
    assert "eval-only" in proc.stdout and "pass@4" in proc.stdout
