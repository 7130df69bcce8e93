"""compare.py on synthetic runs: mean/std over seeds, mismatched configurations kept apart and flagged,
plots with and without matplotlib."""

import builtins
import json
import math
import os

import pytest

import compare


def make_run(root, name, exp, seed, before, after, lr=1e-5, wall=100.0, extra=None):
    d = root / name
    d.mkdir()
    (d / "args.json").write_text(json.dumps({"exp_name": exp, "seed": seed, "learning_rate": lr, "run_name": name,
                                             "output_dir": str(root), **(extra or {})}))
    rows = [{"step": 0, "update": 0, "wall_s": 5.0, "eval/pass@1": before, "eval/pass@4": before + 0.2},
            {"step": 1, "update": 1, "wall_s": 50.0, "rollout/reward_mean": 0.1, "perf/rollout_s": 20.0,
             "perf/train_s": 25.0, "perf/sync_s": 0.5},
            {"step": 2, "update": 2, "wall_s": wall - 10, "rollout/reward_mean": 0.3, "perf/rollout_s": 21.0,
             "perf/train_s": 24.0, "perf/sync_s": 0.5},
            {"step": 2, "update": 2, "wall_s": wall, "eval/pass@1": after, "eval/pass@4": after + 0.2}]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(d)


def test_mean_and_std_over_seeds(tmp_path, capsys):
    make_run(tmp_path, "grpo_s1", "grpo", 1, 0.2, 0.3)
    make_run(tmp_path, "grpo_s2", "grpo", 2, 0.2, 0.5)
    make_run(tmp_path, "gapo_s1", "gapo", 1, 0.2, 0.4)
    assert compare.main([str(tmp_path / "*"), "--no-plot"]) == 0
    out = capsys.readouterr().out
    grpo_line = next(line for line in out.splitlines() if line.startswith("| grpo"))
    # after: mean 0.4, sample std sqrt(((0.1)^2 + (0.1)^2) / 1) = 0.1414
    assert "0.400 +- 0.141" in grpo_line and "2 (1,2)" in grpo_line
    assert "0.600 +- 0.141" in grpo_line  # pass@4 after
    cells = [c.strip() for c in grpo_line.strip("|").split("|")]
    header = [c.strip() for c in out.splitlines()[0].strip("|").split("|")]
    assert cells[header.index("train s")] == "49 +- 0"
    assert cells[header.index("rollout s")] == "41 +- 0"  # 20 + 21
    assert cells[header.index("wall s")] == "100 +- 0"
    assert cells[header.index("other s (load, eval, scoring)")] == "9 +- 0"  # 100 - 41 - 49 - 1
    gapo_line = next(line for line in out.splitlines() if line.startswith("| gapo"))
    assert "0.400" in gapo_line and "+-" not in gapo_line.split("|")[4]  # one seed: no std shown
    assert "differ" not in out  # same configuration apart from the method


def test_mismatched_configurations_are_not_averaged(tmp_path, capsys):
    make_run(tmp_path, "a", "grpo", 1, 0.2, 0.3, lr=1e-5)
    make_run(tmp_path, "b", "grpo", 2, 0.2, 0.5, lr=3e-5)
    compare.main([str(tmp_path / "a"), str(tmp_path / "b"), "--no-plot"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| grpo")]
    assert len(rows) == 2  # two rows, not one averaged row
    assert "learning_rate=1e-05" in rows[0] and "learning_rate=3e-05" in rows[1]
    assert "grpo has 2 configurations" in out and "rows differ in: learning_rate" in out


def test_method_specific_settings_listed_only_where_they_differ(tmp_path, capsys):
    # clip_high_max exists only in gapo's args: not a difference. clip_low exists in both methods and differs.
    make_run(tmp_path, "gapo_s1", "gapo", 1, 0.2, 0.4, extra={"clip_high_max": 0.28, "clip_low": 0.2})
    make_run(tmp_path, "mugrpo_s1", "mugrpo", 1, 0.2, 0.4, extra={"veto_scope": "suffix", "clip_low": 1.0})
    compare.main([str(tmp_path / "*"), "--no-plot"])
    out = capsys.readouterr().out
    assert "rows differ in: clip_low\n" in out + "\n"
    gapo_line = next(line for line in out.splitlines() if line.startswith("| gapo"))
    assert gapo_line.rstrip(" |").endswith("clip_low=0.2") and "veto_scope" not in gapo_line
    # the same method with and without a setting (e.g. runs from two versions of the script): flagged
    make_run(tmp_path, "gapo_s2", "gapo", 2, 0.2, 0.4, extra={"clip_low": 0.2})
    compare.main([str(tmp_path / "gapo_*"), "--no-plot"])
    out = capsys.readouterr().out
    assert "rows differ in: clip_high_max" in out and "clip_high_max=<absent>" in out and "clip_high_max=0.28" in out


def test_plots_written_and_missing_matplotlib_handled(tmp_path, capsys, monkeypatch):
    import matplotlib  # noqa: F401  (a requirement; the no-matplotlib path is tested below)
    make_run(tmp_path, "a", "grpo", 1, 0.2, 0.3)
    make_run(tmp_path, "b", "grpo", 2, 0.2, 0.5)
    compare.main([str(tmp_path / "a"), str(tmp_path / "b"), "--plot-dir", str(tmp_path / "plots")])
    assert os.path.getsize(tmp_path / "plots" / "compare.png") > 1000
    real_import = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    capsys.readouterr()
    assert compare.main([str(tmp_path / "a"), str(tmp_path / "b"), "--plot-dir", str(tmp_path / "p2")]) == 0
    out = capsys.readouterr().out
    assert "matplotlib is not installed" in out and "| grpo" in out
    assert not os.path.exists(tmp_path / "p2" / "compare.png")


def test_no_runs_is_a_clear_error(tmp_path, capsys):
    assert compare.main([str(tmp_path / "nothing")]) == 2
    assert "no run folder" in capsys.readouterr().err
