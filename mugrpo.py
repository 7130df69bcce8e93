"""Mu-GRPO (M. Tian, Y. Xie, C. Wei, "How Off-Policy Can GRPO Be?", arXiv:2605.17570) -- a few huge
generation/optimization stages with relaxed clipping and the negative-advantage veto. Relative to grpo.py:
  1. Stages. A stage is grpo.py's step with a huge batch: --total-steps = number of stages, --updates-per-batch =
     mu, --prompts-per-step = mu x prompts per update. The policy is frozen, the whole stage is generated in one go
     (the engine chunks it behind a progress bar, then sleeps and frees its memory), behaviour log-probs and
     advantages are computed once for the stage and stored, then the mu updates each take the next group-shuffled
     slice of the stage (one pass). This file re-declares only the defaults of those three flags (below
     `# MUGRPO specific arguments`): 3 stages x mu 8 x 4 prompts per update = grpo.py's default budget (24
     updates, 768 rollouts, 4 prompts per update) cut into 3 engine/trainer switches instead of 12.
  2. Behaviour log-probs: a trainer forward pass under the stage-start weights (default; the first update reuses
     its own first forward pass, as grpo.py does) or the engine's sampling log-probs (--behav-logp engine).
  3. Advantages A_i = (r_i - mean_g r) / (std_g r + 1e-6), computed once at generation time.
  4. Relaxed clip [1 - eps_low, 1 + eps_high] = [0, 5] (eps_low 1, eps_high 4): a negative-advantage token is
     never clipped.
  5. Negative-advantage veto, recomputed at every update from the current log-probs: in a response with A_i < 0 a
     trigger is a token with log rho_it < log delta (log space, never exponentiated first); kappa_i = first
     trigger; --veto-scope none | trigger | suffix | suffix_nontrigger (default, the paper's H_kappa) | sequence.
  6. Loss: token-level clipped surrogate times the keep mask, token-mean over the mini-batch's completion tokens
     counted BEFORE the veto (the veto removes gradient, it does not re-weight the rest). With --beta > 0 the k3
     KL term stays on every completion token: the veto masks the policy term only.

Objective per update (mini-batch b of the stage, rho_it = pi_theta(o_it | q, o_i<t) / pi_behav(o_it | q, o_i<t)):
    J(theta) = 1 / (sum_{i in b} |o_i|) * sum_{i in b} sum_t keep_it * min(rho_it A_i, clip(rho_it, 1-eps_low, 1+eps_high) A_i)
    keep_it = 0  iff  A_i < 0 and t in H_kappa_i = {t > kappa_i : log rho_it >= log delta}   (scope suffix_nontrigger)

Readings (ours): delta = 1e-4 (--veto-delta; the project page's example); the pre-veto denominator; unbiased group
std; 64 prompts per update in the paper-scale line. Where the paper is silent we chose: keep = 0 on padding (keep is a
subset of mask); mugrpo/vetoed_token_frac is over all completion tokens of the mini-batch; --prompts-per-step must
be a multiple of --updates-per-batch. The engine switch of a stage is perf/sync_s = perf/wake_s (incl. the weight
push) + perf/sleep_s, as in every script.
A paper-scale stage holds B = 524288 rollouts on the host: the packed rollouts and the dense (B, T) mask and
log-probs are sized in docs/mugrpo.md ("Host memory at paper scale"); --behav-logp engine writes the engine
log-probs into old_logp's buffer (no extra (B, T) tensor).

Run:
  python mugrpo.py                                 # CPU default: Mu-GRPO, 3 stages x mu 8, embedded SmolLM2-135M on `arith`
  python mugrpo.py --total-steps 6 --prompts-per-step 16 --updates-per-batch 4 \\
      --clip-low 0.2 --clip-high 0.2 --veto-scope none                      # standard GRPO (mu = 4), same budget
  python mugrpo.py --clip-low 0.2 --clip-high 0.2 --veto-scope none         # naive high staleness (mu 8, tight clip)
  python mugrpo.py --model Qwen/Qwen2.5-Math-1.5B --dataset dapo17k --eval-dataset math500 --total-steps 4 \\
      --updates-per-batch 1024 --prompts-per-step 65536 --num-generations 8 --max-new-tokens 3072 \\
      --learning-rate 1e-6 --gradient-checkpointing                         # GPU + vLLM, paper scale (4 x 1024)
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
    # MUGRPO specific arguments
    # a stage is grpo.py's step with a huge batch: the same three flags, with Mu-GRPO's defaults and meaning
    total_steps: int = arg(3, "number of stages (Mu-GRPO: a stage is one step with a huge batch; paper: 4)")
    prompts_per_step: int = arg(32, "prompts per stage = mu x prompts per update (a multiple of --updates-per-batch)")
    updates_per_batch: int = arg(
        8, "mu: optimizer updates per stage, one pass over its group-shuffled prompts (paper: 1024; standard GRPO: 4)"
    )
    clip_low: float = arg(1.0, "eps_low: lower clip bound 1 - eps_low (Mu-GRPO relaxed clip [0, 5]; GRPO: 0.2)")
    clip_high: float = arg(4.0, "eps_high: upper clip bound 1 + eps_high (Mu-GRPO relaxed clip [0, 5]; GRPO: 0.2)")
    veto_scope: Literal["none", "trigger", "suffix", "suffix_nontrigger", "sequence"] = arg(
        "suffix_nontrigger",
        "negative-advantage veto: none, trigger, suffix, suffix_nontrigger (the paper's H_kappa), sequence",
    )
    veto_delta: float = arg(
        1e-4,
        "delta: a token of an A<0 response triggers when pi/pi_behav < delta "
        "(tested as log-ratio < log delta; reading: the project page's 1e-4)",
    )
    behav_logp: Literal["trainer", "engine"] = arg(
        "trainer",
        "behaviour log-probs: trainer (forward pass under the stage-start weights) or engine (the rollout "
        "engine's sampling log-probs)",
    )
    checks = (  # (flag, test of its value, what it must be): checked with the common flags, before anything loads
        (
            "prompts_per_step",
            lambda v, args: v % args.updates_per_batch == 0,
            "must be a multiple of --updates-per-batch (mu): a stage is mu x prompts per update",
        ),
        ("clip_low", lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
        ("clip_high", lambda v: 0.0 <= v < math.inf, "must be finite and >= 0"),
        ("veto_delta", lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"),
    )


# ALGO LOGIC: advantages
def compute_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """rewards (B,) -> advantages (B,), computed once per stage; rows [g*G:(g+1)*G] are the G rollouts of prompt g."""
    grouped = rewards.view(-1, group_size)  # (P, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # A_i = r_i - mean_g(r)
    std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centered[:, :1])  # unbiased (N-1)
    return (centered / (std + eps)).reshape(-1)  # std + 1e-6 (the paper's); an all-equal group gives A = 0 exactly


# ALGO LOGIC: policy loss
def compute_policy_loss(
    logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 1.0,
    eps_high: float = 4.0,
    keep: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """Relaxed clipped surrogate times the veto's keep mask. logp, behav_logp, mask, keep, ref_logp: (B, T);
    advantages (B,). Token-mean whose denominator counts the completion tokens before the veto. Returns (loss, stats);
    with keep = mask and eps 0.2/0.2 it is grpo.compute_policy_loss(..., loss_agg="token-mean").

    beta > 0: the k3 KL term to the reference model is a regulariser on EVERY completion token (mask, not keep):
    the veto removes a vetoed token's policy-gradient term only, never its KL penalty."""
    mask = mask.to(logp.dtype)
    keep = mask if keep is None else keep.to(logp.dtype) * mask  # (B, T) 1 = token takes part in the gradient
    log_ratio = logp - behav_logp  # (B, T) log rho_it, behav_logp frozen for the whole stage
    ratio = torch.exp(log_ratio)  # rho_it = pi_theta / pi_behav
    adv = advantages.to(logp.dtype).unsqueeze(1)  # (B, 1), broadcast over tokens
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)  # Mu-GRPO: [0, 5]; rho >= 0 so A<0 never clips
    per_token = torch.maximum(unclipped, clipped)  # pessimistic bound, (B, T)
    n = mask.sum().clamp(min=1.0)  # completion tokens BEFORE the veto (reading: the veto does not re-weight)
    if is_weights is not None:  # rollout correction: w_t (detached) times the clipped term (docs/mismatch.md)
        per_token = per_token * is_weights
    loss = (per_token * keep).sum() / n  # the veto masks the policy term only
    if beta > 0.0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        ref_diff = ref_logp - logp
        kl = torch.exp(ref_diff) - ref_diff - 1.0  # (B, T) k3 estimate of KL(pi || pi_ref)
        loss = loss + beta * (kl * mask).sum() / n  # on every real token, vetoed ones included
    with torch.no_grad():
        clip_low = ((ratio < 1.0 - eps_low) & (adv < 0)).to(mask.dtype) * mask  # clipped branch active, grad 0
        clip_high = ((ratio > 1.0 + eps_high) & (adv > 0)).to(mask.dtype) * mask
        neg = (adv < 0).to(mask.dtype) * mask  # (B, T) real tokens of A < 0 responses
        stats = {
            "clipfrac": ((clip_low + clip_high).sum() / n).item(),
            "clipfrac_low": (clip_low.sum() / n).item(),
            "clipfrac_high": (clip_high.sum() / n).item(),
            "approx_kl": (((ratio - 1.0) - log_ratio) * mask).sum().div(n).item(),  # k3 of KL(behav || new)
            "neg_ratio_sum": (ratio * neg).sum().item(),  # sum of rho over A<0 tokens (mugrpo/neg_ratio_mean)
            "neg_tokens": neg.sum().item(),
            "vetoed_tokens": (mask - keep).sum().item(),  # real tokens removed by the veto
        }
    return loss, stats


