"""Peak memory and time of one training forward+backward with and without --gradient-checkpointing.

The embedded model (SmolLM2-135M, 30 decoder layers) on CPU, loaded by models.load_model exactly as the
scripts load it; rows of random token ids (prompt + completion, every completion token real) go through
common.completion_logps and grpo.compute_policy_loss, then backward. Modes, each in a fresh subprocess:
  off   --gradient-checkpointing not set;
  on    --gradient-checkpointing set (load_model puts the model in training mode, so layers are checkpointed);
  eval  the flag set but the model left in eval mode, as an older load_model did: transformers then
        checkpoints nothing, and memory equals `off`.
Each child runs one warm-up pass (it allocates the gradients), then the measured pass with the gradients
kept allocated, so the reported growth of peak resident memory (VmHWM, reset through /proc/self/clear_refs,
over VmRSS right before the pass) is the activations' share. Also reported: checkpoint calls of the decoder
layers (transformers.modeling_utils.checkpoint) and decoder-layer forward calls per pass (2 x 30 when the
backward recomputes them). Ratios are against `off` at the same size, in the same run.

    flock /tmp/cpu.lock /work/venv/bin/python bench/grad_checkpointing.py            # 4x256 and 8x512 tokens
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import torch
import transformers.modeling_utils as mu
import common, grpo
import models
import run
from scaling import OthersLoad, peak_rss_gb, proc_status_gb, reset_peak_rss
mode, rows, prompt_len, completion_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
run.set_cpu_threads()
calls = []
real = mu.checkpoint
mu.checkpoint = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
model = models.load_model(models.EMBEDDED_MODEL, torch.device("cpu"), gradient_checkpointing=mode != "off")
if mode == "eval":
    model.eval()
forwards = []
for layer in model.model.layers:
    layer.register_forward_pre_hook(lambda m, i: forwards.append(1))
g = torch.Generator().manual_seed(0)
vocab = model.config.vocab_size
prompts = torch.randint(0, vocab, (rows, prompt_len), generator=g).tolist()
completions = torch.randint(0, vocab, (rows, completion_len), generator=g).tolist()
tb = common.pad_batch(prompts, completions, pad_id=0)
advantages = torch.randn(rows, generator=g)
def one_pass():
    logp, _ = common.completion_logps(model, tb, 1.0, 256)
    loss, _ = grpo.compute_policy_loss(logp, logp.detach(), advantages, tb.completion_mask)
    loss.backward()
one_pass()  # warm-up: allocates .grad
model.zero_grad(set_to_none=False)
calls.clear(); forwards.clear()
import ctypes
ctypes.CDLL("libc.so.6").malloc_trim(0)
base = proc_status_gb("VmRSS")
reset_peak_rss()
with OthersLoad() as others:
    t0 = time.perf_counter()
    one_pass()
    seconds = time.perf_counter() - t0
print(json.dumps({"mode": mode, "rows": rows, "tokens": rows * (prompt_len + completion_len),
                  "training": model.training, "checkpoint_calls": len(calls), "layer_forwards": len(forwards),
                  "layers": len(model.model.layers), "s": seconds, "peak_growth_gb": peak_rss_gb() - base,
                  "base_rss_gb": base, "others_cores": others.cores}))
""".replace("ROOT", repr(ROOT))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=["4x64x192", "8x64x448"], help="rows x prompt tokens x completion tokens")
    p.add_argument("--modes", nargs="+", default=["off", "on", "eval"])
    p.add_argument("--out", default="", help="also write the raw JSON rows here")
    o = p.parse_args()
    results = []
    print(f"start {time.strftime('%H:%M:%S')}", flush=True)
    for size in o.sizes:
        rows, plen, clen = (int(x) for x in size.split("x"))
        for mode in o.modes:
            out = subprocess.run(
                [sys.executable, "-c", CHILD, mode, str(rows), str(plen), str(clen)], capture_output=True, text=True
            )
            if out.returncode != 0:
                raise SystemExit(f"{mode} {size} failed:\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results.append(r)
            print(json.dumps(r), flush=True)
    print(
        "| rows x tokens | mode | training mode | checkpoint calls | layer forwards | fwd+bwd s | "
        "peak RSS growth GB | memory vs off | time vs off | others' load (cores) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ref = next(x for x in results if x["mode"] == "off" and x["tokens"] == r["tokens"] and x["rows"] == r["rows"])
        print(
            f"| {r['rows']} x {r['tokens'] // r['rows']} | {r['mode']} | {r['training']} | {r['checkpoint_calls']} | "
            f"{r['layer_forwards']} | {r['s']:.2f} | {r['peak_growth_gb']:.2f} | "
            f"{r['peak_growth_gb'] / max(ref['peak_growth_gb'], 1e-9):.2f} | {r['s'] / max(ref['s'], 1e-9):.2f} | "
            f"{r['others_cores']:.2f} |"
        )
    print(f"done {time.strftime('%H:%M:%S')}")
    if o.out:
        with open(o.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
