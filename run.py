"""The run: what the method scripts (grpo.py, gapo.py, ...) do before anything loads, in the order a run does it (the
models it loads: models.py; what it writes: outputs.py; the step itself: common.py). A reader following one step
skips it, as CleanRL's reader skips gym and tyro.

flags         Args and arg (the common flags; a script subclasses Args), ARG_CHECKS, validate_args
command line  command_line (a UserError or RunError of verifiers.py becomes one line), parse_args, load_config
              (--config)
start         setup (checks, torchrun, threads, seeds, device) -> (common.World, device)
processes     init_world -> DistributedWorld (torchrun at any world size; common.World.install), env_world_size,
              under_torchrun
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import logging
import math
import os
import random
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

import async_rollouts
import common
import engines
import evaluation
import models
import tools
import verifiers
from verifiers import RunError, UserError

# ----- flags: one dataclass of the common flags, each script subclasses it


def arg(default: Any, help: str, **kw) -> Any:
    """Dataclass field with help text (list defaults become default_factory)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class Args:
    """The flags every script takes. A script subclasses it (`class Args(run.Args)`), adds its own fields after
    a `# <METHOD> specific arguments` line, may give an inherited field another default, and lists the range
    checks of its own fields in `checks` (rows as in ARG_CHECKS). Enum flags are Literal types (argparse choices).
    Every row is checked when the dataclass is built, i.e. while the command line is parsed."""

    model: str = arg(models.EMBEDDED_MODEL, "hub id, local HF folder, or the embedded alias smollm2-135m")
    dataset: str = arg("arith", "registry name (arith, humaneval, gsm8k, math, ...), hub id, or local .jsonl/.json/.parquet")
    eval_dataset: list[str] = arg(
        [],
        "evaluation set(s), each used whole: a registry name (math500 aime24 amc23 gsm8k ...: its preset protocol), a "
        "local file, or NAME=FILE (a registry set's local copy, with its preset); default: a held-out split of "
        "--dataset. Several: eval/<set>/pass@k each, eval/pass@k = the first set (docs/evaluation.md)",
    )
    question_field: str = arg("", "question field of a hub/local dataset (default: the registry's, else 'question')")
    answer_field: str = arg("", "answer field of a hub/local dataset (default: the registry's, else 'answer')")
    answer_format: Literal["auto", "gsm8k", "boxed", "raw"] = arg(
        "auto",
        "how the gold answer is read from the answer field: gsm8k (after the last '#### ', as in GSM8K), boxed "
        "(the last \\boxed{} of a solution), raw (the field as it is); auto: the registry's, else detected row by row",
    )
    reward: str = arg(
        "auto",
        "reward: auto (from the dataset), arith (last number or boxed), math (boxed, math-verify), code, "
        "or your own fn(completion, problem) -> float as module:function or path.py:function",
    )
    system_prompt: str = arg("", "optional system prompt (default: the chat template's own)")
    max_prompt_tokens: int = arg(
        0,
        "the longest training prompt in tokens, chat template included (0: the model's context minus "
        "--max-new-tokens); a longer one is dropped at load (--long-prompts)",
    )
    long_prompts: Literal["drop", "error"] = arg(
        "drop",
        "a training prompt longer than --max-prompt-tokens: drop it at load (one line says how many and the longest "
        "kept; verl: filter_overlong_prompts), or stop with an error. An evaluation prompt that does not fit stops "
        "the run either way",
    )
    max_position_embeddings: int = arg(
        0,
        "extend the model's context to N positions (its config's max_position_embeddings, in the trainer and in "
        "vLLM), as verl's DAPO recipe does for Qwen2.5-Math-7B (4096 -> 32768; docs/performance.md); 0: the model's own",
    )
    engine: Literal["auto", "vllm", "hf"] = arg("auto", "rollout engine: auto (vLLM on GPU if installed, else hf), vllm, hf")
    seed: int = arg(1, "random seed")
    total_steps: int = arg(12, "number of steps (rollout batches)")
    prompts_per_step: int = arg(8, "prompts per rollout batch (P)")
    num_generations: int = arg(8, "rollouts per prompt (G)")
    max_new_tokens: int = arg(32, "maximum completion length")
    temperature: float = arg(1.0, "sampling temperature (trainer log-probs use the same)")
    learning_rate: float = arg(1e-5, "AdamW learning rate (constant after warm-up)")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    warmup_updates: int = arg(2, "linear warm-up length in optimizer updates")
    max_grad_norm: float = arg(1.0, "gradient-norm clip")
    updates_per_batch: int = arg(2, "optimizer updates per rollout batch (mini-batches, shuffled by prompt group)")
    beta: float = arg(
        0.0, "KL coefficient to the frozen initial model (k3); 0 loads no reference model (LoRA: the base, adapters off)"
    )
    lora_rank: int = arg(
        0,
        "LoRA (PEFT): train rank-R adapters on the frozen base, held in the compute dtype (bf16 on CUDA); 0: full "
        "fine-tuning (docs/lora.md)",
    )
    lora_alpha: float = arg(32.0, "LoRA: the adapters' output is scaled by alpha / R (PEFT's parametrization)")
    lora_targets: list[str] = arg(
        ["all-linear"],
        "LoRA: the linear layers that get adapters, by name (e.g. q_proj v_proj); all-linear: every linear layer of "
        "the decoder, attention and MLP (not the LM head)",
    )
    zero_variance: Literal["keep", "mask"] = arg(
        "keep",
        "a group whose rewards are all equal (advantage 0): keep its tokens in the loss's denominators, or mask "
        "them out of the loss (token-mean denominator, sequence counts)",
    )
    dynamic_sampling: bool = arg(
        False,
        "DAPO dynamic sampling: draw more rounds of --prompts-per-step prompts until the step has that many groups "
        "whose verifier rewards are not all equal (slots still empty after --max-sampling-rounds: out of the loss)",
    )
    max_sampling_rounds: int = arg(10, "dynamic sampling: at most this many generation rounds per step (verl's DAPO: 10)")
    overlong_buffer: int = arg(
        0,
        "DAPO soft overlong punishment: a completion in the last L tokens before --max-new-tokens gets "
        "r += -(len - (max_new_tokens - L)) / L * --overlong-penalty (0: off)",
    )
    overlong_penalty: float = arg(1.0, "the overlong penalty at --max-new-tokens (DAPO: 1.0)")
    truncated: Literal["keep", "mask"] = arg(
        "keep", "a completion cut at --max-new-tokens: keep it in the loss, or mask it out (DAPO's overlong filtering)"
    )
    micro_batch_tokens: int = arg(
        0,
        "token budget of one forward/backward micro-batch, in tokens computed (rows x padded length, or packs x "
        "longest pack); 0: 1024 on CPU, 16384 on a GPU",
    )
    logp_chunk_tokens: int = arg(256, "completion tokens per chunk of the LM head + log-softmax")
    gen_batch_size: int = arg(
        0,
        "sequences generated together (hf engine; bounds its KV cache); 0: 64 on CPU, on a GPU the rows its free "
        "memory holds at the start (KV cache at the run's context, the sampler; one line says how many)",
    )
    engine_dtype: Literal["auto", "bf16", "trainer"] = arg(
        "auto",
        "the hf engine's weights for generation: bf16 (a bf16 copy refreshed at every weight sync, the trainer's "
        "fp32 weights untouched; its mismatch is logged: docs/mismatch.md), trainer (the trainer's own); auto: bf16 "
        "on a GPU in one process (under --dtype fp16 the copy is fp16), the trainer's elsewhere",
    )
    hf_decode: Literal["dynamic", "static", "static-eager"] = arg(
        "dynamic",
        "the hf engine's decode loop: dynamic (transformers' growing KV cache; the loop with GPU measurements: "
        "docs/performance.md), static (on a GPU in one process, on the engine's copy: a static KV cache, its decode "
        "step as CUDA graphs; not yet measured ahead on a GPU), static-eager (the same without graphs)",
    )
    gpu_memory_utilization: float = arg(
        0.35,
        "share of the GPU's memory vLLM may take for its weights, activations, CUDA graphs and KV cache (it must be "
        "free when the engine starts; the KV cache gets what is left: docs/performance.md)",
    )
    vllm_sleep_level: int = arg(
        2,
        "vLLM's sleep while the trainer trains: 2 discards its weights (the next wake pushes them anyway), 1 keeps a "
        "pinned host copy of them (as large as the weights, copied every step)",
    )
    dtype: Literal["bf16", "fp16"] = arg(
        "bf16",
        "compute dtype on a GPU: autocast of the trainer's forward passes (fp32 master weights stay) and the vLLM "
        "engine's weights; fp16 adds dynamic loss scaling (CPU: fp32, no autocast; fp16 is refused there)",
    )
    rollout_is: Literal["none", "token-tis", "seq-mask", "icepop", "bypass"] = arg(
        "none",
        "correction of the engine-trainer mismatch rho = pi_old / mu (docs/mismatch.md): none, token-tis "
        "(w = min(rho, C)), seq-mask (w = rho_seq, sequence dropped above C), icepop (w = rho inside [0.5, 5], else 0); "
        "bypass: no weights, the ratio taken against mu itself instead of pi_old (docs/async.md)",
    )
    rollout_is_cap: float = arg(0.0, "C of --rollout-is token-tis / seq-mask (0: the standard 2 / 3)")
    max_engine_logp_diff: float = arg(
        0.1,
        "stop the run when the mean |engine - trainer log-prob| of a step's first mini-batch exceeds this (nats): "
        "the engine is not sampling from the trainer's weights (0: no check)",
    )
    async_lag: str = arg(
        "off",
        "asynchronous rollouts (docs/async.md): a producer process with its own engine generates later steps' batches "
        "while the trainer trains, each sampled under weights at most S optimizer updates older than those it is "
        "trained from (0: through the producer, paced to the synchronous run's weights); off: each step generates its own",
    )
    rollout_device: str = arg(
        "auto",
        "--async-lag: the producer's device: auto (the CPU beside a CPU trainer; a second GPU where there is one, else "
        "the trainer's GPU, shared), cpu, cuda or cuda:N",
    )
    rollout_threads: int = arg(
        0,
        "--async-lag on the CPU: the producer's torch threads; the trainer keeps the rest of the cores (0: half; at lag 0, "
        "where the two take turns, each every core)",
    )
    tools: list[str] = arg(
        [],
        "tools the model may call inside its answer (docs/tools.md): calculator (<calc>17*23</calc>), python "
        "(<python>print(2**10)</python>, run in the code sandbox); the engine runs each call and forces its result in "
        "as <output>...</output> tokens, out of the loss; none by default",
    )
    max_tool_calls: int = arg(4, "--tools: the calls run per completion (later ones stay plain text)")
    gradient_checkpointing: bool = arg(
        False, "recompute decoder-layer activations in backward: less memory, more compute (docs/precision.md)"
    )
    compile: bool = arg(
        False,
        "torch.compile each decoder layer and the LM head's log-softmax chunk for the training passes (inductor: "
        "fused kernels; a minute or more of compiling at start; docs/performance.md); a model or device it cannot "
        "compile stops the run before training, with the compiler's error",
    )
    eval_every: int = arg(0, "evaluate every N steps (0: only before and after training)")
    eval_samples: int = arg(4, "evaluation sets without a preset: samples per problem (n; pass@1 is their mean, avg@n)")
    eval_limit: int = arg(0, "evaluate on the first N problems of each set (0: all; the built-in arith holds 100)")
    eval_temperature: float = arg(0.6, "evaluation sets without a preset: sampling temperature (0: greedy, with n 1)")
    eval_top_p: float = arg(1.0, "evaluation sets without a preset: nucleus sampling's top-p (1: off)")
    eval_max_new_tokens: int = arg(0, "evaluation sets without a preset: the answer's token budget (0: --max-new-tokens)")
    eval_k: list[int] = arg([4], "evaluation sets without a preset: k values for pass@k (each <= --eval-samples)")
    eval_protocol: list[str] = arg(
        [],
        "any field of one evaluation set, SET.FIELD=VALUE (SET * : every set), over its preset or the flags above, e.g. "
        "aime24.n=16 aime24.max_new_tokens=4096 gsm8k.grader=gsm8k-strict '*.temperature=0' '*.n=1'; fields: n "
        "temperature top_p max_new_tokens k maj limit question_field answer_field answer_format template instruction "
        "system_prompt grader preset (docs/evaluation.md)",
    )
    eval_only: bool = arg(False, "only evaluate --model on the eval set, then exit")
    save_every: int = arg(0, "write a checkpoint every N steps (0: none; the last step is always saved if N>0)")
    keep_last: int = arg(
        2,
        "keep only the N newest checkpoints (2: the newest and one before it, should a crash break the newest; 0: all); "
        "the final model goes to <run>/final either way",
    )
    resume: str = arg("", "resume from a run folder (its latest checkpoint) or a checkpoint folder")
    output_dir: str = arg("runs", "parent folder of run folders")
    run_name: str = arg("", "run folder name (default: <exp_name>__s<seed>__<time>)")
    track: bool = arg(False, "log to Weights & Biases")
    wandb_project: str = arg("rlvr-reference", "W&B project")
    log_rollouts_every: int = arg(
        0,
        "every N steps, append every rollout (prompt, completion, reward, advantage, length, "
        "finish reason) to <run>/rollouts.jsonl (0: off)",
    )
    config: str = arg("", "replay a run: its args.json (or a YAML file); flags on the command line override it")

    checks = ()  # the script's own rows (field, test, what the value must be), checked after ARG_CHECKS

    def __post_init__(self):
        check_values(self, [*ARG_CHECKS, *type(self).checks])


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# (field, test of its value, what the value must be); a test with two parameters also gets the args (a bound
# that depends on another flag). Flat on purpose: a new flag adds one line. Enums are Literal types instead.
ARG_CHECKS: list[tuple[str, Callable[..., bool], str]] = [
    (
        "reward",
        lambda v: v in verifiers.BUILTIN_REWARDS or ":" in v,
        "must be auto, arith, math, code, or your own function as module:function or path.py:function",
    ),
    ("total_steps", lambda v: v >= 1, "must be >= 1 (number of rollout batches)"),
    ("prompts_per_step", lambda v: v >= 1, "must be >= 1 (prompts per rollout batch)"),
    (
        "num_generations",
        lambda v: v >= 2,
        "must be >= 2 (with one rollout per prompt every group-relative advantage is 0, so no update would move the model)",
    ),
    ("max_new_tokens", lambda v: v >= 1, "must be >= 1 (maximum completion length)"),
    ("max_prompt_tokens", lambda v: v >= 0, "must be >= 0 (0: the model's context minus --max-new-tokens)"),
    ("max_position_embeddings", lambda v: v >= 0, "must be >= 0 (0: the model's own context)"),
    ("temperature", lambda v: _is_num(v) and v > 0, "must be > 0 (the trainer divides logits by it)"),
    ("learning_rate", lambda v: _is_num(v) and v > 0, "must be > 0"),
    ("weight_decay", lambda v: _is_num(v) and v >= 0, "must be >= 0"),
    ("warmup_updates", lambda v: v >= 0, "must be >= 0"),
    ("max_grad_norm", lambda v: _is_num(v) and v > 0, "must be > 0"),
    ("updates_per_batch", lambda v: v >= 1, "must be >= 1 (optimizer updates per rollout batch)"),
    ("beta", lambda v: _is_num(v) and v >= 0, "must be >= 0 (0: no KL term)"),
    ("lora_rank", lambda v: v >= 0, "must be >= 0 (0: full fine-tuning; LoRA: 1 and up, e.g. 8)"),
    ("lora_alpha", lambda v: _is_num(v) and v > 0, "must be > 0 (the adapters' scale is alpha / rank)"),
    (
        "lora_targets",
        lambda v: len(v) > 0 and ("all-linear" not in v or len(v) == 1),
        "must be all-linear or names of linear layers (e.g. q_proj v_proj), not both",
    ),
    ("max_sampling_rounds", lambda v: v >= 1, "must be >= 1 (generation rounds per step with --dynamic-sampling)"),
    (
        "overlong_buffer",
        lambda v, args: 0 <= v <= args.max_new_tokens,
        "must be in [0, --max-new-tokens] (0: no overlong penalty)",
    ),
    ("overlong_penalty", lambda v: _is_num(v) and v >= 0, "must be >= 0 (the penalty at --max-new-tokens)"),
    ("micro_batch_tokens", lambda v: v >= 0, "must be >= 0 (0 picks 1024 on CPU, 16384 on a GPU)"),
    ("logp_chunk_tokens", lambda v: v >= 1, "must be >= 1"),
    ("gen_batch_size", lambda v: v >= 0, "must be >= 0 (0: 64 on CPU, sized from the free memory on a GPU)"),
    ("gpu_memory_utilization", lambda v: _is_num(v) and 0 < v <= 1, "must be in (0, 1]"),
    ("vllm_sleep_level", lambda v: v in (1, 2), "must be 1 or 2"),
    ("rollout_is_cap", lambda v: _is_num(v) and v >= 0, "must be >= 0 (0: the standard cap of the correction)"),
    ("max_engine_logp_diff", lambda v: _is_num(v) and v >= 0, "must be >= 0 (0: no check)"),
    (
        "async_lag",
        lambda v: v == "off" or (v.isascii() and v.isdigit()),
        "must be off or a whole number of optimizer updates >= 0 (0: through the producer, as the synchronous run)",
    ),
    ("rollout_threads", lambda v: v >= 0, "must be >= 0 (0: half the cores)"),
    ("tools", lambda v: all(t in tools.TOOLS for t in v) and len(set(v)) == len(v), "must be calculator, python or both"),
    ("max_tool_calls", lambda v: v >= 1, "must be >= 1 (tool calls run per completion)"),
    ("eval_every", lambda v: v >= 0, "must be >= 0 (0: only before and after training)"),
    ("eval_samples", lambda v: v >= 1, "must be >= 1 (samples per evaluation problem)"),
    ("eval_limit", lambda v: v >= 0, "must be >= 0 (0: every held-out problem)"),
    ("eval_temperature", lambda v: _is_num(v) and v >= 0, "must be >= 0 (0: greedy decoding)"),
    ("eval_top_p", lambda v: _is_num(v) and 0 < v <= 1, "must be in (0, 1] (1: no nucleus cut)"),
    ("eval_max_new_tokens", lambda v: v >= 0, "must be >= 0 (0: --max-new-tokens)"),
    ("eval_k", lambda v: len(v) > 0 and all(k >= 1 for k in v), "values must be >= 1"),
    ("save_every", lambda v: v >= 0, "must be >= 0 (0: no checkpoints; the final model is always written)"),
    ("keep_last", lambda v: v >= 0, "must be >= 0 (0: keep every checkpoint)"),
]


