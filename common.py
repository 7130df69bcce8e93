"""One step of the method scripts (grpo.py, gapo.py, mugrpo.py, codapo.py, opd.py), in the order it runs: the
method-free layer they share. A run starts and ends in the run's rooms: run.py (flags, the command line, processes), models.py
(models, the optimizer, the engine), outputs.py (evaluation, checkpoints); the rollout engines are in engines.py.
The names one step uses, in order:

1. engine.wake (the weight sync: engines.py); group_shuffled_minibatches(minibatch_generator(seed, step)): the
   mini-batch plan
2. PromptSampler.sample, format_prompt; generate_rollout (seed + step; round k: + k * ROUND_SEED_STRIDE; an engine's
   NonFiniteError stops the run, step_named) ->
   RolloutBatch (prompt(r), completion(r), lengths); rollout_rewards (verifiers.compute_rewards) -> rewards (B,)
3. the step's options, each off by default (they follow the step below): dynamic_sampling (more rounds,
   PromptSampler.more), engine.sleep, dapo_shaping (the overlong penalty; in_loss (B,): equal-reward groups,
   truncated rows out of the loss)
4. completion_mask_of (B, T); no_grad_logps: the old (and reference) log-probs; RolloutCorrection: the engine's
   log-probs against the trainer's
5. per mini-batch: micro_batches (a token budget; the rows of one prompt packed, its prompt computed once),
   token_batch_of -> TokenBatch, completion_logps (B, T) with entropy, correction.weights (--rollout-is), the
   method's loss, check_finite (NaN or inf: stop), accumulation_weight, scaler.scale(loss).backward();
   correction.check_engine (a stale engine, its log-probs not finite), clip_grad_norm (the global norm, non-finite:
   stop), scaler.step
6. metrics: grad_metrics, peak_memory_gb, correction.metrics, learning_signal (a step that cannot learn: said),
   RunLogger.log, console_line, CONSOLE

Around them: World and world() (this one process; under torchrun run.init_world installs its DistributedWorld in
its place), bars_off (tqdm's switch of a progress bar), ModelTraits and model_traits (the model's contract with the
step: what the rooms attach to a model), Timers, and every seed a run derives from --seed. After the step, its
options: DAPO's (varied_groups, overlong_penalty, dapo_shaping, group_owners, dynamic_sampling) and torchrun's view
of a rollout (ShardedRollout).
Shapes: B rollouts (rows of one prompt contiguous), T completion tokens, G rollouts per prompt.
"""

from __future__ import annotations

import array
import contextlib
import json
import logging
import math
import operator
import os
import random
import resource
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

import tools
import verifiers
from verifiers import RunError

# ----- the processes, the console and the step's timers


class World:
    """The training processes. A plain `python` run is this one process: every collective below returns its input
    unchanged. Under torchrun, run.init_world installs a DistributedWorld in its place, with the same methods."""

    rank, world_size, local_rank = 0, 1, 0
    device: torch.device | None = None
    enabled = False  # under torchrun (at any world size: a process group, FSDP2)?
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

    @staticmethod
    def install(w: World) -> World:
        """Make `w` the run's World, the one world() returns (run.init_world under torchrun)."""
        global _WORLD
        _WORLD = w
        return w


_WORLD = World()


def world() -> World:
    """The current World: this one process until run.init_world installs a DistributedWorld under torchrun."""
    return _WORLD


def bars_off() -> bool | None:
    """tqdm's `disable=`: True off rank 0; on rank 0 tqdm's own rule (None: off where the output is not a terminal),
    and True where TQDM_DISABLE is set (read as tqdm does: the bool of its string)."""
    return True if not world().is_main or bool(os.environ.get("TQDM_DISABLE")) else None


@dataclass
class ModelTraits:
    """The model's contract with the step, attached by the rooms as `model.rlvr_traits`, read through model_traits
    (a model built by hand has the defaults): autocast_dtype (models.load_model: bf16 or fp16 on CUDA, None on the
    CPU), chunk_logp_entropy (models.compile_model under --compile), lora (models.add_lora). One more name is a
    method, as FSDP2 runs it as a forward: `model.rlvr_completion_logps` (models.shard_model; docs/layout.md)."""

    autocast_dtype: torch.dtype | None = None
    chunk_logp_entropy: Callable | None = None
    lora: object | None = None


def model_traits(model) -> ModelTraits:
    """What the rooms attached to `model` (ModelTraits), or the defaults."""
    return getattr(model, "rlvr_traits", None) or ModelTraits()


