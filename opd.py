"""On-policy distillation (OPD: Agarwal et al., "On-Policy Distillation of Language Models", arXiv:2306.13649; Qwen3
report arXiv:2505.09388, sec. 4.5; Thinking Machines, "On-Policy Distillation", 2025) -- what it changes relative to
grpo.py:
  1. a frozen teacher pi_T (--teacher: a hub id, a local folder, a run's final/), loaded once in the compute dtype, a
     model of its own (never the policy object), no optimizer state, FSDP2-sharded like the policy under torchrun; its
     tokenizer must be the student's (cross-tokenizer distillation is out of scope: one line refuses it);
  2. one no-grad teacher forward per batch over the student's sampled completions, with the trainer's packing and
     chunks, logits divided by the sampling temperature: teacher_logp (B, T) = log pi_T(o_it);
  3. the per-token advantage is the sampled token's negative reverse KL (discount 0):
        A_it = c * (log pi_T(o_it) - log pi_old(o_it))                    (c = --opd-coef)
     and, with --opd-reward, plus the verifier's group advantage A_i of grpo.py (slime's "orthogonal" form);
     without it the verifier's rewards do not enter the loss (they are still logged, and evaluation scores);
  4. the clipped surrogate of grpo.py, unchanged, on these per-token advantages;
  5. metrics: opd/reverse_kl (the mean over the batch's completion tokens of log pi_old - log pi_T, the sampled-token
     estimate of KL(pi_old || pi_T)) and opd/teacher_logp (the teacher's mean log-prob of the sampled tokens).

Objective (per sampled token; l_it as in grpo.py with A_it in place of A_i):
    l_it = max(-A_it r_it, -A_it clip(r_it, 1 - eps_low, 1 + eps_high)),  r_it = pi(o_it) / pi_old(o_it)
On-policy (r = 1) its gradient is c * E_{o ~ pi}[(log pi_T(o) - log pi(o)) grad log pi(o)] = -c grad KL(pi || pi_T)
per token: the student moves toward the teacher where it samples (docs/opd.md).

Run:
  python grpo.py --run-name teacher                     # the default GRPO run: its final/ is a teacher
  python opd.py --teacher runs/teacher/final            # CPU default: the embedded SmolLM2-135M-Instruct learns from it
  python opd.py --teacher Qwen/Qwen3-8B --model Qwen/Qwen3-1.7B --dataset math --prompts-per-step 64 \\
      --num-generations 4 --max-new-tokens 4096 --learning-rate 1e-6 --eval-dataset aime24   # GPU + vLLM
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Literal

import torch
from tqdm.auto import tqdm

import async_rollouts
import common
import evaluation
import models
import outputs
import run
import verifiers
from run import arg


@dataclass
class Args(run.Args):  # the common flags (run.Args), then this method's own
    exp_name: str = arg(os.path.splitext(os.path.basename(__file__))[0], "experiment name (method); runs are grouped by it")
    # OPD specific arguments
    teacher: str = arg(
        "", "the frozen teacher: a hub id, a local HF folder or a run's final/ (required; its tokenizer the student's)"
    )
    opd_coef: float = arg(1.0, "c of the per-token advantage c * (log pi_T - log pi_old)")
    opd_reward: bool = arg(
        False, "add the verifier's group advantage (grpo.py's, --scale-rewards) to every token's (slime's orthogonal form)"
    )
    clip_low: float = arg(0.2, "eps_low: lower clip bound 1 - eps_low")
    clip_high: float = arg(0.2, "eps_high: upper clip bound 1 + eps_high (DAPO clip-higher: 0.28)")
    scale_rewards: Literal["group", "none"] = arg(
        "group", "advantage scale: group (divide by group std + 1e-4) or none (Dr. GRPO)"
    )
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = arg(
        "token-mean", "token-mean (DAPO), seq-mean-token-mean (GRPO), seq-mean-token-sum-norm (Dr. GRPO)"
    )
    checks = (  # (flag, test of its value, what it must be): checked with the common flags, before anything loads
        ("clip_low", lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
        ("clip_high", lambda v: 0.0 <= v < math.inf, "must be finite and >= 0"),
        ("opd_coef", lambda v: math.isfinite(v) and v > 0, "must be > 0 (the teacher's weight in the advantage)"),
    )


# ALGO LOGIC: advantages
def compute_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """rewards (B,) -> advantages (B,); rows [g*G:(g+1)*G] are the G rollouts of prompt g."""
    grouped = rewards.view(-1, group_size)  # (P, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # A_i = r_i - mean_g(r)
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centered[:, :1])  # unbiased (N-1)
        centered = centered / (std + 1e-4)  # GRPO eq. (3); all-equal group -> 0 / 1e-4 = 0 exactly
    elif scale != "none":
        raise ValueError(f"scale must be 'group' or 'none', not {scale!r}")
    return centered.reshape(-1)


# ALGO LOGIC: policy loss
def compute_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    loss_agg: str = "token-mean",
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    max_tokens: int | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate. logp, old_logp, ref_logp, mask: (B, T); advantages (B, T) per token (opd_advantages).
    Returns (loss, stats)."""
    mask = mask.to(logp.dtype)
    log_ratio = logp - old_logp  # (B, T) log r_it
    ratio = torch.exp(log_ratio)  # r_it = pi_theta / pi_old
    adv = advantages.to(logp.dtype)  # (B, T) A_it, one per sampled token
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)  # PPO pessimistic bound, (B, T)
    if is_weights is not None:  # rollout correction: w_t (detached) times the clipped term (docs/mismatch.md)
        per_token = per_token * is_weights
    if beta > 0.0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        ref_diff = ref_logp - logp
        per_token = per_token + beta * (torch.exp(ref_diff) - ref_diff - 1.0)  # k3 estimate of KL(pi || pi_ref)
    if loss_agg == "token-mean":  # DAPO: every token of the (mini-)batch weighs the same
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_agg == "seq-mean-token-mean":  # GRPO: mean over sequences of each sequence's token mean
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1.0)).mean()
    elif loss_agg == "seq-mean-token-sum-norm":  # Dr. GRPO: constant normaliser n_seqs * max_tokens
        loss = (per_token * mask).sum() / (mask.shape[0] * (max_tokens or mask.shape[1]))
    else:
        raise ValueError(f"unknown loss_agg {loss_agg!r}")
    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        clip_low = ((ratio < 1.0 - eps_low) & (adv < 0)).to(mask.dtype) * mask  # clipped branch active, grad 0
        clip_high = ((ratio > 1.0 + eps_high) & (adv > 0)).to(mask.dtype) * mask
        stats = {
            "clipfrac": ((clip_low + clip_high).sum() / n).item(),
            "clipfrac_low": (clip_low.sum() / n).item(),
            "clipfrac_high": (clip_high.sum() / n).item(),
            "approx_kl": (((ratio - 1.0) - log_ratio) * mask).sum().div(n).item(),  # k3 of KL(old || new)
        }
    return loss, stats