def check_values(args, rows: Iterable[tuple[str, Callable[..., bool], str]]) -> None:
    """UserError (one line) for the first row whose test fails on its field's value."""
    for name, ok, must in rows:
        value = getattr(args, name)
        try:
            good = bool(ok(value, args) if ok.__code__.co_argcount == 2 else ok(value))
        except TypeError:
            good = False
        if not good:
            shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
            raise UserError(f"--{name.replace('_', '-')} {shown}: {must}")


def validate_args(args) -> None:
    """The checks that read several flags or the file system (the values were checked when `args` was built);
    UserError (one line) for the first that fails. Cheap: touches no model and no dataset."""
    for check in (_check_cross, _check_output_dir, models.model_flag_problem):
        problem = check(args)
        if problem:
            raise UserError(problem)
    async_rollouts.check_args(args, under_torchrun())  # --async-lag: what it does not run, one line each
    tools.check_args(args)  # --tools: the static loop refused, python's sandbox checked
    evaluation.protocols(args)  # every evaluation set's protocol can run (greedy with n > 1, a k > n, ...: one line)


def _check_cross(args) -> str | None:
    P, M = args.prompts_per_step, args.updates_per_batch
    if M > P or math.ceil(P / math.ceil(P / M)) != M:  # group_shuffled_minibatches: whole groups, ceil(P/M) each
        return (
            f"--updates-per-batch {M} needs --prompts-per-step to split into {M} non-empty mini-batches of whole "
            f"prompt groups; {P} prompts give {math.ceil(P / math.ceil(P / M))} (use a multiple of {M})"
        )
    W = env_world_size()
    if W > 1 and any(n % W for n in minibatch_group_counts(P, M)):  # whole groups, dealt evenly to the ranks
        return (
            f"--prompts-per-step {P} in {M} mini-batch(es) gives {minibatch_group_counts(P, M)} prompt groups "
            f"per mini-batch; with {W} processes each must be a multiple of {W}: use --prompts-per-step a "
            f"multiple of {M * W}"
        )
    if args.resume and not os.path.isdir(args.resume):
        return (
            f"--resume {args.resume}: "
            + ("is a file" if os.path.exists(args.resume) else "no such folder")
            + "; pass a run folder or one of its checkpoints/step_N folders"
        )
    if args.engine_dtype == "bf16" and args.engine == "vllm":
        return "--engine-dtype bf16 is the hf engine's: vLLM's weights take --dtype (bf16 on a GPU already)"
    if args.engine_dtype == "bf16" and under_torchrun():
        return "--engine-dtype bf16 runs in one process only (a bf16 copy of FSDP2-sharded weights is not wired up)"
    if args.hf_decode != "dynamic":  # models.make_engine: StaticHFEngine where it runs, never a silent fallback
        vllm = args.engine == "vllm" or (
            args.engine == "auto" and torch.cuda.is_available() and importlib.util.find_spec("vllm")
        )
        where = "vLLM is this run's engine" if vllm else "there is no GPU" if not torch.cuda.is_available() else ""
        where = where or ("it runs under torchrun" if under_torchrun() else "")
        where = where or ("--engine-dtype trainer leaves no copy" if args.engine_dtype == "trainer" else "")
        if where:
            return (
                f"--hf-decode {args.hf_decode} is the hf engine's static loop on a GPU in one process, on its "
                f"low-precision copy; here {where}: drop the flag (the dynamic loop) or run where it applies"
            )
    if args.engine == "vllm" and importlib.util.find_spec("vllm") is None:  # vLLM's CPU build runs too (docs/vllm.md)
        return "--engine vllm needs vLLM: see the README's GPU install line (or 'vLLM on CPU'), or use --engine hf"
    if args.engine == "vllm" or (args.engine == "auto" and torch.cuda.is_available() and importlib.util.find_spec("vllm")):
        broken = engines.vllm_import_problem()  # installed, but built against another torch, say
        if broken:
            picks = "picks vLLM here (a GPU and vLLM are present)" if args.engine == "auto" else "needs vLLM"
            return f"--engine {args.engine} {picks}, but `import vllm` fails ({broken}); fix the install or use --engine hf"
    if args.track and importlib.util.find_spec("wandb") is None:
        return "--track needs wandb: pip install wandb"
    return None


def nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _check_output_dir(args) -> str | None:
    out = args.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        return f"--output-dir {out} is a file; pass a folder (it holds one folder per run)"
    parent = nearest_existing(out)
    if not os.path.isdir(parent):
        return f"--output-dir {out}: {parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"--output-dir {out}: {parent} is not writable"
    if args.run_name and not args.resume:
        run_dir = os.path.join(out, args.run_name)
        if os.path.exists(run_dir) and not os.path.isdir(run_dir):
            return f"run folder {run_dir} is a file; pick another --run-name"
        if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
            return f"run folder {run_dir} already holds a run; continue it with --resume {run_dir}, or pick another --run-name"
    return None


# ----- the command line and its errors


def command_line(main: Callable, args_cls: type) -> None:
    """Parse `args_cls` from the command line and run `main(args)`; user errors and OOM become one line."""
    code = 0
    try:
        main(parse_args(args_cls))
    except (UserError, RunError) as exc:
        # an error every rank raised together (World.agree, a non-finite global norm, a bad flag: every rank
        # checks the same flags before the process group exists) is reported by one rank; any other by its own
        together = getattr(exc, "on_every_rank", False) or (isinstance(exc, UserError) and not common.world().enabled)
        report_error(f"error: {exc}", together)
        code = 2 if isinstance(exc, UserError) else 1
    except torch.OutOfMemoryError:
        report_error(
            "error: out of memory. Lower --micro-batch-tokens, --prompts-per-step, --num-generations or "
            "--max-new-tokens (or --gen-batch-size for generation), or enable --gradient-checkpointing.",
            together=False,
        )
        sys.exit(3)
    except KeyboardInterrupt:
        print("interrupted; resume with --resume <run dir>", file=sys.stderr)
        sys.exit(130)
    if common.world().enabled:
        # the traceback's frames (models holding DTensors on the process group) are gone once the except block
        # ends; collect them before the group goes, so nothing of it is torn down at interpreter exit
        import gc

        gc.collect()
        common.world().shutdown()
    if code:
        sys.exit(code)


