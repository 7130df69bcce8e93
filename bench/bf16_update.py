"""How much of a small AdamW update survives: bf16 weights vs fp32 master weights with bf16 autocast vs fp32.

The tiny test model (Llama init, std 0.02), 10 fused-AdamW steps (models.make_optimizer) on one fixed GRPO-like
loss through common.completion_logps, at lr 1e-6 and 1e-5; reports the share of the decoder's linear weights that
changed and their mean |dw|, plus the share that changed in the bf16 copy of the fp32 master (what a bf16 rollout
engine receives). Same helpers as tests/test_precision.py (docs/precision.md).

    flock /tmp/cpu.lock /work/venv/bin/python bench/bf16_update.py
    python bench/bf16_update.py --device cuda                     # the same on a GPU (bench/gpu_check.py runs it)
"""

import argparse
import os
import sys
import tempfile
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import models  # noqa: E402
from tests import test_precision as tp  # noqa: E402
from tests import tiny as tiny_mod  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    device = torch.device(p.parse_args().device)
    warnings.simplefilter("ignore")  # make_optimizer's bf16 warning is the point of the first row
    path = tiny_mod.make_tiny_model(tempfile.mkdtemp(prefix="bench_bf16_"))
    print(f"device {device}{' (' + torch.cuda.get_device_name() + ')' if device.type == 'cuda' else ''}")
    print("| lr | path | weights changed | mean abs dw |")
    print("|---|---|---|---|")
    for lr in (1e-6, 1e-5):
        old = models.load_model(path, device, compute_dtype=None).to(torch.bfloat16)
        init = {k: v.detach().clone() for k, v in old.named_parameters()}
        new = models.load_model(path, device, compute_dtype=torch.bfloat16)
        ref = models.load_model(path, device, compute_dtype=None)
        for m in (new, ref):
            m.load_state_dict({k: v.float() for k, v in init.items()}, strict=False)
        for m in (old, new, ref):
            tp._train(m, 10, lr)
        for name, m in (
            ("bf16 weights", old),
            ("fp32 master + bf16 autocast (the scripts on CUDA)", new),
            ("fp32, no autocast (the scripts on CPU)", ref),
        ):
            frac, dw = tp._changed(init, dict(m.named_parameters()))
            print(f"| {lr:g} | {name} | {100 * frac:.1f}% | {dw:.3g} |")
        frac, _ = tp._changed(init, {k: v.detach().to(torch.bfloat16) for k, v in new.named_parameters()})
        print(f"| {lr:g} | bf16 copy of the fp32 master (pushed to a bf16 engine) | {100 * frac:.1f}% | |")


if __name__ == "__main__":
    main()
