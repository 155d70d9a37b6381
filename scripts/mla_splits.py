"""Time the paged MLA decode kernel (hyla.ops.triton.mla) at Kimi-Linear-48B-A3B's layer shape
(32 heads, kv_lora_rank 512 + rope 64, v 128, 16-token pages) over long contexts, for several
cuts of the work, each a comma-separated list of paged_mla_decode's tile arguments (`--cuts ""
split_tokens=256 split_tokens=2048,max_splits=64,block_n=64`): split_tokens (tokens a slice,
min_splits to max_splits slices; 1048576 keeps every context at 4 slices), block_n (tokens a
program reads per step), block_h (heads a program serves: the latents are read once per head
block), min_splits and max_splits; an empty cut is the defaults. `python scripts/mla_splits.py
[--contexts 512 4096 131072 1048576] [--batch 1 16] [--cuts ...]`. Each call is a CUDA-graph
replay (the split and combine kernels alone, as in a decode step's graph; eager calls at short
contexts time the launches instead). Prints ms per call, its ratio to the floor (the latents read
once / copy bandwidth) and the two kernels' own times (split + combine us, from the profiler over
one eager call; with programmatic dependent launch the combine's includes its wait for the
split), then the floor."""

from __future__ import annotations

import argparse

import torch

from hyla.bench.floor import copy_bandwidth, kernel_times
from hyla.bench.moe import graph_ms
from hyla.ops.triton.mla import paged_mla_decode

H, R, ROPE, V, PS = 32, 512, 64, 128, 16


def _cut(text: str) -> dict:
    """'split_tokens=2048,max_splits=64' -> paged_mla_decode keyword arguments."""
    cut = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        cut[key] = int(value)
    return cut


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 131072, 1048576])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--cuts", nargs="+", default=["", "split_tokens=4096", "split_tokens=1024"])
    p.add_argument("--repeat", type=int, default=20)
    a = p.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    cuts = [_cut(c) for c in a.cuts]
    print("batch | context | " + " | ".join(f"{c or 'defaults'} ms" for c in a.cuts) + " | floor ms")
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
            floor = n * L * (R + ROPE) * 2 / bw * 1e3
            cells = []
            for c in cuts:
                call = lambda c=c: paged_mla_decode(q_lat, q_pe, cache, tables, last, w_uv, 0.07, **c)  # noqa: E731
                t = graph_ms(call, a.repeat)
                us = {name: time for time, _, name in kernel_times(call)}
                split, combine = (sum(v for k, v in us.items() if part in k) for part in ("split", "combine"))
                cells.append(f"{t:.3f} ({t / floor:.1f}x; {split:.0f} + {combine:.0f} us)")
            print(f"{n} | {L} | " + " | ".join(cells) + f" | {floor:.3f}")
            del cache, tables
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
