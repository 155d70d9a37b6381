"""CPU benchmark of the torch ops: chunkwise prefill vs the token-loop reference.

    python -m hyla.bench ops [--T 1024 4096 16384] [--heads 4] [--dim 64] [--repeat 3]

Prints one row per sequence length: loop ms, chunk ms, the speed-up and the chunk path's
throughput in tokens/s. Inputs are fresh random tensors (never zeros), fp32, one sequence.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F

from hyla.ops import chunk_kda, naive_recurrent_kda


def _inputs(T: int, H: int, D: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, D, generator=gen)
    k = F.normalize(torch.randn(1, T, H, D, generator=gen), dim=-1)
    v = torch.randn(1, T, H, D, generator=gen)
    g = F.logsigmoid(torch.randn(1, T, H, D, generator=gen))  # typical per-channel log-decays
    beta = torch.rand(1, T, H, generator=gen)
    return q, k, v, g, beta


def _median_ms(fn, repeat: int) -> float:
    fn()  # warm-up: first-call allocations stay out of the figure
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="hyla bench ops", description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    cpu = platform.processor() or platform.machine()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu}")
    print(f"# chunk_kda (chunk 64, and 32) vs naive_recurrent_kda, H={args.heads}, K=V={args.dim}, fp32, B=1")
    head = ("T", "loop ms", "chunk ms", "speed-up", "chunk tok/s", "chunk32 ms", "speed-up")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (7, 10, 10, 9, 12, 11, 9))))
    rows = []
    with torch.inference_mode():
        for T in args.T:
            x = _inputs(T, args.heads, args.dim, seed=T)
            loop = _median_ms(lambda: naive_recurrent_kda(*x, output_final_state=True), args.repeat)
            chunk = _median_ms(lambda: chunk_kda(*x, output_final_state=True), args.repeat)
            c32 = _median_ms(lambda: chunk_kda(*x, output_final_state=True, chunk_size=32), args.repeat)
            row = {"T": T, "loop_ms": loop, "chunk_ms": chunk, "speedup": loop / chunk,
                   "chunk_tok_s": T / chunk * 1e3, "chunk32_ms": c32, "speedup32": loop / c32}
            rows.append(row)
            print(f"{T:>7} {loop:>10.1f} {chunk:>10.1f} {loop / chunk:>8.1f}x {row['chunk_tok_s']:>12.0f} "
                  f"{c32:>11.1f} {loop / c32:>8.1f}x")
    return rows


if __name__ == "__main__":
    main()
