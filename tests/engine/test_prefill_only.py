"""max_tokens=0 (a request that only computes its prompt: what lm-eval's echo + logprobs with
max_tokens 0 runs), the prompt tokens' ranks, and num_cached_tokens (the prefix-cache hit a
request started with, which the server reports as usage.prompt_tokens_details.cached_tokens)."""

from __future__ import annotations

import pytest
import torch

from hyla.engine import LLM, SamplingParams
from tests.engine.test_prompt_logprobs import _llm, checkpoint  # noqa: F401 (a fixture)

N_TOP = 2


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(llm: LLM, prompt: list[int]) -> tuple[list[dict[int, float] | None], list[int | None]]:
    """From one full forward: None, then {prompt[i]: lp, top-N...}; and each token's rank (how
    many tokens are at least as likely, itself included)."""
    with torch.no_grad():
        lp = torch.log_softmax(llm.engine.model(torch.tensor([prompt]))[0].double(), dim=-1)
    scores: list[dict[int, float] | None] = [None]
    ranks: list[int | None] = [None]
    for i in range(1, len(prompt)):
        top = torch.topk(lp[i - 1], N_TOP)
        scores.append({prompt[i]: lp[i - 1, prompt[i]].item(),
                       **{int(t): v.item() for t, v in zip(top.indices, top.values)}})
        ranks.append(int((lp[i - 1] >= lp[i - 1, prompt[i]]).sum()))
    return scores, ranks


def _assert_scores(out, prompt, llm):
    want, want_ranks = _reference(llm, prompt)
    got = out.prompt_logprobs
    assert len(got) == len(want) and got[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert g.keys() == w.keys()
        assert all(abs(g[t] - w[t]) <= 1e-5 for t in g)  # fp32 log-softmax against fp64 (test_prompt_logprobs)
    assert out.prompt_token_ranks == want_ranks


def _all_free(llm: LLM) -> bool:
    m = llm.get_metrics()
    return m["kv_pages_free"] == m["kv_pages_total"] and m["state_slots_free"] == m["state_slots_total"]


@pytest.mark.parametrize("chunk", [None, 5])
def test_max_tokens_zero_scores_the_prompt_and_samples_nothing(checkpoint, chunk):
    llm = _llm(checkpoint, **({} if chunk is None else {"max_num_batched_tokens": chunk}))
    prompts = [_prompt(1, 23), _prompt(2, 7), [9]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=N_TOP))
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        assert out.finished and (c.token_ids, c.text, c.finish_reason) == ([], "", "length")
        _assert_scores(out, prompt, llm)
    assert _all_free(llm)  # every slot and page given back
    m = llm.get_metrics()
    assert m["num_requests_finished"] == 3 and m["generation_tokens"] == 0
    assert m["prompt_tokens"] == sum(map(len, prompts))


def test_prefill_only_requests_batch_with_generating_ones(checkpoint):
    llm = _llm(checkpoint, max_num_batched_tokens=8)
    prompts = [_prompt(3, 19), _prompt(4, 11)]
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    alone = llm.generate(prompts, greedy)
    mixed = llm.generate(prompts + [_prompt(5, 17)], [greedy, greedy, SamplingParams(max_tokens=0)])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    assert mixed[2].outputs[0].token_ids == [] and mixed[2].prompt_logprobs is None
    assert _all_free(llm)


def test_num_cached_tokens_is_the_hit_a_request_started_with(checkpoint):
    llm = _llm(checkpoint, enable_prefix_caching=True)
    prompt = _prompt(6, 40)
    first = llm.generate([prompt], SamplingParams(max_tokens=0))[0]  # computes the prompt, files it
    assert first.num_cached_tokens == 0
    again = llm.generate([prompt + [7, 8]], SamplingParams(temperature=0.0, max_tokens=2))[0]
    hit = llm.get_metrics()["prefix_cache_hit_tokens"]
    assert 0 < again.num_cached_tokens == hit <= len(prompt)
    # a request scoring its prompt takes no hit (every position needs its logits): it reports none
    scored = llm.generate([prompt + [7, 8]], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert scored.num_cached_tokens == 0
    plain = _llm(checkpoint)  # no prefix cache: never a hit
    assert plain.generate([prompt], SamplingParams(max_tokens=1))[0].num_cached_tokens == 0


@pytest.mark.parametrize("kwargs,match", [
    ({"max_tokens": -1}, "max_tokens must be an integer >= 0"),
    ({"max_tokens": 0, "min_tokens": 1}, "min_tokens"),
])
def test_bad_max_tokens_is_a_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
