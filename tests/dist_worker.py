"""Entry point of the several-process tests (tests/test_distributed.py), run as one process (world size 1) or
under `python -m torch.distributed.run --nproc-per-node 2` (gloo on CPU).

  dist_worker.py script <method> <flags...>   run <method>.py's real main() with its flags; with
                                              RLVR_TEST_ENGINE=scripted the rollout engine is ScriptedEngine
  dist_worker.py update <tiny model> <out.pt> [control]
                                              one optimizer update per loss (every loss aggregation of grpo.py,
                                              GAPO token/sequence, Mu-GRPO with its veto, CoDaPO with its dual
                                              clip) on a fixed batch; rank 0 saves the full gradients, the global
                                              grad norm and the updated parameters. control: "average" (FSDP's
                                              default averaging reduce-scatter) or "local_tokens" (per-rank
                                              denominators) are the defects the exactness test must catch.
  dist_worker.py generate <tiny model> <out.pt>
                                              the HF engine under FSDP2 (synced): rank 0's rows all end at their
                                              first token, rank 1's run to the maximum; each rank saves its
                                              completions, log-probs and its next random draw.
  dist_worker.py world <tiny model>          what a script's start makes (run.setup, models.load_policy,
                                              models.make_engine): prints the process group, FSDP2 and the
                                              engine it finds as one JSON line
  dist_worker.py fail-each-rank              run_cli with a main that raises a RunError of its own on every rank
  dist_worker.py slow-stderr <rank> <mode...> any mode above, with every write to stderr on <rank> SLOW_WRITE_S late
                                              (the race: the other rank exits first, torchrun then stops this one)
"""

from __future__ import annotations

import os
import random
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import common  # noqa: E402
import engines  # noqa: E402
import models  # noqa: E402
import run  # noqa: E402
import verifiers  # noqa: E402
from tests import references  # noqa: E402


class ScriptedEngine:
    """Completions that depend only on (request seed, global group, sample index): never on the model or on how
    prompts are split over ranks, so a 2-rank run and a 1-rank run train on identical rollouts. A completion is
    0-2 letters then a digit 1-3 and EOS (the toy task's answer is 2: about a third of the rollouts are right)."""

    name = "scripted"

    def __init__(self, tokenizer, with_logps: bool = False):
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.with_logps = with_logps  # scripted engine log-probs (one per token, from the same seed): the mismatch path

    def generate(
        self, prompt_ids, n, max_new_tokens, temperature, seed=None, desc="generate", progress=True, group_ids=None, top_p=1.0
    ):
        out = common.RolloutBatch(with_engine_logps=self.with_logps)
        for i, ids in enumerate(prompt_ids):
            g = group_ids[i] if group_ids is not None else i  # world size 1: prompt i is global group i
            for j in range(n):
                rng = random.Random(f"{seed}/{g}/{j}")
                text = "x" * rng.randrange(0, 3) + str(rng.choice([1, 2, 3]))
                toks = self.tokenizer.encode(text, add_special_tokens=False)[: max_new_tokens - 1] + [self.eos]
                logps = [-3.0 - 2.0 * rng.random() for _ in toks] if self.with_logps else None
                out.append_row(ids, toks, self.tokenizer.decode(toks, skip_special_tokens=True), "stop", logps)
        return out

    def push_weights(self, model):
        return None

    def sleep(self):
        return None

    def wake(self, model=None, version=None):
        return None


def run_script(method: str, flags: list[str]) -> None:
    if os.environ.get("RLVR_TEST_ENGINE") in ("scripted", "scripted_logps"):
        logps = os.environ["RLVR_TEST_ENGINE"] == "scripted_logps"
        models.make_engine = lambda args, model, tokenizer, *a, **k: ScriptedEngine(tokenizer, logps)
    sys.argv = [os.path.join(ROOT, f"{method}.py"), *flags]
    runpy.run_path(sys.argv[0], run_name="__main__")


# ----- one update per loss ------------------------------------------------------------------------------------
P, G, T_MAX = 4, 4, 7  # 4 prompt groups of 4 rollouts, completions of 1..7 tokens


