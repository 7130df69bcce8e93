"""Bad input fails with one `error:` line (exit 2) before anything slow: every bad flag before any dataset or
model is loaded (run.validate_args, the method scripts' own checks, one-line argparse errors), and every data
error in a local dataset file with its `file:line`."""

import gzip
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

import models
import run
import verifiers
from tests import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = [m for m in ("grpo", "gapo", "mugrpo", "codapo") if os.path.exists(os.path.join(ROOT, f"{m}.py"))]


class Loaded(Exception):
    """Raised by the patched loaders: the run got past validation."""


@pytest.fixture
def no_loading(monkeypatch):
    """Any dataset, tokenizer, model or engine load raises Loaded (and is recorded)."""
    reached = []

    def stop(what):
        def fn(*a, **k):
            reached.append(what)
            raise Loaded(what)

        return fn

    monkeypatch.setattr(verifiers, "load_task", stop("load_task"))
    for name in ("load_tokenizer", "load_model", "make_engine", "embedded_model_dir"):
        monkeypatch.setattr(models, name, stop(name))
    return reached


def run_cli_in_process(method, argv, monkeypatch, capsys):
    """`python <method>.py argv` in this process: the real parse -> main path, with run_cli's exit codes."""
    mod = importlib.import_module(method)
    monkeypatch.setattr(sys, "argv", [f"{method}.py", *argv])
    with pytest.raises(SystemExit) as exc:
        run.command_line(mod.main, mod.Args)
    return exc.value.code, capsys.readouterr()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("inputs")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    broken_model = tmp_path / "broken_model"
    tiny.make_tiny_model(str(broken_model))
    st = broken_model / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-100])  # a copy cut off while it was written
    taken = tmp_path / "out" / "taken"
    taken.mkdir(parents=True)
    (taken / "metrics.jsonl").write_text('{"step": 0}\n')
    adapter = tmp_path / "adapter"  # a PEFT adapter folder (final_adapter/ of a LoRA run) is not a model
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    return {"FILE": str(a_file), "BROKEN_MODEL": str(broken_model), "OUT": str(tmp_path / "out"), "ADAPTER": str(adapter)}


