"""Outputs: what a run writes, in the order it writes it (the run's start: run.py; its models: models.py; the step
itself: common.py). A reader following one step skips it.

logger        open_run_logger -> common.RunLogger (metrics.jsonl, args.json, TensorBoard, W&B)
rollouts      write_rollouts (--log-rollouts-every: rollouts.jsonl)
run folders   resume_of (--resume: find_resume, read_checkpoint), make_run_dir, load_trainer_state
checkpoints   plan_checkpoints (the disk plan at start), save_checkpoint (atomic; --keep-last)
the end       save_final_model (a LoRA run's: merged, its adapters beside it)

Each function a script calls reads its own flags from `args`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import torch

import common
import engines
import models
import run
from verifiers import RunError, UserError

# ----- the logger


def open_run_logger(args, run_dir: str, resume_from_step: int | None = None) -> common.RunLogger:
    """The run's RunLogger: the run folder made, args.json written, TensorBoard when installed, W&B when --track
    (--wandb-project); a resumed run first drops the rows written after its checkpoint (the resumed run re-creates
    them exactly once). Several processes: rank 0 writes every file, the other ranks get a logger that writes
    nothing. The evaluation files and the rollout dump: write_eval, write_rollouts."""
    if not common.world().is_main:
        return common.RunLogger(run_dir, enabled=False)
    os.makedirs(run_dir, exist_ok=True)
    if resume_from_step is not None:
        for name in ("metrics.jsonl", "samples.jsonl", "rollouts.jsonl"):  # torn last lines dropped too
            _truncate_jsonl_after_step(os.path.join(run_dir, name), resume_from_step)
        record_resume(args, run_dir, resume_from_step)
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
    if args.track:
        try:
            import wandb
        except ImportError:
            raise UserError("--track needs wandb: pip install wandb") from None
        name = os.path.basename(run_dir)
        wandb_run = wandb.init(project=args.wandb_project, name=name, config=dataclasses.asdict(args), resume="allow", id=name)
        logger.writers.append(lambda row, x: wandb_run.log(row, step=x))
        logger.closers.append(wandb_run.finish)
    return logger


def record_resume(args, run_dir: str, step: int) -> None:
    """resumes.jsonl: one row per resume, the step it starts after and every setting that changed (a resumed run may
    change only run.MAY_CHANGE_ON_RESUME: the step budget, the cadences, logging, memory and speed), old and new; the
    settings as now hold go to args.json."""
    before = {}
    if os.path.isfile(os.path.join(run_dir, "args.json")):
        with open(os.path.join(run_dir, "args.json")) as f:
            before = json.load(f)
    now = json.loads(json.dumps(dataclasses.asdict(args)))
    changed = {k: [before[k], v] for k, v in now.items() if k in before and before[k] != v and k != "resume"}
    row = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "changed": changed}
    with open(os.path.join(run_dir, "resumes.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    if changed:
        common.CONSOLE.info(
            f"resumed with {', '.join(f'{k} {o!r} -> {n!r}' for k, (o, n) in changed.items())} from step {step} "
            "(resumes.jsonl)"
        )


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


# ----- the rollouts file (--log-rollouts-every)


def turns_of(rollout, tokenizer, r: int) -> dict:
    """--tools: the row's turns (the policy's text and each result, in order) and its calls; else nothing."""
    if rollout.tool_turns is None:
        return {}
    completion, turns, at, out = rollout.completion(r), rollout.tool_turns[r], 0, []
    for t in turns:
        out += [
            {"policy": tokenizer.decode(completion[at : t["start"]])},
            {"tool": tokenizer.decode(completion[t["start"] : t["end"]])},
        ]
        at = t["end"]
    out.append({"policy": tokenizer.decode(completion[at:])})
    return {"turns": out, "tool_calls": [{k: t[k] for k in ("tool", "call", "output", "ok")} for t in turns]}


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
                    }
                    | turns_of(rollout, tokenizer, r),
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


# ----- run folders, the disk plan, checkpoints and resume
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


def resume_of(args) -> Resume | None:
    """The checkpoint --resume names, read and checked before any model loads (find_resume); None without --resume."""
    if not args.resume:
        return None
    return find_resume(args.resume, None if args.eval_only else args.total_steps)


def make_run_dir(args) -> str:
    """--output-dir/--run-name, by default <exp_name>__s<seed>__<time>."""
    name = args.run_name or f"{args.exp_name}__s{args.seed}__{time.strftime('%Y%m%d-%H%M%S')}"
    return common.world().broadcast_object(os.path.join(args.output_dir, name))  # torchrun: rank 0's clock names the run


def find_resume(resume: str, total_steps: int | None = None) -> Resume:
    """`--resume` takes a run folder (its newest complete checkpoint is used; broken newer ones are skipped with
    one warning) or a checkpoint folder `checkpoints/step_N` (or its `model/`); everything is checked before any
    model is loaded."""
    path = os.path.normpath(resume)
    if os.path.basename(path) == "model" and _step_of(os.path.basename(os.path.dirname(path))) is not None:
        path = os.path.dirname(path)
    if _step_of(os.path.basename(path)) is not None or os.path.isfile(os.path.join(path, "trainer_state.pt")):
        run_dir = run.resume_run_dir(path)
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
    lora = os.path.isdir(os.path.join(ckpt, models.ADAPTER_DIR))  # a LoRA run's checkpoint holds its adapters, no model
    model_dir = models.checkpoint_model_dir(ckpt)
    problem = (
        models.adapter_folder_problem(os.path.join(ckpt, models.ADAPTER_DIR)) if lora else models.hf_folder_problem(model_dir)
    )
    if problem:
        raise ValueError(problem)
    path = os.path.join(ckpt, "trainer_state.pt")
    if not os.path.isfile(path):
        raise ValueError("no trainer_state.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain containers, never an object
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
    weights = trainable_bytes(model) if common.model_traits(model).lora is not None else model_bytes(model)
    return weights + 2 * trainable_bytes(model)


def final_bytes(model) -> int:
    """Bytes of <run>/final (and, LoRA, <run>/final_adapter)."""
    return model_bytes(model) + (trainable_bytes(model) if common.model_traits(model).lora is not None else 0)


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def free_disk_bytes(path: str) -> int:
    """Free bytes on the file system that holds `path` (or would: its nearest existing folder), rank 0's."""
    w = common.world()
    return w.broadcast_object(shutil.disk_usage(run.nearest_existing(path)).free if w.is_main else None)


