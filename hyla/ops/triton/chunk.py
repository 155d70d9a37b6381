"""Chunkwise prefill on the GPU (Triton, forward only): same contract as hyla.ops.chunk.

Pass 1 (chunk-parallel, hyla/ops/triton/chunk_intra.py), then pass 2 (the sequential scan,
chunk_scan.py), which writes o, the final state and every requested checkpoint state:
  - scalar or no gate (GDN, delta rule; wu_in_scan): two launches. chunk_intra.chunk_gram_kernel,
    grid (chunks, HV): aqk, L^-1 and four row scales per chunk; chunk_scan.chunk_scan_rows_kernel,
    grid (V / BV, N * HV), reads q, k, v where they are and builds w, u, qg, kg by scaling the
    rows of its products (w, qg, kg are row-scaled keys and queries when the decay is a scalar).
    With checkpoints, a third launch (chunk_checkpoint_rows_kernel, one program per checkpoint)
    turns the start states the scan stored into the checkpoint states.
  - per-channel gate (KDA; wu_in_scan): the Gram kernel in two passes (a fast pass, then the
    chunks it flagged as steep) also writes the decayed tiles Q e^G, K e^G and K e^(G_C - G)
    (token-major, like q) and e^(G_C) per channel; the same scan reads them in place of q and k
    (the third tile for the state update). Checkpoints: the scan stores the chunk-start states
    and the token recurrence steps them to each checkpoint.
  - the factor kernel's path (wu_in_scan=False, or KDA with an fp32 L^-1 and bf16 / fp16
    inputs): the Gram kernel, then chunk_intra.chunk_factors_kernel, grid (slices, chunks, HV):
    w, u, qg, kg, gam (and checkpoint factors), again two passes for KDA, then
    chunk_scan.chunk_scan_kernel on them.
  A fused gate's activation is applied where the kernels load the gate (precompute_gate launches
  it first instead).

Sequences (fixed-length rows or packed varlen) are cut into 64-token chunks that never straddle
two sequences; the tail chunk of a sequence is zero-padded inside the kernels.

Differences from the torch path: `chunk_size` is validated but the kernels always use 64 (the
result is the same function of the inputs); fp64 inputs are not supported (use the torch path);
g is not scanned for positive entries (that check is a full extra read of g).
"""

from __future__ import annotations

import itertools

import torch
import triton

from hyla.ops.triton import _interpreter
from hyla.ops.triton.chunk_intra import chunk_factors_kernel, chunk_gram_kernel
from hyla.ops.triton.chunk_scan import chunk_checkpoint_rows_kernel, chunk_scan_kernel, chunk_scan_rows_kernel
from hyla.ops.triton.gate import gdn_gate_beta, kda_gate_beta
from hyla.ops.triton.params import gate_params, num_sms
from hyla.ops.triton.recurrent import pool_is_k_last, recurrent_fwd
from hyla.ops import chunk as _reference
from hyla.ops import utils
from hyla.ops.transfer import stage_long
from hyla.ops.utils import check_checkpoints, check_chunk_pool, check_inputs

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1

CHUNK = 64
_GATES = {None: 0, "gdn": 1, "kda": 2}
_TABLES: dict = {}


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _chunk_tables(cu_seqlens, B, T, device):
    """cu (int64 [N+1]), per-sequence lengths, chunk_off [N+1], chunk_seq / chunk_pos [NCH] (int32)."""
    key = None
    if cu_seqlens is None:
        key = (B, T, str(device))
        if key in _TABLES:
            return _TABLES[key]
        lengths = [T] * B
        cu = torch.arange(B + 1, device=device, dtype=torch.int64) * T
    else:  # once per step's cu_seqlens tensor, for all its layers; no sync for an engine batch
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        rest = utils.cached_on(cu_seqlens, f"chunk_tables_{device}", lambda: _build_tables(cu_seqlens, device)[1:])
        return (cu, *rest)  # cu itself is not kept on the tensor (no reference cycle)
    return _build_tables(None, device, lengths, cu, key)


