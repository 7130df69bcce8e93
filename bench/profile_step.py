"""Where one step of grpo.py's code path spends its time on CPU, and what a candidate fix would save.

Loads the embedded model as grpo.main does, generates one rollout batch (P x G, max T tokens) with the
HF engine, then:
  1. times generation;
  2. profiles one training pass (pad_batch -> common.completion_logps -> compute_policy_loss -> backward ->
     clip -> AdamW step) with torch.profiler and prints the top operators by self CPU time;
  3. times forward+backward of the log-prob pass three ways on the same batch: the current
     common.completion_logps (per-chunk activation checkpointing, entropy inside the checkpoint), a
     candidate with a hand-written autograd function (one LM-head matmul forward, recomputed once in
     backward with the gradient written in closed form, entropy only in forward), and the backbone alone
     (lower bound: no LM head at all); checks that the candidate gives the same log-probs and gradients.

    flock /tmp/cpu.lock python bench/profile_step.py            # P=4, G=8, T=64 (about 2-3 minutes)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common  # noqa: E402
import grpo  # noqa: E402
import models  # noqa: E402
import run  # noqa: E402
import verifiers  # noqa: E402
from tests import references  # noqa: E402


class ChunkedLogp(torch.autograd.Function):
    """Candidate for common.completion_logps: log-prob (N,) with grad and entropy (N,) without, LM head in
    chunks of `chunk` rows; backward recomputes each chunk's logits once and writes d logp / d logits =
    (onehot - softmax) / temperature directly (no autograd graph, no entropy recompute)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, softcap, chunk):
        logps, ents, logzs = [], [], []
        with torch.no_grad():
            for s in range(0, hidden.shape[0], chunk):
                logits = F.linear(hidden[s : s + chunk], weight, bias).float()
                if softcap:
                    logits = softcap * torch.tanh(logits / softcap)
                logits.div_(temperature)
                logz = torch.logsumexp(logits, dim=-1)
                logps.append(logits.gather(-1, targets[s : s + chunk].unsqueeze(-1)).squeeze(-1) - logz)
                log_p = logits.sub_(logz.unsqueeze(-1))  # in place: log p = z - logz
                ents.append(-(log_p.exp() * log_p).sum(-1))  # entropy = -sum p log p
                logzs.append(logz)
        logz = torch.cat(logzs) if logzs else hidden.new_zeros(0, dtype=torch.float32)
        ctx.save_for_backward(hidden, weight, bias, targets, logz)
        ctx.temperature, ctx.softcap, ctx.chunk = temperature, softcap, chunk
        entropy = torch.cat(ents) if ents else logz.clone()
        ctx.mark_non_differentiable(entropy)
        return (torch.cat(logps) if logps else logz.clone()), entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, targets, logz = ctx.saved_tensors
        T, softcap, chunk = ctx.temperature, ctx.softcap, ctx.chunk
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_b = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[2] else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            raw = F.linear(h, weight, bias).float()
            z = softcap * torch.tanh(raw / softcap) if softcap else raw
            g = grad_logp[s : s + chunk].float()
            # d logp_y / d z_j = (1[j = y] - p_j) / T, times the incoming gradient g
            dz = (z / T - logz[s : s + chunk].unsqueeze(-1)).exp_().mul_(-g.unsqueeze(-1))
            dz.scatter_add_(-1, targets[s : s + chunk].unsqueeze(-1), g.unsqueeze(-1))
            dz.div_(T)
            if softcap:
                dz.mul_(1 - (z / softcap) ** 2)
            dz = dz.to(h.dtype)
            if grad_h is not None:
                grad_h[s : s + chunk] = dz @ weight
            if grad_w is not None:
                grad_w.addmm_(dz.t(), h)
            if grad_b is not None:
                grad_b.add_(dz.sum(0))
        return grad_h, grad_w, grad_b, None, None, None, None


def candidate_completion_logps(model, batch, temperature, chunk_tokens=256, with_entropy=True):
    """common.completion_logps with ChunkedLogp in place of the per-chunk checkpoint."""
    device = next(model.parameters()).device
    input_ids, attention = batch.input_ids.to(device), batch.attention_mask.to(device)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    T = batch.completion_ids.shape[1]
    body = getattr(model, model.base_model_prefix)
    hidden = body(input_ids=input_ids, attention_mask=attention, position_ids=position_ids, use_cache=False).last_hidden_state[
        :, -T - 1 : -1, :
    ]
    head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    mask = batch.completion_mask.to(device).bool()
    lp, ent = ChunkedLogp.apply(
        hidden[mask], head.weight, head.bias, batch.completion_ids.to(device)[mask], temperature, softcap, chunk_tokens
    )
    out = torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_scatter(mask, lp)
    entropy = torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_scatter(mask, ent)
    return out, (entropy if with_entropy else None)


