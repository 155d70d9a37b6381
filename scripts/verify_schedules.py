"""Speculative verify over a K-last state pool: the shipped launch (one warp per 8-column tile,
the next token prefetched), a no-work floor of the verify's pool traffic, the same kernel without
the prefetch, and the persistent pool kernel.

    python scripts/verify_schedules.py                              # GPU: the table
    TRITON_INTERPRET=1 python scripts/verify_schedules.py --check   # CPU: its kernels are exact

The verify with rollback "slots" reads one state per (row, head) and writes T: the state after
each of the row's T tokens goes to its own slot (BENCHMARKS.md "Recurrent decode and verify").
Columns: "floor B" is the same reads and writes with no work (one program per B-column tile);
"no prefetch B" one program per B-column tile with token t + 1's inputs and state slot loaded only
after token t's stores (prefetch_next_token=False); "prefetch 16" the shipped kernel on 16 columns;
"all tokens first B / Ww" a scratch verify that loads all the row's inputs before its first store
(registers grow with T: scripts/kernel_registers.py, BENCHMARKS.md "Recurrent decode and verify");
"persistent B / P" the persistent pool kernel (recurrent_decode.py) with P programs per SM
walking B-column tiles, the next tile's state loaded before the current one is stepped. Uniform
rows (T tokens each, every draft accepted at 1), KDA and GDN with precomputed gates, as the
engine's CUDA-graph verify runs them.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hyla.contract import as_k_last
from hyla.ops.triton import recurrent as rec
from hyla.ops.triton.recurrent_step import position_slot, row_span, start_slot, state_offsets, token_update


@triton.jit
def floor_kernel(pool, idx, T: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """Grid (V / BV, N * HV). No work: row n's tile read from slot idx[n, 0], written to
    idx[n, 0 .. T-1]."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    o_v = i_v * BV + tl.arange(0, BV)
    tile = i_hv * K * V + state_offsets(tl.arange(0, K), o_v, K, V, True)
    b = tl.load(pool + tl.load(idx + i_n * T).to(tl.int64) * HV * K * V + tile)
    for j in range(T):
        tl.store(pool + tl.load(idx + i_n * T + j).to(tl.int64) * HV * K * V + tile, b + 0.0)


@triton.jit
def _row(tile, rows, j):
    """Row j of a [TP, X] tile as an [X] vector (a masked sum: register tiles are not indexable)."""
    return tl.sum(tl.where(rows[:, None] == j, tile, 0.0), axis=0)