def _build_tables(cu_seqlens, device, lengths=None, cu=None, key=None):
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        host = utils.host_values(cu_seqlens)
        lengths = [b - a for a, b in zip(host, host[1:])]
    nch = torch.tensor([-(-n // CHUNK) for n in lengths], dtype=torch.int64)
    chunk_off = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    chunk_off[1:] = nch.cumsum(0)
    total = int(chunk_off[-1])
    chunk_seq = torch.repeat_interleave(torch.arange(len(lengths)), nch)
    chunk_pos = torch.arange(total) - chunk_off[:-1][chunk_seq]
    # one pinned transfer for the three tables (the host goes on launching while it runs)
    off_dev, seq_dev, pos_dev = stage_long([chunk_off, chunk_seq, chunk_pos], device, dtype=torch.int32)
    out = (cu, lengths, chunk_off.tolist(), off_dev, seq_dev, pos_dev)
    if key is not None:
        if len(_TABLES) > 64:
            _TABLES.clear()
        _TABLES[key] = out
    return out


def _step_checkpoint_tables(cu_seqlens, ckpts, chunk_off_list, n_chunks, device) -> dict:
    """_checkpoint_tables' result as {"tables": ...}, built once per engine step: every KDA / GDN
    layer of a step has the same sequences and checkpoints, so with cu_seqlens (the step's tensor)
    the tables and their transfer are shared by the step's layers (its sorting and staging cost
    ~0.2 ms of host a layer). The dict also holds what _checkpoints_by_recurrence derives from
    them ("recurrence"), likewise once a step."""
    if cu_seqlens is None:
        return {"tables": _checkpoint_tables(ckpts, chunk_off_list, n_chunks, device)}
    key = tuple(tuple(ps) for ps in ckpts)
    per_step = utils.cached_on(cu_seqlens, f"checkpoint_tables_{device}", dict)
    if key not in per_step:
        per_step[key] = {"tables": _checkpoint_tables(ckpts, chunk_off_list, n_chunks, device)}
    return per_step[key]


def _checkpoint_tables(ckpts, chunk_off_list, n_chunks, device):
    """Checkpoints sorted by chunk: CSR pointer per chunk, in-chunk offsets r, and for each
    sequence the rows of the sorted output that hold its checkpoints in the caller's order.
    For chunk_checkpoint_rows_kernel also: each sorted checkpoint's chunk (ck_chunk), and per
    chunk the slot of its start state in the scan's ck_start buffer, -1 for a chunk without
    checkpoints (ck_slot [n_chunks]); n_slots = the number of chunks with one. For
    _checkpoints_by_recurrence: (global chunk, r, sequence, slot) of each sorted checkpoint."""
    entries = []  # (global chunk, r, sequence, index in its list)
    for n, ps in enumerate(ckpts):
        for i, p in enumerate(ps):
            c = (p - 1) // CHUNK
            entries.append((chunk_off_list[n] + c, p - c * CHUNK, n, i))
    order = sorted(range(len(entries)), key=lambda e: entries[e][0])
    unique = sorted({gc for gc, _, _, _ in entries})
    rank = {gc: i for i, gc in enumerate(unique)}  # a chunk's slot in the scan's ck_start
    in_order = [(*entries[e][:3], rank[entries[e][0]]) for e in order]
    counts = torch.zeros(n_chunks + 1, dtype=torch.int64)
    slots = torch.full((n_chunks,), -1, dtype=torch.int32)
    rows = [[None] * len(ps) for ps in ckpts]
    pos, chunks = [], []
    for slot, e in enumerate(order):
        gc, r, n, i = entries[e]
        counts[gc + 1] += 1
        pos.append(r)
        chunks.append(gc)
        rows[n][i] = slot
    slots[unique] = torch.arange(len(unique), dtype=torch.int32)
    # one pinned transfer for the four tables
    ck_ptr, ck_pos, ck_chunk, ck_slot = stage_long([counts.cumsum(0), pos, chunks, slots], device,
                                                   dtype=torch.int32)
    return ck_ptr, ck_pos, rows, ck_chunk, ck_slot, len(unique), in_order


def _rows_by_sequence(ck_out: torch.Tensor, rows: list[list[int]], state_shape: tuple) -> list[torch.Tensor]:
    """Each sequence's checkpoint states [n_ck, *state_shape] (fp32) from the sorted output: a view
    where its rows are consecutive (checkpoints in increasing position, as the engine asks), else a
    gather whose indices came over with every other such sequence's in one pinned transfer. (A
    `torch.tensor` of indices per sequence copies from pageable memory, which waits for the stream:
    a burst of 14 returning turns stalled the GPU 126 times in a 12-layer step.)"""
    def consecutive(r: list[int]) -> bool:
        return r == list(range(r[0], r[0] + len(r)))

    counts = [len(r) for r in rows]
    if 0 < sum(counts) == ck_out.shape[0] and [i for r in rows for i in r] == list(range(sum(counts))):
        # sequence-major, as the engine asks
        return list(ck_out.split(counts))  # the views in one call
    scattered = [r for r in rows if r and not consecutive(r)]
    staged = iter(stage_long(scattered, ck_out.device)) if scattered else iter(())
    out = []
    for r in rows:
        if not r:
            out.append(torch.zeros(0, *state_shape, device=ck_out.device, dtype=torch.float32))
        elif consecutive(r):
            out.append(ck_out[r[0]:r[0] + len(r)])
        else:
            out.append(ck_out.index_select(0, next(staged)))
    return out


def _scan_block(n_programs_per_block: int, bvf: int, device, narrowest: int = 32) -> int:
    """Value-block width of the scan: 64 unless that leaves three SMs in four idle or more (one
    64-token chunk step is a fixed latency, so a short grid wants narrower blocks), down to
    `narrowest`. On an H200 (132 SMs, BENCHMARKS.md "Chunk prefill vs fla"): 32 sequence-heads take
    BV = 32 (128 programs; 64 programs of BV = 64 took 21% longer for KDA), 64 take BV = 64 (128
    programs; 256 of BV = 32 took 6% longer)."""
    sms = num_sms(device)
    bv = min(64, bvf)
    while bv > narrowest and 4 * n_programs_per_block * (bvf // bv) < 3 * sms:
        bv //= 2
    return bv


def _register_cap(name: str, value) -> int | None:
    """A kernel's registers-per-thread cap (Triton's maxnreg launch option): None or 24 .. 255."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 24 <= value <= 255):
        raise ValueError(f"`{name}` must be None or an int in 24 .. 255, got {value!r}")
    return value


def _scan_stages(st: torch.dtype, BK: int, BV: int, wu_in_scan: bool, li_dtype: torch.dtype,
                 per_channel: bool = False) -> int:
    """Software-pipelining depth of the scan's loop: as many as fit ~211 KB of shared memory, up
    to 3 (an H200 block has 227 KB; the rest is the products' operand staging; KDA's per-channel
    scan at K = 128, BV = 32 fits three stages, 18% less time than two; at BV = 64 it does not).
    Each stage buffers one chunk's [64, .] operands: w, qg, kg (BK wide), u (BV) and aqk (64), or
    with wu_in_scan q, k, v, aqk and L^-1 (and the chunk-end keys with a per-channel gate). fp32 runs
    unpipelined: three stages needed 278 KB at K = V = 128 (issue 20's OutOfResources), and it is
    the accuracy path, not the fast one. bf16 / fp16 take at least _MIN_LOW_STAGES; where that
    does not fit (KDA at K = 256), the launch raises OutOfResources and hyla.ops.dispatch takes
    the torch path."""
    if st == torch.float32:
        return 1
    columns = ((3 if per_channel else 2) * BK + BV + 64) if wu_in_scan else (3 * BK + BV + 64)
    per_stage = columns * 64 * st.itemsize + (64 * 64 * li_dtype.itemsize if wu_in_scan else 0)
    return max(_MIN_LOW_STAGES, min(3, 211_000 // per_stage))


# Triton 3.6 also miscompiled chunk_scan_rows_kernel with a per-channel gate (the third, decayed-key
# tile) when L^-1 stayed fp32 beside bf16 operands (its tf32 product): o off by ~90% or NaN, the
# final state right, from the same Gram outputs (H200, B x T = 1 x 2048, K = V = 128). With L^-1 in
# the operands' precision it is right; chunk_fwd never launches the fp32 form with bf16 / fp16.

# Triton 3.6 miscompiles both scan kernels unpipelined with bf16 / fp16 operands on an H200:
# chunk_scan_rows_kernel gave wrong outputs at K = V = 128 (o off by 9x), chunk_scan_kernel an
# illegal address at K = 256 (seen in tests/gpu/test_triton_kernels.py). fp32 is unaffected.
_MIN_LOW_STAGES = 2

# chunk_checkpoint_rows_kernel with 4 warps at K = V = 64, BV = 32, bf16 (the bundled Qwen3.5's
# GDN) gave checkpoint states off by 30 or an illegal address on an H200 (Triton 3.6); 2 or 8
# warps there, and 8 at K = V = 128, are right. Its own warp count, not the scan's.
_CHECKPOINT_WARPS = 8


_CHECKPOINT_BLOCK_V = 32  # value columns a program of _checkpoints_by_recurrence


def _recurrence_rows(in_order, chunk_off_list, lengths, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For _checkpoints_by_recurrence: the token rows its segments read (each checkpoint's first r
    tokens of its chunk, in sorted order), the segments' cumulative lengths and each one's
    chunk-start slot, in one transfer."""
    seq_start = [0, *itertools.accumulate(lengths)]
    tokens, seg, slots = [], [0], []
    for gc, r, n, slot in in_order:
        t0 = seq_start[n] + (gc - chunk_off_list[n]) * CHUNK
        tokens.extend(range(t0, t0 + r))
        seg.append(seg[-1] + r)
        slots.append(slot)
    idx, cu_ck, slot_ix = stage_long([tokens, seg, slots], device)
    return idx, cu_ck, slot_ix


def _checkpoints_by_recurrence(q, k, v, g, beta, ck_start, rows_of_segments, gate_kw):
    """The checkpoint states of a per-channel (KDA) scan: for each checkpoint after r tokens of
    its chunk, the token recurrence (recurrent.recurrent_fwd, one varlen segment per checkpoint)
    over those r <= 64 tokens from the chunk-start state the scan stored (ck_start[slot]).
    rows_of_segments: _recurrence_rows(...) of the step's checkpoints
    -> [NCK, HV, K, V] fp32 in the sorted order of _checkpoint_tables. (A checkpoint kernel with
    the chunk form's products, as chunk_checkpoint_rows_kernel is for scalar gates, was
    miscompiled by Triton 3.6 on an H200 for the per-channel tiles: wrong states or illegal
    addresses; the recurrence is a few sequential steps of a kernel already in use for decode.)"""
    B, T = q.shape[:2]
    idx, cu_ck, slot_ix = rows_of_segments  # _recurrence_rows

    def rows(x):
        return x.reshape(B * T, *x.shape[2:]).index_select(0, idx).unsqueeze(0)

    # one value-block width whatever the count of checkpoints: recurrent_fwd's own rule picks it
    # from the count (16 / 32 / 64 columns on an H100 at 32 heads from 1 / 5 / 9 checkpoints), so
    # a server met a new compiled variant mid-burst (~0.4 s, scripts/first_steps.py). A 12-layer
    # FP8 step of 14 returning turns with a checkpoint each: 93.2 ms at 64 columns, 93.7 at 32.
    _, states = recurrent_fwd(rows(q), rows(k), rows(v), rows(g), rows(beta), gate="kda",
                              initial_state=ck_start.index_select(0, slot_ix), output_final_state=True,
                              cu_seqlens=cu_ck, block_v=_CHECKPOINT_BLOCK_V, **gate_kw)
    return states


def chunk_fwd(q, k, v, g, beta, *, gate, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64, checkpoint_positions=None,
              use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
              use_beta_sigmoid_in_kernel=False, intra_warps=4, slice_k=32, scan_block_v=None, scan_warps=None,
              factor_slice=None, factor_warps=4, scan_stages=None, scan_narrowest=32,
              precompute_gate=None, low_precision_inverse=None, gram_maxnreg=None, factor_maxnreg=None,
              wu_in_scan=None, ssm_state_indices=None, has_initial_state=None):
    """The shared forward of chunk_kda (gate="kda"), chunk_gated_delta_rule ("gdn") and
    chunk_delta_rule (None). The arguments after use_beta_sigmoid_in_kernel are launch parameters
    (the defaults: the H200's fastest, BENCHMARKS.md "Chunk prefill vs fla"): warps and channel-slice
    width of the chunk-local Gram kernel; value-block width (default: by grid size, down to
    scan_narrowest), warps and pipeline stages of the scan; width and warps of the slice programs
    of chunk_factors_kernel (factor_slice, factor_warps); precompute_gate: a fused gate's
    activation as a separate elementwise launch (hyla.ops.triton.gate) before them;
    low_precision_inverse: with bf16 / fp16 inputs, hand L^-1 to the kernel that applies it in
    that precision (its products then run as bf16 / fp16 matmuls) instead of fp32; the default
    (GDN: 7% faster on an H200, o error vs the fp32 path 2.9e-3 -> 3.3e-3) except on KDA's
    factor-kernel path (3% faster there, but the safe gate's error rose to 4.9e-3 of the 5e-3
    budget). KDA's scan form needs it: with bf16 / fp16 inputs, an fp32 L^-1 there was
    miscompiled, so low_precision_inverse=False sends KDA to the factor kernel's path;
    gram_maxnreg / factor_maxnreg: a register cap per thread for the two chunk-local kernels
    (more programs per SM, some spills to L1; default for the Gram kernel: 168 for KDA, 128
    otherwise, the fastest of the H200 sweep in BENCHMARKS.md "Chunk prefill vs fla");
    wu_in_scan (the default): chunk_factors_kernel is not launched; the scan
    (chunk_scan_rows_kernel: one more [64, 64] product per chunk) builds w, u, qg and kg from four
    row scales per chunk and q, k, v as they are (scalar or no gate) or, for a per-channel gate,
    the decayed tiles Q e^G, K e^G, K e^(G_C - G) that chunk_gram_kernel writes (its
    checkpoints then come from the token recurrence, _checkpoints_by_recurrence)."""
    if not isinstance(chunk_size, int) or chunk_size < 1 or (chunk_size > 16 and chunk_size % 16):
        raise ValueError(f"`chunk_size` must be <= 16 or a multiple of 16, got {chunk_size}")
    pooled = ssm_state_indices is not None
    n_seq = check_inputs(q, k, v, g, beta, gate=gate, initial_state=initial_state, cu_seqlens=cu_seqlens,
                         check_gate_sign=False, state_is_pool=pooled)
    check_chunk_pool(initial_state, ssm_state_indices, has_initial_state, n_seq)
    klast = pooled and pool_is_k_last(initial_state)
    if beta is None:
        raise ValueError("`beta` is required")
    if q.dtype == torch.float64 or v.dtype == torch.float64:
        raise ValueError("the Triton path computes in fp32; use the torch path for fp64")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K > 256 or V > 256:
        raise ValueError(f"the Triton path supports K, V <= 256, got K={K}, V={V}")
    dev = q.device
    scale = K ** -0.5 if scale is None else float(scale)
    BK, BVF = _pow2(K), _pow2(V)

    if precompute_gate is None:
        # in the kernels: 0.13-0.16 ms faster for KDA's gates v1 and v2 on an H200 (32K tokens x 32
        # heads; BENCHMARKS.md "Chunk prefill vs fla") than writing the fp32 gate and reading it back
        precompute_gate = False
    if factor_slice is None:  # 64-wide slices for scalar decays (fewer, larger programs), 32 for KDA
        factor_slice = 32 if gate == "kda" else 64
    if gram_maxnreg is None:
        gram_maxnreg = 168 if gate == "kda" else 128
    gram_maxnreg = _register_cap("gram_maxnreg", gram_maxnreg)
    factor_maxnreg = _register_cap("factor_maxnreg", factor_maxnreg)
    if precompute_gate and use_gate_in_kernel and g is not None:
        # the gate activation as its own elementwise launch: fp32 log-decays, then the
        # precomputed-gate kernels (one activation per element instead of one per kernel pass)
        if gate == "kda":
            g, _ = kda_gate_beta(g, beta, A_log.reshape(-1).float(), dt_bias, lower_bound)
        else:
            g, _ = gdn_gate_beta(g, beta, A_log.reshape(-1).float(), dt_bias)
        use_gate_in_kernel = False
    gate_fn, a_log, dtb, lb = gate_params(gate, use_gate_in_kernel, A_log, dt_bias, lower_bound, HV, K, dev)

    cu, lengths, off_list, chunk_off, chunk_seq, chunk_pos = _chunk_tables(cu_seqlens, B, T, dev)
    N = len(lengths)
    NCH = off_list[-1]
    ckpts = None if checkpoint_positions is None else check_checkpoints(checkpoint_positions, lengths)
    # Matmul operands of pass 2 are stored in the input precision (bf16 / fp16), fp32 otherwise.
    low = {q.dtype, k.dtype, v.dtype}
    st = q.dtype if len(low) == 1 and q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    if gate == "kda" and st != torch.float32 and low_precision_inverse is False:
        # the per-channel scan with an fp32 L^-1 beside bf16 / fp16 operands is miscompiled by
        # Triton 3.6 (note above _MIN_LOW_STAGES): an fp32 L^-1 takes the factor kernel's path
        if wu_in_scan:
            raise ValueError("`wu_in_scan=True` with a per-channel (kda) gate and bf16 / fp16 inputs needs "
                             "`low_precision_inverse` (an fp32 L^-1 there is miscompiled by Triton 3.6)")
        wu_in_scan = False
    wu_in_scan = True if wu_in_scan is None else bool(wu_in_scan)
    per_channel = wu_in_scan and gate == "kda"  # the Gram kernel writes the decayed q / k tiles
    if low_precision_inverse is None:
        low_precision_inverse = gate != "kda" or per_channel
    # fp32 inputs: 3-pass tf32 (about fp32 accuracy on tensor cores); bf16 / fp16: tf32 for the fp32
    # products of pass 1 (the low-precision operands of pass 2 ignore it).
    prec = "tf32x3" if st == torch.float32 else "tf32"
    if scan_stages is not None and st != torch.float32 and scan_stages < _MIN_LOW_STAGES:
        raise ValueError(f"`scan_stages` must be >= {_MIN_LOW_STAGES} with {st} inputs (an unpipelined "
                         f"low-precision scan is miscompiled by Triton 3.6), got {scan_stages}")
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    gc = qc if g is None else g.contiguous()
    bc = beta.contiguous()

    if not wu_in_scan:
        w = torch.empty(NCH, HV, CHUNK, BK, device=dev, dtype=st)
        qg = torch.empty_like(w)
        kg = torch.empty_like(w)
        u = torch.empty(NCH, HV, CHUNK, BVF, device=dev, dtype=st)
    if per_channel:  # Q e^G, K e^G, K e^(G_C - G) per value head, token-major like q
        qe, ke, kd = (torch.empty(B, T, HV, K, device=dev, dtype=st) for _ in range(3))
    else:
        qe = ke = kd = None
    aqk = torch.empty(NCH, HV, CHUNK, CHUNK, device=dev, dtype=st)
    gam = torch.empty(NCH, HV, BK, device=dev, dtype=torch.float32)

    has_ck = bool(ckpts) and any(len(ps) for ps in ckpts)
    if has_ck:
        ck_step = _step_checkpoint_tables(cu_seqlens, ckpts, off_list, NCH, dev)
        ck_ptr, ck_pos, ck_rows, ck_chunk, ck_slot, n_slots, ck_order = ck_step["tables"]
        NCK = ck_pos.numel()
        # the scan's start states of the chunks that hold checkpoints (wu_in_scan)
        ck_start = torch.empty(n_slots if wu_in_scan else 0, HV, K, V, device=dev, dtype=torch.float32)
        if per_channel:  # the recurrence (_checkpoints_by_recurrence) returns the states
            kr = dr = ck_out = chunk_off
        else:
            # kr: [64, BK] per checkpoint, or its [64] row scale when the scan scales raw keys
            kr = torch.empty(NCK, HV, CHUNK, *(() if wu_in_scan else (BK,)), device=dev, dtype=torch.float32)
            dr = torch.empty(NCK, HV, BK, device=dev, dtype=torch.float32)
            ck_out = torch.empty(NCK, HV, K, V, device=dev, dtype=torch.float32)
    else:
        ck_ptr = ck_pos = kr = dr = ck_out = ck_slot = ck_start = chunk_off  # unused placeholders

    if NCH:
        li = torch.empty(NCH, HV, CHUNK, CHUNK, device=dev, dtype=torch.float32)
        li_low = torch.empty_like(li, dtype=st) if low_precision_inverse and st != torch.float32 else li
        row_factors = torch.empty(NCH, HV, 4 if wu_in_scan else 3, CHUNK, device=dev, dtype=torch.float32)
        common = dict(GATE=_GATES[gate], GATE_FN=gate_fn, HAS_BIAS=dtb is not None, PREC=prec)
        # a per-channel gate: the fast pass, then the steep chunks it flagged (chunk_gram_kernel)
        # with a gate, the factor kernel's fast pass skips the flagged chunks' channel slices
        steep = (torch.empty(NCH, HV, device=dev, dtype=torch.int32)
                 if gate == "kda" or (gate is not None and not wu_in_scan) else chunk_off)
        for gram_pass in ((1, 2) if gate == "kda" else (0,)):
            chunk_gram_kernel[(NCH, HV)](
                qc, kc, gc, bc,
                a_log if a_log is not None else chunk_off, dtb if dtb is not None else chunk_off,
                lb, scale, cu, chunk_seq, chunk_pos, aqk, li, li_low, row_factors, steep,
                gam, ck_ptr, ck_pos, kr, dr,
                *((qe, ke, kd) if per_channel else (chunk_off,) * 3),
                H=H, HV=HV, K=K, BK=BK, BKS=min(BK, slice_k),
                USE_L2NORM=bool(use_qk_l2norm_in_kernel), BETA_SIGMOID=bool(use_beta_sigmoid_in_kernel),
                PASS=gram_pass, ROW_FORM=wu_in_scan, HAS_CKPT=has_ck and wu_in_scan and not per_channel,
                num_warps=intra_warps, maxnreg=gram_maxnreg, **common,
            )
    if NCH and not wu_in_scan:
        bks, bvs = min(BK, factor_slice), min(BVF, factor_slice)
        # pass 1: all u slices and the unflagged chunks' channel slices; pass 2: the flagged ones
        for factor_pass, slices in (((1, BK // bks + BVF // bvs), (2, BK // bks)) if gate is not None
                                    else ((0, BK // bks + BVF // bvs),)):
            chunk_factors_kernel[(slices, NCH, HV)](
                qc, kc, vc, gc,
                a_log if a_log is not None else chunk_off, dtb if dtb is not None else chunk_off, lb,
                cu, chunk_seq, chunk_pos, li_low, row_factors, steep,
                w, u, qg, kg, gam, ck_ptr, ck_pos, kr, dr,
                H=H, HV=HV, K=K, V=V, BK=BK, BV=BVF, BKS=bks, BVS=bvs, HAS_CKPT=has_ck,
                PASS=factor_pass, num_warps=factor_warps, maxnreg=factor_maxnreg, **common,
            )

    o = torch.empty(B, T, HV, V, device=dev, dtype=v.dtype)
    if pooled:  # the pool in place: each sequence's start and final state are its slot
        h0 = final = initial_state
        idx = ssm_state_indices
        mask_h0 = has_initial_state is not None
        has_init = has_initial_state if mask_h0 else idx
    else:
        final = torch.empty(N, HV, K, V, device=dev, dtype=torch.float32) if output_final_state else None
        h0 = initial_state.contiguous() if initial_state is not None else None
        idx = has_init = gam
        mask_h0 = False
    BV = scan_block_v or _scan_block(N * HV, BVF, dev, scan_narrowest)
    stages = scan_stages or _scan_stages(st, BK, BV, wu_in_scan, li_low.dtype if NCH else st, per_channel)
    launch = dict(HAS_H0=h0 is not None, STORE_HT=final is not None, HAS_CKPT=has_ck, PREC=prec,
                  POOL=pooled, KLAST=klast, MASK_H0=mask_h0,
                  num_warps=scan_warps or (4 if BV <= 64 else 8), num_stages=stages)
    if N and wu_in_scan:
        # with a per-channel gate the scan reads the decayed tiles (one per value head) for q and k
        sq_, sk_, skd, s_heads = (qe, ke, kd, HV) if per_channel else (qc, kc, kc, H)
        chunk_scan_rows_kernel[(triton.cdiv(V, BV), N * HV)](
            sq_, sk_, skd, vc, li_low if NCH else gam, aqk, row_factors if NCH else gam, gam,
            h0 if h0 is not None else gam, final if final is not None else gam, o,
            cu, chunk_off, ck_slot, ck_start, idx, has_init,
            H=s_heads, HV=HV, K=K, V=V, BK=BK, BV=BV, PER_CHANNEL=per_channel, **launch,
        )
        if has_ck and per_channel:
            if "recurrence" not in ck_step:
                ck_step["recurrence"] = _recurrence_rows(ck_order, off_list, lengths, dev)
            ck_out = _checkpoints_by_recurrence(
                q, k, v, g, beta, ck_start, ck_step["recurrence"], dict(
                    scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                    lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel))
        elif has_ck:
            chunk_checkpoint_rows_kernel[(triton.cdiv(V, BV), NCK, HV)](
                kc, vc, li_low, aqk, row_factors, ck_start, ck_slot, ck_chunk, kr, dr, ck_out,
                cu, chunk_seq, chunk_pos,
                H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, PREC=prec, num_warps=_CHECKPOINT_WARPS,
            )
    elif N:
        chunk_scan_kernel[(triton.cdiv(V, BV), N * HV)](
            w, u, qg, kg, aqk, gam,
            h0 if h0 is not None else gam, final if final is not None else gam, o,
            cu, chunk_off,
            ck_ptr, kr, dr, ck_out, idx, has_init,
            HV=HV, K=K, V=V, BK=BK, BVF=BVF, BV=BV, **launch,
        )
    if ckpts is None:
        return o, final
    return o, final, _rows_by_sequence(ck_out, ck_rows if has_ck else [[] for _ in ckpts], (HV, K, V))


# The public ops: the torch references' signatures (hyla.ops.chunk), chunk_fwd underneath.
chunk_kda = utils.backend_twin(_reference.chunk_kda, chunk_fwd, gate="kda")
chunk_gated_delta_rule = utils.backend_twin(_reference.chunk_gated_delta_rule, chunk_fwd, gate="gdn")
chunk_delta_rule = utils.backend_twin(_reference.chunk_delta_rule, chunk_fwd, gate=None, g=None)