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
    assert pa.flash_fits(q, 128) == sm80 and pa.flash_fits(q, 192) == sm80
    assert not pa.flash_fits(q.float(), 128) and not pa.flash_fits(q[..., :64], 128)


def test_mla_grouped_prefill_bf16_equals_its_full_forward():
    """MLA's engine prefill on CUDA in bf16 (flash with views of the expansion: strided queries,
    keys and values) for several prompts after cached prefixes equals the layer's whole-sequence
    forward in fp32 of the same weights, to bf16's rounding (2e-2 relative L2)."""
    from hyla.contract import ForwardBatch, MLALayerCache
    from hyla.layers import MLAAttention

    torch.manual_seed(0)
    layer = MLAAttention(256, 4, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    ref_layer = layer.float().cuda()
    layer = MLAAttention(256, 4, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    layer.load_state_dict(ref_layer.state_dict())
    layer = layer.to("cuda", torch.bfloat16)
    page = 16
    lens = [(37, 100), (0, 64), (300, 29), (16, 1)]  # (cached, new)
    tables, first = [], 0
    for ctx, new in lens:
        n = -(-(ctx + new) // page)
        tables.append(list(range(first, first + n)))
        first += n
    cache = MLALayerCache(torch.zeros(first, page, 576, device="cuda", dtype=torch.bfloat16))
    xs = [torch.randn(ctx + new, 256, device="cuda") for ctx, new in lens]
    with torch.no_grad():
        prefix = [n for n, (ctx, _) in enumerate(lens) if ctx]
        layer.forward_batch(torch.cat([xs[n][:lens[n][0]] for n in prefix]).bfloat16(),
                            ForwardBatch.build([lens[n][0] for n in prefix], [0] * len(prefix),
                                               [tables[n] for n in prefix], prefix, device="cuda"), cache)
        batch = ForwardBatch.build([new for _, new in lens], [ctx for ctx, _ in lens], tables,
                                   list(range(len(lens))), device="cuda")
        y = layer.forward_batch(torch.cat([x[ctx:] for x, (ctx, _) in zip(xs, lens)]).bfloat16(), batch, cache)
        start = 0
        for x, (ctx, new) in zip(xs, lens):
            want = ref_layer(x[None])[0, ctx:]
            err = ((y[start:start + new].float() - want).norm() / want.norm()).item()
            assert err <= 2e-2, (ctx, new, err)
            start += new


@pytest.mark.parametrize("T", [1000, 1500, 2048])
@pytest.mark.parametrize("strided", [False, True])
def test_fresh_causal_attention_through_cudnn_buckets(T, strided):
    """A plain causal call from CUDNN_MIN_TOKENS queries (cuDNN over rows padded to a bucket;
    below it, flash) equals torch's sdpa to bf16's rounding (2e-2 relative L2); strided: keys and
    values are views of one [T, H, 384] buffer, as MLA's padded expansion hands them (at 2,048 no
    rows are padded, so cuDNN reads the views themselves)."""
    gen = torch.Generator(device="cuda").manual_seed(T)
    q = torch.randn(1, 8, T, 192, device="cuda", dtype=torch.bfloat16, generator=gen)
    if strided:
        kv = torch.randn(1, T, 8, 384, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = kv[..., :192].transpose(1, 2), kv[..., 192:320].transpose(1, 2)
    else:
        k = torch.randn(1, 8, T, 192, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(1, 8, T, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.07)
    got = pa.attend_after_prefix(q, k, v, 0.07)
    assert got.shape == want.shape
    assert ((got.float() - want).norm() / want.norm()).item() <= 2e-2
