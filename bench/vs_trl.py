"""Step time, tokens/s and peak memory of grpo.py's code path against TRL's GRPOTrainer, same work on CPU.

Both sides: the embedded SmolLM2-135M-Instruct (fp32), the same arithmetic prompts through the same chat
template in the same order, P prompts x G generations, the same maximum completion length, temperature 1,
top_p 1, no top-k, the transformers model's forward as the rollout engine (TRL: `generate`; ours: HFEngine's
sampling loop, which draws from the same softmax(logits / T); `--engine-dtype bf16`: from a bf16 copy), one
optimizer update per rollout batch (TRL: num_iterations=1, gradient_accumulation_steps=1; ours:
--updates-per-batch 1, so neither computes
old log-probs), no reference model (beta 0), token-mean loss (TRL "dapo"), no gradient checkpointing, AdamW
lr 1e-5, grad-norm clip 1.

Each side runs in its own subprocess, alternating ours/TRL (the order flips every repeat) so that drift in
machine load hits both alike. Per step we time the whole loop period (end of step k-1 to end of step k:
generation, rewards, forward/backward, optimizer, logging) and the generation call inside it; step 1 is a
warm-up and is dropped. Peak resident memory is the child's ru_maxrss (os.wait4), whole process life.
Evaluation (ours runs one tiny one before/after training) lies outside every timed period.

    bash bench/setup.sh                                      # bench/.venv = system packages + trl==1.16.0
    flock /tmp/cpu.lock bench/.venv/bin/python bench/vs_trl.py --steps 3 --repeats 2
    flock /tmp/cpu.lock bench/.venv/bin/python bench/vs_trl.py --steps 3 --repeats 2 --engine-dtype auto bf16

`--force-length` makes every row run to max_new_tokens on both sides (TRL: min_new_tokens, EOS suppressed;
ours: references.full_length_rows, EOS sampled as any token and ending nothing), so both generate the same number of
tokens; without it the model stops at EOS as it likes and the mean completion length of each side is printed next
to the times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def read_steps(run_dir: str, B: int) -> list[dict]:
    """Per-step rows from our metrics.jsonl: loop period from wall_s, generation from perf/rollout_s."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    rows = [r for r in rows if "perf/rollout_s" in r]  # training rows that open a step (eval rows excluded)
    out, prev_end = [], None
    for r in rows:
        timers = r["perf/rollout_s"] + r["perf/train_s"] + r["perf/sync_s"] + r.get("perf/reward_s", 0.0)
        out.append(
            {
                "step": r["step"],
                "step_s": None if prev_end is None else r["wall_s"] - prev_end,
                "timers_s": timers,
                "gen_s": r["perf/rollout_s"],
                "tokens": r["rollout/response_len_mean"] * B,
                "truncated_frac": r["rollout/truncated_frac"],
            }
        )
        prev_end = r["wall_s"]
    return out


# ---------------------------------------------------------------------------------------------------------
# children


def child_ours(o) -> dict:
    import grpo
    import models
    from tests import references

    if o.force_length:
        references.full_length_rows()  # bench-only: no row ends before the maximum (TRL side: min_new_tokens)
    out_dir = tempfile.mkdtemp(prefix="bench_ours_")
    args = grpo.Args(
        model=models.EMBEDDED_MODEL,
        dataset="arith",
        engine="hf",
        engine_dtype=o.engine_dtype,
        seed=o.seed,
        total_steps=o.steps,
        prompts_per_step=o.prompts,
        num_generations=o.G,
        max_new_tokens=o.max_new_tokens,
        temperature=1.0,
        learning_rate=1e-5,
        updates_per_batch=1,
        beta=0.0,
        loss_agg="token-mean",
        eval_limit=1,
        eval_samples=1,
        eval_k=[1],
        output_dir=out_dir,
        run_name="run",
    )
    grpo.main(args)
    return {"side": "ours", "steps": read_steps(os.path.join(out_dir, "run"), o.prompts * o.G)}