CONSOLE = logging.getLogger("rlvr")  # the run's console (rank 0 only under torchrun): its handler is run.py's


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


# ----- 1. the mini-batch plan (engine.wake, the weight sync, is in engines.py)


# every seed a run derives from --seed, in one place (run.rank_seed adds the first, evaluation.eval_seed EVAL_SEED_OFFSET,
# models.add_lora LORA_SEED_OFFSET; the data splits' seeds: verifiers.ARITH_EVAL_SEED_OFFSET, HOLDOUT_SHUFFLE_SEED)
RANK_SEED_STRIDE = 1_000_003  # rank r samples from seed + 1_000_003 * r (rank 0 is a one-process run)
SAMPLER_SEED_STRIDE = 1_000_003  # the prompt order of epoch e: seed * 1_000_003 + e
MINIBATCH_SEED_STRIDE = 100_003  # the mini-batch plan of step s: seed * 100_003 + s
ROUND_SEED_STRIDE = 10_000_019  # dynamic sampling's round k of step s samples with seed + s + 10_000_019 * k
EVAL_SEED_OFFSET = 12345  # evaluation samples: seed + 12345 (the same samples before and after training)

LORA_SEED_OFFSET = 7919  # LoRA's A matrices (models.add_lora): seed + 7919, the same on every rank


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


def format_prompt(tokenizer, question: str, instruction: str = "", system_prompt: str | None = None, template="chat"):
    """prompt_text's token ids (the prompt ends in the assistant turn)."""
    return tokenizer(prompt_text(tokenizer, question, instruction, system_prompt, template), add_special_tokens=False)[
        "input_ids"
    ]


def prompt_text(tokenizer, question: str, instruction: str = "", system_prompt: str | None = None, template="chat") -> str:
    """The question, then the instruction (one holding `{question}`: the question there), in the model's chat template
    (template "plain", or a model without one: plain text)."""
    content = f"{question.strip()}\n\n{instruction.strip()}" if instruction else question.strip()
    content = instruction.replace("{question}", question.strip()) if "{question}" in instruction else content
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": content})
    if tokenizer.chat_template and template == "chat":
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return (system_prompt + "\n\n" if system_prompt else "") + content + "\n\nAnswer: "  # a base model: plain text


# ----- 3. the rollout (the engines: engines.py) and the rollout data


class NonFiniteError(RunError):
    """An engine met NaN or inf where it samples (its logits, or the log-probs it returns): it stops, never draws."""

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.on_every_rank = every_rank


def generate_rollout(
    engine, prompt_ids, n: int, max_new_tokens: int, temperature: float, seed: int, minibatches, step: int | None = None
):
    """n completions for each of the P prompts -> a RolloutBatch (engine.generate). Under torchrun (any world size)
    each rank generates the groups World.deal_groups gives it (prompt g's rows seeded by (seed, g): the same draws on
    any rank) -> a ShardedRollout. An engine's NonFiniteError stops the run (every rank), naming `step`."""
    w = world()
    if not w.enabled:
        with step_named(step):
            return engine.generate(prompt_ids, n, max_new_tokens, temperature, seed=seed)
    groups = w.deal_groups(minibatches, n)
    with step_named(step):  # a rank whose engine fails (vLLM's broken log-probs, say) stops every rank (World.agree)
        local = w.agree(
            engine.generate, [prompt_ids[g] for g in groups], n, max_new_tokens, temperature, seed=seed, group_ids=groups
        )
    return ShardedRollout(local, groups, len(prompt_ids), n)


@contextlib.contextmanager
def step_named(step: int | None):
    """An engine's NonFiniteError as the run's error, naming the step whose rollout it stopped."""
    try:
        yield
    except NonFiniteError as exc:
        error = RunError(f"{exc}, in the rollout of step {step}; the last checkpoint is intact")
        error.on_every_rank = getattr(exc, "on_every_rank", False)
        raise error from None


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
        self.version: int | None = None  # --async-lag: the weight version it was sampled under (None: this step's)
        self.lag = 0  # --async-lag: optimizer updates between that version and the one it is trained from
        self.tool_turns: list[list[dict]] | None = None  # --tools: each row's calls, their results' token spans (tools.py)

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
    mask = (torch.arange(max(1, int(lengths.max()))) < lengths[:, None]).float()
    return mask if getattr(rollout, "tool_turns", None) is None else tools.masked(mask, rollout, rows)  # --tools


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
        batch = pack_batch([(rollout.prompt(g[0]), [rollout.completion(r) for r in g]) for g in packs], pad_id)
    else:
        batch = pad_batch([rollout.prompt(r) for r in micro], [rollout.completion(r) for r in micro], pad_id)
    rows = [r for g in packs for r in g] if packs else micro  # the batch's rows in order
    return batch if getattr(rollout, "tool_turns", None) is None else tools.without_tool_tokens(batch, rollout, rows)


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
    sharded = getattr(model, "rlvr_completion_logps", None)  # models.shard_model: FSDP2's registered forward
    if sharded is not None:
        return sharded(batch, temperature, chunk_tokens, with_entropy)
    return completion_logps_forward(model, batch, temperature, chunk_tokens, with_entropy)


