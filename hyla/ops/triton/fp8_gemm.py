"""Triton block-FP8 GEMM for the dense projections (W8A8, DeepSeek-V3's fine-grained FP8 scheme).

Same contract as hyla.ops.fp8.fp8_linear_torch (x [M, K] -> [M, N] in x.dtype, with w [N, K]
float8_e4m3fn and its 128 x 128 block scales s [ceil(N/128), ceil(K/128)]). Two launches, the
scheme vLLM uses (`per_token_group_quant_fp8` then `w8a8_block_fp8_matmul`):

1. `_group_quant_kernel`: each row's groups of 128 columns -> e4m3 codes and one fp32 scale per
   (row, group): s = max(amax, 1e-10) / 448, q = x / s rounded to nearest even. Quantising once
   before the GEMM, rather than inside it, keeps the prefill GEMM's tiles free of that work (each
   row block would be re-quantised once per column block otherwise).
2. `_gemm_kernel`: tiles of BM x BN outputs; the K loop walks the 128-column groups (BK = 128,
   the block size, so each step has one activation scale per row and one weight scale per
   column): acc += dot(a_q, w_q^T) * s_a[:, None] * s_w[None, :] in fp32, then + bias, rounded
   once to x's dtype. The weight scale is gathered per output column (row block n // 128), so BN
   need not divide 128 and partial edge blocks need no special case.

An activation whose producer kernel already wrote its codes and scales (an RMSNorm, a gated output
norm, the SwiGLU activation, with `store_group_quant`) carries them (hyla.ops.fp8_activation):
`activation_fp8` serves them instead of the first launch.

The e4m3 rounding is done in fp32 arithmetic (`e4m3_round`: the round-to-nearest-even of a
value onto e4m3's grid, by adding and subtracting 1.5 * 2^23 ulps), and the division by the scale
is the correctly rounded `div_rn`: then every code is bit for bit torch's `x / s` cast to e4m3
(hyla.ops.fp8.per_token_group_quant), on a GPU and in Triton's CPU interpreter (whose own
fp32 -> fp8 cast rounds ties away from zero and mishandles overflow), up to the sign of zero.

`fp8_linear_scaled_mm` is the alternative second step: cuBLAS through torch._scaled_mm with
BlockWise1x128 activation scales and BlockWise128x128 weight scales (Hopper, CUDA 12.9+),
timed against the Triton GEMM by tests/gpu/test_fp8_kernels.py; `fp8_linear` takes it for
prefill-sized inputs (SCALED_MM_MIN_ROWS), where that timing picked it.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from hyla.ops import fp8_activation
from hyla.ops.triton import _interpreter
from hyla.ops.triton.kernel_tables import tuned_gemm_config
from hyla.ops.triton.pdl import dependent_launch_prologue, pdl_launch

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1
log = logging.getLogger("hyla.ops")

BLOCK = 128  # hyla.ops.fp8.BLOCK
FP8_MAX = tl.constexpr(448.0)  # e4m3's largest finite value
ACT_EPS = 1e-10  # hyla.ops.fp8.ACT_EPS
GROUP_EPS = tl.constexpr(ACT_EPS)  # the same, for the producers' in-kernel quantisation


@triton.jit
def e4m3_round(v):
    """fp32 v (|v| <= 448 up to rounding) -> the nearest e4m3 value, ties to even, as fp32, clamped
    to +-448. The ulp of e4m3 at v is 2^(e - 3) with e = max(floor(log2 |v|), -6) (below 2^-6 the
    subnormals keep the ulp 2^-9); adding and subtracting c = 1.5 * 2^23 * ulp rounds v to a
    multiple of the ulp in one IEEE fp32 rounding (|v| < 2^22 ulps)."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    c = ((e + (23 - 3 + 127)) << 23).to(tl.float32, bitcast=True) * 1.5
    r = (v + c) - c
    return tl.minimum(tl.maximum(r, -FP8_MAX), FP8_MAX)


@triton.jit
def quantize_rows(v, EPS):
    """v [R, G] fp32, one quantisation group per row (masked-out columns 0) -> (codes [R, G] as
    e4m3-valued fp32, scales [R] fp32): s = max(amax, EPS) / 448, codes = round(v / s)."""
    amax = tl.maximum(tl.max(tl.abs(v), axis=1), EPS)
    s = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
    return e4m3_round(tl.math.div_rn(v, s[:, None])), s


