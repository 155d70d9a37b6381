"""The engine against single-request greedy decoding and transformers, under batching pressure."""

import pytest
import torch

from hyla import LLM, SamplingParams
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint, load_reference

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_kimi_checkpoint(tmp_path_factory.mktemp("engine"), "moe", with_tokenizer=True)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(1234)
    lengths = [1, 2, 400, 15, 16, 17, 63, 64, 65, 100, 3, 250, 31, 32, 33, 7, 128, 129, 5, 300, 48, 9, 200, 80]
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def alone(ckpt, prompts):
    """Each prompt run by itself (fp64, so that batching can only differ by rounding far below
    any argmax margin)."""
    llm = LLM(str(ckpt), dtype="float64", max_num_seqs=1)
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_alone_equals_full_forward_greedy(ckpt, prompts, alone):
    from hyla.models import load_model

    model = load_model(ckpt, dtype=torch.float64)
    for p, got in list(zip(prompts, alone))[:6]:
        ids = list(p)
        with torch.no_grad():
            for _ in range(GREEDY.max_tokens):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        assert got == ids[len(p):]


@pytest.mark.parametrize("kw", [
    dict(),
    dict(max_num_seqs=3),
    dict(max_num_batched_tokens=24),
    dict(max_num_seqs=5, max_model_len=448, memory_budget=5 * 25_600 + 36 * 16 * 1024),
], ids=["default", "max_num_seqs=3", "chunked_prefill", "preemption"])
def test_batched_greedy_equals_alone(ckpt, prompts, alone, kw):
    llm = LLM(str(ckpt), dtype="float64", **kw)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    m = llm.get_metrics()
    assert m["num_requests_finished"] == len(prompts)
    assert m["prompt_tokens"] == sum(map(len, prompts))
    assert m["generation_tokens"] >= len(prompts) * GREEDY.max_tokens
    if "memory_budget" in kw:
        assert m["num_preemptions"] > 0
    assert m["kv_pages_free"] == m["kv_pages_total"] and m["state_slots_free"] == m["state_slots_total"]


def _transformers_greedy(ref, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from transformers' full forward, re-run over the whole sequence per token.
    Not `generate`: on this checkpoint (16 experts, grouped routing) transformers' cached decode
    path disagrees with its own full forward (prompt 7, token 24: a logit margin of 0.012, far
    above rounding), while the full forward is the definition of the model."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_equals_transformers_greedy(ckpt, prompts):
    ref = load_reference(ckpt)
    llm = LLM(str(ckpt), dtype="float32")
    chosen = [prompts[i] for i in (0, 3, 7, 11, 19)]
    outs = llm.generate(chosen, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for p, o in zip(chosen, outs):
        assert o.outputs[0].token_ids == _transformers_greedy(ref, p, 32)


def test_seed_reproducible_and_independent_of_batch(ckpt, prompts):
    llm = LLM(str(ckpt), dtype="float64")
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    a = llm.generate([prompts[3]], sp)[0].outputs[0].token_ids
    b = llm.generate([prompts[5], prompts[3], prompts[9]], [SamplingParams(temperature=1.0, max_tokens=16), sp,
                                                             SamplingParams(temperature=0.5, max_tokens=5)])
    assert b[1].outputs[0].token_ids == a
    c = llm.generate([prompts[3]], SamplingParams(temperature=0.9, top_p=0.9, seed=8, max_tokens=16, ignore_eos=True))
    assert c[0].outputs[0].token_ids != a  # another seed samples another continuation


def test_top_k_one_equals_greedy(ckpt, prompts, alone):
    llm = LLM(str(ckpt), dtype="float64")
    outs = llm.generate(prompts[:6], SamplingParams(temperature=1.3, top_k=1, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == alone[:6]


def test_logprobs_are_log_softmax_of_emitted_tokens(ckpt, prompts):
    from hyla.models import load_model

    model = load_model(ckpt, dtype=torch.float64)
    llm = LLM(str(ckpt), dtype="float64")
    p = prompts[4]
    out = llm.generate([p], SamplingParams(temperature=0.8, seed=3, max_tokens=8, logprobs=3, ignore_eos=True))[0]
    toks, lps = out.outputs[0].token_ids, out.outputs[0].logprobs
    assert len(lps) == len(toks)
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([p + toks]))[0].double(), -1)
    for i, (t, lp) in enumerate(zip(toks, lps)):
        row = full[len(p) - 1 + i]
        assert lp[t] == pytest.approx(row[t].item(), abs=1e-5)  # logits are returned in fp32
        top = torch.topk(row, 3).indices.tolist()
        assert set(top) <= set(lp) and len(lp) <= 4


def test_stop_strings_cut_exactly(ckpt):
    llm = LLM(str(ckpt), dtype="float64")
    prompt = "the cat sat on the mat and"
    full = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))[0].outputs[0]
    words = full.text.split()
    assert len(words) >= 3
    stop = " " + words[2]
    cut = full.text[: full.text.find(stop)]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, stop=[stop]))[0]
    assert out.outputs[0].text == cut
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_stop_token_ids_and_eos(ckpt, prompts, alone):
    llm = LLM(str(ckpt), dtype="float64")
    target = alone[2][5]
    out = llm.generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[target]))[0]
    first = alone[2].index(target)
    assert out.outputs[0].token_ids == alone[2][: first + 1] and out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("prompt,params,match", [
    ([5] * 600, SamplingParams(max_tokens=4), "max_model_len"),
    ([5, 300, 7], SamplingParams(max_tokens=4), "token id 300"),
    ([5, -1], SamplingParams(max_tokens=4), "token id -1"),
    ([5, 6], SamplingParams(max_tokens=511), "max_model_len"),
    ([], SamplingParams(max_tokens=4), "empty"),
])
def test_bad_requests_rejected_before_any_work(ckpt, prompts, prompt, params, match):
    llm = LLM(str(ckpt), dtype="float64", max_model_len=512)
    with pytest.raises(ValueError, match=match):
        llm.generate([prompts[0], prompt], params)
    m = llm.get_metrics()
    assert m["num_steps"] == 0 and m["num_requests_waiting"] == 0


