"""Time of one AdamW step on the embedded model's parameters (135M, fp32, CPU) for the three torch
implementations: the per-parameter for-loop (torch's CPU default, what models.make_optimizer gets today),
foreach (multi-tensor) and fused (one kernel per parameter group; HF Trainer/TRL's default
"adamw_torch_fused" for torch >= 2.8). Also checks that fused and for-loop give the same parameters after
three steps, and times clip_grad_norm_.

    flock /tmp/cpu.lock python bench/optimizer_step.py        # about 1 minute
"""

from __future__ import annotations

import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import models  # noqa: E402
import run  # noqa: E402


def main():
    run.set_cpu_threads()
    model = models.load_model(models.EMBEDDED_MODEL, torch.device("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    torch.manual_seed(0)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    print(f"{len(params)} parameter tensors, {n / 1e6:.1f}M parameters, threads {torch.get_num_threads()}")
    print("| AdamW implementation | step s (median of 3, after 1 warm-up) |\n|---|---|")
    results = {}
    for name, kw in [
        ("for-loop (foreach=False, torch CPU default)", {"foreach": False}),
        ("foreach=True", {"foreach": True}),
        ("fused=True", {"fused": True}),
    ]:
        opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, betas=(0.9, 0.99), **kw)
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        results[name] = statistics.median(times[1:])
        print(f"| {name} | {results[name]:.3f} |", flush=True)
        del opt
    # same updates? three steps of each implementation from the same weights and gradients
    start = [p.detach().clone() for p in params]
    after = {}
    for name, kw in [("for-loop", {"foreach": False}), ("fused", {"fused": True})]:
        with torch.no_grad():
            for p, s in zip(params, start):
                p.copy_(s)
        opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, betas=(0.9, 0.99), **kw)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g) * 1e-3
            opt.step()
        after[name] = [p.detach().clone() for p in params]
        del opt
    diff = max((a - b).abs().max().item() for a, b in zip(after["for-loop"], after["fused"]))
    print(f"\nmax |parameter difference| fused vs for-loop after 3 steps: {diff:.3e}")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        times.append(time.perf_counter() - t0)
    print(f"\nclip_grad_norm_: {statistics.median(times):.3f} s")


if __name__ == "__main__":
    main()
