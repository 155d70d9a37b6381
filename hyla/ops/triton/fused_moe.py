"""Triton fused MoE: routed SwiGLU experts as two grouped GEMMs over expert-sorted token blocks.

Same contract as hyla.ops.moe.moe_experts (x [M, H], w13 [E, 2I, H], w2 [E, H, I], weights and
ids [M, k] -> [M, H]). The scheme is the one vLLM and SGLang use for their fused-MoE kernels:

1. `align_pairs` (one launch): the M*k (token, slot) pairs are grouped by expert and each
   expert's run is padded to a multiple of BLOCK_M, so every block of BLOCK_M rows belongs to
   one expert (`block_expert`); padding rows hold the pair index P = M*k and are masked. The
   buffer has its worst-case length P + min(E, P) * (BLOCK_M - 1) for a given M: shapes are
   fixed, nothing is read back on the host, so a CUDA graph can capture the step.
2. `_gate_up_kernel`: each program multiplies one block of rows (gathered from x by token) by
   one BLOCK_N slice of its expert's gate and up rows, and writes the gated activation (fp32
   epilogue, rounded once: silu(gate) * up, GLM's clamped SwiGLU or K3's SiTU) for the pairs:
   h [P, I].
3. `_down_kernel`: the same over h (rows are pairs, not tokens) and w2, each row scaled by its
   routing weight in the fp32 epilogue and written per pair in x's dtype: y [P, H].
4. `_sum_slots_kernel`: out[m] = sum_j y[m, j] in fp32, the k contributions of a token in slot
   order (no atomics, so the result does not depend on the run), rounded once to x's dtype.

Prefill-sized launches run GM row blocks at a time across all column blocks (`_block_ids`), so
the gathered activations of a group are read from HBM once rather than once per column block.

Programs of blocks past the padded end (block_expert = -1) return at once; at decode most of the
grid is such blocks, which costs a few microseconds.

One token (M = 1, batch-1 decode) skips step 1 (`row_blocks`): its k pairs are k blocks of one
live row each, block j holding pair j of expert ids[0, j]. The rows are computed exactly as in
the aligned layout (only the blocks' order differs), without the align launch; an expert named
twice would only be read twice (routing names distinct experts).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hyla.ops.gated_act import SILU, GatedActivation
from hyla.ops.moe_pairs import check_expert_shapes
from hyla.ops.moe_pairs import sort_pairs_by_expert
from hyla.ops.triton import _interpreter
from hyla.ops.triton.kernel_tables import tuned_config
from hyla.ops.triton.norm import to_dtype
from hyla.ops.triton.pdl import dependent_launch_prologue, pdl_launch

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1

_ACT = {"silu": 0, "clamped_silu": 1, "situ": 2}  # the ACT constexpr of _gate_up_kernel


def aligned_rows(pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted, per-expert padded pair buffer: the worst case for `pairs` pairs."""
    rows = pairs + min(num_experts, pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


@triton.jit(do_not_specialize=["P", "R", "NB"])  # COUNT_ARGUMENTS
def _align_kernel(ids, counts, ranks, pad_starts, sorted_pairs, block_expert, P, E, R, NB,
                  BM: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr, BB: tl.constexpr, PDL: tl.constexpr = False):
    """One program: count pairs per expert (an atomic ticket gives each pair its place in its
    expert's run), pad each run to BM rows, scatter the pair indices, and name each block's
    expert. Reads after a barrier bypass L1 (.cg), since atomics update L2 only."""
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    o_e = tl.arange(0, BE)
    m_e = o_e < E
    tl.store(counts + o_e, tl.zeros((BE,), dtype=tl.int32), mask=m_e)
    tl.debug_barrier()
    for p0 in range(0, P, BP):
        o = p0 + tl.arange(0, BP)
        m = o < P
        e = tl.load(ids + o, mask=m, other=0).to(tl.int32)
        tl.store(ranks + o, tl.atomic_add(counts + e, 1, mask=m), mask=m)
    tl.debug_barrier()
    c = tl.atomic_add(counts + o_e, 0, mask=m_e)  # [BE] pairs per expert (an L2 read)
    c = tl.where(m_e, c, 0)
    padded = (c + BM - 1) // BM * BM
    ends = tl.cumsum(padded, 0)
    tl.store(pad_starts + o_e, ends - padded, mask=m_e)
    for r0 in range(0, R, BP):
        o = r0 + tl.arange(0, BP)
        tl.store(sorted_pairs + o, tl.zeros((BP,), dtype=tl.int32) + P, mask=o < R)
    tl.debug_barrier()
    for p0 in range(0, P, BP):
        o = p0 + tl.arange(0, BP)
        m = o < P
        e = tl.load(ids + o, mask=m, other=0).to(tl.int32)
        r = tl.load(ranks + o, mask=m, other=0, cache_modifier=".cg")
        start = tl.load(pad_starts + e, mask=m, other=0, cache_modifier=".cg")
        tl.store(sorted_pairs + start + r, o.to(tl.int32), mask=m)
    total = tl.sum(padded, 0)
    for b0 in range(0, NB, BB):
        ob = b0 + tl.arange(0, BB)
        row = ob * BM
        # the block's expert: the first whose padded run ends after the block's first row
        owner = tl.sum(((ends[None, :] <= row[:, None]) & m_e[None, :]).to(tl.int32), 1)
        tl.store(block_expert + ob, tl.where(row < total, owner, -1), mask=ob < NB)


# Above this many pairs the one-program kernel costs more device time than a device sort (0.37 ms
# at 65,536 pairs on an H200) and the prefill step is device-bound anyway; below it the sort's ~20
# torch ops cost more host time than the kernel's device time, in steps the host bounds. 48B shape,
# 12 layers, FP8, one H100 (scripts/prefill_wall.py, BENCHMARKS.md "Prefill steps: host or device"):
# a 1,024-token step 49.2 -> 38.5 ms at 8,192 -> 40,000; 4,096 tokens 48.3 -> 41.1 ms; 8,192 tokens
# (73,728 pairs) 65 ms either way, 68 ms with the one-program kernel.
ONE_PROGRAM_MAX_PAIRS = 40000

# COUNT_ARGUMENTS: the kernels' pair and block counts (P, R, NB) change with every step's token
# count and only bound loops and masks. Triton compiles a variant per integer argument that is or
# is not a multiple of 16, and a server met new (count, block config) pairs while serving after
# the startup warm-up, a compile of all three kernels each (1.27 s on a cold H100,
# scripts/first_steps.py --fresh 1159): they are left unspecialised (do_not_specialize).


def _align_pairs_sorted(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_pairs` with torch ops around a stable device sort (same contract; pairs of one
    expert in pair order). No host sync."""
    flat = ids.reshape(-1)
    P = flat.numel()
    R = aligned_rows(P, num_experts, block_m)
    order, ends = sort_pairs_by_expert(ids, num_experts)
    counts = torch.diff(ends.long(), prepend=ends.new_zeros(1).long())  # [E] pairs per expert
    padded = (counts + block_m - 1) // block_m * block_m
    pad_ends = padded.cumsum(0)
    e_sorted = flat[order]
    rank = torch.arange(P, device=ids.device) - (ends.long() - counts)[e_sorted]  # place in its expert's run
    sorted_pairs = torch.full((R,), P, dtype=torch.int32, device=ids.device)
    sorted_pairs.scatter_(0, (pad_ends - padded)[e_sorted] + rank, order.to(torch.int32))
    owner = torch.searchsorted(pad_ends, torch.arange(0, R, block_m, device=ids.device), right=True)
    return sorted_pairs, torch.where(owner < num_experts, owner, -1).to(torch.int32)


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids: [M, k] -> (sorted_pairs [R] int32: flat pair indices m*k + j grouped by expert, each
    expert's run padded to a multiple of block_m with the value P = M*k; block_expert
    [R / block_m] int32: the expert of each block of rows, -1 past the last run).
    R = aligned_rows(P, E, block_m), fixed for a given M. One launch (`_align_kernel`); the
    order of pairs inside an expert's run is not fixed (atomic tickets), which changes nothing:
    each row of a block is computed on its own. Prefill-sized batches (more than
    ONE_PROGRAM_MAX_PAIRS pairs) take `_align_pairs_sorted`."""
    flat = ids.reshape(-1)
    P = flat.numel()
    if P > ONE_PROGRAM_MAX_PAIRS:
        return _align_pairs_sorted(ids, num_experts, block_m)
    R = aligned_rows(P, num_experts, block_m)
    dev = ids.device
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    ranks = torch.empty(max(P, 1), dtype=torch.int32, device=dev)
    pad_starts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty(R, dtype=torch.int32, device=dev)
    block_expert = torch.empty(R // block_m, dtype=torch.int32, device=dev)
    BE = triton.next_power_of_2(num_experts)
    _align_kernel[(1,)](flat, counts, ranks, pad_starts, sorted_pairs, block_expert, P, num_experts, R,
                        R // block_m, BM=block_m, BP=1024, BE=BE, BB=max(1, 4096 // BE), num_warps=8, **pdl_launch(flat.device))
    return sorted_pairs, block_expert


class RowBlocks(NamedTuple):
    """The row blocks both GEMMs walk: `sorted_pairs` [count * BM] and `block_expert` [count] as
    `align_pairs` returns them, or with `one_pair` the flat ids [P] as both (block j = pair j,
    the kernels build its rows themselves: `_block_rows`)."""
    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    count: int
    one_pair: bool


def row_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> RowBlocks:
    """ids [M, k] -> the row blocks of the fused-MoE GEMMs: one pair per block for one token
    (no launch), else `align_pairs`."""
    if ids.shape[0] == 1:
        flat = ids.reshape(-1)
        return RowBlocks(flat, flat, flat.numel(), True)
    sorted_pairs, block_expert = align_pairs(ids, num_experts, block_m)
    return RowBlocks(sorted_pairs, block_expert, block_expert.shape[0], False)


@triton.jit
def _block_rows(sorted_pairs, i_m, P, BM: tl.constexpr, ONE_PAIR: tl.constexpr):
    """The pair indices [BM] of row block i_m (P marks a padding row): read from `align_pairs`'
    buffer, or with ONE_PAIR pair i_m in row 0 and padding after it."""
    if ONE_PAIR:
        return tl.where(tl.arange(0, BM) == 0, i_m, P).to(tl.int32)
    return tl.load(sorted_pairs + i_m * BM + tl.arange(0, BM)).to(tl.int32)  # both branches one type


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in fp32; IEEE: exact fp32 products (fp32 inputs), else the default
    (tf32 for fp32, plain for bf16 / fp16)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _block_ids(NB, NN, GM: tl.constexpr):
    """Program id -> (row block, column block) of a 1-D grid of NB x NN programs, GM row blocks
    at a time: the GM row blocks' activations stay in L2 while every column block of them runs
    (launch order row-fastest inside a group), instead of being re-read from HBM once per column
    block. GM = 1 is the plain column-major order (weight tiles shared by consecutive programs)."""
    pid = tl.program_id(0)
    per_group = GM * NN
    first = (pid // per_group) * GM
    rows = tl.minimum(NB - first, GM)
    i_m = first + (pid % per_group) % rows
    i_n = (pid % per_group) // rows
    return i_m, i_n


@triton.jit
def _tanh(x):
    """tanh in fp32 through exp (saturates to +-1 without overflow to nan)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _gated(g, u, ACT: tl.constexpr, LIMIT, BETA, LBETA, HAS_LBETA: tl.constexpr):
    """The gated activation (hyla.ops.gated_act) of fp32 gate / up tiles, in fp32."""
    if ACT == 1:  # clamped_silu
        g = tl.minimum(g, LIMIT)
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
    if ACT == 2:  # situ
        out = BETA * _tanh(g / BETA) * (1.0 / (1.0 + tl.exp(-g)))
        if HAS_LBETA:
            u = LBETA * _tanh(u / LBETA)
        return out * u
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit(do_not_specialize=["P", "NB"])  # COUNT_ARGUMENTS
def _gate_up_kernel(x, w, h, sorted_pairs, block_expert, P, I, H,
                    s_xm, s_we, s_wn, s_hm, NB, NN, LIMIT, BETA, LBETA, top_k: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr, IEEE: tl.constexpr,
                    ACT: tl.constexpr, HAS_LBETA: tl.constexpr, ONE_PAIR: tl.constexpr, PDL: tl.constexpr = False):
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
    a_ptr = x + tok[:, None] * s_xm + o_k[None, :]  # [BM, BK]
    g_ptr = w + e * s_we + o_n[None, :].to(tl.int64) * s_wn + o_k[:, None]  # [BK, BN] gate rows
    u_ptr = g_ptr + I * s_wn  # up rows
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        m_k = (k0 + o_k) < H
        a = tl.load(a_ptr + k0, mask=live[:, None] & m_k[None, :], other=0.0)
        bg = tl.load(g_ptr + k0, mask=m_k[:, None] & m_n[None, :], other=0.0)
        bu = tl.load(u_ptr + k0, mask=m_k[:, None] & m_n[None, :], other=0.0)
        acc_g += _dot(a, bg, IEEE)
        acc_u += _dot(a, bu, IEEE)
    out = _gated(acc_g, acc_u, ACT, LIMIT, BETA, LBETA, HAS_LBETA)  # e.g. silu(gate) * up, fp32
    tl.store(h + pair[:, None].to(tl.int64) * s_hm + o_n[None, :], out.to(h.dtype.element_ty),
             mask=live[:, None] & m_n[None, :])


@triton.jit(do_not_specialize=["P", "NB"])  # COUNT_ARGUMENTS
def _down_kernel(h, w, y, weights, sorted_pairs, block_expert, P, H, I,
                 s_hm, s_we, s_wn, s_ym, NB, NN,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr, IEEE: tl.constexpr, ONE_PAIR: tl.constexpr, PDL: tl.constexpr = False):
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    i_m, i_n = _block_ids(NB, NN, GM)
    e = tl.load(block_expert + i_m).to(tl.int64)
    if e < 0:
        return
    pair = _block_rows(sorted_pairs, i_m, P, BM, ONE_PAIR)  # [BM]
    live = pair < P
    rows = tl.where(live, pair, 0).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < H
    o_k = tl.arange(0, BK)
    a_ptr = h + rows[:, None] * s_hm + o_k[None, :]  # [BM, BK]
    b_ptr = w + e * s_we + o_n[None, :].to(tl.int64) * s_wn + o_k[:, None]  # [BK, BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        m_k = (k0 + o_k) < I
        a = tl.load(a_ptr + k0, mask=live[:, None] & m_k[None, :], other=0.0)
        b = tl.load(b_ptr + k0, mask=m_k[:, None] & m_n[None, :], other=0.0)
        acc += _dot(a, b, IEEE)
    scale = tl.load(weights + rows, mask=live, other=0.0).to(tl.float32)  # [BM] routing weights
    tl.store(y + rows[:, None] * s_ym + o_n[None, :], (acc * scale[:, None]).to(y.dtype.element_ty),
             mask=live[:, None] & m_n[None, :])


@triton.jit
def _sum_slots_kernel(y, out, H, top_k: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr = False):
    """out[m, :] = sum_j y[m, j, :] in fp32, slot order, rounded once to out's dtype."""
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    m = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BH + tl.arange(0, BH)
    live = o < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    for j in tl.static_range(top_k):
        acc += tl.load(y + (m * top_k + j) * H + o, mask=live, other=0.0).to(tl.float32)
    tl.store(out + m * H + o, to_dtype(acc, out.dtype.element_ty), mask=live)


def _config(pairs: int, num_experts: int) -> dict:
    """Block sizes by the expected rows per expert: small blocks for decode (a few rows per
    expert: the GEMMs read weights, BLOCK_M only pads), larger for prefill."""
    per_expert = pairs / num_experts
    if per_expert <= 16:
        return dict(BM=16, BN=64, BK=128, GM=1, num_warps=4, num_stages=3)
    if per_expert <= 64:
        return dict(BM=32, BN=64, BK=128, GM=1, num_warps=4, num_stages=3)
    # Measured on an H200 (`hyla bench moe --sweep`, 8192 tokens, both released shapes): 128-row
    # blocks beat 64-row ones by 15-25%; BM=16 is best up to 256 decode tokens.
    return dict(BM=128, BN=128, BK=64, GM=8, num_warps=8, num_stages=3)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, config: dict | None = None, activation: GatedActivation = SILU) -> torch.Tensor:
    """x: [M, H]; w13: [E, 2I, H]; w2: [E, H, I]; weights: [M, k] (fp32); ids: [M, k] int64 ->
    [M, H] in x.dtype. See the module docstring. config: block sizes and launch options (keys
    of `_config`'s result, optionally a "down" dict overriding them for the second GEMM) instead
    of the tuned table for this device and shape (hyla.ops.triton.kernel_tables) or, without one,
    the heuristic `_config`. activation: the
    experts' gated activation (hyla.ops.gated_act), computed in the first GEMM's epilogue."""
    check_expert_shapes(x, w13, w2, weights, ids)
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()  # no-ops for loaded weights
    M, k = ids.shape
    E, two_i, H = w13.shape
    I = two_i // 2
    P = M * k
    if P == 0:
        return x.new_zeros(M, H)
    if config is None:
        config = tuned_config(M, E, I, H, x.device) or _config(P, E)
    BM, (BN, BK, GM, cfg), (dBN, dBK, dGM, down) = split_config(config)
    blocks = row_blocks(ids, E, BM)
    sorted_pairs, block_expert, nb = blocks.sorted_pairs, blocks.block_expert, blocks.count
    ieee = x.dtype == torch.float32
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    nn_up, nn_down = triton.cdiv(I, BN), triton.cdiv(H, dBN)
    _gate_up_kernel[(nb * nn_up,)](
        x, w13, h, sorted_pairs, block_expert, P, I, H, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        nb, nn_up, float(activation.limit or 0.0), float(activation.beta or 1.0), float(activation.linear_beta or 1.0),
        top_k=k, BM=BM, BN=BN, BK=BK, GM=GM, IEEE=ieee, ACT=_ACT[activation.kind],
        HAS_LBETA=activation.linear_beta is not None, ONE_PAIR=blocks.one_pair, **cfg, **pdl_launch(x.device))
    # per-pair outputs in x's dtype (as vLLM / SGLang keep them): at prefill sizes y is the
    # largest buffer of the layer (8K tokens x 8 slots x 2304), and fp32 doubled its traffic
    y = torch.empty(P, H, dtype=x.dtype, device=x.device)
    _down_kernel[(nb * nn_down,)](
        h, w2, y, weights.reshape(-1).float(), sorted_pairs, block_expert, P, H, I, h.stride(0), w2.stride(0),
        w2.stride(1), y.stride(0), nb, nn_down, BM=BM, BN=dBN, BK=dBK, GM=dGM, ONE_PAIR=blocks.one_pair, IEEE=ieee, **down, **pdl_launch(h.device))
    return sum_slots(y, M, k)


def split_config(config: dict) -> tuple[int, tuple, tuple]:
    """A block configuration (keys of `_config`'s result, optionally a "down" dict overriding
    them for the second GEMM) -> (BM, (BN, BK, GM, launch options) of the first GEMM, the same
    of the second). BM is shared: both GEMMs walk the same expert-aligned row blocks."""
    cfg = dict(config)
    BM = cfg.pop("BM")
    overrides = cfg.pop("down", {})  # first: "down" must not reach the launch options
    if "BM" in overrides:
        raise ValueError("a fused-MoE config's \"down\" blocks cannot set BM: both GEMMs share the row blocks")
    down = {**cfg, **overrides}
    first = (cfg.pop("BN"), cfg.pop("BK"), cfg.pop("GM", 1), cfg)
    second = (down.pop("BN"), down.pop("BK"), down.pop("GM", 1), down)
    return BM, first, second


def sum_slots(y: torch.Tensor, M: int, k: int) -> torch.Tensor:
    """y: [M * k, H] per-pair outputs (slot-major per token) -> [M, H] in y's dtype, the k slots
    of each token summed in fp32 in slot order."""
    H = y.shape[1]
    out = torch.empty(M, H, dtype=y.dtype, device=y.device)
    BH = min(1024, triton.next_power_of_2(H))
    _sum_slots_kernel[(M, triton.cdiv(H, BH))](y, out, H, top_k=k, BH=BH, num_warps=4, **pdl_launch(y.device))
    return out