def ensure_disk(folder: str, need: int, what: str, hint: str) -> None:
    """RunError on every rank when `folder`'s file system has less than `need` bytes (and 5% more) free."""
    free = free_disk_bytes(folder)
    if need * 1.05 > free:
        error = RunError(f"{what} needs about {_gb(need)}, {_gb(free)} are free on {folder}: {hint}")
        error.on_every_rank = True
        raise error


def plan_checkpoints(args, run_dir: str, model) -> None:
    """When a run starts (not --eval-only): one line with a checkpoint's size, how many the disk holds at most
    (--save-every, --keep-last, --total-steps), and what is free; a UserError when the free disk cannot hold the final
    model (and one checkpoint, with --save-every)."""
    if args.eval_only:
        return
    save_every, keep_last, total_steps = args.save_every, args.keep_last, args.total_steps
    ckpt, weights, free = checkpoint_bytes(model), final_bytes(model), free_disk_bytes(run_dir)
    lora = common.model_traits(model).lora is not None
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
            f"{line}, but {_gb(free)} are free on {run.nearest_existing(run_dir)}: free space, or write the run elsewhere "
            "with --output-dir"
        )
        error.on_every_rank = True  # rank 0's free disk, broadcast: every rank stops with the same line
        raise error
    common.CONSOLE.info(
        f"{line}; {_gb(free)} free"
        + ("" if peak <= free else " (not enough for all of them: a checkpoint that does not fit stops the run first)")
    )


def save_checkpoint(args, run_dir: str, step: int, model, tokenizer, optimizer, scheduler, extra: dict) -> str:
    """Atomic: everything goes to a temporary folder that is renamed into place; a kill at any point leaves the
    previous checkpoint intact. The optimizer state is a Distributed Checkpoint, written sharded as it is held
    (one process: whole), readable by any world size. --keep-last > 0 removes older checkpoints so that at most
    that many of steps <= `step` remain: before the write when at least one stays (so the disk holds at most
    --keep-last), after it for --keep-last 1. A checkpoint the free disk cannot hold stops the run before it is
    written (RunError on every rank)."""
    keep_last = args.keep_last
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
    lora = common.model_traits(model).lora
    if lora is None:
        save_hf_folder(model, tokenizer, os.path.join(tmp, "model"))  # several processes: rank 0 writes it
    else:  # the adapters only: the frozen base is --model
        models.save_adapter(model, os.path.join(tmp, models.ADAPTER_DIR), models.resolve_model_path(lora.base))
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
    """Every file of a folder written to disk, with the modes the user's umask gives (a library that writes through a
    temporary file leaves it 0600: transformers' model.safetensors), so a run folder shared with a group is readable."""
    mask = umask()
    for dirpath, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(dirpath, name), 0o777 & ~mask)
        for name in files:
            path = os.path.join(dirpath, name)
            os.chmod(path, 0o666 & ~mask)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    os.chmod(root, 0o777 & ~mask)


def umask() -> int:
    """The process's umask, read without changing it (/proc), else by setting it back at once."""
    try:
        with open("/proc/self/status") as f:
            return int(next(line.split()[1] for line in f if line.startswith("Umask:")), 8)
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


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
    if common.model_traits(model).lora is not None:  # the merged weights under the base's names: a plain model
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
    lora = common.model_traits(model).lora
    folders = {"final": os.path.join(run_dir, "final")}
    if lora is not None:
        folders["final_adapter"] = os.path.join(run_dir, f"final_{models.ADAPTER_DIR}")
    if w.is_main:
        _remove_stale_tmp(run_dir)
    ckpts = checkpoint_dirs(run_dir)
    hint = f"the checkpoint {ckpts[0]} holds the trained model" if ckpts else "no checkpoint holds the trained model"
    ensure_disk(run_dir, final_bytes(model), "the final model", f"{hint}; free space")
    pid = w.broadcast_object(os.getpid())  # rank 0's pid names the temporary folders
    tmps = {name: os.path.join(run_dir, f".tmp_{name}_{pid}") for name in folders}
    save_hf_folder(model, tokenizer, tmps["final"])
    if lora is not None:
        models.save_adapter(model, tmps["final_adapter"], models.resolve_model_path(lora.base))
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
