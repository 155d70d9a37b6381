"""hyla.layers.prefix_attention on CUDA (skipped without): the key-blocked form and the one-call
form (bf16: torch's flash kernel with the values padded; fp32: the memory-efficient kernel)
against one call of torch's scaled_dot_product_attention with the lower-right causal bias, at the
Kimi-Linear MLA head shape (32 heads, keys 192 wide, values 128) and awkward block sizes.

Bounds: fp32 1e-5 relative (the kernels' own fp32 accumulation in another order); bf16 2e-2
relative L2 (each block's output is rounded to bf16 before the fp32 merge; a bf16 attention
output carries ~4e-3 of rounding by itself)."""

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import hyla.layers.prefix_attention as pa  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,L,block", [(300, 4096, 1000), (1, 2049, 700), (512, 512, 100)])
def test_key_blocks_equal_one_call_cuda(dtype, T, L, block):
    gen = torch.Generator(device="cuda").manual_seed(T + L)
    H = 32
    q = torch.randn(1, H, T, 192, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(1, H, L, 192, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(1, H, L, 128, device="cuda", dtype=dtype, generator=gen)
    scale = 192 ** -0.5
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=pa.causal_after_prefix(T, L), scale=scale).float()
    cuts = list(range(0, L - T, block)) + [L - T, L]
    blocked = pa.attend_key_blocks(q, ((k[:, :, s:e], v[:, :, s:e]) for s, e in zip(cuts, cuts[1:]) if e > s), scale)
    for got in (blocked, pa.attend_after_prefix(q, k, v, scale)):
        assert got.dtype == dtype and got.shape == want.shape
        err = ((got.float() - want).norm() / want.norm()).item()
        assert err <= (1e-5 if dtype == torch.float32 else 2e-2), err


def test_flash_kernel_in_half_precision():
    """bf16 takes the flash kernel on an sm80+ card, values up to the key width; fp32 does not."""
    q = torch.zeros(1, 1, 8, 192, device="cuda", dtype=torch.bfloat16)
    sm80 = torch.cuda.get_device_capability() >= (8, 0)
    assert pa._flash_fits(q, q[..., :128]) == sm80 and pa._flash_fits(q, q) == sm80
    assert not pa._flash_fits(q.float(), q[..., :128].float()) and not pa._flash_fits(q[..., :64], q[..., :128])
