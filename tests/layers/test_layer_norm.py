import torch

from hyla.layers import GatedRMSNorm, RMSNorm


def test_rms_norm_rounds_before_weight_like_transformers():
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNorm

    ours, ref = RMSNorm(48, eps=1e-5), KimiLinearRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(48))
        ref.weight.copy_(ours.weight)
    x = torch.randn(4, 48).bfloat16()
    ours, ref = ours.bfloat16(), ref.bfloat16()
    assert torch.equal(ours(x), ref(x))


def test_gated_rms_norm_matches_transformers():
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNormGated

    ours, ref = GatedRMSNorm(16, eps=1e-5), KimiLinearRMSNormGated(16, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(16))
        ref.weight.copy_(ours.weight)
    x, g = torch.randn(3, 5, 2, 16), torch.randn(3, 5, 2, 16)
    assert torch.allclose(ours(x, g), ref(x, g), atol=1e-6, rtol=0)