# (flags, text the one error line must contain)
COMMON_CASES = [
    (["--num-generations", "0"], "--num-generations 0: must be >= 2"),
    (["--prompts-per-step", "0"], "--prompts-per-step 0: must be >= 1"),
    (["--updates-per-batch", "0"], "--updates-per-batch"),
    (["--temperature", "0"], "--temperature 0.0: must be > 0"),
    (["--temperature", "nan"], "--temperature nan: must be > 0"),
    (["--eval-temperature", "-1"], "--eval-temperature -1.0: must be >= 0"),
    (["--eval-temperature", "0"], "--eval-temperature 0 is greedy decoding, which gives one answer per problem"),
    (["--eval-temperature", "0", "--eval-samples", "1"], "--eval-k values must be <= --eval-samples (4 > 1"),
    (["--eval-top-p", "0"], "--eval-top-p 0.0: must be in (0, 1]"),
    (["--eval-top-p", "1.5"], "--eval-top-p 1.5: must be in (0, 1]"),
    (["--eval-max-new-tokens", "-1"], "--eval-max-new-tokens -1: must be >= 0"),
    (["--eval-protocol", "arith.samples=4"], "--eval-protocol arith.samples=4: 'samples' is not a field of an evaluation set"),
    (["--eval-protocol", "aime24.n=4"], "aime24 is not an evaluation set of this run (its sets: arith"),
    (["--eval-protocol", "arith.n=four"], "--eval-protocol arith.n=four: n must be a whole number"),
    (["--eval-protocol", "n=4"], "--eval-protocol n=4: write SET.FIELD=VALUE"),
    (["--eval-protocol", "arith.k=8"], "--eval-protocol arith.k values must be <= --eval-samples (8 > 4"),
    (["--eval-protocol", "arith.maj=8"], "--eval-protocol arith.maj values must be <= --eval-samples (8 > 4"),
    (["--eval-protocol", "arith.grader=exact"], "--eval-protocol arith.grader exact: must be one of auto, math"),
    (["--eval-protocol", "arith.preset=aime"], "--eval-protocol arith.preset=aime: no such preset"),
    (
        ["--eval-dataset", "aime24", "--eval-protocol", "aime24.temperature=0"],
        "--eval-protocol aime24.temperature 0 is greedy decoding, which gives one answer per problem: preset aime24 is 64",
    ),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    (["--eval-k", "0"], "--eval-k 0: values must be >= 1"),
    (["--eval-k", "8"], "--eval-k values must be <= --eval-samples"),
    (["--eval-samples", "0"], "--eval-samples 0: must be >= 1"),
    (["--engine", "tpu"], "invalid choice: 'tpu'"),
    (["--reward", "maths"], "--reward maths: must be auto, arith, math, code"),
    (["--learning-rate", "-1"], "--learning-rate -1.0: must be > 0"),
    (["--eval-limit", "-1"], "--eval-limit -1: must be >= 0"),
    (["--save-every", "-1"], "--save-every -1: must be >= 0"),
    (["--keep-last", "-1"], "--keep-last -1: must be >= 0"),
    (["--total-steps", "0"], "--total-steps 0: must be >= 1"),
    (["--max-grad-norm", "0"], "--max-grad-norm 0.0: must be > 0"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5: must be in (0, 1]"),
    (["--updates-per-batch", "3", "--prompts-per-step", "4"], "--updates-per-batch"),
    (["--output-dir", "FILE"], "is a file; pass a folder"),
    (["--output-dir", "FILE/sub"], "is a file, not a folder"),
    (["--output-dir", "OUT", "--run-name", "taken"], "already holds a run; continue it with --resume"),
    (["--resume", "/nonexistent/run"], "--resume /nonexistent/run: no such folder"),
    (["--resume", "FILE"], "is a file"),
    (["--model", "FILE"], "is a file"),
    (["--model", "/nonexistent/model-folder"], "cannot load model"),
    (["--model", "BROKEN_MODEL"], "model.safetensors is truncated"),
    (["--num-generations", "two"], "invalid int value: 'two'"),
    (["--no-such-flag", "1"], "unknown argument(s): --no-such-flag 1"),
    (["--engine", "vllm"], "--engine vllm needs vLLM"),  # the main suite's venv has no vLLM (CPU or GPU build)
    (["--lora-rank", "-1"], "--lora-rank -1: must be >= 0"),
    (["--lora-alpha", "0"], "--lora-alpha 0.0: must be > 0"),
    (["--lora-targets", "all-linear", "q_proj"], "--lora-targets all-linear q_proj: must be all-linear or names"),
    (["--model", "ADAPTER"], "LoRA adapters without their base model"),
]
METHOD_CASES = {
    "grpo": [
        (["--scale-rewards", "std"], "invalid choice: 'std'"),
        (["--loss-agg", "mean"], "invalid choice: 'mean'"),
        (["--clip-low", "2"], "--clip-low 2.0: must be in [0, 1]"),
    ],
    "gapo": [
        (["--clip-mode", "auto"], "invalid choice: 'auto'"),
        (["--clip-level", "seq"], "invalid choice: 'seq'"),
        (["--scale-rewards", "std"], "invalid choice: 'std'"),
        (["--clip-high-max", "nan"], "--clip-high-max nan: must be finite and >= 0"),
        (["--clip-high-max", "0.1"], "--clip-high-max 0.1: must be >= --clip-low with --clip-mode adaptive"),
    ],
    "mugrpo": [
        (["--veto-scope", "all"], "invalid choice: 'all'"),
        (["--behav-logp", "vllm"], "invalid choice: 'vllm'"),
        (["--prompts-per-step", "12"], "--prompts-per-step 12: must be a multiple of --updates-per-batch"),
    ],
    "codapo": [
        (["--loss-agg", "mean"], "invalid choice: 'mean'"),
        (["--codapo-percentile", "2"], "--codapo-percentile 2.0: must be in [0, 1]"),
        (["--codapo-offset", "-1"], "--codapo-offset -1.0: must be >= 0"),
    ],
}
CASES = [(m, f, n) for m in METHODS for f, n in COMMON_CASES + METHOD_CASES.get(m, [])]


def _fill(flags, files):
    out = []
    for f in flags:
        for key, value in files.items():
            f = f.replace(key, value) if f.startswith(key) else f
        out.append(f)
    return out


@pytest.mark.parametrize("method,flags,needle", CASES, ids=[f"{m}:{' '.join(f)}" for m, f, _ in CASES])
def test_bad_flag_fails_before_anything_loads(method, flags, needle, files, no_loading, monkeypatch, capsys, tmp_path):
    if flags == ["--engine", "vllm"] and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: --engine vllm is valid (tests/test_vllm_real.py runs it)")
    argv = ["--output-dir", str(tmp_path / "runs")] + _fill(flags, files)
    code, out = run_cli_in_process(method, argv, monkeypatch, capsys)
    errors = [line for line in out.err.splitlines() if line.startswith("error:")]
    assert code == 2, out.err
    assert len(errors) == 1 and needle in errors[0], out.err
    assert "usage:" not in out.err  # argparse's multi-line usage text is not printed
    assert no_loading == []  # nothing was loaded
    assert not os.path.exists(tmp_path / "runs")  # and no run folder was made


@pytest.mark.parametrize("method", METHODS)
def test_valid_flags_get_past_validation(method, no_loading, monkeypatch, capsys, tmp_path):
    """The control: the patched loaders are where a valid run goes next (so the test above can fail)."""
    mod = importlib.import_module(method)
    monkeypatch.setattr(sys, "argv", [f"{method}.py", "--output-dir", str(tmp_path)])
    with pytest.raises(Loaded):
        run.command_line(mod.main, mod.Args)
    assert no_loading == ["load_task"]


def _subprocess(method, flags, env_extra=None):
    env = dict(os.environ, HF_HUB_OFFLINE="1", **(env_extra or {}))
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, f"{method}.py"), *flags],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    return proc, time.time() - t0


