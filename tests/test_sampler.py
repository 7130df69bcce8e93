"""The HF engine's sampler: each token drawn from softmax(logits / T) exactly (chi-square tests against the exact
probabilities, and mutated samplers that fail them), one uniform per running row (ended rows draw nothing), the
same tokens for a seed however the groups are chunked or split over ranks; and the opt-in bf16 engine (a bf16
copy of the weights for generation, refreshed at each weight sync, the trainer's fp32 weights untouched)."""

import tempfile

import pytest
import torch

import common
import engines
import grpo
import models
import run
from tests import references, tiny

N_DRAWS = 100_000


@pytest.fixture(scope="module")
def tiny_path():
    return tiny.make_tiny_model(tempfile.mkdtemp(prefix="sampler_"))


@pytest.fixture(scope="module")
def sharp_path(tiny_path):
    """The tiny model with its final norm scaled by 8: logits of standard deviation ~1 instead of ~0.12 (a nearly
    uniform next token, which a sampler that ignored T would draw just as well)."""
    model = models.load_model(tiny_path, torch.device("cpu"))
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    path = tempfile.mkdtemp(prefix="sampler_sharp_")
    model.save_pretrained(path)
    models.load_tokenizer(tiny_path).save_pretrained(path)
    return path


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts (K,) against probabilities (K,): Pearson's statistic, cells expected below 5
    merged into one, df = cells - 1 (regularized upper incomplete gamma)."""
    counts, expected = counts.double(), probs.double() * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
        expected = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    stat = ((counts - expected) ** 2 / expected).sum()
    df = len(counts) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), stat / 2).item()


def two_sample_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value that counts a (K,) and b (K,) come from one distribution (chi-square test of the 2 x K table;
    columns with fewer than 10 draws in all merged into one)."""
    a, b = a.double(), b.double()
    small = (a + b) < 10
    if small.any():
        a = torch.cat([a[~small], a[small].sum(0, keepdim=True)])
        b = torch.cat([b[~small], b[small].sum(0, keepdim=True)])
    table = torch.stack([a, b])  # (2, K)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = table.shape[1] - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), stat / 2).item()


# ----- sample_from_logits against the exact probabilities


def correct(logits, T, u):
    return engines.sample_from_logits(logits / T, u)


def ignores_temperature(logits, T, u):
    return engines.sample_from_logits(logits, u)


def drops_the_last_token(logits, T, u):
    return engines.sample_from_logits(logits[:, :-1] / T, u)


def float32_cumsum(logits, T, u):  # the cumulative sum in float32: its rounding shows on a long vocabulary
    cdf = torch.softmax(logits / T, dim=-1).cumsum(dim=-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1).clamp(max=logits.shape[-1] - 1)


PEAKED = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.027, 0.003]).log()  # the last token has 0.3%


def draw_counts(sampler, logits: torch.Tensor, T: float, n: int = N_DRAWS, seed: int = 0) -> torch.Tensor:
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed))
    tokens = sampler(logits.expand(n, -1), T, u)
    return torch.bincount(tokens, minlength=logits.shape[-1])


@pytest.mark.parametrize("T", [0.5, 1.0, 2.0])
def test_sampler_draws_softmax_of_logits_over_T(T):
    """100,000 draws of a 6-token distribution whose last token has probability 0.003 (at T 1), and of 80 random
    logits: the counts fit softmax(logits / T) (p > 0.001; seeds fixed, so the test is deterministic)."""
    wide = torch.randn(80, generator=torch.Generator().manual_seed(3)) * 2
    for logits in (PEAKED, wide):
        counts = draw_counts(correct, logits[None], T)
        assert chi_square_p(counts, torch.softmax(logits / T, -1)) > 1e-3


@pytest.mark.parametrize("mutant,T", [(ignores_temperature, 0.5), (ignores_temperature, 2.0), (drops_the_last_token, 1.0)])
def test_a_wrong_sampler_fails_the_same_test(mutant, T):
    """The test above can fail: a sampler that ignores T, or never draws the last token, is rejected (p < 1e-9)."""
    counts = draw_counts(mutant, PEAKED[None], T)
    assert chi_square_p(counts, torch.softmax(PEAKED / T, -1)) < 1e-9


