"""Diagnostics the method studies need: pass@1 per difficulty tier in the evaluation, and CoDaPO's
training dynamics (confidence of correct vs incorrect rollouts, mean |A|). Hand-computed numbers first, then
short runs on the tiny model that check the logged rows against the run's own per-sample files."""

import json
import math

import pytest
import torch

import codapo
import compare
import evaluation
import grpo
import run
import verifiers
from tests import references, tiny


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class ScriptedEngine:
    """An engine whose completions are given: generate() returns texts[i * n + j] for sample j of prompt i."""

    def __init__(self, texts):
        self.texts = texts

    def generate(self, prompts, n, max_new_tokens, temperature, seed=None, desc="", top_p=1.0):
        assert len(prompts) * n == len(self.texts)
        return references.rollout_from_rows(
            [p for p in prompts for _ in range(n)], [[5, 6]] * len(self.texts), self.texts, ["stop"] * len(self.texts)
        )


def arith_task(tiers, answers, name="arith"):
    problems = [
        {"question": f"q{i}", "answer": a, **({} if t is None else {"tier": t})}
        for i, (t, a) in enumerate(zip(tiers, answers))
    ]
    return verifiers.Task(name, "arith", problems, "")


def as_set(task, n=2, temperature=0.6, max_new_tokens=4, k=(2,)):
    """An evaluation set of the task under a protocol (each problem's prompt: [1])."""
    protocol = evaluation.EvalProtocol(n=n, temperature=temperature, max_new_tokens=max_new_tokens, k=k, grader="arith")
    return evaluation.EvalSet(
        verifiers.eval_set_label(task.name), task, protocol, len(task.problems), [[1]] * len(task.problems)
    )


# ----------------------------------------------------------------------------------------- per-tier pass@1

# 4 problems, 2 samples each: problem 0 (tier 0) 2/2 right, 1 (tier 0) 1/2, 2 (tier 1) 0/2, 3 (tier 2) 1/2
TIERS, ANSWERS = [0, 0, 1, 2], ["3", "5", "7", "9"]
TEXTS = ["3", "3", "5", "1", "0", "0", "9", "0"]


def test_pass_at_1_per_tier_by_hand():
    m, records = evaluation.evaluate(ScriptedEngine(TEXTS), as_set(arith_task(TIERS, ANSWERS)), seed=0)
    assert m["eval/pass@1"] == pytest.approx((1 + 0.5 + 0 + 0.5) / 4)
    assert m["eval/tier0/pass@1"] == pytest.approx((1.0 + 0.5) / 2)  # mean over the tier's problems
    assert m["eval/tier1/pass@1"] == 0.0
    assert m["eval/tier2/pass@1"] == pytest.approx(0.5)
    assert (m["eval/tier0/n_problems"], m["eval/tier1/n_problems"], m["eval/tier2/n_problems"]) == (2, 1, 1)
    assert not [k for k in m if "tier3" in k]  # only tiers that occur
    assert [r["tier"] for r in records] == [0, 0, 0, 0, 1, 1, 2, 2]  # every sample's tier in its kept completions
    assert all(compare.is_eval_key(k) for k in m if k.endswith("pass@1"))


def test_no_tier_field_no_tier_keys():
    m, records = evaluation.evaluate(ScriptedEngine(TEXTS), as_set(arith_task([None] * 4, ANSWERS)))
    assert not [k for k in m if "tier" in k] and not [r for r in records if "tier" in r]
    # a tier value that cannot be part of a key (a float, a string with '/') is no tier either
    m, _ = evaluation.evaluate(ScriptedEngine(TEXTS), as_set(arith_task([0.5, "a/b", True, None], ANSWERS)))
    assert not [k for k in m if "tier" in k]


def test_tier_keys_follow_the_per_set_prefix():
    tasks = [arith_task(TIERS, ANSWERS, "arith"), arith_task([3, 3, 3, 3], ANSWERS, "/x/other.jsonl")]
    engine = ScriptedEngine(TEXTS)
    m, _ = evaluation.evaluate_sets(engine, [as_set(t) for t in tasks], seed=0)
    assert m["eval/arith/tier0/pass@1"] == pytest.approx(0.75) and m["eval/arith/tier0/n_problems"] == 2
    assert m["eval/other/tier3/pass@1"] == pytest.approx(0.5) and m["eval/other/tier3/n_problems"] == 4
    assert m["eval/tier0/pass@1"] == m["eval/arith/tier0/pass@1"]  # unprefixed keys: the first set's
    assert "eval/tier3/pass@1" not in m


def test_console_and_summary_skip_tier_keys(capsys):
    eval_set = as_set(arith_task(TIERS, ANSWERS))
    m, _ = evaluation.evaluate(ScriptedEngine(TEXTS), eval_set)
    line = evaluation.eval_console_line(0, 3, eval_set, m)
    assert "pass@1 (avg@2) 0.5" in line and "pass@2" in line and "tier" not in line  # one set: not mistaken for a suite
    evaluation.print_summary("t", m, m, {}, 1.0, [eval_set])
    out = capsys.readouterr().out
    assert "eval/pass@1" in out and "eval/pass@2" in out and "tier" not in out