ERROR_REPORT_WAIT_S = 60.0  # the longest a failing rank waits for the other failing ranks' lines to be printed


ERROR_REPORT_GRACE_S = 2.0  # and how long it waits for a rank that fails at the same time to say so


def report_error(line: str, together: bool) -> None:
    """Print an error line on stderr so that every failing rank's reason reaches the user exactly once, whichever
    rank exits first (torchrun stops every rank as soon as one has exited). One process: printed. Several: a line
    every rank has (`together`) is printed by the rank that claims it first in torchrun's store, a rank's own error
    by that rank, with its rank; no failing rank leaves before every rank that failed with it has printed. Without
    torchrun's store (another launcher), each rank prints its own error and rank 0 a shared one."""
    import datetime

    if env_world_size() == 1:
        print(line, file=sys.stderr, flush=True)
        return
    rank = os.environ.get("RANK", "0")
    store = _launcher_store()
    if store is None:
        if not together or rank == "0":
            print(line if together else f"{line} (rank {rank})", file=sys.stderr, flush=True)
        return
    key = f"rlvr/error/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store.add(f"{key}/failing", 1)
    if not together:
        print(f"{line} (rank {rank})", file=sys.stderr, flush=True)
    elif store.add(f"{key}/claims", 1) == 1:  # the first rank with the shared line prints it
        print(line, file=sys.stderr, flush=True)
    else:  # the others wait until it is out
        try:
            store.wait([f"{key}/printed"], datetime.timedelta(seconds=ERROR_REPORT_WAIT_S))
        except (RuntimeError, TimeoutError):  # the claiming rank died before printing: better twice than never
            print(line, file=sys.stderr, flush=True)
    if together:
        store.set(f"{key}/printed", "1")
    store.add(f"{key}/reported", 1)
    start = time.monotonic()
    while time.monotonic() - start < ERROR_REPORT_WAIT_S:  # every rank that failed too has printed its line
        if (
            store.add(f"{key}/reported", 0) >= store.add(f"{key}/failing", 0)
            and time.monotonic() - start >= ERROR_REPORT_GRACE_S
        ):
            return
        time.sleep(0.05)


