"""Decode and speculative verify over a state pool (Triton, forward only).

Same contract as hyla.ops.recurrent (read its docstring for the pool addressing): sequence n
reads its state from slot idx[n] (decode) or idx[n, num_accepted_tokens[n] - 1] (verify), steps
the recurrence over its few tokens, and writes back in place: to idx[n] after its last token
(decode), or after its j-th token to idx[n, j] (verify). A negative slot is a padding row:
nothing is read or written and its outputs are 0.

One program per (value block of BV columns, sequence, value head) holds S [K, BV] in fp32
registers. Decode is bound by the pool traffic (read and write K * V * 4 bytes per head), so the
program loads its whole state tile at once and everything else is a few hundred bytes per token.
The pool may be stored K-last (hyla.contract.state_pool, what the engine allocates) or
contiguous [num_slots, HV, K, V] (fla's); recurrent_step.state_offsets addresses either.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.ops.triton import _interpreter
from hyla.ops.triton.common import head_gate_params
from hyla.ops.triton.params import gate_params, num_sms, token_rows
from hyla.ops.triton.recurrent_decode import decode_persistent_kernel
from hyla.ops.triton.recurrent_step import (position_slot, row_span, start_slot, state_offsets,
                                             token_loads, token_update)
from hyla.ops import recurrent as _reference
from hyla.ops import utils
from hyla.ops.utils import check_inputs
from hyla.ops.triton.pdl import dependent_launch_prologue, pdl_launch

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1

_GATES = {None: 0, "gdn": 1, "kda": 2}


@triton.jit(do_not_specialize=["lower_bound", "scale", "T"])
def recurrent_kernel(
    q, k, v, g, beta, A_log, dt_bias, lower_bound, scale,
    o, h0, ht, cu_seqlens, idx, n_acc, T, sq, sk, sv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, IDX_W: tl.constexpr,
    GATE: tl.constexpr, GATE_FN: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
    POOL: tl.constexpr, SPEC: tl.constexpr, KLAST: tl.constexpr, PREFETCH: tl.constexpr,
    PDL: tl.constexpr = False,
):
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos = row_span(cu_seqlens, i_n, T, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    tile = i_hv * K * V + state_offsets(o_k, o_v, K, V, KLAST)  # offsets inside one [HV, K, V] state

    # Which state to start from; a negative pool slot marks a padding row.
    if POOL:
        slot0 = start_slot(idx, n_acc, i_n, IDX_W, SPEC, PREFETCH)
        live = slot0 >= 0
    else:
        slot0 = i_n.to(tl.int64)
        live = slot0 >= 0
    if not live:
        for t in range(bos, eos):
            tl.store(o + (t * HV + i_hv) * V + o_v, tl.zeros([BV], dtype=tl.float32).to(o.dtype.element_ty),
                     mask=m_v)
        return

    b_s = tl.zeros([BK, BV], dtype=tl.float32)  # [BK, BV]
    if HAS_H0:
        b_s += tl.load(h0 + slot0 * HV * K * V + tile, mask=m_kv, other=0.0).to(tl.float32)

    a_log, bias = head_gate_params(A_log, dt_bias, i_hv, o_k, K, GATE, GATE_FN, HAS_BIAS)
    # PREFETCH (rows of several tokens): token t + 1's inputs, and in a verify the slot its state
    # goes to, are loaded before token t is worked on and stored (recurrent_step.token_loads says
    # why the compiler cannot do it). Without it a verify token waits on two loads in turn after
    # the previous token's stores: its inputs, then (after its output store) its slot.
    if PREFETCH:
        n_q, n_k, n_v, n_b, n_g = token_loads(q, k, v, g, beta, bos, bos < eos, i_h, i_hv, o_k, o_v, sq, sk, sv, HV,
                                              K, V, GATE)
        if SPEC:
            n_dst = position_slot(idx, i_n, 0, IDX_W)
    for t in range(bos, eos):
        if PREFETCH:
            b_q, b_k, b_v, b_b, b_g = n_q, n_k, n_v, n_b, n_g
            n_q, n_k, n_v, n_b, n_g = token_loads(q, k, v, g, beta, t + 1, t + 1 < eos, i_h, i_hv, o_k, o_v, sq, sk,
                                                  sv, HV, K, V, GATE)
            if SPEC:
                dst = n_dst
                n_dst = position_slot(idx, i_n, t + 1 - bos, IDX_W)  # masked past the slot width
        else:
            b_q, b_k, b_v, b_b, b_g = token_loads(q, k, v, g, beta, t, True, i_h, i_hv, o_k, o_v, sq, sk, sv, HV, K,
                                                  V, GATE)
        b_s, b_o = token_update(b_s, b_q, b_k, b_v, b_b, b_g, o_k, a_log, bias, lower_bound, scale, K, GATE,
                                GATE_FN, USE_L2NORM, BETA_SIGMOID)
        tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if SPEC:
            # the state after token j goes to idx[n, j]; a rejected draft only reaches slots the
            # next step does not start from
            if not PREFETCH:
                dst = position_slot(idx, i_n, t - bos, IDX_W)
            if dst >= 0:
                tl.store(ht + dst * HV * K * V + tile, b_s.to(ht.dtype.element_ty), mask=m_kv)

    if STORE_HT:
        if not SPEC:
            tl.store(ht + slot0 * HV * K * V + tile, b_s.to(ht.dtype.element_ty), mask=m_kv)


def _token_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [B, T, H, D] -> (x or a contiguous copy, the elements between two of its token rows):
    read in place when each row's [H, D] block is contiguous (params.token_rows for the rows)."""
    if x.stride(3) != 1 or (x.shape[2] > 1 and x.stride(2) != x.shape[3]):
        x = x.contiguous()
    return token_rows(x)


