"""Speculative decoding with the checkpoint's MTP head (method "mtp") on tiny Qwen3.5 / Qwen3-Next
checkpoints whose `mtp.*` head sits in its own shard: greedy output equals plain greedy for
k = 1..3, both rollbacks, prefix cache on and off; the drafter's proposals are the head's."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyla import LLM, SamplingParams
from hyla.engine.config import EngineConfig
from hyla.models import load_model
from hyla.models.qwen3_5_mtp import load_mtp_head
from tests.oracles.qwen3_5_checkpoint import add_mtp_shard, build_qwen3_5_checkpoint
from tests.oracles.variants import rand_tokens as rand

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [rand(12, 1) * 3, [7], rand(5, 3) * 4]


def _repeat_head(path) -> None:
    """Make the head pass the target's hidden state through (fc picks its normed half, the layer
    adds nothing): it then drafts the token the target just produced, so a target that repeats
    itself accepts some drafts and rejects others."""
    file = path / "model-mtp.safetensors"
    t = load_file(file)
    hid = t["mtp.norm.weight"].shape[0]
    t["mtp.fc.weight"] = torch.cat([torch.zeros(hid, hid), torch.eye(hid)], dim=1)
    for name in t:
        if name.endswith(("pre_fc_norm_hidden.weight", "mtp.norm.weight", "o_proj.weight", "o_proj.bias",
                          "down_proj.weight")):
            t[name] = torch.zeros_like(t[name])
    save_file(t, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = build_qwen3_5_checkpoint(tmp_path_factory.mktemp("mtp"), "moe", "multimodal", with_tokenizer=True)
    add_mtp_shard(path)
    _repeat_head(path)
    return path


@pytest.fixture(scope="module")
def plain(ckpt):
    return [o.outputs[0].token_ids for o in LLM(str(ckpt), dtype="float64").generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("k,rollback,prefix_cache", [  # also k = 2, slots, cache on: test_qwen3_next_checkpoint
    (1, "slots", True), (2, "replay", False), (3, "replay", True),
])
def test_mtp_greedy_equals_plain_greedy(ckpt, plain, k, rollback, prefix_cache):
    cfg = {"method": "mtp", "num_speculative_tokens": k, "rollback": rollback}
    llm = LLM(str(ckpt), dtype="float64", speculative_config=cfg, enable_prefix_caching=prefix_cache, max_num_seqs=3)
    outs = llm.generate(PROMPTS + PROMPTS[:1], GREEDY, use_tqdm=False)  # a retry: a prefix-cache hit
    assert [o.outputs[0].token_ids for o in outs] == plain + plain[:1]
    m = llm.get_metrics()
    assert 0 < m["spec_num_accepted_tokens"] < m["spec_num_draft_tokens"]  # partial acceptance
    assert m["state_slots_free"] + m.get("cached_checkpoints", 0) == m["state_slots_total"]
    assert m["kv_pages_free"] + m.get("cached_pages", 0) == m["kv_pages_total"]
    drafter = llm.engine.spec.drafter
    assert not drafter.views and not drafter._seen  # every request released


def head_drafts_by_hand(model, head, tokens: list[int], start: int, n: int) -> list[int]:
    """The n greedy drafts of an MTP head for a request whose last token sits at len(tokens) - 1,
    the head attending from position `start` on: the target's final-norm states by a plain
    forward, then the head rerun over its whole input each step (it is causal, so the new row
    comes last)."""
    ids, p = torch.tensor(tokens), len(tokens) - 1
    with torch.no_grad():
        h = model.model.forward_layers(model.model.embed_tokens(ids[None]))[0]  # [T, hidden]
        hs, ns, want = h[start:p], ids[start + 1:p + 1], []
        while True:
            y = head(hs[None], ns[None], model)[0, -1]
            want.append(int(model.compute_logits(y).argmax()))
            if len(want) == n:
                return want
            hs, ns = torch.cat([hs, y[None]]), torch.cat([ns, torch.tensor(want[-1:])])


def test_mtp_with_preemption(ckpt):
    """Two running requests and pages for fewer tokens than they hold: requests are preempted and
    recomputed; the head's views restart where needed and the output stays plain greedy."""
    long = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = [PROMPTS[0], rand(30, 2), rand(30, 2) + rand(6, 9)]
    plain = LLM(str(ckpt), dtype="float64", max_model_len=96)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, long, use_tqdm=False)]
    model = plain.engine.model
    slot = model.state_bytes_per_slot()
    pages = 2 * slot // plain.engine.kv_bytes_per_page  # what a budget of 4 slots left for pages without MTP
    page = plain.engine.kv_bytes_per_page + model.config.layer_sizes().kv_per_token * 8 * 16  # + the head's layer
    llm = LLM(str(ckpt), dtype="float64", max_model_len=96, max_num_seqs=2, memory_budget=2 * slot + pages * page,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2, "rollback": "replay"})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, long, use_tqdm=False)] == want
    m = llm.get_metrics()
    assert m["num_preemptions"] > 0 and m["spec_num_accepted_tokens"] > 0


