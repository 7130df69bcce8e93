"""The docs stay true to the code and to each other: docs/flags.md is what docs/make_flags.py writes from the scripts'
Args (every flag of every script in it), every relative link of README.md and docs/*.md reaches a file (and a heading,
where it names one), and README.md stays a short front door."""

import ast
import dataclasses
import glob
import importlib
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = [s for s in ("grpo", "gapo", "mugrpo", "codapo", "opd") if os.path.exists(os.path.join(ROOT, f"{s}.py"))]
README_MAX_LINES = 220
PAGES = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)


@pytest.fixture(scope="module")
def make_flags():
    spec = importlib.util.spec_from_file_location("make_flags", os.path.join(ROOT, "docs", "make_flags.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def flags_page():
    with open(os.path.join(ROOT, "docs", "flags.md")) as f:
        return f.read()


def test_flags_page_is_what_the_generator_writes(make_flags, flags_page):
    assert flags_page == make_flags.render(), "docs/flags.md is stale: run python docs/make_flags.py"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_of_every_script_is_on_the_flags_page(script, flags_page):
    names = [f.name for f in dataclasses.fields(importlib.import_module(script).Args)]
    missing = [n for n in names if f"`--{n.replace('_', '-')}`" not in flags_page]
    assert not missing, f"docs/flags.md lacks {script}.py's {missing}: run python docs/make_flags.py"


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code (a link shown as code is not a link)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markdown marks and punctuation dropped (but - and _), lower case, spaces -> -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").lower())
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    with open(path) as f:
        text = FENCE.sub("", f.read())
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.MULTILINE):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: str) -> list[str]:
    with open(path) as f:
        return LINK.findall(prose(f.read()))


def test_the_link_pattern_on_a_sample():
    sample = 'see [a](docs/a.md), ![p](p.png "t")\n```\n[c](no.md)\n```\n`[d](no.md)` [e](#x) [f [g]](h.md)'
    assert LINK.findall(prose(sample)) == ["docs/a.md", "p.png", "#x", "h.md"]
    assert slug("GPU memory (`bench/memory_plan.py`)") == "gpu-memory-benchmemory_planpy"
    assert slug("Datasets `--dataset` knows by name") == "datasets---dataset-knows-by-name"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_reach_a_file(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(resolved):
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.endswith(".md") and anchor.lower() not in anchors(resolved):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{os.path.relpath(page, ROOT)}: broken links {broken}"


def module_names(module: str) -> set[str] | None:
    """The top-level names a project module defines (read with ast, nothing imported); None: no such module."""
    path = os.path.join(ROOT, f"{module}.py")
    if not os.path.exists(path):
        path = os.path.join(ROOT, module, "__init__.py")
        if not os.path.exists(path):
            return None
    with open(path) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_code_names_of_project_modules_exist(page):
    """`common.completion_logps`, `models.make_engine`, ... in code spans name something their module defines, so a
    rename in the code shows up here. Placeholders (`common.X`) and file names (`run.py`) are not names."""
    with open(page) as f:
        spans = re.findall(r"`([^`\n]+)`", FENCE.sub("", f.read()))
    wrong = set()
    for span in spans:
        for module, name in re.findall(r"(?<![\w./])([a-z_]+)\.([A-Za-z_]\w*)", span):
            if name in ("py", "md", "jsonl", "json", "yaml", "png", "sh") or re.fullmatch(r"[A-Z]", name):
                continue
            names = module_names(module)
            submodule = os.path.exists(os.path.join(ROOT, module, f"{name}.py"))  # sandbox.harness, tests.tiny
            if names is not None and name not in names and not submodule:
                wrong.add(f"{module}.{name}")
    assert not wrong, f"{os.path.relpath(page, ROOT)} names {sorted(wrong)}, which the code does not define"


def test_readme_is_short():
    with open(os.path.join(ROOT, "README.md")) as f:
        n = len(f.read().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines, at most {README_MAX_LINES}: move the detail to a docs page"
