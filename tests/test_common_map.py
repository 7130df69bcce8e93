"""common.py keeps the promise of its map: every `common.X` a script uses is named in the map, and everything a
default CPU step of each script reaches lies above the ruler, in one stretch: no function or class between the first
and the last it reaches is one it does not reach, and the definitions it reaches hold at most STEP_LINES_MAX lines.

The reach is computed from the source with `ast` (`python tests/test_common_map.py` prints it):
- the step is the body of main's `for step in ...` loop, taken at a middle step (step 2 of the default run: no
  evaluation, no checkpoint, no rollout dump) with the script's default flags (`Args()`), one process, no GPU;
- an `if` / conditional expression whose test is decided by those facts follows one branch only (a branch that
  returns or raises ends the path); every other branch is followed;
- a reached definition of common.py (function, class, constant) reaches the top-level names its body reads; a
  reached class is read whole (every method) with its bases; a reached script function reaches what it reads;
- the step's objects made before the loop (engine, sampler, logger, ...) reach their classes: `v = common.C(...)`
  is a C; `v = common.f(...)` is what f returns on the decided path (a class constructed in a return, or the
  class named by its return annotation).
Facts of a default CPU step: `world().enabled` (and a name bound to it) is False, `env_world_size()` is 1,
`torch.cuda.is_available()` is False, `step` is 2.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("grpo", "gapo", "mugrpo", "codapo")
STEP_LINES_MAX = 800  # lines of common.py's definitions a reader of one default CPU step reads
MIDDLE_STEP = 2
UNKNOWN = object()


class Facts:
    """Values known at a default CPU step: the world of one process."""

    enabled = False
    is_main = True
    world_size = 1
    rank = 0


def _source(name: str) -> tuple[str, ast.Module]:
    with open(os.path.join(ROOT, f"{name}.py")) as f:
        text = f.read()
    return text, ast.parse(text)


def _truthy(v):
    return UNKNOWN if v is UNKNOWN else bool(v)


class Evaluator:
    """Partial evaluation of the expressions that decide branches: constants, the script's args, the facts."""

    def __init__(self, env: dict):
        self.env = env

    def __call__(self, node):  # noqa: C901 - one case per node type
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return self.env.get(node.id, UNKNOWN)
        if isinstance(node, ast.Attribute):
            base = self(node.value)
            if base is UNKNOWN:
                return UNKNOWN
            return getattr(base, node.attr, UNKNOWN)
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in ("world", "env_world_size"):
                return Facts if f.id == "world" else 1
            if isinstance(f, ast.Attribute) and f.attr == "world" and isinstance(f.value, ast.Name) and f.value.id == "common":
                return Facts
            if ast.unparse(f) == "torch.cuda.is_available":
                return False
            return UNKNOWN
        if isinstance(node, ast.BoolOp):
            values = [self(v) for v in node.values]
            if isinstance(node.op, ast.And):
                for v in values:
                    if v is not UNKNOWN and not v:
                        return v  # a known falsy operand decides `and`
                return UNKNOWN if any(v is UNKNOWN for v in values) else values[-1]
            for v in values:
                if v is not UNKNOWN and v:
                    return v  # a known truthy operand decides `or`
            return UNKNOWN if any(v is UNKNOWN for v in values) else values[-1]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            v = self(node.operand)
            return UNKNOWN if v is UNKNOWN else not v
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            a, b = self(node.left), self(node.comparators[0])
            if a is UNKNOWN or b is UNKNOWN:
                return UNKNOWN
            ops = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Is: "is"}
            ops |= {ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in"}
            op = ops.get(type(node.ops[0]))
            try:
                return eval(f"a {op} b", {}, {"a": a, "b": b}) if op else UNKNOWN
            except Exception:
                return UNKNOWN
        if isinstance(node, ast.BinOp):
            a, b = self(node.left), self(node.right)
            if a is UNKNOWN or b is UNKNOWN:
                return UNKNOWN
            try:
                return eval(f"a {_BINOPS[type(node.op)]} b", {}, {"a": a, "b": b})
            except Exception:
                return UNKNOWN
        if isinstance(node, ast.IfExp):
            t = _truthy(self(node.test))
            if t is UNKNOWN:
                return UNKNOWN
            return self(node.body if t else node.orelse)
        return UNKNOWN


_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Mod: "%", ast.FloorDiv: "//", ast.Div: "/"}


