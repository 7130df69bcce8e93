"""Per-token entropy and log-probs of one real rollout, packed groups against padded rows (docs/performance.md).

The embedded SmolLM2-135M samples P prompts x G of the arith task (seed 1); the trainer's completion_logps then
scores every row twice: in packed groups (micro_batches with the model: the cost rule) and in padded rows
(micro_batches without it). Printed: the largest and the mean relative difference of the entropy and the largest
absolute difference of the log-probs. --root runs another checkout's common.py (the before/after comparison).

    flock /tmp/cpu.lock python bench/entropy_packing.py
    flock /tmp/cpu.lock python bench/entropy_packing.py --root /path/to/older/checkout
"""

from __future__ import annotations

import argparse
import os
import sys

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
p.add_argument("--prompts", type=int, default=8)
p.add_argument("--G", type=int, default=8)
p.add_argument("--max-new-tokens", type=int, default=32)
o = p.parse_args()
sys.path.insert(0, o.root)

import torch  # noqa: E402

import common  # noqa: E402
import verifiers  # noqa: E402

try:  # a checkout before common.py was split in three holds everything in common.py
    import engines
    import models
except ImportError:
    engines = models = common

batch_of = getattr(common, "token_batch_of", None) or common.rows_batch  # the older name
torch.manual_seed(1)
tok = models.load_tokenizer(models.EMBEDDED_MODEL)
model = models.load_model(models.EMBEDDED_MODEL, torch.device("cpu"))
task = verifiers.load_task("arith", "train", 1)
prompts = [common.format_prompt(tok, q["question"], task.instruction) for q in task.problems[: o.prompts]]
rollout = engines.HFEngine(model, tok).generate(prompts, o.G, o.max_new_tokens, 1.0, progress=False)
rows = list(range(len(rollout)))
out = {}
with torch.no_grad():
    for packed in (True, False):
        logp = torch.zeros(common.completion_mask_of(rollout).shape)
        ent = torch.zeros_like(logp)
        micros = common.micro_batches(rollout, rows, 1024, model if packed else None)
        assert any(getattr(m, "packs", None) for m in micros) == packed
        for micro in micros:
            lp, h = common.completion_logps(model, batch_of(rollout, micro, tok.pad_token_id), 1.0)
            logp[list(micro), : lp.shape[1]], ent[list(micro), : h.shape[1]] = lp, h
        out[packed] = (logp, ent)
mask = common.completion_mask_of(rollout).bool()
(lp_p, h_p), (lp_r, h_r) = out[True], out[False]
rel = ((h_p - h_r).abs() / h_r.abs().clamp(min=1e-12))[mask]
print(
    f"{o.root}: {int(mask.sum())} tokens; entropy packed vs padded: max relative {rel.max():.2g}, mean {rel.mean():.2g}; "
    f"log-probs max abs {(lp_p - lp_r)[mask].abs().max():.2g}; mean entropy {h_r[mask].mean():.4f}"
)