# ALGO LOGIC: negative-advantage veto
def veto_triggers(
    logp: torch.Tensor, behav_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, log_delta: float
) -> torch.Tensor:
    """Trigger tokens (B, T) bool: real completion tokens of A < 0 responses with log rho_it < log delta.

    Compared in log space: exp() of two tiny log-probs underflows to 0/0 in fp32, their difference does not."""
    log_ratio = (logp - behav_logp).detach()  # (B, T) log rho_it under the CURRENT policy (recomputed per update)
    neg = (advantages < 0).unsqueeze(1).to(log_ratio.device)  # (B, 1) only negative-advantage responses
    return (log_ratio < log_delta) & neg & mask.bool()  # padding never triggers


def veto_mask(
    logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    log_delta: float,
    scope: str = "suffix_nontrigger",
) -> torch.Tensor:
    """keep (B, T) float, 1 = keep, 0 = vetoed or padding (keep <= mask). Only rows with A < 0 lose tokens.

    kappa_i = first trigger of row i. Vetoed: `none` nothing; `trigger` the triggers; `suffix` every t > kappa_i
    (kappa_i kept); `suffix_nontrigger` the t > kappa_i that are not triggers (H_kappa); `sequence` the whole row."""
    real = mask.bool()
    trig = veto_triggers(logp, behav_logp, advantages, mask, log_delta)  # (B, T)
    if scope == "none":
        veto = torch.zeros_like(trig)
    elif scope == "trigger":
        veto = trig
    elif scope in ("suffix", "suffix_nontrigger", "sequence"):
        n_trig = trig.long()
        after_kappa = (n_trig.cumsum(dim=1) - n_trig) > 0  # (B, T) some trigger strictly before t  <=>  t > kappa_i
        if scope == "suffix":
            veto = after_kappa
        elif scope == "suffix_nontrigger":
            veto = after_kappa & ~trig  # H_kappa: later triggers themselves are kept (their rho < delta anyway)
        else:
            veto = trig.any(dim=1, keepdim=True).expand_as(trig)  # whole response once it has any trigger
    else:
        raise ValueError(f"unknown veto scope {scope!r} (the choices of --veto-scope in Args)")
    return (real & ~veto).to(logp.dtype)


