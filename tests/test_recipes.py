"""Every recipe in recipes/ parses with its script's Args (the flags exist, their values pass the checks, the
cross-flag rules hold) and says in its header what it should reach, where that comes from, how it is scored and
evaluated, and that it was not run here."""

from __future__ import annotations

import glob
import importlib
import os
import re

import pytest

import models
import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")))


def test_there_is_a_recipe_for_each_method():
    scripts = {os.path.basename(p).split("_")[0] for p in RECIPES}
    assert scripts == {"grpo", "gapo", "mugrpo", "codapo"}, scripts


@pytest.mark.parametrize("path", RECIPES, ids=[os.path.basename(p) for p in RECIPES])
def test_recipe_parses_with_its_script(path):
    script = os.path.basename(path).split("_")[0]
    mod = importlib.import_module(script)
    values = run.load_config(path, mod.Args)
    args = mod.Args(**values)  # every value check of the flags (a bad value raises UserError)
    assert run._check_cross(args) is None, run._check_cross(args)
    assert args.model != models.EMBEDDED_MODEL  # a paper-scale model, not the CPU default
    with open(path) as f:
        header = "".join(line for line in f if line.startswith("#"))
    for needle in ("Published", "Verifier", "valuation", "Not run here", "Context:", "Disk:"):
        assert needle in header, f"{os.path.basename(path)}: the header does not say {needle!r}"


@pytest.mark.parametrize("path", RECIPES, ids=[os.path.basename(p) for p in RECIPES])
def test_recipe_fits_the_context_of_its_model(path):
    """The model's context is written in the header (tests have no network to read its config.json); the recipe's
    new tokens leave room for a prompt in it, or the recipe extends it with max_position_embeddings."""
    script = os.path.basename(path).split("_")[0]
    args = importlib.import_module(script).Args(**run.load_config(path, importlib.import_module(script).Args))
    with open(path) as f:
        header = "".join(line for line in f if line.startswith("#"))
    model_context = int(re.search(r"Context: \S+ has max_position_embeddings (\d+)", header).group(1))
    context = args.max_position_embeddings or model_context
    assert models.context_problem(context, args.max_new_tokens, args.max_prompt_tokens) is None
    assert context - args.max_new_tokens >= 512, "a prompt of a math problem needs a few hundred tokens"
    assert args.max_position_embeddings in (0, *([] if model_context >= 32768 else [32768]))  # verl's extension
    assert args.save_every and args.keep_last == 2, "a checkpoint of a 1.5B model is 18.5 GB: keep two at most"


def test_the_context_check_reports_both_numbers():
    assert "--max-new-tokens 8192 leaves no room" in models.context_problem(4096, 8192)
    problem = models.context_problem(4096, 3072, max_prompt_tokens=2048)
    assert "2048" in problem and "3072" in problem and "4096" in problem and "1024" in problem
    assert models.context_problem(32768, 8192) is None and models.context_problem(None, 10**9) is None


def test_recipes_are_listed_in_their_readme():
    with open(os.path.join(ROOT, "recipes", "README.md")) as f:
        text = f.read()
    for path in RECIPES:
        assert os.path.basename(path) in text, path


@pytest.mark.parametrize("path", RECIPES, ids=[os.path.basename(p) for p in RECIPES])
def test_recipe_says_the_memory_its_default_needs(path):
    """Every header states what the default needs without vLLM: one 80 GB GPU, or how many under torchrun (the line
    bench/memory_plan.py --recipe prints, so a change of the plan or the recipe shows here); a LoRA recipe states its
    own (docs/lora.md)."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import memory_plan

    with open(path) as f:
        stated = [line.rstrip("\n") for line in f if line.startswith("# Memory")]
    assert len(stated) == 1, f"{os.path.basename(path)}: no '# Memory' line in the header"
    if memory_plan.recipe_fit(path) is None:  # LoRA: not planned by memory_plan
        assert "GB" in stated[0], stated
        return
    assert stated[0] == memory_plan.recipe_memory_line(path), f"update the header: {memory_plan.recipe_memory_line(path)}"
    assert memory_plan.recipe_fit(path)["gpus"] is not None, "the recipe fits no node of 8 GPUs of 80 GB"
