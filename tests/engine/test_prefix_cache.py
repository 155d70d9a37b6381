"""Prefix caching must never change a token: every greedy output equals the cache-off output,
and hits are as long as the design promises."""

import pytest

from hyla import LLM, SamplingParams
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint
from tests.oracles.variants import rand_tokens as rand

SP = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_kimi_checkpoint(tmp_path_factory.mktemp("prefix"), "dense", with_tokenizer=True)


@pytest.fixture(scope="module")
def reference(ckpt):
    llm = LLM(str(ckpt), dtype="float64", max_model_len=1200)
    cache = {}

    def run(prompt):
        key = tuple(prompt)
        if key not in cache:
            cache[key] = llm.generate([prompt], SP, use_tqdm=False)[0].outputs[0].token_ids
        return cache[key]

    return run


def hits(llm, prompts, one_by_one=True):
    """Run prompts (one request at a time, or all in one batch); returns outputs and hit lengths."""
    outs, got = [], []
    batches = [[p] for p in prompts] if one_by_one else [prompts]
    for batch in batches:
        before = llm.get_metrics()["prefix_cache_hit_tokens"]
        outs += [o.outputs[0].token_ids for o in llm.generate(batch, SP, use_tqdm=False)]
        got.append(llm.get_metrics()["prefix_cache_hit_tokens"] - before)
    return outs, got


def test_shared_system_prompt_third_request_hits_the_junction(ckpt, reference):
    system = rand(900, 1)
    prompts = [system + rand(n, 10 + n) for n in (5, 11, 7, 3)]
    llm = LLM(str(ckpt), dtype="float64", enable_prefix_caching=True, max_model_len=1200)
    outs, got = hits(llm, prompts)
    assert outs == [reference(p) for p in prompts]
    assert got[0] == 0 and got[1] == 0  # nothing shared yet / only KV shared: the junction is exported
    assert got[2] >= 896 and got[3] >= 896


def test_multi_turn_session_hits_previous_prompt_and_output(ckpt, reference):
    llm = LLM(str(ckpt), dtype="float64", enable_prefix_caching=True, max_model_len=1200)
    context = rand(100, 2)
    previous = None  # prompt + output length of the previous turn
    for turn in range(4):
        out, (hit,) = hits(llm, [context])
        assert out[0] == reference(context)
        if previous is not None:
            assert hit >= previous - 16, (turn, hit, previous)
        previous = len(context) + len(out[0])
        context = context + out[0] + rand(9 + turn, 30 + turn)


@pytest.mark.parametrize("length", [1, 5, 15, 16, 17, 40])
def test_identical_retries_and_short_prompts(ckpt, reference, length):
    prompt = rand(length, 100 + length)
    llm = LLM(str(ckpt), dtype="float64", enable_prefix_caching=True, max_model_len=1200)
    outs, got = hits(llm, [prompt, prompt, prompt])
    assert outs == [reference(prompt)] * 3
    if length > 1:
        assert got[1] == length - 1 and got[2] == length - 1  # capped at prompt_len - 1


def test_shared_part_ending_mid_page(ckpt, reference):
    base = rand(37, 7)  # 2 full pages + 5 tokens
    prompts = [base + rand(4, 8), base, base + rand(20, 9), base[:30] + rand(6, 11)]
    llm = LLM(str(ckpt), dtype="float64", enable_prefix_caching=True, max_model_len=1200)
    outs, got = hits(llm, prompts)
    assert outs == [reference(p) for p in prompts]
    assert got[2] >= 36  # the prompt-end checkpoint of `base` (prompt_len - 1), inside a partial page


def test_batched_requests_with_chunked_prefill_and_interval(ckpt, reference):
    system = rand(300, 3)
    prompts = [system + rand(n, 50 + n) for n in (2, 30, 17, 1, 64)] * 2
    llm = LLM(str(ckpt), dtype="float64", enable_prefix_caching=True, max_model_len=1200,
              max_num_batched_tokens=40, checkpoint_interval=64)
    outs, got = hits(llm, prompts[:5], one_by_one=False)
    outs2, got2 = hits(llm, prompts[5:], one_by_one=False)
    assert outs + outs2 == [reference(p) for p in prompts]
    assert got2[0] >= 5 * 300