def fixed_batch(vocab: int) -> tuple[common.RolloutBatch, torch.Tensor, torch.Tensor]:
    """A rollout batch of B = 16 rows with varied lengths, advantages (B,) and an old-log-prob offset (B, T_MAX):
    old_logp = logp - offset, so ratios exp(offset) in [0.5, 2] reach every clip."""
    rng = random.Random(0)
    batch = common.RolloutBatch()
    for g in range(P):
        prompt = [rng.randrange(3, vocab) for _ in range(3 + g)]
        for _ in range(G):
            completion = [rng.randrange(3, vocab) for _ in range(rng.randint(1, T_MAX))]
            batch.append_row(prompt, completion, "", "stop")
    gen = torch.Generator().manual_seed(0)
    advantages = torch.randn(P * G, generator=gen)
    offset = (torch.rand(P * G, T_MAX, generator=gen) - 0.5) * 1.4
    return batch, advantages, offset


def losses():
    """(name, loss_agg for accumulation_weight, fn(logp, old, adv, mask) -> loss) for every loss under test."""
    import codapo
    import gapo
    import grpo
    import mugrpo

    out = [
        (
            f"grpo_{agg}",
            agg,
            lambda lp, old, adv, m, agg=agg: grpo.compute_policy_loss(
                lp, old, adv, m, eps_low=0.2, eps_high=0.28, loss_agg=agg, max_tokens=T_MAX
            )[0],
        )
        for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    ]
    out.append(
        (
            "gapo_token",
            "token-mean",
            lambda lp, old, adv, m: gapo.compute_policy_loss(
                lp, old, adv, m, eps_low=0.2, eps_high=0.2 + 0.1 * (adv > 0).float(), level="token"
            )[0],
        )
    )
    out.append(
        (
            "gapo_sequence",
            "seq-mean-token-mean",
            lambda lp, old, adv, m: gapo.compute_policy_loss(
                lp, old, adv, m, eps_low=0.2, eps_high=0.2 + 0.1 * (adv > 0).float(), level="sequence"
            )[0],
        )
    )
    out.append(
        (
            "mugrpo",
            "token-mean",
            lambda lp, old, adv, m: mugrpo.compute_policy_loss(
                lp,
                old,
                adv,
                m,
                eps_low=1.0,
                eps_high=4.0,
                keep=mugrpo.veto_mask(lp.detach(), old, adv, m, -0.3, "suffix_nontrigger"),
            )[0],
        )
    )
    out.append(
        (
            "codapo",
            "token-mean",
            lambda lp, old, adv, m: codapo.compute_policy_loss(
                lp,
                old,
                adv,
                m,
                eps_low=0.2,
                eps_high=0.28,
                loss_agg="token-mean",
                ref_logp=None,
                beta=0.0,
                max_tokens=T_MAX,
                dual_clip_c=1.5,
            )[0],
        )
    )
    out.append(("grpo_token-mean+checkpointing", "token-mean", out[0][2]))  # --gradient-checkpointing, sharded
    return out


def run_update(model_path: str, out_path: str, control: str = "") -> None:
    world = run.init_world()
    tokenizer = models.load_tokenizer(model_path)
    full, advantages, offset = fixed_batch(len(tokenizer))
    minibatch = list(range(P * G))  # one mini-batch: every row
    if world.enabled:
        groups = world.deal_groups([minibatch], G)
        rows = [g * G + j for g in groups for j in range(G)]
        local = references.rollout_from_rows(
            [full.prompt(r) for r in rows], [full.completion(r) for r in rows], ["" for _ in rows], ["stop" for _ in rows]
        )
        rollout = common.ShardedRollout(local, groups, P, G)
    else:
        rollout = full
    mask = common.completion_mask_of(rollout)  # (B, T) from every row's length
    results = {}
    for name, agg, loss_fn in losses():
        run.seed_everything(0)
        model = models.load_model(model_path, torch.device("cpu"), gradient_checkpointing=name.endswith("checkpointing"))
        if control == "average" and world.enabled:  # FSDP's default: average the ranks' gradients
            from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

            for layer in models.decoder_layers(model):
                fully_shard(layer)
            fully_shard(model)
            model.rlvr_completion_logps = common.completion_logps_forward.__get__(model)
            register_fsdp_forward_method(model, "rlvr_completion_logps")
        else:
            model = models.shard_model(model)
        optimizer, _ = models.make_optimizer(model, run.Args(learning_rate=1e-2, weight_decay=0.0, warmup_updates=0))
        own = rollout.own(minibatch)
        mb_tokens = mask[own if control == "local_tokens" else minibatch].sum().item()
        loss_sum = 0.0
        for micro in common.micro_batches(rollout, own, 16, model):  # a small budget: several micro-batches per rank
            tb = common.token_batch_of(rollout, micro, tokenizer.pad_token_id)
            logp, _ = common.completion_logps(model, tb, 1.0)
            micro_mask = tb.completion_mask
            old = (logp - offset[micro, : logp.shape[1]]).detach()
            loss = loss_fn(logp, old, advantages[micro], micro_mask)
            weight = common.accumulation_weight(
                "token" if agg == "token-mean" else "sequence", micro_mask, mb_tokens, len(micro), len(minibatch)
            )
            (loss * weight).backward()
            loss_sum += loss.item() * weight
        grad_norm = common.clip_grad_norm(model, 1e9)  # no clipping: the raw global norm
        grads = {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in model.named_parameters()
        }
        optimizer.step()
        params = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
        }
        results[name] = {
            "loss": world.sum(loss_sum),
            "grad_norm": grad_norm.item(),
            "grads": grads,
            "params": params,
            "checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
        }
    if world.is_main:
        torch.save(results, out_path)
    del model, optimizer
    import gc

    gc.collect()  # the sharded model goes before its process group (as run_cli does)
    if world.enabled:
        world.shutdown()


