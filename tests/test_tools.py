"""--tools (tools.py, docs/tools.md): the calculator by hand, the forced result tokens and the masks by hand, several
calls, the call budget, a tool's failures, the trainer's tokens equal to the engine's (a case where re-encoding the
text changes the ids), no gradient through the tools' tokens."""

from __future__ import annotations

import pytest
import torch

import common
import engines
import models
import tools


@pytest.fixture(scope="module")
def tok():
    return models.load_tokenizer(models.EMBEDDED_MODEL)


def ids(tok, pieces):
    """Token ids of the given pieces, each one token (the test's way to write a non-canonical sequence)."""
    out = []
    for piece in pieces:
        found = tok(piece, add_special_tokens=False).input_ids
        assert len(found) == 1, (piece, found)
        out += found
    return out


@pytest.mark.parametrize(
    "expression, value",
    [("17*23", "391"), ("2**10", "1024"), ("(3+4)*5 - 2/4", "34.5"), ("7 // 2 % 3", "0"), ("-(2-5)", "3"), ("6/4", "1.5")],
)
def test_the_calculator_computes_by_hand(expression, value):
    assert tools.calculate(expression) == value


@pytest.mark.parametrize(
    "expression, error",
    [
        ("1/0", "division by zero"),
        ("__import__('os').system('true')", "not Call"),
        ("abc", "not Name"),
        ("9**9**9", "exponent too large"),
        ("10**200", "exponent too large"),
        ("1e308*10", "not a finite number"),
        ("", "empty expression"),
        ("2 +", "not an arithmetic expression"),
        ("'a'*3", "not Constant"),
    ],
)
def test_a_failing_call_returns_an_error_text_and_never_raises(expression, error):
    text, ok = tools.run_tool("calc", expression)
    assert not ok and text.startswith("error: ") and error in text


def test_the_result_is_forced_after_the_closing_token_and_the_budget_counts(tok):
    box = tools.Toolbox(["calculator"], 2, tok)
    completion = ids(tok, ["<", "calc", ">", "1", "7", "*", "2", "3", "</", "calc", ">"])
    turns = []
    forced = box.after(turns, completion)
    assert forced == tok("<output>391</output>", add_special_tokens=False).input_ids
    assert turns == [dict(tool="calc", call="17*23", output="391", ok=True, start=11, end=11 + len(forced))]
    assert box.after(turns, completion + forced) is None  # the segment after the result holds no call
    second = completion + forced + ids(tok, ["<", "calc", ">", "1", "/", "0", "</", "calc", ">"])
    result = box.after(turns, second)
    assert tok.decode(result) == "<output>error: division by zero</output>" and turns[-1]["ok"] is False
    third = second + result + ids(tok, ["<", "calc", ">", "2", "+", "2", "</", "calc", ">"])
    assert box.after(turns, third) is None and len(turns) == 2  # --max-tool-calls 2: the third stays plain text


def test_an_eos_in_a_result_is_plain_text(tok):
    box = tools.Toolbox(["calculator"], 1, tok)
    forced = box.result_ids("a <|im_end|> b")
    assert tok.eos_token_id not in forced and tok.convert_tokens_to_ids("<|im_end|>") not in forced


def test_a_closer_is_every_token_whose_piece_holds_a_closing_bracket(tok):
    box = tools.Toolbox(["calculator", "python"], 1, tok)
    assert ids(tok, [">"])[0] in box.closer_ids and ids(tok, ["calc"])[0] not in box.closer_ids
    assert not set(tok.all_special_ids) & box.closer_ids


def rollout_with_calls():
    out = common.RolloutBatch(with_engine_logps=True)
    out.append_row([1, 2], [5, 6, 7, 8, 9, 10], "a", "stop", [-0.1] * 6)
    out.append_row([1, 2], [5, 6, 7], "b", "stop", [-0.2] * 3)
    out.append_row([3], [4, 4, 4, 4], "c", "length", [-0.3] * 4)
    out.tool_turns = [[dict(start=2, end=4, ok=True)], [], [dict(start=1, end=2, ok=False), dict(start=3, end=4, ok=True)]]
    return out


