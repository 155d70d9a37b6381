"""Speculative verify over a K-last state pool (issue 20, eleventh and twelfth passes): the
shipped launch, a no-work floor of the verify's pool traffic, the shipped kernel with the next
token's inputs prefetched, and the persistent pool kernel.

    python scripts/verify_schedules.py                              # GPU: the table
    TRITON_INTERPRET=1 python scripts/verify_schedules.py --check   # CPU: the floor kernel is exact

The verify with rollback "slots" reads one state per (row, head) and writes T: the state after
each of the row's T tokens goes to its own slot. At N = 64 rows x 2 tokens over 32 KDA heads the
shipped one-program-per-tile launch moves those bytes at 83% of copy bandwidth (BENCHMARKS.md,
eleventh and twelfth passes) against 87-92% for decode. Columns: "floor B" is the same reads and
writes with no work (one program per B-column tile); "prefetch B" one program per B-column tile
with token t + 1's inputs loaded before token t's state is stored (prefetch_next_token);
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
from hyla.ops.triton.recurrent_step import state_offsets


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
    """The floor kernel writes what it read."""
    gen = torch.Generator(device=dev).manual_seed(0)
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
                res[f"prefetch {bv}"] = t(lambda: run(prefetch_next_token=True, block_v=bv, num_warps=1))
            for bv, pps in ((8, 24), (16, 8)):
                res[f"persistent {bv} / {pps}"] = t(lambda: run(persistent=True, block_v=bv, programs_per_sm=pps,
                                                                num_warps=1))
            print(f"{gate} N = {N} x T = {T} | " + " | ".join(
                f"{name} {us:.1f} ({100 * nbytes / (us * 1e-6) / copy_bw:.0f}%)" for name, us in res.items()),
                flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="CPU interpreter: the floor kernel is exact")
    args = ap.parse_args()
    check() if args.check else table()
