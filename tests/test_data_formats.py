"""Real data in, right rewards out: gold answers read in the formats people have (GSM8K '#### N', a solution whose
last \\boxed{} is the answer, a plain value), checked at load (math-verify in the math workers), and no run that
cannot learn (one rollout per prompt, a completion that cannot fit the model's context). Every file is written by
the test."""

import importlib
import importlib.metadata
import os
import re
import sys

import pytest

import common
import evaluation
import models
import run
import verifiers
from tests import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GSM8K_ROWS = [
    {
        "question": f"Janet has {n} eggs and eats 3. How many are left?",
        "answer": f"She has {n} - 3 = <<{n}-3={n - 3}>>{n - 3} eggs left.\n#### {n - 3:,}",
    }
    for n in (10, 25, 1203, 40, 55, 62, 71, 88, 93, 104)
]
BOXED_ROWS = [
    {
        "problem": f"What is {n}/2?",
        "solution": f"Halving gives $\\frac{{{n}}}{{2}}$, so the answer is $\\boxed{{\\frac{{{n}}}{{2}}}}$.",
    }
    for n in (1, 3, 5, 7, 9, 11, 13, 15, 17, 19)
]
PLAIN_ROWS = [{"question": f"What is {n} + 1?", "answer": str(n + 1)} for n in range(10)]


def write(tmp_path, name, rows):
    return tiny.write_jsonl(str(tmp_path / name), rows)


# ----- answer formats


def test_gsm8k_file_is_read_as_gsm8k_and_a_right_answer_scores(tmp_path, capsys):
    path = write(tmp_path, "gsm8k_test.jsonl", GSM8K_ROWS)
    task = verifiers.load_task(path, "train", 0, reward="math")
    assert all(re.fullmatch(r"\d+", p["answer"]) for p in task.problems)  # "#### 1,200" -> "1200"
    assert "1200" in [p["answer"] for p in verifiers.load_task(path, "eval", 0).problems + task.problems]
    problem = task.problems[0]
    right, wrong = f"So \\boxed{{{problem['answer']}}}.", f"So \\boxed{{{int(problem['answer']) + 1}}}."
    assert verifiers.compute_rewards(task, [problem, problem], [right, wrong]) == [1.0, 0.0]
    out = capsys.readouterr().out
    assert out.count("gold answers read as gsm8k") == 1  # printed once though two splits were loaded
    assert "in 10 of 10 rows (detected" in out


def test_boxed_solution_file_and_plain_file(tmp_path, capsys):
    boxed = verifiers.load_task(write(tmp_path, "math.jsonl", BOXED_ROWS), "train", 0, "problem", "solution")
    assert {p["answer"] for p in boxed.problems} <= {f"\\frac{{{n}}}{{2}}" for n in range(1, 20, 2)}
    problem = boxed.problems[0]
    value = int(problem["answer"][6:].split("}")[0]) / 2
    assert verifiers.compute_rewards(boxed, [problem], [f"\\boxed{{{value}}}"]) == [1.0]  # 1.5 = \frac{3}{2}
    plain = verifiers.load_task(write(tmp_path, "plain.jsonl", PLAIN_ROWS), "train", 0)
    assert all(p["answer"] == str(int(p["question"].split()[2]) + 1) for p in plain.problems)
    out = capsys.readouterr().out
    assert "read as boxed" in out and "read as raw" in out


def test_registry_names_use_the_same_reader():
    assert verifiers.HUB_DATASETS["gsm8k"]["answer_format"] == "gsm8k"
    assert verifiers.HUB_DATASETS["math"]["answer_format"] == "boxed"
    assert verifiers.read_answer("work\n#### 1,234", "auto") == ("1234", "gsm8k")
    assert verifiers.read_answer("so $\\boxed{\\frac{1}{2}}$", "auto") == ("\\frac{1}{2}", "boxed")
    assert verifiers.read_answer(" 7 cm ", "auto") == ("7 cm", "raw")
    assert verifiers.read_answer("no marker", "gsm8k") == (None, "gsm8k")


def test_forced_format_that_does_not_fit_is_one_line_with_the_fix(tmp_path):
    path = write(tmp_path, "g.jsonl", GSM8K_ROWS)
    with pytest.raises(verifiers.UserError) as exc:  # the whole solution as gold: nothing could ever match
        verifiers.load_task(path, "train", 0, answer_format="raw")
    msg = str(exc.value)
    assert "gold answers can never be matched" in msg and f"{path}:" in msg and "--answer-format gsm8k" in msg
    assert "\n" not in msg
    with pytest.raises(verifiers.UserError, match=r"have no answer in --answer-format boxed .*--answer-format gsm8k"):
        verifiers.load_task(path, "train", 0, answer_format="boxed")
    task = verifiers.load_task(path, "train", 0, answer_format="gsm8k")
    assert all(re.fullmatch(r"\d+", p["answer"]) for p in task.problems)


