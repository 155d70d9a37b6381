"""Time the paged MLA decode kernel (hyla.ops.triton.mla) at Kimi-Linear-48B-A3B's layer shape
(32 heads, kv_lora_rank 512 + rope 64, v 128, 16-token pages) over long contexts, for several
sequence cuts (`split_tokens` tokens a slice, 4 to `--max-splits` slices; the default split_tokens
of hyla.ops.triton.mla is 2048, and 1048576 keeps every context at 4 slices) and token tiles
(`--block-n`, tokens a program reads per step; 32 by default):
`python scripts/mla_splits.py [--contexts 512 4096 131072 1048576] [--batch 1 16] [--split-tokens ...]
[--block-n 32 64]`. Each call is a CUDA-graph replay (the split and combine kernels alone, as in
a decode step's graph; eager calls at short contexts time the launches instead). Prints ms per
call, the floor (the latents read once / copy bandwidth) and the ratio."""

from __future__ import annotations

import argparse

import torch

from hyla.bench.floor import copy_bandwidth
from hyla.bench.moe import graph_ms
from hyla.ops.triton.mla import paged_mla_decode

H, R, ROPE, V, PS = 32, 512, 64, 128, 16


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 131072, 1048576])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--split-tokens", type=int, nargs="+", default=[1048576, 4096, 2048, 1024])
    p.add_argument("--block-n", type=int, nargs="+", default=[32])
    p.add_argument("--max-splits", type=int, default=64)
    p.add_argument("--repeat", type=int, default=20)
    a = p.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    cuts = [(s, bn) for bn in a.block_n for s in a.split_tokens]
    print("batch | context | " + " | ".join(f"{s} tok/slice{f' n{bn}' if len(a.block_n) > 1 else ''} ms"
                                           for s, bn in cuts) + " | floor ms")
    w_uv = torch.randn(H, V, R, device=dev, dtype=torch.bfloat16) * 0.05
    for n in a.batch:
        for L in a.contexts:
            pages = -(-L // PS)
            if n * pages * PS * (R + ROPE) * 2 > 60 << 30:
                continue
            cache = torch.randn(n * pages, PS, R + ROPE, device=dev, dtype=torch.bfloat16)
            tables = torch.arange(n * pages, device=dev).view(n, pages)
            last = torch.full((n,), L - 1, device=dev, dtype=torch.long)
            q_lat = torch.randn(n, H, R, device=dev, dtype=torch.bfloat16)
            q_pe = torch.randn(n, H, ROPE, device=dev, dtype=torch.bfloat16)
            times = [graph_ms(lambda s=s, bn=bn: paged_mla_decode(q_lat, q_pe, cache, tables, last, w_uv, 0.07,
                                                                  split_tokens=s, max_splits=a.max_splits, block_n=bn),
                              a.repeat) for s, bn in cuts]
            floor = n * L * (R + ROPE) * 2 / bw * 1e3
            print(f"{n} | {L} | " + " | ".join(f"{t:.3f} ({t / floor:.1f}x)" for t in times) + f" | {floor:.3f}")
            del cache, tables
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
