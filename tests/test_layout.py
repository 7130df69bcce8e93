"""The shared layer keeps its shape: imports go one way, a default CPU step stays inside common.py and engines.py,
common.py holds nothing a run reaches only at its start or end, the maps name what the scripts use, no product
file is over 1,600 lines or uses another file's `_private` names, and a script passes no flag through to the run's
rooms (each room reads its own flags from `args`).

- Imports go down only: scripts -> outputs -> run -> models -> engines -> common -> tools -> verifiers -> sandbox (any
  `import` or `from ... import` anywhere in a file, functions included).
- The reach of a step is computed from the source with `ast` (`python tests/test_layout.py` prints it):
  * the step is the body of main's `for step in ...` loop, taken at a middle step (step 2 of the default run: no
    evaluation, no checkpoint, no rollout dump) with the script's default flags (`Args()`), one process, no GPU;
  * an `if` / conditional expression whose test is decided by those facts follows one branch only (a branch that
    returns or raises ends the path); every other branch is followed;
  * a reached definition (function, class, constant) of common.py, engines.py or a room (run.py, models.py,
    outputs.py) reaches the top-level names its body reads in its own file and the `common.X` / `models.X` / ... it
    names; a reached class is
    read whole (every method) with its bases; a reached script function reaches what it reads;
  * the step's objects made before the loop (engine, sampler, logger, ...) reach their classes: `v = mod.C(...)` is
    a C; `v = mod.f(...)` is what f returns on the decided path (a class constructed in a return, or the class
    named by its return annotation), across the files; `v = x if <decided> else y` is what the branch taken makes.
  Facts of a default CPU step: `world().enabled` (and a name bound to it) is False, `env_world_size()` is 1,
  `async_rollouts.start(...)` is None (--async-lag off),
  `torch.cuda.is_available()` is False, `step` is 2. The open reach knows none of them (every branch followed).
- The README's sentence on the reach states the figures this file computes.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("grpo", "gapo", "mugrpo", "codapo", "opd")
ROOMS = ("outputs", "run", "evaluation", "async_rollouts", "models")  # the run's infrastructure, in rooms by purpose
SHARED = (*ROOMS, "engines", "common")  # the files whose definitions the reach follows
LAYERS = [
    SCRIPTS,
    ("outputs",),
    ("run",),
    ("evaluation",),
    ("async_rollouts",),
    ("models",),
    ("engines",),
    ("common",),
    ("tools",),
    ("verifiers",),
    ("sandbox",),
]  # top down
PRODUCT_LINES_MAX = 1600  # no product file longer: a new capability finds its room (or gets one)
SETUP_LINES_MAX = 80  # a script's setup, from `def main` to its step loop: a short, visible list of calls
STEP_LINES_MAX = 960  # lines of common.py's and engines.py's definitions a default CPU step reads (956: --tools' masks)
MIDDLE_STEP = 2
UNKNOWN = object()


class Facts:
    """Values known at a default CPU step: the world of one process."""

    enabled = False
    is_main = True
    world_size = 1
    rank = 0


def _path(name: str) -> str:
    """A module's file: name.py, or name/__init__.py for a package (the sandbox)."""
    flat = os.path.join(ROOT, f"{name}.py")
    return flat if os.path.isfile(flat) else os.path.join(ROOT, name, "__init__.py")


def _source(name: str) -> tuple[str, ast.Module]:
    with open(_path(name)) as f:
        text = f.read()
    return text, ast.parse(text)


def _truthy(v):
    return UNKNOWN if v is UNKNOWN else bool(v)