class Walker:
    """The names a statement list reads on the paths the facts leave open."""

    def __init__(self, env: dict):
        self.env = dict(env)
        self.evaluate = Evaluator(self.env)
        self.names: set[str] = set()  # Name loads
        self.common_attrs: set[str] = set()  # common.X
        self.returns: list[ast.expr] = []
        self.assigned: dict[str, ast.expr] = {}

    def expr(self, node) -> None:
        if node is None:
            return
        if isinstance(node, ast.IfExp):
            t = _truthy(self.evaluate(node.test))
            self.expr(node.test)
            if t is not False:
                self.expr(node.body)
            if t is not True:
                self.expr(node.orelse)
            return
        if isinstance(node, ast.BoolOp):  # `a and b`: b is not evaluated where a is known falsy
            for v in node.values:
                self.expr(v)
                t = _truthy(self.evaluate(v))
                if (isinstance(node.op, ast.And) and t is False) or (isinstance(node.op, ast.Or) and t is True):
                    return
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            self.names.add(node.id)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "common":
            self.common_attrs.add(node.attr)
        for child in ast.iter_child_nodes(node):
            self.expr(child)

    def stmts(self, body) -> bool:
        """Walk `body`; True when every path through it returns or raises."""
        for s in body:
            if self.stmt(s):
                return True
        return False

    def stmt(self, s) -> bool:
        if isinstance(s, ast.If):
            t = _truthy(self.evaluate(s.test))
            self.expr(s.test)
            if t is True:
                return self.stmts(s.body)
            if t is False:
                return self.stmts(s.orelse)
            ends = self.stmts(s.body)
            return self.stmts(s.orelse) and ends
        if isinstance(s, (ast.Return, ast.Raise)):
            if isinstance(s, ast.Return) and s.value is not None:
                self.returns.append(s.value)
            for child in ast.iter_child_nodes(s):
                self.expr(child)
            return True
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return False  # a nested definition: reached when it is called (see reach_of_script)
        if isinstance(s, ast.Assign):
            self.expr(s.value)
            for t in s.targets:
                self.expr(t)
                if isinstance(t, ast.Name):
                    self.env[t.id] = self.evaluate(s.value)
                    self.assigned[t.id] = s.value
                elif isinstance(t, ast.Tuple) and isinstance(s.value, ast.Tuple):
                    for n, v in zip(t.elts, s.value.elts):
                        if isinstance(n, ast.Name):
                            self.env[n.id] = self.evaluate(v)
                            self.assigned[n.id] = v
            return False
        ends = False
        for name, value in ast.iter_fields(s):
            if name in ("body", "orelse", "finalbody"):
                body_ends = self.stmts(value)
                ends = ends or (name == "body" and body_ends and isinstance(s, ast.With))  # a loop may not run
            elif name == "handlers":
                for h in value:
                    self.expr(h.type)
                    self.stmts(h.body)
            elif isinstance(value, list):
                for v in value:
                    if isinstance(v, ast.AST):
                        self.expr(v)
            elif isinstance(value, ast.AST):
                self.expr(value)
        return ends