@triton.jit
def all_tokens_first_kernel(q, k, v, g, beta, scale, o, pool, cu, idx, n_acc, H: tl.constexpr, HV: tl.constexpr,
                            K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, W: tl.constexpr, TP: tl.constexpr,
                            GATE: tl.constexpr):
    """Grid (V / BV, N * HV), a K-last pool, q / k L2-normed here. The verify with every token's
    inputs of the row ([TP = next_pow2(W), K] tiles) loaded before the first state store, then
    the W steps unrolled (recurrent_step.token_update on each token's row of those tiles).
    GATE 2: per-channel log-decays [rows, HV, K]; 1: per-head [rows, HV]."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos = row_span(cu, i_n, 0, True)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    rows = tl.arange(0, TP)
    tr = bos + rows
    m_t = tr < eos
    tile = i_hv * K * V + state_offsets(o_k, o_v, K, V, True)
    slot0 = start_slot(idx, n_acc, i_n, W, True, False)
    b_s = tl.load(pool + tl.maximum(slot0, 0) * HV * K * V + tile, mask=slot0 >= 0, other=0.0)
    qa = tl.load(q + (tr[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)
    ka = tl.load(k + (tr[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)
    va = tl.load(v + (tr[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)
    ba = tl.load(beta + tr * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    if GATE == 2:
        ga = tl.load(g + (tr[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_t[:, None], other=0.0)
    else:
        ga = tl.load(g + tr * HV + i_hv, mask=m_t, other=0.0)
    qa = qa / tl.sqrt(tl.sum(qa * qa, axis=1) + 1e-6)[:, None]
    ka = ka / tl.sqrt(tl.sum(ka * ka, axis=1) + 1e-6)[:, None]
    for j in tl.static_range(W):
        t = bos + j
        if t < eos:
            if GATE == 2:
                b_g = _row(ga, rows, j)
            else:
                b_g = tl.sum(tl.where(rows == j, ga, 0.0), axis=0)
            b_s, b_o = token_update(b_s, _row(qa, rows, j), _row(ka, rows, j), _row(va, rows, j),
                                    tl.sum(tl.where(rows == j, ba, 0.0), axis=0), b_g, o_k, 0.0, 0.0, 0.0, scale, K,
                                    GATE, 0, False, False)
            tl.store(o + (t * HV + i_hv) * V + o_v, tl.where(slot0 >= 0, b_o, 0.0).to(o.dtype.element_ty))
            dst = position_slot(idx, i_n, j, W)
            tl.store(pool + tl.maximum(dst, 0) * HV * K * V + tile, b_s, mask=(dst >= 0) & (slot0 >= 0))


def all_tokens_first(q, k, v, g, beta, pool, kw, block_v: int = 8, num_warps: int = 1) -> torch.Tensor:
    """q, k [1, rows, H, K], v [1, rows, HV, V], g log-decays, beta [1, rows, HV]; pool K-last; kw
    as inputs() gives it -> o [1, rows, HV, V]."""
    _, _, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    idx = kw["ssm_state_indices"]
    N, W = idx.shape
    o = torch.empty_like(v)
    all_tokens_first_kernel[(V // block_v, N * HV)](
        q, k, v, g, beta, K ** -0.5, o, pool, kw["cu_seqlens"], idx, kw["num_accepted_tokens"], H=H, HV=HV, K=K, V=V,
        BV=block_v, W=W, TP=triton.next_power_of_2(W), GATE=2 if kw["gate"] == "kda" else 1, num_warps=num_warps)
    return o


def inputs(N, T, H, D, slots, dev, gen):
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    q, k, v = (r(1, N * T, H, D).bfloat16() for _ in range(3))
    g = F.logsigmoid(r(1, N * T, H, D))
    beta = torch.rand(1, N * T, H, device=dev, generator=gen).bfloat16()
    idx = torch.randperm(slots, device=dev, generator=gen)[:N * T].view(N, T).to(torch.int32)
    kw = dict(gate="kda", use_qk_l2norm_in_kernel=True, ssm_state_indices=idx,
              num_accepted_tokens=torch.ones(N, device=dev, dtype=torch.int32),
              cu_seqlens=torch.arange(0, N * T + 1, T, device=dev, dtype=torch.int32))
    return q, k, v, g, beta, idx, kw


def check(dev: str = "cpu") -> None:
    """The floor kernel writes what it read; the all-tokens-first verify equals the shipped one
    (outputs and every slot), with accepted counts > 1 and a padding row."""
    gen = torch.Generator(device=dev).manual_seed(0)
    for gate in ("kda", "gdn"):
        q, k, v, g, beta, idx, kw = inputs(5, 3, 2, 32, 20, dev, gen)
        if gate == "gdn":
            g = g[..., 0].contiguous()
        kw["gate"] = gate
        kw["num_accepted_tokens"] = torch.tensor([1, 3, 2, 1, 2], device=dev, dtype=torch.int32)
        idx[3] = -1
        pool = as_k_last(torch.randn(20, 2, 32, 32, device=dev, generator=gen))
        p_ref, p = pool.clone(), pool.clone()
        o_ref, _ = rec.recurrent_fwd(q, k, v, g, beta, initial_state=p_ref, **kw)
        o = all_tokens_first(q, k, v, g, beta, p, kw)
        torch.testing.assert_close(o.float(), o_ref.float(), rtol=1e-2, atol=1e-2)  # bf16 outputs
        torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-5)
        print(f"ok: all tokens first, {gate}")
    for T in (2, 3):
        idx = torch.randperm(20, device=dev, generator=gen)[:5 * T].view(5, T).to(torch.int32)
        pool = as_k_last(torch.randn(20, 2, 32, 32, device=dev, generator=gen))
        p = pool.clone()
        floor_kernel[(4, 10)](p, idx, T=T, HV=2, K=32, V=32, BV=8)
        for n in range(5):
            for j in range(T):
                assert torch.equal(p[idx[n, j]], pool[idx[n, 0]])
        print(f"ok: T = {T}")


def table() -> None:
    import triton.testing as tt

    from hyla.bench.kernels import _ceilings

    copy_bw, _ = _ceilings()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    t = lambda f: tt.do_bench_cudagraph(f, rep=40, return_mode="median") * 1e3  # noqa: E731
    gen = torch.Generator(device="cuda").manual_seed(3)
    D, H, slots = 128, 32, 1300
    pool = as_k_last(torch.randn(slots, H, D, D, device="cuda", generator=gen))
    print(f"{torch.cuda.get_device_name()} ({sms} SMs): copy {copy_bw / 1e12:.2f} TB/s; {H} heads, D = {D}; "
          f"us (% of copy)")
    for gate in ("kda", "gdn"):
        for N, T in ((64, 2), (64, 4), (256, 2), (256, 4)):
            q, k, v, g, beta, idx, kw = inputs(N, T, H, D, slots, "cuda", gen)
            if gate == "gdn":
                g = g[..., 0].contiguous()
            kw["gate"] = gate
            nbytes = N * H * D * D * 4 * (1 + T)
            run = lambda **knobs: rec.recurrent_fwd(q, k, v, g, beta, initial_state=pool, **kw, **knobs)  # noqa
            res = {"shipped": t(run)}
            for bv in (8, 16):
                res[f"floor {bv}"] = t(lambda: floor_kernel[(D // bv, N * H)](pool, idx, T=T, HV=H, K=D, V=D, BV=bv,
                                                                              num_warps=1))
            for bv in (8, 16):
                res[f"no prefetch {bv}"] = t(lambda: run(prefetch_next_token=False, block_v=bv, num_warps=1))
            res["prefetch 16"] = t(lambda: run(prefetch_next_token=True, block_v=16, num_warps=1))
            for bv, w in ((8, 1), (32, 4)):
                res[f"all tokens first {bv} / {w}w"] = t(lambda: all_tokens_first(q, k, v, g, beta, pool, kw, bv, w))
            for bv, pps in ((8, 24), (16, 8)):
                res[f"persistent {bv} / {pps}"] = t(lambda: run(persistent=True, block_v=bv, programs_per_sm=pps,
                                                                num_warps=1))
            print(f"{gate} N = {N} x T = {T} | " + " | ".join(
                f"{name} {us:.1f} ({100 * nbytes / (us * 1e-6) / copy_bw:.0f}%)" for name, us in res.items()),
                flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="CPU interpreter: its kernels are exact")
    args = ap.parse_args()
    check() if args.check else table()
