"""hyla's Qwen3.5 (dense and MoE, causal-LM and multimodal layouts) against transformers 5.24 on
tiny random checkpoints written by transformers itself."""

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyla.models import Qwen3_5ForCausalLM, Qwen3_5MultimodalForCausalLM, load_model
from tests.oracles.paged import greedy_generate
from tests.oracles.qwen3_5_checkpoint import LAYOUTS, VARIANTS, load_qwen3_5_reference
from tests.oracles.qwen3_5_checkpoint import qwen3_5_checkpoint  # noqa: F401  (session fixture)

CASES = [(v, lay) for v in sorted(VARIANTS) for lay in LAYOUTS]


def _ids(seed, shape):
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


def test_oracle_files_hold_the_official_layouts(qwen3_5_checkpoint):
    text = load_file(qwen3_5_checkpoint("dense", "text") / "model.safetensors")
    # GVA: 2 key heads x 16, 4 value heads x 24; q ++ k ++ v = 32 + 32 + 96 rows, not interleaved
    assert text["model.layers.0.linear_attn.in_proj_qkv.weight"].shape == (160, 64)
    assert text["model.layers.0.linear_attn.in_proj_z.weight"].shape == (96, 64)
    assert text["model.layers.0.linear_attn.in_proj_b.weight"].shape == (4, 64)
    assert text["model.layers.0.linear_attn.in_proj_a.weight"].shape == (4, 64)
    assert text["model.layers.1.self_attn.q_proj.weight"].shape == (2 * 4 * 32, 64)  # q and its gate
    assert "model.layers.3.mlp.gate_proj.weight" in text
    # randomised away from transformers' init (zero-centred norms at 0, dt_bias at 1)
    assert (text["model.layers.0.input_layernorm.weight"] != 0).all()
    assert (text["model.layers.0.linear_attn.dt_bias"] != 1).all()

    path = qwen3_5_checkpoint("moe", "multimodal")
    config = json.loads((path / "config.json").read_text())
    mm = load_file(path / "model.safetensors")
    assert config["model_type"] == "qwen3_5_moe" and config["text_config"]["model_type"] == "qwen3_5_moe_text"
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [2, 1, 1]
    assert "model.language_model.layers.0.mlp.experts.15.up_proj.weight" in mm
    assert "model.language_model.layers.0.mlp.shared_expert_gate.weight" in mm
    assert any(k.startswith("model.visual.") for k in mm) and not any(k.startswith("model.layers.") for k in mm)


@pytest.mark.parametrize("variant,layout", CASES)
def test_full_sequence_logits_match_transformers(qwen3_5_checkpoint, variant, layout):
    path = qwen3_5_checkpoint(variant, layout)
    model, ref = load_model(path), load_qwen3_5_reference(path)
    assert type(model) is (Qwen3_5ForCausalLM if layout == "text" else Qwen3_5MultimodalForCausalLM)
    assert model.config.mlp_layer_types == ["sparse" if variant == "moe" else "dense"] * 4
    ids = _ids(0, (2, 70))  # 70 > one 64-token chunk
    with torch.no_grad():
        ours, theirs = model(ids), ref(ids).logits
    assert ours.shape == theirs.shape == (2, 70, 256)
    assert ours.abs().max() > 1.0  # logits are O(1): the tolerance below is meaningful
    assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.mark.parametrize("variant,layout", CASES)
def test_greedy_tokens_match_transformers_generate(qwen3_5_checkpoint, variant, layout):
    """32 greedy tokens through the paged path (chunked varlen prefill, batched decode) equal
    transformers' generate (its own chunk prefill and recurrent decode)."""
    path = qwen3_5_checkpoint(variant, layout)
    model, ref = load_model(path), load_qwen3_5_reference(path)
    prompts = [_ids(1, (5,)).tolist(), _ids(3, (70,)).tolist()]
    ours = greedy_generate(model, prompts, max_new_tokens=32, prefill_chunk=16)
    for prompt, got in zip(prompts, ours):
        ids = torch.tensor([prompt])
        # An explicit all-ones mask: otherwise generate() masks prompt tokens equal to pad_token_id.
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                           eos_token_id=None)
        assert got == out[0, len(prompt):].tolist()


def test_tied_embeddings_follow_the_outer_config(qwen3_5_checkpoint):
    """The multimodal layout ties by the outer `tie_word_embeddings` (as transformers does), the
    text layout by its own."""
    for layout in LAYOUTS:
        moe, dense = load_model(qwen3_5_checkpoint("moe", layout)), load_model(qwen3_5_checkpoint("dense", layout))
        assert moe.lm_head.weight is moe.model.embed_tokens.weight
        assert dense.lm_head.weight is not dense.model.embed_tokens.weight


def test_vision_tower_and_mtp_head_are_skipped(qwen3_5_checkpoint, tmp_path, caplog):
    """The released layout: model.visual.* skipped with one log line; an `mtp.*` head in its own
    shard (as released checkpoints store it) skipped too; the text weights load unchanged."""
    src = qwen3_5_checkpoint("dense", "multimodal")
    dst = tmp_path / "with-mtp"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    mtp = {"mtp.fc.weight": torch.randn(64, 128), "mtp.norm.weight": torch.randn(64)}
    save_file(mtp, dst / "model-mtp.safetensors", metadata={"format": "pt"})
    weight_map = {**{k: "model.safetensors" for k in tensors}, **{k: "model-mtp.safetensors" for k in mtp}}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with caplog.at_level(logging.INFO, logger="hyla.models"):
        model = load_model(dst)
    assert len([r for r in caplog.records if "model.visual" in r.getMessage()]) == 1
    sd = model.state_dict()
    assert not any(k.startswith(("mtp.", "model.visual.")) for k in sd)
    name = "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"
    assert torch.equal(sd[name], tensors[name])


def test_bf16_is_as_close_to_fp64_as_transformers_bf16(qwen3_5_checkpoint):
    """bf16 weights: A_log, dt_bias and the router stay fp32, the shared-expert gate does not;
    the logits are as close to the fp64 model's as transformers' own bf16 logits are."""
    from transformers import Qwen3_5MoeForConditionalGeneration as HFModel

    path = qwen3_5_checkpoint("moe", "multimodal")
    model = load_model(path, dtype="bfloat16")
    gdn, moe = model.model.layers[0].linear_attn, model.model.layers[0].mlp
    assert model.dtype == gdn.in_proj_qkv.weight.dtype == moe.shared_expert_gate.weight.dtype == torch.bfloat16
    assert gdn.A_log.dtype == gdn.dt_bias.dtype == moe.gate.weight.dtype == torch.float32
    ids = torch.arange(80).reshape(2, 40) * 5 % 256
    with torch.no_grad():
        exact = load_model(path, dtype="float64")(ids).double()
        ours = model(ids).double()
        theirs = HFModel.from_pretrained(path, dtype=torch.bfloat16)(ids).logits.double()
    assert (ours - exact).norm() <= 1.5 * (theirs - exact).norm()
