"""`kv_cache_dtype="fp8"` (vLLM's `--kv-cache-dtype fp8`) through the engine: attention KV pages in
e4m3 with per-token scales (hyla.ops.kv_fp8), on a tiny Kimi-Linear (MLA latents) and a tiny
Qwen3-Next (GQA keys / values), both with dense MLPs: an MoE router's top-k is discontinuous, and
a near-tied expert choice flipped by any perturbation moves the logits by far more than the
perturbation (measured on the MoE presets: 0.32 at one step of 16 where the others move 0.03),
which would measure the router, not the pages.

- Drift (fp32): the logits of greedy decoding over FP8 pages against the model-dtype pages,
  teacher-forced on the same tokens, move by at most 2^-4 of the logits' scale (e4m3's relative
  rounding: every cached value is within 2^-4 of itself, and attention mixes them convexly);
  measured: 2.3% (MLA, 0.104 of 4.58) and 4.5% (GQA, 0.143 of 3.17) of it. Free-running greedy
  tokens agree up to the first step whose top-2 logit margin is within twice the measured drift
  (before it, no drift that small can change the argmax); measured: all 24 of 24 on both.
- Exactness (fp64, where batching and chunking move nothing but the last bits): the prefix cache
  on or off, preemption (recomputation), speculation (n-gram drafts written, then rewritten when
  rejected; accepted draft-model drafts), tensor parallelism give the tokens of the same FP8 run
  without them. Every reader reads the same quantised rows (prefix hits share or copy pages with
  their scales), so equality is expected.
- Memory: a page holds the same tokens in fewer bytes, so a fixed budget yields more pages, by
  the ratio of the bytes per token (the allocation and the accounting agree).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from hyla import LLM, SamplingParams
from hyla.bench.random_models import random_checkpoint, random_config_dict
from hyla.contract import ForwardBatch
from hyla.engine import EngineConfig
from hyla.models.loader import family_classes
from hyla.models.random_init import init_random_

FAMILIES = ("gqa", "mla")
E4M3_REL = 2.0 ** -4


def _checkpoint(root, name: str, std: float = 0.1, **overrides) -> Path:
    """Preset `name`'s config.json with `overrides`, random weights ~ N(0, std), written as an
    fp32 checkpoint."""
    from safetensors.torch import save_file

    d = dict(random_config_dict(name), dtype="float32", **overrides)
    config_cls, model_cls = family_classes(d["model_type"])
    torch.manual_seed(0)
    model = model_cls(config_cls.from_hf_dict(d))
    init_random_(model, std, seed=0)
    path = Path(root) / name
    path.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(d))
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Dense MLPs, and three attention layers of four (MLA) or five (GQA): most of the model
    reads the pages, and they weigh against the recurrent state (see PREEMPTION)."""
    root = tmp_path_factory.mktemp("kv_fp8")
    kimi_layers = dict(random_config_dict("tiny")["linear_attn_config"], kda_layers=[1], full_attn_layers=[2, 3, 4])
    return {"mla": _checkpoint(root, "tiny", linear_attn_config=kimi_layers),
            "gqa": _checkpoint(root, "tiny-qwen3-next-moe", mlp_only_layers=list(range(5)),
                               layer_types=["linear_attention"] + ["full_attention"] * 3 + ["linear_attention"])}


