"""compare.py on synthetic runs: mean/std over seeds, mismatched configurations kept apart and flagged, labels that
name what differs between the groups shown, eval curves (and before/after-only evals drawn as points),
--metric (exact and glob, absent rows), --baseline paired per-seed differences, plots with and without matplotlib."""

import builtins
import json
import math
import os

import pytest

import compare


def make_run(root, name, exp, seed, before, after, lr=1e-5, wall=100.0, extra=None):
    d = root / name
    d.mkdir()
    (d / "args.json").write_text(
        json.dumps(
            {"exp_name": exp, "seed": seed, "learning_rate": lr, "run_name": name, "output_dir": str(root), **(extra or {})}
        )
    )
    rows = [
        {"step": 0, "update": 0, "wall_s": 5.0, "eval/pass@1": before, "eval/pass@4": before + 0.2},
        {
            "step": 1,
            "update": 1,
            "wall_s": 50.0,
            "rollout/reward_mean": 0.1,
            "perf/rollout_s": 20.0,
            "perf/train_s": 25.0,
            "perf/sync_s": 0.5,
        },
        {
            "step": 2,
            "update": 2,
            "wall_s": wall - 10,
            "rollout/reward_mean": 0.3,
            "perf/rollout_s": 21.0,
            "perf/train_s": 24.0,
            "perf/sync_s": 0.5,
        },
        {"step": 2, "update": 2, "wall_s": wall, "eval/pass@1": after, "eval/pass@4": after + 0.2},
    ]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(d)


def test_mean_and_std_over_seeds(tmp_path, capsys):
    make_run(tmp_path, "grpo_s1", "grpo", 1, 0.2, 0.3)
    make_run(tmp_path, "grpo_s2", "grpo", 2, 0.2, 0.5)
    make_run(tmp_path, "gapo_s1", "gapo", 1, 0.2, 0.4)
    assert compare.main([str(tmp_path / "*"), "--no-plot"]) == 0
    out = capsys.readouterr().out
    grpo_line, grpo_scores = [line for line in out.splitlines() if line.startswith("| grpo")]  # times, then the scores
    # after: mean 0.4, sample std sqrt(((0.1)^2 + (0.1)^2) / 1) = 0.1414; the 95 % t-interval's half-width over
    # 2 seeds: t_{0.975, 1} * 0.1414 / sqrt(2) = 12.7062 * 0.1 = 1.2706
    assert "0.400 ± 1.271" in grpo_scores and "2 (1,2)" in grpo_scores
    assert "0.600 ± 1.271" in grpo_scores  # pass@4 after
    cells = [c.strip() for c in grpo_line.strip("|").split("|")]
    header = [c.strip() for c in out.splitlines()[0].strip("|").split("|")]
    assert cells[header.index("train s")] == "49 +- 0"
    assert cells[header.index("rollout s")] == "41 +- 0"  # 20 + 21
    assert cells[header.index("wall s")] == "100 +- 0"
    assert cells[header.index("other s (load, eval, scoring)")] == "9 +- 0"  # 100 - 41 - 49 - 1
    gapo_scores = [line for line in out.splitlines() if line.startswith("| gapo")][1]
    assert "0.400" in gapo_scores and "±" not in gapo_scores.split("|")[4]  # one seed, no standard error logged: none
    assert "differ" not in out  # same configuration apart from the method


