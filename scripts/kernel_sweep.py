"""Time chosen chunk-prefill and decode launch configurations on a CUDA GPU (a focused
`hyla bench kernels --tune`): which configuration a default should take.

    python scripts/kernel_sweep.py --gate gdn --shapes 1x32768 8x4096 --decode-n 64 256 512
"""

from __future__ import annotations

import argparse

import torch

from hyla.bench import kernels as kb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gate", choices=["kda", "gdn"], default="gdn")
    ap.add_argument("--variants", nargs="+", default=["gate", "fused-v1"])
    ap.add_argument("--shapes", nargs="+", default=["1x32768", "8x4096"])
    ap.add_argument("--decode-n", nargs="*", type=int, default=[64, 256, 512])
    args = ap.parse_args()
    from hyla.ops.triton.chunk import chunk_fwd
    from hyla.ops.triton.recurrent import recurrent_fwd

    gen = torch.Generator(device="cuda").manual_seed(0)
    cfgs = [dict(), dict(factor_slice=32), dict(factor_slice=64), dict(low_precision_inverse=False),
            dict(low_precision_inverse=True),
            dict(gram_maxnreg=168), dict(gram_maxnreg=128), dict(factor_maxnreg=128),
            dict(gram_maxnreg=168, factor_maxnreg=128)]
    with torch.inference_mode():
        for shape in args.shapes:
            B, T = map(int, shape.split("x"))
            for variant in args.variants:
                q, k, v, g, beta, kw = kb._prefill_inputs(B, T, 32, 128, args.gate, variant, gen)
                for cfg in cfgs:
                    t = kb._bench(lambda: chunk_fwd(q, k, v, g, beta, gate=args.gate, **kw, **cfg))
                    print(f"{args.gate} {shape} {variant} {cfg}: {t:.3f} ms", flush=True)
        H, D = 32, 128
        slots = 2 * max(args.decode_n or [1])
        pool = torch.randn(slots, H, D, D, device="cuda", generator=gen)
        for N in args.decode_n:
            q, k, v = (torch.randn(N, 1, H, D, device="cuda", generator=gen).bfloat16() for _ in range(3))
            g = torch.nn.functional.logsigmoid(torch.randn(N, 1, H, D, device="cuda", generator=gen))
            beta = torch.rand(N, 1, H, device="cuda", generator=gen).bfloat16()
            idx = torch.randperm(slots, device="cuda", generator=gen)[:N].to(torch.int32)
            nbytes = N * H * D * D * 4 * 2 + N * H * D * (2 * 3 + 4 + 2) + N * H * 2
            for persistent, bv, nw, pps in [(False, 16, 1, 0), (True, 32, 2, 4), (True, 16, 1, 4), (True, 16, 1, 8),
                                            (True, 16, 1, 16), (True, 32, 1, 4), (True, 32, 1, 8)]:
                t = kb._bench(lambda: recurrent_fwd(q, k, v, g, beta, gate="kda", initial_state=pool,
                                                    ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, block_v=bv,
                                                    num_warps=nw, persistent=persistent, programs_per_sm=pps),
                              graph=True)
                print(f"decode N={N} persistent={persistent} BV={bv} warps={nw} programs/SM={pps}: {t * 1e3:.1f} us "
                      f"({nbytes / (t * 1e-3) / 1e9:.0f} GB/s)", flush=True)


if __name__ == "__main__":
    main()
