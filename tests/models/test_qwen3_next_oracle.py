"""hyla's Qwen3-Next against transformers' Qwen3NextForCausalLM on tiny random checkpoints."""

import json

import pytest
import torch
from safetensors.torch import load_file

from hyla.models import Qwen3NextForCausalLM, load_model
from tests.oracles.paged import greedy_generate
from tests.oracles.qwen3_next_checkpoint import VARIANTS, load_qwen3_next_reference


def _ids(seed, shape):
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


def test_oracle_files_hold_the_official_layout(qwen3_next_checkpoint):
    path = qwen3_next_checkpoint("moe")
    config = json.loads((path / "config.json").read_text())
    t = load_file(path / "model.safetensors")
    assert config["model_type"] == "qwen3_next"
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    # GVA: 2 key heads x 16, 4 value heads x 24; in_proj_qkvz = 2 * 32 + 2 * 96 rows, conv over 32 + 32 + 96
    assert t["model.layers.0.linear_attn.in_proj_qkvz.weight"].shape == (256, 64)
    assert t["model.layers.0.linear_attn.in_proj_ba.weight"].shape == (8, 64)
    assert t["model.layers.0.linear_attn.conv1d.weight"].shape == (160, 1, 4)
    assert t["model.layers.0.linear_attn.A_log"].shape == (4,)
    assert t["model.layers.3.self_attn.q_proj.weight"].shape == (2 * 4 * 32, 64)  # q and its gate
    assert "model.layers.0.mlp.gate_proj.weight" in t and "model.layers.1.mlp.experts.3.up_proj.weight" in t
    assert "model.layers.1.mlp.shared_expert_gate.weight" in t
    # randomised away from transformers' init (zero-centred norms at 0, dt_bias at 1)
    assert (t["model.layers.0.input_layernorm.weight"] != 0).all()
    assert (t["model.layers.0.linear_attn.dt_bias"] != 1).all()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_full_sequence_logits_match_transformers(qwen3_next_checkpoint, variant):
    path = qwen3_next_checkpoint(variant)
    model, ref = load_model(path), load_qwen3_next_reference(path)
    assert isinstance(model, Qwen3NextForCausalLM)
    ids = _ids(0, (2, 70))  # 70 > one 64-token chunk
    with torch.no_grad():
        ours, theirs = model(ids), ref(ids).logits
    assert ours.shape == theirs.shape == (2, 70, 256)
    assert ours.abs().max() > 1.0  # logits are O(1): the tolerance below is meaningful
    assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_tokens_match_transformers_generate(qwen3_next_checkpoint, variant):
    """32 greedy tokens through the paged path (chunked varlen prefill, batched decode) equal
    transformers' generate (its own chunk prefill and recurrent decode)."""
    path = qwen3_next_checkpoint(variant)
    model, ref = load_model(path), load_qwen3_next_reference(path)
    prompts = [_ids(1, (5,)).tolist(), _ids(2, (37,)).tolist(), _ids(3, (70,)).tolist()]
    ours = greedy_generate(model, prompts, max_new_tokens=32, prefill_chunk=16)
    for prompt, got in zip(prompts, ours):
        ids = torch.tensor([prompt])
        # An explicit all-ones mask: otherwise generate() masks prompt tokens equal to pad_token_id.
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                           eos_token_id=None)
        assert got == out[0, len(prompt):].tolist()


def test_tied_embeddings(qwen3_next_checkpoint):
    model = load_model(qwen3_next_checkpoint("dense"))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_bf16_is_as_close_to_fp64_as_transformers_bf16(qwen3_next_checkpoint):
    """bf16 weights: A_log, dt_bias and the router stay fp32, the shared-expert gate does not;
    the logits are as close to the fp64 model's as transformers' own bf16 logits are."""
    from transformers import Qwen3NextForCausalLM as HFModel

    path = qwen3_next_checkpoint("moe")
    model = load_model(path, dtype="bfloat16")
    gdn, moe = model.model.layers[0].linear_attn, model.model.layers[1].mlp
    assert model.dtype == gdn.in_proj_qkvz.weight.dtype == moe.shared_expert_gate.weight.dtype == torch.bfloat16
    assert gdn.A_log.dtype == gdn.dt_bias.dtype == moe.gate.weight.dtype == torch.float32
    ids = torch.arange(80).reshape(2, 40) * 5 % 256
    with torch.no_grad():
        exact = load_model(path, dtype="float64")(ids).double()
        ours = model(ids).double()
        theirs = HFModel.from_pretrained(path, dtype=torch.bfloat16)(ids).logits.double()
    assert (ours - exact).norm() <= 1.5 * (theirs - exact).norm()
