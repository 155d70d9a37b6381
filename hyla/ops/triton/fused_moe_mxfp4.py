"""Triton fused MoE over MXFP4 experts: the packed weights are read as they are stored and
dequantised per K tile in registers, so an expert's weights cross HBM at 4.25 bits each.

Same contract and scheme as hyla.ops.triton.fused_moe (align the (token, slot) pairs into
per-expert blocks, gate/up GEMM with the gated-activation epilogue, down GEMM scaled by the
routing weight, slot sum in fp32), with each weight matrix W [N, K] of an expert given as

    packed [E, N, K/2] uint8   two E2M1 codes per byte: column 2i low nibble, 2i+1 high nibble
    scale  [E, N, K/32] uint8  E8M0 exponent per 32 columns: W[n, c] = E2M1(code) * 2^(scale - 127)

(hyla.models.mxfp4 is the definition; `dequantize_mxfp4` there is this kernel's reference). The
last dimension of both must be contiguous; the row and expert strides are free, so packed and
scale may be two views of one [E, N, K/2 + K/32] buffer (hyla.models.mxfp4.Mxfp4Experts).

How a K tile of BK columns is multiplied: the BK/2 bytes of a weight row hold the even columns
in their low nibbles and the odd columns in their high nibbles, so the activation tile is loaded
as its even and its odd columns ([BM, BK/2] each) and the tile is two dots,
a_even @ W_lo + a_odd @ W_hi, with W_lo / W_hi [BK/2, BN] decoded from the same bytes. No
nibble interleave (join / reshape) is needed, and all of it runs in Triton's interpreter (CI).
The decoded values are exact in bf16, fp16 (for scales within its range) and fp32: an E2M1 value
has at most 2 significant bits, so the only rounding is the one the dot does on its inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.ops.gated_act import SILU, GatedActivation
from hyla.ops.triton import _interpreter
from hyla.ops.triton.fused_moe import _ACT, _block_ids, _block_rows, _config, _dot, _gated, row_blocks, split_config, sum_slots

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1

GROUP = 32  # columns per E8M0 scale (hyla.models.mxfp4.GROUP)


@triton.jit
def _e2m1(code):
    """4-bit E2M1 codes (int32 tile, 0..15) -> fp32 values: bits 1-2 the exponent e, bit 0 the
    mantissa m, bit 3 the sign; |v| = m / 2 for e = 0 (subnormal), (2 + m) 2^e / 4 otherwise
    (codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6)."""
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (2.0 + m) * (1 << e).to(tl.float32) * 0.25)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _dequant(q, s):
    """q: bytes [BKH, BN] (uint8), s: their E8M0 scales [BKH, BN] -> (even columns, odd columns)
    [BKH, BN] each in fp32 (exact; the caller casts to the activations' dtype, still exact).
    2^(s - 127) is built as fp32 bits (s in the exponent field, as E8M0 is fp32's exponent): no
    exp2 per element. s = 0 gives 0 where the format says 2^-127 (a GPU's exp2 flushes that
    fp32 denormal to 0 too); s = 255 (E8M0's NaN) gives inf, and NaN once multiplied by 0."""
    q = q.to(tl.int32)
    factor = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return _e2m1(q & 15) * factor, _e2m1(q >> 4) * factor


@triton.jit
def _mx_dot(a_even, a_odd, q_ptr, s_ptr, m_w, IEEE: tl.constexpr):
    """[BM, BK] activations (their even / odd columns [BM, BKH] each) times one MXFP4 weight tile
    (bytes at q_ptr, scales at s_ptr: [BKH, BN], decoded here) -> [BM, BN] fp32."""
    lo, hi = _dequant(tl.load(q_ptr, mask=m_w, other=0), tl.load(s_ptr, mask=m_w, other=0))
    return _dot(a_even, lo.to(a_even.dtype), IEEE) + _dot(a_odd, hi.to(a_even.dtype), IEEE)


@triton.jit
def _gate_up_kernel(x, wq, ws, h, sorted_pairs, block_expert, P, I, H,
                    s_xm, s_qe, s_qn, s_se, s_sn, s_hm, NB, NN, LIMIT, BETA, LBETA, top_k: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr, IEEE: tl.constexpr,
                    ACT: tl.constexpr, HAS_LBETA: tl.constexpr, ONE_PAIR: tl.constexpr):
    """h[pair, n] = act(x[tok] . W_gate[n], x[tok] . W_up[n]) for one block of pairs and BN
    columns; W rows n (gate) and I + n (up) of the block's expert, decoded per K tile."""
    BKH: tl.constexpr = BK // 2
    i_m, i_n = _block_ids(NB, NN, GM)
    e = tl.load(block_expert + i_m).to(tl.int64)
    if e < 0:
        return
    pair = _block_rows(sorted_pairs, i_m, P, BM, ONE_PAIR)  # [BM]
    live = pair < P
    tok = (pair // top_k).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < I
    o_b = tl.arange(0, BKH)  # byte (= column pair) of the K tile
    a_ptr = x + tok[:, None] * s_xm + 2 * o_b[None, :]  # [BM, BKH] even columns; + 1: odd
    rows = o_n[None, :].to(tl.int64)
    qg_ptr = wq + e * s_qe + rows * s_qn + o_b[:, None]  # [BKH, BN] gate rows' bytes
    sg_ptr = ws + e * s_se + rows * s_sn + (o_b // 16)[:, None]  # [BKH, BN] scales (16 bytes a group)
    qu_ptr, su_ptr = qg_ptr + I * s_qn, sg_ptr + I * s_sn  # up rows
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        kb = k0 // 2
        m_k = (kb + o_b) < H // 2
        m_a = live[:, None] & m_k[None, :]
        m_w = m_k[:, None] & m_n[None, :]
        a_even = tl.load(a_ptr + k0, mask=m_a, other=0.0)
        a_odd = tl.load(a_ptr + k0 + 1, mask=m_a, other=0.0)
        acc_g += _mx_dot(a_even, a_odd, qg_ptr + kb, sg_ptr + k0 // 32, m_w, IEEE)
        acc_u += _mx_dot(a_even, a_odd, qu_ptr + kb, su_ptr + k0 // 32, m_w, IEEE)
    out = _gated(acc_g, acc_u, ACT, LIMIT, BETA, LBETA, HAS_LBETA)  # fp32 epilogue, rounded once
    tl.store(h + pair[:, None].to(tl.int64) * s_hm + o_n[None, :], out.to(h.dtype.element_ty),
             mask=live[:, None] & m_n[None, :])


@triton.jit
def _down_kernel(h, wq, ws, y, weights, sorted_pairs, block_expert, P, H, I,
                 s_hm, s_qe, s_qn, s_se, s_sn, s_ym, NB, NN,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr, IEEE: tl.constexpr, ONE_PAIR: tl.constexpr):
    """y[pair, n] = w_pair * h[pair] . W_down[n] for one block of pairs and BN output columns."""
    BKH: tl.constexpr = BK // 2
    i_m, i_n = _block_ids(NB, NN, GM)
    e = tl.load(block_expert + i_m).to(tl.int64)
    if e < 0:
        return
    pair = _block_rows(sorted_pairs, i_m, P, BM, ONE_PAIR)  # [BM]
    live = pair < P
    prow = tl.where(live, pair, 0).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < H
    o_b = tl.arange(0, BKH)
    a_ptr = h + prow[:, None] * s_hm + 2 * o_b[None, :]  # [BM, BKH] even columns of h
    rows = o_n[None, :].to(tl.int64)
    q_ptr = wq + e * s_qe + rows * s_qn + o_b[:, None]  # [BKH, BN]
    s_ptr = ws + e * s_se + rows * s_sn + (o_b // 16)[:, None]  # [BKH, BN] (16 bytes a scale group)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        kb = k0 // 2
        m_k = (kb + o_b) < I // 2
        m_a = live[:, None] & m_k[None, :]
        m_w = m_k[:, None] & m_n[None, :]
        a_even = tl.load(a_ptr + k0, mask=m_a, other=0.0)
        a_odd = tl.load(a_ptr + k0 + 1, mask=m_a, other=0.0)
        acc += _mx_dot(a_even, a_odd, q_ptr + kb, s_ptr + k0 // 32, m_w, IEEE)
    scale = tl.load(weights + prow, mask=live, other=0.0).to(tl.float32)  # [BM] routing weights
    tl.store(y + prow[:, None] * s_ym + o_n[None, :], (acc * scale[:, None]).to(y.dtype.element_ty),
             mask=live[:, None] & m_n[None, :])


def check_packed(packed: torch.Tensor, scale: torch.Tensor, rows: int, cols: int, what: str) -> None:
    """packed [E, rows, cols/2] and scale [E, rows, cols/32], uint8, last dim contiguous."""
    E = packed.shape[0]
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 {what}: packed and scale must be uint8, got {packed.dtype}, {scale.dtype}")
    if cols % GROUP or tuple(packed.shape) != (E, rows, cols // 2) or tuple(scale.shape) != (E, rows, cols // GROUP):
        raise ValueError(f"MXFP4 {what}: expected packed [E, {rows}, {cols // 2}] and scale [E, {rows}, "
                         f"{cols // GROUP}] (K = {cols} a multiple of {GROUP}); got {tuple(packed.shape)}, "
                         f"{tuple(scale.shape)}")
    if packed.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError(f"MXFP4 {what}: the last dimension of packed and scale must be contiguous")


def fused_moe_mxfp4(x: torch.Tensor, w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                    w2_scale: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, config: dict | None = None,
                    activation: GatedActivation = SILU) -> torch.Tensor:
    """x: [M, H] (bf16 / fp16 / fp32); w13_packed: [E, 2I, H/2] uint8 and w13_scale: [E, 2I, H/32]
    (gate rows, then up rows); w2_packed: [E, H, I/2], w2_scale: [E, H, I/32]; weights: [M, k]
    fp32; ids: [M, k] int64 -> [M, H] in x.dtype: sum_j weights[m, j] * expert_{ids[m, j]}(x[m])
    with the weights decoded from MXFP4 (see the module docstring) to x's dtype inside the GEMMs.
    config: block sizes and launch options (keys of hyla.ops.triton.fused_moe._config's result,
    optionally a "down" dict for the second GEMM, as fused_moe takes; BK a multiple of 32).
    activation: the experts' gated activation, in the first GEMM's fp32 epilogue."""
    if x.ndim != 2 or weights.shape != ids.shape or ids.ndim != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"expected x [M, H], weights and ids [M, k]; got {tuple(x.shape)}, "
                         f"{tuple(weights.shape)}, {tuple(ids.shape)}")
    M, H = x.shape
    E, two_i = w13_packed.shape[:2]
    I = two_i // 2
    check_packed(w13_packed, w13_scale, 2 * I, H, "gate_up")
    check_packed(w2_packed, w2_scale, H, I, "down")
    if w2_packed.shape[0] != E:
        raise ValueError(f"MXFP4 experts: gate_up has {E} experts, down {w2_packed.shape[0]}")
    x = x.contiguous()
    k = ids.shape[1]
    P = M * k
    if P == 0:
        return x.new_zeros(M, H)
    # the heuristic blocks, not fused_moe's tuned tables: those were measured for bf16 weights
    BM, (BN, BK, GM, cfg), (dBN, dBK, dGM, down) = split_config(config if config is not None else _config(P, E))
    if BK % GROUP or dBK % GROUP:
        raise ValueError(f"BK must be a multiple of {GROUP} (one scale per {GROUP} columns), got {BK}, {dBK}")
    blocks = row_blocks(ids, E, BM)
    sorted_pairs, block_expert, nb = blocks.sorted_pairs, blocks.block_expert, blocks.count
    ieee = x.dtype == torch.float32
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    nn_up, nn_down = triton.cdiv(I, BN), triton.cdiv(H, dBN)
    _gate_up_kernel[(nb * nn_up,)](
        x, w13_packed, w13_scale, h, sorted_pairs, block_expert, P, I, H, x.stride(0), w13_packed.stride(0),
        w13_packed.stride(1), w13_scale.stride(0), w13_scale.stride(1), h.stride(0), nb, nn_up,
        float(activation.limit or 0.0), float(activation.beta or 1.0), float(activation.linear_beta or 1.0),
        top_k=k, BM=BM, BN=BN, BK=BK, GM=GM, IEEE=ieee, ACT=_ACT[activation.kind],
        HAS_LBETA=activation.linear_beta is not None, ONE_PAIR=blocks.one_pair, **cfg)
    y = torch.empty(P, H, dtype=x.dtype, device=x.device)  # per-pair outputs in x's dtype, as fused_moe
    _down_kernel[(nb * nn_down,)](
        h, w2_packed, w2_scale, y, weights.reshape(-1).float(), sorted_pairs, block_expert, P, H, I, h.stride(0),
        w2_packed.stride(0), w2_packed.stride(1), w2_scale.stride(0), w2_scale.stride(1), y.stride(0), nb, nn_down,
        BM=BM, BN=dBN, BK=dBK, GM=dGM, ONE_PAIR=blocks.one_pair, IEEE=ieee, **down)
    return sum_slots(y, M, k)
