"""An induced engine-trainer mismatch, and what each rollout correction does with it (docs/mismatch.md).

The engine is the HF engine sampling at a perturbed temperature (T_engine = --engine-temperature, default 1.3)
while the trainer scores at --temperature 1.0, so mu = softmax(z / 1.3) and pi_old = softmax(z): rho = pi_old / mu
varies token by token (far more than the ~1e-5 nats of fp32 vLLM, about what a bf16 engine on a GPU shows on its
worst tokens). Each correction runs grpo.py's real main() for the same steps, prompts and seeds; the table has the
step-1 mismatch/ and rollout_is/ metrics and the update's loss and grad norm.

    flock /tmp/cpu.lock python bench/mismatch_demo.py                  # embedded SmolLM2-135M, ~5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import engines  # noqa: E402
import grpo  # noqa: E402
import models  # noqa: E402
import run  # noqa: E402

MODES = ("none", "token-tis", "seq-mask", "icepop")
KEYS = (
    "mismatch/abs_log_rho_mean",
    "mismatch/kl_k3",
    "mismatch/rho_out_frac",
    "mismatch/seq_rho_gmean_min",
    "mismatch/seq_rho_gmean_max",
    "rollout_is/token_changed_frac",
    "rollout_is/token_zeroed_frac",
    "rollout_is/seq_zeroed_frac",
    "rollout_is/weight_mean",
    "losses/policy_loss",
    "losses/grad_norm",
)


class PerturbedEngine(engines.HFEngine):
    """The HF engine sampling (and reporting its log-probs) at another temperature than the trainer's."""

    def __init__(self, model, tokenizer, temperature: float):
        super().__init__(model, tokenizer, return_logps=True)
        self.engine_temperature = temperature

    def generate(self, prompt_ids, n, max_new_tokens, temperature, **kw):
        return super().generate(prompt_ids, n, max_new_tokens, self.engine_temperature, **kw)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-temperature", type=float, default=1.3)
    p.add_argument("--steps", type=int, default=1)
    a = p.parse_args()
    out = tempfile.mkdtemp(prefix="mismatch_demo_")
    models.make_engine = lambda args, model, tokenizer, *rest, **kw: PerturbedEngine(model, tokenizer, a.engine_temperature)
    table = {}
    for mode in MODES:
        argv = [
            "--total-steps",
            str(a.steps),
            "--prompts-per-step",
            "16",
            "--num-generations",
            "8",
            "--max-new-tokens",
            "48",
            "--eval-limit",
            "4",
            "--eval-samples",
            "1",
            "--eval-k",
            "1",
            "--rollout-is",
            mode,
            "--max-engine-logp-diff",
            "0",
            "--output-dir",
            out,
            "--run-name",
            mode,
        ]
        grpo.main(run.parse_args(grpo.Args, argv))
        with open(os.path.join(out, mode, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        first = next(r for r in rows if "mismatch/abs_log_rho_mean" in r)
        table[mode] = {k: first.get(k) for k in KEYS}
    print(f"\nengine T = {a.engine_temperature}, trainer T = 1.0; step 1 of grpo.py (16 prompts x 8, 48 tokens, seed 1)")
    print("| key | " + " | ".join(MODES) + " |\n|---|" + "---|" * len(MODES))
    for k in KEYS:
        cells = [("" if table[m][k] is None else f"{table[m][k]:.4g}") for m in MODES]
        print(f"| `{k}` | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
