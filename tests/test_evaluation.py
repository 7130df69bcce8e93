"""Evaluation a researcher can cite (docs/evaluation.md): every named set whole, each set's own protocol (the field's
presets, the run-wide flags, --eval-protocol), greedy decoding and top-p in the engines, the graders (lm-eval's GSM8K
extraction, golds of several answers), each score's standard error over problems, maj@k, every completion kept and
scored again, and compare.py's intervals: numbers computed by hand, a statistical test of the top-p sampler."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

import compare
import engines
import evaluation
import grpo
import models
import run
import verifiers
from tests import references, tiny

# ----- the sets: whole when named, a hold-out only from the training source


def thirty(tmp_path, name="bench.jsonl", field="question"):
    rows = [{field: f"What is {i} + 1?", "answer": str(i + 1), "id": f"p{i}"} for i in range(30)]
    return tiny.write_jsonl(str(tmp_path / name), rows)


def test_a_local_file_named_as_an_eval_set_is_scored_whole(tmp_path, capsys):
    """08e5dbc carved a fifth of any source that is not in the registry: 6 of these 30 problems were evaluated."""
    path = thirty(tmp_path)
    (eval_set,) = evaluation.load_sets(grpo.Args(eval_dataset=[path], reward="arith"))
    assert len(eval_set.task.problems) == 30 and eval_set.n_source == 30 and eval_set.scope() == "30 of 30 problems"
    train_path = thirty(tmp_path, "train.jsonl")
    args = grpo.Args(dataset=train_path, eval_dataset=[path], reward="arith")
    train = verifiers.load_training_task(args)
    assert len(train.problems) == 30  # evaluated on another source: the training file whole as well
    (eval_set,) = evaluation.load_sets(args, train)
    assert len(eval_set.task.problems) == 30 and "held out" not in capsys.readouterr().out


def test_the_hold_out_is_carved_only_from_the_training_source_and_said(tmp_path, capsys):
    path = thirty(tmp_path)
    for eval_dataset in ([], [path]):  # no --eval-dataset, or the training file named in it
        args = grpo.Args(dataset=path, eval_dataset=eval_dataset, reward="arith")
        train = verifiers.load_training_task(args)
        (held,) = evaluation.load_sets(args, train)
        assert (len(train.problems), len(held.task.problems)) == (24, 6)  # a fifth held out, disjoint
        assert not {p["question"] for p in train.problems} & {p["question"] for p in held.task.problems}
        assert "dataset " + path + ": 6 problems held out for evaluation, 24 for training" in capsys.readouterr().out
        assert held.scope() == f"6 of 6 problems, held out of {path} (its other 24 train)"
    # --eval-only with the file named: nothing is trained, the set is used whole
    (whole,) = evaluation.load_sets(grpo.Args(dataset=path, eval_dataset=[path], reward="arith", eval_only=True))
    assert len(whole.task.problems) == 30


def test_name_equals_file_is_a_registry_sets_copy_with_its_preset_and_fields(tmp_path):
    """An offline copy of AIME24 in a local file: its label, its preset's protocol, its registry field names (the
    copy's `problem` and, of ('answer', 'solution'), the `answer` it has)."""
    rows = [{"problem": f"Find {i} squared.", "answer": str(i * i), "solution": "long text"} for i in range(1, 31)]
    path = tiny.write_jsonl(str(tmp_path / "aime24_test.jsonl"), rows)
    (eval_set,) = evaluation.load_sets(grpo.Args(eval_dataset=[f"aime24={path}"]))
    assert eval_set.label == "aime24" and len(eval_set.task.problems) == 30
    assert eval_set.task.problems[3]["answer"] == "16" and eval_set.task.problems[3]["question"] == "Find 4 squared."
    p = eval_set.protocol
    assert (p.preset, p.n, p.temperature, p.top_p, p.max_new_tokens, p.grader) == ("aime24", 64, 0.6, 0.95, 32768, "math")
    assert "open-r1" in p.source and p.instruction == evaluation.LIGHTEVAL_MATH
    # a plain local file takes the run-wide flags: no preset
    (plain,) = evaluation.load_sets(grpo.Args(eval_dataset=[path], question_field="problem"))
    assert (plain.label, plain.protocol.preset, plain.protocol.n) == ("aime24_test", "", 4)


