"""EngineConfig validates and resolves everything in __post_init__, before any weight is read."""

import json

import pytest

from hyla import LLM
from hyla.engine.config import EngineConfig, SpecConfig
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_kimi_checkpoint(tmp_path_factory.mktemp("config"), "dense")


@pytest.fixture
def no_weights(monkeypatch):
    """Any weight load fails the test: the configuration must be rejected first."""
    import hyla.models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the configuration was validated")

    monkeypatch.setattr(hyla.models, "load_model", refuse)


@pytest.mark.parametrize("spec,match", [
    ('{"method": "ngram", "num_speculative_tokens": 4', "not valid JSON"),
    ('{"method": "medusa", "num_speculative_tokens": 4}', "method"),
    ({"method": "ngram", "num_speculative_tokens": 40}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": "2"}, "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent/draft"}, "/nonexistent/draft"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rollbak": "slots"}, "unknown keys"),
])
def test_bad_speculative_config_fails_before_a_model_load(ckpt, no_weights, spec, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(ckpt), speculative_config=spec)


def test_draft_model_with_another_vocabulary_is_rejected_before_loading(ckpt, tmp_path, no_weights):
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((ckpt / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": 512}))
    with pytest.raises(ValueError, match="vocabulary"):
        EngineConfig(model=str(ckpt), speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                                          "model": str(other)})


def test_resolved_fields(ckpt):
    cfg = EngineConfig(model=str(ckpt), speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert isinstance(cfg.speculative_config, SpecConfig) and cfg.speculative_config.num_speculative_tokens == 3
    assert cfg.slots_per_seq == 4  # "slots" rollback: 1 + k
    assert cfg.max_model_len == 8192  # no limit in the checkpoint: the default cap
    assert EngineConfig(model=str(ckpt), max_model_len=300).max_model_len == 300
    # no max_position_embeddings in a Kimi config: 2^20, the released model's context
    assert EngineConfig(model=str(ckpt), max_model_len=1 << 20).max_model_len == 1 << 20
    with pytest.raises(ValueError, match=r"max_model_len=1048577 exceeds the model's max_position_embeddings \(1048576\)"):
        EngineConfig(model=str(ckpt), max_model_len=(1 << 20) + 1)  # refused, not cut to the limit
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(model=str(ckpt), max_num_seqs=0)
    with pytest.raises(ValueError, match="config.json"):
        EngineConfig(model=str(ckpt / "missing"))


def test_text_prompts_are_tokenised_once(tmp_path):
    path = build_kimi_checkpoint(tmp_path, "dense", with_tokenizer=True)
    llm = LLM(str(path), dtype="float64", max_model_len=64)
    calls = []
    real = llm.engine.tokenizer.encode

    def counting(text, *args, **kwargs):
        calls.append(text)
        return real(text, *args, **kwargs)

    llm.engine.tokenizer.encode = counting
    from hyla import SamplingParams

    out = llm.generate("the cat sat", SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert calls == ["the cat sat"] and out.prompt == "the cat sat"
    assert out.prompt_token_ids == real("the cat sat")


def test_backend_is_checked_and_applied_when_the_engine_starts(ckpt, monkeypatch):
    """EngineConfig.backend: one of auto / torch / triton (None: the process's choice, from
    HYLA_BACKEND), set for the whole process (hyla.ops.dispatch) when the engine starts."""
    from hyla.ops import dispatch
    from tests.ops.helpers import use_backend

    with pytest.raises(ValueError, match="backend"):
        EngineConfig(str(ckpt), backend="cuda")
    use_backend(monkeypatch, "auto")
    LLM(str(ckpt), device="cpu")
    assert dispatch.get_backend() == "auto"
    LLM(str(ckpt), device="cpu", backend="torch")
    assert dispatch.get_backend() == "torch"