def child_trl(o) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import common
    import models
    import run
    import verifiers

    run.set_cpu_threads()  # ours does the same first thing in grpo.main
    run.seed_everything(o.seed)
    path = models.embedded_model_dir()
    tokenizer = models.load_tokenizer(path)
    task = verifiers.load_task("arith", "train", o.seed)
    sampler = common.PromptSampler(len(task.problems), o.seed)  # the prompts grpo.main draws, in its order
    problems = [task.problems[i] for _ in range(o.steps) for i in sampler.sample(o.prompts)]
    data = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"{p['question'].strip()}\n\n{task.instruction.strip()}"}],
                "answer": p["answer"],
            }
            for p in problems
        ]
    )

    def arith_reward(prompts, completions, answer, **kw):
        return [verifiers.arith_reward(c[0]["content"], a) for c, a in zip(completions, answer)]

    out_dir = tempfile.mkdtemp(prefix="bench_trl_")
    config = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=o.prompts * o.G,
        num_generations=o.G,
        max_completion_length=o.max_new_tokens,
        num_iterations=1,
        gradient_accumulation_steps=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=1e-5,
        use_vllm=False,
        bf16=False,
        fp16=False,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        epsilon=0.2,
        max_grad_norm=1.0,
        gradient_checkpointing=o.trl_gradient_checkpointing,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        max_steps=o.steps,
        shuffle_dataset=False,
        seed=o.seed,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32},
        generation_kwargs={"min_new_tokens": o.max_new_tokens} if o.force_length else None,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=path, reward_funcs=arith_reward, args=config, train_dataset=data, processing_class=tokenizer)

    record = {"gen": [], "tokens": [], "truncated": [], "ends": [], "prompt_check": None}
    generate = trainer._generate

    def timed_generate(prompts):
        t0 = time.perf_counter()
        result = generate(prompts)
        record["gen"].append(time.perf_counter() - t0)
        prompt_ids, completion_ids = result[0], result[1]
        record["tokens"].append(sum(len(c) for c in completion_ids))
        record["truncated"].append(
            sum(len(c) == o.max_new_tokens and c[-1] not in trainer.eos_token_ids for c in completion_ids)
            / len(completion_ids)
        )
        if record["prompt_check"] is None:  # same token ids as common.format_prompt?
            step_problems = problems[: o.prompts]
            ours = [common.format_prompt(tokenizer, p["question"], task.instruction) for p in step_problems]
            theirs = [list(prompt_ids[i * o.G]) for i in range(o.prompts)]
            record["prompt_check"] = ours == theirs
        return result

    trainer._generate = timed_generate

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            record["ends"].append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            record["ends"].append(time.perf_counter())

    trainer.add_callback(StepClock())
    trainer.train()
    steps = []
    for k in range(o.steps):
        steps.append(
            {
                "step": k + 1,
                "step_s": record["ends"][k + 1] - record["ends"][k] if k else None,
                "gen_s": record["gen"][k],
                "tokens": record["tokens"][k],
                "truncated_frac": record["truncated"][k],
            }
        )
    return {"side": "trl", "steps": steps, "prompt_ids_match_ours": record["prompt_check"]}


# ---------------------------------------------------------------------------------------------------------
# parent


def run_child(side: str, o, log_dir: str, tag: str, seed: int, engine_dtype: str = "auto") -> dict:
    name = side if side == "trl" or engine_dtype == "auto" else f"{side}_{engine_dtype}"
    out_json = os.path.join(log_dir, f"{tag}_{name}.json")
    cmd = [
        o.python,
        os.path.abspath(__file__),
        "--child",
        side,
        "--out-json",
        out_json,
        "--steps",
        str(o.steps),
        "--prompts",
        str(o.prompts),
        "--G",
        str(o.G),
        "--max-new-tokens",
        str(o.max_new_tokens),
        "--seed",
        str(seed),
        "--engine-dtype",
        engine_dtype,
    ]
    cmd += ["--force-length"] if o.force_length else []
    cmd += ["--trl-gradient-checkpointing"] if o.trl_gradient_checkpointing else []
    with open(os.path.join(log_dir, f"{tag}_{name}.log"), "w") as log:
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{side} child failed (see {log.name})")
    result = json.load(open(out_json))
    result["peak_rss_gb"] = usage.ru_maxrss / 2**20  # KiB on Linux
    result["process_s"] = time.time() - t0
    result["engine_dtype"] = engine_dtype
    print(
        f"  {tag} {name}: peak RSS {result['peak_rss_gb']:.2f} GB, process {result['process_s']:.0f} s, steps "
        + ", ".join(f"{s['step_s']:.1f}s" if s["step_s"] else "warm-up" for s in result["steps"]),
        flush=True,
    )
    return result