# ----- protocols: the run-wide flags, a preset, --eval-protocol


def test_the_default_runs_protocol_is_unchanged():
    """arith: 100 held-out problems, n 4, T 0.6, top-p 1, 32 tokens, pass@4 (08e5dbc's evaluation of a default run)."""
    (p,) = evaluation.protocols(grpo.Args()).values()
    assert (p.n, p.temperature, p.top_p, p.max_new_tokens, p.k, p.maj, p.limit, p.preset) == (4, 0.6, 1.0, 32, (4,), (), 0, "")
    (eval_set,) = evaluation.load_sets(grpo.Args())
    assert len(eval_set.task.problems) == 100 and eval_set.n_source == 100
    # the same 100 problems as 08e5dbc's (the first 100 of the 200 its training never sees)
    assert eval_set.task.problems == verifiers.arith_problems(200, seed=verifiers.ARITH_EVAL_SEED_OFFSET + 1)[:100]


def test_each_set_has_its_own_protocol(tmp_path):
    path = thirty(tmp_path)
    args = grpo.Args(
        eval_dataset=["gsm8k", "math500", path],
        eval_samples=8,
        eval_k=[2, 8],
        eval_max_new_tokens=64,
        eval_protocol=[
            "math500.n=16",
            "math500.k=1,4,16",
            "bench.top_p=0.9",
            "*.max_new_tokens=512",
            "gsm8k.grader=gsm8k-strict",
        ],
    )
    got = evaluation.protocols(args)
    assert list(got) == ["gsm8k", "math500", "bench"]
    gsm, m500, bench = got.values()
    # gsm8k: lm-eval's preset (greedy, one sample), its grader overridden; the wildcard's budget over the preset's
    assert (gsm.n, gsm.temperature, gsm.k, gsm.max_new_tokens, gsm.grader) == (1, 0.0, (1,), 512, "gsm8k-strict")
    assert "changed here: max_new_tokens=512, grader=gsm8k-strict" in gsm.source
    assert (m500.n, m500.k, m500.temperature, m500.top_p) == (16, (1, 4, 16), 0.6, 0.95)
    # a local file: the run-wide flags, then its own fields
    assert (bench.n, bench.k, bench.top_p, bench.max_new_tokens, bench.preset) == (8, (2, 8), 0.9, 512, "")


def test_config_takes_eval_protocol_as_a_mapping(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "eval_dataset: [aime24, math500]\neval_protocol:\n  aime24: {n: 16, k: [1, 16]}\n  '*': {max_new_tokens: 4096}\n"
    )
    args = grpo.Args(**run.load_config(str(cfg), grpo.Args))
    assert args.eval_protocol == ["aime24.n=16", "aime24.k=1,16", "*.max_new_tokens=4096"]
    aime, m500 = evaluation.protocols(args).values()
    assert (aime.n, aime.k, aime.max_new_tokens, m500.max_new_tokens, m500.n) == (16, (1, 16), 4096, 4096, 4)


def test_a_run_wide_flag_a_preset_set_does_not_take_is_said(capsys):
    evaluation.protocols(grpo.Args(eval_dataset=["aime24"], eval_samples=8), notes=True)
    err = capsys.readouterr().err
    assert "note: --eval-samples applies to evaluation sets without a preset; aime24 keep their preset's n" in err
    evaluation.protocols(grpo.Args(eval_dataset=["aime24"]), notes=True)
    assert capsys.readouterr().err == ""  # nothing given: nothing to say


def test_every_preset_runs_and_names_its_source():
    for name, fields in evaluation.EVAL_PRESETS.items():
        protocol = evaluation.EvalProtocol(**fields)
        assert evaluation.protocol_problem(protocol, {f: f for f in evaluation.SET_FIELDS}) is None, name
        assert protocol.source and ("(" in protocol.source), name  # each names its public source
        assert name in verifiers.HUB_DATASETS or name in verifiers.BUILTIN_DATASETS, name


# ----- the engines: greedy and top-p