def _module_attr(node) -> tuple[str, str] | None:
    """(module, name) of `common.X`, `engines.X` or a room's `models.X`, `run.X`, `outputs.X`."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in SHARED:
        return node.value.id, node.attr
    return None


class Evaluator:
    """Partial evaluation of the expressions that decide branches: constants, the script's args, the facts (none
    in the open reach)."""

    def __init__(self, env: dict, facts: bool = True):
        self.env, self.facts = env, facts

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
            if not self.facts:
                return UNKNOWN
            f = node.func
            if isinstance(f, ast.Name) and f.id in ("world", "env_world_size"):
                return Facts if f.id == "world" else 1
            if _module_attr(f) in (("common", "world"), ("run", "env_world_size")):
                return Facts if f.attr == "world" else 1
            if ast.unparse(f) == "torch.cuda.is_available":
                return False
            if _module_attr(f) == ("async_rollouts", "start"):  # the producer of --async-lag: None when it is off
                return None if getattr(self.env.get("args"), "async_lag", None) == "off" else UNKNOWN
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

    def __init__(self, env: dict, facts: bool = True):
        self.env, self.facts = dict(env), facts
        self.evaluate = Evaluator(self.env, facts)
        self.names: set[str] = set()  # Name loads
        self.module_attrs: set[tuple[str, str]] = set()  # (module, X) of common.X, engines.X, models.X, ...
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
        if _module_attr(node):
            self.module_attrs.add(_module_attr(node))
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


class Shared:
    """The top-level definitions of SHARED's files: (module, name) -> (node, first, last line)."""

    def __init__(self, facts: bool = True):
        self.facts = facts
        self.lines: dict[str, list[str]] = {}
        self.trees: dict[str, ast.Module] = {}
        self.defs: dict[tuple[str, str], tuple[ast.AST, int, int]] = {}
        for mod in SHARED:
            text, tree = _source(mod)
            self.lines[mod], self.trees[mod] = text.splitlines(), tree
            for node in tree.body:
                first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    self.defs[(mod, node.name)] = (node, first, node.end_lineno)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:  # names bound here (an attribute set on a name, X.y = ..., binds nothing)
                        for n in t.elts if isinstance(t, ast.Tuple) else [t]:
                            if isinstance(n, ast.Name):
                                self.defs[(mod, n.id)] = (node, first, node.end_lineno)

    def walker(self, env: dict) -> Walker:
        return Walker(env, self.facts)

    def _reads(self, mod: str, w: Walker) -> set[tuple[str, str]]:
        return {(mod, n) for n in w.names if (mod, n) in self.defs} | {k for k in w.module_attrs if k in self.defs}

    def names_read(self, key: tuple[str, str], env: dict | None = None) -> set[tuple[str, str]]:
        mod, name = key
        node = self.defs[key][0]
        own_self = {"self": Facts} if self.facts and key == ("common", "World") else {}
        if isinstance(node, ast.ClassDef):
            w = self.walker(own_self)
            for base in node.bases:
                w.expr(base)
            reads = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    w2 = self.walker(own_self)
                    for d in item.args.defaults + item.args.kw_defaults:
                        w2.expr(d)
                    w2.stmts(item.body)
                    reads |= self._reads(mod, w2)
                else:
                    w.stmts([item])
            return reads | self._reads(mod, w)
        w = self.walker(env or {})
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.args.defaults + node.args.kw_defaults:
                w.expr(d)
            w.stmts(node.body)
        else:
            w.expr(node.value)
        return self._reads(mod, w)

    def _callee(self, mod: str, func) -> tuple[str, str] | None:
        if isinstance(func, ast.Name) and (mod, func.id) in self.defs:
            return mod, func.id
        key = _module_attr(func)
        return key if key in self.defs else None

    def returned_classes(self, key, call: ast.Call | None = None, env: dict | None = None, depth: int = 0) -> set:
        """The classes (module, name) that function `key` returns on the decided path (called as `call` in `env`)."""
        mod, _ = key
        node = self.defs[key][0]
        if isinstance(node, ast.ClassDef):
            return {key}
        if not isinstance(node, ast.FunctionDef) or depth > 6:
            return set()
        bound = {}
        if call is not None:  # the call's arguments, as far as they are known, bound to the parameters
            evaluate = Evaluator(env or {}, self.facts)
            params = [a.arg for a in node.args.posonlyargs + node.args.args]
            bound |= {p: evaluate(a) for p, a in zip(params, call.args)}
            bound |= {k.arg: evaluate(k.value) for k in call.keywords if k.arg}
        w = self.walker(bound)
        w.stmts(node.body)

        def classify(value, in_mod: str) -> set:
            if isinstance(value, ast.Tuple):
                return classify(value.elts[0], in_mod) if value.elts else set()
            if isinstance(value, ast.Call):
                f = value.func
                callee = self._callee(in_mod, f)
                if callee is None and isinstance(f, ast.Attribute):  # a method call: its object's class
                    callee = self._callee(in_mod, f.value)
                    if callee is not None and isinstance(self.defs[callee][0], ast.ClassDef):
                        return {callee}
                    return set()
                if callee is not None:
                    if isinstance(self.defs[callee][0], ast.ClassDef):
                        return {callee}
                    return self.returned_classes(callee, value, w.env, depth + 1)
            if isinstance(value, ast.Name):
                if value.id in w.assigned:
                    return classify(w.assigned[value.id], in_mod)
                if (in_mod, value.id) in self.defs and isinstance(self.defs[(in_mod, value.id)][0], ast.Assign):
                    return classify(self.defs[(in_mod, value.id)][0].value, in_mod)
            return set()

        out: set = set()
        for value in w.returns:
            out |= classify(value, mod)
        if not out and node.returns is not None:
            for n in ast.walk(node.returns):
                callee = self._callee(mod, n) if isinstance(n, (ast.Name, ast.Attribute)) else None
                if callee is not None:
                    out.add(callee)
        return {c for c in out if isinstance(self.defs[c][0], ast.ClassDef)}


