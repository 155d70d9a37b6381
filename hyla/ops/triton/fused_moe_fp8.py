"""Triton fused MoE over block-FP8 experts (W8A8: e4m3 weights with 128 x 128 block scales, the
activations quantised per token and group of 128 columns at run time).

Same contract and scheme as hyla.ops.triton.fused_moe (the (token, slot) pairs aligned into
per-expert blocks by `align_pairs`, a gate/up GEMM with the gated-activation epilogue, a down GEMM
scaled by the routing weight, the slot sum in fp32), with hyla.ops.fp8.fp8_moe_experts_torch as
the definition of the arithmetic:

    w13 [E, 2I, H] e4m3, s13 [E, 2 ceil(I/128), ceil(H/128)] fp32   gate rows' blocks, then up rows'
                                                                     (each half blocked on its own)
    w2  [E, H, I]  e4m3, s2  [E, ceil(H/128), ceil(I/128)]  fp32

1. x [M, H] is quantised once per token group (hyla.ops.triton.fp8_gemm.per_token_group_quant):
   xq [M, H] e4m3, xs [M, ceil(H/128)]; or not at all when x carries that form (its producer wrote
   it: hyla.ops.triton.fp8_gemm.activation_fp8).
2. `_gate_up_kernel`: a block of BM pairs (rows gathered from xq by token) times BN = 128 gate and
   up rows of its expert; each K step is one 128-column group, so acc += dot(a, w) * s_a[row] *
   s_w[column's block] in fp32. The epilogue computes act(gate, up) in fp32 and quantises it
   right there: the program's 128 columns are exactly one activation group of h, so it writes h
   as e4m3 codes hq [P, I] and scales hs [P, ceil(I/128)] (no second pass, no bf16 h in HBM).
   Split-K (config key KSPLIT = s > 1, for decode sizes): each (block, column block) program is
   s programs (the grid's second axis), program ks walking only its contiguous share of the
   ceil(H/128) K groups with the same fp32 arithmetic, and storing its gate and up sums to a
   workspace partial [s, P, 2I] fp32 (rows = pairs) instead of the epilogue; then
   `_split_k_finish_kernel` (pairs x groups of h) adds the s shares in the fixed order
   ks = 0 .. s-1 (no atomics: deterministic) and runs the same epilogue into hq / hs. Why: at one
   token the 80B's gate/up GEMM is 10 expert blocks x ceil(512/128) = 4 column blocks, 40
   programs each streaming 2 x 128 x 2048 weight bytes over 16 K steps, too few to draw the
   copy bandwidth (20 us a layer on an H200, ~5 us by bandwidth); the column block cannot shrink
   (128 = one activation group, quantised in the epilogue), so K is the dimension that spreads.
   The shares' sums are added in another order than one program's loop, so a group's scale may
   differ from KSPLIT = 1 in its last bit (and, rarely, a code by one e4m3 step); KSPLIT = 1 is
   the single-pass kernel. Untuned, `_config` splits K up to one pair per expert.
3. `_down_kernel`: hq rows (pairs) times w2 of the block's expert, the same K loop over groups of
   I, scaled by the routing weight in the fp32 epilogue, written per pair in x's dtype: y [P, H].
4. `sum_slots` (hyla.ops.triton.fused_moe): out[m] = sum_j y[m, j] in fp32, slot order.

Tuned tables: hyla/assets/kernel_configs/fused_moe/ files named as the bf16 ones with
",dtype=fp8_w8a8" before ".json" (`tuned_config`); BK is always 128 and the first GEMM's BN 128,
so a table sets BM, the down GEMM's BN, GM, the launch options and KSPLIT (absent: 1).
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl

from hyla.ops.fp8_checks import check_fp8_experts
from hyla.ops.gated_act import SILU, GatedActivation
from hyla.ops.triton import _interpreter
from hyla.ops.triton.fp8_gemm import ACT_EPS, BLOCK, activation_fp8, quantize_rows
from hyla.ops.triton.fused_moe import _ACT, _block_ids, _block_rows, _gated, row_blocks, split_config, sum_slots
from hyla.ops.triton import kernel_tables
from hyla.ops.triton.kernel_tables import CONFIG_DIR
from hyla.ops.triton.pdl import dependent_launch_prologue, pdl_launch

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1


@triton.jit
def _store_h_group(acc_g, acc_u, hq, hs, pair, live, o_n, m_n, i_n, s_hm, s_hsm, LIMIT, BETA, LBETA, EPS,
                   ACT: tl.constexpr, HAS_LBETA: tl.constexpr):
    """The first GEMM's epilogue: act(gate, up) of the fp32 sums acc_g / acc_u [R, 128] of pairs
    pair [R] (live [R]: the real ones) and columns o_n [128] (m_n: those < I), the i_n-th
    activation group of h, quantised per row: e4m3 codes to hq [P, I], the group's scale to
    hs [P, ceil(I/128)]."""
    out = _gated(acc_g, acc_u, ACT, LIMIT, BETA, LBETA, HAS_LBETA)  # [R, 128] fp32
    out = tl.where(m_n[None, :], out, 0.0)  # columns past I take no part in the group's amax
    codes, scale = quantize_rows(out, EPS)
    prow = pair.to(tl.int64)
    tl.store(hq + prow[:, None] * s_hm + o_n[None, :], codes.to(hq.dtype.element_ty),
             mask=live[:, None] & m_n[None, :])
    tl.store(hs + prow * s_hsm + i_n, scale, mask=live)


@triton.jit(do_not_specialize=["P", "NB"])  # fused_moe.COUNT_ARGUMENTS
def _gate_up_kernel(xq, xs, w, ws, hq, hs, partial, sorted_pairs, block_expert, P, I, H,
                    s_xm, s_xsm, s_we, s_wn, s_wse, s_wsn, s_hm, s_hsm, s_pk, s_pm, NB, NN, NI, LIMIT, BETA, LBETA, EPS,
                    top_k: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr,
                    ACT: tl.constexpr, HAS_LBETA: tl.constexpr, ONE_PAIR: tl.constexpr, KSPLIT: tl.constexpr = 1,
                    PDL: tl.constexpr = False):
    """hq / hs for one block of pairs and the BN (= 128, one group) columns i_n of h. NI = ceil(I / 128):
    the up rows' first scale row. KSPLIT > 1 (split-K, module docstring): program (i, ks) sums only
    its contiguous share ks of the ceil(H / 128) K groups and stores the fp32 gate and up sums to
    partial[ks] [P, 2I] (strides s_pk, s_pm; gate in columns 0 .. I-1, up from I) for
    `_split_k_finish_kernel`; hq, hs are then not touched."""
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    i_m, i_n = _block_ids(NB, NN, GM)
    e = tl.load(block_expert + i_m).to(tl.int64)
    if e < 0:
        return
    pair = _block_rows(sorted_pairs, i_m, P, BM, ONE_PAIR)  # [BM]
    live = pair < P
    tok = (pair // top_k).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < I
    o_k = tl.arange(0, BK)
    a_ptr = xq + tok[:, None] * s_xm + o_k[None, :]  # [BM, BK]
    as_ptr = xs + tok * s_xsm  # [BM]
    rows = o_n[None, :].to(tl.int64)
    g_ptr = w + e * s_we + rows * s_wn + o_k[:, None]  # [BK, BN] gate rows
    u_ptr = g_ptr + I * s_wn  # up rows
    sg_ptr = ws + e * s_wse + (o_n // BK).to(tl.int64) * s_wsn  # [BN] gate rows' block row
    su_ptr = sg_ptr + NI * s_wsn  # up rows' block row
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    k_groups = tl.cdiv(H, BK)
    if KSPLIT == 1:
        g_first, g_end = 0, k_groups
    else:  # shares differing by at most one group, none empty (KSPLIT <= k_groups)
        ks = tl.program_id(1)
        g_first, g_end = ks * k_groups // KSPLIT, (ks + 1) * k_groups // KSPLIT
    for g in range(g_first, g_end):
        k0 = g * BK
        m_k = (k0 + o_k) < H
        m_w = m_k[:, None] & m_n[None, :]
        a = tl.load(a_ptr + k0, mask=live[:, None] & m_k[None, :], other=0.0)
        sa = tl.load(as_ptr + g, mask=live, other=0.0)
        bg = tl.load(g_ptr + k0, mask=m_w, other=0.0)
        bu = tl.load(u_ptr + k0, mask=m_w, other=0.0)
        sg = tl.load(sg_ptr + g, mask=m_n, other=0.0)
        su = tl.load(su_ptr + g, mask=m_n, other=0.0)
        acc_g += tl.dot(a, bg) * sa[:, None] * sg[None, :]
        acc_u += tl.dot(a, bu) * sa[:, None] * su[None, :]
    if KSPLIT == 1:
        _store_h_group(acc_g, acc_u, hq, hs, pair, live, o_n, m_n, i_n, s_hm, s_hsm, LIMIT, BETA, LBETA, EPS,
                       ACT, HAS_LBETA)
    else:
        prow = pair.to(tl.int64)
        p_ptr = partial + tl.program_id(1).to(tl.int64) * s_pk + prow[:, None] * s_pm + o_n[None, :]  # [BM, BN]
        tl.store(p_ptr, acc_g, mask=live[:, None] & m_n[None, :])
        tl.store(p_ptr + I, acc_u, mask=live[:, None] & m_n[None, :])


@triton.jit(do_not_specialize=["P"])  # fused_moe.COUNT_ARGUMENTS
def _split_k_finish_kernel(partial, hq, hs, P, I, s_pk, s_pm, s_hm, s_hsm, LIMIT, BETA, LBETA, EPS,
                           KSPLIT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, ACT: tl.constexpr,
                           HAS_LBETA: tl.constexpr, PDL: tl.constexpr = False):
    """hq / hs of pairs BP * program_id(0) .. + BP - 1 and the BN (= 128, one group) columns
    program_id(1) of h: the KSPLIT partial sums of partial [KSPLIT, P, 2I] fp32 added in the order
    ks = 0, 1, .. (no atomics: the same bits on every run), then the first GEMM's epilogue."""
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    pair = tl.program_id(0) * BP + tl.arange(0, BP)
    live = pair < P
    prow = pair.to(tl.int64)
    i_n = tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < I
    m = live[:, None] & m_n[None, :]
    g_ptr = partial + prow[:, None] * s_pm + o_n[None, :]  # [BP, BN] gate sums of share 0; up sums from I on
    acc_g = tl.zeros((BP, BN), dtype=tl.float32)
    acc_u = tl.zeros((BP, BN), dtype=tl.float32)
    for _ in tl.static_range(KSPLIT):
        acc_g += tl.load(g_ptr, mask=m, other=0.0)
        acc_u += tl.load(g_ptr + I, mask=m, other=0.0)
        g_ptr += s_pk  # the next share (a pointer step: KSPLIT * s_pk may pass int32)
    _store_h_group(acc_g, acc_u, hq, hs, pair, live, o_n, m_n, i_n, s_hm, s_hsm, LIMIT, BETA, LBETA, EPS,
                   ACT, HAS_LBETA)