def test_compare_reads_tier_keys(tmp_path):
    for seed, p in ((1, 0.5), (2, 0.25)):
        run_path = tmp_path / f"r{seed}"
        run_path.mkdir()
        (run_path / "args.json").write_text(json.dumps({"exp_name": "grpo", "seed": seed}))
        rows = [
            {"step": 0, "update": 0, "eval/pass@1": 0.1, "eval/tier0/pass@1": 0.0},
            {"step": 1, "update": 2, "eval/pass@1": p, "eval/tier0/pass@1": p / 2, "eval/tier0/n_problems": 4},
        ]
        (run_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    groups = compare.group_runs([compare.load_run(str(tmp_path / f"r{s}")) for s in (1, 2)])
    assert compare.eval_keys(groups) == ["eval/pass@1", "eval/tier0/pass@1"]
    assert compare.select_metrics(groups, ["eval/tier*/pass@1"]) == ["eval/tier0/pass@1"]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    rows = [{"question": f"Say two {w}", "answer": "2", "tier": i % 3} for i, w in enumerate(tiny.TOY_WORDS)]
    return tiny.toy_task(tmp_path_factory.mktemp("diag"), rows=rows)


def test_eval_only_run_logs_tiers_consistent_with_its_records(toy, tmp_path, capsys):
    argv = [
        "--model",
        toy["model"],
        "--dataset",
        toy["data"],
        "--eval-dataset",
        toy["data"],
        "--reward",
        "arith",
        "--eval-only",
        "--eval-samples",
        "4",
        "--eval-k",
        "2",
        "--eval-limit",
        "9",
        "--max-new-tokens",
        "3",
        "--temperature",
        "1.0",
        "--eval-temperature",
        "1.5",
        "--output-dir",
        str(tmp_path),
        "--run-name",
        "ev",
    ]
    grpo.main(run.parse_args(grpo.Args, argv))
    assert "tier" not in capsys.readouterr().out
    (row,) = read_jsonl(tmp_path / "ev" / "metrics.jsonl")
    records = read_jsonl(tmp_path / "ev" / "eval_completions_step0_toy.jsonl")
    tiers = {r["tier"] for r in records}  # the eval set is a seeded hold-out of the file: its tiers vary
    assert len(tiers) >= 2 and sorted(k for k in row if "tier" in k) == sorted(
        f"eval/tier{t}/{name}" for t in tiers for name in ("pass@1", "n_problems")
    )
    assert sum(row[f"eval/tier{t}/n_problems"] for t in tiers) == row["eval/n_problems"]
    for t in tiers:
        mine = [r for r in records if r["tier"] == t]
        assert row[f"eval/tier{t}/n_problems"] == len({r["problem"] for r in mine})
        assert row[f"eval/tier{t}/pass@1"] == pytest.approx(sum(r["correct"] for r in mine) / len(mine))


# ----------------------------------------------------------------------------------------- CoDaPO dynamics


def test_codapo_dynamics_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    seq_mean_logp = torch.log(torch.tensor([0.5, 0.2, 0.4, 0.3]))  # per-rollout confidence 0.5, 0.2, 0.4, 0.3
    adv = torch.tensor([0.5, -0.5, -1.0, 1.0])
    d = codapo.codapo_dynamics(rewards, seq_mean_logp, adv, torch.tensor([1.0, -1.0, -2.0, 2.0]))
    assert d["codapo/confidence_correct_mean"] == pytest.approx((0.5 + 0.3) / 2)
    assert d["codapo/confidence_incorrect_mean"] == pytest.approx((0.2 + 0.4) / 2)
    assert d["codapo/adv_abs_mean"] == pytest.approx(3.0 / 4)
    assert d["codapo/adv_abs_mean_unweighted"] == pytest.approx(6.0 / 4)
    # a class with no rollout is left out (never None / NaN); no unweighted advantages, no unweighted key
    d = codapo.codapo_dynamics(torch.ones(4), seq_mean_logp, torch.zeros(4))
    assert set(d) == {"codapo/adv_abs_mean", "codapo/confidence_correct_mean"} and d["codapo/adv_abs_mean"] == 0.0
    d = codapo.codapo_dynamics(torch.zeros(2), seq_mean_logp[:2], adv[:2])
    assert set(d) == {"codapo/adv_abs_mean", "codapo/confidence_incorrect_mean"}
    assert d["codapo/confidence_incorrect_mean"] == pytest.approx(0.35)
    # a partial reward (0 < r < 1) counts as incorrect, as in success_rate
    d = codapo.codapo_dynamics(torch.tensor([0.5, 1.0]), seq_mean_logp[:2], adv[:2])
    assert d["codapo/confidence_incorrect_mean"] == pytest.approx(0.5)  # rollout 0 (r = 0.5, confidence 0.5)
    assert d["codapo/confidence_correct_mean"] == pytest.approx(0.2)  # rollout 1 (r = 1, confidence 0.2)


def test_codapo_run_logs_dynamics_consistent_with_its_rollouts(toy, tmp_path):
    argv = tiny.run_flags(toy, tmp_path, "cd", log_rollouts_every=1)
    codapo.main(run.parse_args(codapo.Args, argv))
    rows = [r for r in read_jsonl(tmp_path / "cd" / "metrics.jsonl") if "rollout/reward_mean" in r]
    rollouts = read_jsonl(tmp_path / "cd" / "rollouts.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        mine = [r for r in rollouts if r["step"] == row["step"]]
        assert row["codapo/adv_abs_mean"] == pytest.approx(sum(abs(r["advantage"]) for r in mine) / len(mine), abs=1e-6)
        rewards = torch.tensor([r["reward"] for r in mine])
        unweighted = codapo.compute_advantages(rewards, 8, None, 1e-6)
        assert row["codapo/adv_abs_mean_unweighted"] == pytest.approx(unweighted.abs().mean().item(), abs=1e-6)
        for key, present in (
            ("codapo/confidence_correct_mean", bool((rewards >= 1).any())),
            ("codapo/confidence_incorrect_mean", bool((rewards < 1).any())),
        ):
            assert (key in row) == present
            if present:
                assert 0.0 < row[key] <= 1.0 and math.isfinite(row[key])
