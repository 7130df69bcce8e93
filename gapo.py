"""GAPO: Group Adaptive Clipping Policy Optimization (Jia, Wang, Kasiviswanathan, Houthooft, arXiv:2609.00444)
-- what it changes relative to grpo.py:
  1. the UPPER clip bound is per rollout: a correct rollout of a group with c of k correct gets
        eps_high(c) = eps_low + (eps_high_max - eps_low) * (k - c)/(k - 1)                    (GAPO eq. 11)
     i.e. the rare correct answer of a hard prompt may move its probability furthest; every incorrect
     rollout, and every rollout of an all-correct / all-wrong group, keeps eps_low; the lower bound
     1 - eps_low is the same for all rollouts. For rewards in [0,1] the general form
     eps_low + (eps_high_max - eps_low) * A_i / A_max, A_max = (k-1)/k, is used (identical for binary rewards);
  2. advantages A_i = r_i - mean_g(r) WITHOUT std division by default (Dr. GRPO form; --scale-rewards group
     restores GRPO's; eq. 11 always reads the raw group statistics);
  3. two clipping levels: token (PPO/GRPO surrogate, token-mean) and sequence (GSPO: one ratio per rollout,
     the geometric mean of its token ratios, mean over sequences; the paper's main variant);
  4. the paper's baselines by flags, same script and seed: --clip-mode fixed (every rollout gets
     1 + --clip-high-max: clip-higher; with --clip-high-max equal to --clip-low: symmetric clip), at either
     level, and focal advantage shaping F-GRPO / F-GSPO (arXiv:2602.06717), A_i <- (1 - c/k)^gamma * A_i;
  5. diagnostics in metrics.jsonl: clip fraction and mean |ratio - 1| of the correct (A > 0) rollouts per c
     (gapo/clipfrac_c{c}, gapo/ratio_absdev_c{c}), fraction of rollouts with A > 0 (gapo/pos_adv_frac).

Objective (binary rewards, group of k rollouts, c correct; s = ratio of the chosen level):
    token level:     l_it = max(-A_i r_it, -A_i clip(r_it, 1 - eps_low, 1 + eps_high_i)),  r_it = pi(o_it)/pi_old(o_it),
                     loss = sum_it m_it l_it / sum_it m_it
    sequence level:  s_i = exp( sum_t m_it (log pi - log pi_old)_it / sum_t m_it ),
                     l_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high_i)),  loss = mean_i l_i,
                     differentiated in the GSPO-token form  log s_it = sg[log s_i] + log pi(o_it) - sg[log pi(o_it)]
    eps_high_i = eps_high(c_i) of eq. 11 for A_i > 0, eps_low otherwise (--clip-mode fixed: --clip-high-max for all).
Our reading where the paper's text was not reachable (docs/gapo.md): the general [0,1] form above, the token-level
aggregation (token-mean), the focal weight's c/k read as the group's mean reward for non-binary rewards, and which
fixed clip the focal baseline sits on (any: the flags are independent).

Clipping only acts off-policy. With --updates-per-batch 1 the ratio is exactly 1 at every update and GAPO equals its
baseline; the default takes 2 updates per rollout batch (the first mini-batch still sees ratio 1, the second is
trained after one optimizer step and is where the clip fires). The paper takes 4 (256 prompts, mini-batches of 64).

Run:
  python gapo.py                                          # CPU default: embedded SmolLM2-135M-Instruct on `arith`,
                                                          # token level, (eps_low, eps_high_max) = (0.2, 0.28)
  python gapo.py --clip-mode fixed                        # baseline: fixed clip-higher (0.2, 0.28)
  python gapo.py --clip-mode fixed --clip-high-max 0.2    # baseline: fixed symmetric clip
  python gapo.py --clip-mode fixed --focal-gamma 1        # baseline: F-GRPO (focal advantage shaping)
  python gapo.py --model Qwen/Qwen2.5-Math-1.5B --dataset deepscaler --eval-dataset aime24 --clip-level sequence \\
      --clip-low 3e-3 --clip-high-max 5e-3 --prompts-per-step 256 --num-generations 8 --updates-per-batch 4 \\
      --max-new-tokens 3072 --learning-rate 1e-6 --eval-samples 256 --eval-k 16 256 --eval-limit 0   # GPU + vLLM
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
    # GAPO specific arguments
    clip_mode: Literal["adaptive", "fixed"] = arg(
        "adaptive",
        "adaptive: GAPO eq. 11 upper bound per correct rollout; fixed: 1 + --clip-high-max for every "
        "rollout (clip-higher baseline; symmetric with --clip-high-max = --clip-low)",
    )
    clip_level: Literal["token", "sequence"] = arg(
        "token",
        "token: PPO/GRPO per-token ratio, token-mean; sequence: GSPO sequence ratio (paper's main variant, use "
        "~1e-3-scale bounds), mean over sequences",
    )
    clip_low: float = arg(
        0.2,
        "eps_low: lower bound 1 - eps_low for every rollout; adaptive mode: also the upper "
        "bound of incorrect rollouts (paper: 0.2 token level, 3e-3 sequence level)",
    )
    clip_high_max: float = arg(
        0.28,
        "eps_high_max: upper bound of a correct rollout with c = 1 (eq. 11); with "
        "--clip-mode fixed, every rollout's upper bound (paper: 0.28 token, 5e-3 sequence)",
    )
    focal_gamma: float = arg(
        0.0, "focal advantage shaping A <- (1 - c/k)^gamma * A (F-GRPO/F-GSPO baseline, arXiv:2602.06717); 0: off"
    )
    scale_rewards: Literal["none", "group"] = arg(
        "none", "advantage scale: none (A = r - mean, GAPO/Dr. GRPO) or group (divide by group std + 1e-4, GRPO)"
    )
    checks = (  # (flag, test of its value, what it must be): checked with the common flags, before anything loads
        ("clip_low", lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"),
        ("clip_high_max", lambda v: 0.0 <= v < math.inf, "must be finite and >= 0"),
        (
            "clip_high_max",
            lambda v, args: args.clip_mode == "fixed" or v >= args.clip_low,
            "must be >= --clip-low with --clip-mode adaptive (eq. 11 interpolates between them)",
        ),
        ("focal_gamma", lambda v: v >= 0.0, "must be >= 0"),
    )


# ALGO LOGIC: advantages
def compute_advantages(rewards: torch.Tensor, group_size: int, scale: str = "none", focal_gamma: float = 0.0) -> torch.Tensor:
    """rewards (B,) -> advantages (B,); rows [g*G:(g+1)*G] are the G rollouts of prompt g."""
    grouped = rewards.view(-1, group_size)  # (P, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # A_i = r_i - mean_g(r)  (GAPO default: no std division)
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centered[:, :1])  # unbiased (N-1)
        centered = centered / (std + 1e-4)  # GRPO eq. (3); all-equal group -> 0 / 1e-4 = 0 exactly
    elif scale != "none":
        raise ValueError(f"scale must be 'group' or 'none', not {scale!r}")
    if focal_gamma > 0.0:  # F-GRPO / F-GSPO baseline: A_i <- (1 - c/k)^gamma * A_i
        success = grouped.mean(dim=1, keepdim=True).clamp(0.0, 1.0)  # (P, 1) c/k for binary rewards (mean reward else)
        centered = centered * (1.0 - success) ** focal_gamma  # down-weights easy (high-success) groups
    return centered.reshape(-1)


# ALGO LOGIC: policy loss
def compute_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float | torch.Tensor = 0.28,
    level: str = "token",
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate with a per-rollout upper bound. logp, old_logp, ref_logp, mask: (B, T); advantages (B,);
    eps_high: float or (B,). level "token": token-mean of the PPO/GRPO term; "sequence": GSPO, mean over sequences.
    Returns (loss, stats); stats["rows"] holds per-row clip counts / units / sum |ratio - 1| for per-c diagnostics
    (units: tokens at token level, 1 per sequence at sequence level)."""
    mask = mask.to(logp.dtype)
    B = logp.shape[0]
    adv = advantages.to(logp.dtype).unsqueeze(1)  # (B, 1), broadcast over tokens
    hi = torch.as_tensor(eps_high, dtype=logp.dtype, device=logp.device).expand(B).unsqueeze(1)  # (B, 1) eps_high_i
    upper = 1.0 + hi  # (B, 1) per-rollout upper bound 1 + eps_high_i
    lower = torch.full_like(upper, 1.0 - eps_low)  # (B, 1) fixed lower bound
    log_ratio = logp - old_logp  # (B, T) log r_it
    if level == "token":
        ratio = torch.exp(log_ratio)  # (B, T) r_it = pi_theta / pi_old
    elif level == "sequence":
        log_s = sequence_log_ratio(logp, old_logp, mask)  # (B,) log s_i
        # GSPO-token form: value s_i on every token, gradient s_i * grad logp_it (token mean of it = grad s_i)
        ratio = torch.exp(log_s.detach().unsqueeze(1) + logp - logp.detach())  # (B, T) s_it
    else:
        raise ValueError(f"level must be 'token' or 'sequence', not {level!r}")
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, min=lower, max=upper)  # GAPO: upper bound per rollout
    per_token = torch.maximum(unclipped, clipped)  # PPO pessimistic bound, (B, T)
    if is_weights is not None:  # rollout correction: w_t (detached) times the clipped term (docs/mismatch.md)
        per_token = per_token * is_weights
    if beta > 0.0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        ref_diff = ref_logp - logp
        per_token = per_token + beta * (torch.exp(ref_diff) - ref_diff - 1.0)  # k3 estimate of KL(pi || pi_ref)
    if level == "token":  # token-mean: every token of the (mini-)batch weighs the same
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    else:  # GSPO: mean over sequences of each sequence's token mean (= l_i, the s_it all equal s_i)
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1.0)).mean()
    with torch.no_grad():
        r = ratio.detach()
        if level == "token":
            units = mask  # (B, T) one unit per completion token
        else:
            units = torch.zeros_like(mask)  # (B, T) one unit per sequence: its first token carries s_i
            units[:, 0] = (mask.sum(1) > 0).to(mask.dtype)
        clip_low = ((r < lower) & (adv < 0)).to(mask.dtype) * units  # clipped branch active, grad 0
        clip_high = ((r > upper) & (adv > 0)).to(mask.dtype) * units
        n = units.sum().clamp(min=1.0)
        k3 = ((torch.exp(log_ratio) - 1.0) - log_ratio) * mask  # (B, T) token-level k3 of KL(old || new), both levels
        stats = {
            "clipfrac": ((clip_low + clip_high).sum() / n).item(),  # per token (token level) / per sequence
            "clipfrac_low": (clip_low.sum() / n).item(),
            "clipfrac_high": (clip_high.sum() / n).item(),
            "approx_kl": (k3.sum() / mask.sum().clamp(min=1.0)).item(),
            "rows": {  # (B,) each
                "clipped": (clip_low + clip_high).sum(1).cpu(),
                "units": units.sum(1).cpu(),
                "abs_dev": ((r - 1.0).abs() * units).sum(1).cpu(),
            },
        }
    return loss, stats


