"""Do a colocated vLLM CPU engine and the trainer contend for the cores inside one process?

Runs in the vLLM venv (docs/vllm.md). Two child processes, one after the other:
- `alone`: only the vLLM engine (the CPU build, in-process engine core as the scripts build it) generating
  4 prompts x 8 completions of at most 64 tokens, 4 times after start-up;
- `colocated`: what grpo.py --engine vllm does: the trainer's model loaded first (threads set by run.setup's
  set_cpu_threads), a training pass timed (packed micro-batches, forward + backward of 32 rows), then the engine
  built beside it; then 4 rounds of generate -> sleep -> the same training pass -> wake (weight push).
Each child prints torch's thread count and the threads' CPU affinity before and after the engine starts, and the
CPU seconds that threads other than the main thread and torch's OpenMP workers used during the training passes
(a vLLM thread that spins while the trainer works would show there), the process's context switches during each
pass (a thread that wakes often preempts the trainer's OpenMP workers), and the engine's threads by name.

    flock /tmp/cpu.lock /path/to/vllm-venv/bin/python bench/vllm_colocated.py            # ~10 min on 2 cores
    VLLM_CPU_CI_ENV=1 flock /tmp/cpu.lock /path/to/vllm-venv/bin/python bench/vllm_colocated.py   # eager engine
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
ROUNDS = 4


def thread_cpu_s() -> dict[int, float]:
    """CPU seconds (user + system) of every thread of this process, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def thread_state() -> dict:
    import torch

    affinities = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            status = open(f"/proc/self/task/{tid}/status").read()
        except OSError:
            continue
        affinities.add(status.split("Cpus_allowed_list:")[1].split()[0])
    names: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
        except OSError:
            continue
        names[name] = names.get(name, 0) + 1
    return {
        "torch_threads": torch.get_num_threads(),
        "os_threads": len(os.listdir("/proc/self/task")),
        "affinities": sorted(affinities),
        "names": names,
    }


def child(mode: str) -> dict:
    import torch

    import common
    import engines
    import models
    import run
    import verifiers
    from tests import references

    run.set_cpu_threads()
    path = models.embedded_model_dir()
    tok = models.load_tokenizer(path)
    task = verifiers.load_task("arith", "train", 1)
    prompts = [common.format_prompt(tok, p["question"], task.instruction) for p in task.problems[:4]]
    result = {"mode": mode, "before_engine": thread_state(), "train_s_before": [], "train_s_after": [], "gen": []}
    model = None
    rollout = references.rollout_from_rows(
        [prompts[g] for g in range(4) for _ in range(8)], [list(range(100, 130))] * 32
    )  # 4 groups x 8 rows of 30 tokens

    def train_pass() -> tuple[float, float, int, int]:
        """Seconds of one forward + backward, the CPU seconds of threads other than this one and the pool's, and the
        process's voluntary and involuntary context switches meanwhile."""
        before = thread_cpu_s()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        for micro in common.micro_batches(rollout, range(32), 1024, model):
            batch = common.token_batch_of(rollout, micro, tok.pad_token_id)
            logp, _ = common.completion_logps(model, batch, 1.0)
            logp.sum().backward()
        model.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        after, usage_after = thread_cpu_s(), resource.getrusage(resource.RUSAGE_SELF)
        used = sorted(((after[t] - before.get(t, 0.0)), t) for t in after)
        # the busiest threads are this one and torch's OpenMP workers (threads - 1 of them): the rest is others
        others = sum(u for u, _ in used[: max(0, len(used) - torch.get_num_threads())])
        switches = usage_after.ru_nvcsw - usage.ru_nvcsw, usage_after.ru_nivcsw - usage.ru_nivcsw
        return seconds, others, *switches

    if mode == "colocated":
        model = models.load_model(path, torch.device("cpu"))
        train_pass()  # warm-up
        result["train_s_before"] = [train_pass() for _ in range(2)]
    t0 = time.perf_counter()
    if mode == "colocated":
        engine = models.make_engine(
            run.Args(engine="vllm", seed=1, gen_batch_size=64, gpu_memory_utilization=0.35), model, tok, path, 256
        )
    else:
        engine = engines.VLLMEngine(path, tok, max_model_len=256, seed=1, gpu_memory_utilization=0.35, dtype="float32")
    result["engine_start_s"] = time.perf_counter() - t0
    result["after_engine"] = thread_state()
    for i in range(ROUNDS):
        t0 = time.perf_counter()
        ro = engine.generate(prompts, 8, 64, 1.0, seed=i, progress=False)
        seconds = time.perf_counter() - t0
        result["gen"].append({"s": seconds, "tokens": int(ro.completion_lengths.sum())})
        if mode == "colocated":
            engine.sleep()
            result["train_s_after"].append(train_pass())
            engine.wake(model)
    engine.close()
    return result


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(child(sys.argv[2])), flush=True)
        return
    results = {}
    for mode in ("alone", "colocated"):
        proc = subprocess.run([sys.executable, __file__, "--child", mode], cwd=ROOT, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            sys.exit(f"{mode} child failed:\n{proc.stderr[-3000:]}")
        results[mode] = json.loads(line[len("RESULT ") :])
    print(f"VLLM_CPU_CI_ENV={os.environ.get('VLLM_CPU_CI_ENV', '0')} (1: eager, no inductor compile)\n")
    print("| | alone | colocated with the trainer |")
    print("|---|---|---|")
    a, c = results["alone"], results["colocated"]

    def rates(r):  # the first round is a warm-up (new batch shapes)
        return [g["tokens"] / g["s"] for g in r["gen"][1:]]

    print(f"| engine start s | {a['engine_start_s']:.0f} | {c['engine_start_s']:.0f} |")
    print(
        "| generate tok/s, rounds 2-4 (median, min-max) | "
        + " | ".join(f"{statistics.median(rates(r)):.1f} ({min(rates(r)):.1f}-{max(rates(r)):.1f})" for r in (a, c))
        + " |"
    )
    print(f"| generate tok/s, round 1 | {rates_first(a):.1f} | {rates_first(c):.1f} |")
    for key in ("before_engine", "after_engine"):
        cells = [f"{r[key]['torch_threads']}, {r[key]['os_threads']}, {'/'.join(r[key]['affinities'])}" for r in (a, c)]
        print(f"| {key.replace('_', ' ')}: torch threads, OS threads, affinity | {' | '.join(cells)} |")
    passes = [("before", p) for p in c["train_s_before"]] + [("after", p) for p in c["train_s_after"]]
    print("\n| training pass (32 rows x 30 tokens, fwd + bwd) | s | CPU s of other threads | context switches vol / invol |")
    print("|---|---|---|---|")
    for when, (seconds, others, vol, invol) in passes:
        print(f"| {when} the engine | {seconds:.1f} | {others:.2f} | {vol} / {invol} |")
    print(f"\nthreads by name after the engine (colocated): {c['after_engine']['names']}")


def rates_first(r) -> float:
    return r["gen"][0]["tokens"] / r["gen"][0]["s"]


if __name__ == "__main__":
    main()
