"""MoE and router against transformers' KimiLinearMoE with the same weights."""

import pytest
import torch

from hyla.layers import MoE


def _pair(n_group, topk_group, top_k, shared, renorm):
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE

    torch.manual_seed(0)
    cfg = KimiLinearConfig(hidden_size=24, moe_intermediate_size=8, num_local_experts=16, num_experts_per_tok=top_k,
                           n_shared_experts=shared, n_group=n_group, topk_group=topk_group, norm_topk_prob=renorm,
                           routed_scaling_factor=2.5, vocab_size=32, num_hidden_layers=1)
    ours = MoE(24, 8, 16, top_k, num_shared_experts=shared, num_group=n_group, topk_group=topk_group,
               renormalize=renorm, routed_scaling_factor=2.5)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        ours.gate.e_score_correction_bias.copy_(torch.randn(16) * 0.2)
    ref = KimiLinearMoE(cfg)
    with torch.no_grad():
        ref.gate.weight.copy_(ours.gate.weight)
        ref.gate.e_score_correction_bias.copy_(ours.gate.e_score_correction_bias)
        ref.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)  # the same stacked layout
        ref.experts.down_proj.copy_(ours.experts.down_proj)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ref.shared_experts, name).weight.copy_(getattr(ours.shared_experts, name).weight)
    return ours, ref


@pytest.mark.parametrize("n_group,topk_group,top_k,renorm", [(1, 1, 2, True), (4, 2, 3, True), (4, 1, 2, False)])
def test_moe_equals_transformers(n_group, topk_group, top_k, renorm):
    ours, ref = _pair(n_group, topk_group, top_k, 1, renorm)
    x = torch.randn(3, 11, 24)
    with torch.no_grad():
        assert torch.allclose(ours(x), ref(x), atol=1e-5, rtol=0)
        w, ids = ours.gate(x.view(-1, 24))
        _, w_ref, ids_ref = ref.gate(x)
    order, order_ref = ids.sort(-1), ids_ref.sort(-1)
    assert torch.equal(order.values, order_ref.values)
    assert torch.allclose(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices), atol=1e-6)


def test_experts_come_from_selected_groups():
    ours, _ = _pair(4, 2, 3, 1, True)
    x = torch.randn(50, 24)
    with torch.no_grad():
        _, ids = ours.gate(x)
    groups = ids // 4
    assert all(len(set(row)) <= 2 for row in groups.tolist())


def test_no_shared_experts():
    moe = MoE(24, 8, 4, 2, num_shared_experts=0)
    assert moe.shared_experts is None
    assert moe(torch.randn(5, 24)).shape == (5, 24)


def _stacking_check(block, x):
    """prepare_for_inference stacks the shared expert as expert E: same output (fp64: only the
    order of a few adds changes), same state_dict names, shapes and values."""
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        want = block(x)
        before = {k: v.clone() for k, v in block.state_dict().items()}
        block.prepare_for_inference()
        got = block(x)
    assert block.shared_stacked
    after = block.state_dict()
    assert list(after) == list(before)
    assert all(after[k].shape == before[k].shape and torch.equal(after[k], before[k]) for k in before)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_shared_expert_stacked_kimi():
    torch.manual_seed(1)
    block = MoE(24, 8, 16, 3, num_shared_experts=1, num_group=4, topk_group=2, routed_scaling_factor=2.5).double()
    _stacking_check(block, torch.randn(2, 7, 24, dtype=torch.float64))


def test_shared_expert_stacked_qwen():
    from hyla.layers import Qwen3NextSparseMoE

    torch.manual_seed(2)
    block = Qwen3NextSparseMoE(24, 8, 16, 4, shared_expert_intermediate_size=8).double()
    _stacking_check(block, torch.randn(9, 24, dtype=torch.float64))


def test_shared_expert_of_another_width_stays_separate():
    block = MoE(24, 8, 4, 2, num_shared_experts=2)
    block.prepare_for_inference()
    assert not block.shared_stacked
    assert block(torch.randn(5, 24)).shape == (5, 24)


def test_stacked_shared_expert_survives_a_move():
    """After prepare_for_inference, .to() re-creates the parameters: the views are gone, and the
    block falls back to the separate shared expert with the moved weights (same output)."""
    torch.manual_seed(3)
    block = MoE(24, 8, 16, 3, num_shared_experts=1).double()
    x = torch.randn(6, 24, dtype=torch.float64)
    with torch.no_grad():
        want = block(x)
        block.prepare_for_inference()
        assert block.experts.shared_is_stacked()
        block.to(torch.float32)
        assert not block.experts.shared_is_stacked()
        got = block(x.float())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
