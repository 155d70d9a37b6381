"""Pool decode schedules side by side (BENCHMARKS.md "Recurrent decode and verify"): the persistent
kernel's two loop forms at several launch shapes, one program per tile, and two floors of the
same bytes, over a V-contiguous [slots, HV, K, V] pool; then the default launch and the RMW floor
over a K-last pool (hyla.contract.state_pool, the engine's layout).

    python scripts/decode_schedules.py                     # GPU: the table
    python scripts/decode_schedules.py --threshold         # GPU: persistent vs one program per tile, small N
    TRITON_INTERPRET=1 python scripts/decode_schedules.py --check   # CPU: every schedule equals the default

Schedules (loop form, value block, warps, programs per SM): "prefetch" keeps the next tile's
state in registers (STAGES = 0), "pipelined S" leaves the loop to Triton's pipeliner with S
stages. The floors: "RMW" reads and writes the same pool tiles with the prefetch schedule and no
work; "copy" is torch's contiguous copy of the same number of bytes. The schedule columns and
"one program per tile" are over the V-contiguous pool; "K-last" columns over the K-last one.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hyla.contract import as_k_last
from hyla.ops.triton import recurrent as rec
from hyla.ops.triton.recurrent_decode import _state_tile, _tile_mask
from hyla.ops.triton.recurrent_step import state_offsets

SCHEDULES = {  # name: (STAGES, BV, warps, programs per SM)
    "prefetch 16 / 1 w / 8": (0, 16, 1, 8),
    "pipelined 4, 32 / 2 w / 3": (4, 32, 2, 3),
    "pipelined 4, 16 / 2 w / 3": (4, 16, 2, 3),
    "pipelined 4, 16 / 1 w / 8": (4, 16, 1, 8),
}
CELLS = [  # gate, fused gate, H, HV, D
    ("kda", False, 32, 32, 128), ("kda", True, 32, 32, 128), ("gdn", False, 16, 32, 128),
    ("gdn", True, 16, 32, 128), ("gdn", False, 16, 32, 256),
]


@triton.jit
def rmw_kernel(pool, idx, n_tiles, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
               KLAST: tl.constexpr):
    """The prefetch schedule's pool traffic with no work: each tile loaded and stored back (with
    as many programs as tiles, one tile each: one program per tile's traffic)."""
    NVB: tl.constexpr = V // BV
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    o_k = tl.arange(0, K)
    cur, slot, i_n, i_hv, o_v = _state_tile(pool, idx, idx, pid, n_tiles, NVB, HV, K, V, K, BV, KLAST, 1, False)
    for tile in range(pid, n_tiles, step):
        nxt, n_slot, n_n, n_hv, n_v = _state_tile(pool, idx, idx, tile + step, n_tiles, NVB, HV, K, V, K, BV, KLAST, 1,
                                                  False)
        off = (tl.maximum(slot, 0) * HV + i_hv) * K * V + state_offsets(o_k, o_v, K, V, KLAST)
        tl.store(pool + off, cur, mask=_tile_mask(o_k, o_v, slot, K, V, K, BV))
        cur, slot, i_n, i_hv, o_v = nxt, n_slot, n_n, n_hv, n_v


def inputs(N, H, HV, D, gate, fused, slots, dev, gen):
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    q, k = (r(N, 1, H, D).bfloat16() for _ in range(2))
    v = r(N, 1, HV, D).bfloat16()
    beta = torch.rand(N, 1, HV, device=dev, generator=gen).bfloat16()
    gshape = (N, 1, HV, D) if gate == "kda" else (N, 1, HV)
    kw = dict(use_qk_l2norm_in_kernel=True)
    if fused:
        g = r(*gshape).bfloat16()
        kw.update(use_gate_in_kernel=True, A_log=torch.rand(HV, device=dev, generator=gen),
                  dt_bias=r(HV * D if gate == "kda" else HV) * 0.1)
    else:
        g = F.logsigmoid(r(*gshape))
    idx = torch.randperm(slots, device=dev, generator=gen)[:N].to(torch.int32)
    return q, k, v, g, beta, idx, kw


def launch(schedule, q, k, v, g, beta, pool, idx, gate, kw):
    """The persistent kernel at an explicit schedule (recurrent_fwd picks one by K)."""
    stages, bv, warps, pps = schedule
    o, _ = rec.recurrent_fwd(q, k, v, g, beta, gate=gate, initial_state=pool, ssm_state_indices=idx,
                             persistent=True, block_v=bv, num_warps=warps, programs_per_sm=pps,
                             decode_stages=stages, **kw)
    return o