@pytest.mark.parametrize(
    "method,flags,needle",
    [
        ("grpo", ["--num-generations", "0"], "--num-generations 0"),
        ("grpo", ["--eval-temperature", "-1"], "--eval-temperature -1.0"),
        ("grpo", ["--eval-temperature", "0"], "--eval-temperature 0 is greedy decoding"),
        ("grpo", ["--output-dir", "FILE"], "is a file"),
        ("grpo", ["--max-new-tokens", "x"], "invalid int value"),
        ("gapo", ["--clip-mode", "x"], "invalid choice"),
        ("mugrpo", ["--veto-scope", "x"], "--veto-scope"),
        ("codapo", ["--loss-agg", "x"], "--loss-agg"),
    ],
)
def test_bad_flag_real_cli(method, flags, needle, files, tmp_path):
    """The real command line: exit 2, one error line, no traceback. --model and --dataset point at things that
    fail with other messages when loaded (an unknown hub id offline, a broken jsonl), so the flag's message
    proves that validation ran before the data and the model."""
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "q", "answer": "1"}\n{"question": \n')
    base = ["--model", "no-such-org/no-such-model", "--dataset", str(broken), "--output-dir", str(tmp_path / "r")]
    proc, _ = _subprocess(method, base + _fill(flags, files))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(errors) == 1 and needle in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr
    assert not os.path.exists(tmp_path / "r")


# ----- data errors: file:line


def _write(path, text: bytes):
    with open(path, "wb") as f:
        f.write(text)
    return str(path)


GOOD = b'{"question": "1+1?", "answer": "2"}\n'


@pytest.mark.parametrize(
    "content,line,needle",
    [
        (GOOD + GOOD + b'{"question": "2+2?", "answer": \n' + GOOD, 3, "not valid JSON"),
        (GOOD + b'{"question": "caf\xe9?", "answer": "2"}\n', 2, "not UTF-8"),
        (GOOD + GOOD + GOOD + b'{"question": "3+3?", "solution": "6"}\n', 4, "row has no field 'answer'"),
        (GOOD + b"[1, 2]\n", 2, "expected a JSON object"),
        (GOOD + b"\n" + b'{"question": "x", "answer": "1"' + b"\n", 3, "not valid JSON"),  # blank lines count
    ],
)
def test_jsonl_data_errors_name_file_and_line(content, line, needle, tmp_path):
    path = _write(tmp_path / "data.jsonl", content)
    with pytest.raises(verifiers.UserError) as exc:
        verifiers.load_task(path, "train", 0)
    msg = str(exc.value)
    assert msg.startswith(f"{path}:{line}: ") and needle in msg, msg
    assert "\n" not in msg


def test_utf8_bom_is_accepted(tmp_path):
    path = _write(tmp_path / "bom.jsonl", b"\xef\xbb\xbf" + GOOD * 10)
    assert len(verifiers.load_task(path, "train", 0).problems) == 8  # 2 held out


def test_json_and_gzip_data_errors(tmp_path):
    path = _write(tmp_path / "data.json", b'[\n {"question": "a", "answer": "1"},\n {"question": "b" "answer": "2"}\n]\n')
    with pytest.raises(verifiers.UserError, match=r"data\.json:3: not valid JSON"):
        verifiers.load_task(path, "train", 0)
    path = _write(tmp_path / "items.json", b'[{"question": "a", "answer": "1"}, 7]')
    with pytest.raises(verifiers.UserError, match="item 2 of the list is a int"):
        verifiers.load_task(path, "train", 0)
    path = _write(
        tmp_path / "columns.json",
        json.dumps({"question": ["a", "b", "c", "d", "e"], "answer": ["1", "2", "3", "4", "5"]}).encode(),
    )
    (held_out,) = verifiers.load_task(path, "eval", 0).problems  # a column dict: 5 rows, 1 held out
    assert held_out["answer"] == str("abcde".index(held_out["question"]) + 1)
    gz = tmp_path / "data.jsonl.gz"
    gz.write_bytes(gzip.compress(GOOD * 200)[:-20])  # cut off
    with pytest.raises(verifiers.UserError, match="cannot read .*data.jsonl.gz"):
        verifiers.load_task(str(gz), "train", 0)


def test_rows_without_a_usable_answer_are_counted_not_hidden(tmp_path, capsys):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(9)] + [{"question": "q", "answer": None}]
    path = tiny.write_jsonl(str(tmp_path / "d.jsonl"), rows)
    task = verifiers.load_task(path, "train", 0)
    assert len(task.problems) == 8  # 9 usable rows, 1 held out
    err = capsys.readouterr().err
    assert "skipped 1 of 10 rows" in err and f"{path}:10" in err