def _args_env(script: str) -> dict:
    sys.path.insert(0, ROOT)
    try:
        mod = importlib.import_module(script)
    finally:
        sys.path.remove(ROOT)
    return {"args": mod.Args(), "step": MIDDLE_STEP, "world": Facts}


def reach_of_script(script: str, shared: Shared | None = None) -> set[tuple[str, str]]:
    """The definitions (module, name) of the shared files a step of `script` reaches: with the facts of a default
    CPU step (Shared(facts=True)), or every branch followed (Shared(facts=False))."""
    shared = shared or Shared()
    _, tree = _source(script)
    script_defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    main = script_defs["main"]
    loop = next(n for n in main.body if isinstance(n, ast.For) and ast.unparse(n.target) == "step")
    nested = {n.name: n for n in ast.walk(main) if isinstance(n, ast.FunctionDef) and n is not main}
    env = _args_env(script) if shared.facts else {}
    # the step's objects made before the loop, and the classes they are
    setup = shared.walker(env)
    setup.stmts(main.body[: main.body.index(loop)])
    objects: dict[str, set] = {}
    for var, value in setup.assigned.items():
        if shared.facts and setup.env.get(var, UNKNOWN) is None:  # decided None (the producer of --async-lag off)
            continue
        while isinstance(value, ast.IfExp) and shared.facts:  # `v = a if <decided> else b`: the branch taken
            test = Evaluator(setup.env, shared.facts)(value.test)
            if test is UNKNOWN:
                break
            value = value.body if test else value.orelse
        for call in (n for n in ast.walk(value) if isinstance(n, ast.Call)):
            key = _module_attr(call.func)
            if key in shared.defs:
                objects.setdefault(var, set()).update(shared.returned_classes(key, call, setup.env))
            elif isinstance(call.func, ast.Name) and isinstance(script_defs.get(call.func.id), ast.ClassDef):
                objects.setdefault(var, set()).add(("script", call.func.id))
    for node in main.body[: main.body.index(loop)]:  # `world, device = run.setup(args)`
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Call):
            names = [e.id for e in node.targets[0].elts if isinstance(e, ast.Name)]
            key = _module_attr(node.value.func)
            if names and key in shared.defs:
                objects[names[0]] = shared.returned_classes(key, node.value, setup.env)
    step = shared.walker(setup.env)
    step.stmts(loop.body)
    # script functions and nested functions the step calls, to a fixed point
    seen_script, todo = set(), [n for n in step.names if n in script_defs or n in nested]
    roots, names_read = set(step.module_attrs), set(step.names)
    while todo:
        name = todo.pop()
        if name in seen_script:
            continue
        seen_script.add(name)
        node = nested.get(name) or script_defs[name]
        w = shared.walker(setup.env)
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                w.expr(base)
            for item in node.body:
                w.stmts(item.body if isinstance(item, ast.FunctionDef) else [item])
        else:
            w.stmts(node.body)
        roots |= w.module_attrs
        names_read |= w.names
        todo += [n for n in w.names if (n in script_defs or n in nested) and n not in seen_script]
    for var in names_read:
        for cls in objects.get(var, ()):
            if cls[0] == "script":
                w = shared.walker(setup.env)
                for base in script_defs[cls[1]].bases:
                    w.expr(base)
                roots |= w.module_attrs
            else:
                roots.add(cls)
    reached, todo = set(), [r for r in roots if r in shared.defs]
    while todo:
        key = todo.pop()
        if key in reached:
            continue
        reached.add(key)
        todo += [k for k in shared.names_read(key) if k not in reached]
    return reached