def test_each_row_draws_from_its_own_distribution():
    """Rows with different logits in one call: each row's counts fit its own softmax (the gather is row-aligned)."""
    logits = torch.stack([PEAKED, PEAKED.flip(0), torch.zeros(6)])  # (3, 6)
    n = 40_000
    u = torch.rand(3 * n, generator=torch.Generator().manual_seed(1))
    tokens = engines.sample_from_logits(logits.repeat(n, 1), u).view(n, 3)
    for r in range(3):
        assert chi_square_p(torch.bincount(tokens[:, r], minlength=6), torch.softmax(logits[r], -1)) > 1e-3


def test_large_vocabulary_extremes():
    """49,152 logits (the embedded model's vocabulary): u near 0 draws the first token with mass, u near 1 the last
    one with mass, never an index past the vocabulary."""
    logits = torch.full((2, 49152), -1e4)
    logits[:, [5, 49150]] = 0.0
    u = torch.tensor([0.0, 1.0 - 2**-24])
    assert engines.sample_from_logits(logits, u).tolist() == [5, 49150]


# ----- the engine: the distribution, the draws it spends, a seed's tokens


def _engine(path, gen_batch_size=64, static_cache=False, **kw):
    """HFEngine, or StaticHFEngine (its loop with a static KV cache, CUDA graphs on a GPU, eager here)."""
    tok = models.load_tokenizer(path)
    engine = engines.StaticHFEngine if static_cache else engines.HFEngine
    return engine(models.load_model(path, torch.device("cpu")), tok, gen_batch_size=gen_batch_size, **kw), tok


@pytest.mark.parametrize("static_cache", [False, True], ids=["dynamic-cache", "static-cache"])
def test_engine_first_and_second_tokens_follow_the_model(sharp_path, static_cache):
    """4,000 rows of one prompt, two tokens each at T 0.7: the first tokens fit softmax(logits / T) of the prompt,
    the second tokens (rows whose first token was not EOS) the exact mixture sum_t1 p(t1) p(. | prompt, t1). Both
    loops: the dynamic KV cache (the CPU default) and the static one (CUDA's, with graphs there)."""
    engine, tok = _engine(sharp_path, gen_batch_size=4000, static_cache=static_cache)
    model, T = engine.model, 0.7
    prompt = common.format_prompt(tok, "What is 1 + 2?")
    ro = engine.generate([prompt], 4000, 2, T, seed=5, progress=False)
    V = model.config.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double() / T, -1)  # (V,)
        follow = torch.tensor([prompt + [t] for t in range(V)])  # every possible first token
        p2 = torch.softmax(model(follow).logits[:, -1].double() / T, -1)  # (V, V) p(t2 | prompt, t1)
    eos = sorted(engine.eos_ids)
    p1_going = p1.clone()
    p1_going[eos] = 0.0
    mixture = (p1_going[:, None] * p2).sum(0) / p1_going.sum()  # (V,)
    completions = tiny.completions(ro)
    first = torch.tensor([c[0] for c in completions])
    second = torch.tensor([c[1] for c in completions if len(c) == 2])
    assert len(second) > 3000
    assert chi_square_p(torch.bincount(first, minlength=V), p1) > 1e-3
    assert chi_square_p(torch.bincount(second, minlength=V), mixture) > 1e-3


@pytest.mark.parametrize("static_cache", [False, True], ids=["dynamic-cache", "static-cache"])
def test_engine_and_transformers_generate_draw_the_same_distribution(sharp_path, static_cache):
    """The reference path: transformers' generate (ReferenceHFEngine) and the engine's loop, 3,000 rows x 3 tokens
    each: the token at each position has the same distribution in both (two-sample chi-square, p > 0.001)."""
    engine, tok = _engine(sharp_path, gen_batch_size=3000, static_cache=static_cache)
    reference = references.ReferenceHFEngine(engine.model, tok, gen_batch_size=3000)
    reference.eos_ids = engine.eos_ids
    prompt = common.format_prompt(tok, "Hi")
    ours = tiny.completions(engine.generate([prompt], 3000, 3, 0.8, seed=2, progress=False))
    torch.manual_seed(2)
    theirs = tiny.completions(reference.generate([prompt], 3000, 3, 0.8, progress=False))
    V = engine.model.config.vocab_size
    for t in range(3):
        a = torch.bincount(torch.tensor([c[t] for c in ours if len(c) > t]), minlength=V)
        b = torch.bincount(torch.tensor([c[t] for c in theirs if len(c) > t]), minlength=V)
        assert two_sample_p(a, b) > 1e-3, t