def test_data_error_real_cli(tmp_path):
    path = _write(tmp_path / "data.jsonl", GOOD * 5 + b'{"question": "q"}\n')
    proc, _ = _subprocess(
        "grpo", ["--model", "no-such-org/no-such-model", "--dataset", path, "--output-dir", str(tmp_path / "r")]
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert (
        errors[0] == f"error: {path}:6: row has no field 'answer'; its fields are ['question'] (every row needs "
        "'question' and 'answer')"
    )
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("method", METHODS)
def test_help_lists_every_flag_with_its_default(method, monkeypatch, capsys):
    """One dataclass per script (run.Args + the method's own fields): --help shows each flag once, with its
    default (Mu-GRPO's stage defaults included) and the choices of each Literal flag."""
    import dataclasses

    mod = importlib.import_module(method)
    monkeypatch.setattr(sys, "argv", [f"{method}.py", "--help"])
    with pytest.raises(SystemExit) as exc:
        run.command_line(mod.main, mod.Args)
    assert exc.value.code == 0
    text = capsys.readouterr().out
    entries = {e.split()[0].split(",")[0].split("=")[0]: e for e in ("\n" + text).split("\n  --")[1:]}
    for f in dataclasses.fields(mod.Args):
        entry = entries.get(f.name.replace("_", "-"))  # spelled as the docs spell it
        assert entry is not None, f"--{f.name.replace('_', '-')} missing from --help"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert f"(default:{default})".replace(" ", "") in "".join(entry.split()), (f.name, entry)  # help wraps anywhere
    if method == "mugrpo":
        assert "(default:3)" in "".join(entries["total-steps"].split())  # the stage default, not grpo.py's 12
        assert "{none,trigger,suffix,suffix_nontrigger,sequence}" in entries["veto-scope"]
