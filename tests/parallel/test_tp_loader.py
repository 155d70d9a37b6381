"""The loader's per-rank slicing (no process group: loading runs no collective): a checkpoint with
per-expert tensors and one with the stacked expert tensors give every rank the same shard, and a
rank's packed GDN conv channels are its 1/N of q, of k and of v."""

import pytest
import torch
from safetensors.torch import save_file

from hyla.models import load_config, load_model
from hyla.parallel.plans import make_plan
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint
from tests.oracles.qwen3_next_checkpoint import build_qwen3_next_checkpoint


def _stacked_copy(src, dst):
    """src re-written with hyla's own names: experts as experts.gate_up_proj / down_proj stacks."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = {k: v.contiguous().clone() for k, v in load_model(src).state_dict().items()}
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    assert any(k.endswith("experts.gate_up_proj") for k in tensors)
    return dst


@pytest.mark.parametrize("family", ["kimi", "qwen3_next"])
@pytest.mark.parametrize("ep", [False, True], ids=["tensor", "expert"])
def test_per_expert_and_stacked_checkpoints_shard_alike(tmp_path, family, ep):
    src = build_kimi_checkpoint(tmp_path, "moe") if family == "kimi" else build_qwen3_next_checkpoint(tmp_path, "moe")
    stacked = _stacked_copy(src, tmp_path / "stacked")
    model_type = load_config(src).model_type
    for rank in range(2):
        a = load_model(src, shard=make_plan(model_type, rank, 2, None, ep)).state_dict()
        b = load_model(stacked, shard=make_plan(model_type, rank, 2, None, ep)).state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_gdn_conv_channels_and_expert_rows(tmp_path):
    path = build_qwen3_next_checkpoint(tmp_path, "moe")
    full = load_model(path).state_dict()
    c = load_config(path)
    hk, hv = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    conv = next(k for k in full if k.endswith("linear_attn.conv1d.weight"))
    gate_up = next(k for k in full if k.endswith("experts.gate_up_proj"))
    i = c.moe_intermediate_size
    for rank in range(2):
        shard = load_model(path, shard=make_plan(c.model_type, rank, 2)).state_dict()
        q, k, v = full[conv].split([hk, hk, hv])
        halves = [t.chunk(2)[rank] for t in (q, k, v)]
        assert torch.equal(shard[conv], torch.cat(halves))
        gate, up = full[gate_up].split([i, i], dim=1)
        assert torch.equal(shard[gate_up], torch.cat([gate.chunk(2, 1)[rank], up.chunk(2, 1)[rank]], dim=1))
