"""KCP across processes: one long KDA sequence split over the ranks of a torchrun job.

    # NCCL, one GPU per rank (falls back to gloo on CPU when CUDA is absent)
    torchrun --standalone --nproc-per-node 4 examples/kcp_torchrun.py --tokens 65536 --heads 8
    # CPU smoke test
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/kcp_torchrun.py --backend gloo
    # the multi-GPU measurement: bf16, H = 32, D = 128, even slices or balanced ones (rank 0's
    # plain pass takes 1.5x the tokens of the others' extended passes)
    torchrun --standalone --nproc-per-node 2 examples/kcp_torchrun.py --dtype bf16 --even-split --tokens 131072 --heads 32
    torchrun --standalone --nproc-per-node 4 examples/kcp_torchrun.py --dtype bf16 --balanced-split 1.5 --tokens 524288 --heads 32

Each rank builds only its own slice, from a generator seeded with (seed, rank), so any rank can
rebuild any slice. Slice lengths are uneven on purpose (rank r holds about (r+1) parts). Rank 0
then rebuilds the whole sequence, runs single-process ``chunk_kda`` on it and reports the
relative error of every rank's output and of the final state, plus the bytes each rank sent
against B * HV * (K^2 + K*V) * itemsize. ``--no-check`` skips that reference run.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hyla.ops import chunk_gated_delta_rule, chunk_kda
from hyla.parallel import (
    add_incoming,
    balanced_slice_lengths,
    chunk_gated_delta_rule_cp,
    chunk_kda_cp,
    count_comm_bytes,
    first_pass,
    kcp_comm_bytes,
    local_pass,
)


def slice_lengths(tokens: int, world: int) -> list[int]:
    """Uneven split: rank r gets about (r + 1) / (1 + 2 + ... + world) of the tokens."""
    weights = [r + 1 for r in range(world)]
    cuts = [tokens * sum(weights[:r]) // sum(weights) for r in range(world + 1)]
    return [cuts[r + 1] - cuts[r] for r in range(world)]


def make_slice(rank: int, length: int, args, device) -> tuple[torch.Tensor, ...]:
    """q, k [B, L, H, K]; v [B, L, H, V]; g [B, L, H, K] (kda) or [B, L, H] (gdn); beta [B, L, H]."""
    # Drawn on the device itself (a CPU generator is slow at 512K x 32 heads), from a generator of
    # that device type seeded with (seed, rank): the same numbers whichever process draws them.
    gen = torch.Generator(device=device).manual_seed(args.seed * 100_003 + rank)
    B, H, K, V = args.batch, args.heads, args.head_dim, args.head_dim
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    q, k, v = r(B, length, H, K), F.normalize(r(B, length, H, K), dim=-1), r(B, length, H, V)
    # A mild decay (a ~ 0.98 on average) so information survives across slice boundaries.
    g = -F.softplus(r(B, length, H, K) - 4.0) if args.gate == "kda" else -F.softplus(r(B, length, H) - 4.0)
    beta = torch.rand(B, length, H, generator=gen, device=device)
    dtype = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    # The log-decay stays fp32 (as fla and the kernels expect); everything else in `dtype`.
    return tuple(x.to(device=device, dtype=torch.float32 if x is g and dtype == torch.bfloat16 else dtype)
                 for x in (q, k, v, g, beta))


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn, repeat: int, device) -> float:
    """Median wall time of `repeat` calls of fn (device-synchronised), after one untimed call."""
    fn()
    times = []
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def main() -> None:
    p = argparse.ArgumentParser(description="KCP (context-parallel KDA / GDN) across torchrun ranks")
    p.add_argument("--tokens", type=int, default=4096, help="total sequence length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128, help="K = V")
    p.add_argument("--gate", choices=["kda", "gdn"], default="kda")
    p.add_argument("--dtype", choices=["fp32", "fp64", "bf16"], default="fp32")
    p.add_argument("--even-split", action="store_true", help="equal slices (default: rank r holds ~(r+1) parts)")
    p.add_argument("--balanced-split", type=float, metavar="COST", default=None,
                   help="rank 0 (plain pass) takes COST times the others' tokens (their pass carries K "
                        "extra columns; ~1.5 on an H200): hyla.parallel.balanced_slice_lengths")
    p.add_argument("--repeat", type=int, default=5, help="timed runs (median reported)")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the single-process reference on rank 0")
    args = p.parse_args()

    backend = args.backend if args.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.balanced_split is not None:
        lengths = balanced_slice_lengths(args.tokens, world, extended_cost=args.balanced_split)
    elif args.even_split:
        lengths = [args.tokens // world + (r < args.tokens % world) for r in range(world)]
    else:
        lengths = slice_lengths(args.tokens, world)
    cp_op, op = (chunk_kda_cp, chunk_kda) if args.gate == "kda" else (chunk_gated_delta_rule_cp, chunk_gated_delta_rule)

    q, k, v, g, beta = make_slice(rank, lengths[rank], args, device)
    h0 = torch.randn(args.batch, args.heads, args.head_dim, args.head_dim,
                     generator=torch.Generator().manual_seed(args.seed)).to(device=device, dtype=torch.float32
                                                                             if q.dtype == torch.bfloat16 else q.dtype)
    cp_op(q, k, v, g, beta, initial_state=h0)  # warm-up (kernels, NCCL communicators)
    times = []
    for _ in range(args.repeat):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        with count_comm_bytes() as counter:
            o, final = cp_op(q, k, v, g, beta, initial_state=h0)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    ms = sorted(times)[len(times) // 2]
    # The collective alone, on a buffer of the summary's size: its share of the step.
    buf = torch.zeros(counter.bytes_sent // 4, dtype=torch.float32, device=device)
    out = torch.empty(world * buf.numel(), dtype=torch.float32, device=device)
    gather_ms = _median_ms(lambda: gather_into(out, buf), args.repeat, device)
    # The two local halves alone: the chunk pass over K + V columns, and adding the incoming
    # state's share (one matmul per head).
    gate = args.gate
    if rank == 0:  # rank 0's plain pass from its known incoming state
        pass_ms = _median_ms(lambda: first_pass(q, k, v, g, beta, gate=gate, initial_state=h0), args.repeat, device)
    else:
        pass_ms = _median_ms(lambda: local_pass(q, k, v, g, beta, gate=gate), args.repeat, device)
    o_zero, P, _, S_loc = local_pass(q, k, v, g, beta, gate=gate)
    add_ms = _median_ms(lambda: add_incoming(o_zero, P, S_loc), args.repeat, device)
    del o_zero, P

    # Reporting only: collect per-rank figures and outputs on rank 0 (not counted above).
    stats = [None] * world
    dist.all_gather_object(stats, (lengths[rank], counter.bytes_sent, ms, gather_ms, pass_ms, add_ms))
    outs = [o]
    if not args.no_check and rank == 0:
        for r in range(1, world):
            outs.append(torch.empty(args.batch, lengths[r], args.heads, args.head_dim, dtype=o.dtype, device=device))
            dist.recv(outs[r], src=r)
    elif not args.no_check:
        dist.send(o.contiguous(), dst=0)

    if rank == 0:
        summary_dtype = torch.float64 if args.dtype == "fp64" else torch.float32  # bf16 summarises in fp32
        want = kcp_comm_bytes(args.batch, args.heads, args.head_dim, args.head_dim, summary_dtype)
        print(f"KCP {args.gate} on {backend}, {world} ranks, T={args.tokens}, B={args.batch}, H={args.heads}, "
              f"K=V={args.head_dim}, {args.dtype}")
        for r, (n, sent, t, tg, tp, ta) in enumerate(stats):
            print(f"  rank {r}: {n:>8} tokens  sent {sent} bytes (expected {want})  {t:.2f} ms "
                  f"(all-gather alone {tg:.3f} ms, {100 * tg / t:.1f}%; local pass {tp:.2f} ms, "
                  f"incoming-state matmul {ta:.2f} ms)")
        if not args.no_check:
            parts = [make_slice(r, lengths[r], args, device) for r in range(world)]
            full = [torch.cat([part[i] for part in parts], dim=1) for i in range(5)]
            o_ref, final_ref = op(*full, initial_state=h0, output_final_state=True)
            one = _median_ms(lambda: op(*full, initial_state=h0, output_final_state=True), args.repeat, device)
            slowest = max(st[2] for st in stats)
            print(f"  one process on the whole sequence: {one:.2f} ms; KCP (slowest rank) {slowest:.2f} ms: "
                  f"speed-up {one / slowest:.2f}x, efficiency {one / slowest / world:.0%}")
            o_all = torch.cat(outs, dim=1)
            print(f"  vs single-process {op.__name__}: output rel err {rel_err(o_all, o_ref):.3e}, "
                  f"final state rel err {rel_err(final, final_ref):.3e}")
        ok = all(st[1] == want for st in stats)
        print("  bytes sent per rank match the formula" if ok else "  BYTES MISMATCH")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
