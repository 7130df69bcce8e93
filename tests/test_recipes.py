"""Every recipe in recipes/ parses with its script's Args (the flags exist, their values pass the checks, the
cross-flag rules hold) and says in its header what it should reach, where that comes from, how it is scored and
evaluated, and that it was not run here."""

from __future__ import annotations

import glob
import importlib
import os

import pytest

import infra

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")))


def test_there_is_a_recipe_for_each_method():
    scripts = {os.path.basename(p).split("_")[0] for p in RECIPES}
    assert scripts == {"grpo", "gapo", "mugrpo", "codapo"}, scripts


@pytest.mark.parametrize("path", RECIPES, ids=[os.path.basename(p) for p in RECIPES])
def test_recipe_parses_with_its_script(path):
    script = os.path.basename(path).split("_")[0]
    mod = importlib.import_module(script)
    values = infra.load_config(path, mod.Args)
    args = mod.Args(**values)  # every value check of the flags (a bad value raises UserError)
    assert infra._check_cross(args) is None, infra._check_cross(args)
    assert args.model != infra.EMBEDDED_MODEL  # a paper-scale model, not the CPU default
    with open(path) as f:
        header = "".join(line for line in f if line.startswith("#"))
    for needle in ("Published", "Verifier", "valuation", "Not run here"):
        assert needle in header, f"{os.path.basename(path)}: the header does not say {needle!r}"


def test_recipes_are_listed_in_their_readme():
    with open(os.path.join(ROOT, "recipes", "README.md")) as f:
        text = f.read()
    for path in RECIPES:
        assert os.path.basename(path) in text, path
