"""Attention of new tokens over a cached prefix (hyla.layers.prefix_attention), by CUDA kernel:
what a prefill step spends in MLA's attention (queries and keys of nope + rope, values of v_dim:
Kimi-Linear-48B-A3B 192 / 128) or gated attention (one head dim, --dims 256 256).

    python scripts/prefix_attention_bench.py
    python scripts/prefix_attention_bench.py --cases 512:3072 2048:16384 8192:65536 --heads 16 --dims 256 256

Each case new:context is one sequence's T new queries over context + T keys (lower-right causal;
context 0 is a plain causal call). Columns, CUDA-event medians of 20 calls at one shape:
  sdpa    torch's scaled_dot_product_attention (is_causal, or the causal_lower_right bias): the
          kernel torch picks (for MLA: cuDNN without a prefix, memory-efficient with one)
  hyla    attend_after_prefix (torch's flash kernel, values padded to the key width)
  blocks  attend_key_blocks over the prefix and the new block (the long-context path: two
          attention_with_lse calls merged by log-sum-exp)
  cudnn   cuDNN's kernel over the prefix and the new block, merged (a peer for the rate)
err: the largest absolute difference from sdpa. Then, with --new-shapes, the wall time of the
first call at eight new (new, context) pairs near each case, as a server meets them: a kernel
library that builds a plan per shape pays it here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hyla.bench.floor import median_ms
from hyla.layers.masks import causal_after_prefix
from hyla.layers.prefix_attention import _merge, attend_after_prefix, attend_key_blocks


def sdpa(q, k, v, scale):
    T, L = q.shape[-2], k.shape[-2]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_after_prefix(T, L) if L > T else None,
                                          is_causal=L == T, scale=scale)


def cudnn_split(q, k, v, scale):
    T, L = q.shape[-2], k.shape[-2]
    out = lse = None
    for start, stop, causal in ((0, L - T, False), (L - T, L, True)):
        if stop > start:
            o, s = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k[:, :, start:stop].contiguous(), v[:, :, start:stop].contiguous(), None, True, 0.0, causal, False,
                scale=scale)[:2]
            out, lse = _merge(out, lse, o, s.reshape(*s.shape[:2], -1))
    return out.to(q.dtype)


def inputs(H, T, L, D, Dv, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g),
            torch.randn(1, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g),
            torch.randn(1, H, L, Dv, device="cuda", dtype=torch.bfloat16, generator=g))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", nargs="+", default=["512:0", "512:3072", "2048:16384", "8192:65536"])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--dims", type=int, nargs=2, default=[192, 128], metavar=("QK", "V"))
    p.add_argument("--new-shapes", action="store_true", help="also the first call at new shapes")
    args = p.parse_args()
    H, D, Dv = args.heads, *args.dims
    scale = D ** -0.5
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: {H} heads, qk {D}, v {Dv}, bf16")
    print("| new | context | sdpa ms | hyla ms | blocks ms | cudnn ms | err hyla / blocks / cudnn | TFLOP/s hyla |")
    print("|---|---|---|---|---|---|---|---|")
    for case in args.cases:
        T, ctx = map(int, case.split(":"))
        q, k, v = inputs(H, T, ctx + T, D, Dv)
        blocks = ([(k[:, :, :ctx], v[:, :, :ctx])] if ctx else []) + [(k[:, :, ctx:], v[:, :, ctx:])]
        fns = [lambda: sdpa(q, k, v, scale), lambda: attend_after_prefix(q, k, v, scale),
               lambda: attend_key_blocks(q, iter(blocks), scale), lambda: cudnn_split(q, k, v, scale)]
        ref = fns[0]().float()
        times, errs = [], []
        for fn in fns:
            try:
                out = fn()
                times.append(median_ms(fn, 20))
                errs.append(f"{(out.float() - ref).abs().max().item():.1e}")
            except RuntimeError as err:
                times.append(float("nan"))
                errs.append(type(err).__name__)
        flops = 2 * H * T * (ctx + (T + 1) / 2) * (D + Dv)
        print(f"| {T} | {ctx} | " + " | ".join(f"{t:.3f}" for t in times) + f" | {' / '.join(errs[1:])} | "
              f"{flops / times[1] / 1e9:.0f} |")
    if not args.new_shapes:
        return
    print("\n| near case | first call at a new shape, wall ms (median of 8): sdpa | hyla |")
    print("|---|---|---|")
    for case in args.cases:
        T, ctx = map(int, case.split(":"))
        walls: dict[str, list[float]] = {"sdpa": [], "hyla": []}
        for i in range(1, 9):
            for name, fn in (("sdpa", sdpa), ("hyla", attend_after_prefix)):
                t = T + 7 * i + (name == "hyla")  # every call a shape neither has seen
                q, k, v = inputs(H, t, (ctx + 13 * i if ctx else 0) + t, D, Dv, seed=i)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(q, k, v, scale)
                torch.cuda.synchronize()
                walls[name].append((time.perf_counter() - t0) * 1e3)
        print(f"| {T}:{ctx} | {statistics.median(walls['sdpa']):.3f} | {statistics.median(walls['hyla']):.3f} |")


if __name__ == "__main__":
    main()
