"""Checkpoint loading: official names, sharded index, dtypes, and errors that name the problem."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyla.models import load_model


def _copy(src, dst, edit=None, config_edit=None):
    """Copy checkpoint `src` to `dst`, passing its tensors / config through the edit functions."""
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    if edit:
        tensors = edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _logits(model):
    ids = torch.arange(40).reshape(2, 20) * 5 % 256
    with torch.no_grad():
        return model(ids)


def test_official_names_are_the_state_dict(kimi_checkpoint):
    path = kimi_checkpoint("moe")
    model = load_model(path)
    keys = set(model.state_dict())
    assert {"model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.self_attn.f_a_proj.weight",
            "model.layers.1.block_sparse_moe.experts.3.w1.weight",
            "model.layers.1.block_sparse_moe.gate.e_score_correction_bias"} <= keys
    assert model.model.layers[0].self_attn.A_log.shape == (1, 1, 2, 1)
    # transformers saves the dense layer 0 MLP as block_sparse_moe.*; hyla names it mlp.* (released name)
    saved = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp.") for k in load_file(path / "model.safetensors")}
    assert keys == saved


def test_dense_mlp_under_its_released_name(kimi_checkpoint, tmp_path):
    """The released checkpoints name a dense layer's MLP `mlp.`; transformers saves `block_sparse_moe.`."""
    src = kimi_checkpoint("moe")
    rename = lambda t: {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in t.items()}  # noqa: E731
    dst = _copy(src, tmp_path / "renamed", rename)
    assert torch.equal(_logits(load_model(dst)), _logits(load_model(src)))


def test_sharded_index(kimi_checkpoint, tmp_path):
    src = kimi_checkpoint("dense")
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    dst = tmp_path / "sharded"
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, dst / shard)
        weight_map.update({n: shard for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert torch.equal(_logits(load_model(dst)), _logits(load_model(src)))


def test_bf16_keeps_gate_and_router_in_fp32(kimi_checkpoint):
    path = kimi_checkpoint("moe")
    model = load_model(path, dtype="bfloat16")
    attn, moe = model.model.layers[0].self_attn, model.model.layers[1].block_sparse_moe
    assert model.dtype == torch.bfloat16 and attn.q_proj.weight.dtype == torch.bfloat16
    assert attn.A_log.dtype == attn.dt_bias.dtype == torch.float32
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    # Random tiny models amplify bf16 rounding (and routing flips): judge against transformers' bf16.
    from transformers import KimiLinearForCausalLM

    ref = _logits(load_model(path))
    with torch.no_grad():
        hf = KimiLinearForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        hf_bf16 = hf(torch.arange(40).reshape(2, 20) * 5 % 256).logits.float()
    assert (_logits(model) - ref).norm() <= 1.5 * (hf_bf16 - ref).norm()


def test_tied_embeddings(kimi_checkpoint, tmp_path):
    def drop_head(t):
        t = dict(t)
        t.pop("lm_head.weight")
        return t

    dst = _copy(kimi_checkpoint("dense"), tmp_path / "tied", drop_head, lambda c: c.update(tie_word_embeddings=True))
    model = load_model(dst)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("edit,match", [
    (lambda t: {k: v for k, v in t.items() if k != "model.layers.2.self_attn.dt_bias"},
     r"missing tensors.*model\.layers\.2\.self_attn\.dt_bias"),
    (lambda t: {**t, "model.layers.0.self_attn.bogus": torch.zeros(2)},
     r"unexpected tensors.*model\.layers\.0\.self_attn\.bogus"),
    (lambda t: {**t, "model.layers.0.self_attn.A_log": torch.zeros(2)},
     r"shape mismatch for model\.layers\.0\.self_attn\.A_log: checkpoint \[2\], model expects \[1, 1, 2, 1\]"),
])
def test_tensor_errors_name_the_tensor(kimi_checkpoint, tmp_path, edit, match):
    dst = _copy(kimi_checkpoint("moe"), tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=match):
        load_model(dst)


@pytest.mark.parametrize("config_edit,match", [
    (lambda c: c.update(model_type="llama"), "unknown model_type 'llama'"),
    (lambda c: c.update(num_experts_per_token=9), "num_experts_per_token"),
    (lambda c: c["linear_attn_config"].update(gate_lower_bound=0.5), "gate_lower_bound"),
])
def test_config_errors(kimi_checkpoint, tmp_path, config_edit, match):
    dst = _copy(kimi_checkpoint("moe"), tmp_path / "bad", config_edit=config_edit)
    with pytest.raises(ValueError, match=match):
        load_model(dst)


def test_no_pickle(tmp_path, kimi_checkpoint):
    dst = tmp_path / "pickle"
    dst.mkdir()
    shutil.copy(kimi_checkpoint("dense") / "config.json", dst / "config.json")
    (dst / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match="pickle checkpoints are not loaded"):
        load_model(dst)