def _prompts(n_tokens=(37, 9), seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in n_tokens]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@torch.inference_mode()
def _teacher_forced(model, kv_cache_dtype: str, prompt: list[int], tokens: list[int], page_size: int = 16):
    """Logits [1 + len(tokens) - 1, V]: the prompt as one prefill (pages in reverse order), then
    one decode step per token, over pools of kv_cache_dtype (the engine's step code)."""
    pages = -(-(len(prompt) + len(tokens)) // page_size)
    cache = model.allocate_cache(1, pages + 1, page_size=page_size, kv_cache_dtype=kv_cache_dtype)
    table = [list(range(pages))[::-1]]
    h = model.forward_batch(torch.tensor(prompt), ForwardBatch.build([len(prompt)], [0], table, [0]), cache)
    out, ctx = [model.compute_logits(h[-1:])[0]], len(prompt)
    for t in tokens[:-1]:
        h = model.forward_batch(torch.tensor([t]), ForwardBatch.build([1], [ctx], table, [0]), cache)
        out.append(model.compute_logits(h)[0])
        ctx += 1
    return torch.stack(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_greedy_logit_drift_and_token_agreement(ckpts, family):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = _prompts()
    auto = LLM(str(ckpts[family]), dtype="float32", device="cpu", max_model_len=96)
    fp8 = LLM(str(ckpts[family]), dtype="float32", device="cpu", max_model_len=96, kv_cache_dtype="fp8")
    want, got = auto.generate(prompts, params, use_tqdm=False), fp8.generate(prompts, params, use_tqdm=False)
    model = auto.engine.model
    assert model.kv_cache_dtype == "auto" and fp8.engine.model.kv_cache_dtype == "fp8"
    drift = scale = 0.0
    for p, o in zip(prompts, want):
        la = _teacher_forced(model, "auto", p, o.outputs[0].token_ids)
        lf = _teacher_forced(model, "fp8", p, o.outputs[0].token_ids)
        assert torch.equal(la.argmax(-1), torch.tensor(o.outputs[0].token_ids))  # the engine's own tokens
        drift, scale = max(drift, (lf - la).abs().max().item()), max(scale, la.abs().max().item())
    assert drift <= E4M3_REL * scale, (drift, scale)
    agreed = 0
    for a, f in zip(want, got):
        ta, tf = a.outputs[0].token_ids, f.outputs[0].token_ids
        margins = [sorted(d.values())[-1] - sorted(d.values())[-2] for d in a.outputs[0].logprobs]
        close = next((i for i, m in enumerate(margins) if m <= 2 * drift + 1e-4), len(ta))
        assert tf[:close] == ta[:close], (close, ta, tf)
        agreed += next((i for i, (x, y) in enumerate(zip(ta, tf)) if x != y), len(ta))
    logging.getLogger("hyla.tests").info("%s: fp8 logit drift %.3g (%.2f%% of max |logit| %.3g), greedy tokens "
                                          "agree on %d of %d", family, drift, 100 * drift / scale, scale, agreed,
                                          sum(len(_) for _ in _tokens(want)))


@pytest.fixture(scope="module")
def fp8_reference(ckpts):
    """The fp64 FP8-page greedy tokens of every family, plain (no prefix cache, no speculation)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    shared = _prompts((40,), seed=5)[0]
    # a hybrid's hit needs a state checkpoint at the junction: the second request exports it, the
    # third hits (tests/engine/test_prefix_cache.py)
    prompts = [shared + s for s in _prompts((5, 11, 3), seed=6)] + [[7, 8, 9, 10] * 6]
    out = {}
    for family, path in ckpts.items():
        llm = LLM(str(path), dtype="float64", device="cpu", max_model_len=96, kv_cache_dtype="fp8")
        out[family] = _tokens(llm.generate(prompts, params, use_tqdm=False))
    return prompts, params, out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("key_blocks", [False, True])
def test_prefix_cache_with_fp8_pages_gives_the_cache_off_tokens(ckpts, fp8_reference, family, key_blocks,
                                                                 monkeypatch):
    """key_blocks: a hit's prefill attends over the cached prefix a few positions at a time, the
    FP8 rows gathered and dequantised per block (hyla.layers.prefix_attention.EXPAND_BYTES)."""
    prompts, params, ref = fp8_reference
    blocked = []
    if key_blocks:
        import hyla.layers.prefix_attention as pa

        monkeypatch.setattr(pa, "EXPAND_BYTES", 1 << 12)
        real = pa.attend_key_blocks
        monkeypatch.setattr(pa, "attend_key_blocks", lambda *a: blocked.append(1) or real(*a))
    llm = LLM(str(ckpts[family]), dtype="float64", device="cpu", max_model_len=96, kv_cache_dtype="fp8",
              enable_prefix_caching=True)
    got = [_tokens(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]  # one by one: hits
    assert got == ref[family]
    assert bool(blocked) == key_blocks
    assert llm.get_metrics()["prefix_cache_hit_tokens"] >= 32  # the shared 40 tokens' whole pages, at least


# Preemption needs running requests whose pages outgrow the budget while their state slots fit:
# family -> (max_num_seqs, pages beyond those the slots' half of the budget leaves, prompt lengths,
# max_model_len). Slots take at most half the budget, so the pages are at least max_num_seqs x
# (slot / page bytes): ~2 per slot for the GQA checkpoint, ~1.3 for tiny GLM-5-Next (DSA latents;
# its indexer rows stay in the model dtype), ~6 for the MLA one (whose preemption would need
# prompts of ~100 tokens: left to the GQA and DSA cases). All three requests start, then outgrow
# the pages while decoding.
PREEMPTION = {"gqa": (3, 2, (30, 28, 26), 96), "dsa": (3, 4, (30, 28, 26), 96)}


@pytest.mark.parametrize("family", sorted(PREEMPTION))
def test_preemption_with_fp8_pages_gives_the_same_tokens(ckpts, tmp_path_factory, family):
    seqs, extra, lens, max_len = PREEMPTION[family]
    path = ckpts.get(family) or random_checkpoint(tmp_path_factory.mktemp("dsa"), "tiny-glm5-next")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = _prompts(lens, seed=7)
    kw = dict(dtype="float64", device="cpu", max_model_len=max_len, kv_cache_dtype="fp8")
    plain = LLM(str(path), **kw)
    want = _tokens(plain.generate(prompts, params, use_tqdm=False))
    slot, page = plain.engine.model.state_bytes_per_slot(), plain.engine.kv_bytes_per_page
    llm = LLM(str(path), max_num_seqs=seqs, memory_budget=2 * seqs * slot + extra * page, **kw)
    assert llm.engine.pools.slots.num_slots == seqs
    assert llm.engine.pools.pages.num_pages < seqs * -(-(min(lens) + 12) // 16)  # all running: too few
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert llm.get_metrics()["num_preemptions"] > 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method,rollback", [("ngram", "slots"), ("draft_model", "replay")])
def test_speculation_with_fp8_pages_gives_the_same_tokens(ckpts, fp8_reference, family, method, rollback):
    """n-gram drafts (on these random models mostly rejected: their rows are written, then
    rewritten) and, for accepted drafts, the checkpoint itself as the draft model (its own pools,
    in the model dtype: it proposes the greedy tokens, which the FP8 target accepts)."""
    prompts, params, ref = fp8_reference
    spec = {"method": method, "num_speculative_tokens": 3, "rollback": rollback}
    if method == "draft_model":
        spec["model"] = str(ckpts[family])
    llm = LLM(str(ckpts[family]), dtype="float64", device="cpu", max_model_len=96, kv_cache_dtype="fp8",
              speculative_config=spec)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == ref[family]
    m = llm.get_metrics()
    assert m["spec_num_draft_tokens"] > 0  # drafts were written into the pages and verified
    if method == "draft_model":
        assert m["spec_num_accepted_tokens"] > m["spec_num_draft_tokens"] // 2


def test_tensor_parallel_ranks_hold_their_heads_fp8_pages(ckpts, fp8_reference):
    """TP = 2 (gloo, fp64): each rank allocates FP8 pages and scales for its own KV head; the
    tokens are the one-process FP8 run's."""
    import torch.distributed as dist

    prompts, params, ref = fp8_reference
    llm = LLM(str(ckpts["gqa"]), dtype="float64", device="cpu", max_model_len=96, kv_cache_dtype="fp8",
              tensor_parallel_size=2)
    try:
        layer = llm.engine.runner.cache.attention_layers[0]  # rank 0's pools
        assert [t.shape[2] for t in layer.tensors()] == [1, 1, 1, 1]  # 2 KV heads over 2 ranks
        assert layer.k.dtype == torch.float8_e4m3fn and layer.k_scale.dtype == torch.float32
        assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == ref["gqa"]
    finally:
        llm.shutdown()
    assert not dist.is_initialized()


def test_the_cli_flag_reaches_the_engine_config(ckpts):
    import argparse

    from hyla.cli import _add_engine_args, _engine_config

    p = argparse.ArgumentParser()
    _add_engine_args(p, prefix_cache_default=False)
    base = ["--model", str(ckpts["mla"]), "--device", "cpu"]
    assert _engine_config(p.parse_args(base)).kv_cache_dtype == "auto"
    for value in ("fp8", "fp8_e4m3"):
        assert _engine_config(p.parse_args(base + ["--kv-cache-dtype", value])).kv_cache_dtype == value
    with pytest.raises(SystemExit):  # argparse's choices: vLLM's other FP8 formats are not offered
        p.parse_args(base + ["--kv-cache-dtype", "fp8_e5m2"])


def _attention_bytes(llm) -> int:
    cache = llm.engine.runner.cache
    return sum(t.numel() * t.element_size() for layer in cache.attention_layers for t in layer.tensors())


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_pages_for_the_same_budget_grow_by_the_bytes_ratio(ckpts, family, caplog):
    budget = 3 << 20
    llms = {}
    with caplog.at_level(logging.INFO, logger="hyla.engine"):
        for kv in ("auto", "fp8_e4m3"):
            llms[kv] = LLM(str(ckpts[family]), dtype="float32", device="cpu", max_model_len=64, max_num_seqs=4,
                           memory_budget=budget, kv_cache_dtype=kv)
    auto, fp8 = llms["auto"].engine, llms["fp8_e4m3"].engine
    c = auto.model.config
    n = sum(t != "linear_attention" for t in c.layer_types)
    if family == "mla":  # latents r + rope, one e4m3 byte each, and a scale for c and one for k_pe
        want_auto, want_fp8 = n * (c.kv_lora_rank + c.qk_rope_head_dim) * 4, n * (
            c.kv_lora_rank + c.qk_rope_head_dim + 2 * 4)
    else:  # keys and values, Hkv x D each, and a scale per token and KV head each
        want_auto, want_fp8 = n * 2 * c.num_key_value_heads * c.head_dim * 4, n * 2 * c.num_key_value_heads * (
            c.head_dim + 4)
    assert auto.model.kv_bytes_per_token() == want_auto and fp8.model.kv_bytes_per_token() == want_fp8
    slots = auto.pools.slots.num_slots
    assert fp8.pools.slots.num_slots == slots
    free = budget - slots * auto.model.state_bytes_per_slot()
    for eng, per_token in ((auto, want_auto), (fp8, want_fp8)):
        assert eng.pools.pages.num_pages == free // (per_token * 16)
    ratio = fp8.pools.pages.num_pages / auto.pools.pages.num_pages
    assert math.isclose(ratio, want_auto / want_fp8, rel_tol=0.01), ratio
    # what was allocated is what was counted (scales included; no scratch page on the CPU)
    for eng, llm in ((auto, llms["auto"]), (fp8, llms["fp8_e4m3"])):
        assert _attention_bytes(llm) == eng.pools.pages.num_pages * eng.kv_bytes_per_page
    layer = fp8.runner.cache.attention_layers[0]
    assert all(t.dtype in (torch.float8_e4m3fn, torch.float32) for t in layer.tensors())
    assert all(t.dtype == torch.float32 for t in auto.runner.cache.attention_layers[0].tensors())
    assert len(auto.runner.cache.attention_layers[0].tensors()) == (1 if family == "mla" else 2)  # auto: no scales
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pools:")]
    assert f"{fp8.pools.pages.num_pages} KV pages" in lines[-2] and "fp8 e4m3" in lines[-1], lines


@pytest.mark.parametrize("value", ["fp8_e5m2", "fp8_inc", "float16", "FP8"])
def test_a_bad_kv_cache_dtype_is_a_value_error(ckpts, value):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8', 'fp8_e4m3'\]"):
        EngineConfig(model=str(ckpts["mla"]), device="cpu", kv_cache_dtype=value)
