"""One rank of the 2-rank real-vLLM check (tests/test_vllm_real.py::test_two_ranks_external_launcher).

Launched as `python -m torch.distributed.run --standalone --nproc-per-node 2 tests/vllm_two_ranks.py OUT_DIR` in
the vLLM venv. Each rank: gloo process group, the embedded model sharded with FSDP2 (`fully_shard` on each decoder
layer, then the root), `models.make_engine("vllm", ...)` (external_launcher, one engine per rank; its first push
gathers the DTensor shards), then

  1. rollout of this rank's groups (rank r: global groups r and r + 2 of PROMPTS) on the original weights;
  2. the same seeded perturbation of some weights on every rank (on the shards);
  3. rollout WITHOUT a push (the defect control: the engine must not match the perturbed trainer);
  4. push_weights (full_tensor per parameter), rollout again;
  5. the FSDP trainer's completion_logps of each rollout's tokens,

and writes OUT_DIR/rank<r>.json. The test compares it with one process (world size 1) generating all four groups.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
import zlib

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests import tiny  # noqa: E402

QUESTIONS = ["What is 12 + 7?", "Name a colour of the sky.", "Say hello in French.", "Count from one to five."]
N, MAX_NEW, TEMPERATURE, SEED = 2, 12, 1.0, 7
MAX_MODEL_LEN = 256


def perturbed(name: str) -> bool:
    """Which parameters the check perturbs: the attention/MLP projections of layers 0-3 and the tied embedding."""
    layer = name.split("layers.")[1].split(".")[0] if "layers." in name else None
    return "embed_tokens" in name or (layer is not None and int(layer) < 4 and name.endswith("proj.weight"))


def noise(name: str, shape) -> torch.Tensor:
    """The same full-shape noise for a parameter name in any process (seeded by the name)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(tuple(shape), generator=g) * 0.02


@torch.no_grad()
def perturb(model) -> list[str]:
    """Add noise(name) to the perturbed parameters; plain tensors or FSDP2 DTensor shards alike."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    changed = []
    for name, p in model.named_parameters():  # a tied parameter is yielded once
        if not perturbed(name):
            continue
        z = noise(name, p.shape).to(p.dtype)
        if isinstance(p, DTensor):  # the full noise on every rank, each keeps its shard (no communication)
            z = distribute_tensor(z, p.device_mesh, p.placements, src_data_rank=None)
        p.add_(z)
        changed.append(name)
    return changed


def main(out_dir: str) -> None:
    os.environ.setdefault("RLVR_DIST_TIMEOUT_S", "240")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    import common
    import models
    import run

    t0 = time.time()
    run.init_world()  # the process group (gloo on CPU) and the World the engine reads
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    assert world == 2, world
    device = torch.device("cpu")
    tokenizer = models.load_tokenizer(models.EMBEDDED_MODEL)
    model = models.load_model(models.EMBEDDED_MODEL, device)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    from torch.distributed.tensor import DTensor

    assert all(isinstance(p, DTensor) for p in model.parameters())

    # the trainer's log-prob path calls model.model(...) and reads the head weight: run it as an FSDP forward
    model.trainer_logps = types.MethodType(
        lambda self, batch: common.completion_logps(self, batch, TEMPERATURE, with_entropy=False)[0], model
    )
    register_fsdp_forward_method(model, "trainer_logps")

    def trainer_logps(rollout):
        batch = common.pad_batch(tiny.prompts(rollout), tiny.completions(rollout), tokenizer.pad_token_id)
        with torch.no_grad():
            lp = model.trainer_logps(batch)
        return [lp[i, : len(c)].tolist() for i, c in enumerate(tiny.completions(rollout))]

    t_setup = time.time() - t0
    engine = models.make_engine(
        run.Args(engine="vllm", seed=0, gen_batch_size=8, gpu_memory_utilization=0.35),
        model,
        tokenizer,
        models.EMBEDDED_MODEL,
        MAX_MODEL_LEN,
    )
    t_engine = time.time() - t0 - t_setup
    groups = list(range(rank, len(QUESTIONS), world))
    prompts = [common.format_prompt(tokenizer, QUESTIONS[g]) for g in groups]

    def rollout():
        return engine.generate(prompts, N, MAX_NEW, TEMPERATURE, seed=SEED, progress=False, group_ids=groups)

    def record(r):
        return {
            "completion_ids": [list(c) for c in tiny.completions(r)],
            "engine_logps": [list(e) for e in tiny.engine_logps(r)],
            "trainer_logps": trainer_logps(r),
        }

    out = {
        "rank": rank,
        "world": world,
        "groups": groups,
        "engine_world": engine.world_size,
        "executor": type(engine.llm.llm_engine.model_executor).__name__,
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }
    out["original"] = record(rollout())
    out["changed"] = perturb(model)
    out["stale"] = record(rollout())  # no push yet: the engine still has the original weights
    t1 = time.time()
    engine.push_weights(model)
    out["push_s"] = time.time() - t1
    out["pushed"] = record(rollout())
    out["times"] = {"setup_s": t_setup, "engine_s": t_engine, "total_s": time.time() - t0}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    torch.distributed.barrier()
    engine.close()  # vLLM's shutdown also destroys the default process group (VLLMEngine.close)
    out_closed = not torch.distributed.is_initialized()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.closed"), "w") as f:
        f.write(str(out_closed))


if __name__ == "__main__":
    main(sys.argv[1])
