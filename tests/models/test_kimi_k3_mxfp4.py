"""MXFP4 experts (compressed-tensors `weight_packed` U8 + `weight_scale` E8M0, groups of 32): a
tiny K3 checkpoint whose experts this test packs itself loads and equals the model built from the
same weights stored dequantised as plain `.weight` tensors; sharded checkpoints work too."""

import json

import pytest
import torch
from safetensors.torch import save_file

from hyla.models import load_model
from hyla.models.mxfp4 import dequantize_mxfp4
from tests.oracles.kimi_k3_checkpoint import config_dict, per_expert, random_state, write_checkpoint

torch.set_num_threads(1)

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (weight_packed [N, K/2] u8, weight_scale [N, K/32] u8, the dequantised [N, K]),
    as compressed-tensors' MXFP4 compressor: group exponent floor(log2(amax)) - 2 (6 = 1.5 * 2^2),
    nearest E2M1 magnitude, sign in bit 3, even column in the low nibble."""
    groups = w.unflatten(-1, (-1, 32))
    exp = torch.floor(torch.log2(groups.abs().amax(-1))) - 2  # [N, K/32]
    x = groups / torch.exp2(exp)[..., None]
    mag = (x.abs()[..., None] - E2M1).abs().argmin(-1)  # [N, K/32, 32]
    codes = (mag | (torch.signbit(x).long() << 3)).flatten(-2)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    value = (E2M1[mag] * torch.where(torch.signbit(x), -1.0, 1.0) * torch.exp2(exp)[..., None]).flatten(-2)
    return packed, (exp + 127).to(torch.uint8), value


def test_dequantize_known_bytes():
    # byte 0x21: low nibble 1 (0.5) first, high nibble 2 (1.0); 0xF8: -0.0 then -6.0 (bit 3 = sign)
    packed = torch.tensor([[0x21, 0xF8] + [0] * 14, [0x77] * 16], dtype=torch.uint8)
    scale = torch.tensor([[127], [125]], dtype=torch.uint8)  # 2^0, 2^-2
    w = dequantize_mxfp4(packed, scale)
    assert w.shape == (2, 32)
    assert w[0, :4].tolist() == [0.5, 1.0, -0.0, -6.0] and torch.signbit(w[0, 2])
    assert torch.equal(w[1], torch.full((32,), 1.5))
    with pytest.raises(ValueError, match="one exponent per 32"):
        dequantize_mxfp4(packed, torch.zeros(2, 2, dtype=torch.uint8))


def pack_experts(state: dict) -> tuple[dict, dict]:
    """A per-expert state dict -> (the same with every expert weight as MXFP4 weight_packed /
    weight_scale, the same with every expert weight replaced by its dequantised value)."""
    plain, packed = {}, {}
    for name, t in state.items():
        if ".experts." in name:
            q, s, value = quantize(t)
            base = name[: -len(".weight")]
            packed[base + ".weight_packed"], packed[base + ".weight_scale"] = q, s
            plain[name] = value
        else:
            plain[name] = packed[name] = t
    return packed, plain


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(MXFP4 checkpoint, sharded MXFP4 checkpoint, plain checkpoint with the dequantised experts)."""
    root = tmp_path_factory.mktemp("k3-mxfp4")
    config = config_dict()
    packed, plain = pack_experts(per_expert(random_state(config, 3)))
    quant = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
             "config_groups": {"experts": {"targets": ["re:.*experts.*"], "weights": {"num_bits": 4, "type": "float",
                                                                                        "group_size": 32}}}}
    mx_config = {**config, "quantization_config": quant}
    mx = write_checkpoint(root / "mxfp4", mx_config, packed, with_tokenizer=False)
    ref = write_checkpoint(root / "plain", config, plain, with_tokenizer=False)
    sharded = root / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps(mx_config))
    first = [n for n in packed if ".layers.0." in n or ".layers.1." in n]
    halves = {"a.safetensors": first, "b.safetensors": [n for n in packed if n not in first]}
    for file, part in halves.items():
        save_file({n: packed[n] for n in part}, str(sharded / file), metadata={"format": "pt"})
    index = {"weight_map": {n: f for f, part in halves.items() for n in part}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    return mx, sharded, ref


def test_a_pair_split_over_shards_is_named(checkpoints, tmp_path):
    _, sharded, _ = checkpoints
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    scale = next(n for n in index["weight_map"] if n.endswith("weight_scale"))
    index["weight_map"][scale] = "b.safetensors" if index["weight_map"][scale] == "a.safetensors" else "a.safetensors"
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(sharded, broken)
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="different shards"):
        load_model(broken)


def test_mxfp4_experts_equal_dequantised_weights(checkpoints):
    mx, sharded, ref = checkpoints
    ids = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = load_model(ref, dtype=torch.float32)(ids)
        for path in (mx, sharded):
            model = load_model(path, dtype=torch.float32)
            assert torch.equal(model(ids), want)
    sd = model.state_dict()
    w13 = sd["language_model.model.layers.1.block_sparse_moe.experts.gate_up_proj"]
    assert w13.shape == (8, 64, 32) and w13.dtype == torch.float32
