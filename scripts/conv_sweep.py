"""Tile sweep of the Triton prefill conv (hyla.ops.triton.conv_prefill) at one prefill's shape.

    python scripts/conv_sweep.py --tokens 8192 --channels 4096 --stride 12576

x is a column block of a wider projection output (row stride --stride), as in a KDA layer.
Prints ms per conv (CUDA-graph replays) for each (BT, BD, num_warps) and the bandwidth floor (x read
once, y written once).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from hyla.bench import floor as fl
from hyla.bench.moe import graph_ms
from hyla.ops.triton.conv_prefill import _conv_prefill_kernel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--channels", type=int, default=4096)
    p.add_argument("--stride", type=int, default=12576)
    p.add_argument("--width", type=int, default=4)
    args = p.parse_args()
    T, D, W = args.tokens, args.channels, args.width
    wide = torch.randn(T, args.stride, device="cuda", dtype=torch.bfloat16)
    x = wide[:, :D]
    weight = torch.randn(D, W, device="cuda", dtype=torch.float32)
    init = torch.randn(1, D, W - 1, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, T], device="cuda", dtype=torch.int32)
    seq_of = torch.zeros(T, device="cuda", dtype=torch.int32)
    y = torch.empty(T, D, device="cuda", dtype=torch.bfloat16)
    bw = fl.copy_bandwidth(torch.device("cuda"))
    floor_ms = 2 * T * D * 2 / bw * 1e3
    print(f"# conv prefill {T} x {D} (row stride {args.stride}), W={W}: floor {floor_ms:.4f} ms at {bw / 1e9:.0f} GB/s")
    rows = []
    for BT, BD, nw in itertools.product([16, 32, 64, 128], [64, 128, 256], [4, 8]):
        def run():
            _conv_prefill_kernel[(triton.cdiv(T, BT), triton.cdiv(D, BD))](
                x, x.stride(0), weight, weight, init, seq_of, cu, y, T, D, W=W, BT=BT, BD=BD,
                HAS_BIAS=False, HAS_INIT=True, SILU=True, num_warps=nw)
        try:
            ms = graph_ms(run, 50)  # CUDA-graph replays: kernel time, not launch latency
        except Exception as err:  # noqa: BLE001 - a tile that does not compile is skipped
            print(f"# BT={BT} BD={BD} warps={nw}: {type(err).__name__}")
            continue
        rows.append((ms, BT, BD, nw))
    rows.sort(reverse=True)  # the fastest tile printed last, so `| tail` keeps it
    for ms, BT, BD, nw in rows:
        print(f"BT={BT:4d} BD={BD:4d} warps={nw}: {ms:.4f} ms ({ms / floor_ms:.2f}x floor)")


if __name__ == "__main__":
    main()