# ALGO LOGIC: the teacher's per-token advantage
def opd_advantages(teacher_logp: torch.Tensor, old_logp: torch.Tensor, group_adv: torch.Tensor, coef: float) -> torch.Tensor:
    """teacher_logp, old_logp (B, T) of the sampled tokens, group_adv (B,) -> A (B, T): the sampled token's negative
    reverse KL, A_it = c * (log pi_T(o_it) - log pi_old(o_it)), plus the group advantage A_i (zeros: the teacher alone)."""
    return coef * (teacher_logp - old_logp) + group_adv.unsqueeze(1)  # (B, T)


# ALGO LOGIC: the batch's distillation metrics
def opd_metrics(opd_sums: torch.Tensor) -> dict:
    """(3,) sums over the batch's sampled tokens (log pi_old - log pi_T, log pi_T, their count) -> opd/reverse_kl (the
    sampled-token estimate of KL(pi_old || pi_T)) and opd/teacher_logp (the teacher's mean log-prob of them)."""
    kl_sum, teacher_sum, n_tokens = opd_sums.tolist()
    return {"opd/reverse_kl": kl_sum / max(n_tokens, 1.0), "opd/teacher_logp": teacher_sum / max(n_tokens, 1.0)}


# ALGO LOGIC: the teacher, checked before anything loads
def check_teacher(args, student_tokenizer) -> None:
    """One line (UserError) for a teacher this script cannot use: none given, LoRA adapters alone, an incomplete folder,
    or a tokenizer other than the student's (the same vocabulary, token for token: a token id must mean the same in both
    models, or log pi_T(o_it) scores another token; cross-tokenizer distillation is out of scope). --eval-only
    evaluates the student alone: no teacher needed, none checked."""
    if args.eval_only:
        return
    if not args.teacher:
        raise verifiers.UserError(
            "--teacher is required: a hub id, a local model folder or a run's final/ (e.g. python grpo.py --run-name "
            "teacher, then python opd.py --teacher runs/teacher/final)"
        )
    problem = models.model_name_problem(args.teacher, "--teacher")
    if problem:
        raise verifiers.UserError(problem)
    teacher_vocab, student_vocab = models.load_tokenizer(args.teacher).get_vocab(), student_tokenizer.get_vocab()
    if teacher_vocab != student_vocab:
        differ = sum(student_vocab.get(tok) != i for tok, i in teacher_vocab.items()) + len(
            student_vocab.keys() - teacher_vocab.keys()
        )
        raise verifiers.UserError(
            f"--teacher {args.teacher}: its tokenizer is not the student's ({len(teacher_vocab)} tokens against "
            f"{len(student_vocab)}, {differ} differ); cross-tokenizer distillation is out of scope: pick a teacher of "
            "the student's tokenizer (the same model family)"
        )


