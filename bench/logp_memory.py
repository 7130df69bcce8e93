"""Peak memory of per-token log-probs + backward: common.completion_logps (LM head on completion tokens
only, chunked fp32 log-softmax recomputed in backward) against a naive full log-softmax over (B, T, vocab).

A tiny Llama (hidden 64, 2 layers) with a 49,152-token vocabulary (SmolLM2's) so that the LM head dominates,
as it does for long completions of real models. Each configuration runs in a fresh subprocess and reports
the growth of its peak resident memory (ru_maxrss) over the state right before the forward pass.

    python bench/logp_memory.py --chunk-tokens 256      # T = 256, 1024, 4096, batch 1
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = r"""
import json, resource, sys, time, torch
sys.path.insert(0, ROOT)
import common
from transformers import LlamaConfig, LlamaForCausalLM
mode, T, CHUNK = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
torch.set_num_threads(2)
cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=T + 64, tie_word_embeddings=True)
model = LlamaForCausalLM(cfg)
prompt = torch.randint(0, 49152, (1, 32)).tolist()
completion = torch.randint(0, 49152, (1, T)).tolist()
tb = common.pad_batch(prompt, completion, pad_id=0)
def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
base = rss()
t0 = time.perf_counter()
if mode == "chunked":
    logp, _ = common.completion_logps(model, tb, temperature=1.0, chunk_tokens=CHUNK)
else:
    pos = (tb.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=tb.input_ids, attention_mask=tb.attention_mask, position_ids=pos).logits.float()
    logp = torch.log_softmax(logits[:, -T - 1:-1], -1).gather(-1, tb.completion_ids.unsqueeze(-1)).squeeze(-1)
    shifted = logits[:, -T - 1 : -1].detach()
    _ = (torch.softmax(shifted, -1) * torch.log_softmax(shifted, -1)).sum(-1)  # entropy
(logp * tb.completion_mask).sum().backward()
print(json.dumps({"mode": mode, "T": T, "peak_mb": rss() - base, "s": time.perf_counter() - t0}))
""".replace("ROOT", repr(ROOT))


def main():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("lengths", nargs="*", type=int, default=[256, 1024, 4096])
    parser.add_argument("--chunk-tokens", type=int, default=256, help="common.completion_logps chunk size")
    opts = parser.parse_args()
    lengths = opts.lengths
    results = {}
    for T in lengths:
        for mode in ("naive", "chunked"):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, mode, str(T), str(opts.chunk_tokens)], capture_output=True, text=True, check=True
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[(mode, T)] = r
    print(f"chunk = {opts.chunk_tokens} tokens")
    print(
        "| completion tokens T | naive full log-softmax peak MB | chunked peak MB | ratio chunked/naive "
        "| naive s | chunked s |"
    )
    print("|---|---|---|---|---|---|")
    for T in lengths:
        n, c = results[("naive", T)], results[("chunked", T)]
        print(
            f"| {T} | {n['peak_mb']:.0f} | {c['peak_mb']:.0f} | {c['peak_mb'] / max(n['peak_mb'], 1e-9):.2f} "
            f"| {n['s']:.2f} | {c['s']:.2f} |"
        )


if __name__ == "__main__":
    main()
