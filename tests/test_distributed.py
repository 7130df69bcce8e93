"""Several processes (issue 13, docs/distributed.md): torchrun with 2 gloo ranks on CPU against one process.

Each launch runs under a subprocess timeout and a short process-group timeout (RLVR_DIST_TIMEOUT_S), so a hang
fails the test instead of stalling CI. Tolerances, measured here (2 ranks, tiny Llama, fp32 CPU): one update per
loss, full gradients 6.7e-8 .. 9.2e-8 relative to one process, grad norms within 1e-7 relative; end to end
(scripted engine, 2 steps): see test_scripts_two_ranks_equal_one_rank. The bounds below sit 10x above those
and far below the defects the negative controls produce (gradient x 1/2, wrong denominators: relative 1e-1 and
more).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import models
import run
from tests import tiny

pytestmark = pytest.mark.slow  # processes under torchrun: left out of the quick tier, pytest -m "not slow"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "dist_worker.py")
GRAD_REL_TOL = 1e-6  # |g2 - g1| / |g1| over all parameters
PARAM_TOL = 1e-5  # max |p2 - p1| after one AdamW step at lr 1e-2 (a flipped update of one weight would be 2e-2)
METRIC_REL_TOL = 1e-5  # end to end, every logged metric but perf/* and wall_s
WEIGHT_TOL = 1e-5  # end to end, final weights
DEFECT_MIN = 1e-2  # a negative control must move the gradient at least this much (relative)
LAUNCH_TIMEOUT = 240


def env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RLVR_DIST_TIMEOUT_S="60", **extra)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def launch_two_nodes(args: list[str], cwd, **extra_env) -> list[subprocess.CompletedProcess]:
    """Two torchrun launches on this machine, one per node (--nnodes 2 --node-rank 0 / 1), one gloo process each,
    meeting through c10d rendezvous on a free localhost port: two machines of one process each."""
    port, procs = free_port(), []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1"]
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=rlvr-two-nodes", WORKER, *args]
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env(**extra_env))
        )
    try:
        outs = [p.communicate(timeout=LAUNCH_TIMEOUT) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def launch(args: list[str], nproc: int, cwd, **extra_env) -> subprocess.CompletedProcess:
    """`python WORKER args` (nproc 1: one plain process, world size 1) or torchrun with nproc gloo ranks."""
    if nproc == 1:
        cmd = [sys.executable, WORKER, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", WORKER, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, cwd=cwd, env=env(**extra_env))


@pytest.fixture(scope="module")
def grpo_one_process(toy, tmp_path_factory):
    """grpo.py in one process on split-independent rollouts (ScriptedEngine), 2 steps, a checkpoint each."""
    out = tmp_path_factory.mktemp("grpo_w1")
    proc = launch(["script", "grpo", *script_flags(toy, out, "run", "grpo")], 1, out, RLVR_TEST_ENGINE="scripted")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "run"


# ----- one update, every loss -------------------------------------------------------------------------------


def flat(tensors: dict) -> torch.Tensor:
    return torch.cat([t.flatten().double() for t in tensors.values()])


@pytest.fixture(scope="module")
def updates(toy):
    """Results of one update per loss: world size 1, world size 2, and the two defects at world size 2."""
    out = {}
    for tag, nproc, control in (("w1", 1, ""), ("w2", 2, ""), ("average", 2, "average"), ("local_tokens", 2, "local_tokens")):
        path = str(toy["dir"] / f"update_{tag}.pt")
        proc = launch(["update", toy["model"], path, control], nproc, toy["dir"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[tag] = torch.load(path)
    return out


LOSSES = [
    "grpo_token-mean",
    "grpo_seq-mean-token-mean",
    "grpo_seq-mean-token-sum-norm",
    "gapo_token",
    "gapo_sequence",
    "mugrpo",
    "codapo",
    "grpo_token-mean+checkpointing",
]


@pytest.mark.parametrize("loss", LOSSES)
def test_one_update_two_ranks_equals_one(updates, loss):
    one, two = updates["w1"][loss], updates["w2"][loss]
    g1, g2 = flat(one["grads"]), flat(two["grads"])
    assert g1.norm() > 0
    assert ((g2 - g1).norm() / g1.norm()).item() < GRAD_REL_TOL
    assert math.isclose(two["grad_norm"], one["grad_norm"], rel_tol=GRAD_REL_TOL)
    assert math.isclose(two["loss"], one["loss"], rel_tol=GRAD_REL_TOL, abs_tol=1e-9)
    assert (flat(two["params"]) - flat(one["params"])).abs().max().item() < PARAM_TOL
    if loss.endswith("checkpointing"):  # really recomputed, and the same gradient as without recomputation
        assert two["checkpointing"] and one["checkpointing"]
        g0 = flat(updates["w1"]["grpo_token-mean"]["grads"])
        assert ((g2 - g0).norm() / g0.norm()).item() < GRAD_REL_TOL


@pytest.mark.parametrize("control", ["average", "local_tokens"])
def test_exactness_catches_the_defects(updates, control):
    """FSDP's default averaging halves every gradient at 2 ranks; per-rank token counts re-weight the ranks
    (token-mean losses). Both must break the equality the test above asserts."""
    # sequence means and the constant Dr. GRPO normaliser use row counts: per-rank token counts leave them alone
    by_rows = {"grpo_seq-mean-token-mean", "grpo_seq-mean-token-sum-norm", "gapo_sequence"}
    for loss in LOSSES:
        if control == "local_tokens" and loss in by_rows:
            continue
        g1, gc = flat(updates["w1"][loss]["grads"]), flat(updates[control][loss]["grads"])
        assert ((gc - g1).norm() / g1.norm()).item() > DEFECT_MIN, (control, loss)


# ----- end to end, every script ------------------------------------------------------------------------------


def script_flags(toy, out, run_name, method, extra=()):
    settings = dict(num_generations=4, max_new_tokens=4, eval_limit=5, micro_batch_tokens=24, save_every=1)
    if method == "mugrpo":  # a stage of mu = 2 updates of 2 prompts
        settings["updates_per_batch"] = 2
    if method == "opd":  # the teacher: another tiny model, FSDP2-sharded like the policy
        settings["teacher"] = tiny.teacher_model(toy)
    return tiny.run_flags(toy, out, run_name, **settings) + list(extra)


def read_rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/") and k != "wall_s"} for r in rows]


def final_weights(run_dir, folder: str = "final") -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(run_dir, folder, "model.safetensors"))


def assert_rows_close(rows1: list[dict], rows2: list[dict]) -> None:
    assert len(rows1) == len(rows2)
    for a, b in zip(rows1, rows2):
        assert a.keys() == b.keys(), set(a) ^ set(b)
        for k in a:
            if isinstance(a[k], float):
                assert math.isclose(a[k], b[k], rel_tol=METRIC_REL_TOL, abs_tol=1e-7), (k, a[k], b[k], a.get("step"))
            else:
                assert a[k] == b[k], (k, a[k], b[k])


@pytest.mark.parametrize("method", ["grpo", "gapo", "mugrpo", "codapo", "opd"])
def test_scripts_two_ranks_equal_one_rank(toy, tmp_path, method):
    """The real main() of each script, 2 steps with a checkpoint each, on rollouts that do not depend on the
    split (ScriptedEngine): rewards, losses, grad norms, clip fractions, CoDaPO's selections, evaluations and
    the final weights agree with one process."""
    runs = {}
    for nproc in (1, 2):
        name = f"{method}_w{nproc}"
        proc = launch(
            ["script", method, *script_flags(toy, tmp_path, name, method)], nproc, tmp_path, RLVR_TEST_ENGINE="scripted"
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[nproc] = tmp_path / name
    rows1, rows2 = comparable(read_rows(runs[1])), comparable(read_rows(runs[2]))
    train = [r for r in rows1 if "losses/policy_loss" in r]
    assert len(train) >= 2 and any(r["losses/policy_loss"] != 0 for r in train)  # something was learned from
    if method == "codapo":
        assert any("codapo/selected" in r for r in rows1)
    if method == "opd":  # the teacher scored every row on both ranks: the batch's reverse KL is the one process's
        assert all(r["opd/reverse_kl"] != 0 for r in rows1 if "opd/reverse_kl" in r)
    assert_rows_close(rows1, rows2)
    w1, w2 = final_weights(runs[1]), final_weights(runs[2])
    assert w1.keys() == w2.keys()
    initial = final_weights(os.path.dirname(toy["model"]), "model")
    moved = max((w1[k] - initial[k]).abs().max().item() for k in w1)
    assert moved > 1e-4  # training changed the weights
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < WEIGHT_TOL


@pytest.mark.parametrize("method,mode", [("grpo", "token-tis"), ("mugrpo", "seq-mask")])
def test_rollout_correction_two_ranks_equal_one_rank(toy, tmp_path, method, mode):
    """An engine that returns log-probs (scripted, far from the trainer's: every weight is moved) and a rollout
    correction on: the mismatch/ and rollout_is/ metrics, losses and final weights agree with one process."""
    runs = {}
    extra = ["--rollout-is", mode, "--max-engine-logp-diff", "0"]
    for nproc in (1, 2):
        name = f"{method}_is_w{nproc}"
        flags = script_flags(toy, tmp_path, name, method) + extra
        proc = launch(["script", method, *flags], nproc, tmp_path, RLVR_TEST_ENGINE="scripted_logps")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[nproc] = tmp_path / name
    rows1, rows2 = comparable(read_rows(runs[1])), comparable(read_rows(runs[2]))
    first = [r for r in rows1 if "mismatch/abs_log_rho_mean" in r]
    assert first and all(r["rollout_is/token_changed_frac"] > 0 for r in first)  # the correction reweighted
    assert_rows_close(rows1, rows2)
    w1, w2 = final_weights(runs[1]), final_weights(runs[2])
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < WEIGHT_TOL


def test_lora_two_ranks_equal_one_process_and_resume_across_world_sizes(toy, tmp_path):
    """LoRA (rank 2 on every linear layer) with the KL term (its reference: the base with the adapters off, through
    the FSDP2 forward): 2 gloo ranks on split-independent rollouts equal one process in every metric, the adapters
    and the merged final model; the 2-rank step-1 checkpoint (adapters, AdamW state sharded over 2) resumed by one
    process ends where the uninterrupted run ended."""
    from safetensors.torch import load_file

    extra = ["--lora-rank", "2", "--beta", "0.05", "--learning-rate", "1e-2"]
    runs = {}
    for nproc in (1, 2):
        name = f"lora_w{nproc}"
        proc = launch(
            ["script", "grpo", *script_flags(toy, tmp_path, name, "grpo", extra)], nproc, tmp_path, RLVR_TEST_ENGINE="scripted"
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[nproc] = tmp_path / name
    rows1, rows2 = read_rows(runs[1]), read_rows(runs[2])
    assert {r["perf/trainable_params"] for r in rows1 + rows2 if "perf/trainable_params" in r} == {2176}  # 2 x 1088
    assert_rows_close(comparable(rows1), comparable(rows2))
    assert any(r.get("losses/policy_loss") for r in rows1)  # something was learned from
    a1, a2 = (load_file(run / "final_adapter" / "adapter_model.safetensors") for run in (runs[1], runs[2]))
    assert a1.keys() == a2.keys() and len(a1) == 28
    assert max(v.abs().max().item() for k, v in a1.items() if ".lora_B." in k) > 1e-3  # the adapters moved
    assert max((a1[k] - a2[k]).abs().max().item() for k in a1) < WEIGHT_TOL
    w1, w2 = final_weights(runs[1]), final_weights(runs[2])
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < WEIGHT_TOL
    resumed = tmp_path / "lora_resumed_w1"
    shutil.copytree(runs[2], resumed)
    assert len([n for n in os.listdir(resumed / "checkpoints" / "step_000001" / "optimizer") if n.endswith(".distcp")]) == 2
    for gone in ("checkpoints/step_000002", "final", "final_adapter"):
        shutil.rmtree(resumed / gone)
    flags = script_flags(toy, tmp_path, "lora_resumed_w1", "grpo", extra)
    proc = launch(["script", "grpo", *flags, "--resume", str(resumed)], 1, tmp_path, RLVR_TEST_ENGINE="scripted")
    assert proc.returncode == 0, proc.stderr[-3000:]
    a3 = load_file(resumed / "final_adapter" / "adapter_model.safetensors")
    assert max((a2[k] - a3[k]).abs().max().item() for k in a2) < WEIGHT_TOL
    assert_rows_close(comparable(rows2), comparable(read_rows(resumed)))


# ----- the real HF engine, checkpoints, failures ---------------------------------------------------------------


def test_two_rank_smoke_real_engine_then_resume_in_one_process(toy, tmp_path):
    """2 ranks with the real transformers engine (synced generation under FSDP2), a checkpoint per step; the
    2-rank checkpoint resumes in one process and in two, and the HF folders load with transformers."""
    from transformers import AutoModelForCausalLM

    flags = script_flags(toy, tmp_path, "smoke", "grpo")
    proc = launch(["script", "grpo", *flags], 2, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2/2" in proc.stdout and proc.stdout.count("final model:") == 1  # rank 0 prints, once
    run = tmp_path / "smoke"
    rows = read_rows(run)
    assert [r["step"] for r in rows if "rollout/reward_mean" in r] == [1, 2]
    ckpt = run / "checkpoints" / "step_000001"
    assert (ckpt / "optimizer" / ".metadata").is_file()  # sharded optimizer state (Distributed Checkpoint)
    shards = [n for n in os.listdir(ckpt / "optimizer") if n.endswith(".distcp")]
    assert len(shards) == 2
    for folder in (ckpt / "model", run / "final"):
        loaded = AutoModelForCausalLM.from_pretrained(str(folder))
        assert loaded.config.architectures == ["LlamaForCausalLM"]
    # resume the 2-rank run from step 1: once with 1 process, once with 2; both must redo step 2 as it was
    for nproc in (1, 2):
        resumed = tmp_path / f"resume_w{nproc}"
        shutil.copytree(run, resumed)
        shutil.rmtree(resumed / "checkpoints" / "step_000002")
        flags_r = [f for f in flags]
        flags_r[flags_r.index("--run-name") + 1] = f"resume_w{nproc}"
        proc = launch(["script", "grpo", *flags_r, "--resume", str(resumed)], nproc, tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "resumed" in proc.stdout
        step2 = [r for r in read_rows(resumed) if r.get("step") == 2 and "rollout/reward_mean" in r]
        assert len(step2) == 1
    # resuming with 2 ranks from a 2-rank checkpoint reproduces the optimizer state exactly: the learning
    # rate schedule and update counter continue (the rollouts differ: HF sampling depends on the batch split)
    r_orig = [r for r in rows if r.get("step") == 2 and "update" in r and "charts/learning_rate" in r]
    r_res = [r for r in read_rows(tmp_path / "resume_w2") if r.get("step") == 2 and "charts/learning_rate" in r]
    assert [r["update"] for r in r_orig] == [r["update"] for r in r_res]


@pytest.mark.parametrize("engine", ["scripted", "hf"])
def test_dynamic_sampling_two_ranks(toy, tmp_path, engine):
    """--dynamic-sampling under torchrun: each rank fills its own slots of the plan with the groups it generated
    (no tokens move between ranks), so both ranks train the same number of groups and no collective is left
    waiting; the batch keeps P groups, the kept ones vary, and the fillers are the all-equal rest. With the
    scripted engine (rollouts that do not depend on the split) and with the real transformers engine."""
    flags = script_flags(toy, tmp_path, f"dyn_{engine}", "grpo", ["--dynamic-sampling", "--max-sampling-rounds", "3"])
    flags += ["--log-rollouts-every", "1"]
    extra_env = {"RLVR_TEST_ENGINE": "scripted"} if engine == "scripted" else {}
    proc = launch(["script", "grpo", *flags], 2, tmp_path, **extra_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / f"dyn_{engine}"
    train = [r for r in read_rows(run) if "dynamic/rounds" in r]
    assert [r["step"] for r in train] == [1, 2]
    with open(run / "rollouts.jsonl") as f:
        rollouts = [json.loads(line) for line in f]
    for r in train:
        rows = [x for x in rollouts if x["step"] == r["step"]]
        assert len(rows) == 16  # P = 4 groups of G = 4, dealt 2 and 2
        groups = [rows[i : i + 4] for i in range(0, 16, 4)]
        varied = sum(len({x["reward"] for x in g}) > 1 for g in groups)
        assert r["dynamic/kept_groups"] == varied and r["dynamic/kept_groups"] + r["dynamic/filler_groups"] == 4
        assert r["dynamic/sampled_groups"] == 4 * r["dynamic/rounds"] and 1 <= r["dynamic/rounds"] <= 3


def test_synced_generation_rank_done_early_steps_without_drawing(toy, tmp_path):
    """The HF engine under FSDP2: rank 0's rows all end at their first token, rank 1's run 9 steps. Rank 0 keeps
    stepping (its forwards are collectives) without sampling: each rank's completions, log-probs and next random
    draw equal one unsharded process generating that rank's prompts from the same seed."""
    from tests.dist_worker import GEN_MAX_NEW, generate_setup

    out = str(tmp_path / "gen.pt")
    proc = launch(["generate", toy["model"], out], 2, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tok = tiny.make_tokenizer()
    for rank in (0, 1):
        got = torch.load(f"{out}.rank{rank}")
        model = models.load_model(toy["model"], torch.device("cpu"))
        engine, prompts = generate_setup(rank, model, tok)
        torch.manual_seed(11)
        ro = engine.generate(prompts, 2, GEN_MAX_NEW, 0.9, progress=False)
        assert got["completions"] == [ro.completion(r) for r in range(len(ro))], rank
        assert {len(c) for c in got["completions"]} == ({1} if rank == 0 else {GEN_MAX_NEW})
        for a, b in zip(got["logps"], (ro.engine_logp(r) for r in range(len(ro)))):
            assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, rank
        assert torch.equal(got["next_draw"], torch.rand(3)), rank  # the synced steps drew nothing


def test_checkpoints_resume_exactly_across_world_sizes(toy, tmp_path, grpo_one_process):
    """With split-independent rollouts, a run resumed from a 2-rank checkpoint with 1 process and with 2
    processes, and a one-process checkpoint resumed with 2, end with the weights of the uninterrupted run."""
    base = ["script", "grpo", *script_flags(toy, tmp_path, "full", "grpo")]
    proc = launch(base, 2, tmp_path, RLVR_TEST_ENGINE="scripted")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for nproc in (1, 2):
        name = f"resumed_w{nproc}"
        shutil.copytree(tmp_path / "full", tmp_path / name)
        shutil.rmtree(tmp_path / name / "checkpoints" / "step_000002")
        shutil.rmtree(tmp_path / name / "final")
        flags = script_flags(toy, tmp_path, name, "grpo")
        proc = launch(
            ["script", "grpo", *flags, "--resume", str(tmp_path / name)], nproc, tmp_path, RLVR_TEST_ENGINE="scripted"
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        w_full, w_res = final_weights(tmp_path / "full"), final_weights(tmp_path / name)
        assert max((w_full[k] - w_res[k]).abs().max().item() for k in w_full) < WEIGHT_TOL, nproc
        assert_rows_close(comparable(read_rows(tmp_path / "full")), comparable(read_rows(tmp_path / name)))
    # and a one-process checkpoint (its optimizer state one shard) resumed by 2 ranks
    shutil.copytree(grpo_one_process, tmp_path / "full_w1")
    shutil.copytree(tmp_path / "full_w1", tmp_path / "w1_resumed_w2")
    shutil.rmtree(tmp_path / "w1_resumed_w2" / "checkpoints" / "step_000002")
    shutil.rmtree(tmp_path / "w1_resumed_w2" / "final")
    flags = script_flags(toy, tmp_path, "w1_resumed_w2", "grpo")
    proc = launch(
        ["script", "grpo", *flags, "--resume", str(tmp_path / "w1_resumed_w2")], 2, tmp_path, RLVR_TEST_ENGINE="scripted"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    w_full, w_res = final_weights(tmp_path / "full_w1"), final_weights(tmp_path / "w1_resumed_w2")
    assert max((w_full[k] - w_res[k]).abs().max().item() for k in w_full) < WEIGHT_TOL


def test_two_nodes_equal_one_process_and_resume_across_the_change(toy, tmp_path, grpo_one_process):
    """--nnodes 2 --node-rank 0/1 with c10d rendezvous on localhost, one gloo process per node: the run equals the
    one-process run (every metric, the final weights); its step-1 checkpoint resumed by one process, and the
    one-process run's step-1 checkpoint resumed on two nodes, end as the uninterrupted run did."""

    def truncated_copy(run, name):  # the run as a kill after step 1's checkpoint leaves it
        shutil.copytree(run, tmp_path / name)
        shutil.rmtree(tmp_path / name / "checkpoints" / "step_000002")
        shutil.rmtree(tmp_path / name / "final")
        return ["script", "grpo", *script_flags(toy, tmp_path, name, "grpo"), "--resume", str(tmp_path / name)]

    def assert_same_run(name):
        assert_rows_close(comparable(read_rows(grpo_one_process)), comparable(read_rows(tmp_path / name)))
        w1, w2 = final_weights(grpo_one_process), final_weights(tmp_path / name)
        assert w1.keys() == w2.keys() and max((w1[k] - w2[k]).abs().max().item() for k in w1) < WEIGHT_TOL, name

    nodes = launch_two_nodes(
        ["script", "grpo", *script_flags(toy, tmp_path, "nodes", "grpo")], tmp_path, RLVR_TEST_ENGINE="scripted"
    )
    assert [p.returncode for p in nodes] == [0, 0], nodes[0].stderr[-2000:] + nodes[1].stderr[-2000:]
    assert sum(p.stdout.count("final model:") for p in nodes) == 1  # one console: the global rank 0's
    assert_same_run("nodes")
    proc = launch(truncated_copy(tmp_path / "nodes", "nodes_resumed_w1"), 1, tmp_path, RLVR_TEST_ENGINE="scripted")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run("nodes_resumed_w1")
    resumed = launch_two_nodes(truncated_copy(grpo_one_process, "w1_resumed_nodes"), tmp_path, RLVR_TEST_ENGINE="scripted")
    assert [p.returncode for p in resumed] == [0, 0], resumed[0].stderr[-2000:] + resumed[1].stderr[-2000:]
    assert_same_run("w1_resumed_nodes")


def test_error_on_one_rank_stops_both_with_one_line(toy, tmp_path):
    """A custom reward that raises on rank 1 only: both ranks stop (no hang: the subprocess timeout and the
    60 s process-group timeout would fail this test), the error line is printed once."""
    flags = script_flags(toy, tmp_path, "fail", "grpo")
    flags[flags.index("--reward") + 1] = os.path.join(ROOT, "tests", "dist_rewards.py") + ":fail_on_rank1"
    proc = launch(["script", "grpo", *flags], 2, tmp_path, RLVR_TEST_ENGINE="scripted")
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "reward sandbox could not start on this rank" in lines[0] and "(rank 1)" in lines[0]


@pytest.mark.parametrize("slow_rank", [0, 1])
def test_a_shared_error_reaches_the_user_once_whichever_rank_exits_first(toy, tmp_path, slow_rank):
    """The race of a bad flag under torchrun: every rank raises the same one-line error, one rank's stderr is slow
    (each write 1.5 s late), the other rank is done first and torchrun then stops the slow one. Twice each: the
    line is printed exactly once, whichever rank prints it."""
    flags = script_flags(toy, tmp_path, "race", "grpo")
    flags[flags.index("--prompts-per-step") + 1] = "6"  # 2 mini-batches of 3 groups: not dealt evenly to 2 ranks
    for attempt in range(2):
        proc = launch(["slow-stderr", str(slow_rank), "script", "grpo", *flags], 2, tmp_path)
        assert proc.returncode != 0
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "multiple of 2" in lines[0], (attempt, proc.stderr[-2000:])


@pytest.mark.parametrize("slow_rank", [0, 1])
def test_each_failing_ranks_own_error_reaches_the_user_once(tmp_path, slow_rank):
    """Both ranks fail, each with its own error: both lines reach the user once each, with their rank, though the
    rank whose stderr is slow would otherwise be stopped by torchrun before it wrote its line."""
    proc = launch(["slow-stderr", str(slow_rank), "fail-each-rank"], 2, tmp_path)
    assert proc.returncode != 0
    lines = sorted(line for line in proc.stderr.splitlines() if line.startswith("error:"))
    assert lines == ["error: rank 0's own failure (rank 0)", "error: rank 1's own failure (rank 1)"], proc.stderr[-2000:]


def test_uneven_batch_fails_before_loading(toy, tmp_path):
    """--prompts-per-step that cannot be dealt evenly to 2 ranks: one line, exit 2, before any model loads."""
    flags = script_flags(toy, tmp_path, "uneven", "grpo")
    flags[flags.index("--prompts-per-step") + 1] = "6"  # 2 mini-batches of 3 groups
    proc = launch(["script", "grpo", *flags], 2, tmp_path)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-2000:]  # every rank checks the flags; rank 0 prints
    assert "multiple of 2" in lines[0] and "Loading weights" not in proc.stderr


def test_torchrun_with_one_process_runs_the_distributed_path(toy):
    """torchrun --nproc-per-node 1 is the distributed path on one process (issue 50): a gloo process group, the policy
    under FSDP2 and the synced HF engine, so the GPU check's torchrun steps test NCCL and FSDP2 on one GPU. Before
    issue 50 it was a plain one-process run (no group, no FSDP2); a plain `python` run still is."""
    import json

    found = {}
    for nproc in (1, "torchrun-1"):
        cmd = [sys.executable, WORKER, "world", toy["model"]]
        if nproc != 1:
            cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, cwd=toy["dir"], env=env())
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        line = next(x for x in proc.stdout.splitlines() if x.startswith("WORLD "))
        found[nproc] = json.loads(line[len("WORLD ") :])
        # the one line that says so (issue 61: a launcher's four variables for one process took this path silently)
        assert (run.ONE_PROCESS_GROUP in proc.stdout + proc.stderr) == (nproc != 1), proc.stderr[-2000:]
    assert found["torchrun-1"] == {
        "process_group": True, "backend": "gloo", "world_size": 1, "enabled": True, "fsdp2": True, "engine": "HFEngine",
    }  # fmt: skip
    assert found[1] == {
        "process_group": False, "backend": None, "world_size": None, "enabled": False, "fsdp2": False, "engine": "HFEngine",
    }  # fmt: skip
