"""Asynchronous rollouts, --async-lag S (docs/async.md): a producer process with its own copy of the policy and its
own rollout engine generates the batches of later steps while the trainer trains. A script calls start(...) once
(None when the flag is off), then:

    trainer (the script's loop)                               producer (produce(), another process)
    take(step, update): step's batch, its weight version       for each job (step, prompts, seed, min version), in
      stamped on it, and its lag update - version                order: wait until the published version reaches
    dispatch_ahead(step): draw the prompts of each step           the job's minimum, copy the newest published
      whose weights this step's updates publish                  weights into its copy (the batch's version, read
    publish(model, update): the weights after each update        before its first token), generate with the
    metrics(), sampler_state(), close()                          engine's log-probs mu, send the batch back

Pacing, not dropping: the batch of step j is sampled under a version v >= (j - 1) * U - S, U = --updates-per-batch
((j - 1) * U, counted from the first batch a run takes, is the version the trainer trains step j from), so its
lag (j - 1) * U - v lies in [0, S]: at most S + 1 batches are out at once, each is taken exactly once, in order,
and none is dropped. S = 0 runs through the same producer, paced to wait for each step's weights: the
synchronous run's prompts, seeds and weights.
Resume: a checkpoint holds the prompt sampler as it was before the first batch not yet taken, so a resumed run
draws the batches that were in flight again, with their seeds, and generates them under the checkpoint's weights.
"""

from __future__ import annotations

import atexit
import copy
import ctypes
import importlib.util
import itertools
import os
import queue
import re
import shutil
import signal
import time
import traceback
import weakref
from types import SimpleNamespace

import torch

import common
import models
from verifiers import RunError, UserError

OFF = "off"  # --async-lag's default: every step generates its own batch, in the trainer's process
POLL_S = 1.0  # how often a blocked side looks whether the other one is still alive
VERSION_POLL_S = 0.005  # how often a producer waiting for a version reads it (a shared integer, no lock)
CLOSE_WAIT_S = 30.0  # close(): the producer's time to shut its engine down before it is killed


def lag_of(args) -> int | None:
    """--async-lag as a number of optimizer updates; None: off."""
    return None if args.async_lag == OFF else int(args.async_lag)


def check_args(args, under_torchrun: bool) -> None:
    """The flag combinations async rollouts do not run, one UserError line each (run.validate_args: before anything
    loads). The lag's own value (off or a whole number) is checked with the flags (run.ARG_CHECKS)."""
    if lag_of(args) is None:
        return
    if under_torchrun:
        raise UserError(
            "--async-lag runs in one process: under torchrun it is not supported (docs/async.md); run it with python"
        )
    if args.dynamic_sampling:
        raise UserError(
            "--async-lag with --dynamic-sampling is not supported: a step's later rounds depend on its first round's "
            "rewards (docs/async.md); drop one of them"
        )
    device = rollout_device(args)  # a device that is not there: its own line
    if device.type == "cuda":
        producer_visible_devices(device, os.environ.get("CUDA_VISIBLE_DEVICES"))  # the trainer's view, mappable
    vllm = args.engine == "vllm" or (args.engine == "auto" and importlib.util.find_spec("vllm") is not None)
    if device.type == "cuda" and (device.index or 0) == 0 and vllm:
        raise UserError(
            "--async-lag with vLLM needs a GPU of its own for the producer (--rollout-device cuda:1): two vLLM engines "
            "and the trainer on one GPU do not fit; use --engine hf to share it"
        )


def rollout_device(args) -> torch.device:
    """--rollout-device: auto is the CPU when the trainer is on it, else the second GPU where there is one (the
    overlap is real only on capacity of its own), else the trainer's GPU, shared."""
    name = args.rollout_device
    if name == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", 1 if torch.cuda.device_count() > 1 else 0)
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--rollout-device {name}: not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise UserError(f"--rollout-device {name}: this machine has {count} CUDA device(s); use auto or cpu")
    elif device.type != "cpu":
        raise UserError(f"--rollout-device {name}: the producer runs on cpu or cuda[:N]")
    return device