def test_max_tokens_below_zero_is_a_value_error():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)  # 0 is a prefill-only request (tests/engine/test_prefill_only.py)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_incremental_engine_streams_and_aborts(ckpt, prompts, alone):
    llm = LLM(str(ckpt), dtype="float64")
    engine = llm.engine
    engine.add_request("a", prompts[0], GREEDY)
    engine.add_request("b", prompts[2], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    seen = []
    for _ in range(4):
        seen += [o for o in engine.step() if o.request_id == "a"]
    assert [len(o.outputs[0].token_ids) for o in seen] == [1, 2, 3, 4]  # one new token per step
    assert engine.abort_request("b")
    assert not engine.abort_request("b")
    while engine.has_unfinished_requests():
        seen += [o for o in engine.step() if o.request_id == "a"]
    assert seen[-1].finished and seen[-1].outputs[0].token_ids == alone[0]
    m = engine.get_metrics()
    assert m["kv_pages_free"] == m["kv_pages_total"] and m["state_slots_free"] == m["state_slots_total"]
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("c", [1], GREEDY)
        engine.add_request("c", [1], GREEDY)


def test_one_failing_request_is_finished_with_an_error_and_the_others_continue(ckpt, prompts, alone):
    """A forward that fails whenever it sees token 13 (a stand-in for any per-request fault):
    only the request carrying it ends with finish_reason "error"; the rest are exact."""
    llm = LLM(str(ckpt), dtype="float64")
    model = llm.engine.model
    real = model.forward_batch

    def flaky(input_ids, batch, cache):
        if bool((input_ids == 13).any()):
            raise RuntimeError("poisoned token")
        return real(input_ids, batch, cache)

    model.forward_batch = flaky
    good = [p for p in prompts[:8] if 13 not in p]
    bad = good[1][:5] + [13] + good[1][5:]
    outs = llm.generate(good[:3] + [bad] + good[3:], GREEDY, use_tqdm=False)
    failed = outs[3].outputs[0]
    assert failed.finish_reason == "error" and "poisoned token" in outs[3].error
    want = [alone[prompts.index(p)] for p in good]
    assert [o.outputs[0].token_ids for o in outs[:3] + outs[4:]] == want
    m = llm.get_metrics()
    assert m["num_requests_failed"] == 1
    assert m["kv_pages_free"] == m["kv_pages_total"] and m["state_slots_free"] == m["state_slots_total"]