@triton.jit(do_not_specialize=["P", "NB"])  # fused_moe.COUNT_ARGUMENTS
def _down_kernel(hq, hs, w, ws, y, weights, sorted_pairs, block_expert, P, H, I,
                 s_hm, s_hsm, s_we, s_wn, s_wse, s_wsn, s_ym, NB, NN,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr, ONE_PAIR: tl.constexpr, PDL: tl.constexpr = False):
    """y[pair, n] = w_pair * sum_g (hq[pair, g] . w2_q[n, g]) s_h[pair, g] s_w[n // 128, g]."""
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    i_m, i_n = _block_ids(NB, NN, GM)
    e = tl.load(block_expert + i_m).to(tl.int64)
    if e < 0:
        return
    pair = _block_rows(sorted_pairs, i_m, P, BM, ONE_PAIR)  # [BM]
    live = pair < P
    prow = tl.where(live, pair, 0).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < H
    o_k = tl.arange(0, BK)
    a_ptr = hq + prow[:, None] * s_hm + o_k[None, :]  # [BM, BK]
    as_ptr = hs + prow * s_hsm
    b_ptr = w + e * s_we + o_n[None, :].to(tl.int64) * s_wn + o_k[:, None]  # [BK, BN]
    bs_ptr = ws + e * s_wse + (o_n // BK).to(tl.int64) * s_wsn  # [BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(0, tl.cdiv(I, BK)):
        k0 = g * BK
        m_k = (k0 + o_k) < I
        a = tl.load(a_ptr + k0, mask=live[:, None] & m_k[None, :], other=0.0)
        sa = tl.load(as_ptr + g, mask=live, other=0.0)
        b = tl.load(b_ptr + k0, mask=m_k[:, None] & m_n[None, :], other=0.0)
        sb = tl.load(bs_ptr + g, mask=m_n, other=0.0)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
    scale = tl.load(weights + prow, mask=live, other=0.0).to(tl.float32)  # [BM] routing weights
    tl.store(y + prow[:, None] * s_ym + o_n[None, :], (acc * scale[:, None]).to(y.dtype.element_ty),
             mask=live[:, None] & m_n[None, :])


# Pairs per `_split_k_finish_kernel` program: a few, so that a decode step's handful of pairs still
# spreads over several programs per group of h (as timed with split-K: BENCHMARKS.md "Block-FP8
# weights on the GPU", the 80B release layout on an H100)
FINISH_PAIRS = 4


def _config(pairs: int, num_experts: int, k_groups: int) -> dict:
    """Blocks by the expected rows per expert, as hyla.ops.triton.fused_moe._config; BK and the
    first GEMM's BN are the block size (128). k_groups: ceil(H / 128), the most KSPLIT can be.
    To be tuned on the device."""
    per_expert = pairs / num_experts
    if per_expert <= 16:
        cfg = dict(BM=16, BN=BLOCK, BK=BLOCK, GM=1, num_warps=4, num_stages=3, down=dict(BN=64))
        if per_expert <= 1:
            # decode: a few programs per expert block, each streaming all of H (40 programs for the
            # 80B at one token): split K so that more SMs read the weights. A card's swept table sets
            # it (`hyla bench moe --fp8 --sweep`; the H100's 80B table: 4 at one token, 2 at 16)
            cfg["KSPLIT"] = min(4, k_groups)
        return cfg
    if per_expert <= 64:
        return dict(BM=32, BN=BLOCK, BK=BLOCK, GM=1, num_warps=4, num_stages=3, down=dict(BN=64))
    return dict(BM=64, BN=BLOCK, BK=BLOCK, GM=8, num_warps=8, num_stages=3)


def split_k(config: dict, k_groups: int) -> tuple[int, dict]:
    """config (keys of `_config`'s result) -> (KSPLIT, 1 when absent; the config without it, for
    fused_moe.split_config: KSPLIT is no launch option and splits the gate/up GEMM only).
    k_groups: ceil(H / 128). ValueError for a KSPLIT that is not an int from 1 to k_groups (every
    share must hold a group) or one in the "down" overrides."""
    rest = dict(config)
    ksplit = rest.pop("KSPLIT", 1)
    if "KSPLIT" in rest.get("down", {}):
        raise ValueError("a fused-MoE config's \"down\" blocks cannot set KSPLIT: it splits the gate/up GEMM only")
    if isinstance(ksplit, bool) or not isinstance(ksplit, int) or not 1 <= ksplit <= k_groups:
        raise ValueError(f"KSPLIT must be an int from 1 to the {k_groups} K groups of 128 columns, got {ksplit!r}")
    return ksplit, rest


def tuned_config(tokens: int, num_experts: int, intermediate: int, hidden: int, device: torch.device,
                 directory: Path = CONFIG_DIR) -> dict | None:
    """The FP8 kernels' tuned configuration (hyla.ops.triton.kernel_tables, dtype "fp8_w8a8"), with
    BN and BK defaulting to the block size; None without a table entry near `tokens`."""
    cfg = kernel_tables.tuned_config(tokens, num_experts, intermediate, hidden, device, directory, dtype="fp8_w8a8")
    if cfg is not None:
        cfg.setdefault("BN", BLOCK)
        cfg.setdefault("BK", BLOCK)
    return cfg


def fused_moe_fp8(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor, config: dict | None = None,
                  activation: GatedActivation = SILU) -> torch.Tensor:
    """x [M, H] (bf16 / fp16 / fp32); w13 [E, 2I, H] e4m3 with s13 [E, 2 ceil(I/128), ceil(H/128)];
    w2 [E, H, I] e4m3 with s2 [E, ceil(H/128), ceil(I/128)]; weights [M, k] fp32; ids [M, k] int64
    -> [M, H] in x.dtype (see the module docstring). config: blocks, launch options and KSPLIT
    (keys of `_config`'s result; BK and the first GEMM's BN must be 128; KSPLIT as `split_k`
    checks it) instead of the tuned table or the heuristic. activation: the experts' gated
    activation, in the first GEMM's fp32 epilogue."""
    check_fp8_experts(x, w13, s13, w2, s2, weights, ids)
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("the FP8 expert weights' last dimension must be contiguous")
    M, k = ids.shape
    E, two_i, H = w13.shape
    I = two_i // 2
    P = M * k
    if P == 0:
        return x.new_zeros(M, H)
    k_groups = triton.cdiv(H, BLOCK)
    if config is None:
        config = tuned_config(M, E, I, H, x.device) or _config(P, E, k_groups)
    ksplit, config = split_k(config, k_groups)
    BM, (BN, BK, GM, cfg), (dBN, dBK, dGM, down) = split_config(config)
    if BN != BLOCK or BK != BLOCK or dBK != BLOCK:
        raise ValueError(f"the FP8 fused MoE needs BK = 128 and the gate/up BN = 128 (one activation group), "
                         f"got BN={BN}, BK={BK}, down BK={dBK}")
    xq, xs = activation_fp8(x)
    blocks = row_blocks(ids, E, BM)
    sorted_pairs, block_expert, nb = blocks.sorted_pairs, blocks.block_expert, blocks.count
    ni = triton.cdiv(I, BLOCK)
    hq = torch.empty(P, I, dtype=torch.float8_e4m3fn, device=x.device)
    hs = torch.empty(P, ni, dtype=torch.float32, device=x.device)
    nn_up, nn_down = ni, triton.cdiv(H, dBN)
    act_args = (float(activation.limit or 0.0), float(activation.beta or 1.0), float(activation.linear_beta or 1.0),
                ACT_EPS)
    act_consts = dict(ACT=_ACT[activation.kind], HAS_LBETA=activation.linear_beta is not None)
    # split-K: the KSPLIT shares' fp32 gate / up sums, rows = pairs (every pair is in one block, so
    # every row is written); without it a placeholder the kernel never touches
    partial = torch.empty(ksplit, P, two_i, dtype=torch.float32, device=x.device) if ksplit > 1 else hs
    s_pk, s_pm = (partial.stride(0), partial.stride(1)) if ksplit > 1 else (0, 0)
    _gate_up_kernel[(nb * nn_up, ksplit)](
        xq, xs, w13, s13, hq, hs, partial, sorted_pairs, block_expert, P, I, H, xq.stride(0), xs.stride(0),
        w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), hq.stride(0), hs.stride(0), s_pk, s_pm,
        nb, nn_up, ni, *act_args, top_k=k, BM=BM, BN=BN, BK=BK, GM=GM, ONE_PAIR=blocks.one_pair, KSPLIT=ksplit,
        **act_consts, **cfg, **pdl_launch(xq.device))
    if ksplit > 1:
        _split_k_finish_kernel[(triton.cdiv(P, FINISH_PAIRS), ni)](
            partial, hq, hs, P, I, s_pk, s_pm, hq.stride(0), hs.stride(0), *act_args, KSPLIT=ksplit,
            BP=FINISH_PAIRS, BN=BLOCK, **act_consts, num_warps=4, **pdl_launch(hq.device))
    y = torch.empty(P, H, dtype=x.dtype, device=x.device)  # per-pair outputs in x's dtype, as fused_moe
    _down_kernel[(nb * nn_down,)](
        hq, hs, w2, s2, y, weights.reshape(-1).float(), sorted_pairs, block_expert, P, H, I, hq.stride(0),
        hs.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0), nb, nn_down,
        BM=BM, BN=dBN, BK=dBK, GM=dGM, ONE_PAIR=blocks.one_pair, **down, **pdl_launch(hq.device))
    return sum_slots(y, M, k)