def _check_pool_shapes(idx, n_acc, pool, n):
    """The torch path's pool checks (hyla.ops.recurrent._check_pool_args) minus the ones that read
    values (slot < num_slots, 1 <= num_accepted <= width): those would synchronise the device."""
    utils.check_slot_indices(idx, pool)
    if idx.ndim not in (1, 2) or idx.shape[0] != n:
        raise ValueError(f"`ssm_state_indices` must be [N] or [N, 1+num_spec] with N={n}, got {tuple(idx.shape)}")
    if idx.ndim == 2:
        if n_acc is None:
            raise ValueError("2-D `ssm_state_indices` (speculative verify) needs `num_accepted_tokens` [N]")
        if n_acc.shape != (n,):
            raise ValueError(f"`num_accepted_tokens` must be [{n}], got {tuple(n_acc.shape)}")
    elif n_acc is not None:
        raise ValueError("`num_accepted_tokens` is only valid with 2-D `ssm_state_indices`")


# The persistent decode kernel is the default from this many 16-column (value block, sequence,
# head) tiles per SM on: on an H200 (BENCHMARKS.md "Recurrent decode and verify") it beat one
# program per tile at every size measured, down to 15.5 tiles per SM (N = 8, 16, 32 sequences x 32
# heads at K = V = 128: 1.30x, 1.30x, 1.11x; K = V = 64 likewise); a shorter grid gains nothing
# from a loop.
_PERSISTENT_MIN_TILES_PER_SM = 15


# Its launch (BENCHMARKS.md "Recurrent decode and verify"; H200, 32 heads). K <= 128: the one-tile
# register prefetch, 16-column tiles, 1 warp, 8 programs per SM. K = 256: a [256, 16] fp32 tile
# twice over (current and next) does not fit one warp's registers (it ran at 33-35% of copy
# bandwidth), so the software-pipelined loop: the tiles wait in shared memory, STAGES - 1 of them
# per program (16 KB each: 3 programs x 3 x 16 KB fit the budget below), 2 warps, 3 programs per
# SM, at 0.65-0.70x the time. At K = 128 the pipelined loop with 32-column tiles was within +-3% of
# the register prefetch (better at N = 64, worse at N = 256 and 512).
_DECODE_SMEM_BUDGET = 200_000