def test_greedy_twice_gives_the_same_completions_and_is_the_argmax(tmp_path):
    model_dir = tiny.make_tiny_model(str(tmp_path / "m"), init_range=0.5)
    model = models.load_model(model_dir, torch.device("cpu"))
    tok = models.load_tokenizer(model_dir)
    engine = engines.HFEngine(model, tok, gen_batch_size=4, return_logps=True)
    prompts = [tok("ab", add_special_tokens=False)["input_ids"], tok("cde", add_special_tokens=False)["input_ids"]]
    first = engine.generate(prompts, 1, 6, 0.0, seed=1)
    second = engine.generate(prompts, 1, 6, 0.0, seed=2)  # another seed: greedy draws nothing
    assert tiny.completions(first) == tiny.completions(second)
    for r, ids in enumerate(prompts):  # each token the most likely one after the prompt and the tokens before it
        seq = list(ids)
        for tok_id in first.completion(r):
            with torch.no_grad():
                logits = model(torch.tensor([seq])).logits[0, -1]
            assert tok_id == int(logits.argmax())
            seq.append(tok_id)
    # the reference (transformers' generate with do_sample=False) agrees
    reference = references.ReferenceHFEngine(model, tok, gen_batch_size=4)
    assert tiny.completions(reference.generate(prompts, 1, 6, 0.0)) == tiny.completions(first)