def check():
    gen = torch.Generator().manual_seed(0)
    for gate, fused, D in (("kda", False, 32), ("gdn", True, 64)):
        q, k, v, g, beta, idx, kw = inputs(5, 2, 4, D, gate, fused, 12, "cpu", gen)
        pool = torch.randn(12, 4, D, D, generator=gen)
        p_ref = pool.clone()
        o_ref, _ = rec.recurrent_fwd(q, k, v, g, beta, gate=gate, initial_state=p_ref, ssm_state_indices=idx, **kw)
        for name, schedule in SCHEDULES.items():
            p = pool.clone()
            o = launch(schedule, q, k, v, g, beta, p, idx, gate, kw)
            torch.testing.assert_close(o.float(), o_ref.float(), rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-5)
        p = as_k_last(pool)
        o = rec.recurrent_fwd(q, k, v, g, beta, gate=gate, initial_state=p, ssm_state_indices=idx, **kw)[0]
        torch.testing.assert_close(o.float(), o_ref.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-5)
        for klast in (False, True):
            p = as_k_last(pool) if klast else pool.clone()
            rmw_kernel[(4,)](p, idx, 5 * 4 * (D // 16), HV=4, K=D, V=D, BV=16, KLAST=klast)
            torch.testing.assert_close(p, pool)
        print(f"ok: {gate}{' fused' if fused else ''} D={D}, {len(SCHEDULES)} schedules and the RMW floor")


def _timer():
    import triton.testing as tt

    def t(f):
        ms = tt.do_bench_cudagraph(f, rep=100, return_mode="median")
        torch.cuda.synchronize()
        return ms * 1e3  # us
    return t


def table(ns):
    from hyla.bench.kernels import _ceilings

    copy_bw, _ = _ceilings()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    t = _timer()
    print(f"{torch.cuda.get_device_name()}: copy {copy_bw / 1e12:.2f} TB/s, {sms} SMs; us (% of copy)")
    gen = torch.Generator(device="cuda").manual_seed(3)
    names = ["default", *SCHEDULES, "one program per tile", "floor: RMW", "floor: copy", "K-last: default",
             "K-last floor: RMW, one program per 8-column tile"]
    print("| cell | N | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    for gate, fused, H, HV, D in CELLS:
        pool = torch.randn(2 * max(ns), HV, D, D, device="cuda", generator=gen)
        pool_kl = as_k_last(pool)
        for N in ns:
            q, k, v, g, beta, idx, kw = inputs(N, H, HV, D, gate, fused, pool.shape[0], "cuda", gen)
            nbytes = N * HV * D * D * 4 * 2
            row = [t(lambda: rec.recurrent_fwd(q, k, v, g, beta, gate=gate, initial_state=pool,
                                               ssm_state_indices=idx, **kw))]
            for schedule in SCHEDULES.values():
                stages, bv, warps, pps = schedule
                fits = not stages or (stages - 1) * pps * D * bv * 4 <= 220_000
                row.append(t(lambda: launch(schedule, q, k, v, g, beta, pool, idx, gate, kw)) if fits else None)
            row.append(t(lambda: rec.recurrent_fwd(q, k, v, g, beta, gate=gate, initial_state=pool,
                                                   ssm_state_indices=idx, persistent=False, **kw)))
            n_tiles = N * HV * (D // 16)
            row.append(t(lambda: rmw_kernel[(min(n_tiles, 8 * sms),)](pool, idx, n_tiles, HV=HV, K=D, V=D, BV=16,
                                                                       KLAST=False)))
            src = pool[:N]
            dst = torch.empty_like(src)
            row.append(t(lambda: dst.copy_(src)))
            del dst
            row.append(t(lambda: rec.recurrent_fwd(q, k, v, g, beta, gate=gate, initial_state=pool_kl,
                                                   ssm_state_indices=idx, **kw)))
            n8 = N * HV * (D // 8)
            row.append(t(lambda: rmw_kernel[(n8,)](pool_kl, idx, n8, HV=HV, K=D, V=D, BV=8, KLAST=True)))
            cells = [f"{us:.1f} ({100 * nbytes / (us * 1e-6) / copy_bw:.0f}%)" if us else "smem" for us in row]
            label = f"{gate}{' fused-v1' if fused else ''} {H}/{HV} heads, D = {D}"
            print(f"| {label} | {N} | " + " | ".join(cells) + " |", flush=True)
        del pool, pool_kl


def threshold():
    t = _timer()
    gen = torch.Generator(device="cuda").manual_seed(4)
    print("| D | N | tiles / SM | default us | persistent us | one program per tile us |")
    print("|---:|---:|---:|---:|---:|---:|")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for D, ns in ((64, (4, 8, 16, 32, 64)), (128, (1, 4, 8, 16, 32, 64))):
        pool = torch.randn(512, 32, D, D, device="cuda", generator=gen)
        for N in ns:
            q, k, v, g, beta, idx, kw = inputs(N, 32, 32, D, "kda", False, 512, "cuda", gen)
            ts = [t(lambda: rec.recurrent_fwd(q, k, v, g, beta, gate="kda", initial_state=pool,
                                              ssm_state_indices=idx, persistent=p, **kw)) for p in (None, True, False)]
            print(f"| {D} | {N} | {N * 32 * D / 16 / sms:.1f} | {ts[0]:.1f} | {ts[1]:.1f} | {ts[2]:.1f} |", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="CPU interpreter: every schedule equals the default")
    ap.add_argument("--threshold", action="store_true", help="persistent vs one program per tile at small N")
    ap.add_argument("--n", type=int, nargs="+", default=[64, 256, 512])
    args = ap.parse_args()
    if args.check:
        check()
    elif args.threshold:
        threshold()
    else:
        table(args.n)