def backbone_only(model, batch, temperature, chunk_tokens=256, with_entropy=True):
    device = next(model.parameters()).device
    attention = batch.attention_mask.to(device)
    body = getattr(model, model.base_model_prefix)
    hidden = body(
        input_ids=batch.input_ids.to(device),
        attention_mask=attention,
        position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
        use_cache=False,
    ).last_hidden_state
    T = batch.completion_ids.shape[1]
    return hidden[:, -T - 1 : -1, :].sum(-1), None


def fwd_bwd(fn, model, tb, chunk):
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    logp, _ = fn(model, tb, 1.0, chunk)
    t1 = time.perf_counter()
    (logp * tb.completion_mask).sum().div(tb.completion_mask.sum()).backward()
    t2 = time.perf_counter()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), grads, t1 - t0, t2 - t1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--force-length", action="store_true", help="every row runs --max-new-tokens (no row ends at EOS)")
    p.add_argument("--top", type=int, default=18, help="operators to list")
    p.add_argument("--seed", type=int, default=1)
    o = p.parse_args()

    run.set_cpu_threads()
    run.seed_everything(o.seed)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}", flush=True)
    tokenizer = models.load_tokenizer(models.EMBEDDED_MODEL)
    model = models.load_model(models.EMBEDDED_MODEL, torch.device("cpu"))
    print(f"attention implementation: {model.config._attn_implementation}")
    if o.force_length:  # the engine ignores the model's generation_config: its rows simply never end
        references.full_length_rows()
    optimizer, scheduler = models.make_optimizer(model, run.Args(learning_rate=1e-5, weight_decay=0.0, warmup_updates=2))
    engine = models.make_engine(
        run.Args(engine="hf", seed=o.seed, gen_batch_size=64, gpu_memory_utilization=0.3), model, tokenizer, "", 512
    )
    task = verifiers.load_task("arith", "train", o.seed)
    problems = [task.problems[i] for i in common.PromptSampler(len(task.problems), o.seed).sample(o.prompts)]
    prompts = [common.format_prompt(tokenizer, q["question"], task.instruction) for q in problems]

    engine.generate(prompts[:1], 2, 4, 1.0, progress=False)  # warm-up
    t0 = time.perf_counter()
    rollout = engine.generate(prompts, o.G, o.max_new_tokens, 1.0, seed=o.seed, progress=False)
    gen_s = time.perf_counter() - t0
    B = len(rollout)
    n_tok = int(rollout.completion_lengths.sum())
    print(f"\n## generation: {B} rows, {n_tok / B:.1f} completion tokens/row, {gen_s:.2f} s ({n_tok / gen_s:.1f} tokens/s)")

    pad_id = tokenizer.pad_token_id
    tb = common.token_batch_of(rollout, range(len(rollout)), pad_id)
    print(
        f"train batch: {tuple(tb.input_ids.shape)} (rows x padded length), {int(tb.completion_mask.sum())} completion tokens"
    )
    fwd_bwd(common.completion_logps, model, common.token_batch_of(rollout, range(2), pad_id), o.chunk_tokens)  # warm-up

    from torch.profiler import ProfilerActivity, profile

    advantages = torch.randn(B)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logp, entropy = common.completion_logps(model, tb, 1.0, o.chunk_tokens)
        loss, _ = grpo.compute_policy_loss(logp, logp.detach(), advantages, tb.completion_mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        train_s = time.perf_counter() - t0
    print(f"\n## one training pass (profiled, so a little slower): {train_s:.2f} s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=o.top, max_name_column_width=48))

    print("\n## forward+backward of the log-prob pass, same batch")
    lp_ref, g_ref, f_ref, b_ref = fwd_bwd(common.completion_logps, model, tb, o.chunk_tokens)
    lp_new, g_new, f_new, b_new = fwd_bwd(candidate_completion_logps, model, tb, o.chunk_tokens)
    _, _, f_bb, b_bb = fwd_bwd(backbone_only, model, tb, o.chunk_tokens)
    lp_ref2, _, f_ref2, b_ref2 = fwd_bwd(common.completion_logps, model, tb, o.chunk_tokens)  # order effects
    max_lp = (lp_ref - lp_new).abs().max().item()
    rel_g = max(((g_ref[k] - g_new[k]).norm() / g_ref[k].norm().clamp_min(1e-12)).item() for k in g_ref)
    print("| variant | forward s | backward s | total s |\n|---|---|---|---|")
    print(f"| common.completion_logps (current) | {f_ref:.2f} | {b_ref:.2f} | {f_ref + b_ref:.2f} |")
    print(f"| same, run again | {f_ref2:.2f} | {b_ref2:.2f} | {f_ref2 + b_ref2:.2f} |")
    print(f"| candidate ChunkedLogp | {f_new:.2f} | {b_new:.2f} | {f_new + b_new:.2f} |")
    print(f"| backbone only (no LM head) | {f_bb:.2f} | {b_bb:.2f} | {f_bb + b_bb:.2f} |")
    print(f"candidate vs current: max |logp diff| {max_lp:.2e}, max relative grad diff {rel_g:.2e}")


if __name__ == "__main__":
    main()