def test_eviction_pressure_keeps_outputs_exact(ckpt, reference):
    llm_probe = LLM(str(ckpt), dtype="float64", max_model_len=256)
    slot = llm_probe.engine.model.state_bytes_per_slot()
    page = llm_probe.engine.model.kv_bytes_per_token() * 16
    # Room for 4 slots and 40 pages: running requests plus a handful of pages / checkpoints.
    budget = 4 * slot + 40 * page
    llm = LLM(str(ckpt), dtype="float64", enable_prefix_caching=True, max_model_len=256, memory_budget=budget,
              max_num_seqs=2)
    systems = [rand(120, 200 + i) for i in range(4)]
    prompts = [systems[i // 3 % 4] + rand(5, 300 + i) for i in range(18)]  # runs of 3 per system prompt
    outs, _ = hits(llm, prompts)
    assert outs == [reference(p) for p in prompts]
    m = llm.get_metrics()
    assert m["checkpoints_evicted"] > 0 and m["pages_evicted"] > 0
    assert m["prefix_cache_hit_tokens"] > 0
    assert m["state_slots_free"] + m["cached_checkpoints"] == m["state_slots_total"]


def test_checkpoint_on_a_sibling_page_is_found(ckpt, reference):
    """A checkpoint sits on one child page while the best-matching child is another: the hit must
    still use it (both share the first tokens of that page)."""
    x, z, v = rand(37, 21), rand(20, 22), rand(10, 23)
    prompts = [x, x + z, x + z[:11] + v]
    llm = LLM(str(ckpt), dtype="float64", enable_prefix_caching=True, max_model_len=1200)
    outs, got = hits(llm, prompts)
    assert outs == [reference(p) for p in prompts]
    assert got[2] >= 36


def test_exact_junction_is_exported_for_the_third_request(ckpt, reference):
    system = rand(905, 31)  # ends mid-page: the junction is not page-aligned
    prompts = [system + rand(6, 32), system + rand(7, 33), system + rand(8, 34)]
    llm = LLM(str(ckpt), dtype="float64", enable_prefix_caching=True, max_model_len=1200)
    outs, got = hits(llm, prompts)
    assert outs == [reference(p) for p in prompts]
    assert got[2] >= 905


def test_a_hit_pinning_the_room_it_needs_does_not_stall_an_idle_engine(ckpt):
    """Four pages in all: the second turn's hit shares two cached pages and copies rows from the
    cache's third, so with nothing running the only pages it could get are the ones its own hit
    pins. The engine starts it without the hit (recomputed) instead of stepping empty forever."""
    probe = LLM(str(ckpt), dtype="float64", max_model_len=64)
    slot = probe.engine.model.state_bytes_per_slot()
    page = probe.engine.model.kv_bytes_per_token() * 16
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = LLM(str(ckpt), dtype="float64", enable_prefix_caching=True, max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=16, memory_budget=4 * slot + 4 * page)
    first = rand(36, 7)
    second = first + llm.generate([first], sp, use_tqdm=False)[0].outputs[0].token_ids + [5, 6, 7]
    engine = llm.engine
    engine.add_request("second", second, sp)
    for _ in range(100):
        if not engine.scheduler.has_unfinished():
            break
        outs = engine.step()
    assert not engine.scheduler.has_unfinished(), "the request never started"
    assert outs[0].outputs[0].token_ids == probe.generate([second], sp, use_tqdm=False)[0].outputs[0].token_ids


def test_cache_salt_keeps_tenants_apart_and_outputs_exact(ckpt, reference):
    """A salted request hits only what requests of its salt filed (vLLM's cache_salt), and no
    output changes: the same prompt under salts a, b, none, then a again."""
    llm = LLM(str(ckpt), dtype="float64", max_model_len=1200, enable_prefix_caching=True)
    prompt = rand(96, seed=41)
    got = []
    for salt in ("a", "b", None, "a"):
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, cache_salt=salt)
        before = llm.get_metrics()["prefix_cache_hit_tokens"]
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference(prompt)
        got.append(llm.get_metrics()["prefix_cache_hit_tokens"] - before)
    assert got[:3] == [0, 0, 0] and got[3] == len(prompt) - 1  # a's retry: all but the last token


def test_vllm_prompt_dicts_carry_their_cache_salt(ckpt, reference):
    """LLM.generate takes vLLM's TokensPrompt / TextPrompt dicts; a dict's cache_salt salts that
    prompt alone. Bad dicts are a ValueError naming the prompt and the key."""
    llm = LLM(str(ckpt), dtype="float64", max_model_len=1200, enable_prefix_caching=True)
    prompt = rand(80, seed=43)
    hits_of = []
    for request in ({"prompt_token_ids": prompt, "cache_salt": "a"}, {"prompt_token_ids": prompt},
                    {"prompt_token_ids": prompt, "cache_salt": "a"}):
        before = llm.get_metrics()["prefix_cache_hit_tokens"]
        assert llm.generate(request, SP, use_tqdm=False)[0].outputs[0].token_ids == reference(prompt)
        hits_of.append(llm.get_metrics()["prefix_cache_hit_tokens"] - before)
    assert hits_of == [0, 0, len(prompt) - 1]
    text = llm.generate([{"prompt": "hello world"}], SP, use_tqdm=False)[0]
    assert text.prompt_token_ids == llm.tokenizer.encode("hello world")
    for bad, match in [({"prompt_token_ids": prompt, "multi_modal_data": {}}, "multi_modal_data"),
                       ({"prompt": "a", "prompt_token_ids": prompt}, "exactly one"), ({}, "exactly one"),
                       ({"prompt": [1, 2]}, "must be a string"), ({"prompt_token_ids": prompt, "cache_salt": ""},
                                                                  "cache_salt")]:
        with pytest.raises(ValueError, match=match) as err:
            llm.generate([[5, 6, 7], bad], SP, use_tqdm=False)
        assert str(err.value).startswith("prompt 1:")
    assert not llm.engine.has_unfinished_requests()