def test_top_p_keeps_the_nucleus_and_draws_in_proportion():
    """The exact distribution top-p sampling must give: the most likely tokens whose probabilities first reach top_p,
    renormalised (transformers' TopPLogitsWarper keeps the same set); 200k draws within 5 standard deviations."""
    from transformers.generation.logits_process import TopPLogitsWarper

    probs = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
    scores = probs.log().unsqueeze(0)
    for top_p in (0.5, 0.7, 0.9, 0.96):
        kept = torch.isfinite(TopPLogitsWarper(top_p)(None, scores.clone()))[0]
        want = torch.where(kept, probs, torch.zeros(())) / probs[kept].sum()
        n = 200_000
        g = torch.Generator().manual_seed(int(top_p * 100))
        drawn = engines.sample_from_logits(scores.expand(n, -1), torch.rand(n, generator=g), top_p)
        freq = torch.bincount(drawn, minlength=6).double() / n
        assert torch.all(freq[~kept] == 0), top_p
        sd = (want * (1 - want) / n).sqrt().double()
        assert torch.all((freq - want.double()).abs() <= 5 * sd + 1e-12), (top_p, freq, want)
    # top_p 1 draws exactly what it drew before (the same token for the same uniform)
    u = torch.rand(1000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(
        engines.sample_from_logits(scores.expand(1000, -1), u), engines.sample_from_logits(scores.expand(1000, -1), u, 1.0)
    )


def test_the_vllm_engine_passes_greedy_and_top_p_to_its_sampling_params():
    from tests import fake_vllm

    calls = []
    engine = engines.VLLMEngine.__new__(engines.VLLMEngine)
    engine._vllm = fake_vllm
    engine._logit_bias = None
    params = engine._sampling_params(1, 16, 0.0, 7, 0.95)
    calls.append(params)
    assert params.temperature == 0.0 and params.n == 1
    params = engine._sampling_params(4, 16, 0.6, 7, 0.95)
    assert params.top_p == 0.95 and params.temperature == 0.6


# ----- graders


@pytest.mark.parametrize(
    "completion,strict,flexible",
    [
        ("16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18", "18", "18"),
        ("She makes $18.", None, "$18."),
        ("#### 1,234 and later 7", "1,234", "7"),  # strict: the first '#### N'; flexible: the last number
        ("no number here", None, None),
        ("The answer is -5", None, "-5"),
    ],
)
def test_gsm8k_answers_as_lm_eval_extracts_them(completion, strict, flexible):
    assert verifiers.gsm8k_answer(completion, True) == strict
    assert verifiers.gsm8k_answer(completion, False) == flexible


def test_gsm8k_reward_by_lm_eval_exact_match():
    gold = verifiers.read_answer("Janet sells 9 eggs...\n#### 1,234", "gsm8k")[0]
    assert gold == "1234"
    assert verifiers.gsm8k_reward("so #### 1,234", gold, True) == 1.0  # ',' removed on both sides
    assert verifiers.gsm8k_reward("the total is $1,234.", gold, False) == 1.0  # '$' and a final '.' removed
    assert verifiers.gsm8k_reward("the total is 1234.00", gold, False) == 0.0  # exact match: 1234.00 is not 1234
    assert verifiers.gsm8k_reward("#### 1234", "1234", True) == 1.0 and verifiers.gsm8k_reward("1234", "1234", True) == 0.0
    # the GSM8K answer format scores under the gsm8k graders, not under the boxed math grader
    task = verifiers.Task("gsm8k", "math", [], "")
    rewards, answers = verifiers.grade(task, "gsm8k-flexible", [{"answer": "18"}] * 2, ["#### 18", "so 17"])
    assert rewards == [1.0, 0.0] and answers == ["18", "17"]


def test_a_gold_of_several_answers_needs_every_one():
    """08e5dbc kept a MATH solution's last box only: the complete answer '1, -2' scored 0."""
    gold, fmt = verifiers.read_answer("so $x = \\boxed{1}$ or $x = \\boxed{-2}$ (and $\\boxed{1}$ again)", "boxed")
    assert (gold, fmt) == (["1", "-2"], "boxed")
    assert verifiers.read_answer(["$1$", "$-2$"], "auto")[0] == ["$1$", "$-2$"]  # OlympiadBench's final_answer list
    assert verifiers.read_answer(["$7$"], "auto")[0] == "$7$"
    for completion, want in [
        ("The roots are \\boxed{1} and \\boxed{-2}.", 1.0),
        ("\\boxed{-2, 1}", 1.0),
        ("\\boxed{x = 1, x = -2}", 1.0),
        ("\\boxed{1}", 0.0),  # fewer
        ("\\boxed{1} and \\boxed{-2} and \\boxed{3}", 0.0),  # more
        ("\\boxed{1, -2, 3}", 0.0),
    ]:
        assert verifiers.math_reward(completion, gold) == want, completion
        assert verifiers.math_reward(completion, ["$1$", "$-2$"]) == want, completion
    assert verifiers.math_reward("\\boxed{1}", "1") == 1.0  # one gold: the last box, as before


# ----- the numbers: standard errors, maj@k, kept completions


class Scripted:
    """completions texts[i * n + j] (sample j of problem i), as the engines return them."""

    def __init__(self, texts, finish=None):
        self.texts, self.finish = texts, finish

    def generate(self, prompts, n, max_new_tokens, temperature, seed=None, desc="", top_p=1.0, group_ids=None):
        self.seen = (n, max_new_tokens, temperature, top_p)
        finish = self.finish or ["stop"] * len(self.texts)
        return references.rollout_from_rows(
            [p for p in prompts for _ in range(n)], [[5, 6]] * len(self.texts), self.texts, finish
        )


def math_set(answers, **protocol):
    task = verifiers.Task("s", "math", [{"question": f"q{i}", "answer": a} for i, a in enumerate(answers)], "")
    p = evaluation.EvalProtocol(**{"grader": "math", **protocol})
    return evaluation.EvalSet("s", task, p, len(answers), [[1]] * len(answers))


def test_standard_errors_and_maj_at_k_by_hand():
    # 3 problems, 4 samples: problem 0 right 3/4 (majority '2'), 1 right 1/4 (majority '9', wrong), 2 right 0/4
    texts = ["\\boxed{2}", "\\boxed{2}", "\\boxed{3}", "\\boxed{2}"]
    texts += ["\\boxed{5}", "\\boxed{9}", "\\boxed{9}", "no box"]
    texts += ["\\boxed{1}", "\\boxed{1}", "\\boxed{0}", "\\boxed{0}"]  # a tie: the answer given first wins ('1')
    engine = Scripted(texts)
    m, records = evaluation.evaluate(engine, math_set(["2", "5", "7"], n=4, k=(2,), maj=(4, 1)), seed=0)
    per_problem = [0.75, 0.25, 0.0]
    mean = sum(per_problem) / 3
    se = math.sqrt(sum((v - mean) ** 2 for v in per_problem) / 2 / 3)
    assert m["eval/pass@1"] == pytest.approx(mean) and m["eval/pass@1_se"] == pytest.approx(se)
    pass2 = [1 - math.comb(1, 2) / math.comb(4, 2), 1 - math.comb(3, 2) / math.comb(4, 2), 0.0]  # 1 - C(n-c,k)/C(n,k)
    assert m["eval/pass@2"] == pytest.approx(sum(pass2) / 3)
    assert m["eval/maj@4"] == pytest.approx(1 / 3)  # only problem 0's majority is right
    assert m["eval/maj@4_se"] == pytest.approx(math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2 / 3))
    assert m["eval/maj@1"] == pytest.approx(2 / 3)  # maj@1: the first sample ('2' and '5' right, '1' wrong)
    assert [r["extracted"] for r in records[4:8]] == ["5", "9", "9", None]
    assert len(records) == 12 and [r["sample"] for r in records[:4]] == [0, 1, 2, 3]  # problems x n, every one kept
    assert engine.seen == (4, 32, 0.6, 1.0)
    assert (m["eval/n_samples"], m["eval/top_p"], m["eval/max_new_tokens"], m["eval/grader"]) == (4, 1.0, 32, "math")