def completion_logps_forward(
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
    chunk_fn = model_traits(model).chunk_logp_entropy or chunk_logp_entropy  # --compile: models.compile_model
    logps, ents = [], []
    with autocast_context(model):  # one context for every chunk; the recompute in backward restores its state
        # the head's weight cast to the compute dtype once per micro-batch, outside the recomputed chunks: autocast
        # casts it per chunk (its cache ends with each context) and again in each chunk's recompute
        dtype = model_traits(model).autocast_dtype
        cast = [p.detach().to(dtype) if dtype is not None and p is not None else None for p in (head.weight, head.bias)]
        for start in range(0, flat_hidden.shape[0], chunk_tokens):
            h, y = flat_hidden[start : start + chunk_tokens], flat_targets[start : start + chunk_tokens]
            # each chunk's gradient reaches the fp32 weight in fp32 (CastOnce), summed there as autocast's casts did
            weight, bias = (CastOnce.apply(p, c) if c is not None else p for p, c in zip((head.weight, head.bias), cast))
            if torch.is_grad_enabled():
                lp, ent = torch.utils.checkpoint.checkpoint(
                    chunk_fn, h, weight, bias, y, temperature, softcap, use_reentrant=False
                )
            else:
                lp, ent = chunk_fn(h, weight, bias, y, temperature, softcap)
            logps.append(lp)
            ents.append(ent)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=device)
    out = out.masked_scatter(mask, torch.cat(logps)) if logps else out
    if not with_entropy:
        return out, None
    entropy = torch.zeros(mask.shape, dtype=torch.float32, device=device)
    return out, entropy.masked_scatter(mask, torch.cat(ents).detach()) if ents else entropy


class CastOnce(torch.autograd.Function):
    """`cast`, a copy of `param` in a lower dtype made once, as a function of `param`: the gradient goes back to
    `param` in its own dtype, as through autocast's own cast, without casting `param` again."""

    @staticmethod
    def forward(ctx, param, cast):
        ctx.dtype = param.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


def autocast_context(model):
    """Autocast of `model`'s forward passes in its `autocast_dtype` (load_model: bf16 on CUDA); else a no-op."""
    dtype = model_traits(model).autocast_dtype
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(next(model.parameters()).device.type, dtype=dtype)


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
        dtype = model_traits(model).autocast_dtype or next(model.parameters()).dtype
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