def visible_devices(visible: str) -> list[str]:
    """The devices CUDA_VISIBLE_DEVICES makes visible, in order, each in its own form, read as CUDA reads it (and
    torch.cuda._parse_visible_devices): a list of GPU UUIDs (GPU-...) or of MIG instances (MIG-...), up to the first
    entry of another form; else indices, each the digits an entry starts with, up to the first entry with none or a
    negative one; a device named twice: none visible."""
    entries = visible.split(",")
    prefix = next((p for p in ("GPU-", "MIG-") if visible.startswith(p)), None)
    if prefix:
        named = list(itertools.takewhile(lambda e: e.startswith(prefix), entries))
    else:
        digits = [re.match(r"[+]?(\d+)", e.strip()) for e in entries]
        named = [str(int(m.group(1))) for m in itertools.takewhile(bool, digits)]
    return named if len(set(named)) == len(named) else []


def producer_visible_devices(device: torch.device, visible: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES of a producer on `device`, the trainer's cuda:i: the i-th device the trainer's own
    list makes visible, in its form (an index, a UUID or a MIG name: the child reads it as the same physical
    device), or i where the trainer has no list. A list with no i-th device: a UserError line."""
    index = device.index or 0
    if visible is None:
        return str(index)
    named = visible_devices(visible)
    if index < len(named):
        return named[index]
    raise UserError(
        f"--rollout-device {device}: CUDA_VISIBLE_DEVICES={visible!r} makes {len(named)} device(s) visible, so the "
        f"producer cannot be given the trainer's device {index}; name one of cuda:0..cuda:{len(named) - 1}, or fix "
        "the list"
        if named
        else f"--rollout-device {device}: CUDA_VISIBLE_DEVICES={visible!r} makes no device visible (an empty list, "
        "a device named twice or an entry CUDA does not read); fix the list"
    )


def start(args, model, model_path: str, lora, max_model_len: int, draw_prompts, sampler, update: int):
    """The producer of --async-lag (None when it is off or the run only evaluates): started here, its first weights
    the trainer's at `update`. draw_prompts(step, k) -> (problem ids, prompt token ids, seed) is the script's own."""
    if lag_of(args) is None or args.eval_only:
        return None
    return Producer(args, model, model_path, lora, max_model_len, draw_prompts, sampler, update)


class Producer:
    """The trainer's side of async rollouts: the jobs sent, the batches back, the weights published."""

    def __init__(self, args, model, model_path, lora, max_model_len, draw_prompts, sampler, update):
        self.lag, self.updates_per_batch, self.total_steps = lag_of(args), args.updates_per_batch, args.total_steps
        self.draw_prompts, self.sampler = draw_prompts, sampler
        device = rollout_device(args)
        cpu = device.type == "cpu" and next(model.parameters()).device.type == "cpu"
        if cpu and self.lag == 0 and not args.rollout_threads:  # the two sides take turns: each takes every core
            producer_threads = torch.get_num_threads()  # (the synchronous run's thread count, and so its sums)
        elif cpu:  # each side its own share of the cores
            cores = torch.get_num_threads()
            producer_threads = args.rollout_threads or max(1, cores // 2)
            torch.set_num_threads(max(1, cores - producer_threads))
        else:
            producer_threads = args.rollout_threads or torch.get_num_threads()
        ctx = torch.multiprocessing.get_context("spawn")
        # the published weights: the trainable parameters, in shared host memory (LoRA: the adapters only)
        self.params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        _check_shared_memory(sum(p.numel() * p.element_size() for _, p in self.params))
        self.shared = {name: torch.empty(p.shape, dtype=p.dtype).share_memory_() for name, p in self.params}
        # their version, written under self.lock with them. A plain lock and a polled integer, not a Condition: a
        # producer killed while waiting on a Condition would leave the trainer's next notify blocked for good
        self.published = ctx.Value("q", -1, lock=False)
        self.lock = ctx.Lock()
        self.stopping = ctx.Value("b", 0, lock=False)  # 1: the producer stops at its next look (close())
        self.jobs, self.results = ctx.Queue(), ctx.Queue()
        self.pending = {}  # step -> (problem ids, the sampler's state before they were drawn), dispatched, not taken
        self.ready = {}  # step -> the finished batch's message, received, not taken
        self.next_dispatch = None  # the first step not dispatched yet
        self.base = None  # the version step 1 would be trained from: pacing is anchored at the first batch taken
        self.publish_s, self.waited_s, self.generated_s, self.depth, self.last_lag = 0.0, 0.0, 0.0, 0, 0
        self.process = None
        self.publish(model, update)
        self.publish_s = 0.0
        settings = {
            "args": dict(vars(args)),
            "model_path": model_path,
            "lora": lora,
            "max_model_len": max_model_len,
            "device": str(device),
            "visible": producer_visible_devices(device, os.environ.get("CUDA_VISIBLE_DEVICES"))
            if device.type == "cuda"
            else None,
            "threads": producer_threads,
        }
        self.process = ctx.Process(
            target=produce,
            args=(settings, self.shared, self.published, self.lock, self.stopping, self.jobs, self.results, os.getpid()),
            name="rollout-producer",
            daemon=False,  # vLLM's engine starts processes of its own
        )
        self.process.start()
        self.t0 = None  # set when the first batch is taken
        # stopped by close(), or when this object is collected or the interpreter exits, whichever comes first (a run
        # that stops on an error, in a script or in-process, leaves no producer behind)
        self._stop = weakref.finalize(self, _stop_producer, self.process, self.stopping, self.jobs, self.results)
        _OPEN.difference_update([stop for stop in _OPEN if not stop.alive])
        _OPEN.add(self._stop)
        common.CONSOLE.info(
            f"async rollouts: a producer on {device} ({producer_threads} thread(s); the trainer "
            f"{torch.get_num_threads()}), at most {self.lag} update(s) behind"
        )

    # ----- the weights

    @torch.no_grad()
    def publish(self, model, version: int) -> None:
        """The trainer's weights after update `version`, for the producer's next batch (under the lock: the
        producer never copies half of one version and half of another)."""
        t0 = time.perf_counter()
        while not self.lock.acquire(timeout=POLL_S):  # the producer copies the previous version out
            if self.process is not None and not self.process.is_alive():  # died holding the lock: it stays held
                raise RunError(f"--async-lag: the rollout producer died (exit code {self.process.exitcode})")
        try:
            for name, p in self.params:
                self.shared[name].copy_(p.detach())
            self.published.value = version
        finally:
            self.lock.release()
        self.publish_s += time.perf_counter() - t0

    # ----- the jobs

    def trained_from(self, step: int) -> int:
        """The version step `step` is trained from: `base` + (step - 1) * U (base 0, or a resumed run's offset)."""
        return self.base + (step - 1) * self.updates_per_batch

    def min_version(self, step: int) -> int:
        """The oldest weights step `step` may be sampled under: S updates before the version it is trained from."""
        return max(0, self.trained_from(step) - self.lag)

    def dispatch(self, step: int) -> None:
        state = copy.deepcopy(self.sampler.state_dict())  # a checkpoint before this batch resumes with its draw
        problem_idx, prompt_ids, seed = self.draw_prompts(step, 0)
        self.pending[step] = (problem_idx, state)
        self.jobs.put((step, prompt_ids, seed, self.min_version(step)))
        self.next_dispatch = step + 1

    def dispatch_ahead(self, step: int) -> None:
        """After step `step`'s batch is scored (a method's choice of the next prompts made), before its updates: send
        every later batch whose minimum version these updates publish, (j - 1) * U - S <= step * U."""
        j = self.next_dispatch if self.next_dispatch is not None else step + 1
        while j <= self.total_steps and self.min_version(j) <= self.trained_from(step + 1):
            self.dispatch(j)
            j += 1

    def take(self, step: int, update: int) -> tuple:
        """Step's problem ids and batch (a RolloutBatch with .version, the weights it was sampled under, and .lag =
        update - version), once the producer has it; RunError if the producer failed or died."""
        if self.base is None:  # the first batch (also of a resumed run): pacing counts from the trainer's update now
            self.base = update - (step - 1) * self.updates_per_batch
        if self.trained_from(step) != update:
            raise RunError(f"--async-lag: step {step} starts at update {update}, not {self.trained_from(step)}")
        if step not in self.pending:  # the run's first step (also after a resume)
            self.dispatch(step)
        t0 = time.perf_counter()
        self._receive(block=False)
        self.depth = len(self.ready)  # finished batches waiting when the trainer asks (this step's included)
        while step not in self.ready:
            self._receive(block=True)
        self.waited_s += time.perf_counter() - t0
        _, _, rollout, version, gen_s = self.ready.pop(step)
        problem_idx, _ = self.pending.pop(step)
        if not rollout.has_engine_logps:
            raise RunError("--async-lag: the producer's engine returned no log-probs mu; a stale batch needs them")
        rollout.version, rollout.lag = version, update - version
        if not 0 <= rollout.lag <= self.lag:
            raise RunError(f"--async-lag {self.lag}: step {step}'s batch is {rollout.lag} updates old (a pacing bug)")
        self.generated_s += gen_s
        self.last_lag = rollout.lag
        if self.t0 is None:  # the first batch is serial by nature (and waits for the producer's start): the clocks of
            self.t0, self.waited_s, self.generated_s = time.perf_counter(), 0.0, 0.0  # overlap and idleness start here
        return problem_idx, rollout

    def _receive(self, block: bool) -> None:
        while True:
            try:
                message = self.results.get(timeout=POLL_S) if block else self.results.get_nowait()
            except queue.Empty:
                if block and not self.process.is_alive():
                    raise RunError(
                        f"--async-lag: the rollout producer died (exit code {self.process.exitcode}); "
                        "its error, if it wrote one, is above"
                    ) from None
                if block:
                    continue
                return
            if message[0] == "error":
                raise RunError(f"--async-lag: the rollout producer failed: {message[1]}")
            if message[0] == "batch":
                self.ready[message[1]] = message
                if block:
                    return

    # ----- what the run logs and saves

    def metrics(self) -> dict:
        """The step's async/ and perf/ keys: its batch's lag (every row of a batch shares its version), the finished
        batches waiting when it was taken, the weight publishes of its updates, and over the run so far the overlap
        1 - wall / (generation + training) and each side's idle share."""
        wall = max(time.perf_counter() - self.t0, 1e-9)  # since the first batch was taken
        trainer_busy = wall - self.waited_s
        out = {
            "async/lag_mean": float(self.last_lag),
            "async/lag_max": float(self.last_lag),
            "async/queue_depth": float(self.depth),
            "perf/weight_publish_s": self.publish_s,
            "perf/overlap_frac": 1.0 - wall / max(self.generated_s + trainer_busy, 1e-9),
            "async/producer_idle_frac": max(0.0, 1.0 - self.generated_s / wall),
            "async/trainer_idle_frac": self.waited_s / wall,
        }
        self.publish_s = 0.0
        return out

    def sampler_state(self) -> dict:
        """The prompt sampler for a checkpoint: as it was before the first batch dispatched and not yet taken."""
        if self.pending:
            return self.pending[min(self.pending)][1]
        return self.sampler.state_dict()

    def close(self) -> None:
        """Stop the producer (its engine shut down; killed after CLOSE_WAIT_S). A second call does nothing."""
        self._stop()


def _stop_producer(process, stopping, jobs, results) -> None:
    """Ask the producer to stop (it looks between jobs and while it waits for a version), read what it still sends
    (its exit waits for its batches to leave the pipe), then kill it after CLOSE_WAIT_S."""
    stopping.value = 1
    jobs.put(None)
    deadline = time.monotonic() + CLOSE_WAIT_S
    while process.is_alive() and time.monotonic() < deadline:
        process.join(0.05)
        try:
            while True:
                results.get_nowait()
        except (queue.Empty, OSError, EOFError):
            pass
    if process.is_alive():
        process.kill()
        process.join()
    for q in (jobs, results):
        q.cancel_join_thread()
        q.close()


_OPEN: set = set()  # the finalizers of the producers started (the ones that ran are pruned at the next start)


@atexit.register  # registered after multiprocessing's own exit hook (torch imports it), so it runs before that
def close_all() -> None:  # hook joins every child still running: a producer waiting for jobs would never end
    """Stop every producer still running: at exit, and for a run stopped in-process (the tests)."""
    for stop in list(_OPEN):
        stop()  # a finalizer that ran already does nothing
    _OPEN.clear()


def _check_shared_memory(needed: int) -> None:
    """The published weights live in shared memory (/dev/shm on Linux): RunError, in one line, where it is too small."""
    if not os.path.isdir("/dev/shm"):
        return
    free = shutil.disk_usage("/dev/shm").free
    if needed > free:
        raise RunError(
            f"--async-lag: the published weights need {needed / 2**30:.2f} GiB of shared memory, /dev/shm has "
            f"{free / 2**30:.2f} GiB free (in a container: --shm-size)"
        )


# ----- the producer process


def produce(settings, shared, published, lock, stopping, jobs, results, parent_pid) -> None:
    """The producer's loop (a spawned process): its own copy of the policy and engine, one job at a time."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the trainer stops it
    engine = None
    try:
        args = SimpleNamespace(**settings["args"])
        device = torch.device(settings["device"])
        torch.set_num_threads(settings["threads"])
        if device.type == "cuda":  # its GPU only, before CUDA starts: vLLM's executor takes the first device it sees
            os.environ["CUDA_VISIBLE_DEVICES"] = settings["visible"]  # the physical GPU behind the trainer's cuda:i
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
        model_path = settings["model_path"]
        tokenizer = models.load_tokenizer(model_path)
        policy = models.load_model(
            model_path,
            device,
            compute_dtype=args.dtype,
            max_position_embeddings=args.max_position_embeddings,
            lora=settings["lora"],
        )  # as the trainer's model loads (fp32, training mode), so that lag 0 samples what the trainer's engine would
        policy.requires_grad_(False)
        params = dict(policy.named_parameters())
        missing = sorted(set(shared) - set(params))
        if missing:
            raise RunError(f"the producer's copy has no parameter {missing[0]} (of {len(missing)} published)")
        engine = models.make_engine(args, policy, tokenizer, model_path, settings["max_model_len"], engine_logps=True)
        if engine.name == "hf" and not engine.return_logps:
            raise RunError("the producer's engine returns no log-probs mu; async rollouts need them")
        serve(args, engine, policy, shared, published, lock, stopping, jobs, results, parent_pid)
    except SystemExit:  # the trainer is gone: nobody to tell
        results.cancel_join_thread()
    except BaseException as e:  # noqa: BLE001 - the trainer gets the reason in one line, then the process ends
        if not stopping.value:
            traceback.print_exc()
            results.put(("error", f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__))
            results.close()
            results.join_thread()  # the line is in the pipe before the process ends (the trainer reads it)
    finally:
        if stopping.value:
            results.cancel_join_thread()  # the trainer stops us: exit without waiting for it to read the pipe
        if engine is not None and hasattr(engine, "close"):
            engine.close()


def serve(args, engine, policy, shared, published, lock, stopping, jobs, results, parent_pid) -> None:
    """One job at a time until the trainer sends None: wait for the job's minimum version, take the newest published
    weights into `policy` (the batch's version is read here, under the lock, before its first token), generate with
    the lock free (the trainer publishes meanwhile), send ("batch", step, rollout, version, seconds) back."""
    params = dict(policy.named_parameters())
    held = None  # the version the copy holds
    while True:
        job = _next_job(jobs, stopping, parent_pid)
        if job is None:
            return
        step, prompt_ids, seed, min_version = job
        polls = 0
        while published.value < min_version:  # the trainer's update that publishes it is under way
            time.sleep(VERSION_POLL_S)
            polls += 1
            if polls % int(POLL_S / VERSION_POLL_S) == 0:
                _check_parent(parent_pid)
            if stopping.value:
                return
        with lock:
            version = published.value
            if version != held:
                with torch.no_grad():
                    for name, tensor in shared.items():
                        params[name].copy_(tensor)
                held = version
        t0 = time.perf_counter()
        engine.wake(policy, version=version)
        G, T = args.num_generations, args.max_new_tokens
        rollout = engine.generate(prompt_ids, G, T, args.temperature, seed=seed, progress=False)
        results.put(("batch", step, rollout, version, time.perf_counter() - t0))


def _next_job(jobs, stopping, parent_pid):
    while not stopping.value:
        try:
            return jobs.get(timeout=POLL_S)
        except queue.Empty:
            _check_parent(parent_pid)
    return None


def _check_parent(parent_pid: int) -> None:
    if os.getppid() != parent_pid:
        raise SystemExit("the trainer is gone")


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when the trainer dies, whatever the trainer died of (else: the polls above)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    _check_parent(parent_pid)
