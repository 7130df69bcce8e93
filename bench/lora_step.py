"""One training step of a 7B-shaped model with LoRA against full fine-tuning: peak GPU memory and tokens/s.

The device machine has no network, so the model is Qwen2.5-7B's published shape (below) with random weights: time
and memory of a step do not depend on the values. Each arm runs in its own process (a clean peak, and an out-of-memory
that stops one arm only), through the code every method script runs:
- the model: `models.model_dtypes` + `models.add_lora` (LoRA: the base frozen in bf16, fp32 adapters on every linear
  layer of the decoder; full: fp32 master weights), bf16 autocast, `--gradient-checkpointing`;
- the step: `common.micro_batches` + `common.completion_logps` + `grpo.compute_policy_loss` + backward, then
  `common.clip_grad_norm` and `models.make_optimizer`'s fused AdamW (its state made at the first step, as in a run).
Rows of `--prompt-len` + `--completion-len` random tokens; the first step warms up, the next `--repeats` are timed.

    python bench/lora_step.py                                   # on a GPU: full, then LoRA r1, r16, r64 at 7B
    python bench/lora_step.py --config tiny --device cpu        # seconds: checks the script (tests/test_lora.py)

The device has torch and transformers but no network: PEFT (and accelerate, which it imports) travel as wheels.

    python bench/lora_step.py --export-wheels               # here, once: into the git-ignored bench/wheels/ (about 1 MiB)
    run(command="pip install -q --no-deps bench/wheels/*.whl; PYTHONUNBUFFERED=1 python3 bench/lora_step.py",
        carry=["bench/wheels"], timeout_s=540)                # on the lent device: 4 arms, each under 4 minutes

Not run on a GPU yet (no device was lent to the LoRA issue): docs/lora.md has the command and no figures from it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import memory_plan  # noqa: E402 - bench/memory_plan.py: the shapes of the recipes' models

CONFIGS = {  # config.json of Qwen/Qwen2.5-7B-Instruct: memory_plan's shape fields, and the rest a model needs
    "qwen2.5-7b": dict(memory_plan.SHAPES["qwen2.5-7b"], **memory_plan.QWEN25_REST),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
    ),
}


def one_arm(a) -> dict:
    """The arm `a.rank` (0: full fine-tuning) in this process -> its figures."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    import common
    import grpo
    import models
    import run
    from tests import references

    device = torch.device(a.device)
    lora = models.LoRA(a.rank, 32.0, ("all-linear",), "random", seed=1) if a.rank else None
    dtype, autocast_dtype = models.model_dtypes(device, trainable=lora is None)  # LoRA: the base in the compute dtype
    config = Qwen2Config(**CONFIGS[a.config], use_cache=False)
    out = {"arm": f"LoRA r{a.rank}" if a.rank else "full", "config": a.config, "weights": str(dtype)}
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if lora is not None:
        models.add_lora(model, lora, log=False)
        model.to(device)
    models.set_model_traits(model, autocast_dtype=autocast_dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    trainable, total = models.trainable_params(model)
    out.update(params=total, trainable=trainable, build_s=round(time.perf_counter() - t0, 1))
    if device.type == "cuda":
        out["weights_gb"] = round(torch.cuda.memory_allocated(device) / 2**30, 2)
        torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(1)
    vocab, rows = config.vocab_size, a.rows
    prompts = [torch.randint(0, vocab, (a.prompt_len,), generator=gen).tolist() for _ in range(rows)]
    completions = [torch.randint(0, vocab, (a.completion_len,), generator=gen).tolist() for _ in range(rows)]
    batch = references.rollout_from_rows(prompts, completions)  # every row its own prompt: nothing packs
    advantages = torch.randn(rows, generator=gen)
    optimizer, _ = models.make_optimizer(model, run.Args(learning_rate=1e-5, weight_decay=0.0, warmup_updates=1))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for rep in range(a.repeats + 1):  # the first step warms up (kernels, the allocator, AdamW's state)
        sync()
        start = time.perf_counter()
        for mb in common.micro_batches(batch, list(range(rows)), a.micro_batch_tokens, model):
            tb = common.token_batch_of(batch, mb, 0)
            logp, _ = common.completion_logps(model, tb, 1.0, a.logp_chunk_tokens, with_entropy=False)
            mask = tb.completion_mask.to(logp.device)
            loss, _ = grpo.compute_policy_loss(logp, logp.detach(), advantages[mb].to(logp.device), mask)
            (loss * len(mb) / rows).backward()
        common.clip_grad_norm(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        if rep:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens = rows * (a.prompt_len + a.completion_len)
    out.update(
        step_s=round(step_s, 3), tokens_per_s=round(tokens / step_s, 1), peak_gb=round(common.peak_memory_gb(device), 2)
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen2.5-7b", choices=sorted(CONFIGS))
    p.add_argument("--ranks", type=int, nargs="+", default=[0, 1, 16, 64], help="0: full fine-tuning")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--completion-len", type=int, default=768)
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--logp-chunk-tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=int, default=240, help="seconds per arm")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # one arm, in a child process
    p.add_argument("--export-wheels", action="store_true", help="download PEFT's wheels into bench/wheels/ and stop")
    p.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for lora_step.json (default $OUT)")
    a = p.parse_args()
    if a.rank is not None:
        print("RESULT " + json.dumps(one_arm(a)), flush=True)
        return
    if a.export_wheels:
        folder = os.path.join(ROOT, "bench", "wheels")
        pins = ["peft==0.21.2", "accelerate==1.16.0"]  # requirements.txt's peft; the accelerate this was tested with
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", folder, *pins], check=True)
        print(f"wrote {folder}: {', '.join(sorted(os.listdir(folder)))}")
        return
    results = []
    for rank in a.ranks:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--rank", str(rank)]
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, cwd=ROOT)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if lines:
                result = json.loads(lines[-1][len("RESULT ") :])
            else:
                err = proc.stderr.strip().splitlines()
                oom = next((line for line in err if "OutOfMemoryError" in line or "out of memory" in line), None)
                result = {"arm": f"LoRA r{rank}" if rank else "full", "error": (oom or (err[-1] if err else "?"))[:300]}
        except subprocess.TimeoutExpired:
            result = {"arm": f"LoRA r{rank}" if rank else "full", "error": f"timed out after {a.timeout} s"}
        result["wall_s"] = round(time.time() - t0, 1)
        results.append(result)
        print(json.dumps(result), flush=True)
    keys = ["arm", "params", "trainable", "weights_gb", "peak_gb", "step_s", "tokens_per_s", "error"]
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in results:
        print("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "lora_step.json"), "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