@triton.jit
def store_group_quant(q, s, v, rows, row_ok, col0, row_len, R: tl.constexpr, C: tl.constexpr):
    """A producer kernel's per_token_group_quant of the tile it stores: v [R, C] fp32, the values of
    rows `rows` [R] (int64; row_ok [R]: the real ones) and columns col0 .. col0 + C - 1 (col0 and C
    multiples of 128) of a contiguous [*, row_len] activation, row_len a multiple of 128 (no group
    straddles two rows or the edge). Writes the e4m3 codes to q [*, row_len] and one fp32 scale per
    (row, group of 128 columns) to s [*, row_len / 128]: each group by `quantize_rows`, so bit for
    bit what `_group_quant_kernel` writes for those values. Columns past row_len count as 0."""
    cols = col0 + tl.arange(0, C)
    m = row_ok[:, None] & (cols < row_len)[None, :]
    groups = tl.reshape(tl.where(m, v, 0.0), [R * (C // 128), 128])  # row-major: one group per row
    codes, scale = quantize_rows(groups, GROUP_EPS)
    tl.store(q + rows[:, None] * row_len + cols[None, :], tl.reshape(codes, [R, C]).to(q.dtype.element_ty), mask=m)
    g = col0 // 128 + tl.arange(0, C // 128)
    tl.store(s + rows[:, None] * (row_len // 128) + g[None, :], tl.reshape(scale, [R, C // 128]),
             mask=row_ok[:, None] & (g < row_len // 128)[None, :])


@triton.jit
def _group_quant_kernel(x, q, s, M, K, s_xm, s_qm, s_sm, EPS, BM: tl.constexpr, G: tl.constexpr, PDL: tl.constexpr = False):
    """One program: BM rows x one group of G columns."""
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    o_m = tl.program_id(0) * BM + tl.arange(0, BM)
    g = tl.program_id(1)
    o_k = g * G + tl.arange(0, G)
    mask = (o_m < M)[:, None] & (o_k < K)[None, :]
    rows = o_m.to(tl.int64)
    v = tl.load(x + rows[:, None] * s_xm + o_k[None, :], mask=mask, other=0.0).to(tl.float32)
    codes, scale = quantize_rows(v, EPS)
    tl.store(q + rows[:, None] * s_qm + o_k[None, :], codes.to(q.dtype.element_ty), mask=mask)
    tl.store(s + rows * s_sm + g, scale, mask=o_m < M)


def per_token_group_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) -> (q [M, K] e4m3, s [M, ceil(K/128)] fp32); bit for bit
    hyla.ops.fp8.per_token_group_quant (up to the sign of zero)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    groups = triton.cdiv(K, BLOCK)
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, groups, dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return q, s
    BM = 16 if M <= 256 else 64
    _group_quant_kernel[(triton.cdiv(M, BM), groups)](x, q, s, M, K, x.stride(0), q.stride(0), s.stride(0), ACT_EPS,
                                                       BM=BM, G=BLOCK, num_warps=4, **pdl_launch(x.device))
    return q, s


def activation_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) -> (q [M, K] e4m3, s [M, ceil(K/128)] fp32) for an FP8 GEMM:
    the form x carries when its producer wrote one (hyla.ops.fp8_activation), else
    `per_token_group_quant(x)`. The same bits either way."""
    carried = fp8_activation.lookup(x)
    return carried if carried is not None else per_token_group_quant(x)


@triton.jit
def _gemm_kernel(a, a_s, b, b_s, c, bias, M, N, K, s_am, s_asm, s_bn, s_bsn, s_cm,
                 HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr, PDL: tl.constexpr = False):
    """c[m, n] = sum_g (a_q[m, g] . b_q[n, g]) s_a[m, g] s_b[n // BK, g] (+ bias[n]); GM row
    blocks at a time across all column blocks (their activations stay in L2)."""
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    pid = tl.program_id(0)
    nb_m, nb_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GM * nb_n
    first = (pid // per_group) * GM
    rows_in_group = tl.minimum(nb_m - first, GM)
    i_m = first + (pid % per_group) % rows_in_group
    i_n = (pid % per_group) // rows_in_group
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_m, m_n = o_m < M, o_n < N
    a_ptr = a + o_m[:, None].to(tl.int64) * s_am + o_k[None, :]  # [BM, BK]
    b_ptr = b + o_n[None, :].to(tl.int64) * s_bn + o_k[:, None]  # [BK, BN]: w rows as columns
    as_ptr = a_s + o_m.to(tl.int64) * s_asm  # [BM] scales of group 0
    bs_ptr = b_s + (o_n // BK).to(tl.int64) * s_bsn  # [BN] the block row of each output column
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, BK)):
        k0 = g * BK
        m_k = (k0 + o_k) < K
        av = tl.load(a_ptr + k0, mask=m_m[:, None] & m_k[None, :], other=0.0)
        bv = tl.load(b_ptr + k0, mask=m_k[:, None] & m_n[None, :], other=0.0)
        sa = tl.load(as_ptr + g, mask=m_m, other=0.0)
        sb = tl.load(bs_ptr + g, mask=m_n, other=0.0)
        acc += tl.dot(av, bv) * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    tl.store(c + o_m[:, None].to(tl.int64) * s_cm + o_n[None, :], acc.to(c.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])


def gemm_config(M: int, N: int) -> dict:
    """Tiles by the number of rows, where no tuned table has an entry (hyla.ops.triton.kernel_tables,
    `hyla bench fp8-gemm`): decode-sized M reads weights (BM = 16 only pads, narrow column tiles
    give the grid enough programs); prefill-sized M wants square 128 tiles. BK is the block size.
    The decode rows are what the sweep picked on an H100 for most of the 48B's and 80B's shapes
    (BENCHMARKS.md "Block-FP8 weights on the GPU"): one row 0.0115-0.0194 ms where tiles of 64
    columns took 0.0156-0.0293 on the widest K."""
    if M <= 4:
        return dict(BM=16, BN=16, GM=1, num_warps=2, num_stages=4)
    if M <= 16:
        return dict(BM=16, BN=32, GM=1, num_warps=4, num_stages=4)
    if M <= 64:  # 32-row tiles: FP8 tensor-core MMAs of 64-row tiles (wgmma) accumulate in reduced precision
        return dict(BM=32, BN=64, GM=1, num_warps=4, num_stages=4)
    if M <= 256:
        return dict(BM=64, BN=128, GM=8, num_warps=4, num_stages=3)
    return dict(BM=128, BN=128, GM=8, num_warps=8, num_stages=3)


def check_weight(w: torch.Tensor, s: torch.Tensor) -> None:
    N, K = w.shape
    if w.dtype != torch.float8_e4m3fn or s.dtype != torch.float32 or tuple(s.shape) != (
            triton.cdiv(N, BLOCK), triton.cdiv(K, BLOCK)):
        raise ValueError(f"expected w [N, K] float8_e4m3fn and s [ceil(N/128), ceil(K/128)] float32; got "
                         f"{tuple(w.shape)} {w.dtype}, {tuple(s.shape)} {s.dtype}")
    if w.stride(-1) != 1:
        raise ValueError("the FP8 weight's last dimension must be contiguous")


def fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, s: torch.Tensor, out_dtype: torch.dtype,
             bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """xq [M, K] e4m3 with xs [M, ceil(K/128)] (per_token_group_quant) times w [N, K] e4m3 with s
    [ceil(N/128), ceil(K/128)] -> [M, N] in out_dtype (+ bias [N]). config: BM, BN, GM and launch
    options instead of `gemm_config`'s."""
    check_weight(w, s)
    M, K = xq.shape
    N = w.shape[0]
    if w.shape[1] != K or tuple(xs.shape) != (M, triton.cdiv(K, BLOCK)):
        raise ValueError(f"activations {tuple(xq.shape)} / scales {tuple(xs.shape)} do not fit w {tuple(w.shape)}")
    c = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M == 0:
        return c
    cfg = dict(config or tuned_gemm_config(M, N, K, xq.device) or gemm_config(M, N))
    BM, BN, GM = cfg.pop("BM"), cfg.pop("BN"), cfg.pop("GM", 1)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    _gemm_kernel[grid](xq, xs, w, s, c, bias if bias is not None else c, M, N, K, xq.stride(0), xs.stride(0),
                       w.stride(0), s.stride(0), c.stride(0), HAS_BIAS=bias is not None, BM=BM, BN=BN, BK=BLOCK,
                       GM=GM, **cfg, **pdl_launch(xq.device))
    return c


# From this many rows a CUDA tensor goes through cuBLAS (torch._scaled_mm) where it takes the shape:
# tests/gpu/test_fp8_kernels.py timed it at 8192 rows 1.6-1.85x faster than the Triton GEMM on the
# released projections (one H100, BENCHMARKS.md "Block-FP8 weights on the GPU"), and at 64 rows
# the Triton GEMM 1.1-1.2x faster (cuBLAS refuses one row); the rows between are not timed yet.
SCALED_MM_MIN_ROWS = 4096
# What cuBLAS turned down once, Triton runs from then on: (N, K, whether M is a multiple of 16).
# Keyed by M's alignment too: on one H100 image cuBLAS refused one row but took 16 and 64 rows of
# the same weights (`hyla bench fp8-gemm`, docs/perf-log/2026-12-06-h100-branches-landed-agent-
# poisson.md), and refusals during the kernel warm-up (row counts not logged then), keyed by the
# weight alone, sent every later GEMM of those weights, 8,192-row prefills included, to the
# Triton GEMM (1.6-1.85x cuBLAS's time there: BENCHMARKS "Block-FP8 weights on the GPU"). The
# warning now names the rows.
_scaled_mm_refused: set[tuple[int, int, bool]] = set()


def _refusal_key(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int, bool]:
    return (*w.shape, x.shape[0] % 16 == 0)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x.dtype: quantise x per token group (or take the form it carries:
    `activation_fp8`), then the block-FP8 GEMM (cuBLAS from SCALED_MM_MIN_ROWS rows on CUDA where
    it takes the shape, else Triton; config: the Triton GEMM's tiles, which also keeps it Triton)."""
    if (config is None and x.is_cuda and x.shape[0] >= SCALED_MM_MIN_ROWS and scaled_mm_supports(x, w)
            and _refusal_key(x, w) not in _scaled_mm_refused
            and not torch.cuda.is_current_stream_capturing()):  # a refusal inside a capture would void it
        try:
            return fp8_linear_scaled_mm(x, w, s, bias)
        except RuntimeError as err:  # this torch / cuBLAS build has no blockwise scaling for it
            _scaled_mm_refused.add(_refusal_key(x, w))
            log.warning("torch._scaled_mm refused a %s block-FP8 GEMM over %d rows (%s): the Triton GEMM runs "
                        "it, and every GEMM of those weights whose rows are %s a multiple of 16", tuple(w.shape),
                        x.shape[0], str(err).splitlines()[0][:120], "" if x.shape[0] % 16 == 0 else "not")
    xq, xs = activation_fp8(x)
    return fp8_gemm(xq, xs, w, s, x.dtype, bias, config)


def scaled_mm_supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Shapes and dtypes the cuBLAS blockwise path is asked for: bf16 output, N and K multiples of
    128 (whole blocks; cuBLAS also needs 16-aligned dims), at least one row."""
    N, K = w.shape
    return x.dtype == torch.bfloat16 and N % BLOCK == 0 and K % BLOCK == 0 and x.shape[0] > 0


def fp8_linear_scaled_mm(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 -> [M, N] bf16 through torch._scaled_mm: the activations as `activation_fp8`
    gives them (scales passed outer-dim-major, [M, K/128] with stride (1, M), as cuBLAS reads
    1 x 128 scales), the weight as its column-major transpose [K, N] with the transposed
    128 x 128 scales [K/128, N/128]."""
    check_weight(w, s)
    xq, xs = activation_fp8(x)
    out = torch._scaled_mm(xq, w.t(), scale_a=xs.t().contiguous().t(), scale_b=s.t(), out_dtype=x.dtype)
    return out if bias is None else out + bias.to(out.dtype)
