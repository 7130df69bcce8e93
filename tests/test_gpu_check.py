"""bench/gpu_check.py, the GPU check, run as its CPU dry run (tiny shapes, a few tokens): every step of the real
check runs through the same code (the engine race and the static engine's checks, the four scripts in one process,
resume, an async producer, eval-only, the precision check, torchrun with one process and its checkpoint resumed in
one, the speed steps through gpu_step.py's functions, --compile),
so the script cannot rot while no GPU is lent; and its files are rewritten after every step."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the GPU check's dry run: left out of the quick tier, pytest -m "not slow"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = [
    "model", "engines-0.5b", "engines-0.5b-chunks", "static-sleep-memory", "sdpa-backend", "graphs-vs-eager",
    "grpo", "resume", "torchrun", "torchrun-resume", "async-producer", "fp16", "gapo", "mugrpo", "codapo",
    "eval-only", "precision", "step-0.5b", "step-0.5b-run-defaults", "packed-0.5b", "step-1.5b", "step-1.5b-ckpt",
    "step-1.5b-ckpt-run-defaults", "compile-1.5b",
]  # fmt: skip


def test_gpu_check_dry_run_passes_every_step(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "gpu_check.py"),
            "--device",
            "cpu",
            "--out",
            str(out),
            "--budget-s",
            "1e9",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())["results"]
    assert [r["step"] for r in results] == STEPS
    assert all(r["ok"] for r in results), results
    by = {r["step"]: r for r in results}
    for m in ("grpo", "gapo", "mugrpo", "codapo"):
        assert by[m]["finite"] and by[m]["updates"] >= 1 and by[m]["final"]
        assert by[m]["peak_mem_gb"] > 0 and len(by[m]["pass@1"]) == 2  # evaluated before and after
    assert by["torchrun"]["process_group"]  # torchrun with one process ran the distributed path (issue 50)
    assert by["grpo"]["grad_norm_max"] > 0  # the parity reward gives mixed groups: a real gradient
    assert by["resume"]["step2_reward"][0] == by["resume"]["step2_reward"][1]  # on the CPU: exactly
    # the engine steps (issue 61): every engine on the same work, the decision between ours, the memory at sleep()
    race = by["engines-0.5b"]
    tokens = {e: race[f"gen_tokens_{e}"] for e in ("hf", "static", "static-eager", "generate-static", "generate-batch")}
    assert len(set(tokens.values())) == 1 and race["rows"] * race["new_tokens"] == tokens["hf"], race
    assert race["decision"].split()[0] in ("hf", "static") and "tokens_per_s_static_replay" in race
    assert by["engines-0.5b-chunks"]["batch"] < by["engines-0.5b-chunks"]["rows"]  # two chunk shapes
    assert not by["static-sleep-memory"]["cache_alive_after_sleep_two_shapes"]
    assert by["sdpa-backend"]["decode_backend"] == "flash"  # the CPU's flash kernel (_for_cpu)
    assert by["graphs-vs-eager"]["same_token_share"] == 1.0
    assert by["fp16"]["refused_on_cpu"] and by["async-producer"]["updates"] >= 1
    assert by["packed-0.5b"]["packed_groups"] > 0 and by["packed-0.5b"]["padded_packed_groups"] == 0
    assert by["step-0.5b"]["train_peak_gb_planned"] is not None  # bench/memory_plan.py's estimate beside the peak
    # what a run does beside the headline shape (issue 50): the scripts' head chunks, rows of unequal length
    assert by["step-0.5b-run-defaults"]["ragged"] and by["step-0.5b-run-defaults"]["logp_chunk_tokens"] == 256
    assert not by["step-0.5b"]["ragged"] and by["step-1.5b-ckpt-run-defaults"]["gradient_checkpointing"]
    summary = (out / "summary.md").read_text()
    assert f"{len(STEPS)} of {len(STEPS)} steps passed" in summary and "| torchrun | pass |" in summary
    assert (out / "logs.txt").stat().st_size > 0
