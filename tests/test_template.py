"""The template rule: outside the `# ALGO LOGIC` blocks, the method-specific Args block and the module
docstring, grpo.py, gapo.py, mugrpo.py and codapo.py are identical line for line.

Stripped before comparing:
- the module docstring;
- the Args lines from `# <METHOD> specific arguments` to the end of the dataclass;
- every block that starts with a line `# ALGO LOGIC...` (any indentation) and runs up to the next
  `# TRY NOT TO MODIFY...` line, `def main(` or `if __name__` (whichever comes first);
- single lines that end with the comment `# ALGO LOGIC` (a changed loop line): they may add to grpo.py's lines or
  replace some of them (a method replaces a shared line instead of keeping it dead), never drop one unreplaced.
"""

import ast
import difflib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = [m for m in ("grpo", "gapo", "mugrpo", "codapo", "opd") if os.path.exists(os.path.join(ROOT, f"{m}.py"))]
BLOCK_START = re.compile(r"^\s*# ALGO LOGIC")
BLOCK_END = re.compile(r"^(\s*# TRY NOT TO MODIFY|def main\(|if __name__)")
INLINE = re.compile(r"#\s*ALGO LOGIC\s*$")
SPECIFIC_ARGS = re.compile(r"^\s+# \S+ specific arguments")


def template_lines(path: str, keep_inline: bool = False) -> list[str]:
    with open(path) as f:
        source = f.read()
    doc_end = ast.parse(source).body[0].end_lineno  # the module docstring
    lines = source.splitlines()[doc_end:]
    out, in_block, in_args = [], False, False
    for line in lines:
        if in_args:
            if line.strip() and not line.startswith(" "):
                in_args = False
            else:
                continue
        if SPECIFIC_ARGS.match(line):
            in_args = True
            continue
        if BLOCK_START.match(line):
            in_block = True
            continue
        if in_block:
            if BLOCK_END.match(line):
                in_block = False
            else:
                continue
        if INLINE.search(line) and not keep_inline:
            continue
        out.append(line)
    return out


def test_stripping_rules_on_a_sample(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text(
        '"""doc"""\nimport a\n\nclass Args:\n    x: int = 1\n    # X specific arguments\n    y: int = 2\n\n'
        "# ALGO LOGIC: f\ndef f():\n    return 1\n\n\ndef main(args):\n    a = 1\n    # ALGO LOGIC: adv\n"
        "    b = 2\n    # TRY NOT TO MODIFY: rest\n    c = 3  # ALGO LOGIC\n    d = 4\n"
    )
    # blank lines inside a stripped block go with it
    assert template_lines(str(sample)) == [
        "import a",
        "",
        "class Args:",
        "    x: int = 1",
        "def main(args):",
        "    a = 1",
        "    # TRY NOT TO MODIFY: rest",
        "    d = 4",
    ]


def template_drift(base: list[str], other: list[str]) -> list[str]:
    """The differences of `other` (its inline `# ALGO LOGIC` lines kept) against `base` that the template does not
    allow: every line `other` adds or puts in place of base lines must end in `# ALGO LOGIC`; no base line may
    be dropped without a replacement."""
    problems = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, base, other, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        new = other[j1:j2]
        if tag == "delete" or not new:
            problems += [f"grpo.py line dropped: {line}" for line in base[i1:i2]]
        problems += [f"untagged line: {line}" for line in new if not INLINE.search(line)]
    return problems


def test_replaced_lines_must_all_be_tagged():
    base = ["a = 1", "b = 2", "c = 3"]
    assert template_drift(base, ["a = 1", "b = 5  # ALGO LOGIC", "c = 3"]) == []  # replaced
    assert template_drift(base, ["a = 1", "b = 2", "x = 0  # ALGO LOGIC", "c = 3"]) == []  # added
    assert template_drift(base, ["a = 1", "c = 3"]) == ["grpo.py line dropped: b = 2"]  # dropped, no replacement
    assert template_drift(base, ["a = 1", "b = 5", "c = 3"]) == ["untagged line: b = 5"]  # changed, not tagged
    assert template_drift(base, ["a = 1", "b = 5  # ALGO LOGIC", "d = 4", "c = 3"]) == ["untagged line: d = 4"]


@pytest.mark.parametrize("method", [m for m in METHODS if m != "grpo"])
def test_method_script_matches_grpo_outside_algo_logic(method):
    base = template_lines(os.path.join(ROOT, "grpo.py"))
    other = template_lines(os.path.join(ROOT, f"{method}.py"), keep_inline=True)
    diff = "\n".join(difflib.unified_diff(base, other, "grpo.py", f"{method}.py", lineterm="", n=1))
    assert template_drift(base, other) == [], f"{method}.py drifted from grpo.py outside ALGO LOGIC:\n{diff}"


@pytest.mark.parametrize("method", METHODS)
def test_template_sections_present_in_order(method):
    with open(os.path.join(ROOT, f"{method}.py")) as f:
        text = f.read()
    markers = [
        "class Args(run.Args):",
        "# ALGO LOGIC: advantages",
        "def compute_advantages(",
        "# ALGO LOGIC: policy loss",
        "def compute_policy_loss(",
        "def main(args",
        "# TRY NOT TO MODIFY: run dir",
        "# TRY NOT TO MODIFY: rollout",
        "# TRY NOT TO MODIFY: rewards",
        "# TRY NOT TO MODIFY: metrics, eval, checkpoint",
        'if __name__ == "__main__":',
    ]
    positions = [text.find(m) for m in markers]
    assert all(p >= 0 for p in positions), [m for m, p in zip(markers, positions) if p < 0]
    assert positions == sorted(positions)


@pytest.mark.parametrize("method", METHODS)
def test_importing_a_method_script_is_cheap(method):
    import subprocess
    import sys

    code = f"import sys; sys.path.insert(0, {ROOT!r}); import {method}; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
