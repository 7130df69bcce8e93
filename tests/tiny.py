"""A tiny chat model and tokenizer built offline for the tests (no download)."""

from __future__ import annotations

import json

import torch

CHARS = list("0123456789+-*= ?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,\n")
SPECIALS = ["<pad>", "<|im_end|>", "<|im_start|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS + ["<unk>"])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_tiny_model(path: str, seed: int = 0, hidden: int = 32, layers: int = 2) -> str:
    """Save a randomly initialised 2-layer Llama with the char tokenizer to `path`; returns path."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def prompts(rollout) -> list[list[int]]:
    """Every row's prompt token ids of a RolloutBatch, as plain lists."""
    return [rollout.prompt(r) for r in range(len(rollout))]


def completions(rollout) -> list[list[int]]:
    """Every row's completion token ids of a RolloutBatch, as plain lists."""
    return [rollout.completion(r) for r in range(len(rollout))]


def engine_logps(rollout) -> list[list[float]]:
    """Every row's engine log-probs of a RolloutBatch, as plain lists."""
    return [rollout.engine_logp(r) for r in range(len(rollout))]
