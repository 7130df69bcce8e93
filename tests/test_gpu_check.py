"""bench/gpu_check.py, the prepared GPU check, run as its CPU dry run (tiny shapes, a few tokens): every step of the
real check runs through the same code (the four scripts, resume, eval-only, torchrun with one process and its
checkpoint resumed in one, gpu_step.py, bf16_update.py), so the script cannot rot while no GPU is lent."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_dry_run_passes_every_step(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "gpu_check.py"), "--device", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())["results"]
    steps = [r["step"] for r in results]
    assert steps == [
        "model",
        "grpo",
        "gapo",
        "mugrpo",
        "codapo",
        "resume",
        "eval-only",
        "torchrun",
        "torchrun-resume",
        "gpu_step",
        "bf16_update",
    ]
    assert all(r["ok"] for r in results), results
    by = {r["step"]: r for r in results}
    for m in ("grpo", "gapo", "mugrpo", "codapo"):
        assert by[m]["finite"] and by[m]["updates"] >= 1 and by[m]["final"] and by[m]["checkpoints"] == ["step_000001"]
        assert by[m]["peak_mem_gb"] > 0 and len(by[m]["pass@1"]) == 2  # evaluated before and after
    assert by["grpo"]["grad_norm_max"] > 0  # the parity reward gives mixed groups: a real gradient
    assert by["torchrun-resume"]["checkpoints"] == ["step_000001", "step_000002"]
    summary = (out / "summary.md").read_text()
    assert "11 of 11 steps passed" in summary and "| torchrun | pass |" in summary
    assert (out / "logs.txt").stat().st_size > 0 and (out / "gpu_step.json").is_file()
