"""The GPU path, round two (issue 61), what the CPU can show of it: the static engine's KV cache given back at
sleep() by reference counting (no garbage collector) and one cache alive at a change of chunk shape; the async
producer's device mapped through the trainer's CUDA_VISIBLE_DEVICES (indices, UUIDs, MIG names, emulated); the
engine a GPU run builds (the dynamic loop unless --hf-decode static, refused where it cannot run)."""

from __future__ import annotations

import gc
import queue
import tempfile
import types
import weakref

import pytest
import torch

import async_rollouts
import engines
import grpo
import models
import run
from tests import tiny
from verifiers import UserError


@pytest.fixture(scope="module")
def tiny_path():
    return tiny.make_tiny_model(tempfile.mkdtemp(prefix="gpu_round2_"))


def _static(path, gen_batch_size):
    tok = models.load_tokenizer(path)
    model = models.load_model(path, torch.device("cpu"))
    return engines.StaticHFEngine(model, tok, gen_batch_size=gen_batch_size, return_logps=True), tok


def _prompts(tok, k):
    return [tok(f"{i}+{i}=", add_special_tokens=False)["input_ids"] for i in range(k)]


def _completions(rollout):
    return [rollout.completion(r) for r in range(len(rollout))]


def test_sleep_gives_the_cache_back_without_the_garbage_collector(tiny_path):
    """After sleep() the cache's tensors are gone at once, with the cyclic collector off: at 08e5dbc the decode
    step's closure referred back to its state (a cycle), so the cache lived until a full collection (this fails
    there)."""
    engine, tok = _static(tiny_path, gen_batch_size=8)
    engine.generate(_prompts(tok, 2), 2, 4, 1.0, seed=0, progress=False)
    cache = engine.decode_state.cache
    keys, values = weakref.ref(cache.keys[0]), weakref.ref(cache.values[-1])
    del cache
    gc.collect()  # nothing else of the generate call is left in a cycle of its own
    gc.disable()
    try:
        engine.sleep()
        assert keys() is None and values() is None
    finally:
        gc.enable()


def test_a_change_of_chunk_shape_holds_one_cache_not_two(tiny_path, monkeypatch):
    """Two chunks of different shapes (8 rows, then the last 4): when the second cache is allocated, no tensor of
    the first is alive (the garbage collector off, as the CUDA allocator never runs it). At 08e5dbc both were."""
    engine, tok = _static(tiny_path, gen_batch_size=8)
    allocate, caches, alive_at_allocation = engines.StaticKV.allocate, [], []

    def counting(config, rows, length, dtype, device):
        alive_at_allocation.append(sum(ref() is not None for ref in caches))
        cache = allocate(config, rows, length, dtype, device)
        caches.append(weakref.ref(cache.keys[0]))
        return cache

    monkeypatch.setattr(engines.StaticKV, "allocate", staticmethod(counting))
    gc.collect()
    gc.disable()
    try:
        engine.generate(_prompts(tok, 3), 4, 4, 1.0, seed=0, progress=False)  # 12 rows: chunks of 8 and 4
    finally:
        gc.enable()
    assert alive_at_allocation == [0, 0]


def test_the_released_state_draws_what_a_kept_one_does(tiny_path):
    """sleep() between two calls changes no token: the state is rebuilt as it was (the same seed, the same draws)."""
    engine, tok = _static(tiny_path, gen_batch_size=8)
    prompts = _prompts(tok, 3)
    kept = [_completions(engine.generate(prompts, 4, 6, 1.0, seed=3, progress=False)) for _ in range(2)]
    engine.sleep()
    again = _completions(engine.generate(prompts, 4, 6, 1.0, seed=3, progress=False))
    assert kept[0] == kept[1] == again


# ----- the producer's GPU: the trainer's cuda:i through the trainer's own CUDA_VISIBLE_DEVICES


@pytest.mark.parametrize(
    "visible, index, physical",
    [
        (None, 1, "1"),  # no list: the bare index
        ("2,3", 1, "3"),  # 08e5dbc gave "1": physical GPU 1, not the job's 3
        ("3", 0, "3"),  # a scheduler's one GPU: 08e5dbc gave "0"
        (" 4, 6", 1, "6"),  # CUDA reads an index as the digits an entry starts with
        ("GPU-8b0e3f3a-aaaa,GPU-11c2d4e5-bbbb", 1, "GPU-11c2d4e5-bbbb"),
        ("MIG-4f7a9c1e-cccc", 0, "MIG-4f7a9c1e-cccc"),
        ("MIG-GPU-8b0e3f3a-aaaa/1/0", 0, "MIG-GPU-8b0e3f3a-aaaa/1/0"),  # the older drivers' MIG form
    ],
)
def test_the_producer_gets_the_physical_device_of_the_trainers_view(visible, index, physical):
    assert async_rollouts.producer_visible_devices(torch.device("cuda", index), visible) == physical