def load_teacher(args, device: torch.device):
    """The frozen teacher --teacher: a model of its own, never the policy object (a LoRA student's base included), in
    the compute dtype, no optimizer state, FSDP2-sharded like the policy under torchrun (models.load_frozen); None
    under --eval-only."""
    return None if args.eval_only else models.load_frozen(args, args.teacher, device)


def main(args: Args) -> None:
    # TRY NOT TO MODIFY: run dir, logging, seeding, model, engine, data
    world, device = run.setup(args)  # checks, torchrun process group (world size 1: none), threads, seeds
    resume = outputs.resume_of(args)  # --resume: the checkpoint, read and checked before the model loads; else None
    run_dir = resume.run_dir if resume else outputs.make_run_dir(args)
    model_path = resume.model_dir if resume else args.model  # a LoRA checkpoint's: its base (adapters: lora)
    lora = models.lora_settings(args, resume)  # --lora-rank > 0: adapters on the frozen base; None: full fine-tuning
    train_task = verifiers.load_training_task(args)  # data and scoring, gold answers checked (None: --eval-only)
    eval_sets = evaluation.load_sets(args, train_task)  # each set whole, with its protocol (docs/evaluation.md)
    tokenizer = models.load_tokenizer(model_path)
    check_teacher(args, tokenizer)  # ALGO LOGIC
    evaluation.make_prompts(eval_sets, tokenizer)  # each set's prompts, in its template and instruction
    # every prompt against the model's context, before the weights load (a training prompt too long: dropped)
    train_task, max_model_len = models.fit_context(args, model_path, tokenizer, train_task, eval_sets)
    model = models.load_policy(args, model_path, device, lora)  # fp32 master weights; torchrun: FSDP2-sharded
    # --beta: the frozen initial model (a LoRA run's: the policy itself with its adapters off, no second copy)
    ref_model = models.reference_model(args, model, device) if args.beta > 0 else None
    teacher = load_teacher(args, device)  # ALGO LOGIC
    optimizer, scheduler = models.make_optimizer(model, args)
    model_metrics = models.lora_metrics(model)  # LoRA: perf/trainable_params, perf/trainable_frac; else none
    engine = models.make_engine(args, model, tokenizer, model_path, max_model_len)  # vLLM or the HF engine
    scaler = torch.amp.GradScaler(device.type, enabled=args.dtype == "fp16")  # fp16: dynamic loss scaling; else none
    timers = common.Timers(["rollout", "reward", "train", "wake", "sleep", "eval"])
    G, P = args.num_generations, args.prompts_per_step
    pad_id = tokenizer.pad_token_id
    start_step, update, wall_offset, eval_before = 0, 0, 0.0, None
    sampler = common.PromptSampler(len(train_task.problems), args.seed) if train_task else None
    if resume:
        state = outputs.load_trainer_state(resume.state, optimizer, scheduler, model)
        sampler.load_state_dict(state["sampler"])
        start_step, update, wall_offset, eval_before = state["step"], state["update"], state["wall_s"], state["eval_before"]
        timers.total.update(state["timers"])
        if state.get("grad_scaler"):  # fp16: the loss scale
            scaler.load_state_dict(state["grad_scaler"])
        common.CONSOLE.info(f"resumed {run_dir} from {resume.model_dir} (step {start_step})")
    logger = outputs.open_run_logger(args, run_dir, start_step if resume else None)
    outputs.plan_checkpoints(args, run_dir, model)  # one line: a checkpoint's size, the disk needed and free
    t_start = time.time() - wall_offset

    def run_eval(step: int) -> dict:
        with timers("eval"):
            engine.wake(model, version=update)  # a push only if the weights changed since the last one
            return evaluation.run_evaluation(args, engine, eval_sets, logger, step, update, t_start)

    def draw_prompts(step: int, k: int) -> tuple:
        """Round k of a step's P problems (k > 0: dynamic sampling's later rounds): ids, prompt token ids, seed."""
        problem_idx = sampler.sample(P) if k == 0 else sampler.more(P)
        questions = [train_task.problems[i]["question"] for i in problem_idx]
        prompts = [common.format_prompt(tokenizer, q, train_task.instruction, args.system_prompt or None) for q in questions]
        return problem_idx, prompts, args.seed + step + k * common.ROUND_SEED_STRIDE  # round 0: seed + step

    # --async-lag S: a producer process generates later batches meanwhile, <= S updates stale (async_rollouts.py)
    producer = async_rollouts.start(args, model, model_path, lora, max_model_len, draw_prompts, sampler, update)

    def sample_round(step: int, k: int, minibatches: list[list[int]]) -> tuple:
        """Round k of a step: P prompts, G rollouts each, their rewards (k > 0: dynamic sampling's later rounds)."""
        with timers("rollout"):
            if producer is None:
                problem_idx, prompts, seed = draw_prompts(step, k)
                # torchrun: this rank's groups only (a ShardedRollout addressed by global row); world size 1: all
                rollout = common.generate_rollout(
                    engine, prompts, G, args.max_new_tokens, args.temperature, seed, minibatches, step
                )
            else:  # drawn and generated ahead under weight version rollout.version, rollout.lag updates before these
                problem_idx, rollout = producer.take(step, update)
        with timers("reward"):  # verifiers.py scores every row
            row_problems = [train_task.problems[i] for i in problem_idx for _ in range(G)]
            rewards = common.rollout_rewards(train_task, row_problems, rollout)  # (B,) every row, on every rank
        return problem_idx, rollout, rewards

    if args.eval_only:
        title = f"{args.exp_name} eval-only: {args.model} on {', '.join(s.label for s in eval_sets)}"
        evaluation.print_summary(title, None, run_eval(0), timers.total, time.time() - t_start, eval_sets)
        logger.close()
        return
    if start_step == 0:
        eval_before = run_eval(0)
    eval_after = eval_before
    bar = tqdm(total=args.total_steps, initial=start_step, desc="train", unit="step", disable=common.bars_off())
    for step in range(start_step + 1, args.total_steps + 1):
        timers.reset_step()
        # TRY NOT TO MODIFY: rollout
        with timers("wake"):
            # the weight sync, one push per weight version (`update`: the optimizer updates so far). vLLM: wake, push
            # the weights, reset the prefix cache; hf: refresh its bf16 copy (--engine-dtype bf16), else nothing
            if producer is None:  # --async-lag: the producer's engine has its own weights, published after each update
                engine.wake(model, version=update)
        # the seeded mini-batch plan (row ids of whole groups), the same on every rank; torchrun deals groups by it
        minibatches = common.group_shuffled_minibatches(
            P, G, args.updates_per_batch, common.minibatch_generator(args.seed, step)
        )
        problem_idx, rollout, rewards = sample_round(step, 0, minibatches)  # the step's P prompts, rollouts, rewards
        # TRY NOT TO MODIFY: rewards, then DAPO's options (each off by default): dynamic sampling, the overlong
        # penalty, rows out of the loss
        in_loss, shaping_metrics = torch.ones(len(rollout)), {}  # (B,) 1: the row's tokens are in the loss
        if args.dynamic_sampling:  # DAPO: more rounds until P groups whose rewards vary (empty slots: out of the loss)
            problem_idx, rollout, rewards, in_loss, shaping_metrics = common.dynamic_sampling(
                sample_round, step, (problem_idx, rollout, rewards), G, args.max_sampling_rounds, minibatches
            )
        with timers("sleep"):
            engine.sleep()
        problems = [train_task.problems[i] for i in problem_idx]
        row_problems = [p for p in problems for _ in range(G)]
        if args.overlong_buffer or args.zero_variance == "mask" or args.truncated == "mask":
            rewards, in_loss, shaping = common.dapo_shaping(
                rewards,
                in_loss,
                rollout,
                G,
                args.max_new_tokens,
                args.overlong_buffer,
                args.overlong_penalty,
                args.zero_variance,
                args.truncated,
            )  # rewards + the overlong penalty; in_loss 0 for equal-reward groups, truncated rows
            shaping_metrics |= shaping
        # ALGO LOGIC: advantages -- the group advantage A_i (B,) only with --opd-reward; the teacher's per token below
        advantages = compute_advantages(rewards, G, args.scale_rewards) if args.opd_reward else torch.zeros(len(rewards))
        loss_unit = "token" if args.loss_agg == "token-mean" else "sequence"  # micro-batch shares by tokens or rows
        # TRY NOT TO MODIFY: old log-probs
        B = len(rollout)
        mask = common.completion_mask_of(rollout)  # (B, T)
        with timers("train"):
            # The first mini-batch is trained under the weights that would give old_logp: its old_logp is the
            # detached log-prob of its own first forward pass (same numbers, one forward pass saved).
            later_rows = rollout.own(r for mb in minibatches[1:] for r in mb)  # torchrun: this rank's rows
            old_logp = torch.zeros_like(mask)  # (B, T)
            old_ready = torch.zeros(B, dtype=torch.bool)  # (B,) rows whose old_logp is filled
            if later_rows:
                old_logp[later_rows] = common.no_grad_logps(
                    model, rollout, later_rows, pad_id, args.temperature, args.micro_batch_tokens, args.logp_chunk_tokens
                )
                old_ready[later_rows] = True
            ref_logp = None
            if ref_model is not None:  # (B, T), this rank's rows filled
                ref_logp = torch.zeros_like(mask)
                ref_logp[rollout.rows] = common.no_grad_logps(
                    ref_model, rollout, rollout.rows, pad_id, args.temperature, args.micro_batch_tokens, args.logp_chunk_tokens
                )
            # the engine's log-probs against the trainer's, row by row in the update loop: the rollout correction
            # (--rollout-is), the mismatch/ metrics and the stale-engine check
            correction = common.RolloutCorrection(
                rollout, mask, args.rollout_is, args.rollout_is_cap, args.max_engine_logp_diff
            )
            # ALGO LOGIC: the teacher's log-probs of the sampled tokens, one no-grad pass over this rank's rows
            teacher_logp = torch.zeros_like(mask)  # (B, T) log pi_T(o_it) at the sampling temperature
            teacher_logp[rollout.rows] = common.no_grad_logps(
                teacher, rollout, rollout.rows, pad_id, args.temperature, args.micro_batch_tokens, args.logp_chunk_tokens
            )
            opd_sums = torch.zeros(3, dtype=torch.float64)  # (sum of log pi_old - log pi_T, sum of log pi_T, tokens)
        # TRY NOT TO MODIFY: update (mini-batches x micro-batches; a method changes only lines tagged ALGO LOGIC)
        if producer is not None:  # --async-lag: send the later batches this step's updates' weights may sample
            producer.dispatch_ahead(step)  # after what a method picks from this batch (the next prompts, say)
        update_metrics = []  # one dict per optimizer update
        with timers("train"):
            for mb_rows in tqdm(minibatches, desc="update", leave=False, unit="upd", disable=common.bars_off()):
                mb_tokens = max((mask[mb_rows].sum(1) * in_loss[mb_rows]).sum().item(), 1.0)  # token-mean denominator
                mb_seqs = in_loss[mb_rows].sum().item()  # the sequence count of the other aggregations
                sums = dict.fromkeys(("policy_loss", "clipfrac", "clipfrac_low", "clipfrac_high", "approx_kl", "entropy"), 0.0)
                for micro in common.micro_batches(rollout, rollout.own(mb_rows), args.micro_batch_tokens, model):
                    token_batch = common.token_batch_of(rollout, micro, pad_id)  # padded rows or packed groups
                    logp, entropy = common.completion_logps(model, token_batch, args.temperature, args.logp_chunk_tokens)
                    T_m = logp.shape[1]
                    micro_mask = token_batch.completion_mask.to(logp.device)  # (b, T_m)
                    ready = old_ready[micro].unsqueeze(1).to(logp.device)
                    old = torch.where(ready, old_logp[micro, :T_m].to(logp.device), logp.detach())  # (b, T_m)
                    ref = ref_logp[micro, :T_m].to(logp.device) if ref_logp is not None else None
                    is_weights = correction.weights(micro, old, micro_mask)  # (b, T_m) rollout correction; None: off
                    ratio_ref = correction.ratio_reference(micro, old)  # the ratio's reference: old; --rollout-is bypass: mu
                    micro_mask = micro_mask * in_loss[micro].unsqueeze(1).to(logp.device)  # (b, T_m) the rows in the loss
                    # ALGO LOGIC: the method's loss of the micro-batch (per-token advantages from the teacher)
                    teacher_m = teacher_logp[micro, :T_m].to(logp.device)  # (b, T_m)
                    token_adv = opd_advantages(teacher_m, old, advantages[micro].to(logp.device), args.opd_coef)
                    real = token_batch.completion_mask.to(logp.device)  # (b, T_m) every sampled token, in the loss or not
                    opd_sums += torch.stack([((old - teacher_m) * real).sum(), (teacher_m * real).sum(), real.sum()]).cpu()
                    loss, stats = compute_policy_loss(
                        logp,
                        ratio_ref,
                        token_adv,
                        micro_mask,
                        eps_low=args.clip_low,
                        eps_high=args.clip_high,
                        loss_agg=args.loss_agg,
                        ref_logp=ref,
                        beta=args.beta,
                        is_weights=is_weights,
                        max_tokens=args.max_new_tokens,
                    )
                    # TRY NOT TO MODIFY: the micro-batch's share of the mini-batch's loss and statistics
                    common.check_finite(step, update + 1, micro_mask, logp=logp, old=old, ref=ref, loss=loss)  # NaN, inf: stop
                    weight = common.accumulation_weight(loss_unit, micro_mask, mb_tokens, len(micro), mb_seqs)
                    scaler.scale(loss * weight).backward()  # fp16: the loss scaled; bf16 / fp32: unchanged
                    n_tok = micro_mask.sum().item()
                    sums["policy_loss"] += loss.item() * weight
                    for k in ("clipfrac", "clipfrac_low", "clipfrac_high", "approx_kl"):
                        sums[k] += stats[k] * n_tok / mb_tokens
                    sums["entropy"] += (entropy * micro_mask).sum().item() / mb_tokens
                # TRY NOT TO MODIFY: the optimizer update
                correction.check_engine(step)  # the step's first mini-batch: is the engine sampling from these weights?
                sums = world.sum(sums)  # torchrun: add the ranks' shares (each already over global denominators)
                scaler.unscale_(optimizer)  # fp16: the true gradients, before they are clipped
                grad_norm = common.clip_grad_norm(model, args.max_grad_norm, scaler, step, update + 1)  # non-finite: stop
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)  # freed now, not at the next mini-batch: the engine's wake gets it
                update += 1
                if producer is not None:  # --async-lag: the producer's next batch may be sampled under these weights
                    producer.publish(model, update)
                update_metrics.append(
                    {f"losses/{k}": v for k, v in sums.items()}
                    | common.grad_metrics(grad_norm, scaler)
                    | {"charts/learning_rate": scheduler.get_last_lr()[0], "update": update}
                )
        # TRY NOT TO MODIFY: metrics, eval, checkpoint
        step_time = sum(timers.step.values())
        n_completion_tokens = int(mask.sum().item())
        rollout_metrics = {
            "rollout/reward_mean": rewards.mean().item(),
            "rollout/reward_std": rewards.std().item() if B > 1 else 0.0,
            "rollout/zero_adv_group_frac": (rewards.view(-1, G).std(1) == 0).float().mean().item() if G > 1 else 1.0,
            "rollout/response_len_mean": n_completion_tokens / B,
            "rollout/truncated_frac": sum(r == "length" for r in rollout.finish_reasons) / B,
            "perf/rollout_s": timers.step["rollout"],
            "perf/train_s": timers.step["train"],
            "perf/sync_s": timers.step["wake"] + timers.step["sleep"],
            "perf/wake_s": timers.step["wake"],
            "perf/sleep_s": timers.step["sleep"],
            "perf/reward_s": timers.step["reward"],
            "perf/tokens_per_s": n_completion_tokens / max(step_time, 1e-9),
            "perf/peak_mem_gb": common.peak_memory_gb(device),
        }
        rollout_metrics |= shaping_metrics  # DAPO's options: dynamic/, the overlong penalty, rows in the loss
        rollout_metrics |= model_metrics  # LoRA's trainable parameters
        rollout_metrics |= producer.metrics() if producer is not None else {}  # --async-lag: async/ and its perf/
        rollout_metrics |= correction.metrics()  # mismatch/ (and rollout_is/ with a correction): the update loop's rows
        rollout_metrics |= common.learning_signal(step, rollout_metrics, update_metrics, args.opd_reward)  # ALGO LOGIC
        rollout_metrics |= opd_metrics(world.sum(opd_sums))  # the batch's, every rank's rows  # ALGO LOGIC
        for i, metrics in enumerate(update_metrics):  # rollout keys on the step's first update row
            logger.log({"step": step, **metrics, "wall_s": time.time() - t_start, **(rollout_metrics if i == 0 else {})})
        common.CONSOLE.info(
            common.console_line(
                step,
                args.total_steps,
                {**rollout_metrics, **update_metrics[-1]},
                [
                    "rollout/reward_mean",
                    "rollout/response_len_mean",
                    "losses/policy_loss",
                    "losses/clipfrac",
                    "losses/approx_kl",
                    "losses/entropy",
                    "perf/rollout_s",
                    "perf/train_s",
                ],
            )
        )
        if args.log_rollouts_every and step % args.log_rollouts_every == 0:
            outputs.write_rollouts(logger, step, tokenizer, rollout, row_problems, rewards, advantages, G)
        bar.update(1)
        if (args.eval_every and step % args.eval_every == 0) or step == args.total_steps:
            eval_after = run_eval(step)
        if args.save_every and (step % args.save_every == 0 or step == args.total_steps):
            outputs.save_checkpoint(
                args,
                run_dir,
                step,
                model,
                tokenizer,
                optimizer,
                scheduler,
                {
                    "sampler": producer.sampler_state() if producer is not None else sampler.state_dict(),
                    "update": update,
                    "wall_s": time.time() - t_start,
                    "eval_before": eval_before,
                    "grad_scaler": scaler.state_dict(),
                    "timers": dict(timers.total),
                },
            )
    bar.close()
    if producer is not None:
        producer.close()
    final_dir = outputs.save_final_model(run_dir, model, tokenizer)  # weights + tokenizer, no optimizer state
    wall = time.time() - t_start
    evaluation.print_summary(
        f"{args.exp_name}: {args.model} on {train_task.name}, {args.total_steps} steps, run {run_dir}",
        eval_before,
        eval_after,
        timers.total,
        wall,
        eval_sets,
    )
    common.CONSOLE.info(f"final model: {final_dir}")
    logger.close()


if __name__ == "__main__":
    run.command_line(main, Args)
