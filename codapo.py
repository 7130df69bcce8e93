"""CoDaPO: Confidence and Difficulty-adaptive Policy Optimization (Zhou et al., "The Easy, the Hard, and the
Learnable", ICML 2026, arXiv:2606.07950; official verl code github.com/tmlr-group/CoDaPO, whose definitions are
followed where the paper is terse) -- what it changes relative to grpo.py:
  1. a bounded value per question q from its G rollouts (codapo_weights):
        success rate  p_q = mean_i [r_i == 1],   difficulty value  V_d = 1 - 4 (d_q - 1/2)^2 = 4 p_q (1 - p_q),
        confidence    c_q = exp( mean_i mean_t old_logp_it )   (old-policy log-probs at the sampling temperature),
        weight        w_q = c_q * V_d + offset                 (offset 0.1 as in the official code: w in [0.1, 1.1]);
     c needs every rollout's old log-probs, so they are computed for ALL rows (grpo.py reuses the first
     mini-batch's own forward pass instead), and the advantages are computed after them;
  2. advantages scaled per question, no renormalisation of w:  A_i = w_q (r_i - mean_q r) / (std_q r + 1e-6);
  3. two-step schedule (CoDaSampling + CoDaLearning): a broad step on P fresh prompts, then a selection of the
     learnable questions (0 < p < 1) with w_q >= quantile(w, --codapo-percentile), highest weight first
     (select_for_resampling); the next step is the focused step: the selected questions, each repeated
     --repeat-count times and cycled to fill the P prompt slots, get fresh rollouts from the UPDATED policy,
     every copy its own group of G, with weights recomputed from its own rollouts;
  4. a step is one rollout batch (P x G rollouts, --updates-per-batch updates) whether broad or focused:
     --total-steps counts both, and focused steps draw no new prompts, so the same --total-steps /
     --prompts-per-step / --num-generations as grpo.py gives exactly the same number of rollouts and updates.
     Broad steps are the odd steps 1, 3, 5, ... unless a focused step was skipped (see below); the pending
     selection lives in the prompt sampler's state, so a checkpoint between the two steps resumes exactly.
Objective (token-mean, no KL, as the official recipe):
  J(theta) = E[ 1/sum_i|o_i| sum_i sum_t min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i) ],
  r_it = pi_theta(o_it | q, o_i,<t) / pi_old(o_it | q, o_i,<t),  A_i from 2;
  with --dual-clip-c c > 1 (the official verl loss: c = 3) a token with A_i < 0 contributes max(that term, c A_i):
  its loss never exceeds c |A_i| and its gradient is 0 once r_it > c. Off by default (0), so the default loss and
  the ablations below are grpo.py's; the paper-scale line turns it on.
Ablations by flag: --no-codapo-weighting (w = 1 in the advantages; the selection still ranks by w),
--no-focused-step (every step broad), both (grpo.py's objective; exactly with --codapo-std-eps 1e-4).
Deliberate change vs the official code: there, when most of the batch is saturated (all right or all wrong,
w = offset) the quantile equals the offset, every question passes the threshold and the focused batch is
filled with the first questions in batch order, saturated ones included (zero advantage: a wasted step).
Here only learnable questions (0 < p < 1) can be selected; if there is none, the focused step is skipped,
logged as codapo/focused_skipped = 1, and the next step is a broad one. The official entropy bonus (0.001)
is not used (no method here has one).
Paper-scale recipe: 8 optimizer updates per step, not 1. The official trainer feeds each prompt G times with
rollout n = 1, so its ppo_mini_batch_size=16 counts trajectories: a 16 x 8 = 128-rollout step is 8 mini-batches
of 16 trajectories, one epoch (--updates-per-batch 8; here each mini-batch is 2 whole groups). With one update
per step the ratio is always 1 and no clip ever fires. The official "DAPO variant" is clip-higher (--clip-high
0.28) plus dynamic sampling (regenerating until groups are not all-equal): here --clip-high 0.28 --dynamic-sampling.
With --dynamic-sampling a focused step's later rounds draw fresh prompts (PromptSampler.more), and the step stays
a focused one; its groups whose correctness is all equal are replaced.

Run:
  python codapo.py                                 # CPU default: embedded SmolLM2-135M-Instruct on `arith`
  python codapo.py --no-codapo-weighting --no-focused-step --codapo-std-eps 1e-4   # = grpo.py's objective
  python codapo.py --model Qwen/Qwen2.5-Math-1.5B --dataset math --eval-dataset math500 --prompts-per-step 16 \\
      --num-generations 8 --updates-per-batch 8 --learning-rate 1e-6 --warmup-updates 0 --max-new-tokens 3072 \\
      --dual-clip-c 3 --gradient-checkpointing --total-steps 9360 --eval-every 100 --eval-samples 32 --eval-k 1 \\
      --eval-limit 0 --save-every 100              # GPU + vLLM, official recipe (DAPO variant: add --clip-high 0.28)
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
    # CODAPO specific arguments
    codapo_offset: float = arg(
        0.1, "offset added to the value: w = c * V_d + offset (official code; the paper's eq. has none)"
    )
    codapo_percentile: float = arg(0.75, "select learnable questions with w >= this quantile of the batch's w (CoDaSampling)")
    repeat_count: int = arg(4, "copies of each selected question in the focused step (about 1 / (1 - percentile))")
    codapo_weighting: bool = arg(True, "scale each question's advantages by w (--no-codapo-weighting: w = 1, ablation)")
    focused_step: bool = arg(
        True, "follow each broad step by a focused step on the selected questions (--no-focused-step: ablation)"
    )
    codapo_std_eps: float = arg(1e-6, "epsilon of the group std in the advantage (official 1e-6; grpo.py uses 1e-4)")
    clip_low: float = arg(0.2, "eps_low: lower clip bound 1 - eps_low (official recipe 0.2)")
    clip_high: float = arg(
        0.2,
        "eps_high: upper clip bound 1 + eps_high (official 0.2; 0.28 in its DAPO variant, with --dynamic-sampling)",
    )
    dual_clip_c: float = arg(
        0.0,
        "dual clip for A < 0: cap each token's loss at c |A| (Ye et al. 2020; the official "
        "verl loss uses c = 3); 0 or negative: off (default: the grpo.py loss)",
    )
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = arg(
        "token-mean", "token-mean (official), seq-mean-token-mean (GRPO), seq-mean-token-sum-norm (Dr. GRPO)"
    )
    checks = (  # (flag, test of its value, what it must be): checked with the common flags, before anything loads
        ("codapo_percentile", lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
        ("repeat_count", lambda v: v >= 1, "must be >= 1"),
        ("dual_clip_c", lambda v: v > 1.0 or v <= 0.0, "must be > 1 (3 in the official recipe) or <= 0 (off)"),
        ("clip_low", lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
        ("clip_high", lambda v: 0.0 <= v < math.inf, "must be finite and >= 0"),
        ("codapo_std_eps", lambda v: 0.0 < v < math.inf, "must be > 0"),
        ("codapo_offset", lambda v: 0.0 <= v < math.inf, "must be >= 0 (a negative offset can flip the sign of an advantage)"),
        (
            "async_lag",
            lambda v, args: v == "off" or not args.focused_step or int(v) < args.updates_per_batch,
            "must be below --updates-per-batch with the focused step: a focused batch is drawn after its broad step's "
            "rewards, and a larger lag would draw it before them (docs/codapo.md); or add --no-focused-step",
        ),
    )


# ALGO LOGIC: advantages
def compute_advantages(
    rewards: torch.Tensor, group_size: int, weights: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """rewards (B,), weights (B // G,) one per group (None: all 1) -> advantages (B,).

    A_i = w_q * (r_i - mean_q r) / (std_q r + eps), unbiased std; rows [g*G:(g+1)*G] are group g. With w = 1 and
    eps = 1e-4 this is grpo.py's compute_advantages(scale="group") exactly."""
    grouped = rewards.view(-1, group_size)  # (P, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # r_i - mean_q r
    std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centered[:, :1])  # unbiased (N-1)
    adv = centered / (std + eps)  # all-equal group -> 0 / eps = 0 exactly
    if weights is not None:
        adv = adv * weights.to(adv.dtype).view(-1, 1)  # CoDaLearning: scale group q by w_q (no renormalisation)
    return adv.reshape(-1)


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
    dual_clip_c: float = 0.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate. logp, old_logp, ref_logp, mask: (B, T); advantages (B,). Returns (loss, stats).

    dual_clip_c > 1: dual-clip PPO (Ye et al. 2020, arXiv:1912.09729; verl's clip_ratio_c, 3 in the official
    CoDaPO loss): a token with A < 0 has loss min(max(-A r, -A clip(r)), -c A), so it never exceeds c |A| and
    has zero gradient once r > c. dual_clip_c <= 0: off, the loss is exactly the plain clipped surrogate."""
    if 0.0 < dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1 or <= 0 (off), not {dual_clip_c}")
    mask = mask.to(logp.dtype)
    log_ratio = logp - old_logp  # (B, T) log r_it
    ratio = torch.exp(log_ratio)  # r_it = pi_theta / pi_old
    adv = advantages.to(logp.dtype).unsqueeze(1)  # (B, 1), broadcast over tokens
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)  # PPO pessimistic bound, (B, T)
    dual = torch.zeros_like(per_token, dtype=torch.bool)  # (B, T) tokens whose loss the dual clip capped
    if dual_clip_c > 0.0:
        # dual clip: for A < 0 the bound above grows without limit in r (-A r); cap it at -c A = c |A|.
        # With c > 1 it binds exactly when r > c (max(r, clip(r)) = r there), a constant: zero gradient.
        dual = (adv < 0) & (per_token > -adv * dual_clip_c)
        per_token = torch.where(dual, -adv * dual_clip_c, per_token)
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
        clip_dual = dual.to(mask.dtype) * mask  # A < 0 and r > c: capped at c |A|, grad 0 (disjoint from clip_low)
        stats = {
            "clipfrac": ((clip_low + clip_high + clip_dual).sum() / n).item(),
            "clipfrac_low": (clip_low.sum() / n).item(),
            "clipfrac_high": (clip_high.sum() / n).item(),
            "clipfrac_dual": (clip_dual.sum() / n).item(),
            "approx_kl": (((ratio - 1.0) - log_ratio) * mask).sum().div(n).item(),  # k3 of KL(old || new)
        }
    return loss, stats


# ALGO LOGIC: codapo_weights, select_for_resampling, focused prompt slots
def success_rate(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """rewards (B,) in [0, 1] -> p (B // G,): the share of each group's rollouts that are fully right (r == 1)."""
    return (rewards.view(-1, group_size) >= 1.0).to(torch.float32).mean(dim=1)  # p_q = mean_i [r_i == 1]


def codapo_confidence(seq_mean_logp: torch.Tensor, group_size: int) -> torch.Tensor:
    """seq_mean_logp (B,): each rollout's mean token log-prob under the old policy -> c (B // G,) in (0, 1].

    c_q = exp( mean_i [ mean_t old_logp_it ] ): averaged over ALL G rollouts of q (right and wrong), then
    exponentiated, i.e. the geometric-mean token probability of the group."""
    return torch.exp(seq_mean_logp.to(torch.float32).view(-1, group_size).mean(dim=1))


def codapo_weights(rewards: torch.Tensor, seq_mean_logp: torch.Tensor, group_size: int, offset: float = 0.1) -> torch.Tensor:
    """One weight per group (B // G,): w_q = c_q * V_d + offset, V_d = 4 p_q (1 - p_q) in [0, 1].

    V_d = 1 - 4 (d_q - 1/2)^2 with difficulty d_q = 1 - p_q: 0 for all-right and all-wrong groups, 1 at p = 1/2.
    So saturated groups (and every group when G = 1) get exactly w = offset."""
    p = success_rate(rewards, group_size)  # (P,)
    value_difficulty = 4.0 * p * (1.0 - p)  # (P,) V_d
    return codapo_confidence(seq_mean_logp, group_size) * value_difficulty + offset  # (P,)


def codapo_dynamics(
    rewards: torch.Tensor,
    seq_mean_logp: torch.Tensor,
    advantages: torch.Tensor,
    unweighted_advantages: torch.Tensor | None = None,
) -> dict:
    """The paper's training dynamics for one step (rollout-level; logged on the step's first update row).

    rewards, seq_mean_logp (mean_t old_logp_it), advantages: (B,). Per rollout, confidence exp(mean_t old_logp_it)
    (the geometric-mean token probability under the sampling policy) averaged over the correct (r >= 1) and over
    the incorrect rollouts: confidence inflation shows as both rising; mean |A_i| over the B rollouts as used in
    the update (after w_q) shows advantage contraction; with `unweighted_advantages` also mean |A_i| before w_q.
    A class with no rollout is left out of the dict (a metric with no data is never None or NaN)."""
    conf = torch.exp(seq_mean_logp.to(torch.float32))  # (B,) per-rollout confidence in (0, 1]
    right = rewards >= 1.0  # (B,) correct rollouts, the same rule as success_rate
    out = {"codapo/adv_abs_mean": advantages.to(torch.float32).abs().mean().item()}  # mean_i |A_i| after w_q
    if unweighted_advantages is not None:
        out["codapo/adv_abs_mean_unweighted"] = unweighted_advantages.to(torch.float32).abs().mean().item()
    if right.any():
        out["codapo/confidence_correct_mean"] = conf[right].mean().item()
    if (~right).any():
        out["codapo/confidence_incorrect_mean"] = conf[~right].mean().item()
    return out


def select_for_resampling(
    rewards: torch.Tensor, weights: torch.Tensor, group_size: int, percentile: float = 0.75
) -> list[int]:
    """Group indices for the focused step, highest weight first (ties: batch order).

    Official rule: w_q >= quantile(w, percentile) over all B // G groups (linear interpolation, as torch.quantile).
    Deliberate change: only learnable groups (0 < p < 1) qualify. In a mostly saturated batch the quantile falls
    to the offset and every group passes; the official code then takes groups in batch order, saturated ones
    (zero advantage) included. Returns [] when no group is learnable (the caller skips the focused step)."""
    p = success_rate(rewards, group_size)  # (P,)
    w = weights.to(torch.float32)
    threshold = torch.quantile(w, percentile)  # scalar; percentile 0.75 -> about the top quarter
    chosen = ((w >= threshold) & (p > 0.0) & (p < 1.0)).nonzero().flatten().tolist()
    return sorted(chosen, key=lambda g: -w[g].item())  # stable sort: equal weights keep batch order


def focused_prompt_slots(selected: list[int], repeat_count: int, num_slots: int) -> list[int]:
    """Prompt slots of the focused step: each selected id `repeat_count` times in a row, the sequence cycled and
    cut to `num_slots` (as the official code): [a, b], 4, 8 -> a a a a b b b b; [a], 4, 8 -> a x 8;
    [a, b, c], 4, 8 -> a a a a b b b b (the lowest-weight selection falls off). Every slot is its own group of G."""
    sequence = [q for q in selected for _ in range(repeat_count)]
    return [sequence[i % len(sequence)] for i in range(num_slots)]


class FocusSampler(common.PromptSampler):
    """The prompt sampler of grpo.py plus one pending focus: after a broad step, set_focus(problem ids) makes
    the next sample(P) return the focused step's slots instead of fresh prompts (the epoch stream does not
    move). The pending focus is part of state_dict(), which goes into every checkpoint: a run stopped between
    a broad step and its focused step resumes with that focused step."""

    def __init__(self, n: int, seed: int, repeat_count: int):
        super().__init__(n, seed)
        self.repeat_count, self.focus, self.last_focused = repeat_count, [], False

    def set_focus(self, problem_ids: list[int]) -> None:
        self.focus = [int(i) for i in problem_ids]

    def sample(self, k: int) -> list[int]:
        self.last_focused = bool(self.focus)  # does the batch being drawn belong to a focused step?
        if not self.focus:
            return super().sample(k)  # broad step: k fresh prompts
        slots, self.focus = focused_prompt_slots(self.focus, self.repeat_count, k), []
        return slots

    def state_dict(self) -> dict:
        return {**super().state_dict(), "focus": list(self.focus)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.focus = list(state.get("focus", []))


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
    sampler = FocusSampler(len(train_task.problems), args.seed, args.repeat_count) if train_task else None  # ALGO LOGIC
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
        # ALGO LOGIC: advantages -- CoDaPO's weights need every row's old log-probs, so they come after them (below)
        # TRY NOT TO MODIFY: old log-probs
        B = len(rollout)
        mask = common.completion_mask_of(rollout)  # (B, T)
        with timers("train"):
            # The first mini-batch is trained under the weights that would give old_logp: its old_logp is the
            # detached log-prob of its own first forward pass (same numbers, one forward pass saved).
            # CoDaPO: the confidence c_q needs old_logp on EVERY row, the first mini-batch's included  # ALGO LOGIC
            later_rows = rollout.rows  # every row this rank holds  # ALGO LOGIC
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
        # ALGO LOGIC: value w_q, advantages, selection for the focused step (shapes: B = P*G rows, P groups)
        focused = sampler.last_focused  # this batch re-rolls the previous broad step's selection
        seq_mean_logp = (old_logp * mask).sum(1) / mask.sum(1).clamp(min=1.0)  # (B,) mean_t old_logp_it per rollout
        seq_mean_logp = world.share_rows(seq_mean_logp, rollout.rows)  # torchrun: every rank's rows, on every rank
        weights = codapo_weights(rewards, seq_mean_logp, G, args.codapo_offset)  # (P,) w_q = c_q * 4p(1-p) + offset
        weighting = weights if args.codapo_weighting else None  # (P,), or None: w = 1 (--no-codapo-weighting)
        advantages = compute_advantages(rewards, G, weighting, args.codapo_std_eps)  # (B,) w_q (r_i - mean) / (std + eps)
        loss_unit = "token" if args.loss_agg == "token-mean" else "sequence"  # micro-batch shares by tokens or rows
        p_q = success_rate(rewards, G)  # (P,) success rate per group
        codapo_metrics = {
            "codapo/weight_mean": weights.mean().item(),
            "codapo/weight_max": weights.max().item(),
            "codapo/confidence_mean": codapo_confidence(seq_mean_logp, G).mean().item(),
            "codapo/learnable_frac": ((p_q > 0) & (p_q < 1)).float().mean().item(),
            "codapo/focused_step": float(focused),
            f"codapo/{'focused' if focused else 'broad'}_reward_mean": rewards.mean().item(),
        }
        unweighted = compute_advantages(rewards, G, None, args.codapo_std_eps)  # (B,) the same before w_q
        codapo_metrics |= codapo_dynamics(rewards, seq_mean_logp, advantages, unweighted)  # confidence by class, mean |A|
        if not focused:  # broad step: pick what the next (focused) step re-rolls from the updated policy
            selected = select_for_resampling(rewards, weights, G, args.codapo_percentile)  # group ids, best first
            codapo_metrics["codapo/selected"] = len(selected)
            if selected:
                codapo_metrics["codapo/selected_reward_mean"] = rewards.view(P, G)[selected].mean().item()
            if args.focused_step:
                sampler.set_focus([problem_idx[g] for g in selected])  # pending focus: saved with the sampler state
                codapo_metrics["codapo/focused_skipped"] = float(not selected)
                if not selected:  # deliberate change vs the official code: never re-roll saturated questions
                    common.CONSOLE.info(
                        f"step {step}: no learnable question (every group all right or all wrong); "
                        "focused step skipped, the next step is a broad one"
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
                dual_clipfrac = 0.0  # share of the mini-batch's tokens capped by the dual clip (A < 0, r > c)  # ALGO LOGIC
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
                    # ALGO LOGIC: the method's loss of the micro-batch
                    loss, stats = compute_policy_loss(
                        logp,
                        ratio_ref,
                        advantages[micro].to(logp.device),
                        micro_mask,
                        eps_low=args.clip_low,
                        eps_high=args.clip_high,
                        loss_agg=args.loss_agg,
                        ref_logp=ref,
                        beta=args.beta,
                        is_weights=is_weights,
                        max_tokens=args.max_new_tokens,
                        dual_clip_c=args.dual_clip_c,
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
                    dual_clipfrac += stats["clipfrac_dual"] * n_tok / mb_tokens  # ALGO LOGIC
                # TRY NOT TO MODIFY: the optimizer update
                correction.check_engine(step)  # the step's first mini-batch: is the engine sampling from these weights?
                sums = world.sum(sums)  # torchrun: add the ranks' shares (each already over global denominators)
                dual_clipfrac = world.sum(dual_clipfrac)  # ALGO LOGIC
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
                update_metrics[-1] |= {"codapo/dual_clipfrac": dual_clipfrac} if args.dual_clip_c > 0 else {}  # ALGO LOGIC
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
        rollout_metrics.update(codapo_metrics)  # ALGO LOGIC
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