# ALGO LOGIC: gapo_eps_high
def gapo_eps_high(rewards: torch.Tensor, group_size: int, eps_low: float, eps_high_max: float) -> torch.Tensor:
    """Per-rollout upper clip bound (B,), GAPO eq. 11. Binary rewards, c correct of k:
    correct -> eps_low + (eps_high_max - eps_low) * (k - c)/(k - 1); incorrect, all-correct, all-wrong -> eps_low.
    General form for rewards in [0,1]: eps_low + (eps_high_max - eps_low) * A_i / A_max for A_i > 0, A_max = (k-1)/k,
    from the raw (unscaled) group statistics."""
    eps = torch.full_like(rewards, eps_low, dtype=torch.float32)  # (B,)
    if group_size < 2:  # k = 1: no advantage, nothing to widen
        return eps
    grouped = rewards.float().view(-1, group_size)  # (P, G)
    adv_raw = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)  # (B,) raw A_i; correct: (k - c)/k
    a_max = (group_size - 1) / group_size  # A of the single correct rollout of a group (c = 1)
    share = (adv_raw.clamp(min=0.0) / a_max).clamp(max=1.0)  # (B,) (k - c)/(k - 1) for correct, 0 otherwise
    return eps + (eps_high_max - eps_low) * share  # GAPO eq. 11