def summarize(runs: list[dict], o, engine_dtype: str = "auto") -> str:
    ours = [r for r in runs if r["side"] == "ours" and r.get("engine_dtype", "auto") == engine_dtype]
    trl = [r for r in runs if r["side"] == "trl"]
    B = o.prompts * o.G

    def measured(r):
        return [s for s in r["steps"] if s["step_s"] is not None]

    def per_step(r, key):
        if key == "train_s":
            return [s["step_s"] - s["gen_s"] for s in measured(r)]
        if key == "tok_per_s":
            return [s["tokens"] / s["step_s"] for s in measured(r)]
        if key == "len":
            return [s["tokens"] / B for s in measured(r)]
        return [s[key] for s in measured(r)]

    rows = [
        ("step time (s)", "step_s"),
        ("generation (s)", "gen_s"),
        ("rest of step: rewards + train (s)", "train_s"),
        ("completion tokens / s", "tok_per_s"),
        ("mean completion tokens", "len"),
    ]
    lines = [
        f"ours with --engine-dtype {engine_dtype}",
        "",
        "| per step | ours median | TRL median | ours/TRL min | median | max |",
        "|---|---|---|---|---|---|",
    ]
    ratios_out = {}
    for label, key in rows:
        a = [v for r in ours for v in per_step(r, key)]
        b = [v for r in trl for v in per_step(r, key)]
        # pair step k of repeat r on both sides (same prompts), then min/median/max over the pairs
        ratios = [x / y for ro, rt in zip(ours, trl) for x, y in zip(per_step(ro, key), per_step(rt, key))]
        ratios_out[key] = ratios
        lines.append(
            f"| {label} | {statistics.median(a):.2f} | {statistics.median(b):.2f} | {min(ratios):.2f} | "
            f"{statistics.median(ratios):.2f} | {max(ratios):.2f} |"
        )
    mem = [ro["peak_rss_gb"] / rt["peak_rss_gb"] for ro, rt in zip(ours, trl)]
    ratios_out["peak_rss"] = mem
    lines.append(
        f"| peak resident memory (GB, per process) | {statistics.median(r['peak_rss_gb'] for r in ours):.2f} | "
        f"{statistics.median(r['peak_rss_gb'] for r in trl):.2f} | {min(mem):.2f} | {statistics.median(mem):.2f} | "
        f"{max(mem):.2f} |"
    )
    n_pairs = len(ratios_out["step_s"])
    lines.append("")
    lines.append(
        f"{len(ours)} repeats x {o.steps - 1} measured steps = {n_pairs} paired steps per side; "
        f"P={o.prompts}, G={o.G}, max completion {o.max_new_tokens}"
        f"{', forced to full length' if o.force_length else ', natural EOS'}. "
        f"Truncated fraction ours {statistics.median(s['truncated_frac'] for r in ours for s in measured(r)):.2f}, "
        f"TRL {statistics.median(s['truncated_frac'] for r in trl for s in measured(r)):.2f}. "
        f"TRL prompt ids identical to ours: {all(r.get('prompt_ids_match_ours') for r in trl)}."
    )
    return "\n".join(lines), ratios_out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--out-json", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=3, help="steps per process (the first is a dropped warm-up)")
    p.add_argument("--repeats", type=int, default=2, help="ours/TRL process pairs, alternating order")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (P)")
    p.add_argument("--G", type=int, default=8, help="generations per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=1, help="repeat r runs both sides with seed + r (its own prompts and draws)")
    p.add_argument("--force-length", action="store_true", help="every row runs --max-new-tokens on both sides")
    p.add_argument(
        "--trl-gradient-checkpointing",
        action="store_true",
        help="TRL's own default (True); off by default here because ours is off by default",
    )
    p.add_argument(
        "--engine-dtype",
        nargs="+",
        default=["auto"],
        choices=["auto", "bf16"],
        help="ours: the hf engine's weights (several: each repeat runs ours once per value, TRL once)",
    )
    p.add_argument("--python", default=sys.executable, help="interpreter for both children (needs trl)")
    p.add_argument("--results", default=os.path.join(ROOT, "bench", "results"), help="folder for JSON and logs")
    o = p.parse_args()
    if o.child:
        o.engine_dtype = o.engine_dtype[0]
        result = child_ours(o) if o.child == "ours" else child_trl(o)
        with open(o.out_json, "w") as f:
            json.dump(result, f)
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = os.path.join(o.results, f"vs_trl_{stamp}")
    os.makedirs(log_dir, exist_ok=True)
    print(f"logs in {log_dir}", flush=True)
    runs = []
    for rep in range(o.repeats):
        sides = [("ours", dtype) for dtype in o.engine_dtype] + [("trl", "auto")]
        for side, dtype in sides if rep % 2 == 0 else sides[::-1]:
            runs.append(run_child(side, o, log_dir, f"r{rep}", o.seed + rep, dtype))
    tables, ratios = {}, {}
    for dtype in o.engine_dtype:
        tables[dtype], ratios[dtype] = summarize(runs, o, dtype)
        print(tables[dtype] + "\n")
    with open(os.path.join(log_dir, "summary.json"), "w") as f:
        json.dump({"args": vars(o), "runs": runs, "ratios": ratios, "table": tables}, f, indent=1)
    with open(os.path.join(log_dir, "table.md"), "w") as f:
        f.write("\n".join(tables.values()) + "\n")


if __name__ == "__main__":
    main()