def stretch(shared: Shared, keys: set) -> tuple[int, int]:
    return min(shared.defs[k][1] for k in keys), max(shared.defs[k][2] for k in keys)


def own_lines(shared: Shared, keys: set) -> int:
    """Lines of the definitions themselves (a constant block counted once), without the blank lines and section
    headers between them."""
    spans = {(k[0], shared.defs[k][1], shared.defs[k][2]) for k in keys}
    return sum(last - first + 1 for _, first, last in spans)


def unreached_between(shared: Shared, mod: str, keys: set) -> list[str]:
    """Functions and classes of `mod` between its first and last reached definition that are not reached."""
    first, last = stretch(shared, {k for k in keys if k[0] == mod})
    return sorted(
        n
        for (m, n), (node, start, _) in shared.defs.items()
        if m == mod and first <= start <= last and (m, n) not in keys and isinstance(node, (ast.FunctionDef, ast.ClassDef))
    )


def docstring_names(mod: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", ast.get_docstring(_source(mod)[1]) or ""))


def used_names(script: str, mod: str) -> set[str]:
    _, tree = _source(script)
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and ast.unparse(n.value) == mod}
    for node in ast.walk(tree):  # from <mod> import x
        if isinstance(node, ast.ImportFrom) and node.module == mod:
            used |= {a.name for a in node.names}
    return used


def imported_modules(name: str) -> set[str]:
    """Every project module `name`.py imports, anywhere in the file."""
    _, tree = _source(name)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out & {m for layer in LAYERS for m in layer}


def reach_figures(shared: Shared | None = None) -> dict[str, tuple[int, int]]:
    """script -> (definitions, lines of their own) of a default CPU step."""
    shared = shared or Shared()
    out = {}
    for script in SCRIPTS:
        reached = reach_of_script(script, shared)
        out[script] = (len(reached), own_lines(shared, reached))
    return out


def readme_sentence(figures: dict[str, tuple[int, int]]) -> str:
    defs = sorted({d for d, _ in figures.values()})
    lines = sorted({n for _, n in figures.values()})
    span = lambda v: f"{v[0]}" if len(v) == 1 else f"{v[0]}-{v[-1]}"  # noqa: E731
    return f"reaches {span(defs)} definitions of `common.py` and `engines.py`, {span(lines)} lines of their own"


@pytest.fixture(scope="module")
def shared():
    return Shared()