def test_the_masks_by_hand():
    rollout = rollout_with_calls()
    expected = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 1, 0, 0, 0]], dtype=torch.float32)
    assert torch.equal(common.completion_mask_of(rollout), expected)
    assert torch.equal(common.completion_mask_of(rollout, [2, 0]), expected[[2, 0]])
    padded = common.token_batch_of(rollout, [0, 1, 2], pad_id=0)
    assert torch.equal(padded.completion_mask, expected)
    packed = common.token_batch_of(rollout, common.MicroBatch.of_packs([[0, 1], [2]]), pad_id=0)
    assert torch.equal(packed.completion_mask, expected)
    assert len(packed.gather) == int(expected.sum())  # one hidden state per policy token
    metrics = common.RolloutCorrection(rollout, expected).metrics()
    assert metrics["tools/calls_per_completion"] == 1.0 and metrics["tools/call_frac"] == pytest.approx(2 / 3)
    assert metrics["tools/error_frac"] == pytest.approx(1 / 3) and metrics["tools/token_frac"] == pytest.approx(4 / 13)
    correction = common.RolloutCorrection(rollout, expected)
    assert torch.allclose(correction.engine[2], torch.tensor([-0.3] * 4 + [0.0] * 2))  # every token's mu, in place


def tiny_model(tok, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("packed", [False, True])
def test_the_tools_tokens_carry_no_gradient(tok, packed):
    """The loss over the policy's tokens equals a reference computed from full logits at the policy's positions
    only, and so does its gradient: the tools' tokens are context, never targets."""
    model = tiny_model(tok)
    rollout = rollout_with_calls()
    micro = common.MicroBatch.of_packs([[0, 1], [2]]) if packed else [0, 1, 2]
    batch = common.token_batch_of(rollout, micro, pad_id=0)
    logp, _ = common.completion_logps(model, batch, 1.0, with_entropy=False)
    mask = common.completion_mask_of(rollout)
    assert torch.all(logp[mask == 0] == 0)
    loss = (logp * mask).sum()
    grads = torch.autograd.grad(loss, [p for p in model.parameters()])
    reference = 0.0
    for r in range(3):
        prompt, completion = rollout.prompt(r), rollout.completion(r)
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].log_softmax(-1)
        for t, target in enumerate(completion):
            if mask[r, t]:
                reference = reference + logits[len(prompt) + t - 1, target]
    expected = torch.autograd.grad(reference, [p for p in model.parameters()])
    assert torch.allclose(loss, reference, atol=1e-5)
    for g, e in zip(grads, expected):
        assert torch.allclose(g, e, atol=1e-5)


class Scripted(engines.HFEngine):
    """The HF engine with the model's draws replaced by a script per row (the policy's tokens in order)."""

    script: list[list[int]] = []

    def _sample(self, input_ids, attention, n, max_new_tokens, temperature, generators=None, top_p=1.0):
        self._at = [0] * input_ids.shape[0]
        return super()._sample(input_ids, attention, n, max_new_tokens, temperature, generators, top_p)

    def _draw(self, logits, live, t, n, decoding, generators, tokens, logps, ended, eos):
        for r in live.tolist():
            row = self.script[r]
            tokens[r, t] = row[min(self._at[r], len(row) - 1)]
            self._at[r] += 1
            if logps is not None:
                logps[r, t] = -1.0
        ended[live] = torch.isin(tokens[live, t], eos)
        return False


class ScriptedTools(engines.ToolHFEngine, Scripted):
    pass


