"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs): every prompt token after the first
scored under the tokens before it, equal to a full forward's log_softmax, with chunked prefill
at every chunk boundary, with the prefix cache on (such a request computes what a hit would
skip), under preemption, and batched with requests that do not ask."""

from __future__ import annotations

import pytest
import torch

from hyla.engine import LLM, SamplingParams
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint

N_TOP = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_kimi_checkpoint(tmp_path_factory.mktemp("prompt_lp"), "moe")


def _llm(path, **kwargs) -> LLM:
    kwargs.setdefault("memory_budget", 1 << 22)
    return LLM(str(path), dtype=torch.float64, device="cpu", max_num_seqs=4, max_model_len=96, **kwargs)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return _llm(checkpoint)


def _reference(llm: LLM, prompt: list[int]) -> list[dict[int, float] | None]:
    """None, then {prompt[i]: lp, top-N...} from one full forward over the whole prompt."""
    model = llm.engine.model
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt]))[0].double(), dim=-1)
    out: list[dict[int, float] | None] = [None]
    for i in range(1, len(prompt)):
        top = torch.topk(lp[i - 1], N_TOP)
        out.append({prompt[i]: lp[i - 1, prompt[i]].item(),
                    **{int(t): v.item() for t, v in zip(top.indices, top.values)}})
    return out


def _assert_equal(got, want):
    """The engine's logits are fp32 (compute_logits) and so is its log-softmax, as for sampled
    logprobs; the reference takes the same fp32 logits to fp64. |logprob| < 20 here, so fp32
    rounding of the log-softmax stays below 20 * 2^-23 * a few ops: 1e-5 absolute."""
    assert len(got) == len(want) and got[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert g.keys() == w.keys()
        for t in g:
            assert abs(g[t] - w[t]) <= 1e-5, (t, g[t], w[t])


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prompt_logprobs_equal_a_full_forward(llm):
    prompts = [_prompt(1, 23), _prompt(2, 5), [7, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=N_TOP)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        _assert_equal(out.prompt_logprobs, _reference(llm, prompt))
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]  # sampling unchanged
    assert all(o.prompt_logprobs is None for o in plain)


@pytest.mark.parametrize("chunk", [1, 2, 7, 16])
def test_chunked_prefill_scores_every_position(checkpoint, chunk):
    llm = _llm(checkpoint, max_num_batched_tokens=chunk + 1)  # + 1: a decode can share the step
    prompt = _prompt(3, 29)
    mixed = [prompt, _prompt(4, 11)]
    outs = llm.generate(mixed, [SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=N_TOP),
                                SamplingParams(temperature=0.0, max_tokens=3)])
    _assert_equal(outs[0].prompt_logprobs, _reference(llm, prompt))
    assert outs[1].prompt_logprobs is None


def test_prefix_cache_hit_is_not_taken_by_a_request_that_scores_its_prompt(checkpoint):
    llm = _llm(checkpoint, enable_prefix_caching=True)
    prompt = _prompt(5, 40)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))  # fills the cache
    hits = llm.get_metrics()["prefix_cache_hit_tokens"]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=N_TOP))[0]
    _assert_equal(out.prompt_logprobs, _reference(llm, prompt))
    assert llm.get_metrics()["prefix_cache_hit_tokens"] == hits
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))
    assert llm.get_metrics()["prefix_cache_hit_tokens"] > hits  # others still hit


def test_preempted_requests_keep_their_prompt_logprobs(checkpoint):
    # 4 state slots (25,600 B each) and 8 KV pages (16,384 B): three requests of 70 tokens (5 pages
    # each) cannot all run to the end, some are preempted and recomputed
    llm = _llm(checkpoint, memory_budget=4 * 25600 + 8 * 16384, max_num_batched_tokens=16)
    prompts = [_prompt(10 + i, 30) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=N_TOP)
    outs = llm.generate(prompts, params)
    assert llm.get_metrics()["num_preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        _assert_equal(out.prompt_logprobs, _reference(llm, prompt))


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True])
def test_bad_prompt_logprobs_is_a_value_error(bad):
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer in 0..20"):
        SamplingParams(prompt_logprobs=bad)
