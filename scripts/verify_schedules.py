"""Speculative verify over a K-last state pool (issue 20, eleventh pass): the shipped launch, a
no-work floor of the verify's pool traffic, and a persistent schedule that prefetches the next
tile's state while it steps the current one.

    python scripts/verify_schedules.py                              # GPU: the table
    TRITON_INTERPRET=1 python scripts/verify_schedules.py --check   # CPU: the scratch kernels are exact

The verify with rollback "slots" reads one state per (row, head) and writes T: the state after
each of the row's T tokens goes to its own slot. At N = 64 rows x 2 tokens over 32 KDA heads the
shipped one-program-per-tile launch moves those bytes at 83% of copy bandwidth (BENCHMARKS.md,
eleventh pass) against 87-92% for decode. "floor" is the same reads and writes with no work
(one program per 8- or 16-column tile); "persistent B / P" keeps P programs per SM walking
B-column tiles, the next tile's state loaded before the current one is stepped. Uniform rows
(T tokens each, every draft accepted at 1), KDA with precomputed gates, as the engine's
CUDA-graph verify runs it.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hyla.contract import as_k_last
from hyla.ops.triton import recurrent as rec
from hyla.ops.triton.recurrent_step import state_offsets, token_step


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
def _tile_state(pool, idx, tile, n_tiles, NVB: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BV: tl.constexpr, T: tl.constexpr):
    """Tile number -> (its start state [K, BV] from slot idx[n, 0], that slot or -1 past the end,
    row, value head, value columns)."""
    in_range = tile < n_tiles
    t = tl.where(in_range, tile, 0)
    i_nh = t // NVB
    i_n = i_nh // HV
    i_hv = i_nh % HV
    o_v = (t % NVB) * BV + tl.arange(0, BV)
    slot = tl.where(in_range, tl.load(idx + i_n * T).to(tl.int64), -1)
    off = (tl.maximum(slot, 0) * HV + i_hv) * K * V + state_offsets(tl.arange(0, K), o_v, K, V, True)
    return tl.load(pool + off, mask=slot >= 0, other=0.0), slot, i_n, i_hv, o_v


@triton.jit
def _steps(b_s, slot, i_n, i_hv, o_v, q, k, v, g, beta, scale, o, pool, idx, H: tl.constexpr, HV: tl.constexpr,
           K: tl.constexpr, V: tl.constexpr, T: tl.constexpr):
    """Row i_n's T tokens on one tile: outputs, and the state after token j to slot idx[n, j]."""
    o_k = tl.arange(0, K)
    tile = i_hv * K * V + state_offsets(o_k, o_v, K, V, True)
    for j in range(T):
        row = i_n * T + j
        b_s, b_o = token_step(b_s, q, k, v, g, beta, row, i_hv // (HV // H), i_hv, o_k, o_v, 0.0, 0.0, 0.0, scale,
                              H * K, H * K, HV * V, H, HV, K, V, 2, 0, True, False)
        tl.store(o + (row * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=slot >= 0)
        dst = tl.load(idx + i_n * T + j).to(tl.int64)
        tl.store(pool + tl.maximum(dst, 0) * HV * K * V + tile, b_s, mask=(dst >= 0) & (slot >= 0))


@triton.jit(do_not_specialize=["scale", "n_tiles"])
def persistent_verify_kernel(q, k, v, g, beta, scale, o, pool, idx, n_tiles, H: tl.constexpr, HV: tl.constexpr,
                             K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, T: tl.constexpr):
    """Grid: a fixed number of programs walking the N * HV * V / BV tiles with a stride, the
    next tile's state loaded into registers before the current tile's T steps."""
    NVB: tl.constexpr = V // BV
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cur, slot, i_n, i_hv, o_v = _tile_state(pool, idx, pid, n_tiles, NVB, HV, K, V, BV, T)
    for tile in range(pid, n_tiles, step):
        nxt, n_slot, n_n, n_hv, n_v = _tile_state(pool, idx, tile + step, n_tiles, NVB, HV, K, V, BV, T)
        _steps(cur, slot, i_n, i_hv, o_v, q, k, v, g, beta, scale, o, pool, idx, H, HV, K, V, T)
        cur, slot, i_n, i_hv, o_v = nxt, n_slot, n_n, n_hv, n_v


def persistent_verify(q, k, v, g, beta, pool, idx, T: int, block_v: int = 8, programs_per_sm: int = 16,
                      sms: int = 132) -> torch.Tensor:
    """q, k [1, N*T, H, K] bf16, v [1, N*T, HV, V], g [1, N*T, HV, K] fp32 log-decays, beta
    [1, N*T, HV]; pool K-last [slots, HV, K, V] fp32; idx [N, T] int32 -> o [1, N*T, HV, V]."""
    _, NT, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = torch.empty_like(v)
    n_tiles = NT // T * HV * (V // block_v)
    persistent_verify_kernel[(min(n_tiles, programs_per_sm * sms),)](
        q, k, v, g, beta, K ** -0.5, o, pool, idx, n_tiles, H=H, HV=HV, K=K, V=V, BV=block_v, T=T, num_warps=1)
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
    """The persistent scratch kernel equals the shipped verify; the floor writes what it read."""
    gen = torch.Generator(device=dev).manual_seed(0)
    for T in (2, 3):
        q, k, v, g, beta, idx, kw = inputs(5, T, 2, 32, 20, dev, gen)
        pool = as_k_last(torch.randn(20, 2, 32, 32, device=dev, generator=gen))
        p_ref = pool.clone()
        o_ref, _ = rec.recurrent_fwd(q, k, v, g, beta, initial_state=p_ref, **kw)
        p = pool.clone()
        o = persistent_verify(q, k, v, g, beta, p, idx, T, sms=2)
        torch.testing.assert_close(o.float(), o_ref.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-5)
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
    D, H, slots = 128, 32, 1100
    pool = as_k_last(torch.randn(slots, H, D, D, device="cuda", generator=gen))
    print(f"{torch.cuda.get_device_name()}: copy {copy_bw / 1e12:.2f} TB/s; KDA {H} heads, D = {D}; us (% of copy)")
    for N, T in ((64, 2), (64, 4), (256, 2)):
        q, k, v, g, beta, idx, kw = inputs(N, T, H, D, slots, "cuda", gen)
        nbytes = N * H * D * D * 4 * (1 + T)
        res = {"shipped": t(lambda: rec.recurrent_fwd(q, k, v, g, beta, initial_state=pool, **kw))}
        for bv in (8, 16):
            res[f"floor {bv}"] = t(lambda: floor_kernel[(D // bv, N * H)](pool, idx, T=T, HV=H, K=D, V=D, BV=bv,
                                                                          num_warps=1))
        for bv, pps in ((8, 16), (16, 8), (8, 24), (16, 12), (8, 32)):
            res[f"persistent {bv} / {pps}"] = t(lambda: persistent_verify(q, k, v, g, beta, pool, idx, T, bv, pps, sms))
        print(f"N = {N} x T = {T} | " + " | ".join(
            f"{name} {us:.1f} ({100 * nbytes / (us * 1e-6) / copy_bw:.0f}%)" for name, us in res.items()), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="CPU interpreter: the scratch kernels are exact")
    args = ap.parse_args()
    check() if args.check else table()