def group_correct_counts(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """rewards (B,) -> c (B,): number of correct rollouts (reward >= 1) in each row's group (diagnostics only)."""
    c = (rewards.view(-1, group_size) >= 1.0).sum(dim=1)  # (P,)
    return c.repeat_interleave(group_size)  # (B,)


def per_c_metrics(per_c: torch.Tensor) -> dict:
    """One update's gapo/clipfrac_c{c} and gapo/ratio_absdev_c{c} (the paper's plots) from per_c (3, G + 1): clipped
    units, units and sum |ratio - 1| of the correct rows trained off-policy, by their group's c (only the c present)."""
    out = {}
    for c in range(per_c.shape[1]):
        if per_c[1, c] > 0:
            out[f"gapo/clipfrac_c{c}"] = (per_c[0, c] / per_c[1, c]).item()
            out[f"gapo/ratio_absdev_c{c}"] = (per_c[2, c] / per_c[1, c]).item()  # mean |ratio - 1|
    return out


# ALGO LOGIC: sequence ratio (GSPO)
def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log s_i (B,) = sum_t m_it (logp_it - old_logp_it) / sum_t m_it  (GSPO sequence ratio, length-normalised)."""
    mask = mask.to(logp.dtype)
    return ((logp - old_logp) * mask).sum(1) / mask.sum(1).clamp(min=1.0)


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
    evaluation.make_prompts(eval_sets, tokenizer)  # each set's prompts, in its template and instruction
    # every prompt against the model's context, before the weights load (a training prompt too long: dropped)
    train_task, max_model_len = models.fit_context(args, model_path, tokenizer, train_task, eval_sets)
    model = models.load_policy(args, model_path, device, lora)  # fp32 master weights; torchrun: FSDP2-sharded
    # --beta: the frozen initial model (a LoRA run's: the policy itself with its adapters off, no second copy)
    ref_model = models.reference_model(args, model, device) if args.beta > 0 else None
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
        # ALGO LOGIC: advantages
        advantages = compute_advantages(rewards, G, args.scale_rewards, args.focal_gamma)  # (B,) r - mean_g r [* focal]
        if args.clip_mode == "adaptive":
            eps_high = gapo_eps_high(rewards, G, args.clip_low, args.clip_high_max)  # (B,) GAPO eq. 11
        else:
            eps_high = torch.full((len(rewards),), args.clip_high_max)  # (B,) fixed clip(-higher) baseline
        n_correct = group_correct_counts(rewards, G)  # (B,) c of each row's group (per-c diagnostics)
        positive = advantages > 0  # (B,) correct rollouts of mixed groups: the ones eq. 11 widens
        loss_unit = args.clip_level  # micro-batch shares: by tokens (token level) or by rows (sequence level)
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
        # TRY NOT TO MODIFY: update (mini-batches x micro-batches; a method changes only lines tagged ALGO LOGIC)
        if producer is not None:  # --async-lag: send the later batches this step's updates' weights may sample
            producer.dispatch_ahead(step)  # after what a method picks from this batch (the next prompts, say)
        update_metrics = []  # one dict per optimizer update
        with timers("train"):
            for mb_rows in tqdm(minibatches, desc="update", leave=False, unit="upd", disable=common.bars_off()):
                mb_tokens = max((mask[mb_rows].sum(1) * in_loss[mb_rows]).sum().item(), 1.0)  # token-mean denominator
                mb_seqs = in_loss[mb_rows].sum().item()  # the sequence count of the other aggregations
                sums = dict.fromkeys(("policy_loss", "clipfrac", "clipfrac_low", "clipfrac_high", "approx_kl", "entropy"), 0.0)
                per_c = torch.zeros(3, G + 1)  # (clipped units, units, sum |ratio - 1|) of A > 0 rows, by c  # ALGO LOGIC
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
                    # ALGO LOGIC: the method's loss of the micro-batch (a per-rollout upper bound)
                    loss, stats = compute_policy_loss(
                        logp,
                        ratio_ref,
                        advantages[micro].to(logp.device),
                        micro_mask,
                        eps_low=args.clip_low,
                        eps_high=eps_high[micro].to(logp.device),
                        level=args.clip_level,
                        ref_logp=ref,
                        beta=args.beta,
                        is_weights=is_weights,
                    )
                    # TRY NOT TO MODIFY: the micro-batch's share of the mini-batch's loss and statistics
                    common.check_finite(step, update + 1, micro_mask, logp=logp, old=old, ref=ref, loss=loss)  # NaN, inf: stop
                    weight = common.accumulation_weight(loss_unit, micro_mask, mb_tokens, len(micro), mb_seqs)
                    scaler.scale(loss * weight).backward()  # fp16: the loss scaled; bf16 / fp32: unchanged
                    n_tok = micro_mask.sum().item()
                    sums["policy_loss"] += loss.item() * weight
                    clip_w = n_tok / mb_tokens if args.clip_level == "token" else len(micro) / len(mb_rows)  # ALGO LOGIC
                    for k in ("clipfrac", "clipfrac_low", "clipfrac_high"):  # per token / per sequence  # ALGO LOGIC
                        sums[k] += stats[k] * clip_w  # ALGO LOGIC
                    sums["approx_kl"] += stats["approx_kl"] * n_tok / mb_tokens  # ALGO LOGIC
                    sums["entropy"] += (entropy * micro_mask).sum().item() / mb_tokens
                    # ALGO LOGIC: per-c diagnostics of the correct rows trained off-policy (their ratio can move)
                    sel = positive[micro] & old_ready[micro]  # (b,)
                    c_sel = n_correct[micro][sel]  # (n_sel,) their c
                    for j, key in enumerate(("clipped", "units", "abs_dev")):
                        per_c[j].index_add_(0, c_sel, stats["rows"][key][sel].float())
                # TRY NOT TO MODIFY: the optimizer update
                correction.check_engine(step)  # the step's first mini-batch: is the engine sampling from these weights?
                sums = world.sum(sums)  # torchrun: add the ranks' shares (each already over global denominators)
                per_c = world.sum(per_c)  # ALGO LOGIC
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
                update_metrics[-1] |= per_c_metrics(per_c)  # ALGO LOGIC
        # ALGO LOGIC: the batch's share of A > 0 rollouts and their mean upper bound
        update_metrics[0] |= {
            "gapo/pos_adv_frac": positive.float().mean().item(),  # share of rollouts with A > 0
            "gapo/eps_high_pos_mean": eps_high[positive].mean().item() if positive.any() else 0.0,
        }
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
        rollout_metrics |= common.learning_signal(step, rollout_metrics, update_metrics)  # a step that cannot learn: said
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
