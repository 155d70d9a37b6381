"""Qwen3-Next's sparse MoE block against transformers' Qwen3NextSparseMoeBlock (fused expert
tensors copied into hyla's per-expert MLPs)."""

import torch

from hyla.layers import Qwen3NextSparseMoE


def test_equals_transformers_block():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    cfg = Qwen3NextConfig(hidden_size=32, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=20,
                          shared_expert_intermediate_size=24, norm_topk_prob=False, num_hidden_layers=1)
    torch.manual_seed(0)
    ref = Qwen3NextSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ours = Qwen3NextSparseMoE(32, 20, 6, 3, 24, norm_topk_prob=False)
    with torch.no_grad():
        ours.gate.weight.copy_(ref.gate.weight)
        ours.shared_expert_gate.weight.copy_(ref.shared_expert_gate.weight)
        ours.shared_expert.load_state_dict(ref.shared_expert.state_dict())
        ours.experts.gate_up_proj.copy_(ref.experts.gate_up_proj)
        ours.experts.down_proj.copy_(ref.experts.down_proj)
        x = torch.randn(2, 9, 32)
        want = ref(x)
        got = ours(x)
    assert (got - want).abs().max() <= 1e-5 and want.abs().max() > 0.1
    ours.gate.norm_topk_prob = True
    with torch.no_grad():
        weights, ids = ours.gate(x.reshape(-1, 32))
    assert torch.allclose(weights.sum(-1), torch.ones(18)) and ids.shape == (18, 3)