def test_broken_golds_are_dropped_and_counted_with_their_line(tmp_path, capsys):
    rows = PLAIN_ROWS + [{"question": "Which one?", "answer": "\\frac{1}{"}]  # unparseable LaTeX, line 11
    path = write(tmp_path, "broken.jsonl", rows)
    problems = verifiers.load_task(path, "train", 0).problems + verifiers.load_task(path, "eval", 0).problems
    assert len(problems) == 10 and all(p["answer"] != "\\frac{1}{" for p in problems)
    err = capsys.readouterr().err
    assert "dropped 1 of" in err and f"{path}:11" in err and "can never be matched" in err
    mostly = [{"question": f"q{i}", "answer": "\\frac{1}{"} for i in range(8)] + PLAIN_ROWS[:2]
    with pytest.raises(verifiers.UserError, match=r"\d of \d gold answers can never be matched.*--answer-field"):
        verifiers.load_task(write(tmp_path, "mostly.jsonl", mostly), "train", 0)


def test_arith_golds_need_a_number(tmp_path, capsys):
    rows = PLAIN_ROWS + [{"question": "Say a word", "answer": "seven"}]
    path = write(tmp_path, "a.jsonl", rows)
    problems = [p for split in ("train", "eval") for p in verifiers.load_task(path, split, 0, reward="arith").problems]
    assert len(problems) == 10 and all(p["answer"] != "seven" for p in problems)
    assert "holds no number" in capsys.readouterr().err


def test_gold_check_uses_math_verify_in_the_workers():
    assert verifiers.math_golds_parse(["18", "\\frac{3}{2}", "x^2+1", "\\frac{1}{", "", "[0, 1)"]) == [
        True,
        True,
        True,
        False,
        False,
        True,
    ]


# ----- no run that cannot learn


class Loaded(Exception):
    pass


def run_main(method, argv, monkeypatch, capsys):
    mod = importlib.import_module(method)

    def stop(*a, **k):
        raise Loaded("load_model")

    monkeypatch.setattr(models, "load_model", stop)
    monkeypatch.setattr(sys, "argv", [f"{method}.py", *argv])
    try:
        run.command_line(mod.main, mod.Args)
    except SystemExit as exc:
        return exc.code, capsys.readouterr()
    return 0, capsys.readouterr()