def test_the_engine_forces_results_and_the_trainer_trains_on_the_engines_ids(tok):
    """Two rows: one calls twice (its policy tokens a non-canonical split: re-encoding its text changes the ids),
    one answers plainly; a third is cut by the budget inside a result."""
    call = ["<", "calc", ">", "1", "7", "*", "2", "3", "</", "calc", ">"]
    first = ids(tok, [" ", "hel", "lo", *call, " ", "so", *call]) + [tok.eos_token_id]
    plain = ids(tok, [" ", "4", "2"]) + [tok.eos_token_id]
    cut = ids(tok, call) + [tok.eos_token_id]
    ScriptedTools.script = [first, plain, cut]
    box = tools.Toolbox(["calculator"], 4, tok)
    engine = ScriptedTools(tiny_model(tok), tok, box, gen_batch_size=8, return_logps=True)
    prompt = tok("What is 17 * 23?", add_special_tokens=False).input_ids
    budget = 48
    out = engine.generate([prompt, prompt, prompt], 1, budget, 1.0, seed=0)
    result = tok("<output>391</output>", add_special_tokens=False).input_ids
    a, b = len(ids(tok, [" ", "hel", "lo", *call])), len(ids(tok, [" ", "so", *call]))
    expected = first[:a] + result + first[a : a + b] + result + first[a + b :]
    assert out.completion(0) == expected
    assert out.completion(1) == plain and out.tool_turns[1] == []
    second = a + len(result) + b
    assert [(t["start"], t["end"]) for t in out.tool_turns[0]] == [(a, a + len(result)), (second, second + len(result))]
    assert out.texts[0] == tok.decode(first, skip_special_tokens=True)  # the policy's own text: no result in it
    assert tok(tok.decode(first[: a + b]), add_special_tokens=False).input_ids != first[: a + b]  # re-encoding changes it
    assert out.engine_logp(0) == [-1.0] * a + [0.0] * len(result) + [-1.0] * b + [0.0] * len(result) + [-1.0]
    batch = common.token_batch_of(out, [0, 1], pad_id=tok.pad_token_id)
    assert batch.completion_ids[0, : len(expected)].tolist() == expected  # the engine's ids, not the text's
    mask = common.completion_mask_of(out)
    assert mask[0].sum() == len(expected) - 2 * len(result)
    assert mask[0, a : a + len(result)].sum() == 0


def test_the_budget_cuts_a_result(tok):
    call = ids(tok, ["<", "calc", ">", "1", "7", "*", "2", "3", "</", "calc", ">"])
    ScriptedTools.script = [call + [tok.eos_token_id]]
    engine = ScriptedTools(tiny_model(tok), tok, tools.Toolbox(["calculator"], 4, tok), gen_batch_size=8)
    out = engine.generate([[1, 2]], 1, len(call) + 3, 1.0, seed=0)
    result = tok("<output>391</output>", add_special_tokens=False).input_ids
    assert out.completion(0) == call + result[:3] and out.finish_reasons[0] == "length"
    assert out.tool_turns[0][0]["start"] == len(call) and out.tool_turns[0][0]["end"] == len(call) + 3


def test_bad_input_is_one_line_before_anything_loads():
    import run
    from verifiers import UserError

    with pytest.raises(UserError, match="calculator, python or both"):
        run.Args(tools=["abacus"])
    with pytest.raises(UserError, match="max_tool_calls|>= 1"):
        run.Args(tools=["calculator"], max_tool_calls=0)
    with pytest.raises(UserError, match="hf-decode"):
        tools.check_args(run.Args(tools=["calculator"], hf_decode="static"))
    with pytest.raises(UserError, match="--engine hf"):
        tools.check_args(run.Args(tools=["calculator"], engine="vllm"))
    tools.check_args(run.Args(tools=["calculator"], engine="hf"))
    import verifiers

    code = verifiers.Task("mbpp", "code", [], "")
    with pytest.raises(UserError, match="code task"):
        tools.check_tasks(run.Args(tools=["calculator"]), [code])


def test_write_rollouts_shows_the_turns(tok):
    import outputs

    rollout = common.RolloutBatch()
    call, result = ids(tok, ["<", "calc", ">", "2", "+", "2", "</", "calc", ">"]), tok("<output>4</output>").input_ids
    rollout.append_row([1], call + result + ids(tok, [" ", "4"]), "t", "stop")
    rollout.tool_turns = [[dict(tool="calc", call="2+2", output="4", ok=True, start=len(call), end=len(call) + len(result))]]
    record = outputs.turns_of(rollout, tok, 0)
    assert record["turns"] == [{"policy": "<calc>2+2</calc>"}, {"tool": "<output>4</output>"}, {"policy": " 4"}]
    assert record["tool_calls"] == [dict(tool="calc", call="2+2", output="4", ok=True)]