def chunk_logp_entropy(hidden, weight, bias, targets, temperature: float, softcap: float | None):
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
    correction); `ratio_reference(rows, old)`: what the ratio is taken against (--rollout-is bypass: mu itself);
    `check_engine(step)`: stop the run when the step's first mini-batch shows an engine that is not sampling from
    the trainer's weights (a batch of --async-lag sampled under older weights is not checked). Inert where the
    engine returned no log-probs."""

    SUMS = ("tokens", "abs", "k3", "out", "seqs", "seq_gmean", "w_changed", "w_zeroed", "w_sum", "seq_changed", "seq_zeroed")

    def __init__(self, rollout, mask: torch.Tensor, mode: str = "none", cap: float = 0.0, max_diff: float = 0.0):
        self.mode, self.cap, self.max_diff, self.checked = mode, cap, max_diff, False
        self.lag = rollout.lag  # --async-lag: the batch's weights are this many updates older than the trainer's
        if mode == "bypass" and not rollout.has_engine_logps:
            raise RunError("--rollout-is bypass takes the ratio against the engine's log-probs: it returned none")
        self.engine = None  # (B, T) engine log-probs of the rows this process holds, like the mask
        if rollout.has_engine_logps:  # row-major boolean indexing visits each row's tokens in packed order
            held = torch.zeros(mask.shape[0], dtype=torch.bool)
            held[rollout.rows] = True
            tooled = getattr(rollout, "tool_turns", None) is not None  # --tools: mu of their tokens too
            every = torch.arange(mask.shape[1]) < rollout.completion_lengths[:, None] if tooled else mask.bool()  # (B, T)
            self.engine = torch.zeros_like(mask)
            self.engine[every & held.unsqueeze(1)] = rollout.engine_logps_flat().to(mask.dtype)
        self.sums = dict.fromkeys(self.SUMS, 0.0)
        self.tool_metrics = tools.rollout_metrics(rollout) if getattr(rollout, "tool_turns", None) else {}  # tools/
        self.abs_max, self.seq_min, self.seq_max = 0.0, math.inf, -math.inf

    @property
    def available(self) -> bool:  # the engine returned log-probs
        return self.engine is not None

    def log_rho(self, rows, old: torch.Tensor) -> torch.Tensor | None:
        """(b, T_m) log rho = old - engine log-prob of `rows`, None without engine log-probs."""
        return None if self.engine is None else old.detach() - self.engine[rows, : old.shape[1]].to(old.device)

    def ratio_reference(self, rows, old: torch.Tensor) -> torch.Tensor:
        """(b, T_m) the log-probs the method's ratio is taken against: `old` (pi_old), or with --rollout-is bypass
        the engine's mu of `rows` (TRL's async GRPO, PipelineRL: pi_theta / mu, clipped around mu; no weights)."""
        if self.mode != "bypass":
            return old
        return self.engine[rows, : old.shape[1]].to(device=old.device, dtype=old.dtype)

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
        --max-engine-logp-diff, or is NaN (the engine kept old weights: a push that did not land). Later calls do
        nothing. (The engines themselves stop at logits or log-probs that are not finite: NonFiniteError.)"""
        if self.checked or self.engine is None or self.max_diff <= 0 or self.lag > 0:
            return
        self.checked = True
        seen = world().sum({"abs": self.sums["abs"], "tokens": self.sums["tokens"]})  # torchrun: every rank's tokens
        mean = seen["abs"] / max(seen["tokens"], 1.0)
        if not mean <= self.max_diff:  # NaN fails too
            error = RunError(
                f"the rollout engine is not sampling from the trainer's weights: mean |engine - trainer "
                f"log-prob| {mean:.3g} nats > --max-engine-logp-diff {self.max_diff:g} at step {step} "
                "(a weight push that did not land?)"
            )
            error.on_every_rank = True
            raise error

    def metrics(self) -> dict:
        if self.engine is None or not bool(world().max(float(self.sums["tokens"] > 0))):
            return dict(self.tool_metrics)
        s = world().sum(self.sums)
        n, seqs = max(s["tokens"], 1.0), max(s["seqs"], 1.0)
        out = self.tool_metrics | {
            "mismatch/abs_log_rho_mean": s["abs"] / n,
            "mismatch/abs_log_rho_max": world().max(self.abs_max),
            "mismatch/kl_k3": s["k3"] / n,
            "mismatch/rho_out_frac": s["out"] / n,
            "mismatch/seq_rho_gmean_min": -world().max(-self.seq_min),
            "mismatch/seq_rho_gmean_mean": s["seq_gmean"] / seqs,
            "mismatch/seq_rho_gmean_max": world().max(self.seq_max),
        }
        if self.mode not in ("none", "bypass"):
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
      icepop     w_t = rho_t if 0.5 <= rho_t <= 5, else 0
    bypass: None too (no weights; RolloutCorrection.ratio_reference puts mu in pi_old's place)."""
    if mode in ("none", "bypass"):
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


FINITE_NAMES = dict(logp="the trainer's log-probs", old="the old log-probs (pi_old)", loss="the policy loss")
FINITE_NAMES["ref"] = "the reference model's log-probs"


def check_finite(step: int, update: int, mask: torch.Tensor, **values: torch.Tensor | None) -> None:
    """RunError on every rank naming the first of `values` (FINITE_NAMES) with a NaN or inf where `mask` (b, T) is set
    (the loss: anywhere), so a broken number never reaches a gradient (torchrun: the ranks agree by one MAX)."""
    names = list(values)
    bad = [
        n for n, v in values.items() if v is not None and not torch.isfinite(v.detach()[mask.bool()] if v.dim() else v).all()
    ]
    first = int(world().max(float(names.index(bad[0]) + 1) if bad else 0.0))
    if first:
        error = RunError(
            f"non-finite values (NaN or inf) in {FINITE_NAMES[names[first - 1]]} at step {step} (update {update}); lower "
            "--learning-rate, or check the model (--dtype fp16 overflowing?) and the data; the last checkpoint is intact"
        )
        error.on_every_rank = True
        raise error


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
    """metrics.jsonl, one flat row per optimizer update or evaluation, and the writers outputs.open_run_logger
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


SIGNAL_SAID: set[str] = set()  # the causes learning_signal has said in this run (once each)
SIGNAL_ADVICE = {
    "signal/all_truncated": "every completion was cut at --max-new-tokens, none ends with an answer: raise --max-new-tokens",
    "signal/equal_rewards": "every group's rewards were equal, so every advantage is 0: the task is too hard or too easy "
    "for the model; pick another, or raise --num-generations",
    "signal/zero_update": "the policy loss and the gradient were exactly 0 at every update: the model did not move",
}


def learning_signal(step: int, rollout_metrics: dict, update_metrics: list[dict], rewards_matter: bool = True) -> dict:
    """signal/<cause> 1.0 where a cause of SIGNAL_ADVICE held at this step (equal rewards: only where `rewards_matter`);
    the first step each holds, one console line says which and what to change."""
    m = rollout_metrics
    held = [
        m.get("rollout/truncated_frac", 0.0) >= 1.0,
        rewards_matter and m.get("rollout/zero_adv_group_frac", 0.0) >= 1.0,
        all(u.get("losses/policy_loss") == u.get("losses/grad_norm") == 0.0 for u in update_metrics),
    ]
    for key in [k for k, h in zip(SIGNAL_ADVICE, held) if h and k not in SIGNAL_SAID]:
        SIGNAL_SAID.add(key)
        CONSOLE.warning(f"warning: step {step} cannot learn: {SIGNAL_ADVICE[key]} ({key} in metrics.jsonl)")
    return {k: float(h) for k, h in zip(SIGNAL_ADVICE, held)}


def console_line(step: int, total: int, row: dict, keys: Sequence[str]) -> str:
    """`step s/total | key value | ...` of the keys present in `row`, each without its namespace."""
    shown = [(k.split("/", 1)[-1], row[k]) for k in keys if row.get(k) is not None]
    return " | ".join(
        [f"step {step}/{total}", *(f"{name} {v:.4g}" if isinstance(v, float) else f"{name} {v}" for name, v in shown)]
    )


# ==============================================================================================
# The step's options, each off by default
# ==============================================================================================


# ----- DAPO's options (arXiv:2503.14476): dynamic sampling, the overlong penalty, rows out of the loss. A step
# calls them between its rewards and its advantages.


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


# ----- torchrun's view of a rollout: each rank holds the rows of its own prompt groups (run.py starts the
# processes; docs/distributed.md)


class ShardedRollout:
    """One rank's share of a rollout batch of B = P*n rows (several processes). It holds the tokens, texts and
    engine log-probs of the rows of its own prompt groups only, addressed by their GLOBAL row index (row r
    belongs to group r // n), and, for every row, the prompt and completion lengths and finish reasons (gathered
    per-row scalars; token ids are never gathered).

    Reads like a RolloutBatch: `prompt(r)`, `completion(r)`, `engine_logp(r)` for r in `rows` (another rank's row
    raises), `prompt_lengths` / `completion_lengths` of all B rows, `texts` and `engine_logps_flat()` of this
    rank's rows in `rows` order, `finish_reasons` of all B rows."""

    version, lag = None, 0  # the step's own weights (--async-lag runs in one process)

    def __init__(self, local: RolloutBatch, groups: Sequence[int], num_groups: int, n: int):
        w = world()
        self.rows = [g * n + j for g in groups for j in range(n)]  # this rank's global rows, ascending
        B = num_groups * n
        if len(local) != len(self.rows):
            raise RunError(
                f"rank {w.rank}: the engine returned {len(local)} rows for {len(self.rows)} ({len(groups)} groups x {n})"
            )
        mine = (self.rows, local.prompt_lengths.tolist(), local.completion_lengths.tolist(), list(local.finish_reasons))
        mine += (getattr(local, "tool_turns", None),)  # --tools: every row's calls (the masks of all rows need their spans)
        prompt_len, completion_len = torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64)
        self.finish_reasons: list[str] = [""] * B
        self.tool_turns = [[] for _ in range(B)] if local.tool_turns is not None else None
        groups_seen = set()
        for rows, p_len, c_len, reasons, turns in w.gather_objects(mine):
            prompt_len[rows], completion_len[rows] = torch.tensor(p_len), torch.tensor(c_len)
            for r, reason, row_turns in zip(rows, reasons, turns or [None] * len(rows)):
                self.finish_reasons[r] = reason
                if self.tool_turns is not None:
                    self.tool_turns[r] = row_turns
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