class Module:
    """The top-level definitions of common.py: name -> (node, first line, last line)."""

    def __init__(self, name: str = "common"):
        self.text, self.tree = _source(name)
        self.lines = self.text.splitlines()
        self.defs: dict[str, tuple[ast.AST, int, int]] = {}
        for node in self.tree.body:
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                self.defs[node.name] = (node, first, node.end_lineno)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:  # names bound here (an attribute set on a name, X.y = ..., binds nothing)
                    for n in t.elts if isinstance(t, ast.Tuple) else [t]:
                        if isinstance(n, ast.Name):
                            self.defs[n.id] = (node, first, node.end_lineno)
        self.ruler = next(i for i, line in enumerate(self.lines, 1) if line.startswith("# Part B"))

    def names_read(self, name: str, env: dict | None = None) -> set[str]:
        node = self.defs[name][0]
        if isinstance(node, ast.ClassDef):
            w = Walker({"self": Facts} if name == "World" else {})
            for base in node.bases:
                w.expr(base)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    w2 = Walker({"self": Facts} if name == "World" else {})
                    for d in item.args.defaults + item.args.kw_defaults:
                        w2.expr(d)
                    w2.stmts(item.body)
                    w.names |= w2.names
                else:
                    w.stmts([item])
            return w.names & self.defs.keys()
        w = Walker(env or {})
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.args.defaults + node.args.kw_defaults:
                w.expr(d)
            w.stmts(node.body)
        else:
            w.expr(node.value)
        return w.names & self.defs.keys()

    def returned_classes(self, name: str, call: ast.Call | None = None, env: dict | None = None, depth: int = 0) -> set[str]:
        """The classes of common.py that function `name` returns on the decided path (called as `call` in `env`)."""
        node = self.defs[name][0]
        if isinstance(node, ast.ClassDef):
            return {name}
        if not isinstance(node, ast.FunctionDef) or depth > 4:
            return set()
        bound = {}
        if call is not None:  # the call's arguments, as far as they are known, bound to the parameters
            evaluate = Evaluator(env or {})
            params = [a.arg for a in node.args.posonlyargs + node.args.args]
            bound |= {p: evaluate(a) for p, a in zip(params, call.args)}
            bound |= {k.arg: evaluate(k.value) for k in call.keywords if k.arg}
        w = Walker(bound)
        w.stmts(node.body)
        out: set[str] = set()

        def classify(value) -> set[str]:
            if isinstance(value, ast.Tuple):
                return classify(value.elts[0]) if value.elts else set()
            if isinstance(value, ast.Call):
                f = value.func
                head = f.value if isinstance(f, ast.Attribute) else f
                if isinstance(head, ast.Name) and head.id in self.defs:
                    if isinstance(self.defs[head.id][0], ast.ClassDef):
                        return {head.id}
                    if head is f:
                        return self.returned_classes(head.id, value, w.env, depth + 1)
            if isinstance(value, ast.Name):
                if value.id in w.assigned:
                    return classify(w.assigned[value.id])
                if value.id in self.defs and isinstance(self.defs[value.id][0], ast.Assign):
                    return classify(self.defs[value.id][0].value)
            return set()

        for value in w.returns:
            out |= classify(value)
        if not out and node.returns is not None:
            out = {n.id for n in ast.walk(node.returns) if isinstance(n, ast.Name) and n.id in self.defs}
        return {c for c in out if isinstance(self.defs[c][0], ast.ClassDef)}


def _args_env(script: str) -> dict:
    sys.path.insert(0, ROOT)
    try:
        mod = importlib.import_module(script)
    finally:
        sys.path.remove(ROOT)
    return {"args": mod.Args(), "step": MIDDLE_STEP, "world": Facts}


def reach_of_script(script: str, common: Module | None = None) -> set[str]:
    """The definitions of common.py a default CPU step of `script` reaches."""
    common = common or Module("common")
    _, tree = _source(script)
    script_defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    main = script_defs["main"]
    loop = next(n for n in main.body if isinstance(n, ast.For) and ast.unparse(n.target) == "step")
    nested = {n.name: n for n in ast.walk(main) if isinstance(n, ast.FunctionDef) and n is not main}
    env = _args_env(script)
    # the step's objects made before the loop, and the classes they are
    setup = Walker(env)
    setup.stmts(main.body[: main.body.index(loop)])
    objects: dict[str, set[str]] = {}
    for var, value in setup.assigned.items():
        calls = [n for n in ast.walk(value) if isinstance(n, ast.Call)]
        for call in calls:
            f = call.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "common":
                classes = common.returned_classes(f.attr, call, setup.env) if f.attr in common.defs else set()
                objects.setdefault(var, set()).update(classes)
            elif isinstance(f, ast.Name) and f.id in script_defs and isinstance(script_defs[f.id], ast.ClassDef):
                objects.setdefault(var, set()).add(f"script:{f.id}")
    for target in ("world",):  # `world, device = common.setup(args)`
        for node in main.body[: main.body.index(loop)]:
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple):
                names = [e.id for e in node.targets[0].elts if isinstance(e, ast.Name)]
                if target in names and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute):
                    objects[target] = common.returned_classes(node.value.func.attr)
    step = Walker(setup.env)
    step.stmts(loop.body)
    # script functions and nested functions the step calls, to a fixed point
    seen_script, todo = set(), [n for n in step.names if n in script_defs or n in nested]
    common_roots, names_read = set(step.common_attrs), set(step.names)
    while todo:
        name = todo.pop()
        if name in seen_script:
            continue
        seen_script.add(name)
        node = nested.get(name) or script_defs[name]
        w = Walker(setup.env)
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                w.expr(base)
            for item in node.body:
                w.stmts(item.body if isinstance(item, ast.FunctionDef) else [item])
        else:
            w.stmts(node.body)
        common_roots |= w.common_attrs
        names_read |= w.names
        todo += [n for n in w.names if (n in script_defs or n in nested) and n not in seen_script]
    for var in names_read:
        for cls in objects.get(var, ()):
            if cls.startswith("script:"):
                todo_cls = cls.split(":", 1)[1]
                node = script_defs[todo_cls]
                w = Walker(setup.env)
                for base in node.bases:
                    w.expr(base)
                common_roots |= w.common_attrs
            else:
                common_roots.add(cls)
    reached, todo = set(), [r for r in common_roots if r in common.defs]
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        todo += [n for n in common.names_read(name) if n not in reached]
    return reached