def test_mismatched_configurations_are_not_averaged(tmp_path, capsys):
    make_run(tmp_path, "a", "grpo", 1, 0.2, 0.3, lr=1e-5)
    make_run(tmp_path, "b", "grpo", 2, 0.2, 0.5, lr=3e-5)
    compare.main([str(tmp_path / "a"), str(tmp_path / "b"), "--no-plot"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| grpo")][:2]  # the times (the scores follow)
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


# --- eval curves, --metric, --baseline ---


def write_run(root, name, exp, seed, rows, extra=None):
    d = root / name
    d.mkdir()
    (d / "args.json").write_text(json.dumps({"exp_name": exp, "seed": seed, "run_name": name, **(extra or {})}))
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(d)


def groups_of(*paths):
    return compare.group_runs([compare.load_run(p) for p in paths])


def sparse_metric_runs(root):
    # key "m/x" is absent from some rows (as mugrpo/triggered_frac is when there is no data); wall_s = 10 * update + seed
    values = {1: {1: 0.1, 2: 0.3}, 2: {1: 0.3, 3: 0.5}, 3: {1: 0.8, 2: 0.7}}
    paths = []
    for seed, per_update in values.items():
        rows = [
            {
                "step": u,
                "update": u,
                "wall_s": 10.0 * u + seed,
                "rollout/reward_mean": 0.0,
                **({"m/x": per_update[u]} if u in per_update else {}),
            }
            for u in (1, 2, 3)
        ]
        paths.append(write_run(root, f"grpo_s{seed}", "grpo", seed, rows))
    return paths


def test_metric_curve_mean_band_and_absent_rows(tmp_path):
    (g,) = groups_of(*sparse_metric_runs(tmp_path))
    u1, u2, u3 = compare.curve(g, "m/x", "minmax")
    # update 1: values 0.1, 0.3, 0.8 -> mean 0.4, band min-max [0.1, 0.8], 3 seeds, mean wall (11 + 12 + 13) / 3
    assert u1 == pytest.approx((1, 12.0, 0.4, 0.1, 0.8, 3))
    # update 2: seed 2 has no m/x there -> mean of 0.3 and 0.7 over 2 seeds; update 3: seed 2 only
    assert u2 == pytest.approx((2, 22.0, 0.5, 0.3, 0.7, 2))
    assert u3 == pytest.approx((3, 32.0, 0.5, 0.5, 0.5, 1))
    # std band: update 1 sample std = sqrt((0.3^2 + 0.1^2 + 0.4^2) / 2) = sqrt(0.13) = 0.36056
    s1, s2, _ = compare.curve(g, "m/x", "std")
    assert s1[3:5] == pytest.approx((0.4 - math.sqrt(0.13), 0.4 + math.sqrt(0.13)))
    assert s2[3:5] == pytest.approx((0.5 - math.sqrt(0.08), 0.5 + math.sqrt(0.08)))  # std of 0.3, 0.7 = 0.28284


def test_metric_selection_by_name_and_glob(tmp_path, capsys):
    row = {
        "step": 1,
        "update": 1,
        "wall_s": 1.0,
        "gapo/clipfrac_c0.2": 0.01,
        "gapo/clipfrac_c0.5": 0.02,
        "gapo/ratio_absdev_c0.2": 0.1,
        "eval/pass@1/tier3": 0.5,
        "mugrpo/triggered_frac": None,
    }
    groups = groups_of(write_run(tmp_path, "gapo_s1", "gapo", 1, [row]))
    assert compare.select_metrics(groups, ["gapo/clipfrac_c*"]) == ["gapo/clipfrac_c0.2", "gapo/clipfrac_c0.5"]
    assert compare.select_metrics(groups, ["gapo/ratio_absdev_c0.2", "gapo/*_c0.2"]) == [
        "gapo/ratio_absdev_c0.2",
        "gapo/clipfrac_c0.2",
    ]  # exact name, then the glob's other match; no duplicates
    assert compare.select_metrics(groups, ["eval/*tier3*"]) == ["eval/pass@1/tier3"]
    with pytest.raises(ValueError, match="matches no logged key"):
        compare.select_metrics(groups, ["mugrpo/triggered_frac"])  # only ever null: nothing to plot
    assert compare.main([str(tmp_path / "gapo_s1"), "--metric", "gapo/clipfrc_c0.2", "--no-plot"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "close: gapo/clipfrac_c0.2" in err


def test_final_value_table_over_seeds(tmp_path, capsys):
    sparse_metric_runs(tmp_path)
    assert compare.main([str(tmp_path / "*"), "--metric", "m/*", "--no-plot"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| grpo | 3 |"))
    # last value of each seed: 0.3, 0.5, 0.7 -> mean 0.5, sample std 0.2
    assert line == "| grpo | 3 | 0.5 +- 0.2 |"


def eval_rows(finals, n_evals=2):
    """Eval rows at updates 0, 2, ...; pass@1 rises linearly to `final` (the value of the last eval)."""
    return [
        {
            "step": i,
            "update": 2 * i,
            "wall_s": 10.0 * i,
            "eval/pass@1": finals * i / (n_evals - 1),
            "eval/pass@4": min(1.0, finals * i / (n_evals - 1) + 0.125),
        }
        for i in range(n_evals)
    ]


def test_paired_differences_against_baseline(tmp_path, capsys):
    # finals are binary fractions so the differences are exact
    for seed, final in {1: 0.5, 2: 0.25, 3: 0.75}.items():
        write_run(tmp_path, f"grpo_s{seed}", "grpo", seed, eval_rows(final))
    for seed, final in {1: 0.75, 2: 0.125, 4: 0.5}.items():  # seed 3 missing, seed 4 extra
        rows = eval_rows(final) + [{"step": 1, "update": 1, "wall_s": 5.0, "gapo/clipfrac_c0.2": 0.01}]
        write_run(tmp_path, f"gapo_s{seed}", "gapo", seed, rows)
    for seed, final in {1: 0.625, 2: 0.375, 3: 0.875}.items():
        write_run(tmp_path, f"mugrpo_s{seed}", "mugrpo", seed, eval_rows(final))
    for seed, final in {1: 0.5, 2: 0.5, 3: 0.5}.items():
        write_run(tmp_path, f"codapo_s{seed}", "codapo", seed, eval_rows(final))
    assert compare.main([str(tmp_path / "*"), "--baseline", "grpo", "--metric", "gapo/clipfrac_c0.2", "--no-plot"]) == 0
    lines = {
        tuple(c.strip() for c in x.strip("|").split("|")[:2]): x
        for x in capsys.readouterr().out.splitlines()
        if " - grpo |" in x
    }
    # gapo: seed 1 +0.25, seed 2 -0.125 -> mean +0.0625, std sqrt(2 * 0.1875^2) = 0.2652, the 95 % t-interval's
    # half-width t_{0.975, 1} * 0.2652 / sqrt(2) = 12.7062 * 0.1875 = 2.382; seeds 3 and 4 unmatched
    assert lines[("gapo - grpo", "eval/pass@1")] == (
        "| gapo - grpo | eval/pass@1 | +0.0625 ± 2.382 | 1: +0.25, 2: -0.125 | 1/2 positive | 4 (gapo only), 3 (grpo only) |"
    )
    # mugrpo: +0.125 for every seed; pass@4 = pass@1 + 0.125 in both, so the same differences
    for key in ("eval/pass@1", "eval/pass@4"):
        assert lines[("mugrpo - grpo", key)] == (
            f"| mugrpo - grpo | {key} | +0.125 ± 0 | 1: +0.125, 2: +0.125, 3: +0.125 | 3/3 positive | - |"
        )
    # codapo: 0, +0.25, -0.25 -> mean 0, std 0.25, half-width t_{0.975, 2} * 0.25 / sqrt(3) = 4.3027 * 0.14434 = 0.621;
    # a tie is neither positive nor negative
    assert lines[("codapo - grpo", "eval/pass@1")] == (
        "| codapo - grpo | eval/pass@1 | +0 ± 0.621 | 1: +0, 2: +0.25, 3: -0.25 | 1/3 positive, 1 tied | - |"
    )
    # a key only gapo logs: nothing paired, every seed listed with the reason
    assert lines[("gapo - grpo", "gapo/clipfrac_c0.2")] == (
        "| gapo - grpo | gapo/clipfrac_c0.2 | - | - | - | 4 (gapo only), 3 (grpo only), "
        "1 (no value in grpo), 2 (no value in grpo) |"
    )
    assert not any(k[0].startswith("grpo - ") for k in lines)


def test_final_value_ignores_the_eval_before_training(tmp_path):
    path = write_run(tmp_path, "crashed", "grpo", 1, eval_rows(0.5)[:1] + [{"step": 1, "update": 1, "wall_s": 1.0}])
    run = compare.load_run(path)
    assert run.evals() and compare.final_value(run, "eval/pass@1") is None
    assert compare.final_value(compare.load_run(write_run(tmp_path, "ok", "grpo", 1, eval_rows(0.5, 3))), "eval/pass@1") == 0.5


def test_baseline_errors_are_one_line(tmp_path, capsys):
    write_run(tmp_path, "grpo_s1", "grpo", 1, eval_rows(0.5))
    write_run(tmp_path, "grpo_lr", "grpo", 1, eval_rows(0.5), extra={"learning_rate": 3e-5})
    write_run(tmp_path, "gapo_s1", "gapo", 1, eval_rows(0.5))
    write_run(tmp_path, "gapo_s1b", "gapo", 1, eval_rows(0.25))
    for argv, message in [
        (["--baseline", "ppo"], "is none of the groups: gapo, grpo"),
        (["--baseline", "grpo"], "matches 2 configurations"),
        (["--baseline", "gapo"], "more than one run with seed 1"),
    ]:
        assert compare.main([str(tmp_path / "*"), "--no-plot", *argv]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and message in err, err


def test_per_tier_and_per_set_eval_keys(tmp_path, capsys):
    rows = eval_rows(0.5)
    for r in rows:
        r.update({"eval/pass@1/tier3": r["eval/pass@1"] / 2, "eval/math500/pass@1": r["eval/pass@1"]})
    groups = groups_of(write_run(tmp_path, "grpo_s1", "grpo", 1, rows))
    assert compare.eval_keys(groups) == ["eval/pass@1", "eval/pass@4", "eval/math500/pass@1", "eval/pass@1/tier3"]
    assert compare.main([str(tmp_path / "*"), "--no-plot"]) == 0  # the old pass_keys parsed "1/tier3" as k and failed
    assert "pass@4 after" in capsys.readouterr().out


def test_eval_curves_and_metric_plots_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    for seed in (1, 2):
        rows = eval_rows(0.5 * seed, n_evals=4) + [
            {"step": 1, "update": u, "wall_s": 5.0 * u, "rollout/reward_mean": 0.1 * u, "gapo/clipfrac_c0.2": 0.01 * u}
            for u in (1, 2, 3)
        ]
        write_run(tmp_path, f"gapo_s{seed}", "gapo", seed, rows)
    (g,) = groups_of(str(tmp_path / "gapo_s1"), str(tmp_path / "gapo_s2"))
    # pass@1 evals at updates 0, 2, 4, 6: seed 1 rises to 0.5, seed 2 to 1.0 -> means 0, 0.25, 0.5, 0.75
    assert [p[2] for p in compare.curve(g, "eval/pass@1")] == pytest.approx([0.0, 0.25, 0.5, 0.75])
    plots = tmp_path / "plots"
    assert (
        compare.main([str(tmp_path / "gapo_*"), "--plot-dir", str(plots), "--metric", "gapo/clipfrac_c*", "--band", "std"])
        == 0
    )
    for name in ("compare.png", "compare_eval.png", "compare_gapo_clipfrac_c0.2.png"):
        assert os.path.getsize(plots / name) > 1000, name
    assert f"wrote {plots / 'compare_eval.png'}" in capsys.readouterr().out
    # only before/after evals: no eval-curve figure
    write_run(tmp_path, "grpo_s1", "grpo", 1, eval_rows(0.5))
    compare.main([str(tmp_path / "grpo_s1"), "--plot-dir", str(tmp_path / "p2")])
    assert os.path.exists(tmp_path / "p2" / "compare.png") and not os.path.exists(tmp_path / "p2" / "compare_eval.png")


def test_new_options_without_matplotlib(tmp_path, capsys, monkeypatch):
    for seed in (1, 2):
        write_run(tmp_path, f"grpo_s{seed}", "grpo", seed, eval_rows(0.5, 4))
        write_run(tmp_path, f"gapo_s{seed}", "gapo", seed, eval_rows(0.75, 4))
    real_import = builtins.__import__
    monkeypatch.setattr(
        builtins,
        "__import__",
        lambda name, *a, **k: (
            (_ for _ in ()).throw(ImportError(name)) if name.startswith("matplotlib") else real_import(name, *a, **k)
        ),
    )
    assert (
        compare.main([str(tmp_path / "*"), "--metric", "eval/pass@4", "--baseline", "grpo", "--plot-dir", str(tmp_path / "p")])
        == 0
    )
    out = capsys.readouterr().out
    assert "matplotlib is not installed" in out and "2/2 positive" in out and not os.path.exists(tmp_path / "p")


def test_nan_entries_are_reported_not_hidden(tmp_path, capsys):
    rows = [{"step": 1, "update": 1, "wall_s": 1.0, "m/x": 0.5}, {"step": 2, "update": 2, "wall_s": 2.0, "m/x": float("nan")}]
    path = write_run(tmp_path, "grpo_s1", "grpo", 1, rows)
    assert compare.main([path, "--metric", "m/x", "--no-plot"]) == 0
    assert f"note: m/x is NaN in {path} (1 rows); those rows are left out" in capsys.readouterr().out


def test_old_string_eval_dataset_groups_with_the_new_list_form(tmp_path):
    """Runs written before several eval sets existed record eval_dataset as a string ("" = held-out split); they
    are seeds of the same configuration as new runs that record a list ([] = held-out split)."""
    a = make_run(tmp_path, "old", "grpo", 1, 0.2, 0.3, extra={"eval_dataset": ""})
    b = make_run(tmp_path, "new", "grpo", 2, 0.2, 0.4, extra={"eval_dataset": []})
    c = make_run(tmp_path, "other", "grpo", 3, 0.2, 0.4, extra={"eval_dataset": "math500"})
    d = make_run(tmp_path, "other_new", "grpo", 4, 0.2, 0.4, extra={"eval_dataset": ["math500"]})
    groups = groups_of(a, b, c, d)
    assert sorted(len(g.runs) for g in groups) == [2, 2]
    assert {tuple(sorted(os.path.basename(r.path) for r in g.runs)) for g in groups} == {
        ("new", "old"),
        ("other", "other_new"),
    }


def test_lora_and_full_runs_side_by_side_with_peak_memory(tmp_path, capsys):
    """LoRA runs are rows of their own, labelled with their rank (the baseline name `grpo` is the full run); the
    main table has each row's peak memory (the largest perf/peak_mem_gb of a run, mean over seeds)."""
    for seed, peak in ((1, 2.0), (2, 3.0)):
        make_run(tmp_path, f"full_s{seed}", "grpo", seed, 0.2, 0.4)
        make_run(tmp_path, f"r8_s{seed}", "grpo", seed, 0.2, 0.5, lr=1e-4, extra={"lora_rank": 8})
        for name, value in ((f"full_s{seed}", peak), (f"r8_s{seed}", peak / 2)):
            path = tmp_path / name / "metrics.jsonl"
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            rows[1]["perf/peak_mem_gb"], rows[2]["perf/peak_mem_gb"] = value - 0.5, value
            path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert compare.main([str(tmp_path / "*"), "--no-plot", "--baseline", "grpo"]) == 0
    out = capsys.readouterr().out
    header = [c.strip() for c in out.splitlines()[0].strip("|").split("|")]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()[2:4]}
    # the learning rates differ too, so the labels name them; --baseline grpo still names the full run
    assert set(rows) == {"grpo lr 1e-5", "grpo LoRA r8 lr 1e-4"}
    assert rows["grpo lr 1e-5"][header.index("peak mem GiB")] == "2.50 +- 0.71"  # seeds 2.0 and 3.0
    assert rows["grpo LoRA r8 lr 1e-4"][header.index("peak mem GiB")] == "1.25 +- 0.35"
    assert "| grpo LoRA r8 lr 1e-4 - grpo lr 1e-5 | eval/pass@1 | +0.1 ± 0 |" in out


# --- labels name what differs; an evaluation before and after only is two points ---


def legend_and_lines(groups, keys):
    """The figure compare.py draws (not saved): its legend texts and, per panel, {line label: Line2D}."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = compare.draw(plt, groups, keys, "minmax")
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    panels = [{line.get_label(): line for line in ax.get_lines()} for ax in fig.axes]
    return fig, legend, panels


def test_labels_name_the_settings_that_differ(tmp_path, capsys):
    """The LoRA study's two rank-1 arms (3e-4 and 1e-4) were both 'grpo LoRA r1': a label now holds whatever tells
    its group from the others shown (here the learning rate and zero_variance), never the seed or bookkeeping."""
    for lr in (1e-4, 3e-4):
        for zv in ("keep", "mask"):
            for seed in (1, 2):
                extra = {"lora_rank": 1, "zero_variance": zv, "output_dir": f"out_{seed}", "resume": "", "track": False}
                make_run(tmp_path, f"r1_lr{lr}_{zv}_s{seed}", "grpo", seed, 0.2, 0.3, lr=lr, extra=extra)
    groups = groups_of(*sorted(str(p) for p in tmp_path.iterdir()))
    assert [len(g.runs) for g in groups] == [2, 2, 2, 2]  # seeds pooled, as before
    assert sorted(g.label for g in groups) == [
        "grpo LoRA r1 lr 1e-4 zero_variance=keep",
        "grpo LoRA r1 lr 1e-4 zero_variance=mask",
        "grpo LoRA r1 lr 3e-4 zero_variance=keep",
        "grpo LoRA r1 lr 3e-4 zero_variance=mask",
    ]
    # the same labels in the table and in the plot's legend (with the seeds pooled, n=2)
    assert compare.main([str(tmp_path / "*"), "--no-plot"]) == 0
    rows = [line.split("|")[1].strip() for line in capsys.readouterr().out.splitlines()[2:6]]
    assert sorted(rows) == sorted(g.label for g in groups)
    fig, legend, _ = legend_and_lines(groups, ["rollout/reward_mean", "eval/pass@1"])
    assert sorted(legend) == sorted(f"{g.label} (n=2)" for g in groups)
    # only the learning rate differs among the groups shown: the other flag drops out of the labels
    keep = [str(p) for p in sorted(tmp_path.iterdir()) if "_keep_" in p.name]
    assert sorted(g.label for g in groups_of(*keep)) == ["grpo LoRA r1 lr 1e-4", "grpo LoRA r1 lr 3e-4"]
    # nothing differs but the method: the method alone
    assert [g.label for g in groups_of(keep[0])] == ["grpo LoRA r1"]


def test_lora_study_labels_and_baseline(tmp_path, capsys):
    """The LoRA study's arms: full at 1e-5, rank 1 at 3e-4 and 1e-4, rank 8 at 3e-4. Every label differs, and
    --baseline grpo (the study's command) still names the full fine-tuning run."""
    arms = {"full": (1e-5, 0, 0.4), "r1": (3e-4, 1, 0.35), "r1lr1e-4": (1e-4, 1, 0.3), "r8": (3e-4, 8, 0.45)}
    for arm, (lr, rank, after) in arms.items():
        for seed in (1, 2, 3):
            make_run(tmp_path, f"study_{arm}_s{seed}", "grpo", seed, 0.2, after, lr=lr, extra={"lora_rank": rank})
    assert compare.main([str(tmp_path / "*"), "--no-plot", "--baseline", "grpo"]) == 0
    out = capsys.readouterr().out
    labels = [line.split("|")[1].strip() for line in out.splitlines()[2:6]]
    assert sorted(labels) == ["grpo LoRA r1 lr 1e-4", "grpo LoRA r1 lr 3e-4", "grpo LoRA r8 lr 3e-4", "grpo lr 1e-5"]
    assert "| grpo LoRA r1 lr 1e-4 - grpo lr 1e-5 | eval/pass@1 | -0.1 ± 0 |" in out
    assert "| grpo LoRA r1 lr 3e-4 - grpo lr 1e-5 | eval/pass@1 | -0.05 ± 0 |" in out
    # a label is matched first: one rank-1 arm as the baseline
    assert compare.main([str(tmp_path / "*"), "--no-plot", "--baseline", "grpo LoRA r1 lr 1e-4"]) == 0
    assert "| grpo LoRA r1 lr 3e-4 - grpo LoRA r1 lr 1e-4 | eval/pass@1 | +0.05 ± 0 |" in capsys.readouterr().out
    # the name of two arms is ambiguous: one error line
    assert compare.main([str(tmp_path / "*"), "--no-plot", "--baseline", "grpo LoRA r1"]) == 2
    assert "matches 2 configurations" in capsys.readouterr().err


def test_labels_never_clash(tmp_path):
    """Settings whose short forms agree (an absent lora_rank and rank 0 both read as full fine-tuning; learning
    rates equal to 12 digits) are spelled out as key=<JSON value>, so two groups never share a label."""
    a = make_run(tmp_path, "old", "grpo", 1, 0.2, 0.3)  # written before --lora-rank existed
    b = make_run(tmp_path, "new", "grpo", 1, 0.2, 0.3, extra={"lora_rank": 0})
    assert sorted(g.label for g in groups_of(a, b)) == ["grpo lora_rank=0", "grpo lora_rank=<absent>"]
    c = make_run(tmp_path, "c", "grpo", 1, 0.2, 0.3, lr=1e-4)
    d = make_run(tmp_path, "d", "grpo", 1, 0.2, 0.3, lr=1.0000000000001e-4)
    e = make_run(tmp_path, "e", "grpo", 1, 0.2, 0.3, lr=3e-4)
    labels = [g.label for g in groups_of(c, d, e)]
    assert labels == ["grpo learning_rate=0.0001", "grpo learning_rate=0.00010000000000001", "grpo lr 3e-4"]
    assert len(set(labels)) == len(labels)
    # float values in their shorter form
    assert [compare.short_value(json.dumps(v)) for v in (1e-5, 0.0003, 0.001, 0.2, 4.0, 0.28, True, "suffix")] == [
        "1e-5",
        "3e-4",
        "1e-3",
        "0.2",
        "4",
        "0.28",
        "True",
        "suffix",
    ]


def test_eval_before_and_after_only_is_points_not_a_line(tmp_path):
    """--eval-every 0 (evaluations at the first and last update only): markers with error bars over seeds, no line
    and no band between them. Evaluations at 3 or more updates stay a curve with a band."""
    for seed in (1, 2):
        write_run(tmp_path, f"ba_s{seed}", "grpo", seed, eval_rows(0.25 * seed, n_evals=2), extra={"eval_every": 0})
        write_run(tmp_path, f"ev_s{seed}", "grpo", seed, eval_rows(0.25 * seed, n_evals=4), extra={"eval_every": 1})
    groups = groups_of(*sorted(str(p) for p in tmp_path.iterdir()))
    assert {g.label: compare.points_only(g, "eval/pass@1") for g in groups} == {
        "grpo eval_every=0": True,
        "grpo eval_every=1": False,
    }
    from matplotlib.collections import LineCollection, PolyCollection

    fig, legend, panels = legend_and_lines(groups, ["eval/pass@1"])
    assert sorted(legend) == ["grpo eval_every=0 (n=2)", "grpo eval_every=1 (n=2)"]
    for ax, lines in zip(fig.axes, panels):  # against updates, and against wall time
        before_after, curve = lines["grpo eval_every=0 (n=2)"], lines["grpo eval_every=1 (n=2)"]
        assert before_after.get_linestyle() == "None" and before_after.get_marker() == "o"
        assert len(before_after.get_xdata()) == 2
        assert curve.get_linestyle() == "-" and curve.get_marker() == "o" and len(curve.get_xdata()) == 4
        assert len([c for c in ax.collections if isinstance(c, PolyCollection)]) == 1  # the curve's band only
        (bars,) = [c for c in ax.collections if isinstance(c, LineCollection)]  # the points' min-max over seeds
        assert len(bars.get_segments()) == 2
    # a training metric stays a line however few its rows
    (tmp_path / "sparse").mkdir()
    _, _, (reward, _) = legend_and_lines(groups_of(*sparse_metric_runs(tmp_path / "sparse")), ["m/x"])
    (line,) = reward.values()
    assert line.get_linestyle() == "-"