def test_truncation_is_logged_and_said(tmp_path, capsys):
    texts = ["\\boxed{2}", "\\boxed{2", "\\boxed{2", "\\boxed{2"]
    eval_set = math_set(["2"], n=4, k=(1,))
    engine = Scripted(texts, ["stop", "length", "length", "length"])
    logger = evaluation.common.RunLogger(str(tmp_path))
    args = grpo.Args(total_steps=3)
    m = evaluation.run_evaluation(args, engine, [eval_set], logger, 0, 0, 0.0)
    assert m["eval/truncated_frac"] == 0.75
    out = capsys.readouterr()
    assert "eval step 0/3 | s: 1 of 1 problems, n 4, T 0.6, top-p 1, 32 tokens, grader math" in out.out
    assert "pass@1 (avg@4) 0.2500 | length 2.0, cut 75%" in out.out  # one problem: no standard error
    assert "warning: eval s: 75% of the answers were cut at 32 tokens" in out.err and "--eval-max-new-tokens" in out.err
    args = grpo.Args(total_steps=3, eval_only=True)
    evaluation.run_evaluation(args, Scripted(texts[:1]), [math_set(["2"], n=1, k=(1,))], logger, 0, 0, 0.0)
    line = capsys.readouterr().out
    assert line.startswith("eval | s:") and "step" not in line  # an evaluation alone speaks of no training step


def test_kept_completions_are_scored_again_without_generating(tmp_path):
    texts = ["The answer is 7. #### 7", "#### 8", "so 12", "#### 12"]
    task = verifiers.Task("g", "math", [{"question": "a", "answer": "7"}, {"question": "b", "answer": "12"}], "")
    eval_set = evaluation.EvalSet("g", task, evaluation.EvalProtocol(n=2, k=(2,), grader="gsm8k-flexible"), 2, [[1], [1]])
    logger = evaluation.common.RunLogger(str(tmp_path))
    m = evaluation.run_evaluation(grpo.Args(), Scripted(texts), [eval_set], logger, 5, 0, 0.0)
    path = tmp_path / "eval_completions_step5_g.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["text"] for r in records] == texts and {"id", "tokens", "finish_reason", "extracted", "correct"} <= records[
        0
    ].keys()
    again = evaluation.rescore(str(path), "gsm8k-flexible", k=(2,))
    assert again["eval/pass@1"] == m["eval/pass@1"] == 0.75 and again["eval/pass@2"] == m["eval/pass@2"]
    strict = evaluation.rescore(str(path), "gsm8k-strict", maj=(2,))
    assert strict["eval/pass@1"] == 0.5  # '#### 8' is wrong, 'so 12' has no '####'
    assert strict["eval/maj@2"] == 1.0  # a's tie 7-8: the first answer given (7); b: '12', the only answer read off
    protocols = json.loads((tmp_path / "eval_protocols.json").read_text())
    assert protocols["g"]["grader"] == "gsm8k-flexible" and protocols["g"]["problems"] == "2 of 2 problems"


# ----- compare.py: intervals over seeds, protocols kept apart, the paired bootstrap


def test_t_quantiles_and_interval_by_hand():
    for df, t in ((1, 12.706204736), (2, 4.302652730), (4, 2.776445105), (10, 2.228138852), (30, 2.042272456)):
        assert compare.t_quantile(0.975, df) == pytest.approx(t, abs=1e-8)
    mean, half = compare.t_interval([0.5, 0.7, 0.6])
    assert mean == pytest.approx(0.6) and half == pytest.approx(4.302652730 * 0.1 / math.sqrt(3))
    assert compare.t_interval([0.4]) == (0.4, None)