def stretch(common: Module, reached: set[str]) -> tuple[int, int]:
    first = min(common.defs[n][1] for n in reached)
    last = max(common.defs[n][2] for n in reached)
    return first, last


def own_lines(common: Module, reached: set[str]) -> int:
    """Lines of the reached definitions themselves (a constant block counted once), without the blank lines and
    section headers between them."""
    spans = {(common.defs[n][1], common.defs[n][2]) for n in reached}
    return sum(last - first + 1 for first, last in spans)


def map_names(common: Module) -> set[str]:
    doc = ast.get_docstring(common.tree) or ""
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", doc))


def used_common_names(script: str) -> set[str]:
    _, tree = _source(script)
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "common"}
    for node in ast.walk(tree):  # from common import x
        if isinstance(node, ast.ImportFrom) and node.module == "common":
            used |= {a.name for a in node.names}
    return used


@pytest.fixture(scope="module")
def common_module():
    return Module("common")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_common_name_a_script_uses_is_in_the_map(script, common_module):
    missing = sorted(used_common_names(script) - map_names(common_module))
    assert not missing, f"{script}.py uses common.{missing} that the map (common.py's docstring) does not name"


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_default_cpu_step_reads_in_one_stretch_above_the_ruler(script, common_module):
    reached = reach_of_script(script, common_module)
    below = sorted(n for n in reached if common_module.defs[n][1] > common_module.ruler)
    assert not below, f"a default CPU step of {script}.py reaches {below}, below the ruler (line {common_module.ruler})"
    first, last = stretch(common_module, reached)
    between = sorted(
        n
        for n, (node, start, _) in common_module.defs.items()
        if first <= start <= last and n not in reached and isinstance(node, (ast.FunctionDef, ast.ClassDef))
    )
    assert not between, f"lines {first}-{last} hold {between}, which a default CPU step of {script}.py does not reach"
    lines = own_lines(common_module, reached)
    assert lines <= STEP_LINES_MAX, f"a default CPU step of {script}.py reads {lines} lines, more than {STEP_LINES_MAX}"


def test_the_reach_follows_the_decided_branches_only():
    """A branch the facts decide is not followed (the distributed path of a one-process run), an undecided one is."""
    code = (
        "def f(x):\n    w = world()\n    if not w.enabled:\n        return A(x)\n    return B(x)\n"
        "def g(x):\n    if x:\n        return C()\n    return D() if torch.cuda.is_available() else E()\n"
    )
    w = Walker({})
    tree = ast.parse(code)
    w.stmts(tree.body[0].body)
    assert {"A"} <= w.names and "B" not in w.names
    w = Walker({})
    w.stmts(tree.body[1].body)
    assert {"C", "E"} <= w.names and "D" not in w.names


if __name__ == "__main__":
    common = Module("common")
    for script in SCRIPTS:
        reached = reach_of_script(script, common)
        first, last = stretch(common, reached)
        below = sorted(n for n in reached if common.defs[n][1] > common.ruler)
        print(
            f"{script}: {len(reached)} definitions, {own_lines(common, reached)} lines of their own, in lines "
            f"{first}-{last} ({last - first + 1} with the blank lines between them), ruler at {common.ruler}, "
            f"below it: {below or 'none'}"
        )
        if "-v" in sys.argv:
            for n in sorted(reached, key=lambda n: common.defs[n][1]):
                print(f"    {common.defs[n][1]:5d}-{common.defs[n][2]:5d} {n}")
