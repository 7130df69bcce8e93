"""Issue 14 "Also": a custom reward (--reward module:function / path.py:function), several eval sets in one run,
the training rollouts dump (--log-rollouts-every) and --config replay. Tiny model, a few steps, in process where
possible; the bad-input paths through the real CLI (one `error:` line, exit code)."""

import importlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import evaluation
import grpo
import models
import outputs
import run
import verifiers
from tests import tiny

pytestmark = pytest.mark.slow  # whole runs of the features: left out of the quick tier, pytest -m "not slow"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REWARD_FILE = """
import math

def reward(completion, problem):
    # the row's extra field "bonus" reaches the function; rewards outside [0, 1] are allowed
    return problem["bonus"] if problem["answer"] in completion else 0.0

def boom(completion, problem):
    return {"a": 1}["b"]

def nothing(completion, problem):
    return None

def nan(completion, problem):
    return math.nan

def text(completion, problem):
    return "1.0"

def huge(completion, problem):
    return 1e39

def flag(completion, problem):
    return problem["answer"] in completion

def edits(completion, problem):
    problem.clear()
    return 0.0

def odd(completion, problem):
    return float(len(completion) % 2)  # about half the samples "correct": pass@k is not stuck at 0

def one_arg(completion):
    return 0.0

NOT_A_FUNCTION = 3
"""


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    d = tmp_path_factory.mktemp("features")
    toy = tiny.toy_task(d, rows=[{"question": f"Say two {w}", "answer": "2", "bonus": 1.5} for w in tiny.TOY_WORDS])
    other = tiny.write_jsonl(
        str(d / "other.jsonl"), [{"question": f"Say one {w}", "answer": "1"} for w in "abcdefghijklmnopqrst"]
    )
    reward_file = d / "myreward.py"
    reward_file.write_text(REWARD_FILE)
    return {**toy, "other": other, "reward_file": str(reward_file)}


def flags(toy, out, run_name, steps=2):
    return tiny.run_flags(toy, out, run_name, total_steps=steps)


def with_flag(argv, name, *values):
    argv = list(argv)
    if name in argv:
        i = argv.index(name)
        del argv[i : i + 2]
    return argv + [name, *values]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_cli(argv, method="grpo", timeout=180):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, f"{method}.py"), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def one_error_line(proc, code):
    assert proc.returncode == code, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


# ----------------------------------------------------------------------------------------------- custom reward


def test_custom_reward_from_file_and_module(toy, monkeypatch):
    spec = f"{toy['reward_file']}:reward"
    custom = verifiers.load_custom_reward(spec)
    task = verifiers.load_task(toy["data"], "train", 1, reward=spec)
    assert task.kind == "custom" and task.custom_reward is custom
    assert task.instruction == verifiers.MATH_INSTRUCTION  # the dataset's answer format stays
    assert task.problems[0]["bonus"] == 1.5  # extra dataset fields pass through
    rewards = verifiers.compute_rewards(task, task.problems[:3], ["it is 2", "no", "2"])
    assert rewards == [1.5, 0.0, 1.5]
    monkeypatch.syspath_prepend(str(toy["dir"]))  # module:function form, found on the Python path
    from_module = verifiers.load_custom_reward("myreward:flag")
    task.custom_reward = from_module
    assert verifiers.compute_rewards(task, task.problems[:2], ["2", "x"]) == [1.0, 0.0]  # bool -> 1.0 / 0.0


def test_extra_fields_pass_through_and_builtin_kinds_unchanged(tmp_path):
    rows = [{"problem": "What is 1+1?", "solution": "so \\boxed{2}", "level": "Level 1", "id": 7}]
    problems, where = verifiers._rows_to_problems(rows, "math", "problem", "solution", "boxed", "x")
    assert where == ["dataset x, row 1"]  # where each problem comes from, for the gold check's messages
    assert problems == [
        {
            "problem": "What is 1+1?",
            "solution": "so \\boxed{2}",
            "level": "Level 1",
            "id": 7,
            "question": "What is 1+1?",
            "answer": "2",
        }
    ]
    gsm, _ = verifiers._rows_to_problems(
        [{"question": "q", "answer": "work #### 1,234"}], "math", "question", "answer", "gsm8k", "x"
    )
    assert gsm == [{"question": "q", "answer": "1234"}]  # question/answer are still the normalised ones
    task = verifiers.load_task(
        tiny.write_jsonl(str(tmp_path / "m.jsonl"), [{"question": "q", "answer": "3"}] * 6), "train", reward="arith"
    )
    assert task.kind == "arith" and verifiers.compute_rewards(task, task.problems[:2], ["3", "4"]) == [1.0, 0.0]


@pytest.mark.parametrize(
    "fn,needle",
    [
        ("boom", "raised KeyError: 'b' (at myreward.py:9)"),
        ("nothing", "returned NoneType"),
        ("nan", "returned nan"),
        ("text", "returned str"),
        ("huge", "returned 1e+39"),
    ],
)
def test_broken_custom_reward_stops_the_run(fn, needle, toy):
    task = verifiers.load_task(toy["data"], "train", 1, reward=f"{toy['reward_file']}:{fn}")
    with pytest.raises(verifiers.RunError) as err:
        verifiers.compute_rewards(task, task.problems[:2], ["2", "2"])
    assert needle in str(err.value) and f"myreward.py:{fn}" in str(err.value) and "\n" not in str(err.value)


def test_custom_reward_gets_a_copy_of_the_problem(toy):
    task = verifiers.load_task(toy["data"], "train", 1, reward=f"{toy['reward_file']}:edits")
    verifiers.compute_rewards(task, task.problems[:2], ["2", "2"])
    assert task.problems[0]["question"].startswith("Say two")


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("mathh", "--reward mathh: must be auto, arith, math, code, or your own function"),
        ("/nonexistent/r.py:fn", "file /nonexistent/r.py does not exist"),
        ("no_such_module_xyz:fn", "cannot import no_such_module_xyz"),
        ("FILE:missing", "has no attribute 'missing'"),
        ("FILE:NOT_A_FUNCTION", "NOT_A_FUNCTION is a int, not a function"),
        ("FILE:one_arg", "cannot be called as one_arg(completion, problem)"),
    ],
)
def test_bad_reward_spec_is_one_line_before_any_model_load(spec, needle, toy, tmp_path, monkeypatch):
    spec = spec.replace("FILE", toy["reward_file"])
    argv = with_flag(flags(toy, tmp_path, "bad"), "--reward", spec)
    line = one_error_line(run_cli(argv), 2)
    assert needle in line, line

    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the reward was checked")

    monkeypatch.setattr(models, "load_model", no_model)
    monkeypatch.setattr(models, "load_tokenizer", no_model)
    with pytest.raises(verifiers.UserError, match="--reward"):
        grpo.main(run.parse_args(grpo.Args, argv))


def test_reward_module_that_fails_to_import(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("def reward(c, p):\n    return 1.0\nraise RuntimeError('config missing')\n")
    with pytest.raises(verifiers.UserError, match="importing .*broken.py failed: RuntimeError: config missing"):
        verifiers.load_custom_reward(f"{bad}:reward")


def test_custom_reward_raising_mid_run_is_one_line_exit_1(toy, tmp_path):
    argv = with_flag(flags(toy, tmp_path, "boom", 1), "--reward", f"{toy['reward_file']}:boom")
    line = one_error_line(run_cli(argv), 1)
    assert "reward function" in line and "raised KeyError" in line, line


# ----------------------------------------------------------------------------------------------- rollouts dump


def test_rollouts_dump_with_custom_reward(toy, tmp_path):
    spec = f"{toy['reward_file']}:reward"
    args = run.parse_args(
        grpo.Args, with_flag(with_flag(flags(toy, tmp_path, "dump", 3), "--reward", spec), "--log-rollouts-every", "2")
    )
    grpo.main(args)
    run_path = tmp_path / "dump"
    rows = read_jsonl(run_path / "rollouts.jsonl")
    assert [r["step"] for r in rows] == [2] * 32  # every 2nd step of 3: step 2 only; P*G = 32 rows
    assert set(rows[0]) == {
        "step",
        "group",
        "prompt",
        "completion",
        "answer",
        "reward",
        "advantage",
        "length",
        "finish_reason",
    }
    assert [r["group"] for r in rows] == [i // 8 for i in range(32)]
    assert "<|im_start|>user\nSay two" in rows[0]["prompt"]  # decoded with the chat template
    for r in rows:
        assert r["reward"] == (1.5 if "2" in r["completion"] else 0.0)  # the custom function, out of [0, 1]
        assert 1 <= r["length"] <= 3 and r["finish_reason"] in ("stop", "length")
        # texts are decoded without special tokens: a row that ends with EOS at the limit is a 3-token "stop"
        assert r["finish_reason"] == "stop" or r["length"] == 3
    rewards = torch.tensor([r["reward"] for r in rows])
    assert torch.allclose(torch.tensor([r["advantage"] for r in rows]), grpo.compute_advantages(rewards, 8), atol=1e-5)
    metrics = [m for m in read_jsonl(run_path / "metrics.jsonl") if m.get("step") == 2 and "rollout/reward_mean" in m]
    assert metrics[0]["rollout/reward_mean"] == pytest.approx(rewards.mean().item())
    assert metrics[0]["rollout/truncated_frac"] == pytest.approx(sum(r["finish_reason"] == "length" for r in rows) / 32)
    # eval with a custom reward: a sample is correct when its reward >= 1.0 (here 1.5)
    evals = [m for m in read_jsonl(run_path / "metrics.jsonl") if "eval/pass@1" in m]
    records = read_jsonl(run_path / "eval_completions_step3_toy.jsonl")
    assert all(r["correct"] == (r["reward"] >= 1.0) for r in records)
    assert evals[-1]["eval/pass@1"] == pytest.approx(sum(r["correct"] for r in records) / len(records))


def test_rollouts_dump_off_by_default_and_cut_on_resume(toy, tmp_path):
    args = run.parse_args(grpo.Args, flags(toy, tmp_path, "plain", 1))
    assert args.log_rollouts_every == 0
    grpo.main(args)
    assert not (tmp_path / "plain" / "rollouts.jsonl").exists()
    run_path = tmp_path / "resumed"
    run_path.mkdir()
    tiny.write_jsonl(str(run_path / "rollouts.jsonl"), [{"step": s, "reward": 0.0} for s in (1, 1, 2, 3, 3)])
    with open(run_path / "rollouts.jsonl", "a") as f:
        f.write('{"step": 3, "rew')  # the kill that stopped the run cut a row short
    outputs.open_run_logger(args, str(run_path), resume_from_step=2).close()  # rows after the checkpoint are re-created later
    assert [r["step"] for r in read_jsonl(run_path / "rollouts.jsonl")] == [1, 1, 2]


# ----------------------------------------------------------------------------------------------- eval suites


def test_several_eval_sets(toy, tmp_path, capsys):
    common_argv = [
        "--model",
        toy["model"],
        "--reward",
        f"{toy['reward_file']}:odd",
        "--eval-only",
        "--eval-samples",
        "2",
        "--eval-k",
        "2",
        "--output-dir",
        str(tmp_path),
        "--eval-limit",
        "3",
    ]
    grpo.main(run.parse_args(grpo.Args, common_argv + ["--eval-dataset", toy["data"], toy["other"], "--run-name", "suite"]))
    out = capsys.readouterr().out
    grpo.main(run.parse_args(grpo.Args, common_argv + ["--eval-dataset", toy["other"], "--run-name", "one"]))
    (suite,) = read_jsonl(tmp_path / "suite" / "metrics.jsonl")
    (one,) = read_jsonl(tmp_path / "one" / "metrics.jsonl")
    for label in ("toy", "other"):
        assert {f"eval/{label}/pass@1", f"eval/{label}/pass@2", f"eval/{label}/n_problems"} <= suite.keys()
        assert suite[f"eval/{label}/n_problems"] == 3  # --eval-limit per set
        records = read_jsonl(tmp_path / "suite" / f"eval_completions_step0_{label}.jsonl")
        assert len(records) == 6
        assert suite[f"eval/{label}/pass@1"] == pytest.approx(sum(r["correct"] for r in records) / 6)
        assert f"eval/{label}/pass@1" in out and f"eval/{label}/pass@2" in out  # the summary prints every set
    for key in ("pass@1", "pass@2", "n_problems", "reward_mean"):  # unprefixed keys = the first set's
        assert suite[f"eval/{key}"] == suite[f"eval/toy/{key}"]
    # a set's numbers do not depend on the other sets of the suite (same seed per set); one set: today's keys
    assert one["eval/pass@1"] == suite["eval/other/pass@1"] and one["eval/pass@2"] == suite["eval/other/pass@2"]
    assert 0 < one["eval/pass@1"] < 1
    # not one set evaluated twice: each set's samples are of its own questions
    samples = read_jsonl(tmp_path / "suite" / "samples.jsonl")
    assert {s["question"][:7] for s in samples if s["eval_set"] == "toy"} == {"Say two"}
    assert {s["question"][:7] for s in samples if s["eval_set"] == "other"} == {"Say one"}
    assert not [k for k in one if k.count("/") > 1]
    assert os.path.exists(tmp_path / "one" / "eval_completions_step0_other.jsonl")
    samples = read_jsonl(tmp_path / "suite" / "samples.jsonl")
    assert {s["eval_set"] for s in samples} == {"toy", "other"}


def test_eval_set_labels_and_duplicates(toy, tmp_path):
    assert verifiers.eval_set_label("math500") == "math500"
    assert verifiers.eval_set_label("/a/b/data.jsonl.gz") == "data"
    assert verifiers.eval_set_label("owner/name") == "name"
    assert verifiers.eval_set_label("aime24=/a/b/aime_copy.jsonl") == "aime24"  # NAME=FILE: a registry set's copy
    copy = tiny.write_jsonl(str(tmp_path / "toy.json"), [{"question": "q", "answer": "1"}] * 5)
    with pytest.raises(verifiers.UserError, match="both log as eval/toy/"):
        evaluation.load_sets(grpo.Args(eval_dataset=[toy["data"], copy], reward="arith"))
    (eval_set,) = evaluation.load_sets(grpo.Args(eval_limit=7))
    assert eval_set.label == "arith" and len(eval_set.task.problems) == 7  # default: the held-out split of --dataset
    assert eval_set.n_source == 100 and eval_set.scope() == "7 of 100 problems (limit 7)"


# ----------------------------------------------------------------------------------------------- --config


def test_config_replays_a_run_and_flags_override(toy, tmp_path):
    original = run.parse_args(grpo.Args, flags(toy, tmp_path, "orig", 2))
    grpo.main(original)
    path = str(tmp_path / "orig" / "args.json")
    replay = run.parse_args(grpo.Args, ["--config", path])
    saved = json.load(open(path))
    expected = dict(saved, config=path, run_name="")  # run_name is not replayed: a replay is a new run
    assert dataclasses_asdict(replay) == expected
    grpo.main(replay)
    (new_dir,) = [d for d in os.listdir(tmp_path) if d.startswith("grpo__s1__")]

    def training(rows):
        return [{k: v for k, v in r.items() if not k.startswith("perf/") and k != "wall_s"} for r in rows]

    a, b = (
        training(read_jsonl(tmp_path / "orig" / "metrics.jsonl")),
        training(read_jsonl(tmp_path / new_dir / "metrics.jsonl")),
    )
    assert len(a) == len(b) > 2 and a == b  # identical training and eval metrics, row for row
    over = run.parse_args(grpo.Args, ["--config", path, "--total-steps", "5", "--eval-k", "1", "--beta", "0.1"])
    assert (over.total_steps, over.eval_k, over.beta, over.max_new_tokens) == (5, [1], 0.1, 3)


def dataclasses_asdict(obj):
    import dataclasses

    return dataclasses.asdict(obj)


def test_config_yaml_types_and_old_eval_dataset(tmp_path):
    pytest.importorskip("yaml")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("total_steps: 3\nlearning_rate: 1\neval_dataset: ''\neval_k: [1, 2]\ngradient_checkpointing: true\n")
    args = run.parse_args(grpo.Args, ["--config", str(cfg)])
    assert (args.total_steps, args.learning_rate, args.eval_dataset, args.eval_k, args.gradient_checkpointing) == (
        3,
        1.0,
        [],
        [1, 2],
        True,
    )
    assert isinstance(args.learning_rate, float)
    cfg.write_text("eval_dataset: math500\n")  # an args.json written before eval_dataset became a list
    assert run.parse_args(grpo.Args, ["--config", str(cfg)]).eval_dataset == ["math500"]
    assert run.parse_args(grpo.Args, ["--config", str(cfg), "--eval-dataset", "a", "b"]).eval_dataset == ["a", "b"]


@pytest.mark.parametrize(
    "content,needle",
    [
        ({"total_steps": 2, "bogus": 1}, "unknown argument 'bogus' for grpo.py"),
        (
            {"exp_name": "codapo", "codapo_offset": 0.1, "repeat_count": 4},
            "unknown arguments 'codapo_offset', 'repeat_count' for grpo.py; the file is from exp_name 'codapo'",
        ),
        ({"total_steps": "two"}, "total_steps must be int, not str"),
        ({"eval_k": [1, "2"]}, "eval_k must be int, not str"),
        ({"gradient_checkpointing": "yes"}, "gradient_checkpointing must be bool"),
        ([1, 2], "expected a mapping"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_config_is_one_line(content, needle, toy, tmp_path):
    cfg = tmp_path / "args.json"
    cfg.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(verifiers.UserError, match=None) as err:
        run.parse_args(grpo.Args, ["--config", str(cfg)])
    assert needle in str(err.value), str(err.value)
    if needle.startswith("unknown argument 'bogus'"):  # and through the real CLI: one line, exit 2
        assert needle in one_error_line(run_cli(["--config", str(cfg)]), 2)


def test_config_other_method_and_not_replayed_keys(tmp_path, capsys):
    import codapo

    cfg = tmp_path / "args.json"
    cfg.write_text(json.dumps({"exp_name": "grpo_clip28", "run_name": "old", "resume": "runs/old", "clip_high": 0.28}))
    args = run.parse_args(grpo.Args, ["--config", str(cfg)])
    assert (args.exp_name, args.run_name, args.resume, args.clip_high) == ("grpo_clip28", "", "", 0.28)
    err = capsys.readouterr().err
    assert "exp_name 'grpo_clip28'" in err and "run_name 'old' is not replayed" in err
    # a grpo run's full args.json into codapo.py: grpo's own arguments are unknown there
    full = dict(json.load(open(cfg)), exp_name="grpo", scale_rewards="group")
    cfg.write_text(json.dumps(full))
    with pytest.raises(
        verifiers.UserError, match="unknown argument 'scale_rewards' for codapo.py; the file is from exp_name 'grpo'"
    ):
        run.parse_args(codapo.Args, ["--config", str(cfg)])
    with pytest.raises(verifiers.UserError, match="no such file"):
        run.parse_args(grpo.Args, ["--config", str(tmp_path / "missing.json")])
    with pytest.raises(verifiers.UserError, match=r"unknown argument\(s\): --no-such-flag"):
        run.parse_args(grpo.Args, ["--no-such-flag", "1"])


@pytest.mark.parametrize("method", ["grpo", "gapo", "mugrpo", "codapo"])
def test_every_method_dumps_rollouts_and_evaluates_a_suite(method, toy, tmp_path):
    from tests.test_e2e import override_flags

    mod = importlib.import_module(method)
    argv = with_flag(
        with_flag(flags(toy, tmp_path, "m", 2), "--log-rollouts-every", "1"), "--eval-dataset", toy["data"], toy["other"]
    ) + override_flags(method)
    args = run.parse_args(mod.Args, argv)
    mod.main(args)
    rows = read_jsonl(tmp_path / "m" / "rollouts.jsonl")
    B = args.prompts_per_step * args.num_generations
    assert [r["step"] for r in rows] == [1] * B + [2] * B
    for step in (1, 2):
        step_rows = [r for r in rows if r["step"] == step]
        (metric,) = [
            m for m in read_jsonl(tmp_path / "m" / "metrics.jsonl") if m.get("step") == step and "rollout/reward_mean" in m
        ]
        assert metric["rollout/reward_mean"] == pytest.approx(sum(r["reward"] for r in step_rows) / B)
        assert all(math.isfinite(r["advantage"]) for r in step_rows)
    evals = [m for m in read_jsonl(tmp_path / "m" / "metrics.jsonl") if "eval/pass@1" in m]
    assert len(evals) == 2 and all("eval/toy/pass@2" in e and "eval/other/pass@2" in e for e in evals)


def test_documented_reward_example_runs(tmp_path):
    """docs/features.md's ten-line example is real code: load it through --reward's loader and score with it."""
    with open(os.path.join(ROOT, "docs", "features.md")) as f:
        text = f.read()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert len([line for line in code.splitlines() if line.strip()]) <= 10
    path = tmp_path / "myreward.py"
    path.write_text(code)
    task = verifiers.load_task("arith", "eval", 1, reward=f"{path}:reward")
    problem = dict(task.problems[0], max_chars=10)
    right, wrong = f"so {problem['answer']}", "so -1"
    assert verifiers.compute_rewards(task, [problem] * 3, [right, wrong, right + " " * 20]) == pytest.approx(
        [1.0, 0.0, 1.0 - 0.001 * (len(right) + 20 - 10)]
    )