# ----- synced generation ------------------------------------------------------------------------------------


def generate_setup(rank: int, model, tokenizer) -> tuple[engines.HFEngine, list[list[int]]]:
    """Rank r's engine and prompts. Rank 0: every token ends a row (its rows end after one token, then it only
    steps for the collectives); rank 1: no token ends a row (it runs every step)."""
    engine = engines.HFEngine(model, tokenizer, gen_batch_size=8, return_logps=True)
    if rank == 0:
        engine.eos_ids = set(range(len(tokenizer)))
    else:
        engine.eos_ids = set()  # no row ends: every step runs
    questions = [("What is 1 + 2?", "Hi"), ("Say seven now", "Count to 3")][rank]
    return engine, [common.format_prompt(tokenizer, q) for q in questions]


GEN_MAX_NEW = 9


def run_generate(model_path: str, out_path: str) -> None:
    world = run.init_world()
    tokenizer = models.load_tokenizer(model_path)
    model = models.shard_model(models.load_model(model_path, torch.device("cpu")))
    engine, prompts = generate_setup(world.rank, model, tokenizer)
    torch.manual_seed(11)
    ro = engine.generate(prompts, 2, GEN_MAX_NEW, 0.9, progress=False)
    result = {
        "completions": [ro.completion(r) for r in range(len(ro))],
        "logps": [ro.engine_logp(r) for r in range(len(ro))],
        "next_draw": torch.rand(3),
    }
    torch.save(result, f"{out_path}.rank{world.rank}")
    del model, engine
    import gc

    gc.collect()
    if world.enabled:
        world.shutdown()


def run_world(model_path: str) -> None:
    import json

    import torch.distributed as td
    from torch.distributed.fsdp import FSDPModule

    import grpo

    args = grpo.Args(model=model_path, engine="hf")
    world, device = run.setup(args)
    model = models.load_policy(args, model_path, device)
    engine = models.make_engine(args, model, models.load_tokenizer(model_path), model_path, 64)
    found = {
        "process_group": td.is_initialized(),
        "backend": td.get_backend() if td.is_initialized() else None,
        "world_size": td.get_world_size() if td.is_initialized() else None,
        "enabled": world.enabled,
        "fsdp2": isinstance(model, FSDPModule) and all(isinstance(m, FSDPModule) for m in model.model.layers),
        "engine": type(engine).__name__,
    }
    print("WORLD " + json.dumps(found), flush=True)
    if world.enabled:
        world.shutdown()


SLOW_WRITE_S = 1.5


class SlowWriter:
    """A text stream whose every write arrives SLOW_WRITE_S late."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        import time

        time.sleep(SLOW_WRITE_S)
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def fail_each_rank() -> None:
    import grpo

    def failing_main(args) -> None:
        raise verifiers.RunError(f"rank {os.environ.get('RANK')}'s own failure")

    sys.argv = [sys.argv[0]]
    run.command_line(failing_main, grpo.Args)


def main() -> None:
    mode = sys.argv[1]
    if mode == "slow-stderr":
        if os.environ.get("RANK", "0") == sys.argv[2]:
            sys.stderr = SlowWriter(sys.stderr)
        del sys.argv[1:3]
        mode = sys.argv[1]
    if mode == "fail-each-rank":
        fail_each_rank()
    elif mode == "script":
        run_script(sys.argv[2], sys.argv[3:])
    elif mode == "update":
        run_update(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else "")
    elif mode == "generate":
        run_generate(sys.argv[2], sys.argv[3])
    elif mode == "world":
        run_world(sys.argv[2])
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