@pytest.mark.parametrize("method", ["grpo", "mugrpo"])
def test_one_rollout_per_prompt_is_refused(method, monkeypatch, capsys, tmp_path):
    code, out = run_main(method, ["--num-generations", "1", "--output-dir", str(tmp_path)], monkeypatch, capsys)
    errors = [line for line in out.err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "--num-generations 1: must be >= 2" in errors[0]


def test_completion_longer_than_the_context_is_refused_before_the_weights_load(monkeypatch, capsys, tmp_path):
    model = tiny.make_tiny_model(str(tmp_path / "model"))  # max_position_embeddings 256
    data = write(tmp_path, "d.jsonl", PLAIN_ROWS)
    argv = ["--model", model, "--dataset", data, "--output-dir", str(tmp_path / "runs")]
    code, out = run_main("grpo", argv + ["--max-new-tokens", "10000000"], monkeypatch, capsys)
    errors = [line for line in out.err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, out.err
    assert "--max-new-tokens 10000000 leaves no room for a prompt in the model's context of 256 tokens" in errors[0]
    code, out = run_main("grpo", argv + ["--max-new-tokens", "200"], monkeypatch, capsys)  # prompts of ~100 tokens
    errors = [line for line in out.err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, out.err
    assert "its longest prompt" in errors[0] and "256 tokens" in errors[0] and "at most" in errors[0]
    mod = importlib.import_module("grpo")
    with pytest.raises(Loaded):  # a completion that fits gets past the check, to the weights
        mod.main(run.parse_args(mod.Args, argv + ["--max-new-tokens", "8", "--run-name", "fits"]))
    # --max-position-embeddings extends the context: the 200 new tokens then fit too
    with pytest.raises(Loaded):
        mod.main(run.parse_args(mod.Args, argv + ["--max-new-tokens", "200", "--max-position-embeddings", "512"]))


def _task_with_a_long_prompt(tmp_path):
    rows = PLAIN_ROWS + [{"question": "What is " + "1 + " * 60 + "1?", "answer": "61"}]  # char tokens: about 330
    where = [f"{tmp_path}/d.jsonl:{i + 1}" for i in range(len(rows))]
    return verifiers.Task("d.jsonl", "arith", rows, verifiers.ARITH_INSTRUCTION, where=where)


def test_training_prompts_that_do_not_fit_are_dropped_with_one_line(tmp_path, capsys):
    tok, model = tiny.make_tokenizer(), tiny.make_tiny_model(str(tmp_path / "model"))  # context 256
    task = _task_with_a_long_prompt(tmp_path)
    lengths = [len(common.format_prompt(tok, p["question"], task.instruction)) for p in task.problems]
    assert lengths[-1] > 246 >= max(lengths[:-1])
    kept, context = models.fit_context(
        run.Args(system_prompt="", max_new_tokens=10), model, tok, task, [eval_set([[1, 2, 3]], 10)]
    )
    assert kept.problems == task.problems[:-1] and kept.where == task.where[:-1]
    assert context == max(lengths[:-1]) + 10  # the engine's context: the longest prompt kept + the new tokens
    out = capsys.readouterr().out
    assert (
        f"dropped 1 of 11 training prompts longer than 246 tokens (the model's context 256 minus --max-new-tokens 10); "
        f"the longest kept has {max(lengths[:-1])} tokens" in out
    )
    with pytest.raises(verifiers.UserError, match=r"1 of 11 training prompts .* longer than 246 tokens.*d.jsonl:11"):
        models.fit_context(run.Args(system_prompt="", max_new_tokens=10, long_prompts="error"), model, tok, task, [])
    with pytest.raises(verifiers.UserError, match="none is left"):
        models.fit_context(run.Args(system_prompt="", max_new_tokens=10, max_prompt_tokens=20), model, tok, task, [])
    kept, context = models.fit_context(
        run.Args(system_prompt="", max_new_tokens=10, max_position_embeddings=1024), model, tok, task, []
    )
    assert kept.problems == task.problems and context == lengths[-1] + 10  # an extended context holds them all
    assert (
        models.fit_context(run.Args(system_prompt="", max_new_tokens=10), model, tok, None, [eval_set([[1] * 40], 10)])[1]
        == 50
    )  # eval-only
    with pytest.raises(verifiers.UserError, match=r"evaluation set d: its longest prompt \(300 tokens\)"):
        models.fit_context(run.Args(system_prompt="", max_new_tokens=10), model, tok, None, [eval_set([[1] * 300], 10)])
    # an evaluation set's own token budget, not the training one
    assert models.fit_context(run.Args(max_new_tokens=10), model, tok, None, [eval_set([[1] * 40], 100)])[1] == 140
    with pytest.raises(verifiers.UserError, match=r"plus its 250 new tokens exceed .* lower --eval-max-new-tokens"):
        models.fit_context(run.Args(max_new_tokens=10), model, tok, None, [eval_set([[1] * 40], 250)])


def eval_set(prompts, max_new_tokens):
    """An evaluation set of `prompts` (token id lists) whose protocol allows `max_new_tokens` new tokens."""
    task = verifiers.Task("d", "math", [{"question": "q", "answer": "1"}] * len(prompts), "")
    protocol = evaluation.EvalProtocol(max_new_tokens=max_new_tokens)
    return evaluation.EvalSet("d", task, protocol, len(prompts), prompts)


# ----- set-up and summary


def test_requirements_ask_only_for_extras_their_packages_provide():
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        lines = [line.split("#")[0].strip() for line in f]
    for line in filter(None, lines):
        m = re.match(r"([A-Za-z0-9_.-]+)\[([^\]]+)\]", line)
        if m:
            provided = importlib.metadata.metadata(m.group(1)).get_all("Provides-Extra") or []
            for extra in m.group(2).split(","):
                assert extra.strip() in provided, f"{m.group(1)} provides no extra {extra!r} (it has {provided})"


def test_eval_only_summary_shows_one_value_per_metric(capsys):
    evaluation.print_summary("x eval-only", None, {"eval/pass@1": 0.5, "eval/pass@4": 0.75}, {"eval": 1.0}, 1.0)
    out = capsys.readouterr().out
    assert "eval/pass@1    0.5000" in out and "eval/pass@4    0.7500" in out
    assert "before" not in out and "n/a" not in out
    evaluation.print_summary("x", {"eval/pass@1": 0.25}, {"eval/pass@1": 0.5}, {}, 1.0)
    assert "before 0.2500  after 0.5000" in capsys.readouterr().out
