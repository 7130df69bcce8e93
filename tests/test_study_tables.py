"""The studies' per-run tables (docs/studies/*_runs.py) on synthetic runs, against figures computed by hand."""

import importlib.util
import json
import os

import pytest

STUDIES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "studies")


def load_module(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(STUDIES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_run(root, name, args, rows, done=True):
    d = root / name
    d.mkdir()
    (d / "args.json").write_text(json.dumps(args))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if done:
        (d / ".done").touch()


def codapo_run(root, seed, weighting, focused, after, done=True):
    arm = {(True, True): "full", (False, True): "noweight", (True, False): "nofocus", (False, False): "neither"}
    rows = [
        {"step": 0, "eval/pass@1": 0.25, "eval/pass@2": 0.4, **{f"eval/tier{t}/pass@1": 0.1 * t for t in range(5)}},
        {
            "step": 1,
            "update": 1,
            "rollout/reward_mean": 0.05,
            "codapo/confidence_correct_mean": 0.5,
            "codapo/confidence_incorrect_mean": 0.25,
            "codapo/adv_abs_mean_unweighted": 0.1,
        },
        {"step": 1, "update": 2, "losses/grad_norm": 1.0},  # second update of the step: no rollout keys
        {
            "step": 2,
            "update": 3,
            "rollout/reward_mean": 0.4,
            "codapo/confidence_correct_mean": 0.75,
            "codapo/adv_abs_mean_unweighted": 0.8,
        },  # no incorrect rollout in this step: key absent
        {"step": 2, "eval/pass@1": after, "eval/pass@2": after + 0.1, **{f"eval/tier{t}/pass@1": 0.2 * t for t in range(5)}},
    ]
    write_run(
        root,
        f"{arm[(weighting, focused)]}_s{seed}",
        {
            "exp_name": f"codapo_{arm[(weighting, focused)]}",
            "seed": seed,
            "codapo_weighting": weighting,
            "focused_step": focused,
            "eval_k": [2],
        },
        rows,
        done,
    )


def test_codapo_main_effects_paired_per_seed(tmp_path, capsys):
    after = {
        1: {(True, True): 0.60, (False, True): 0.50, (True, False): 0.40, (False, False): 0.40},
        2: {(True, True): 0.30, (False, True): 0.40, (True, False): 0.30, (False, False): 0.30},
    }
    for seed, cells in after.items():
        for (weighting, focused), value in cells.items():
            codapo_run(tmp_path, seed, weighting, focused, value)
    codapo_run(tmp_path, 3, True, True, 0.9)  # seed 3 has one cell only: left out of the paired effects
    codapo_run(tmp_path, 4, False, False, 0.9, done=False)  # unfinished: left out everywhere
    load_module("codapo_runs").main(str(tmp_path))
    out = capsys.readouterr().out
    # focused: seed 1 ((0.6-0.4) + (0.5-0.4)) / 2 = +0.150, seed 2 ((0.3-0.3) + (0.4-0.3)) / 2 = +0.050
    assert "| focused step on - off (mean over weighting) | +0.150 | +0.050 | +0.100 | 2 / 0 / 0 |" in out
    # weighting: seed 1 ((0.6-0.5) + (0.4-0.4)) / 2 = +0.050, seed 2 ((0.3-0.4) + (0.3-0.3)) / 2 = -0.050
    assert "| weighting on - off (mean over focused step) | +0.050 | -0.050 | +0.000 | 1 / 1 / 0 |" in out
    assert "seed 3" not in out.split("Main effects")[1]
    assert "_s4" not in out and "| 4 |" not in out
    # per run: first and last step of each rollout key, the absent incorrect-confidence key keeps the step-1 value
    assert (
        "| codapo_full | 1 | on | on | 0.250 (s0) / 0.600 (s2) | 0.700 | 0.00 0.20 0.40 0.60 0.80 "
        "| 0.05 -> 0.40 | 0.50 -> 0.75 | 0.25 -> 0.25 | 0.10 -> 0.80 |"
    ) in out
    # per step, mean over seeds: full has seeds 1-3 (all the same rows); step 2 has no incorrect confidence
    assert "| codapo_full | codapo/confidence_correct_mean | 0.50 | 0.75 |" in out
    assert "| codapo_full | codapo/confidence_incorrect_mean | 0.25 | - |" in out
    # per arm over seeds 1-3 for full: after 0.6, 0.3, 0.9 -> mean 0.600, std 0.300
    assert "| codapo_full | 3 | 0.600 +- 0.300 | 0.350 +- 0.300 |" in out


def test_codapo_no_finished_runs_is_a_clear_error(tmp_path):
    codapo_run(tmp_path, 1, True, True, 0.5, done=False)
    with pytest.raises(SystemExit, match="no finished runs"):
        load_module("codapo_runs").main(str(tmp_path))


def test_mugrpo_run_summary(tmp_path):
    rows = [
        {"step": 0, "eval/pass@1": 0.4, "eval/pass@2": 0.5, "eval/response_len_mean": 18.0},
        {
            "step": 1,
            "update": 1,
            "losses/grad_norm": 0.0,
            "losses/approx_kl": 0.0,
            "losses/entropy": 0.7,
            "losses/clipfrac": 0.0,
            "rollout/reward_mean": 0.1,
            "rollout/truncated_frac": 0.3,
        },
        {
            "step": 1,
            "update": 2,
            "losses/grad_norm": 2.0,
            "losses/approx_kl": 0.5,
            "losses/entropy": 0.6,
            "losses/clipfrac": 0.1,
            "mugrpo/triggered_frac": 0.6,
            "mugrpo/vetoed_token_frac": 0.2,
        },
        {
            "step": 2,
            "update": 3,
            "losses/grad_norm": 1.0,
            "losses/approx_kl": 1.0,
            "losses/entropy": 0.5,
            "losses/clipfrac": 0.3,
            "mugrpo/triggered_frac": 0.2,
            "mugrpo/vetoed_token_frac": 0.0,
            "rollout/reward_mean": 0.0,
            "rollout/truncated_frac": 0.1,
        },
        {"step": 2, "eval/pass@1": 0.1, "eval/pass@2": 0.2, "eval/response_len_mean": 8.0},
    ]
    write_run(tmp_path, "naive_s1", {"exp_name": "naive", "seed": 1, "eval_k": [2]}, rows)
    mod = load_module("mugrpo_runs")
    s = mod.summarise(*mod.load(str(tmp_path / "naive_s1")))
    assert (s["pass1_before"], s["pass1_after"], s["pass2_after"]) == (0.4, 0.1, 0.2)
    assert (s["with_grad"], s["updates"], s["triggers"]) == (2, 3, [2, 3])
    assert s["triggered_frac"] == pytest.approx(0.4) and s["vetoed_frac"] == pytest.approx(0.1)
    assert s["kl_mean"] == pytest.approx(0.5) and s["kl_max"] == 1.0 and s["clipfrac_max"] == 0.3
    assert (s["entropy_first"], s["entropy_last"], s["reward"]) == (0.7, 0.5, [0.1, 0.0])


def opd_like_run(root, name, arm, seed, evals, steps, kl=None, done=True):
    """evals: [(step, pass@1, wall_s)]; steps: [(step, rollout_s, train_s)]; kl: per step (OPD)."""
    rows = [{"step": s, "update": 2 * s, "eval/pass@1": p, "wall_s": w} for s, p, w in evals]
    for i, (s, rollout_s, train_s) in enumerate(steps):
        row = {
            "step": s,
            "update": 2 * s - 1,
            "rollout/reward_mean": 0.5,
            "perf/rollout_s": rollout_s,
            "perf/train_s": train_s,
            "rollout/response_len_mean": 10.0 * s,  # step 1: 10 tokens, step 2: 20
        }
        rows.append(row | ({"opd/reverse_kl": kl[i]} if kl else {}))
    rows.sort(key=lambda r: (r["step"], "eval/pass@1" in r))
    write_run(root, name, {"exp_name": arm, "seed": seed}, rows, done)


def test_opd_steps_to_the_teachers_bar_by_hand(tmp_path, capsys):
    """The teacher (grpo__s1) ends at pass@1 0.6: the bar is 0.9 x 0.6 = 0.54. grpo__s2 reaches it at step 4 (0.55),
    opd__s1 at step 2 (0.56, at 20 s), opd__s2 never; an unfinished run is left out."""
    opd_like_run(tmp_path, "grpo__s1", "grpo", 1, [(0, 0.3, 1), (2, 0.5, 10), (4, 0.6, 30)], [(1, 2.0, 4.0), (2, 4.0, 6.0)])
    opd_like_run(tmp_path, "grpo__s2", "grpo", 2, [(0, 0.3, 1), (2, 0.4, 10), (4, 0.55, 30)], [(1, 3.0, 5.0), (2, 3.0, 5.0)])
    opd_like_run(
        tmp_path, "opd__s1", "opd", 1, [(0, 0.3, 1), (2, 0.56, 20), (4, 0.5, 40)], [(1, 2.0, 7.0), (2, 2.0, 9.0)], [0.3, 0.1]
    )
    opd_like_run(tmp_path, "opd__s2", "opd", 2, [(0, 0.3, 1), (2, 0.4, 20), (4, 0.5, 40)], [(1, 2.0, 8.0)], [0.2])
    opd_like_run(tmp_path, "opd__s3", "opd", 3, [(0, 0.9, 1)], [], done=False)
    load_module("opd_runs").main(str(tmp_path))
    out = capsys.readouterr().out
    assert "held-out pass@1 0.600 after training; the bar: 0.9 of it = 0.5400" in out
    assert "| grpo__s2 | grpo | 2 | 0.300 | 0.400 | 0.550 | 4 | 30 | 3.0 | 5.0 | 15.0 | - |" in out
    assert "| opd__s1 | opd | 1 | 0.300 | 0.560 | 0.500 | 2 | 20 | 2.0 | 8.0 | 15.0 | 0.300 -> 0.100 |" in out
    assert "| opd__s2 | opd | 2 | 0.300 | 0.400 | 0.500 | not reached | - | 2.0 | 8.0 | 10.0 | 0.200 -> 0.200 |" in out
    assert "opd__s3" not in out
    # per arm: opd's pass@1 at step 2 is the mean of 0.56 and 0.4 (0.48, sample std 0.113), its train s 8.0 +- 0.0
    opd_arm = "| opd | 2 | 0.300 +- 0.000 | 0.480 +- 0.113 | 0.500 +- 0.000 | 2, - | 2.000 +- 0.000 | 8.000 +- 0.000 |"
    assert opd_arm + " 12.500 +- 3.536 |" in out  # completion tokens: 15 and 10
    grpo_arm = "| grpo | 2 | 0.300 +- 0.000 | 0.450 +- 0.071 | 0.575 +- 0.035 | 4, 4 | 3.000 +- 0.000 | 5.000 +- 0.000 |"
    assert grpo_arm + " 15.000 +- 0.000 |" in out