def _decode_launch(BK: int, V: int, state_bytes: int, block_v, num_warps, programs_per_sm, decode_stages=None):
    """-> (value block, warps, programs per SM, pipeline stages: 0 = register prefetch); an
    argument given by the caller is kept."""
    if BK <= 128:
        bv, warps, pps, stages = 16, 1, 8, 0
    else:
        bv, warps, pps, stages = 16, 2, 3, 4
    bv, warps, pps = block_v or bv, num_warps or warps, programs_per_sm or pps
    if decode_stages is not None:
        return bv, warps, pps, decode_stages
    if stages:
        per_stage = BK * bv * state_bytes + 4 * BK * 4  # the state tile and the q, k, g, dt_bias rows
        stages = max(2, min(stages, 1 + _DECODE_SMEM_BUDGET // (pps * per_stage)))
    return bv, warps, pps, stages


# Over a K-last pool (hyla.contract.state_pool) a tile of BV value columns is one contiguous
# BV * K * 4-byte run and one warp reduces it over K. Measured on an H200 (BENCHMARKS.md
# "Recurrent decode and verify"; 32 value heads, K = V = 128 and 256): one program per 8-column
# tile, one warp, is the fastest decode from 32 sequences on (87-95% of copy bandwidth at N >= 64,
# against 77-84% for the best schedule over a V-contiguous pool); below ~48 16-column tiles per SM
# the persistent prefetch loop (K <= 128) is faster. A per-channel gate computed in the kernel
# (KDA with use_gate_in_kernel) costs each tile K activations, which one program per tile cannot
# hide at N = 64 (80%): the persistent loop with 8-column tiles and 16 programs per SM does (87-89%).
# Verify (several tokens, every position's state written): one warp, 8 columns, with the next
# token prefetched (below), for KDA and GDN alike (88-92% of copy at N = 64 / 256 rows x 2 / 4
# tokens; 16 columns 87-91%; BENCHMARKS.md "Recurrent decode and verify").
_KLAST_DECODE_TILE = (8, 1)  # (block_v, num_warps) of one program per tile
_KLAST_VERIFY_TILE = (8, 1)
_KLAST_PERSISTENT_MAX_TILES_PER_SM = 48


def _klast_decode_launch(BK: int, tiles_per_sm: float, channel_gate_in_kernel: bool) -> tuple[bool, int, int, int]:
    """A plain decode step over a K-last pool -> (persistent, value block, warps, programs per SM
    or 0 when not persistent); tiles_per_sm counts 16-column tiles."""
    if BK <= 128 and tiles_per_sm < _KLAST_PERSISTENT_MAX_TILES_PER_SM:
        return True, 16, 1, 8
    if BK <= 128 and channel_gate_in_kernel:
        return True, 8, 1, 16
    return (False, *_KLAST_DECODE_TILE, 0)


def pool_is_k_last(pool: torch.Tensor) -> bool:
    """The state pool's layout: False for a contiguous [num_slots, HV, K, V] (fla's), True for
    K-last, the transposed view of a contiguous [num_slots, HV, V, K]. Any other strides are an
    error: the pool is updated in place, so it cannot be made contiguous here."""
    if pool.is_contiguous():
        return False
    if pool.transpose(-1, -2).is_contiguous():
        return True
    raise ValueError(f"the state pool `initial_state` must be contiguous [num_slots, HV, K, V] or K-last (the "
                     f"transposed view of a contiguous [num_slots, HV, V, K]); got strides {tuple(pool.stride())}")


def _block_v(n_heads_total: int, V: int, device) -> int:
    """Value-block width: 64 columns (256 B rows of the fp32 state, 4 warps) when that still
    gives every SM four programs, else 32, else 16 (measured on an H200: at N = 64 and 256
    sequences x 32 heads, 64-wide blocks beat 32-wide by 6-7%; BENCHMARKS.md "Recurrent decode
    and verify")."""
    bvf = max(16, triton.next_power_of_2(V))
    sms = num_sms(device)
    for bv in (64, 32):
        if bv <= bvf and n_heads_total * (bvf // bv) >= 4 * sms:
            return bv
    return 16


def recurrent_fwd(q, k, v, g, beta, *, gate, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, ssm_state_indices=None,
                  num_accepted_tokens=None, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                  lower_bound=None, use_beta_sigmoid_in_kernel=False, block_v=None, num_warps=None,
                  persistent=None, programs_per_sm=None, decode_stages=None, prefetch_next_token=None):
    """The fused recurrent forward (fla's fused_recurrent_* arguments and layouts). Launch knobs,
    None = the measured defaults: block_v, num_warps (both kernels); persistent (None: the
    persistent decode kernel on plain decode steps from _PERSISTENT_MIN_TILES_PER_SM tiles per
    SM); for the persistent kernel only, programs_per_sm and decode_stages (0: the next tile
    prefetched into registers, >= 1: Triton's pipelined loop; _decode_launch); for one program
    per tile only, prefetch_next_token (token t + 1's inputs, and a verify's slot for its state,
    loaded before token t's stores: recurrent_step.token_loads; None: on, the measured default)."""
    pooled = ssm_state_indices is not None
    # Shape checks only: this path never reads device values on the host (no synchronisation),
    # so it can be captured in a CUDA graph. Slot ranges are the caller's contract.
    n = check_inputs(q, k, v, g, beta, gate=gate, initial_state=initial_state, cu_seqlens=None,
                     check_gate_sign=False, state_is_pool=pooled or cu_seqlens is not None)
    if beta is None:
        raise ValueError("`beta` is required")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is not None:
        if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2
                or cu_seqlens.dtype not in (torch.int32, torch.int64)):
            raise ValueError("`cu_seqlens` must be a 1-D int32/int64 tensor [N+1] of cumulative lengths")
        if B != 1:
            raise ValueError(f"with `cu_seqlens` the batch size must be 1, got B={B}")
        n = cu_seqlens.numel() - 1
        if initial_state is not None and not pooled and initial_state.shape[0] != n:
            raise ValueError(f"`initial_state` has {initial_state.shape[0]} rows for {n} sequences")
    if q.dtype == torch.float64 or v.dtype == torch.float64:
        raise ValueError("the Triton path computes in fp32; use the torch path for fp64")
    if K > 256 or V > 256:
        raise ValueError(f"the Triton path supports K, V <= 256, got K={K}, V={V}")
    dev = q.device
    if pooled:
        _check_pool_shapes(ssm_state_indices, num_accepted_tokens, initial_state, n)
    scale = K ** -0.5 if scale is None else float(scale)

    gate_fn, a_log, dtb, lb = gate_params(gate, use_gate_in_kernel, A_log, dt_bias, lower_bound, HV, K, dev)

    # q, k, v are read in place when only their token rows are strided (a verify's q / k / v are
    # column blocks of its conv output); anything else is made contiguous first.
    (qc, sq), (kc, sk), (vc, sv) = _token_rows(q), _token_rows(k), _token_rows(v)
    bc = beta.contiguous()
    gc = qc if g is None else g.contiguous()
    o = torch.empty(B, T, HV, V, device=dev, dtype=v.dtype)
    spec = pooled and ssm_state_indices.ndim == 2
    klast = pooled and pool_is_k_last(initial_state)
    if pooled:
        h0 = ht = initial_state
        idx = ssm_state_indices.contiguous()
        n_acc = num_accepted_tokens.contiguous() if spec else idx
        idx_w = idx.shape[1] if spec else 1
        store_ht = True
    else:
        h0 = initial_state.contiguous() if initial_state is not None else None
        ht = torch.empty(n, HV, K, V, device=dev, dtype=torch.float32) if output_final_state else None
        idx = n_acc = o
        idx_w = 1
        store_ht = ht is not None
    BK = max(16, triton.next_power_of_2(K))
    # Plain decode (one token per sequence, pool in place) may take the persistent prefetching
    # kernel (recurrent_decode.py): over a V-contiguous pool from _PERSISTENT_MIN_TILES_PER_SM
    # tiles per SM on, over a K-last pool where _klast_decode_launch measured it faster.
    one_token = pooled and not spec and cu_seqlens is None and T == 1
    tiles_per_sm = n * HV * triton.cdiv(V, 16) / num_sms(dev)
    # a K-last pool's measured launch: (persistent, block_v, warps, programs per SM)
    kl = _klast_decode_launch(BK, tiles_per_sm, gate == "kda" and gate_fn > 0) if klast and one_token else None
    if persistent is None:
        if klast:
            persistent = kl is not None and kl[0]
        else:
            persistent = one_token and tiles_per_sm >= _PERSISTENT_MIN_TILES_PER_SM
    elif persistent and not pooled:
        raise ValueError("persistent=True needs a state pool (`ssm_state_indices`): the persistent kernel walks "
                         "pool tiles")
    if not persistent and (programs_per_sm or decode_stages is not None):
        raise ValueError("`programs_per_sm` and `decode_stages` set the persistent pool kernel's launch; this "
                         "call does not take that kernel (pass persistent=True with a state pool)")
    if prefetch_next_token is not None and not isinstance(prefetch_next_token, bool):
        raise ValueError(f"`prefetch_next_token` must be None or a bool, got {prefetch_next_token!r}")
    if prefetch_next_token and persistent:
        raise ValueError("`prefetch_next_token` applies to one program per tile; this call takes the persistent "
                         "pool kernel (pass persistent=False)")
    if decode_stages is not None:
        if isinstance(decode_stages, bool) or not isinstance(decode_stages, int) or decode_stages < 0:
            raise ValueError(f"`decode_stages` must be an int >= 0 (0: register prefetch, >= 1: Triton-pipelined "
                             f"loop with that many stages), got {decode_stages!r}")
    if n and persistent:
        if kl is not None and kl[0]:  # the K-last launch; a knob the caller gives is kept
            block_v, num_warps, programs_per_sm = block_v or kl[1], num_warps or kl[2], programs_per_sm or kl[3]
        BV, warps, pps, stages = _decode_launch(BK, V, initial_state.element_size(), block_v, num_warps,
                                                programs_per_sm, decode_stages)
        n_tiles = n * HV * triton.cdiv(V, BV)
        decode_persistent_kernel[(min(n_tiles, pps * num_sms(dev)),)](
            qc, kc, vc, gc, bc,
            a_log if a_log is not None else o, dtb if dtb is not None else o,
            lb, scale, o, initial_state, idx, n_acc, cu_seqlens if cu_seqlens is not None else o, n_tiles, T,
            sq, sk, sv,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
            GATE=_GATES[gate], GATE_FN=gate_fn, HAS_BIAS=dtb is not None,
            USE_L2NORM=bool(use_qk_l2norm_in_kernel), BETA_SIGMOID=bool(use_beta_sigmoid_in_kernel),
            STAGES=stages, KLAST=klast, ROWS=not one_token, IS_VARLEN=cu_seqlens is not None, IDX_W=idx_w,
            SPEC=spec, num_warps=warps, **pdl_launch(qc.device))
    elif n:
        # prefetch_next_token, on unless a call turns it off: with one program per tile and rows of
        # several tokens, token t + 1's inputs (and in a verify its state slot) are loaded before
        # token t is stepped and stored (recurrent_step.token_loads). Without it each token's loads
        # wait behind the previous token's stores (the compiler cannot hoist a load over a store
        # that may alias), a memory latency per token. Measured on an H200 (scripts/
        # verify_schedules.py, BENCHMARKS.md "Recurrent decode and verify"), 8-column tiles, % of
        # copy bandwidth, without -> with: KDA 64 x 2 83 -> 89, 64 x 4 86 -> 88, 256 x 2 86 -> 91,
        # 256 x 4 88 -> 90; GDN (16 -> 8 columns) 64 x 2 84 -> 90, 256 x 4 89 -> 90. KDA's verify
        # runs on 80 registers (96 without), GDN's on 96.
        if klast:
            bv, warps = _KLAST_DECODE_TILE if one_token else _KLAST_VERIFY_TILE
            BV, warps = block_v or bv, num_warps or warps
        else:
            BV, warps = block_v or _block_v(n * HV, V, dev), num_warps or 4
        recurrent_kernel[(triton.cdiv(V, BV), n * HV)](
            qc, kc, vc, gc, bc,
            a_log if a_log is not None else o, dtb if dtb is not None else o,
            lb, scale,
            o, h0 if h0 is not None else o, ht if ht is not None else o,
            cu_seqlens if cu_seqlens is not None else o, idx, n_acc, T, sq, sk, sv,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, IDX_W=idx_w,
            GATE=_GATES[gate], GATE_FN=gate_fn, HAS_BIAS=dtb is not None,
            USE_L2NORM=bool(use_qk_l2norm_in_kernel), BETA_SIGMOID=bool(use_beta_sigmoid_in_kernel),
            IS_VARLEN=cu_seqlens is not None, HAS_H0=h0 is not None, STORE_HT=store_ht,
            POOL=pooled, SPEC=spec, KLAST=klast,
            PREFETCH=prefetch_next_token is not False,  # None: on (see above)
            num_warps=warps, **pdl_launch(qc.device))
    if pooled:
        return o, initial_state
    return o, ht


# The public ops: the torch references' signatures (hyla.ops.recurrent), recurrent_fwd underneath.
fused_recurrent_kda = utils.backend_twin(_reference.fused_recurrent_kda, recurrent_fwd, gate="kda")
fused_recurrent_gated_delta_rule = utils.backend_twin(_reference.fused_recurrent_gated_delta_rule, recurrent_fwd,
                                                      gate="gdn")