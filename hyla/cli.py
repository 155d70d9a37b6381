"""The `hyla` command: serve, generate, bench, plot, demo."""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> None:
    """A short tour of the ops: chunkwise prefill equals the exact loop, checkpoints, decode."""
    import torch
    import torch.nn.functional as F

    from hyla.ops import chunk_kda, fused_recurrent_kda, naive_recurrent_kda

    torch.manual_seed(0)
    T, H, K, V = args.tokens, 4, 64, 64
    q = torch.randn(1, T, H, K, dtype=torch.float64)
    k = F.normalize(torch.randn(1, T, H, K, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, H, V, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(1, T, H, K, dtype=torch.float64))
    beta = torch.rand(1, T, H, dtype=torch.float64)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    p = T // 3 + 1
    o, s, (ck,) = chunk_kda(q, k, v, g, beta, output_final_state=True, checkpoint_positions=[[p]])
    _, s_p = naive_recurrent_kda(q[:, :p], k[:, :p], v[:, :p], g[:, :p], beta[:, :p], output_final_state=True)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    print(f"KDA, T={T}, H={H}, K=V={K}, fp64")
    print(f"  chunkwise prefill vs exact loop: output rel. error {rel(o, o_ref):.1e}, state {rel(s, s_ref):.1e}")
    print(f"  in-pass checkpoint after {p} tokens vs loop stopped there: {rel(ck[0], s_p[0]):.1e}")
    pool = torch.zeros(4, H, K, V, dtype=torch.float64)
    pool[2] = s[0]
    x = [t[:, :1] for t in (q, k, v, g, beta)]
    o_dec, _ = fused_recurrent_kda(*x, initial_state=pool, ssm_state_indices=torch.tensor([2]))
    print(f"  one decode step over a state pool (slot 2, in place): |o| = {o_dec.norm():.3f}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="hyla", description="hybrid linear-attention LLM stack")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="a short demonstration of the ops")
    demo.add_argument("--tokens", type=int, default=300)
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="benchmarks: ops, kernels, throughput, prefix-cache, spec",
                           add_help=False)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=lambda a: __import__("hyla.bench.__main__", fromlist=["main"]).main(a.rest))

    plot = sub.add_parser("plot", help="render the explanatory figures (PNG)")
    plot.add_argument("--out", required=True, help="output directory")
    plot.set_defaults(func=_plot)

    args = parser.parse_args(argv)
    args.func(args)


def _plot(args) -> None:
    from hyla.viz.plots import render_all

    for name, path in render_all(args.out).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