VETO_DIAGNOSTICS = ("neg_ratio_sum", "neg_tokens", "vetoed_tokens", "neg_resp", "triggered_resp", "mismatch_triggers")


def veto_metrics(diag: dict, mb_tokens: float, staleness: int, with_mismatch: bool) -> dict:
    """One update's mugrpo/ keys from the mini-batch's sums `diag` (VETO_DIAGNOSTICS, over every rank). A ratio with
    no data (no A<0 token in the mini-batch) is left out of the row, never null."""
    out = {"mugrpo/staleness": staleness, "mugrpo/vetoed_token_frac": diag["vetoed_tokens"] / max(mb_tokens, 1.0)}
    if diag["neg_tokens"]:
        out["mugrpo/neg_ratio_mean"] = diag["neg_ratio_sum"] / diag["neg_tokens"]
        if with_mismatch:  # share of A<0 tokens with log(pi_behav / mu) < log delta: the engine's log-probs exist
            out["mugrpo/mismatch_trigger_frac"] = diag["mismatch_triggers"] / diag["neg_tokens"]
    if diag["neg_resp"]:
        out["mugrpo/triggered_frac"] = diag["triggered_resp"] / diag["neg_resp"]
    return out


def main(args: Args) -> None:
    # ALGO LOGIC: stage settings (a stage = one step with mu = --updates-per-batch updates on its own rollouts)
    log_delta = math.log(args.veto_delta)  # trigger test in log space: log rho_it < log delta
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
    engine_logps = args.behav_logp == "engine"  # the engine's log-probs as the behaviour policy  # ALGO LOGIC
    engine = models.make_engine(args, model, tokenizer, model_path, max_model_len, engine_logps)  # ALGO LOGIC
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
        # A stage's rollouts: P = mu x prompts per update, B = P*G rows, generated in one go under frozen weights.
        advantages = compute_advantages(rewards, G)  # (B,) group-normalised once per stage, stored for its mu updates
        loss_unit = "token"  # token-mean over the mini-batch's tokens before the veto: micro-batch shares by tokens
        # TRY NOT TO MODIFY: old log-probs
        B = len(rollout)
        mask = common.completion_mask_of(rollout)  # (B, T)
        with timers("train"):
            # The first mini-batch is trained under the weights that would give old_logp: its old_logp is the
            # detached log-prob of its own first forward pass (same numbers, one forward pass saved).
            trainer_behav = args.behav_logp == "trainer"  # engine log-probs: no trainer pass  # ALGO LOGIC
            later_rows = rollout.own(r for mb in minibatches[1:] for r in mb) if trainer_behav else []  # ALGO LOGIC
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
        # ALGO LOGIC: behaviour log-probs pi_behav of the stage, frozen for its mu updates: old_logp / old_ready below
        # hold the trainer's pass under the stage-start weights (the first mini-batch: its own first pass), or with
        # --behav-logp engine the engine's sampling log-probs (temperature-processed) of every row
        if args.behav_logp == "engine":
            if not rollout.has_engine_logps:
                raise verifiers.RunError("--behav-logp engine: the rollout engine returned no log-probs")
            # written into old_logp's (B, T) buffer, unused with engine log-probs (no row is ready there): at paper
            # scale a second dense (B, T) fp32 tensor would be another 6.4 GB. Row-major boolean indexing of the
            # mask visits row r's len(r) real tokens in order, exactly the packed order of the flat log-probs.
            flat = rollout.engine_logps_flat()  # (sum_r len(r),) float32, rows this process holds (torchrun: its own)
            old_ready[rollout.rows] = True  # (B,) all rows at world size 1
            own_tokens = mask.bool() & old_ready.unsqueeze(1)  # (B, T) real tokens of the rows held here
            if flat.numel() != int(own_tokens.sum().item()):
                raise verifiers.RunError(
                    f"--behav-logp engine: {flat.numel()} engine log-probs for "
                    f"{int(own_tokens.sum().item())} completion tokens"
                )
            old_logp[own_tokens] = flat.to(old_logp.dtype)
        # TRY NOT TO MODIFY: update (mini-batches x micro-batches; a method changes only lines tagged ALGO LOGIC)
        if producer is not None:  # --async-lag: send the later batches this step's updates' weights may sample
            producer.dispatch_ahead(step)  # after what a method picks from this batch (the next prompts, say)
        update_metrics = []  # one dict per optimizer update
        with timers("train"):
            bar_desc = f"stage {step} update"  # ALGO LOGIC
            upd_bar = tqdm(minibatches, desc=bar_desc, leave=False, unit="upd", disable=common.bars_off())  # ALGO LOGIC
            for staleness, mb_rows in enumerate(upd_bar):  # staleness: updates since the stage's rollouts  # ALGO LOGIC
                mb_tokens = max((mask[mb_rows].sum(1) * in_loss[mb_rows]).sum().item(), 1.0)  # token-mean denominator
                mb_seqs = in_loss[mb_rows].sum().item()  # the sequence count of the other aggregations
                sums = dict.fromkeys(("policy_loss", "clipfrac", "clipfrac_low", "clipfrac_high", "approx_kl", "entropy"), 0.0)
                diag = dict.fromkeys(VETO_DIAGNOSTICS, 0.0)  # the veto's sums over the mini-batch  # ALGO LOGIC
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
                    # ALGO LOGIC: the method's loss of the micro-batch (ratio_ref: the stage's behaviour log-probs)
                    adv = advantages[micro].to(logp.device)  # (b,) stored at generation time
                    # veto from the CURRENT log-probs: triggers log rho < log delta in A<0 rows, then the scope's mask
                    keep = veto_mask(logp.detach(), ratio_ref, adv, micro_mask, log_delta, args.veto_scope)  # (b, T_m)
                    loss, stats = compute_policy_loss(
                        logp,
                        ratio_ref,
                        adv,
                        micro_mask,
                        eps_low=args.clip_low,
                        eps_high=args.clip_high,
                        keep=keep,
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
                    for k in ("clipfrac", "clipfrac_low", "clipfrac_high", "approx_kl"):
                        sums[k] += stats[k] * n_tok / mb_tokens
                    sums["entropy"] += (entropy * micro_mask).sum().item() / mb_tokens
                    # ALGO LOGIC: the veto's diagnostics of the micro-batch
                    for k in ("neg_ratio_sum", "neg_tokens", "vetoed_tokens"):
                        diag[k] += stats[k]
                    trig = veto_triggers(logp.detach(), ratio_ref, adv, micro_mask, log_delta)  # (b, T_m) bool
                    diag["neg_resp"] += int((adv < 0).sum().item())
                    diag["triggered_resp"] += int(trig.any(dim=1).sum().item())  # triggers exist only in A<0 rows
                    log_rho = correction.log_rho(micro, old)  # (b, T_m) log(pi_behav / mu) of the engine; None: none
                    if log_rho is not None:  # A<0 tokens that the mismatch alone would trigger, with no staleness
                        neg = (adv < 0).unsqueeze(1) & micro_mask.bool()  # (b, T_m)
                        diag["mismatch_triggers"] += ((log_rho < log_delta) & neg).sum().item()
                # TRY NOT TO MODIFY: the optimizer update
                correction.check_engine(step)  # the step's first mini-batch: is the engine sampling from these weights?
                sums = world.sum(sums)  # torchrun: add the ranks' shares (each already over global denominators)
                diag = world.sum(diag)  # ALGO LOGIC
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
                # ALGO LOGIC: the veto's metrics of the update, the stage's progress bar
                update_metrics[-1] |= veto_metrics(diag, mb_tokens, staleness, correction.available)
                veto_frac = update_metrics[-1]["mugrpo/vetoed_token_frac"]
                upd_bar.set_postfix(loss=f"{sums['policy_loss']:.3g}", clip=f"{sums['clipfrac']:.2f}", veto=f"{veto_frac:.2f}")
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
