"""Long-context paths at small scale against the model's own full forward: a 450-token prompt in
4-token KV pages (a block table of 113+ pages, handed out in a shuffled order), prefilled in chunks
of 7 (boundaries at every offset within a page and within the KDA kernels' 64-token chunks), 63,
64, 65, 100 tokens or all at once, then decoded across page boundaries. Every prompt position's
log-probabilities and every generated token (greedy) and its log-probability equal the full
forward over prompt + output (fp64 weights; the engine's logits are fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from hyla.engine import LLM, SamplingParams
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint

PROMPT_LEN, PAGE_SIZE, NEW_TOKENS = 450, 4, 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_kimi_checkpoint(tmp_path_factory.mktemp("long_context"), "moe")  # 2 KDA + 2 MLA (RoPE) layers


@pytest.mark.parametrize("chunk,score_bytes,expand_bytes", [
    (7, None, None), (63, None, None), (64, None, None), (65, None, None), (100, None, None),
    (100, 1 << 14, None), (None, None, None), (100, None, 1 << 16), (63, 1 << 14, 1 << 16)])
def test_many_pages_and_chunk_offsets_equal_the_full_forward(checkpoint, chunk, score_bytes, expand_bytes,
                                                             monkeypatch):
    # 7 is prime to 64: the boundaries 7k (k < 64, 448 tokens) fall at every offset mod 64 and mod 4.
    # score_bytes: the MLA prefill over a prefix in CPU query blocks; expand_bytes: its prefix's
    # keys and values built a block of positions at a time (hyla.layers.prefix_attention)
    import hyla.layers.prefix_attention as pa

    if score_bytes is not None:
        monkeypatch.setattr(pa, "CPU_SCORE_BYTES", score_bytes)
    blocked = []
    if expand_bytes is not None:
        monkeypatch.setattr(pa, "EXPAND_BYTES", expand_bytes)
        real = pa.attend_key_blocks
        monkeypatch.setattr(pa, "attend_key_blocks", lambda *a: blocked.append(1) or real(*a))
    llm = LLM(str(checkpoint), dtype=torch.float64, device="cpu", max_num_seqs=1, page_size=PAGE_SIZE,
              max_model_len=PROMPT_LEN + NEW_TOKENS + 2, memory_budget=1 << 22,
              max_num_batched_tokens=chunk or 4096)
    pages = llm.engine.pools.pages
    assert pages.num_free == pages.num_pages > 2 * (PROMPT_LEN + NEW_TOKENS) // PAGE_SIZE
    order = list(pages._free)  # a non-contiguous block table: the free list in a shuffled order
    random.Random(chunk).shuffle(order)
    pages._free.clear()
    pages._free.extend(order)

    prompt = torch.randint(3, 250, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    metrics = llm.get_metrics()
    tokens = out.outputs[0].token_ids
    assert len(tokens) == NEW_TOKENS and pages.num_free == pages.num_pages

    with torch.no_grad():
        lp = torch.log_softmax(llm.engine.model(torch.tensor([prompt + tokens]))[0].double(), dim=-1)
    # prompt positions: the prompt token's log-probability and the top one, as the full forward gives them
    got = out.prompt_logprobs
    assert len(got) == PROMPT_LEN and got[0] is None
    for i in range(1, PROMPT_LEN):
        want = {prompt[i]: lp[i - 1, prompt[i]].item(), int(lp[i - 1].argmax()): lp[i - 1].max().item()}
        assert got[i].keys() == want.keys(), i
        assert all(abs(got[i][t] - want[t]) <= 1e-5 for t in want), (i, got[i], want)  # fp32 log-softmax
    # decode over the pages: greedy = the full forward's argmax, with its log-probability
    for j, (token, logprobs) in enumerate(zip(tokens, out.outputs[0].logprobs, strict=True)):
        row = lp[PROMPT_LEN - 1 + j]
        assert token == int(row.argmax()), j
        assert abs(logprobs[token] - row[token].item()) <= 1e-5, j
    assert bool(blocked) == (expand_bytes is not None)
    # one step per prefill chunk, then one per token after the first
    assert metrics["num_steps"] == -(-PROMPT_LEN // (chunk or PROMPT_LEN)) + NEW_TOKENS - 1