@pytest.mark.parametrize("name", [m for layer in LAYERS for m in layer])
def test_imports_go_down_only(name):
    level = next(i for i, layer in enumerate(LAYERS) if name in layer)
    above = {m for layer in LAYERS[: level + 1] for m in layer}  # its own layer too (a script imports no script)
    upward = sorted(imported_modules(name) & above - {name})
    assert not upward, (
        f"{name}.py imports {upward}: imports go scripts -> outputs -> run -> models -> engines -> common -> verifiers "
        "-> sandbox"
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_shared_name_a_script_uses_is_in_its_files_map(script):
    for mod in ("common", *ROOMS):
        missing = sorted(used_names(script, mod) - docstring_names(mod))
        assert not missing, f"{script}.py uses {mod}.{missing}, which {mod}.py's opening map does not name"
    assert not used_names(script, "engines"), f"{script}.py uses engines.* directly (models.make_engine builds it)"


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_default_cpu_step_stays_in_common_and_engines(script, shared):
    reached = reach_of_script(script, shared)
    assert ("engines", "HFEngine") in reached and ("common", "generate_rollout") in reached  # the walk got there
    outside = sorted(n for m, n in reached if m not in ("common", "engines"))
    assert not outside, f"a default CPU step of {script}.py reaches {outside} of the run's rooms {ROOMS}"
    for mod in ("common", "engines"):
        between = unreached_between(shared, mod, reached)
        assert not between, f"{mod}.py: the stretch a default CPU step of {script}.py reads holds {between}, unreached"
    lines = own_lines(shared, reached)
    assert lines <= STEP_LINES_MAX, f"a default CPU step of {script}.py reads {lines} lines, more than {STEP_LINES_MAX}"


def test_common_holds_nothing_a_run_reaches_only_at_its_start_or_end():
    """Every function and class of common.py is reached by the step of some script when every branch is followed
    (the options off by default, several processes); constants (the seed offsets) may serve the start too."""
    shared = Shared(facts=False)
    reached = set().union(*(reach_of_script(s, shared) for s in SCRIPTS))
    unreached = sorted(
        n
        for (m, n), (node, *_) in shared.defs.items()
        if m == "common" and isinstance(node, (ast.FunctionDef, ast.ClassDef)) and (m, n) not in reached
    )
    assert not unreached, f"common.py holds {unreached}, which no step reaches: they belong in a room {ROOMS}"


def test_readme_states_the_reach_this_file_computes():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = " ".join(f.read().split())
    sentence = readme_sentence(reach_figures())
    assert sentence in readme, f"README.md should say: '... {sentence} ...' (python tests/test_layout.py)"


def test_the_reach_follows_the_decided_branches_only():
    """A branch the facts decide is not followed (the distributed path of a one-process run), an undecided one is,
    and with no facts both are."""
    code = (
        "def f(x):\n    w = world()\n    if not w.enabled:\n        return A(x)\n    return B(x)\n"
        "def g(x):\n    if x:\n        return C()\n    return D() if torch.cuda.is_available() else E()\n"
    )
    tree = ast.parse(code)
    w = Walker({})
    w.stmts(tree.body[0].body)
    assert {"A"} <= w.names and "B" not in w.names
    w = Walker({})
    w.stmts(tree.body[1].body)
    assert {"C", "E"} <= w.names and "D" not in w.names
    w = Walker({}, facts=False)
    w.stmts(tree.body[0].body)
    assert {"A", "B"} <= w.names


def test_an_upward_import_is_caught(tmp_path, monkeypatch):
    """The import rule reads imports inside functions too."""
    (tmp_path / "common.py").write_text("def f():\n    import models\n    return models\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    assert imported_modules("common") == {"models"}


def product_files() -> list[str]:
    """The product's Python files (relative paths): the top level and the sandbox/ folder, not tests/, bench/, docs/."""
    top = [n for n in os.listdir(ROOT) if n.endswith(".py")]
    sandbox = [os.path.join("sandbox", n) for n in os.listdir(os.path.join(ROOT, "sandbox")) if n.endswith(".py")]
    return sorted(top + sandbox)


def module_of(path: str) -> str:
    """sandbox/__init__.py -> sandbox, sandbox/harness.py -> sandbox.harness, grpo.py -> grpo."""
    parts = path[: -len(".py")].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def private_uses(text: str, modules: set[str], own: str) -> list[str]:
    """`mod._name` and `from mod import _name` in `text` for a module of `modules` other than `own` (dunders excepted)."""
    tree = ast.parse(text)
    bound = {}  # local name -> module (`import a.b as c`, `import a`)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules and a.name != own:
                    bound[a.asname or a.name.split(".")[0]] = a.name
    found = []
    for node in ast.walk(tree):
        private = lambda n: n.startswith("_") and not n.startswith("__")  # noqa: E731
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules and node.module != own:
            found += [f"from {node.module} import {a.name}" for a in node.names if private(a.name)]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            if private(node.attr):
                found.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
    return found


ROOM_CALLS = {*ROOMS, "verifiers"}  # the files a script calls at its start and end


def passed_through_flags(main: ast.FunctionDef) -> list[str]:
    """The flags `args.X` of a script's main whose every use is an argument of a call to a room (ROOM_CALLS): flags that
    only the infrastructure reads, which the room should read from `args` itself."""
    parent = {child: node for node in ast.walk(main) for child in ast.iter_child_nodes(node)}
    uses: dict[str, list[bool]] = {}
    for node in ast.walk(main):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
            up = parent.get(node)
            while up is not None and not isinstance(up, ast.Call):
                up = parent.get(up)
            to_room = up is not None and isinstance(up.func, ast.Attribute) and ast.unparse(up.func.value) in ROOM_CALLS
            uses.setdefault(node.attr, []).append(to_room)
    return sorted(name for name, to_room in uses.items() if all(to_room))


def test_no_product_file_is_over_the_line_limit():
    sizes = {}
    for path in product_files():
        with open(os.path.join(ROOT, path)) as f:
            sizes[path] = sum(1 for _ in f)
    over = {p: n for p, n in sizes.items() if n > PRODUCT_LINES_MAX}
    assert not over, f"{over}: over {PRODUCT_LINES_MAX} lines; the capability that grew it finds its own room"


def test_no_product_file_uses_another_files_private_names():
    modules = {module_of(p) for p in product_files()} | {"sandbox"}
    for path in product_files():
        with open(os.path.join(ROOT, path)) as f:
            found = private_uses(f.read(), modules, module_of(path))
        assert not found, f"{path} uses another file's private names: {found} (make them public where they are defined)"


def test_the_private_name_rule_catches_a_use():
    code = "import common\nfrom verifiers import _code\nx = common._WORLD\ny = common.world()\nz = self._own\n"
    assert private_uses(code, {"common", "verifiers"}, "infra") == ["from verifiers import _code", "common._WORLD (line 3)"]
    assert private_uses(code, {"common", "verifiers"}, "common") == ["from verifiers import _code"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_passes_no_flag_through_to_the_rooms(script):
    _, tree = _source(script)
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    through = passed_through_flags(main)
    assert not through, (
        f"{script}.py passes {['--' + f.replace('_', '-') for f in through]} to the run's rooms only: the room reads "
        "its own flags from args"
    )


def test_the_pass_through_rule_catches_a_flag():
    code = (
        "def main(args):\n    e = models.make_engine(args, m, engine_dtype=args.engine_dtype)\n"
        "    r = models.reference_model(args) if args.beta > 0 else None\n"
        "    loss = f(args.beta, args.clip)\n    outputs.save(args, keep=args.keep_last, steps=args.clip)\n"
    )
    main = ast.parse(code).body[0]
    assert passed_through_flags(main) == ["engine_dtype", "keep_last"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_scripts_setup_is_a_short_list_of_calls(script):
    _, tree = _source(script)
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    loop = next(n for n in main.body if isinstance(n, ast.For) and ast.unparse(n.target) == "step")
    lines = loop.lineno - main.lineno
    assert lines <= SETUP_LINES_MAX, f"{script}.py: {lines} lines from `def main` to the step loop (at most {SETUP_LINES_MAX})"


if __name__ == "__main__":
    shared = Shared()
    figures = reach_figures(shared)
    for script in SCRIPTS:
        reached = reach_of_script(script, shared)
        spans = {mod: stretch(shared, {k for k in reached if k[0] == mod}) for mod in ("common", "engines")}
        print(
            f"{script}: {len(reached)} definitions, {own_lines(shared, reached)} lines of their own; "
            + ", ".join(f"{mod}.py lines {a}-{b}" for mod, (a, b) in spans.items())
        )
        if "-v" in sys.argv:
            for mod, n in sorted(reached, key=lambda k: (k[0], shared.defs[k][1])):
                print(f"    {mod:8s} {shared.defs[(mod, n)][1]:5d}-{shared.defs[(mod, n)][2]:5d} {n}")
    print(f"README: ... {readme_sentence(figures)} ...")