PROMPTS = ["What is 1 + 2?", "Hi", "Say seven now", "Count"]


@pytest.mark.parametrize("static_cache", [False, True], ids=["dynamic-cache", "static-cache"])
def test_ended_rows_draw_nothing(tiny_path, static_cache):
    """Without a seed the engine draws from torch's global generator: exactly one uniform per running row per step
    (the rows still running at step t: those whose completion is longer than t), so the next draw after the call
    is the one after sum(completion lengths) such draws. A sampler that drew for ended rows too fails this."""
    engine, tok = _engine(tiny_path, static_cache=static_cache)
    prompts = [common.format_prompt(tok, q) for q in PROMPTS]
    torch.manual_seed(11)
    ro = engine.generate(prompts, 8, 40, 1.0, progress=False)
    after = torch.rand(4)
    lengths = ro.completion_lengths
    assert lengths.min() < lengths.max() == 40  # rows ended early and rows ran to the maximum
    torch.manual_seed(11)
    for t in range(int(lengths.max())):
        torch.rand(int((lengths > t).sum()))  # the engine's draws at step t
    assert torch.equal(after, torch.rand(4))


@pytest.mark.parametrize("static_cache", [False, True], ids=["dynamic-cache", "static-cache"])
def test_a_seed_draws_the_same_tokens_however_the_groups_are_chunked_or_split(tiny_path, static_cache):
    """generate(seed=s): twice the same tokens; another seed other tokens; one group per chunk the same tokens as
    all in one chunk; a subset of the prompts passed with their group ids (a torchrun rank's share) the same
    tokens as those groups in the one-process call. The log-probs too."""
    engine, tok = _engine(tiny_path, return_logps=True, static_cache=static_cache)
    prompts = [common.format_prompt(tok, q) for q in PROMPTS]
    full = engine.generate(prompts, 3, 12, 0.9, seed=7, progress=False)
    assert tiny.completions(full) == tiny.completions(engine.generate(prompts, 3, 12, 0.9, seed=7, progress=False))
    assert tiny.completions(full) != tiny.completions(engine.generate(prompts, 3, 12, 0.9, seed=8, progress=False))
    engine.gen_batch_size = 3  # one group per chunk
    assert tiny.completions(full) == tiny.completions(engine.generate(prompts, 3, 12, 0.9, seed=7, progress=False))
    engine.gen_batch_size = 64
    share = engine.generate([prompts[2], prompts[0]], 3, 12, 0.9, seed=7, group_ids=[2, 0], progress=False)
    want = [full.completion(r) for r in [6, 7, 8, 0, 1, 2]]
    assert tiny.completions(share) == want
    got_logps, want_logps = tiny.engine_logps(share), [full.engine_logp(r) for r in [6, 7, 8, 0, 1, 2]]
    assert all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5) for a, b in zip(got_logps, want_logps))


def test_the_static_cache_draws_the_tokens_of_the_dynamic_one(tiny_path):
    """The static KV cache (its decode step a CUDA graph per bucket of running rows, eager here) against the dynamic
    one, fp32 on the CPU: the same seed gives the same tokens and log-probs within float rounding, while rows end at
    different steps and the running ones move to smaller buckets (32 rows: 32, 16, 8, 4, 2, 1)."""
    for attention in ("sdpa", "eager"):
        dynamic, tok = _engine(tiny_path, return_logps=True)
        dynamic.model.config._attn_implementation = attention
        static = engines.StaticHFEngine(dynamic.model, tok, return_logps=True)
        dynamic.eos_ids = static.eos_ids = static.eos_ids | set(range(20, 32))  # rows end early, at varied steps
        prompts = [common.format_prompt(tok, q) for q in PROMPTS]
        a = dynamic.generate(prompts, 8, 40, 1.0, seed=3, progress=False)
        b = static.generate(prompts, 8, 40, 1.0, seed=3, progress=False)
        lengths = a.completion_lengths
        assert lengths.min() <= 2 and (lengths <= 4).sum() >= 16 and lengths.max() >= 16  # buckets 32, 16, 8, 4, 2, 1
        assert tiny.completions(a) == tiny.completions(b), attention
        for r in range(len(a)):
            assert torch.allclose(torch.tensor(a.engine_logp(r)), torch.tensor(b.engine_logp(r)), atol=1e-5)


