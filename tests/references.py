"""References the tests and benchmarks compare the product code against (not used by the scripts)."""

from __future__ import annotations

import array
from collections.abc import Callable

import torch

import common
import engines


class ReferenceHFEngine(engines.HFEngine):
    """HFEngine with transformers' `generate` as its sampler (torch's global generator, whatever the seed): the
    reference its sampling loop is tested against (the same distribution, the same log-probs of what it draws)."""

    def _sample(self, input_ids, attention, n: int, max_new_tokens: int, temperature: float, generators=None, top_p=1.0):
        """HFEngine._sample through transformers' `generate`: every row prefilled and stepped to the chunk's longest."""
        from transformers import GenerationConfig

        model, synced = self.sampler, common.world().enabled
        # generate() fills every field left None in its config from model.generation_config (a Qwen-Instruct
        # repetition_penalty, a min_p, suppress_tokens, ...): hide it for the call so nothing is merged in
        model_generation_config, model.generation_config = model.generation_config, GenerationConfig()
        try:
            gen = model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                generation_config=self.sampling_config(max_new_tokens, temperature, top_p),
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

    def sampling_config(self, max_new_tokens: int, temperature: float, top_p: float = 1.0):
        """Plain sampling from softmax(logits / temperature), the distribution completion_logps scores: no top-k,
        min-p, repetition or length penalty, suppressed or forced tokens; top-p only where asked (evaluation);
        temperature 0: greedy."""
        from transformers import GenerationConfig

        if temperature == 0:
            return GenerationConfig(
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=self.pad_id,
                eos_token_id=sorted(self.eos_ids),
                use_cache=True,
                return_dict_in_generate=True,
                output_scores=self.return_logps,
            )
        return GenerationConfig(
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=top_p,
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
    init = engines.HFEngine.__init__

    def init_without_eos(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.eos_ids = set()

    engines.HFEngine.__init__ = init_without_eos
    return lambda: setattr(engines.HFEngine, "__init__", init)


def rollout_from_rows(prompt_ids, completion_ids, texts=(), finish_reasons=(), engine_logps=None) -> common.RolloutBatch:
    """A RolloutBatch of lists of rows (tests, benchmarks); `texts` and `finish_reasons` are kept as given."""
    if len(prompt_ids) != len(completion_ids) or (engine_logps is not None and len(engine_logps) != len(prompt_ids)):
        raise ValueError(
            f"RolloutBatch: {len(prompt_ids)} prompts, {len(completion_ids)} completions, "
            f"{'no' if engine_logps is None else len(engine_logps)} log-prob rows"
        )
    batch = common.RolloutBatch(with_engine_logps=engine_logps is not None)
    for r in range(len(prompt_ids)):
        batch.append_row(prompt_ids[r], completion_ids[r], "", "", None if engine_logps is None else engine_logps[r])
    batch.texts, batch.finish_reasons = list(texts), list(finish_reasons)
    return batch


def rollout_nbytes(batch: common.RolloutBatch) -> int:
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
