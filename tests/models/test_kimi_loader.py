"""Checkpoint loading: official names, sharded index, dtypes, and errors that name the problem."""

import json
import re
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
            "model.layers.1.block_sparse_moe.experts.gate_up_proj",
            "model.layers.1.block_sparse_moe.gate.e_score_correction_bias"} <= keys
    assert model.model.layers[0].self_attn.A_log.shape == (1, 1, 2, 1)
    # transformers saves the dense layer 0 MLP as block_sparse_moe.*; hyla names it mlp.* (released
    # name). Per-expert tensors experts.{e}.w1/w3/w2 fill the stacked experts.gate_up_proj / down_proj.
    saved = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp.") for k in load_file(path / "model.safetensors")}
    stacked = {re.sub(r"experts\.\d+\.w[13]\.weight$", "experts.gate_up_proj", k) for k in saved}
    stacked = {re.sub(r"experts\.\d+\.w2\.weight$", "experts.down_proj", k) for k in stacked}
    assert keys == stacked


def test_stacked_experts_hold_the_per_expert_tensors(kimi_checkpoint):
    path = kimi_checkpoint("moe")
    tensors = load_file(path / "model.safetensors")
    experts = load_model(path).model.layers[1].block_sparse_moe.experts
    I = experts.down_proj.shape[2]
    for e in range(experts.num_experts):
        pre = f"model.layers.1.block_sparse_moe.experts.{e}."
        assert torch.equal(experts.gate_up_proj[e, :I], tensors[pre + "w1.weight"])
        assert torch.equal(experts.gate_up_proj[e, I:], tensors[pre + "w3.weight"])
        assert torch.equal(experts.down_proj[e], tensors[pre + "w2.weight"])


@pytest.mark.parametrize("prefix", ["block_sparse_moe", "mlp"])
def test_fused_expert_tensors_load(kimi_checkpoint, tmp_path, prefix):
    """hyla's own state_dict (stacked experts), and the same under transformers' in-memory `mlp.`
    prefix, load to the same model."""
    src = kimi_checkpoint("moe")
    model = load_model(src)
    state = {k.replace("block_sparse_moe.", f"{prefix}."): v.contiguous() for k, v in model.state_dict().items()}
    dst = tmp_path / "fused"
    dst.mkdir()
    save_file(state, dst / "model.safetensors")
    shutil.copy(src / "config.json", dst / "config.json")
    assert torch.equal(_logits(load_model(dst)), _logits(model))


def test_missing_expert_is_named(kimi_checkpoint, tmp_path):
    src = kimi_checkpoint("moe")
    drop = lambda t: {k: v for k, v in t.items() if "experts.5.w3" not in k}  # noqa: E731
    dst = _copy(src, tmp_path / "no-expert", drop)
    with pytest.raises(ValueError, match=r"experts.gate_up_proj \(experts \[5\]\)"):
        load_model(dst)


def test_expert_piece_with_wrong_shape_is_named(kimi_checkpoint, tmp_path):
    src = kimi_checkpoint("moe")

    def edit(t):
        name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
        t[name] = t[name][:, :-1].contiguous()
        return t
    with pytest.raises(ValueError, match="shape mismatch for model.layers.1.block_sparse_moe.experts.2.w2.weight"):
        load_model(_copy(src, tmp_path / "bad-shape", edit))


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