def test_without_a_seed_the_global_generator_decides(tiny_path):
    engine, tok = _engine(tiny_path)
    prompts = [common.format_prompt(tok, q) for q in PROMPTS]
    runs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        runs.append(tiny.completions(engine.generate(prompts, 2, 10, 1.0, progress=False)))
    assert runs[0] == runs[1] != runs[2]


# ----- --engine-dtype bf16


def engine_args(engine_dtype: str) -> run.Args:
    return run.Args(engine="hf", seed=0, gen_batch_size=64, gpu_memory_utilization=0.3, engine_dtype=engine_dtype)


def test_bf16_engine_copy_is_refreshed_at_wake_and_the_trainer_is_untouched(tiny_path):
    """make_engine(engine_dtype="bf16"): generation runs on a bf16 copy (buffers kept fp32), log-probs returned;
    after the trainer's weights change, the copy keeps the old ones until wake(model) copies the new ones (rounded
    to bf16); the trainer's weights stay fp32, unshared and unchanged by the copy."""
    tok = models.load_tokenizer(tiny_path)
    model = models.load_model(tiny_path, torch.device("cpu"))
    engine = models.make_engine(engine_args("bf16"), model, tok, "unused", 256)
    assert engine.return_logps and engine.sampler is not model
    assert {p.dtype for p in engine.sampler.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {b.dtype for b in engine.sampler.buffers()} == {b.dtype for b in model.buffers()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    trained = [p.detach().clone() for p in model.parameters()]
    stale = [p.detach().clone() for p in engine.sampler.parameters()]
    assert not all(torch.equal(a, b.to(torch.bfloat16)) for a, b in zip(stale, trained))
    ro = engine.generate([common.format_prompt(tok, "Hi")], 2, 4, 1.0, seed=0, progress=False)
    assert all(len(lp) == len(c) for lp, c in zip(tiny.engine_logps(ro), tiny.completions(ro)))
    assert all(torch.equal(a, b) for a, b in zip(stale, engine.sampler.parameters()))  # no wake: no refresh
    engine.wake(model)
    assert all(torch.equal(c, t.to(torch.bfloat16)) for c, t in zip(engine.sampler.parameters(), trained))
    assert all(p.dtype == torch.float32 and torch.equal(p, t) for p, t in zip(model.parameters(), trained))
    assert all(c.data_ptr() != p.data_ptr() for c, p in zip(engine.sampler.parameters(), model.parameters()))


def test_bf16_engine_log_probs_measure_its_own_rounding(tiny_path):
    """The bf16 engine's log-probs of what it drew against the fp32 trainer's: close but not equal (the mismatch
    the run's mismatch/ metrics report); the fp32 engine's are equal to 1e-4."""
    tok = models.load_tokenizer(tiny_path)
    model = models.load_model(tiny_path, torch.device("cpu"))
    prompts = [common.format_prompt(tok, q) for q in PROMPTS]
    diffs = {}
    for dtype in ("auto", "bf16"):
        engine = models.make_engine(engine_args(dtype), model, tok, "unused", 256, engine_logps=True)
        ro = engine.generate(prompts, 4, 8, 1.0, seed=1, progress=False)
        trainer = common.no_grad_logps(model, ro, range(len(ro)), tok.pad_token_id, 1.0, token_budget=512)
        diffs[dtype] = max(
            (trainer[r, : len(lp)] - torch.tensor(lp)).abs().max().item() for r, lp in enumerate(tiny.engine_logps(ro))
        )
    assert diffs["auto"] < 1e-4
    assert 1e-4 < diffs["bf16"] < 0.5


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--engine", "vllm", "--engine-dtype", "bf16"], "--engine-dtype bf16 is the hf engine's"),
        (["--engine-dtype", "fp8"], "invalid choice: 'fp8'"),
    ],
)
def test_bf16_engine_refusals(flags, needle, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("sys.argv", ["grpo.py", "--output-dir", str(tmp_path), *flags])
    with pytest.raises(SystemExit) as exc:
        run.command_line(grpo.main, grpo.Args)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exc.value.code == 2 and len(err) == 1 and needle in err[0]


def test_bf16_engine_refused_under_torchrun(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("sys.argv", ["grpo.py", "--output-dir", str(tmp_path), "--engine-dtype", "bf16"])
    with pytest.raises(SystemExit) as exc:
        run.command_line(grpo.main, grpo.Args)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exc.value.code == 2 and len(err) == 1 and "runs in one process only" in err[0]


def _one_token_gqa_inputs():
    """One query token, 6 query heads over 2 key/value heads, 40 keys, a boolean mask: (module, q, k, v, mask)."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    q, k, v = torch.randn(5, 6, 1, 16), torch.randn(5, 2, 40, 16), torch.randn(5, 2, 40, 16)
    mask = torch.rand(5, 1, 1, 40) < 0.7
    mask[..., 0] = True
    return module, q, k, v, mask


def test_grouped_query_attention_of_one_token_equals_transformers_sdpa():
    """_gqa_sdpa (StaticHFEngine's attention on its copy): one query token, 6 query heads over 2 key/value heads,
    a boolean mask: the same output as transformers' SDPA, which repeats the keys and values per query head."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module, q, k, v, mask = _one_token_gqa_inputs()
    ours, _ = engines._gqa_sdpa(module, q, k, v, mask, scaling=0.25)
    theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert ours.shape == theirs.shape == (5, 1, 6, 16) and torch.allclose(ours, theirs, atol=1e-6)


def test_static_engine_on_a_bf16_copy_of_a_grouped_query_model(tmp_path):
    """What make_engine builds on a GPU: StaticHFEngine on a bf16 copy, _gqa_sdpa in the copy only (the trainer's
    model keeps transformers' SDPA), here eager on the CPU: the tokens of HFEngine's bf16 copy for the same seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny.make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "gqa")
    tok.save_pretrained(tmp_path / "gqa")
    model = models.load_model(str(tmp_path / "gqa"), torch.device("cpu"))
    static = engines.StaticHFEngine(model, tok, return_logps=True, dtype=torch.bfloat16)
    dynamic = engines.HFEngine(model, tok, return_logps=True, dtype=torch.bfloat16)
    assert static.sampler.config._attn_implementation == engines.GQA_SDPA
    assert model.config._attn_implementation == dynamic.sampler.config._attn_implementation == "sdpa"
    prompts = [common.format_prompt(tok, q) for q in PROMPTS]
    a = dynamic.generate(prompts, 4, 16, 1.0, seed=9, progress=False)
    b = static.generate(prompts, 4, 16, 1.0, seed=9, progress=False)
    assert tiny.completions(a) == tiny.completions(b)
    assert all(
        torch.allclose(torch.tensor(x), torch.tensor(y), atol=2e-2) for x, y in zip(tiny.engine_logps(a), tiny.engine_logps(b))
    )


SYNCING_OPS = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "item"}


def test_the_captured_decode_step_never_waits_for_the_device(tiny_path, monkeypatch):
    """What StaticHFEngine captures as a CUDA graph (its decode step) must not read a value back to the host: a
    capture fails at the first such op. Every op of every decode call, run eagerly here, is recorded by a dispatch
    mode; none of those that synchronise (.item(), nonzero, a boolean mask index, ...) may appear, and the calls
    must run (the loop reached its graphs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    seen, calls = set(), []

    class RecordedGraphs(engines._DecodeGraphs):
        def __call__(self, b, length):
            with Record() as mode:
                out = self.decode(b, length)
            seen.update(mode.ops)
            calls.append(b)
            return out

    monkeypatch.setattr(engines, "_DecodeGraphs", RecordedGraphs)
    engine, tok = _engine(tiny_path, static_cache=True)
    engine.eos_ids = engine.eos_ids | set(range(20, 32))  # rows end: smaller buckets are called too
    engine.generate([common.format_prompt(tok, q) for q in PROMPTS], 4, 12, 1.0, seed=1, progress=False)
    assert (
        len(calls) > 1 and len(set(calls)) > 1 and {"embedding", "index_copy_"} <= seen
    )  # the model ran, the cache was written
    assert not SYNCING_OPS & seen, sorted(SYNCING_OPS & seen)


# ----- --dtype fp16 (issue 50)


def test_static_engine_sizes_its_cache_from_its_copy_not_the_trainers_autocast(tiny_path):
    """A trainer under --dtype fp16 (autocast_dtype fp16) with a bf16 copy: the static loop's KV cache and masks take
    the copy's dtype (autocast is off there), so SDPA gets query, keys and values of one dtype; the same tokens as
    HFEngine's bf16 copy. Before issue 50 the cache was fp16 and SDPA raised "Expected query, key, and value to have
    the same dtype"."""
    tok = models.load_tokenizer(tiny_path)
    model = models.load_model(tiny_path, torch.device("cpu"))
    model.rlvr_traits = common.ModelTraits(autocast_dtype=torch.float16)  # what load_model sets on CUDA for fp16
    prompts = [common.format_prompt(tok, q) for q in PROMPTS]
    for attention in ("sdpa", "eager"):
        model.config._attn_implementation = attention
        static = engines.StaticHFEngine(model, tok, return_logps=True, dtype=torch.bfloat16)
        out = static.generate(prompts, 2, 6, 1.0, seed=4, progress=False)
        assert len(out) == 2 * len(prompts) and all(len(c) >= 1 for c in tiny.completions(out)), attention
    model.config._attn_implementation = "sdpa"


@pytest.mark.parametrize(
    "engine_dtype,dtype,on_gpu,want",
    [
        ("auto", "fp16", True, torch.float16),  # the copy rounds as the trainer's fp16 autocast does
        ("auto", "bf16", True, torch.bfloat16),
        ("auto", "fp16", False, None),  # elsewhere: the trainer's own weights
        ("bf16", "fp16", True, torch.bfloat16),  # asked for by name
        ("trainer", "bf16", True, None),
    ],
)
def test_the_engine_copy_takes_the_compute_dtype_under_auto(engine_dtype, dtype, on_gpu, want):
    args = run.Args(engine="hf", engine_dtype=engine_dtype, dtype=dtype)
    assert models.engine_copy_dtype(args, on_gpu) == want


def test_grouped_query_attention_takes_any_memory_layout_sdpa_returns(monkeypatch):
    """SDPA's memory-efficient kernel (chosen on A100, L40S, A10G, or with TORCH_CUDNN_SDPA_DEPRIORITIZED=1) returns
    its output (b, Hkv, g, d) in a transposed memory layout, which a .view cannot merge into (b, H, 1, d) ("view
    size is not compatible"): _gqa_sdpa reshapes it and gives the same output."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module, q, k, v, mask = _one_token_gqa_inputs()
    theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def transposed_layout(*args, **kwargs):  # the same values, laid out as the mem-efficient kernel lays them out
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", transposed_layout)
    ours, _ = engines._gqa_sdpa(module, q, k, v, mask, scaling=0.25)
    assert ours.shape == theirs.shape == (5, 1, 6, 16) and torch.allclose(ours, theirs, atol=1e-6)


def test_the_samplers_resolution_is_that_of_float32_uniforms():
    """The engines draw u from torch.rand (float32: multiples of 2^-24 in [0, 1)), so sample_from_logits resolves a
    token's probability to 2^-24, not to the float64 cumulative sum's 1e-16: a last token of probability 1e-9 is
    never drawn (no float32 u reaches past 1 - 1e-9), one of probability 2^-23 is drawn by the largest u."""
    assert torch.rand(3).dtype == torch.float32 and torch.rand(3, generator=torch.Generator()).dtype == torch.float32
    largest = torch.tensor([1.0 - 2**-24])  # the largest float32 below 1
    assert largest.item() == float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))
    for p_last, drawn in ((1e-9, 0), (2**-23, 1)):
        logits = torch.tensor([[0.0, torch.tensor(p_last / (1 - p_last)).log().item()]], dtype=torch.float64)
        assert engines.sample_from_logits(logits.float(), largest).item() == drawn, p_last
    assert "2^-24" in engines.sample_from_logits.__doc__


# ----- the static loop's costs (issue 50): keys read, graphs kept, a capture that fails


def test_the_decode_step_reads_a_length_bucket_of_the_filled_keys():
    """_length_bucket: the next power of two of the filled keys (at least 64), at most the cache; the cache a
    multiple of 256 keys, so chunks whose prompts differ a little share it."""
    assert [engines._length_bucket(f, 4352) for f in (1, 64, 65, 300, 513, 4097, 4352)] == [64, 64, 128, 512, 1024, 4352, 4352]
    assert [engines._cache_length(k) for k in (1, 256, 257, 4100)] == [256, 256, 512, 4352]


def test_length_buckets_and_kept_graphs_draw_the_same_tokens(tiny_path, monkeypatch):
    """fp32 on the CPU: the static loop reading length buckets gives the tokens and log-probs of the loop reading
    the whole cache and of the dynamic loop; chunks of one shape share one cache (allocated once, its stale keys
    never seen by the next chunk), a chunk of another shape gets a new one, sleep() gives it back."""
    allocations, buckets = [], set()
    allocate, bucket = engines.StaticKV.allocate, engines._length_bucket
    monkeypatch.setattr(engines, "_length_bucket", lambda f, n: buckets.add(bucket(f, n)) or bucket(f, n))
    monkeypatch.setattr(engines.StaticKV, "allocate", lambda *a, **k: allocations.append(a[2:4]) or allocate(*a, **k))
    dynamic, tok = _engine(tiny_path, return_logps=True, gen_batch_size=8)
    static = engines.StaticHFEngine(dynamic.model, tok, gen_batch_size=8, return_logps=True)
    dynamic.eos_ids = static.eos_ids = static.eos_ids | set(range(20, 23))  # rows end at varied steps
    prompts = [common.format_prompt(tok, q) for q in PROMPTS]  # 4 prompts x 4 rows: two chunks of 8 rows
    a = dynamic.generate(prompts, 4, 100, 1.0, seed=5, progress=False)
    b = static.generate(prompts, 4, 100, 1.0, seed=5, progress=False)
    assert len(allocations) == 1 and static.decode_state is not None  # both chunks on one cache, kept after
    static.length_buckets = False  # every step reads the whole cache
    c = static.generate(prompts, 4, 100, 1.0, seed=5, progress=False)
    assert tiny.completions(a) == tiny.completions(b) == tiny.completions(c)
    assert buckets == {64, 128}  # rows ran past the first bucket's 64 keys (prompts of 21 to 33 tokens)
    for r in range(len(a)):
        for other in (b, c):
            assert torch.allclose(torch.tensor(a.engine_logp(r)), torch.tensor(other.engine_logp(r)), atol=1e-5)
    static.generate(prompts[:1], 4, 100, 1.0, seed=5, progress=False)  # 4 rows: another shape, another cache
    assert len(allocations) == 2
    static.sleep()
    assert static.decode_state is None


def test_a_graph_capture_that_fails_stops_with_its_cause_and_the_flag_without_graphs():
    """_DecodeGraphs on a device where capturing fails (here: no CUDA at all) raises one RunError line naming the
    cause and --hf-decode static-eager; nothing falls back to eager by itself."""
    from verifiers import RunError

    graphs = engines._DecodeGraphs(lambda b, length: torch.zeros(b, 3), torch.device("cpu"))
    graphs.cuda = True  # as on a GPU: the capture is attempted
    with pytest.raises(RunError) as error:
        graphs(2, 64)
    message = str(error.value)
    assert "could not capture its decode step as a CUDA graph" in message and "--hf-decode static-eager" in message
    assert "\n" not in message and not graphs.graphs