def _launcher_store():
    """torchrun's own TCPStore, which its workers may use (TORCHELASTIC_USE_AGENT_STORE), as a client; else None."""
    import datetime

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        import torch.distributed as td

        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        return td.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))
    except (KeyError, ValueError, RuntimeError, TimeoutError):
        return None


class _ConsoleHandler(logging.Handler):
    """CONSOLE's lines through tqdm.write (a progress bar is redrawn below them): INFO on stdout, notes, warnings
    and above on stderr; the stream is looked up per line (pytest replaces them)."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        tqdm.write(self.format(record), file=sys.stderr if record.levelno >= logging.WARNING else sys.stdout)


common.CONSOLE.addHandler(_ConsoleHandler())


common.CONSOLE.propagate = False


common.CONSOLE.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.ERROR)  # torchrun: rank 0 speaks
# the code sandbox's own lines (its mode, its pool's memory, a slot that did not empty) on the same console
SANDBOX_LOG = logging.getLogger("verifiers.sandbox")
SANDBOX_LOG.addHandler(_ConsoleHandler())
SANDBOX_LOG.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)


def parse_args(args_cls: type, argv: Sequence[str] | None = None):
    """Build the CLI from a dataclass: `--flag-name` (also `--flag_name`; no abbreviation: a prefix is an error that
    names the flags meant), help text per field in groups (the script's own flags first), defaults shown, Literal
    fields as choices. `--config FILE` (a run's args.json, or YAML) supplies the values; `--resume RUN` takes the
    run's own args.json (resumed_settings), and a flag given that changes what the run is, with another value than
    it was started with, is refused (check_resumed). Flags on the command line override the rest."""
    from transformers import HfArgumentParser

    argv = list(sys.argv[1:] if argv is None else argv)
    script = os.path.splitext(os.path.basename(sys.argv[0] or "script.py"))[0]
    doc = (sys.modules["__main__"].__doc__ or "").split("\n")[0]
    parser = HfArgumentParser(
        args_cls,
        description=doc,
        allow_abbrev=False,
        formatter_class=HelpFormatter,
        usage=f"python {script}.py [--flag value ...]",
    )
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default="")
    pre.add_argument("--resume", default="")
    known = pre.parse_known_args(argv)[0]
    if known.config and known.resume:
        raise UserError(
            f"--config {known.config} with --resume {known.resume}: a resumed run keeps the settings it was started with "
            "(its args.json); drop --config"
        )
    values = load_config(known.config, args_cls) if known.config else {}
    recorded = resumed_settings(known.resume, args_cls) if known.resume else {}
    parser.set_defaults(**values, **recorded)
    group_flags(parser, args_cls)
    parser.error = _argparse_error  # a bad value is one line (exit 2), not the usage text
    args, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if rest:
        raise UserError(unknown_flags_message(rest, parser))
    if recorded:
        check_resumed(args, recorded, given_flags(argv, parser), known.resume)
    if values.get("exp_name") not in (None, args_cls.exp_name) and args.exp_name == values["exp_name"]:
        common.CONSOLE.warning(
            f"note: --config {known.config} has exp_name {values['exp_name']!r}, which this run keeps (pass --exp-name to "
            "change it)"
        )
    return args


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help as the docs spell the flags: `--num-generations` (the `--num_generations` alias works, unlisted)."""

    def _format_action_invocation(self, action):
        if action.option_strings:
            shown = [o for o in action.option_strings if "_" not in o] or action.option_strings
            action = copy.copy(action)
            action.option_strings = shown
        return super()._format_action_invocation(action)


# --help's groups of the common flags, in this order after the script's own (every field of Args is in one)
FLAG_GROUPS = {
    "model and data": (
        "model dataset question_field answer_field answer_format reward system_prompt max_prompt_tokens long_prompts "
        "max_position_embeddings"
    ),
    "the step": (
        "seed total_steps prompts_per_step num_generations max_new_tokens temperature learning_rate weight_decay "
        "warmup_updates max_grad_norm updates_per_batch beta"
    ),
    "evaluation (docs/evaluation.md)": (
        "eval_dataset eval_every eval_samples eval_limit eval_temperature eval_top_p eval_max_new_tokens eval_k "
        "eval_protocol eval_only"
    ),
    "DAPO's options (docs/dapo.md)": (
        "zero_variance dynamic_sampling max_sampling_rounds overlong_buffer overlong_penalty truncated"
    ),
    "LoRA (docs/lora.md)": "lora_rank lora_alpha lora_targets",
    "the engine and precision (docs/mismatch.md, docs/precision.md)": (
        "engine engine_dtype hf_decode gpu_memory_utilization vllm_sleep_level dtype rollout_is rollout_is_cap "
        "max_engine_logp_diff"
    ),
    "asynchronous rollouts (docs/async.md)": "async_lag rollout_device rollout_threads",
    "tool calls (docs/tools.md)": "tools max_tool_calls",
    "memory and speed": "micro_batch_tokens logp_chunk_tokens gen_batch_size gradient_checkpointing compile",
    "run folder, checkpoints, resume, logging": (
        "exp_name output_dir run_name save_every keep_last resume config track wandb_project log_rollouts_every"
    ),
}


def group_flags(parser, args_cls: type) -> None:
    """Sort --help into groups: the script's own flags (the fields of `args_cls` that Args does not have) first, then
    FLAG_GROUPS. Only the listing changes; every flag parses as before."""
    own = [
        f.name for f in dataclasses.fields(args_cls) if f.name not in {g.name for g in dataclasses.fields(Args)} | {"exp_name"}
    ]
    method = next((f.default for f in dataclasses.fields(args_cls) if f.name == "exp_name"), "the script")
    groups = {f"{method}.py's own flags (the method)": own}
    groups |= {title: names.split() for title, names in FLAG_GROUPS.items()}
    by_dest = {a.dest: a for a in parser._optionals._group_actions}
    for title, names in groups.items():
        group = parser.add_argument_group(title)
        for name in names:
            if name in by_dest:
                parser._optionals._group_actions.remove(by_dest[name])
                group._group_actions.append(by_dest.pop(name))
    parser._optionals.title = "help"


def given_flags(argv: Sequence[str], parser) -> set[str]:
    """The fields named on the command line (`--flag value` or `--flag=value`)."""
    actions = parser._option_string_actions
    return {actions[t.split("=", 1)[0]].dest for t in argv if t.startswith("--") and t.split("=", 1)[0] in actions}


def unknown_flags_message(rest: Sequence[str], parser) -> str:
    """unknown argument(s) ..., naming the flags a prefix or a near spelling meant."""
    import difflib

    flags = sorted({o for o in parser._option_string_actions if o.startswith("--") and "_" not in o})
    hints = []
    for token in (t.split("=", 1)[0] for t in rest if t.startswith("--")):
        meant = [f for f in flags if f.startswith(token)] or difflib.get_close_matches(token, flags, n=3, cutoff=0.75)
        if meant:
            hints.append(f"{token} is not a flag (flags are never abbreviated): did you mean {' or '.join(meant[:4])}?")
    return f"unknown argument(s): {' '.join(rest)}" + (f"; {'; '.join(hints)}" if hints else " (see --help)")


# Flags a resumed run may change: the step budget, the evaluation and save cadence, checkpoints kept, logging, where
# the run folder is, and the knobs of memory and speed (not of what is computed: the same numbers up to rounding)
MAY_CHANGE_ON_RESUME = (
    "total_steps eval_every eval_only save_every keep_last log_rollouts_every track wandb_project output_dir run_name "
    "resume config micro_batch_tokens logp_chunk_tokens gen_batch_size gradient_checkpointing compile "
    "gpu_memory_utilization vllm_sleep_level hf_decode rollout_threads"
).split()


def resume_run_dir(resume: str) -> str:
    """The run folder of a --resume value: the folder itself, or the run of a checkpoints/step_N (or its model/)."""
    path = os.path.normpath(resume)
    if os.path.basename(path) == "model" and re.fullmatch(r"step_\d+", os.path.basename(os.path.dirname(path))):
        path = os.path.dirname(path)
    if re.fullmatch(r"step_\d+", os.path.basename(path)) or os.path.isfile(os.path.join(path, "trainer_state.pt")):
        return os.path.dirname(os.path.dirname(os.path.abspath(path)))
    return path


def resumed_settings(resume: str, args_cls: type) -> dict:
    """The settings a run was started with (its args.json), the defaults of its resumed command line; {} when the
    folder has none (the checks of --resume say what is wrong). A run of another script is one error line."""
    path = os.path.join(resume_run_dir(resume), "args.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(
            f"--resume {resume}: {path} is unreadable ({exc}); it records the settings the run was started with"
        ) from None
    script = dataclasses.fields(args_cls)
    own = next((f.default for f in script if f.name == "exp_name"), None)
    if isinstance(data, dict) and data.get("exp_name") not in (None, own) and own is not None:
        raise UserError(f"--resume {resume}: the run was made by {data['exp_name']}.py; resume it with that script")
    import typing

    hints, names = typing.get_type_hints(args_cls), {f.name for f in script}
    dropped = [k for k in data if k not in names]
    if dropped:
        common.CONSOLE.warning(
            f"note: --resume {resume}: {path} records {', '.join(dropped)}, which this script does not take"
        )
    return {k: _config_value(path, k, v, hints[k]) for k, v in data.items() if k in names and k not in ("resume", "config")}


def check_resumed(args, recorded: dict, given: set[str], resume: str) -> None:
    """A flag given on a resumed command line with another value than the run was started with: refused in one line,
    unless it is one a resumed run may change (MAY_CHANGE_ON_RESUME; outputs.open_run_logger records those)."""
    for name in sorted(given):
        if name in MAY_CHANGE_ON_RESUME or name not in recorded or getattr(args, name) == recorded[name]:
            continue
        shown = lambda v: " ".join(map(str, v)) if isinstance(v, list) else v
        flag = "--" + name.replace("_", "-")
        raise UserError(
            f"{flag} {shown(getattr(args, name))}: the run {resume_run_dir(resume)} was started with {flag} "
            f"{shown(recorded[name])} (its args.json), and a resumed run keeps what it is; drop the flag, or start a new "
            f"run (a resumed run may change {', '.join('--' + n.replace('_', '-') for n in MAY_CHANGE_ON_RESUME[:7])}, ...)"
        )


def _argparse_error(message: str):
    raise UserError(f"{message} (see --help)")


NOT_REPLAYED = ("config", "run_name", "resume")  # a replay is a new run: its own folder, not the old one's


def load_config(path: str, args_cls: type) -> dict:
    """Values of `args_cls` fields from a JSON (args.json as RunLogger writes it) or YAML file, type-checked.

    Unknown keys are one error line (a file from another method script names that script); run_name and resume
    are not replayed (they would write into, or resume, the old run)."""
    if not os.path.isfile(path):
        raise UserError(f"--config {path}: no such file")
    with open(path) as f:
        text = f.read()
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise UserError(
                f"--config {path}: reading YAML needs PyYAML (pip install pyyaml); or pass the run's args.json"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise UserError(f"--config {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"--config {path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of argument names to values, not {type(data).__name__}")
    import typing

    hints = typing.get_type_hints(args_cls)
    fields = {f.name: f for f in dataclasses.fields(args_cls)}
    unknown = [k for k in data if k.replace("-", "_") not in fields]
    if unknown:
        script = fields["exp_name"].default if "exp_name" in fields else args_cls.__name__
        origin = data.get("exp_name")
        hint = (
            f"; the file is from exp_name {origin!r} and method-specific arguments do not carry over to {script}.py"
            if origin not in (None, script)
            else ""
        )
        raise UserError(
            f"--config {path}: unknown argument{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))} for {script}.py{hint}"
        )
    values = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name in NOT_REPLAYED:
            if value and name != "config":
                common.CONSOLE.warning(
                    f"note: --config {path}: {name} {value!r} is not replayed (a replay is a new run); pass "
                    f"--{name.replace('_', '-')} on the command line to set it"
                )
            continue
        if name == "eval_protocol" and isinstance(value, dict):  # {set: {field: value}}, the readable form in YAML
            value = protocol_items(path, value)
        values[name] = _config_value(path, name, value, hints[name])
    return values


def protocol_items(path: str, sets: dict) -> list[str]:
    """--config's eval_protocol as a mapping {SET: {FIELD: VALUE}} -> the flag's SET.FIELD=VALUE items (a list value:
    its items joined by commas)."""
    items = []
    for label, fields in sets.items():
        if not isinstance(fields, dict):
            raise UserError(
                f"--config {path}: eval_protocol.{label} must map fields to values, e.g. {{n: 16, temperature: 0.6}}"
            )
        for name, value in fields.items():
            text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else "" if value is None else str(value)
            items.append(f"{label}.{name}={text}")
    return items


def _config_value(path: str, name: str, value: Any, hint: Any) -> Any:
    """`value` checked against the field type (bool, int, float, str, Literal, list[...]); one error line otherwise."""
    import typing

    def check(v, t):
        if typing.get_origin(t) is Literal:  # argparse does not check a default against the choices
            if v not in typing.get_args(t):
                raise UserError(
                    f"--config {path}: {name} must be one of {', '.join(map(str, typing.get_args(t)))}, not {v!r:.60}"
                )
            return v
        if t is bool:
            ok = isinstance(v, bool)
        elif t is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif t is float:  # an int is a fine float
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            v = float(v) if ok else v
        elif t is str:
            ok = isinstance(v, str)
        else:
            ok = True
        if not ok:
            raise UserError(f"--config {path}: {name} must be {t.__name__}, not {type(v).__name__} ({v!r:.60})")
        return v

    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):  # a scalar where a list is expected (e.g. an older args.json's "")
            value = [] if value in ("", None) else [value]
        return [check(v, item) for v in value]
    return check(value, hint)


# ----- the start of a run: the device, threads, seeds (every seed's offset: common.py, step 1)


def setup(args) -> tuple[common.World, torch.device]:
    """Before anything loads: the flags that read the file system or several fields (validate_args), the process
    group under torchrun, every core for torch on CPU, the device, `--micro-batch-tokens 0` resolved for it
    (args.json then records the value used), the seeded global generators. Returns (world, device)."""
    validate_args(args)
    w = init_world()
    set_cpu_threads()
    quiet_library_bars()
    device = pick_device()
    if args.dtype == "fp16" and device.type != "cuda":
        raise UserError("--dtype fp16 needs a CUDA GPU: on CPU the scripts compute in fp32 (no autocast)")
    if args.dtype == "fp16" and w.enabled:
        raise UserError(
            "--dtype fp16 runs in one process only (loss scaling of FSDP2's sharded gradients is not "
            "wired up); use bf16 under torchrun"
        )
    if args.engine_dtype == "bf16" and args.engine == "auto" and device.type == "cuda" and importlib.util.find_spec("vllm"):
        raise UserError(
            "--engine-dtype bf16 is the hf engine's: --engine auto picks vLLM here (its weights take --dtype); add --engine hf"
        )
    args.micro_batch_tokens = resolve_micro_batch_tokens(args.micro_batch_tokens, device)
    if device.type != "cuda":  # on a GPU 0 stays: models.make_engine sizes the batch from the free memory
        args.gen_batch_size = args.gen_batch_size or models.GEN_BATCH_CPU  # args.json: the value used
    seed_everything(args.seed)
    return w, device


def quiet_library_bars() -> None:
    """transformers' and datasets' own progress bars (loading weights, writing shards) by tqdm's rule, as the scripts'
    (common.bars_off): none where the output is not a terminal or TQDM_DISABLE is set."""
    if common.bars_off() is None and sys.stderr.isatty():
        return
    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()


def pick_device() -> torch.device:
    if common.world().enabled:
        return common.world().device  # the rank's own GPU (cuda:LOCAL_RANK), or the CPU
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_micro_batch_tokens(value: int, device: torch.device) -> int:
    """`--micro-batch-tokens 0`: 1024 on CPU (faster than 4096 there, at half the memory: docs/performance.md),
    16384 on a GPU, where bigger micro-batches keep the device busy."""
    return value or (16384 if device.type == "cuda" else 1024)


def set_cpu_threads() -> None:
    """Use every core on CPU (torch's default can be lower inside containers)."""
    if not torch.cuda.is_available():
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # torchrun: the node's ranks share its cores
        torch.set_num_threads(max(1, n))


def rank_seed(seed: int, rank: int) -> int:
    return seed + common.RANK_SEED_STRIDE * rank


def seed_everything(seed: int) -> None:
    """Seed python, torch and numpy's global generators (what sampling draws from), each rank its own stream;
    everything every rank must agree on (prompt order, mini-batch plan) uses its own seeded generator."""
    seed = rank_seed(seed, common.world().rank)
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


# ----- several processes (torchrun + FSDP2; docs/distributed.md)
#
# `python gapo.py` is one process: no process group, no wrapping, and every common.World method returns its input
# (the numbers of a one-process run). Under `torchrun --nproc-per-node N`, N = 1 too (the distributed path then runs
# on one GPU: the process group, FSDP2, the FSDP HF engine), every rank runs the same script on the same
# seeded prompts and mini-batch plan; whole prompt groups are dealt to ranks, each generates and trains only its
# rows, per-row scalars (rewards, lengths, what a method needs) are shared so that every rank computes the group
# and batch statistics of the whole batch, and loss denominators are global (FSDP sums gradients, it does not
# average them: see shard_model).


DIST_TIMEOUT_S = float(os.environ.get("RLVR_DIST_TIMEOUT_S", "1800"))  # unbalanced generation on a GPU takes minutes


def env_world_size() -> int:
    """World size torchrun announces in the environment (1 for a plain `python` run); readable before init."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        raise UserError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} is not a number; launch with torchrun") from None


def under_torchrun() -> bool:
    """A launch by torchrun at any world size (1 too): the env:// rendezvous variables it sets (WORLD_SIZE, RANK,
    MASTER_ADDR, MASTER_PORT) are there, or WORLD_SIZE says more than one process. A plain `python` run sets none."""
    return env_world_size() > 1 or all(v in os.environ for v in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"))


def minibatch_group_counts(num_prompts: int, num_minibatches: int) -> list[int]:
    """Prompt groups per mini-batch of group_shuffled_minibatches (ceil(P/M) each, the last one the rest)."""
    per = math.ceil(num_prompts / num_minibatches)
    return [n for m in range(num_minibatches) if (n := min(per, num_prompts - m * per)) > 0]


class DistributedWorld(common.World):
    """The processes of a torchrun launch (World's methods, each a collective over the process group init_world
    joined): rank, world size, the rank's device, and how a batch is split over the ranks."""

    def __init__(self, rank: int, world_size: int, local_rank: int, device: torch.device):
        self.rank, self.world_size, self.local_rank, self.device = rank, world_size, local_rank, device
        self.enabled, self.is_main = True, rank == 0  # torchrun at any world size: collectives on the group
        self._closers: list[Callable[[], None]] = []  # run by shutdown() before the process group goes

    # -- splitting a batch ---------------------------------------------------------------------
    def deal_groups(self, minibatches: Sequence[Sequence[int]], group_size: int) -> list[int]:
        """This rank's prompt groups (global indices, ascending): in each mini-batch of the seeded plan its k-th
        group goes to rank k % W, so every rank holds the same number of groups of every mini-batch."""
        for mb in minibatches:
            if (len(mb) // group_size) % self.world_size:
                raise RunError(
                    f"a mini-batch of {len(mb) // group_size} prompt groups cannot be split evenly over "
                    f"{self.world_size} processes"
                )
        owners = common.group_owners(minibatches, group_size, self.world_size)
        return [g for g, rank in enumerate(owners) if rank == self.rank]

    def same_count(self, micro_batches: list[list[int]]) -> list[list[int]]:
        """Every rank's FSDP forward/backward passes are collectives, so every rank must run the same number of
        micro-batches (3 against 2 hangs). The count is agreed (MAX over ranks) and a rank with fewer splits its
        largest ones; the ranks hold equal numbers of rows (whole groups dealt evenly), so this always succeeds.
        Splitting changes no number but float summation order. World size 1: unchanged."""
        out = list(micro_batches)
        target = int(self.max(len(out)))
        while len(out) < target:
            big = max(range(len(out)), key=lambda i: len(out[i]), default=None)
            if big is None or len(out[big]) < 2:
                n_rows = sum(len(mb) for mb in out)
                raise RunError(
                    f"rank {self.rank} has {n_rows} rows for {target} micro-batches: the ranks' "
                    "shares of the batch are unequal"
                )
            out[big : big + 1] = _split_micro_batch(out[big])
        return out

    # -- collectives over the process group (at world size 1 they return their input) --------
    def share_rows(self, values: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """values (B, ...) valid on this rank's `rows` only -> valid on every row, on every rank (each row has
        exactly one owner: a SUM of the owner's value and zeros, exact in any dtype)."""
        import torch.distributed as td

        own = torch.zeros(values.shape[0], dtype=torch.bool)
        own[list(rows)] = True
        out = torch.where(own.view(-1, *[1] * (values.dim() - 1)), values.cpu(), torch.zeros((), dtype=values.dtype))
        out = out.to(self.device)
        td.all_reduce(out, op=td.ReduceOp.SUM)
        return out.to(values.device)

    def sum(self, values):
        """All-reduce SUM of a float, a tensor, or a dict of floats (in float64: metric sums and counts)."""
        import torch.distributed as td

        if isinstance(values, dict):
            keys = list(values)
            total = self.sum(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64))
            return {k: v.item() for k, v in zip(keys, total)}
        if isinstance(values, torch.Tensor):
            out = values.detach().to(self.device, torch.float64 if values.is_floating_point() else values.dtype).clone()
            td.all_reduce(out, op=td.ReduceOp.SUM)
            return out.to(values.device, values.dtype)
        return self.sum(torch.tensor([float(values)], dtype=torch.float64)).item()

    def max(self, value: float) -> float:
        import torch.distributed as td

        out = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        td.all_reduce(out, op=td.ReduceOp.MAX)
        return out.item()

    def gather_objects(self, obj) -> list:
        """[obj of rank 0, obj of rank 1, ...] on every rank (pickled: small things only)."""
        import torch.distributed as td

        out = [None] * self.world_size
        td.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj):
        """Rank 0's `obj` on every rank."""
        import torch.distributed as td

        box = [obj]
        td.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        import torch.distributed as td

        td.barrier()

    def agree(self, fn: Callable, *args, **kwargs):
        """fn(*args) on every rank; if it raised on any rank, every rank raises the same one-line error (that of
        the lowest failing rank), so no rank is left waiting in the next collective."""
        try:
            result, failure = fn(*args, **kwargs), None
        except (UserError, RunError) as exc:
            result, failure = None, (type(exc).__name__, str(exc))
        except Exception as exc:  # a reward sandbox that will not start, a custom reward that raises, ...
            result, failure = None, ("RunError", f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")
        failures = [(r, f) for r, f in enumerate(self.gather_objects(failure)) if f is not None]
        if failures:
            rank, (kind, message) = failures[0]
            error = {"UserError": UserError, "NonFiniteError": common.NonFiniteError}.get(kind, RunError)(
                f"{message} (rank {rank})"
            )
            error.on_every_rank = True  # command_line prints it on rank 0 only
            raise error
        return result

    def at_shutdown(self, close: Callable[[], None]) -> None:
        """Register something that must be closed while the process group still exists (a vLLM engine)."""
        self._closers.append(close)

    def shutdown(self) -> None:
        import torch.distributed as td

        closers, self._closers = self._closers, []
        for close in closers:  # vLLM's shutdown destroys the default group itself (VLLMEngine.close)
            close()
        if self.enabled and td.is_initialized():
            td.destroy_process_group()  # without it a 2-rank run sometimes aborted at exit (docs/distributed.md)


def _split_micro_batch(micro):
    """Two micro-batches of one: padded rows halved; packs halved, or a single pack's rows (two sub-packs that
    each repeat the prompt)."""
    packs = getattr(micro, "packs", None)
    if not packs:
        half = len(micro) // 2
        return [type(micro)(micro[:half]), type(micro)(micro[half:])]
    if len(packs) == 1:
        packs = [packs[0][: len(packs[0]) // 2], packs[0][len(packs[0]) // 2 :]]
    half = len(packs) // 2
    return [common.MicroBatch.of_packs(packs[:half]), common.MicroBatch.of_packs(packs[half:])]


def init_world() -> common.World:
    """Under torchrun, at any world size (1 too): join the process group (gloo on CPU, NCCL with the rank's GPU) and
    quiet the other ranks (quiet_rank). Plain `python`: one process, nothing happens."""
    if not under_torchrun() or common.world().enabled:
        return common.world()
    import datetime

    import torch.distributed as td

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=DIST_TIMEOUT_S)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        td.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        td.init_process_group("gloo", timeout=timeout)
    w = common.World.install(DistributedWorld(td.get_rank(), td.get_world_size(), local_rank, device))
    if not w.is_main:
        quiet_rank()
    if w.world_size == 1:
        common.CONSOLE.info(ONE_PROCESS_GROUP)
    return w


ONE_PROCESS_GROUP = (
    "WORLD_SIZE=1 with RANK, MASTER_ADDR and MASTER_PORT set (torchrun, or a launcher that exports them): this one "
    "process runs the distributed path (a process group of one, FSDP2, the synced engine); unset them for a plain run"
)


def quiet_rank() -> None:
    """One console: metrics lines, notes, summaries and progress bars come from rank 0. Another rank's CONSOLE keeps
    errors only, transformers keeps its warnings, and neither it nor datasets draws a progress bar (the scripts' own
    bars are off there by their `disable=`). Errors reach the user through report_error."""
    common.CONSOLE.setLevel(logging.ERROR)
    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read at import
    import transformers

    transformers.utils.logging.set_verbosity_warning()
    transformers.utils.logging.disable_progress_bar()
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