@pytest.mark.parametrize(
    "visible, index, needle",
    [
        ("3", 1, "makes 1 device(s) visible"),
        ("2,-1,3", 1, "makes 1 device(s) visible"),  # a negative entry ends the list
        ("GPU-8b0e3f3a,3", 1, "makes 1 device(s) visible"),  # an entry of another form ends a UUID list
        ("0,0", 0, "makes no device visible"),  # a device named twice: none
        ("", 0, "makes no device visible"),
    ],
)
def test_a_device_that_cannot_be_mapped_is_refused_in_one_line(visible, index, needle):
    with pytest.raises(UserError) as err:
        async_rollouts.producer_visible_devices(torch.device("cuda", index), visible)
    assert needle in str(err.value) and "\n" not in str(err.value)


def _fake_gpus(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_the_flags_check_refuses_an_unmappable_producer_before_anything_loads(monkeypatch):
    """run.validate_args (async_rollouts.check_args): the trainer sees 2 GPUs, the list names the same one twice."""
    _fake_gpus(monkeypatch, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,5")
    args = grpo.Args(async_lag="1", rollout_device="cuda:1", engine="hf")
    with pytest.raises(UserError, match="makes no device visible"):
        async_rollouts.check_args(args, under_torchrun=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    async_rollouts.check_args(args, under_torchrun=False)  # mappable: no error


def test_the_producer_process_sets_the_mapped_device_before_cuda_starts(monkeypatch):
    """produce() (the spawned process' loop, run in this process) with the settings the trainer wrote for
    CUDA_VISIBLE_DEVICES=GPU-a,GPU-b and --rollout-device cuda:1: CUDA_VISIBLE_DEVICES is GPU-b when it first
    touches CUDA (set_device, stubbed to stop the producer there)."""
    seen = {}

    def set_device(device):
        seen["visible"], seen["device"] = async_rollouts.os.environ["CUDA_VISIBLE_DEVICES"], str(device)
        raise RuntimeError("stopped here by the test")

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(async_rollouts, "_die_with_parent", lambda pid: None)
    monkeypatch.setattr(async_rollouts.signal, "signal", lambda *a: None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b")
    settings = {
        "args": {}, "device": "cuda:1", "threads": 1,
        "visible": async_rollouts.producer_visible_devices(torch.device("cuda:1"), "GPU-a,GPU-b"),
    }  # fmt: skip

    class Results(queue.Queue):
        close = join_thread = cancel_join_thread = lambda self: None

    results = Results()
    threads = torch.get_num_threads()
    try:
        async_rollouts.produce(settings, {}, None, None, types.SimpleNamespace(value=0), None, results, 0)
    finally:
        torch.set_num_threads(threads)
    assert seen == {"visible": "GPU-b", "device": "cuda:0"}
    assert results.get_nowait() == ("error", "RuntimeError: stopped here by the test")


# ----- the engine a GPU run builds


def test_hf_decode_static_is_refused_where_it_cannot_run(monkeypatch):
    """--hf-decode static/static-eager: the static loop on a GPU's copy in one process; elsewhere one line before
    anything loads (never a silent fallback to the dynamic loop)."""
    args = grpo.Args(hf_decode="static", engine="hf")
    assert "there is no GPU" in run._check_cross(args)
    _fake_gpus(monkeypatch, 1)
    monkeypatch.setattr(run.importlib.util, "find_spec", lambda name: None)  # no vLLM installed
    assert run._check_cross(args) is None
    assert "--engine-dtype trainer leaves no copy" in run._check_cross(
        grpo.Args(hf_decode="static-eager", engine_dtype="trainer")
    )
    for name, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("MASTER_ADDR", "localhost"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    assert "under torchrun" in run._check_cross(args)


def test_the_default_gpu_engine_is_the_dynamic_loop(tiny_path, monkeypatch):
    """make_engine on a GPU in one process (models.on_one_gpu stubbed, the model on the CPU): HFEngine on the bf16
    copy by default, StaticHFEngine only under --hf-decode static (graphs) or static-eager (none)."""
    model = models.load_model(tiny_path, torch.device("cpu"))
    tok = models.load_tokenizer(tiny_path)
    monkeypatch.setattr(models, "on_one_gpu", lambda model: True)
    built = {}
    for decode in ("dynamic", "static", "static-eager"):
        args = grpo.Args(engine="hf", hf_decode=decode, gen_batch_size=8)
        built[decode] = models.make_engine(args, model, tok, tiny_path, 64)
    monkeypatch.undo()
    assert type(built["dynamic"]) is engines.HFEngine and built["dynamic"].sampler is not model  # the bf16 copy
    assert next(built["dynamic"].sampler.parameters()).dtype == torch.bfloat16
    assert type(built["static"]) is engines.StaticHFEngine and built["static"].cuda_graphs
    assert type(built["static-eager"]) is engines.StaticHFEngine and not built["static-eager"].cuda_graphs
