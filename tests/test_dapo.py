"""DAPO's options in run.Args (arXiv:2503.14476), each off by default: --zero-variance mask, --dynamic-sampling
with --max-sampling-rounds, --overlong-buffer / --overlong-penalty, --truncated mask.

Hand values for the pieces (the overlong penalty, the rows that leave the loss, dynamic sampling's slots), then the
real scripts: the logged policy loss of the first update (ratio 1, so each token's loss is -A_i) against the loss
computed by hand from the rollouts the run dumped, with the masked rows out of every denominator."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import common
import models
import verifiers
from tests import references, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARD = os.path.join(ROOT, "tests", "dapo_rewards.py") + ":reward"


# ----- the overlong penalty and the rows out of the loss, by hand -------------------------------------------------


def test_overlong_penalty_by_hand():
    # L_max 10, buffer 4: no penalty up to 6 tokens, then -(len - 6) / 4 * penalty, -penalty at 10
    lengths = torch.tensor([1, 5, 6, 7, 8, 10])
    assert common.overlong_penalty(lengths, 10, 4, 1.0).tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -1.0]
    assert common.overlong_penalty(lengths, 10, 4, 0.5).tolist() == [0.0, 0.0, 0.0, -0.125, -0.25, -0.5]
    assert common.overlong_penalty(lengths, 10, 10, 1.0).tolist() == pytest.approx([-0.1, -0.5, -0.6, -0.7, -0.8, -1.0])


def _rollout(lengths, reasons, prompt=(5, 6)):
    completions = [[7] * n for n in lengths]
    return references.rollout_from_rows([list(prompt)] * len(lengths), completions, [""] * len(lengths), reasons)


def test_shaping_masks_truncated_rows_and_keeps_eos_at_the_limit():
    # G = 2, L_max 4: row 0 cut at the limit ("length"), row 1 ended with EOS exactly at the limit ("stop", 4 tokens
    # with the EOS), rows 2 and 3 short
    rollout = _rollout([4, 4, 2, 1], ["length", "stop", "stop", "stop"])
    rewards, ones = torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.ones(4)
    shaped, in_loss, metrics = common.dapo_shaping(rewards, ones, rollout, 2, 4, 2, 1.0, "keep", "mask")
    # overlong buffer 2: lengths 4, 4, 2, 1 -> penalties -1, -1, 0, 0 (the EOS-at-the-limit row too, as verl counts it)
    assert shaped.tolist() == [0.0, 0.0, 0.0, 1.0]
    assert in_loss.tolist() == [0.0, 1.0, 1.0, 1.0]  # only the truncated row leaves the loss
    assert metrics["rollout/overlong_penalty_mean"] == -0.5 and metrics["rollout/in_loss_frac"] == 0.75
    # --zero-variance mask looks at the shaped rewards: group 0 is now [0, 0] (all equal), group 1 [0, 1]
    _, in_loss, _ = common.dapo_shaping(rewards, ones, rollout, 2, 4, 2, 1.0, "mask", "keep")
    assert in_loss.tolist() == [0.0, 0.0, 1.0, 1.0]
    _, in_loss, _ = common.dapo_shaping(rewards, ones, rollout, 2, 4, 0, 1.0, "mask", "keep")  # no penalty: [1, 1]
    assert in_loss.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert common.varied_groups(torch.tensor([1.0, 1.0, 0.0, 0.5, 2.0, 2.0]), 2).tolist() == [False, True, False]


def test_zero_variance_mask_denominators_by_hand():
    """The update's arithmetic on two micro-batches: group A rewards [1, 0] (A = +-0.5, scale none), group B [1, 1]
    (A = 0); lengths 2, 1 | 3, 3. Ratio 1, so each token's loss is -A_i. token-mean: keep (-1 + 0.5) / 9, mask
    (-1 + 0.5) / 3; seq-mean-token-mean: keep (-0.5 + 0.5 + 0 + 0) / 4 = 0, mask 0 / 2; Dr. GRPO: keep
    (-1 + 0.5) / (4 * 3), mask (-1 + 0.5) / (2 * 3)."""
    import grpo

    A = torch.tensor([0.5, -0.5, 0.0, 0.0])
    lengths = [2, 1, 3, 3]
    mask = (torch.arange(3) < torch.tensor(lengths)[:, None]).float()  # (4, 3)
    expected = {
        ("token-mean", "keep"): -0.5 / 9,
        ("token-mean", "mask"): -0.5 / 3,
        ("seq-mean-token-mean", "keep"): 0.0,
        ("seq-mean-token-mean", "mask"): 0.0,
        ("seq-mean-token-sum-norm", "keep"): -0.5 / 12,
        ("seq-mean-token-sum-norm", "mask"): -0.5 / 6,
    }
    # seq-mean-token-mean gives 0 both ways here; a sign check with unequal per-row values:
    A_seq = torch.tensor([0.5, -0.25, 0.0, 0.0])
    for (agg, zv), want in expected.items():
        in_loss = torch.tensor([1.0, 1.0, 0.0, 0.0]) if zv == "mask" else torch.ones(4)
        for adv, target in ((A, want), (A_seq, None)):
            mb_rows = [0, 1, 2, 3]
            mb_tokens = max((mask[mb_rows].sum(1) * in_loss[mb_rows]).sum().item(), 1.0)  # as the scripts
            mb_seqs = in_loss[mb_rows].sum().item()
            unit = "token" if agg == "token-mean" else "sequence"
            total = 0.0
            for micro in ([0, 2], [1, 3]):
                micro_mask = mask[micro] * in_loss[micro].unsqueeze(1)
                logp = torch.zeros(2, 3, requires_grad=True)
                loss, _ = grpo.compute_policy_loss(logp, logp.detach(), adv[micro], micro_mask, loss_agg=agg, max_tokens=3)
                total += loss.item() * common.accumulation_weight(unit, micro_mask, mb_tokens, len(micro), mb_seqs)
            if target is None:  # seq-mean-token-mean with A_seq: keep (-0.5 + 0.25) / 4, mask (-0.5 + 0.25) / 2
                if agg == "seq-mean-token-mean":
                    assert math.isclose(total, -0.25 / (2 if zv == "mask" else 4), abs_tol=1e-7), (agg, zv, total)
                continue
            assert math.isclose(total, target, abs_tol=1e-7), (agg, zv, total, target)


# ----- dynamic sampling's slots ----------------------------------------------------------------------------------


def _round(rewards_by_group, G=2, tag=0):
    """A round: P groups with the given rewards; completion tokens tell (round tag, group, row)."""
    P = len(rewards_by_group)
    rows = [[100 + tag, g, j] for g in range(P) for j in range(G)]
    rollout = references.rollout_from_rows(
        [[1, g] for g in range(P) for _ in range(G)],
        rows,
        [f"{tag}/{g}/{j}" for g in range(P) for j in range(G)],
        ["stop"] * (P * G),
    )
    problem_idx = [10 * tag + g for g in range(P)]
    return problem_idx, rollout, torch.tensor([float(r) for rs in rewards_by_group for r in rs])


VARIED, EQUAL = (1, 0), (0, 0)


def test_dynamic_sampling_fills_the_slots_in_drawing_order():
    rounds = {0: _round([VARIED, EQUAL, VARIED, EQUAL], tag=0), 1: _round([EQUAL, VARIED, EQUAL, EQUAL], tag=1)}
    rounds[2] = _round([EQUAL, EQUAL, EQUAL, VARIED], tag=2)
    calls = []

    def sample_round(step, k, minibatches):
        calls.append((step, k))
        return rounds[k]

    plan = common.group_shuffled_minibatches(4, 2, 2, torch.Generator().manual_seed(0))
    idx, rollout, rewards, in_loss, metrics = common.dynamic_sampling(sample_round, 7, rounds[0], 2, 3, plan)
    assert calls == [(7, 1), (7, 2)]  # round 0 is given; rounds 1 and 2 drawn, then every slot is filled
    assert idx == [0, 2, 11, 23]  # slot order: (0, 0), (0, 2), (1, 1), (2, 3)
    assert [rollout.completion(r)[:2] for r in range(8)] == [[100, 0]] * 2 + [[100, 2]] * 2 + [[101, 1]] * 2 + [[102, 3]] * 2
    assert rollout.texts[4] == "1/1/0" and rollout.prompt(6) == [1, 3]
    assert rewards.tolist() == [1, 0, 1, 0, 1, 0, 1, 0] and in_loss.tolist() == [1.0] * 8
    assert metrics["dynamic/rounds"] == 3 and metrics["dynamic/kept_groups"] == 4
    assert metrics["dynamic/filler_groups"] == 0 and metrics["dynamic/sampled_groups"] == 12


def test_dynamic_sampling_trains_on_what_was_kept_when_the_rounds_run_out():
    rounds = {0: _round([VARIED, EQUAL, VARIED, EQUAL], tag=0), 1: _round([EQUAL, VARIED, EQUAL, EQUAL], tag=1)}
    plan = common.group_shuffled_minibatches(4, 2, 1, torch.Generator().manual_seed(0))
    idx, rollout, rewards, in_loss, metrics = common.dynamic_sampling(lambda s, k, m: rounds[k], 1, rounds[0], 2, 2, plan)
    # three kept groups; the fourth slot takes the last round's first group not used, out of the loss
    assert idx == [0, 2, 11, 10] and in_loss.tolist() == [1.0] * 6 + [0.0] * 2
    assert rewards.tolist() == [1, 0, 1, 0, 1, 0, 0, 0]
    assert metrics["dynamic/kept_groups"] == 3 and metrics["dynamic/filler_groups"] == 1
    # every group of round 0 varied: the rollout is round 0's own, nothing copied
    everything = _round([VARIED] * 4)
    same = common.dynamic_sampling(lambda s, k, m: pytest.fail("no second round"), 1, everything, 2, 5, plan)
    assert same[1] is everything[1] and same[3].tolist() == [1.0] * 8


def test_dynamic_sampling_fills_each_ranks_slots_with_its_own_groups(monkeypatch):
    """Two ranks, seen from rank 1: the plan deals groups 1 and 3 to rank 1 (the second group of each mini-batch);
    rank 0 needs one more round, rank 1 fills from its own groups only, and builds its share of the batch."""

    class TwoRanks:
        enabled, world_size, rank = True, 2, 1

    built = {}

    class Sharded:
        def __init__(self, local, groups, num_groups, n):
            built.update(local=local, groups=groups, num_groups=num_groups, n=n)

    monkeypatch.setattr(common, "world", lambda: TwoRanks)
    monkeypatch.setattr(common, "ShardedRollout", Sharded)
    plan = [[0, 1, 2, 3], [4, 5, 6, 7]]  # G = 2: mini-batch 0 holds groups 0, 1; mini-batch 1 groups 2, 3
    assert common.group_owners(plan, 2, 2) == [0, 1, 0, 1]
    rounds = {0: _round([EQUAL, VARIED, EQUAL, VARIED], tag=0), 1: _round([VARIED, EQUAL, VARIED, VARIED], tag=1)}
    idx, rollout, rewards, in_loss, metrics = common.dynamic_sampling(lambda s, k, m: rounds[k], 1, rounds[0], 2, 4, plan)
    # rank 0's slots (0, 2) from round 1's groups 0 and 2; rank 1's slots (1, 3) from its round-0 groups 1 and 3
    assert idx == [10, 1, 12, 3] and in_loss.tolist() == [1.0] * 8
    assert built["groups"] == [1, 3] and built["num_groups"] == 4
    assert [built["local"].completion(r)[:2] for r in range(4)] == [[100, 1]] * 2 + [[100, 3]] * 2
    assert metrics["dynamic/rounds"] == 2 and metrics["dynamic/varied_groups"] == 5


# ----- the real scripts --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    rows = [{"question": f"Say {w}", "answer": "0", "kind": kind} for w, kind in zip("abcd", ["zero", "varied"] * 2)]
    return tiny.toy_task(tmp_path_factory.mktemp("dapo"), rows=rows)


class VariedEngine:
    """Completions that depend only on (request seed, group, sample): 1 to max_new_tokens letters; a row of the
    maximum length either ends with EOS there ("stop") or is cut ("length"), a shorter one ends with EOS. The
    trainer scores them with the real tiny model (the first update's ratio is 1 whatever the engine)."""

    name = "varied"

    def __init__(self, tokenizer):
        self.tokenizer, self.eos = tokenizer, tokenizer.eos_token_id

    def generate(
        self, prompt_ids, n, max_new_tokens, temperature, seed=None, desc="", progress=True, group_ids=None, top_p=1.0
    ):
        import random

        out = common.RolloutBatch()
        for i, ids in enumerate(prompt_ids):
            g = group_ids[i] if group_ids is not None else i
            for j in range(n):
                rng = random.Random(f"{seed}/{g}/{j}")
                k = rng.randint(1, max_new_tokens)  # letters
                toks = self.tokenizer.encode("".join(rng.choice("abcdefgh") for _ in range(k)), add_special_tokens=False)
                cut = k == max_new_tokens and rng.random() < 0.5  # cut at the limit, no EOS
                if not cut:  # EOS after the letters, or in place of the last one at the maximum length
                    toks = toks[: max_new_tokens - 1] + [self.eos]
                out.append_row(ids, toks, self.tokenizer.decode(toks, skip_special_tokens=True), "length" if cut else "stop")
        return out

    def wake(self, model=None, version=None):
        return None

    def sleep(self):
        return None


@pytest.fixture
def varied_engine(monkeypatch):
    monkeypatch.setattr(models, "make_engine", lambda args, model, tokenizer, *a, **k: VariedEngine(tokenizer))


def _run(method, toy, out, name, steps=1, **overrides):
    import importlib

    mod = importlib.import_module(method)
    settings = dict(
        reward=REWARD,
        total_steps=steps,
        num_generations=4,
        max_new_tokens=4,
        learning_rate=1e-3,
        warmup_updates=0,
        updates_per_batch=1,
        eval_limit=1,
        eval_samples=1,
        eval_k=[1],
        log_rollouts_every=1,
    )
    mod.main(mod.Args(**tiny.run_settings(toy, out, name, **{**settings, **overrides})))
    with open(os.path.join(out, name, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    with open(os.path.join(out, name, "rollouts.jsonl")) as f:
        rollouts = [json.loads(line) for line in f]
    return [m for m in metrics if "losses/policy_loss" in m], rollouts


def _expected_first_loss(rows, in_loss, agg="token-mean", max_tokens=4):
    """The first update's policy loss by hand: ratio 1 (old = the first forward pass), so a token's loss is -A_i."""
    A = [r["advantage"] for r in rows]
    L = [r["length"] for r in rows]
    if agg == "token-mean":
        return sum(-a * n * w for a, n, w in zip(A, L, in_loss)) / sum(n * w for n, w in zip(L, in_loss))
    if agg == "seq-mean-token-mean":
        return sum(-a * w for a, w in zip(A, in_loss)) / sum(in_loss)
    return sum(-a * n * w for a, n, w in zip(A, L, in_loss)) / (sum(in_loss) * max_tokens)


def _varied(rows, G=4):
    groups = [rows[i : i + G] for i in range(0, len(rows), G)]
    return [float(len({r["reward"] for r in g}) > 1) for g in groups for _ in g]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_script_zero_variance_mask_loss_by_hand(toy, tmp_path, agg, varied_engine):
    """The first update of a run with --zero-variance mask against the same rollouts kept (the default): the
    policy loss by hand from the dumped rollouts, each with its own denominator, and the gradient norms, whose
    ratio is the ratio of the denominators (the masked rows have A = 0, so only the scale of the gradient
    differs). At ratio 1 seq-mean-token-mean's loss is 0 either way (sum_i A_i = 0 in a group): its gradient
    norm still shows the sequence count."""
    train, rows = _run("grpo", toy, tmp_path, f"zv-{agg}", zero_variance="mask", loss_agg=agg)
    varied = _varied(rows)
    assert 0 < sum(varied) < len(rows), "the test needs an equal-reward group and a varied one"
    assert train[0]["rollout/in_loss_frac"] == sum(varied) / len(rows)
    want = _expected_first_loss(rows, varied, agg)
    assert math.isclose(train[0]["losses/policy_loss"], want, rel_tol=1e-5, abs_tol=1e-7), (train[0], want)
    keep, rows_keep = _run("grpo", toy, tmp_path, f"keep-{agg}", loss_agg=agg)  # the default: every row counts
    assert [r["completion"] for r in rows_keep] == [r["completion"] for r in rows]  # the same rollouts
    want_keep = _expected_first_loss(rows_keep, [1.0] * len(rows), agg)
    assert math.isclose(keep[0]["losses/policy_loss"], want_keep, rel_tol=1e-5, abs_tol=1e-7)
    assert "rollout/in_loss_frac" not in keep[0]  # the default run logs what it logged before
    lengths = [r["length"] for r in rows]
    if agg == "token-mean":  # denominators: tokens in the loss
        scale = sum(lengths) / sum(n * w for n, w in zip(lengths, varied))
    else:  # sequences in the loss
        scale = len(rows) / sum(varied)
    assert scale > 1.2
    ratio = train[0]["losses/grad_norm"] / keep[0]["losses/grad_norm"]
    assert math.isclose(ratio, scale, rel_tol=1e-4), (ratio, scale)
    if agg != "seq-mean-token-mean":
        assert abs(want) > 1e-3 and math.isclose(want / want_keep, scale, rel_tol=1e-4), (want, want_keep, scale)


def test_script_truncated_mask_and_overlong_penalty(toy, tmp_path, varied_engine):
    train, rows = _run("grpo", toy, tmp_path, "trunc", truncated="mask", overlong_buffer=2, overlong_penalty=1.0)
    from tests.dapo_rewards import reward

    problems = {f"Say {w}": kind for w, kind in zip("abcd", ["zero", "varied"] * 2)}
    for r in rows:
        kind = next(k for q, k in problems.items() if q in r["prompt"])
        penalty = min(-(r["length"] - (4 - 2)) / 2 * 1.0, 0.0)  # L_max 4, buffer 2
        assert math.isclose(r["reward"], reward(r["completion"], {"kind": kind}) + penalty, abs_tol=1e-6), r
    kept = [float(r["finish_reason"] != "length") for r in rows]
    assert 0 < sum(kept) < len(rows), "the test needs a truncated row and one that stopped"
    want = _expected_first_loss(rows, kept)
    assert math.isclose(train[0]["losses/policy_loss"], want, rel_tol=1e-5, abs_tol=1e-8), (train[0], want)


@pytest.mark.parametrize("method", ["grpo", "gapo", "mugrpo", "codapo"])
def test_script_dynamic_sampling_trains_on_varied_groups(toy, tmp_path, method, varied_engine):
    extra = {"updates_per_batch": 2, "prompts_per_step": 4} if method == "mugrpo" else {}
    train, rows = _run(method, toy, tmp_path, "dyn", steps=2, dynamic_sampling=True, max_sampling_rounds=4, **extra)
    first = [m for m in train if "dynamic/rounds" in m]
    assert len(first) == 2, train  # one row per step carries the rollout metrics
    for step, m in zip((1, 2), first):
        groups = [r for r in rows if r["step"] == step]
        assert len(groups) == 16  # P x G rows: the batch keeps its size
        varied = _varied(groups)
        assert m["dynamic/kept_groups"] == sum(varied) / 4, (m, varied)  # kept = the groups that vary
        assert m["dynamic/kept_groups"] + m["dynamic/filler_groups"] == 4
        if m.get("codapo/focused_step") == 1.0:  # CoDaPO's focused step re-rolls learnable ("varied") questions only
            assert m["dynamic/rounds"] >= 1
        else:  # half the prompts always score 0: round 0 cannot fill every slot
            assert m["dynamic/rounds"] >= 2
        assert m["dynamic/sampled_groups"] == 4 * m["dynamic/rounds"]
        assert m["rollout/zero_adv_group_frac"] == m["dynamic/filler_groups"] / 4


def test_bad_dapo_flags_are_one_line_errors():
    import grpo

    with pytest.raises(verifiers.UserError, match="--overlong-buffer 40: must be in"):
        grpo.Args(max_new_tokens=32, overlong_buffer=40)
    with pytest.raises(verifiers.UserError, match="--max-sampling-rounds 0"):
        grpo.Args(max_sampling_rounds=0)
    with pytest.raises(verifiers.UserError, match="--overlong-penalty -1"):
        grpo.Args(overlong_penalty=-1.0)
