"""Full-size device tests of the block-FP8 kernels (skipped without CUDA): Qwen3-Next-80B-A3B's
shapes (hidden 2048; attention q/k/v packed 9216 x 2048, o_proj 2048 x 4096; Gated DeltaNet
in_proj_qkvz 12288 x 2048, out_proj 2048 x 4096; 512 experts of width 512, top-10, plus the
shared expert stacked as expert 513) at decode batch 1 and 64 and an 8192-token prefill.

Each kernel against the torch definition (hyla.ops.fp8) on the same device, bf16 activations:
the activation codes bit for bit, the outputs to relative L2 error <= 5e-3 (the two differ in
fp32 summation order and then round to bf16, 2^-9 relative; the MoE also re-quantises h, where a
different fp32 order can move a code by one ulp). Each prints its time next to the bf16 path's
(F.linear / hyla's bf16 fused MoE): `pytest tests/gpu/test_fp8_kernels.py -s`. The cuBLAS path
(torch._scaled_mm, timed beside the Triton GEMM) runs where this torch build takes blockwise scales.
"""

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from hyla.bench.floor import time_ms  # noqa: E402
from hyla.ops.fp8 import (block_quantize, fp8_linear_torch, fp8_moe_experts_torch,  # noqa: E402
                          per_token_group_quant, quantize_gate_up)
from hyla.ops.triton import fp8_gemm  # noqa: E402
from hyla.ops.triton.fused_moe_fp8 import fused_moe_fp8  # noqa: E402

DEV = "cuda"
TOL = 5e-3
GEMMS = {"qkv": (9216, 2048), "o_proj": (2048, 4096), "in_proj_qkvz": (12288, 2048), "out_proj": (2048, 4096)}
TOKENS = (1, 64, 8192)
GEMM_TOKENS = (1, 64, 1024, 2048, 4096, 8192)  # where fp8_linear switches to cuBLAS (SCALED_MM_MIN_ROWS)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def ms(fn) -> float:
    """Mean ms of 20 back-to-back calls after one warm-up (hyla.bench.floor.time_ms)."""
    return time_ms(fn, 20, warmup=1)


@pytest.mark.parametrize("M", TOKENS)
def test_group_quant_full_size(M):
    x = torch.randn(M, 4096, device=DEV, dtype=torch.bfloat16)
    q, s = fp8_gemm.per_token_group_quant(x)
    rq, rs = per_token_group_quant(x)
    assert torch.equal(s, rs) and torch.equal(q.float(), rq.float())


@pytest.mark.parametrize("M", GEMM_TOKENS)
@pytest.mark.parametrize("name", list(GEMMS))
def test_fp8_gemm_full_size(name, M):
    N, K = GEMMS[name]
    gen = torch.Generator(device=DEV).manual_seed(0)
    w_bf16 = (torch.randn(N, K, device=DEV, generator=gen) / K ** 0.5).to(torch.bfloat16)
    w, s = block_quantize(w_bf16)
    x = torch.randn(M, K, device=DEV, generator=gen).to(torch.bfloat16)
    ref = fp8_linear_torch(x, w, s)

    def triton_gemm():
        return fp8_gemm.fp8_gemm(*fp8_gemm.per_token_group_quant(x), w, s, x.dtype)
    err = rel(triton_gemm(), ref)
    assert rel(fp8_gemm.fp8_linear(x, w, s), ref) <= TOL  # what the product runs (cuBLAS from SCALED_MM_MIN_ROWS)
    line = (f"  {name} M={M}: triton rel err {err:.1e}, {ms(triton_gemm):.4f} ms; "
            f"bf16 F.linear {ms(lambda: F.linear(x, w_bf16)):.4f} ms")
    if fp8_gemm.scaled_mm_supports(x, w):
        try:
            cublas = fp8_gemm.fp8_linear_scaled_mm(x, w, s)
        except RuntimeError as e:  # this torch / cuBLAS takes no blockwise scales
            line += f"; _scaled_mm unavailable: {str(e).splitlines()[0][:120]}"
        else:
            line += (f"; _scaled_mm rel err {rel(cublas, ref):.1e}, "
                     f"{ms(lambda: fp8_gemm.fp8_linear_scaled_mm(x, w, s)):.4f} ms")
            assert rel(cublas, ref) <= TOL
    print(line)
    assert err <= TOL


def _moe_inputs(M: int):
    """The 80B's routed experts in block FP8 and M tokens' routing -> (x, w13, s13, w2, s2, weights,
    ids, the experts in bf16 (w13, w2))."""
    E, H, I, k = 513, 2048, 512, 11  # 512 routed + the stacked shared expert; top-10 + the shared slot
    gen = torch.Generator(device=DEV).manual_seed(1)
    w13_bf16 = (torch.randn(E, 2 * I, H, device=DEV, generator=gen) / H ** 0.5).to(torch.bfloat16)
    w2_bf16 = (torch.randn(E, H, I, device=DEV, generator=gen) / I ** 0.5).to(torch.bfloat16)
    w13, s13 = quantize_gate_up(w13_bf16)
    w2, s2 = block_quantize(w2_bf16)
    x = torch.randn(M, H, device=DEV, generator=gen).to(torch.bfloat16)
    routed = torch.rand(M, E - 1, device=DEV, generator=gen).topk(k - 1, dim=-1).indices
    ids = torch.cat([routed, torch.full((M, 1), E - 1, device=DEV)], 1)
    weights = torch.rand(M, k, device=DEV, generator=gen)
    return x, w13, s13, w2, s2, weights, ids, (w13_bf16, w2_bf16)


@pytest.mark.parametrize("M", TOKENS)
def test_fused_moe_fp8_full_size(M):
    from hyla.ops.triton.fused_moe import fused_moe

    x, w13, s13, w2, s2, weights, ids, (w13_bf16, w2_bf16) = _moe_inputs(M)
    got = fused_moe_fp8(x, w13, s13, w2, s2, weights, ids)
    ref = fp8_moe_experts_torch(x, w13, s13, w2, s2, weights, ids)
    err = rel(got, ref)
    t8 = ms(lambda: fused_moe_fp8(x, w13, s13, w2, s2, weights, ids))
    t16 = ms(lambda: fused_moe(x, w13_bf16, w2_bf16, weights, ids))
    print(f"  fused MoE M={M}: fp8 rel err {err:.1e}, {t8:.4f} ms; bf16 {t16:.4f} ms")
    assert err <= TOL


@pytest.mark.parametrize("M", (1, 64))
def test_fused_moe_fp8_split_k_full_size(M):
    """The gate/up GEMM split K ways (KSPLIT: 1 to all 16 of H's groups) on decode-sized blocks:
    each to the definition, and to KSPLIT = 1 (the same products summed in another order, which
    moves scales by an ulp and codes of h by one step at most); prints each one's time."""
    x, w13, s13, w2, s2, weights, ids, _ = _moe_inputs(M)
    ref = fp8_moe_experts_torch(x, w13, s13, w2, s2, weights, ids)
    blocks = dict(BM=16, BN=128, BK=128, GM=1, num_warps=4, num_stages=3, down=dict(BN=64))
    single = fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, config=blocks)
    line = f"  fused MoE M={M} split-K:"
    for ksplit in (1, 2, 4, 8, 16):
        config = dict(blocks, KSPLIT=ksplit)
        got = fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, config=config)
        assert rel(got, ref) <= TOL and rel(got, single) <= TOL, ksplit
        line += f" {ksplit}: {ms(lambda: fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, config=config)):.4f} ms;"
    print(line)