def test_the_bootstrap_matches_the_exact_resampling_distribution():
    """Four problems: all 4^4 = 256 resamples enumerated give the exact bootstrap distribution of the mean."""
    diffs = [0.0, 0.25, 0.5, -0.25]
    exact = sorted(sum(c) / 4 for c in itertools.product(diffs, repeat=4))
    mean, low, high = compare.paired_bootstrap(diffs, resamples=20000, seed=3)
    assert mean == pytest.approx(0.125)
    cdf = lambda x: sum(v <= x + 1e-12 for v in exact) / len(exact)
    assert 0.01 <= cdf(low) <= 0.06 and 0.94 <= cdf(high) <= 0.999  # the 2.5 % and 97.5 % points, to a step


def write_eval_run(root, name, exp, seed, scores, protocol="n=2 T=0.6", label="s"):
    """A run whose final evaluation kept its completions: problem i right in `scores[i]` of its 2 samples."""
    d = root / name
    d.mkdir()
    (d / "args.json").write_text(json.dumps({"exp_name": exp, "seed": seed}))
    p1 = sum(scores) / (2 * len(scores))
    rows = [
        {"step": 0, "update": 0, "wall_s": 1.0, "eval/pass@1": 0.0, "eval/protocol": protocol, "eval/n_samples": 2},
        {"step": 1, "update": 1, "wall_s": 2.0, "rollout/reward_mean": 0.0},
        {"step": 1, "update": 1, "wall_s": 3.0, "eval/pass@1": p1, "eval/protocol": protocol, "eval/n_samples": 2},
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "eval_protocols.json").write_text(json.dumps({label: {}}))
    with open(d / f"eval_completions_step1_{label}.jsonl", "w") as f:
        for i, c in enumerate(scores):
            for j in range(2):
                f.write(json.dumps({"problem": i, "id": f"p{i}", "sample": j, "correct": j < c}) + "\n")
    return str(d)


def test_a_protocol_mismatch_is_kept_apart(tmp_path, capsys):
    write_eval_run(tmp_path, "a1", "grpo", 1, [1, 2], protocol="n=2 T=0.6 problems=2/2")
    write_eval_run(tmp_path, "a2", "grpo", 2, [2, 2], protocol="n=2 T=1 problems=2/2")  # the same flags, another protocol
    assert compare.main([str(tmp_path / "*"), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "note: s was evaluated under 2 different protocols" in out
    rows = [line for line in out.splitlines() if line.startswith("| grpo")]
    assert rows == ["| grpo | 2 (1,2) | 3 +- 0 | 0 +- 0 | 0 +- 0 | 0.0 +- 0.0 | 3 +- 0 | - |"] + [
        "| grpo | 1 (1) | 0.000 | 0.750 |",  # each protocol its own table: the seeds never averaged (0.875)
        "| grpo | 1 (2) | 0.000 | 1.000 |",
    ]


def test_the_paired_bootstrap_over_problems_against_the_baseline(tmp_path, capsys):
    write_eval_run(tmp_path, "g1", "grpo", 1, [0, 1, 2, 1])
    write_eval_run(tmp_path, "g2", "grpo", 2, [1, 1, 2, 0])
    write_eval_run(tmp_path, "p1", "gapo", 1, [2, 1, 2, 2])
    write_eval_run(tmp_path, "p2", "gapo", 2, [1, 2, 2, 0])
    write_eval_run(tmp_path, "p3", "gapo", 3, [2, 2, 2, 2])  # no baseline run of seed 3
    assert compare.main([str(tmp_path / "*"), "--no-plot", "--baseline", "grpo"]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("| gapo - grpo | s |")]
    # per problem, the seed-averaged pass@1 difference: ((1 - 0) + (0.5 - 0.5)) / 2 / ... = [0.5, 0.25, 0, 0.25]
    diffs = [((2 - 0) / 2 + (1 - 1) / 2) / 2, ((1 - 1) / 2 + (2 - 1) / 2) / 2, 0.0, ((2 - 1) / 2 + 0) / 2]
    mean, low, high = compare.paired_bootstrap(diffs)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == compare.g4(mean, "+") == "+0.25"
    assert cells[3] == f"[{compare.g4(low, '+')}, {compare.g4(high, '+')}]"
    assert cells[4:7] == ["4", "2", "3 (gapo only)"]
