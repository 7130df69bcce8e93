"""A tiny chat model and tokenizer built offline for the tests (no download), the toy task the script tests train
on, and the flags of a tiny run."""

from __future__ import annotations

import json
import pathlib

import torch

CHARS = list("0123456789+-*= ?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,\n")
SPECIALS = ["<pad>", "<|im_end|>", "<|im_start|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(chars: list[str] | None = None):
    """The char tokenizer of the tiny model (`chars`: its characters in another order, a tokenizer of other ids)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + (chars or CHARS) + ["<unk>"])}
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


def make_tiny_model(path: str, seed: int = 0, hidden: int = 32, layers: int = 2, init_range: float = 0.02) -> str:
    """Save a randomly initialised 2-layer Llama with the char tokenizer to `path`; returns path. `init_range`: the std
    of its initial weights (transformers' default 0.02 makes the tied embeddings so small that every logit is near 0:
    only a change of the embeddings themselves moves the output far)."""
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
        initializer_range=init_range,
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


TOY_WORDS = "abcdefghijklmnop"
# a tiny run of a script on the toy task: every script test starts from these and overrides what it tests
TINY_RUN = {
    "reward": "arith",
    "total_steps": 2,
    "prompts_per_step": 4,
    "num_generations": 8,
    "max_new_tokens": 3,
    "learning_rate": 3e-3,
    "warmup_updates": 1,
    "eval_limit": 2,
    "eval_samples": 2,
    "eval_k": [2],
}


def toy_task(folder, rows: list[dict] | None = None, init_range: float = 0.02) -> dict:
    """The tiny model and the toy task in `folder`: by default 16 questions 'Say two <letter>' with answer '2', which
    the random model says now and then by chance. {"model": its folder, "data": the .jsonl, "dir": `folder`}."""
    folder = pathlib.Path(folder)
    rows = rows if rows is not None else [{"question": f"Say two {w}", "answer": "2"} for w in TOY_WORDS]
    model = make_tiny_model(str(folder / "model"), init_range=init_range)
    return {"model": model, "data": write_jsonl(str(folder / "toy.jsonl"), rows), "dir": folder}


def run_settings(toy: dict, out, run_name: str, **overrides) -> dict:
    """The Args fields of a tiny run on `toy` (TINY_RUN), its output in out/run_name, then `overrides`."""
    return {
        "model": toy["model"],
        "dataset": toy["data"],
        **TINY_RUN,
        "output_dir": str(out),
        "run_name": run_name,
        **overrides,
    }


def as_flags(settings: dict) -> list[str]:
    """Args fields as command-line flags: `--flag-name value` (a list: its values; True: the flag alone)."""
    flags = []
    for key, value in settings.items():
        flag = f"--{key.replace('_', '-')}"
        if isinstance(value, bool):
            flags += [flag] if value else []
        else:
            flags += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    return flags


def run_flags(toy: dict, out, run_name: str, **overrides) -> list[str]:
    """run_settings as command-line flags."""
    return as_flags(run_settings(toy, out, run_name, **overrides))


def teacher_model(toy: dict) -> str:
    """A second tiny model with the toy task's tokenizer (another seed, larger weights: its next-token distributions are
    peaked where the toy model's are near uniform): a teacher for opd.py, made once per toy."""
    path = pathlib.Path(toy["dir"]) / "teacher"
    if not (path / "config.json").exists():
        make_tiny_model(str(path), seed=1, init_range=0.5)  # a peaked teacher, far from the near-uniform student
    return str(path)