def test_proposals_are_the_heads_tokens(ckpt):
    """Each proposal equals the head run by hand over the target's whole-sequence hidden states
    (from the request's first speculative step on, where the drafter's view starts)."""
    llm = LLM(str(ckpt), dtype="float64", speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    drafter = llm.engine.spec.drafter
    seen, propose = [], drafter.propose

    def record(seqs, ks, generator=None):
        out = propose(seqs, ks, generator)
        seen.extend((list(s.token_ids), drafter.views[s.request_id].start, d) for s, (d, _) in zip(seqs, out) if d)
        return out

    drafter.propose = record
    prompt = rand(9, 5) * 2
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert len(seen) >= 3
    model = load_model(ckpt, dtype="float64")
    head = load_mtp_head(ckpt, model)
    for tokens, start, drafts in seen:
        assert drafts == head_drafts_by_hand(model, head, tokens, start, len(drafts))


def test_qwen3_next_checkpoint(tmp_path):
    from tests.oracles.qwen3_next_checkpoint import build_qwen3_next_checkpoint

    path = build_qwen3_next_checkpoint(tmp_path, "moe", with_tokenizer=True)
    add_mtp_shard(path)
    _repeat_head(path)
    prompts, params = PROMPTS + [rand(30, 2)], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(path), dtype="float64").generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(path), dtype="float64", speculative_config={"method": "mtp", "num_speculative_tokens": 2},
              enable_prefix_caching=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert llm.get_metrics()["spec_num_accepted_tokens"] > 0


def test_a_checkpoint_without_a_head_fails_at_startup(tmp_path):
    path = build_qwen3_5_checkpoint(tmp_path, "dense", "text")
    with pytest.raises(ValueError, match=r"needs a checkpoint with a multi-token-prediction head.*no `mtp\.\*`"):
        EngineConfig(str(path), speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="method 'mtp' takes no 'model'"):
        EngineConfig(str(path), speculative_config={"method": "mtp", "num_speculative_tokens": 2, "model": "x"})
    shutil.rmtree(path)


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    return float(torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2.0, dtype=torch.float64),
                                         stat.double() / 2))


def test_sampling_with_mtp_drafts_keeps_the_target_distribution(tmp_path):
    """Vocabulary 8, temperature 1: the second and third generated tokens (the first two a request
    can take through MTP drafts: its first speculative step drafts from the prompt's hidden
    states) are distributed as the target's marginals."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from tests.oracles.qwen3_5_checkpoint import TINY, VARIANTS

    torch.manual_seed(3)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**TINY, **VARIANTS["dense"], "vocab_size": 8}))
    with torch.no_grad():
        model.lm_head.weight.mul_(4)  # sharper, structured next-token distributions
    path = tmp_path / "tiny8"
    model.save_pretrained(path)
    add_mtp_shard(path)
    prompt = [3, 4, 5, 6, 7, 1, 0, 2, 3, 4, 5]
    ref = load_model(path, dtype=torch.float64)
    with torch.no_grad():  # p(c) = sum over a, b of p(a) p(b | a) p(c | a, b)
        p1 = torch.softmax(ref(torch.tensor([prompt]))[0, -1], -1)
        p2 = torch.softmax(ref(torch.tensor([prompt + [a] for a in range(8)]))[:, -1], -1)  # [a, b]
        p3 = torch.softmax(ref(torch.tensor([prompt + [a, b] for a in range(8) for b in range(8)]))[:, -1], -1)
        second = (p1[:, None] * p2).sum(0)
        third = ((p1[:, None] * p2).reshape(64, 1) * p3).sum(0)
    llm = LLM(str(path), dtype="float64", speculative_config={"method": "mtp", "num_speculative_tokens": 2},
              max_num_seqs=64)
    drafter, first_drafts = llm.engine.spec.drafter, {}
    propose = drafter.propose

    def record(seqs, ks, generator=None):
        out = propose(seqs, ks, generator)
        for seq, (d, _) in zip(seqs, out):
            if d and len(seq.token_ids) == len(prompt) + 1:  # the first speculative step: d1 is token 2's draft
                first_drafts[seq.request_id] = d[0]
        return out

    drafter.propose = record
    n = 400
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, seed=s, max_tokens=4, ignore_eos=True)
                                       for s in range(n)], use_tqdm=False)
    counts = torch.zeros(2, 8)
    for o in outs:
        for j in (0, 1):
            counts[j, o.outputs[0].token_ids[1 + j]] += 1
    m = llm.get_metrics()
    assert len(first_drafts) == n  # every request's first speculative step drafted
    assert m["spec_num_accepted_tokens"] > 0
    assert _chi2_pvalue(counts[0], second) > 1e-3
    assert _chi2_pvalue(counts[1], third) > 1e-3
    # The power to reject a wrong rule: taking the head's draft as the second token fails the test.
    naive = torch.bincount(torch.tensor(list(first_drafts.values())), minlength=8).double()
    assert _chi2_pvalue(naive, second) < 1e-6


def test_mtp_with_prefill_graphs_equals_plain_greedy(ckpt, plain):
    """Prefill steps through the padded static spans (hyla.engine.prefill_graphs; on the CPU without
    graphs): the head reads the prefill's hidden states, which the runner copies out of the static
    buffer before the next step overwrites it."""
    cfg = {"method": "mtp", "num_speculative_tokens": 2, "rollback": "slots"}
    llm = LLM(str(ckpt), dtype="float64", speculative_config=cfg, enable_prefix_caching=True, max_num_seqs=3,
              prefill_graph_max_tokens=32)
    assert llm.engine.runner.prefill_graphs is not None
    outs = llm.generate(PROMPTS + PROMPTS[:1], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain + plain[:1]
    assert llm.get_metrics()["spec_num_accepted_tokens"] > 0
