"""opd.py (on-policy distillation, docs/opd.md): the per-token advantage and the loss by hand, a toy categorical policy
that OPD drives onto its teacher (and a sign-flipped control that it drives away), a teacher equal to the student
(zero advantages, the model unchanged), the teacher's checks (none given, another tokenizer, LoRA adapters alone),
the verifier's rewards out of the loss without --opd-reward, resume, and LoRA. Several processes:
tests/test_distributed.py (opd among the scripts, 2 ranks against one)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import common
import engines
import models
import opd
import verifiers
from tests import tiny

CPU = torch.device("cpu")


def rows_of(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_rows(run_dir) -> list[dict]:
    return [r for r in rows_of(run_dir) if "losses/policy_loss" in r]


def weights(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def test_opd_advantages_by_hand():
    teacher = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])  # (B, T) log pi_T of the sampled tokens
    old = torch.tensor([[-1.5, -1.0], [-0.5, -3.0]])  # (B, T) log pi_old
    group = torch.tensor([0.5, 0.0])  # (B,) the verifier's group advantage
    adv = opd.opd_advantages(teacher, old, group, coef=2.0)
    # A_it = 2 (log pi_T - log pi_old) + A_i: 2*0.5+0.5, 2*(-1)+0.5; 2*0+0, 2*2.5+0
    assert torch.equal(adv, torch.tensor([[1.5, -1.5], [0.0, 5.0]]))


def test_policy_loss_with_per_token_advantages_by_hand():
    old = torch.tensor([[-1.0, -2.0]])
    adv = torch.tensor([[1.5, -1.5]])  # (B, T)
    mask = torch.tensor([[1.0, 0.0]])
    loss, _ = opd.compute_policy_loss(old.clone(), old, adv, mask)  # ratio 1: -A of the one token in the mask
    assert loss.item() == pytest.approx(-1.5)
    logp = old + torch.tensor([[torch.log(torch.tensor(1.5)).item(), 0.0]])  # ratio 1.5 > 1 + 0.2 with A > 0: clipped
    loss, stats = opd.compute_policy_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx(-1.5 * 1.2) and stats["clipfrac_high"] == 1.0  # max(-2.25, -1.8)
    mask2 = torch.ones(1, 2)  # the second token: A < 0 at ratio 1, -A = 1.5
    loss, _ = opd.compute_policy_loss(logp, old, adv, mask2)
    assert loss.item() == pytest.approx((-1.8 + 1.5) / 2)


def _categorical_opd(sign: float, steps: int = 300) -> tuple[float, float, int]:
    """A categorical policy over 5 tokens trained by OPD on its own samples (256 a step) toward a fixed teacher; sign
    -1 flips the advantage (a defect). Returns (KL(p || p_T) before, after, the policy's mode)."""
    gen = torch.Generator().manual_seed(0)
    teacher = torch.tensor([0.05, 0.60, 0.20, 0.10, 0.05]).log()  # (V,) log p_T, mode 1
    logits = torch.tensor([0.0, 0.0, 0.0, 2.0, 0.0], requires_grad=True)  # the student's mode: 3
    optimizer = torch.optim.Adam([logits], lr=0.05)

    def kl() -> float:
        logp = torch.log_softmax(logits.detach(), -1)
        return (logp.exp() * (logp - teacher)).sum().item()

    before = kl()
    for _ in range(steps):
        logp_all = torch.log_softmax(logits, -1)
        y = torch.multinomial(logp_all.detach().exp(), 256, replacement=True, generator=gen)  # on-policy samples
        logp = logp_all[y].unsqueeze(0)  # (1, N): one row of N sampled tokens
        old = logp.detach()
        adv = sign * opd.opd_advantages(teacher[y].unsqueeze(0), old, torch.zeros(1), coef=1.0)  # (1, N)
        loss, _ = opd.compute_policy_loss(logp, old, adv, torch.ones_like(logp))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return before, kl(), int(logits.argmax())


def test_opd_drives_a_toy_categorical_policy_onto_its_teacher():
    """The sampled-token reverse KL as the advantage is the reverse-KL gradient: the student's KL(p || p_T) goes from
    1.3 to about zero and it takes the teacher's mode; with the sign flipped the KL grows instead."""
    before, after, mode = _categorical_opd(+1.0)
    assert before > 1.0 and after < 0.01 and mode == 1
    _, flipped, flipped_mode = _categorical_opd(-1.0, steps=100)
    assert flipped > before and flipped_mode != 1


def test_a_teacher_equal_to_the_student_gives_zero_advantages(toy):
    """The student's own starting weights as the teacher (a frozen model of their own): the teacher's log-probs of the
    sampled tokens equal the student's, so every advantage is exactly 0."""
    tok = models.load_tokenizer(toy["model"])
    student = models.load_model(toy["model"], CPU)
    teacher = opd.load_teacher(opd.Args(teacher=toy["model"]), CPU)
    assert teacher is not student and not any(p.requires_grad for p in teacher.parameters())
    prompts = [common.format_prompt(tok, f"Say two {w}") for w in "abcd"]
    rollout = engines.HFEngine(student, tok).generate(prompts, 4, 6, 1.0, seed=0, progress=False)
    rows = list(range(len(rollout)))
    old = common.no_grad_logps(student, rollout, rows, tok.pad_token_id, 1.0, 1024)
    teacher_logp = common.no_grad_logps(teacher, rollout, rows, tok.pad_token_id, 1.0, 1024)
    mask = common.completion_mask_of(rollout)
    assert mask.sum() > 0 and torch.equal(teacher_logp * mask, old * mask)
    adv = opd.opd_advantages(teacher_logp, old, torch.zeros(len(rows)), coef=1.0)
    assert torch.equal(adv * mask, torch.zeros_like(adv))


def test_a_run_whose_teacher_is_its_own_start_does_not_move(toy, tmp_path):
    """End to end: reverse KL 0 at every step, a zero loss, and the final weights equal the initial ones."""
    args = opd.Args(**tiny.run_settings(toy, tmp_path, "self", teacher=toy["model"]))
    opd.main(args)
    rows = train_rows(tmp_path / "self")
    assert rows and all(r["losses/policy_loss"] == 0.0 for r in rows)
    assert [r["opd/reverse_kl"] for r in rows if "opd/reverse_kl" in r] == [0.0, 0.0]
    start, end = weights(toy["model"]), weights(tmp_path / "self" / "final")
    assert all(torch.equal(start[k], end[k]) for k in start)


def first_token_kl(student_path: str, teacher_path: str, prompts: list[list[int]]) -> float:
    """The exact KL(pi || pi_T) of the first completion token, over the whole vocabulary, averaged over `prompts`."""
    student, teacher = (models.load_model(p, CPU, trainable=False) for p in (student_path, teacher_path))
    kls = []
    with torch.no_grad():
        for ids in prompts:
            logp, logp_t = (torch.log_softmax(m(torch.tensor([ids])).logits[0, -1], -1) for m in (student, teacher))
            kls.append((logp.exp() * (logp - logp_t)).sum().item())
    return sum(kls) / len(kls)


def test_a_teacher_distills_into_the_student(toy, tmp_path):
    """Another model as the teacher, one-token completions (every sample scores the first position): the exact reverse
    KL of the first token on the training prompts falls by more than a quarter in 8 steps (4.1 -> 2.7 measured); the
    sampled estimate opd/reverse_kl is positive from the first step."""
    teacher = tiny.teacher_model(toy)
    task = verifiers.load_task(toy["data"], "train", 1, reward="arith")
    tok = models.load_tokenizer(toy["model"])
    prompts = [common.format_prompt(tok, p["question"], task.instruction) for p in task.problems]
    settings = tiny.run_settings(toy, tmp_path, "distill", teacher=teacher, total_steps=8, max_new_tokens=1)
    opd.main(opd.Args(**{**settings, "num_generations": 16, "prompts_per_step": 8, "learning_rate": 1e-2, "eval_limit": 1}))
    before = first_token_kl(toy["model"], teacher, prompts)
    after = first_token_kl(str(tmp_path / "distill" / "final"), teacher, prompts)
    assert before > 1.0 and after < 0.75 * before, (before, after)
    kls = [r["opd/reverse_kl"] for r in rows_of(tmp_path / "distill") if "opd/reverse_kl" in r]
    assert len(kls) == 8 and kls[0] > 1.0


def test_the_teacher_is_checked_before_the_model_loads(toy, tmp_path, monkeypatch):
    """One line each, before the policy loads: no teacher, a teacher of another tokenizer (the same tokens, other ids),
    LoRA adapters alone."""

    def no_policy(*a, **k):
        raise AssertionError("the policy loaded before the teacher was checked")

    monkeypatch.setattr(models, "load_policy", no_policy)
    other = tmp_path / "other_tokenizer"
    tiny.make_tiny_model(str(other))
    tiny.make_tokenizer(list(reversed(tiny.CHARS))).save_pretrained(str(other))
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    cases = [
        ("", "--teacher is required"),
        (str(other), "its tokenizer is not the student's (75 tokens against 75, 70 differ); cross-tokenizer"),
        (str(adapters), f"--teacher {adapters}: LoRA adapters without their base model"),
        (str(tmp_path / "nothing"), "no such folder"),
    ]
    for teacher, message in cases:
        with pytest.raises(verifiers.UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            opd.main(opd.Args(**tiny.run_settings(toy, tmp_path, f"bad{len(teacher)}", teacher=teacher)))


def test_without_opd_reward_the_verifiers_rewards_do_not_enter_the_loss(toy, tmp_path):
    """Two rewards (every completion 1.0; the parity of its length): without --opd-reward the losses and the final
    weights are the same to the bit; with it they differ (the group advantage enters)."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text(
        "def one(completion, problem):\n    return 1.0\n\n\n"
        "def parity(completion, problem):\n    return float(len(completion) % 2)\n"
    )
    out = {}
    for opd_reward in (False, True):
        for fn in ("one", "parity"):
            name = f"{fn}_{opd_reward}"
            settings = tiny.run_settings(toy, tmp_path, name, teacher=tiny.teacher_model(toy), reward=f"{rewards}:{fn}")
            opd.main(opd.Args(**settings, opd_reward=opd_reward))
            out[name] = ([r["losses/policy_loss"] for r in train_rows(tmp_path / name)], weights(tmp_path / name / "final"))
    assert [r["rollout/reward_mean"] for r in train_rows(tmp_path / "one_False") if "rollout/reward_mean" in r] == [1.0, 1.0]
    assert out["one_False"][0] == out["parity_False"][0]
    assert all(torch.equal(out["one_False"][1][k], out["parity_False"][1][k]) for k in out["one_False"][1])
    assert out["one_True"][0] != out["parity_True"][0]


def test_resume_continues_the_run(toy, tmp_path):
    """3 steps straight against 2 steps, a checkpoint, then --resume to 3: the third step's rows are the same."""
    teacher = tiny.teacher_model(toy)
    opd.main(opd.Args(**tiny.run_settings(toy, tmp_path, "straight", teacher=teacher, total_steps=3, save_every=1)))
    opd.main(opd.Args(**tiny.run_settings(toy, tmp_path, "resumed", teacher=teacher, total_steps=2, save_every=1)))
    opd.main(
        opd.Args(
            **tiny.run_settings(
                toy, tmp_path, "ignored", teacher=teacher, total_steps=3, save_every=1, resume=str(tmp_path / "resumed")
            )
        )
    )

    def step3(run_dir):
        return [
            {k: v for k, v in r.items() if not k.startswith("perf/") and k != "wall_s"}
            for r in rows_of(run_dir)
            if r["step"] == 3
        ]

    assert step3(tmp_path / "straight") and step3(tmp_path / "straight") == step3(tmp_path / "resumed")


def test_lora_student_with_a_teacher_of_its_own(toy, tmp_path, monkeypatch):
    """--lora-rank: the student trains adapters on its frozen base; the teacher is a separate frozen model even when it
    is the base itself (never the policy with its adapters off)."""
    loaded = []
    real = models.load_frozen
    monkeypatch.setattr(models, "load_frozen", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    opd.main(opd.Args(**tiny.run_settings(toy, tmp_path, "lora", teacher=toy["model"], lora_rank=2, total_steps=1)))
    assert len(loaded) == 1 and not any(".lora_" in n for n, _ in loaded[0].named_parameters())
    assert os.path.isdir(tmp_path / "lora" / "final_adapter")
    assert "opd/reverse_kl" in train_rows(tmp_path / "lora")[0]
    shutil.rmtree(tmp_path / "lora")
