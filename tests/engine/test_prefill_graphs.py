"""`prefill_graph_max_tokens` through the engine (Kimi-Linear; Qwen3-Next's gated attention too) (hyla.engine.prefill_graphs): prefill steps of up
to N tokens run their spans over padded static buffers (CUDA graphs on a GPU; the same buffers
without graphs here). In fp64, where padding and bucketing move nothing but the last bits, greedy
tokens equal the eager engine's: plain, chunked prompts, the prefix cache (checkpoints written
inside the cores), preemption (recomputed prefills) and n-gram speculation (verify steps go
around the spans)."""

from __future__ import annotations

import pytest
import torch

from hyla import LLM, SamplingParams
from hyla.bench.random_models import random_checkpoint
from hyla.engine import EngineConfig

KW = dict(dtype="float64", device="cpu", max_model_len=160, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return str(random_checkpoint(tmp_path_factory.mktemp("pg"), "tiny"))


def _prompts(lens, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 200, (n,), generator=g).tolist() for n in lens]


def _tokens(llm, prompts, n=10):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3-next-moe"])
def test_greedy_tokens_equal_the_eager_engine(kimi, tmp_path_factory, name):
    path = kimi if name == "tiny" else str(random_checkpoint(tmp_path_factory.mktemp("pgq"), name))
    prompts = _prompts((37, 9, 100, 1))  # 100: two chunks of 64 and 36
    want = _tokens(LLM(path, **KW), prompts)
    llm = LLM(path, prefill_graph_max_tokens=64, **KW)
    assert llm.engine.runner.prefill_graphs.buckets == [16, 24, 32, 48, 64]
    assert _tokens(llm, prompts) == want
    # up to 24 tokens: the 64-token chunks run eagerly, the shorter steps through the spans
    assert _tokens(LLM(path, prefill_graph_max_tokens=24, **KW), prompts) == want


def test_prefix_cache_and_speculation(kimi):
    shared = _prompts((40,), seed=9)[0]
    prompts = [shared + p for p in _prompts((13, 30, 3), seed=11)]
    want = _tokens(LLM(kimi, **KW), prompts)
    cached = LLM(kimi, prefill_graph_max_tokens=48, enable_prefix_caching=True, **KW)
    assert _tokens(cached, prompts[:1]) == want[:1]
    assert _tokens(cached, prompts[1:]) == want[1:]  # hits on the shared prefix, resumed in the cores
    assert cached.get_metrics()["prefix_cache_hit_tokens"] > 0
    spec = LLM(kimi, prefill_graph_max_tokens=64, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
               **KW)
    assert _tokens(spec, prompts) == want


def test_preemption(kimi):
    """Three prompts whose 8 pages each fit the 26 pages, then outgrow them while decoding."""
    prompts = _prompts((120, 118, 116), seed=7)
    want = _tokens(LLM(kimi, **KW), prompts, n=24)
    plain = LLM(kimi, **KW)
    slot, page = plain.engine.model.state_bytes_per_slot(), plain.engine.kv_bytes_per_page
    llm = LLM(kimi, prefill_graph_max_tokens=64, max_num_seqs=3, memory_budget=2 * 3 * slot + 4 * page, **KW)
    assert llm.engine.pools.pages.num_pages == 26
    assert _tokens(llm, prompts, n=24) == want
    assert llm.get_metrics()["num_preemptions"] > 0


def test_default_is_off_on_the_cpu(kimi):
    """The default (None) turns them on only where decode runs in CUDA graphs."""
    assert EngineConfig(model=kimi).prefill_graph_max_tokens is None
    assert LLM(kimi, **KW).engine.runner.prefill_graphs is None
    assert LLM(kimi, prefill_graph_max_tokens=0, **KW).engine.runner.prefill_graphs is None


def test_refusals(kimi, tmp_path_factory):
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(model=kimi, prefill_graph_max_tokens=64, enforce_eager=True)
    with pytest.raises(ValueError, match="prefill_graph_max_tokens must be"):
        EngineConfig(model=kimi, prefill_graph_max_tokens=-1)
    glm = str(random_checkpoint(tmp_path_factory.mktemp("pgg"), "tiny-glm5-next"))
    with pytest.raises(ValueError, match="does not run its prefill steps in spans"):
        LLM(glm, prefill_graph_max_tokens=64, **KW)
