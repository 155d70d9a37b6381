"""Qwen3.5 config.json parsing (both layouts), the loader's dispatch, bad configs, parameter
counts against transformers, and the released-shape random model."""

import copy

import pytest
import torch

from hyla.bench.random_models import QWEN3_5_35B, model_config, random_config_dict
from hyla.models import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5MoeConfig, load_config, load_model, memory_report
from hyla.models.memory import parameter_counts
from tests.oracles.qwen3_5_checkpoint import qwen3_5_checkpoint  # noqa: F401  (session fixture)

# The released multimodal layout of the 35B-A3B shape: its text model under text_config.
RELEASED_35B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
    "text_config": dict(QWEN3_5_35B, model_type="qwen3_5_moe_text"), "tie_word_embeddings": False,
    "vision_config": {"model_type": "qwen3_5_moe", "depth": 27, "hidden_size": 1152, "out_hidden_size": 2048},
    "image_token_id": 248056, "video_token_id": 248057,
}
for key in ("architectures", "dtype"):
    RELEASED_35B["text_config"].pop(key)
RELEASED_35B["dtype"] = "bfloat16"


def test_released_layout_config_and_memory_report():
    c = Qwen3_5MoeConfig.from_hf_dict(RELEASED_35B)
    assert c.model_type == "qwen3_5_moe" and c.multimodal and c.dtype == "bfloat16"
    assert c.attention_layers == list(range(3, 40, 4)) and len(c.linear_layers) == 30
    assert c.mlp_layer_types == ["sparse"] * 40 and c.norm_topk_prob
    assert (c.num_experts, c.num_experts_per_tok, c.rope_theta, c.rotary_dim) == (256, 8, 10000000, 64)
    assert c.mrope_section == [11, 11, 10]
    r = memory_report(c, torch.bfloat16, torch.float32)
    assert r.recurrent_state_bytes_per_request == 30 * 32 * 128 * 128 * 4
    assert r.conv_state_bytes_per_request == 30 * 8192 * 3 * 2
    assert r.kv_bytes_per_token == 10 * 2 * 2 * 256 * 2
    assert "30 GDN + 10 GQA" in str(r)
    text = Qwen3_5MoeConfig.from_hf_dict(QWEN3_5_35B)
    assert text.model_type == "qwen3_5_moe_text" and not text.multimodal
    assert parameter_counts(text) == parameter_counts(c)


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_parameter_count_equals_transformers_model_on_meta(moe):
    """transformers' defaults (Qwen3_5MoeTextConfig names Qwen/Qwen3.5-35B-A3B); hyla reads an empty
    config.json with the same defaults."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    hf_config, hf_model = (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM) if moe else (Qwen3_5TextConfig,
                                                                                     Qwen3_5ForCausalLM)
    with torch.device("meta"):
        ref = hf_model(hf_config())
    want = sum(t.numel() for t in ref.state_dict().values())
    ours = (Qwen3_5MoeConfig if moe else Qwen3_5Config).from_hf_dict(
        {"model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text"})
    main, fp32 = parameter_counts(ours)
    assert main + fp32 == want
    if moe:
        assert 34e9 < want < 36e9  # "35B-A3B"


@pytest.mark.parametrize("variant,layout", [("dense", "text"), ("moe", "multimodal")])
def test_loaded_model_counts_and_dispatch(qwen3_5_checkpoint, variant, layout):
    path = qwen3_5_checkpoint(variant, layout)
    c = load_config(path)
    assert type(c) is (Qwen3_5MoeConfig if variant == "moe" else Qwen3_5Config)
    assert c.model_type == {"text": "qwen3_5_text", "multimodal": "qwen3_5_moe"}[layout]
    model = load_model(path)
    main, fp32 = parameter_counts(model.config)
    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}  # tied once
    assert main + fp32 == sum(t.numel() for t in unique.values())


def _bad(edit):
    d = copy.deepcopy(RELEASED_35B)
    edit(d)
    return d


@pytest.mark.parametrize("edit,field", [
    (lambda d: d.pop("text_config"), "text_config"),
    (lambda d: d["text_config"].update(model_type="qwen3_5_text"), "text_config.model_type"),
    (lambda d: d["text_config"]["rope_parameters"].update(mrope_section=[11, 11]), "mrope_section"),
    (lambda d: d["text_config"]["rope_parameters"].update(rope_type="yarn"), "RoPE type"),
    (lambda d: d["text_config"].update(hidden_act="gelu"), "hidden_act"),
    (lambda d: d["text_config"].update(linear_num_value_heads=24, linear_num_key_heads=16), "linear_num_value_heads"),
    (lambda d: d["text_config"].update(num_experts_per_tok=300), "num_experts_per_tok"),
    (lambda d: d.update(model_type="qwen3_5"), "model_type"),
])
def test_bad_configs_name_the_field(edit, field):
    with pytest.raises(ValueError, match=field):
        Qwen3_5MoeConfig.from_hf_dict(_bad(edit))


def test_defaults_and_outer_keys_of_the_multimodal_layout():
    d = {"model_type": "qwen3_5", "tie_word_embeddings": True, "eos_token_id": 7, "dtype": "bfloat16",
         "text_config": {"num_hidden_layers": 8, "tie_word_embeddings": False, "eos_token_id": 9}}
    c = Qwen3_5Config.from_hf_dict(d)
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_key_value_heads) == (248320, 4096, 12288, 4)
    assert c.mlp_layer_types == ["dense"] * 8 and c.attention_layers == [3, 7]
    assert c.tie_word_embeddings and c.eos_token_id == 9 and c.dtype == "bfloat16"  # the outer flag ties
    d.pop("tie_word_embeddings")
    assert not Qwen3_5Config.from_hf_dict(d).tie_word_embeddings  # transformers' outer default


def test_released_shape_random_model_first_layers():
    cut = Qwen3_5MoeConfig.first_layers_hf_dict(RELEASED_35B, 4)
    assert cut["text_config"]["num_hidden_layers"] == 4 and RELEASED_35B["text_config"]["num_hidden_layers"] == 40
    c = model_config("qwen3.5-35b-a3b", layers=4)
    assert c.layer_types == ["linear_attention"] * 3 + ["full_attention"] and c.mlp_layer_types == ["sparse"] * 4
    assert random_config_dict("qwen3.5-35b-a3b")["num_hidden_layers"] == 40
    with torch.device("meta"):
        small = Qwen3_5ForCausalLM(model_config("qwen3.5-35b-a3b", layers=1))
    assert small.model.layers[0].linear_attn.in_proj_qkv.weight.shape == (8192, 2048)
    assert small.model.layers[0].mlp.experts.gate_up_proj.shape == (256, 1024, 2048)
