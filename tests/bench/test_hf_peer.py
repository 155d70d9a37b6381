"""hyla.bench.hf_peer: transformers built on hyla's tensors computes hyla's logits.

Tiny random MoE shapes of both families (16 experts, both layer kinds, a dense layer), fp32 on
the CPU. hyla and transformers then run the same math in a different order (hyla's chunkwise
delta rule vs transformers' torch fallback, sorted grouped GEMMs vs grouped_mm's loop fallback),
so their logits differ by fp32 rounding only: about 1e-6 relative to the logits' norm here. A
wrong mapping (gate / up swapped, q/k/v convs in the wrong order, a tensor left at a default)
moves the O(1) logits by O(1): 1e-4 relative separates the two by two orders of magnitude each
way.
"""

import pytest
import torch

from hyla.bench import hf_peer
from hyla.bench.random_models import random_config_dict, random_model

FAMILIES = ["tiny-kimi-moe", "tiny-qwen3-next-moe"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    model = random_model(request.param, dtype=torch.float32, seed=1)
    return request.param, model, hf_peer.build_peer(model, random_config_dict(request.param))


def test_transformers_logits_equal_hyla_logits_on_shared_weights(pair):
    name, model, hf = pair
    c = model.config
    assert c.num_experts >= 16 and {"linear_attention", "full_attention"} <= set(c.layer_types)
    assert {"dense", "sparse"} <= set(c.mlp_layer_types)
    ids = torch.randint(3, c.vocab_size, (2, 41), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert ours.abs().max() > 1.0  # logits O(1): a wrong tensor would show
    assert _rel(ours, theirs) < 1e-4


def test_expert_and_projection_storage_is_shared(pair):
    name, model, hf = pair
    sd = model.state_dict()
    prefix = "model.layers.1.block_sparse_moe." if name == "tiny-kimi-moe" else "model.layers.1.mlp."
    hf_experts = hf.get_submodule("model.layers.1.mlp.experts")
    if f"{prefix}experts.gate_up_proj" in sd:  # hyla's stacked layout: nothing copied
        assert hf_experts.gate_up_proj.data_ptr() == sd[f"{prefix}experts.gate_up_proj"].data_ptr()
        assert hf_experts.down_proj.data_ptr() == sd[f"{prefix}experts.down_proj"].data_ptr()
    assert hf.lm_head.weight.data_ptr() == sd["lm_head.weight"].data_ptr()
    w = sd["model.layers.0.self_attn.q_proj.weight" if name == "tiny-kimi-moe" else
           "model.layers.0.linear_attn.out_proj.weight"]
    assert any(t.data_ptr() == w.data_ptr() for t in hf.parameters())
    assert not any(t.is_meta for t in list(hf.parameters()) + list(hf.buffers()))


@pytest.mark.parametrize("name", FAMILIES)
def test_old_per_expert_layout_is_stacked_like_the_new_one(name):
    """Before hyla's MoE kept stacked experts its state_dict had one module per expert; both
    layouts must give transformers the same [E, 2I, H] / [E, H, I] tensors."""
    model = random_model(name, dtype=torch.float32, seed=2)
    sd = model.state_dict()
    kimi = name == "tiny-kimi-moe"
    E = model.config.num_experts
    stacked = {k: v for k, v in sd.items() if k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    if not stacked:
        pytest.skip("hyla's MoE still has per-expert modules: the mapping test above covers that layout")
    old = {k: v for k, v in sd.items() if k not in stacked}
    gate, up, down = ("w1", "w3", "w2") if kimi else ("gate_proj", "up_proj", "down_proj")
    for key, t in stacked.items():
        base = key.rsplit(".", 1)[0]
        for e in range(E):
            if key.endswith("gate_up_proj"):
                inter = t.shape[1] // 2
                old[f"{base}.{e}.{gate}.weight"], old[f"{base}.{e}.{up}.weight"] = t[e, :inter], t[e, inter:]
            else:
                old[f"{base}.{e}.{down}.weight"] = t[e]
    for key, t in stacked.items():
        hf_name = key.replace(".block_sparse_moe.", ".mlp.")
        assert torch.equal(hf_peer._source(hf_name, old, type(model.config).TRANSFORMERS_NAMES, E), t)


def test_decode_step_from_a_chunked_prefill_matches_a_full_forward(pair):
    """The transformers decode cell: a cache built in chunks of sequences, merged along the batch,
    then restored after a step, gives the logits of one full forward, every time."""
    name, model, hf = pair
    ids = torch.randint(3, model.config.vocab_size, (3, 13), generator=torch.Generator().manual_seed(3))
    cache = hf_peer.prefilled_cache(hf, ids[:, :12], chunk_tokens=12)  # one sequence per chunk
    snap = hf_peer._snapshot(cache)
    kw = hf_peer._cache_kwarg(hf)
    steps = []
    with torch.inference_mode():
        for _ in range(2):
            steps.append(hf(input_ids=ids[:, 12:], use_cache=True, **{kw: cache}).logits[:, -1])
            hf_peer._restore(cache, snap)
        full = model(ids)[:, -1]
    assert torch.equal(steps[0], steps[1])
    assert _rel(steps[0], full) < 1e-4


def test_glm5_next_peer_logits_equal_hyla_logits():
    """GLM-5-Next's peer is the multimodal class: its vision tower is allocated but never run, the
    text model gets hyla's tensors (renamed through TRANSFORMERS_NAMES); prompts past
    index_topk * index_kpool tokens so the indexer really drops positions."""
    model = random_model("tiny-glm5-next", dtype=torch.float32, seed=1)
    hf = hf_peer.build_peer(model, random_config_dict("tiny-glm5-next"))
    c = model.config
    assert 41 > c.index_topk * c.index_kpool
    ids = torch.randint(3, c.vocab_size, (2, 41), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids), hf(input_ids=ids).logits
    assert ours.abs().max() > 1.0
    assert _rel(ours, theirs) < 1e-4


def test_glm5_next_peer_cache_restores_between_decode_steps():
    """The decode timing restores transformers' cache before each step: an indexed layer's keys,
    its empty NoPE values and its indexer keys included (a missed one grows every step)."""
    model = random_model("tiny-glm5-next", dtype=torch.float32, seed=1)
    hf = hf_peer.build_peer(model, random_config_dict("tiny-glm5-next"))
    assert hf_peer.decode_step_ms(hf, batch=2, context=40, vocab=model.config.vocab_size, repeat=2) > 0


def test_merge_keeps_a_shared_counter_and_refuses_unequal_ones():
    """Zero-dim tensors of a cache layer (transformers 5.25's tokens-seen counter) are not batched:
    merging chunks keeps the counter they agree on and refuses chunks of different lengths."""
    from types import SimpleNamespace

    def cache(n, seen):
        layer = SimpleNamespace(cumulative_length_linear=torch.tensor(seen), recurrent_states={0: torch.randn(n, 2)})
        return SimpleNamespace(layers=[layer])

    merged = hf_peer._merge([cache(1, 12), cache(2, 12)])
    assert merged.layers[0].cumulative_length_linear.item() == 12
    assert merged.layers[0].recurrent_states[0].shape == (3, 2)
    with pytest.raises(ValueError, match="cumulative_length_linear"):
        hf_peer._merge([cache(1, 12), cache(1, 7)])
