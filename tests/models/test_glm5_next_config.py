"""GLM-5-Next config.json parsing (nested text_config, flat, schedules), validation, parameter
counts against transformers' model, and the loader's registry / vision skip."""

import logging

import pytest
import torch

from hyla.models import load_config, load_model
from hyla.models.glm5_next_config import Glm5NextConfig
from tests.oracles.glm5_next_checkpoint import TEXT, VARIANTS, glm5_next_checkpoint, hf_config  # noqa: F401


def _text(**over) -> dict:
    return dict(model_type="glm5_next_text", **{**TEXT, **VARIANTS["hc2"], **over})


def test_released_defaults_match_transformers():
    from transformers import Glm5NextTextConfig

    ref = Glm5NextTextConfig()
    c = Glm5NextConfig.from_hf_dict({"model_type": "glm5_next", "text_config": {
        "vocab_size": 154880, "hidden_size": 4096, "num_hidden_layers": 45}})
    assert c.layer_types == ref.layer_types and c.mlp_layer_types == ref.mlp_layer_types
    assert c.indexer_types == ref.indexer_types
    for name in ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                 "index_topk", "index_head_dim", "index_n_heads", "index_kpool", "hc_mult", "hc_eps",
                 "hc_sinkhorn_iters", "linear_num_heads", "linear_head_dim", "linear_lower_bound", "swiglu_limit",
                 "moe_intermediate_size", "num_experts_per_tok", "routed_scaling_factor", "intermediate_size"):
        assert getattr(c, name) == getattr(ref, name), name
    assert c.num_experts == ref.n_routed_experts == 288
    assert len(c.linear_layers) == 34 and len(c.attention_layers) == 11


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_saved_config_parses_like_transformers(glm5_next_checkpoint, variant):  # noqa: F811
    path = glm5_next_checkpoint(variant)
    c = load_config(path)
    ref = hf_config(variant).text_config
    assert isinstance(c, Glm5NextConfig) and c.has_vision
    assert (c.layer_types, c.mlp_layer_types, c.indexer_types) == (ref.layer_types, ref.mlp_layer_types,
                                                                   ref.indexer_types)
    assert (c.hc_mult, c.index_kpool, c.index_topk, c.q_lora_rank) == (ref.hc_mult, ref.index_kpool,
                                                                       ref.index_topk, ref.q_lora_rank)


def test_parameter_counts_match_transformers():
    from transformers import Glm5NextForConditionalGeneration

    for variant in VARIANTS:
        hf = Glm5NextForConditionalGeneration(hf_config(variant))
        want = sum(p.numel() for n, p in hf.state_dict().items() if ".visual." not in n)
        c = Glm5NextConfig.from_hf_dict(dict(model_type="glm5_next_text", **{**TEXT, **VARIANTS[variant]}))
        assert sum(c.parameter_counts()) == want, variant


def test_flat_layout_and_schedules():
    flat = {k: v for k, v in _text().items() if k not in ("indexer_types",)}
    flat.update(model_type="glm5_next", index_topk_pattern="FFFFSF")
    c = Glm5NextConfig.from_hf_dict(flat)
    assert c.indexer_types == ["full"] * 4 + ["shared", "full"] and not c.has_vision
    assert c.selection_source(4) == 3 and c.indexer_layers == [1, 3]
    d = _text(indexer_types=None, index_topk_freq=2, index_skip_topk_offset=2)
    assert Glm5NextConfig.from_hf_dict(d).indexer_types == ["full", "full", "shared", "full", "shared", "full"]
    c = Glm5NextConfig.from_hf_dict(_text(layer_types=["linear_attention", "full_attention"] * 3))
    assert c.layer_types[1] == "indexed_attention"
    cut = Glm5NextConfig.from_hf_dict(Glm5NextConfig.first_layers_hf_dict(_text(), 4))
    assert cut.num_hidden_layers == 4 and cut.indexer_types == ["full"] * 4
    lac = _text(linear_attn_config={"head_dim": 8, "num_heads": 8, "gate_lower_bound": -3.0})
    c = Glm5NextConfig.from_hf_dict(lac)
    assert (c.linear_head_dim, c.linear_num_heads, c.linear_lower_bound) == (8, 8, -3.0)


@pytest.mark.parametrize("over, field", [
    (dict(index_topk=6), "index_topk"),
    (dict(layer_types=["linear_attention", "sliding_attention"] * 3), "layer_types"),
    (dict(mlp_layer_types=["dense", "moe"] * 3), "mlp_layer_types"),
    (dict(indexer_types=["full", "sparse"] * 3), "indexer_types"),
    (dict(indexer_types=["shared"] * 6), "indexer_types"),
    (dict(qk_rope_head_dim=64), "qk_rope_head_dim"),
    (dict(q_lora_rank=None), "q_lora_rank"),
    (dict(hc_mult=0), "hc_mult"),
    (dict(linear_lower_bound=1.0), "linear_lower_bound"),
    (dict(index_kpool=0), "index_kpool"),
    (dict(n_group=3), "n_group"),
])
def test_bad_configs_name_the_field(over, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        Glm5NextConfig.from_hf_dict(_text(**over))


def test_loader_skips_the_vision_tower_with_one_log_line(glm5_next_checkpoint, caplog):  # noqa: F811
    with caplog.at_level(logging.INFO, logger="hyla.models.glm5_next"):
        model = load_model(glm5_next_checkpoint("hc4"))
    assert sum("model.visual" in r.getMessage() for r in caplog.records) == 1
    names = model.state_dict().keys()
    assert "model.language_model.layers.0.self_attn.q_conv1d.weight" in names
    assert "model.language_model.layers.1.self_attn.indexer.index_kpool_compress_gate" in names
    assert "model.language_model.layers.0.hc_attn_fn" in names and not any("visual" in n for n in names)
    assert model.model.language_model.layers[0].hc_attn_base.dtype == torch.float32
