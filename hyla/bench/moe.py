"""One MoE block of the released shapes on the GPU: Triton fused MoE vs grouped GEMMs vs the floor.

    python -m hyla.bench moe [--shapes kimi-linear-48b-a3b qwen3-next-80b-a3b]
                             [--tokens 1 16 64 256 1024 8192] [--sweep] [--repeat 50] [--fp8] [--mxfp4]

Per shape and token count (random bf16 weights built on the device, random hidden states, the
family's own router: sigmoid noaux_tc for Kimi, softmax top-k for Qwen3-Next):

- `block graph ms`: the whole block (router, routed experts on the default path, shared expert)
  replayed as a CUDA graph — what a decode step pays;
- `triton ms` / `grouped_mm ms`: the routed experts alone on the same routing, the Triton
  fused-MoE kernels (hyla.ops.triton.fused_moe) and the sorted `grouped_mm` path
  (hyla.ops.moe.moe_experts_torch), each replayed as a CUDA graph;
- floor = bytes the block must read / copy bandwidth: the experts the batch touches (counted
  from the routing) x the bytes of one expert, the shared expert, the router weight (fp32), the
  hidden states in and out (hyla.bench.floor.moe_block_parts). `--sweep` also times a few
  Triton block configurations.

`--fp8`: the routed experts block-quantised (hyla.ops.fp8: e4m3, 128 x 128 scales) and the
block-FP8 fused MoE (hyla.ops.triton.fused_moe_fp8) timed beside the bf16 kernel on the same
routing, against its own floor (the touched experts at one byte a weight plus their scales);
with `--sweep` its configurations are `fp8_sweep`'s (FP8_SWEEP, BK and the gate/up BN fixed at the
128-column block; up to FP8_SPLIT_K_TOKENS tokens also split-K, KSPLIT 1, 2, 4, 8) and
`--write-configs` writes the "fp8_w8a8" tables the FP8 kernel reads, KSPLIT included.

`--mxfp4`: the routed experts drawn in MXFP4 (Kimi K3's released format; K3's own shape is not
public, so the chosen shapes stand in): the packed kernel (hyla.ops.triton.fused_moe_mxfp4), the
same weights converted to block FP8 as `mxfp4_experts="fp8"` loads them, and the bf16 kernel on
them dequantised, each a CUDA graph on one routing.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from hyla.bench.floor import copy_bandwidth, moe_block_parts
from hyla.ops.triton.kernel_tables import config_file_name, write_configs

SHAPES = {
    # hidden, moe_intermediate, experts, top-k, shared intermediate, family
    "kimi-linear-48b-a3b": dict(hidden=2304, inter=1024, experts=256, top_k=8, shared=1024, family="kimi"),
    "qwen3-next-80b-a3b": dict(hidden=2048, inter=512, experts=512, top_k=10, shared=512, family="qwen"),
}
SWEEP = [dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=3), dict(BM=16, BN=128, BK=128, num_warps=4, num_stages=3),
         dict(BM=16, BN=64, BK=256, num_warps=4, num_stages=2), dict(BM=16, BN=32, BK=256, num_warps=4, num_stages=3),
         dict(BM=32, BN=64, BK=128, num_warps=4, num_stages=3), dict(BM=64, BN=128, BK=64, num_warps=8, num_stages=3),
         dict(BM=128, BN=128, BK=64, GM=1, num_warps=8, num_stages=3),
         dict(BM=128, BN=128, BK=64, GM=8, num_warps=8, num_stages=3),
         dict(BM=128, BN=128, BK=64, GM=8, num_warps=8, num_stages=4),
         dict(BM=128, BN=256, BK=64, GM=8, num_warps=8, num_stages=3),
         dict(BM=64, BN=128, BK=64, GM=8, num_warps=4, num_stages=4),
         dict(BM=128, BN=64, BK=64, GM=16, num_warps=4, num_stages=4),
         dict(BM=128, BN=128, BK=128, GM=8, num_warps=8, num_stages=2),
         dict(BM=128, BN=64, BK=128, GM=8, num_warps=8, num_stages=3),
         dict(BM=64, BN=256, BK=64, GM=8, num_warps=8, num_stages=3),
         dict(BM=256, BN=64, BK=64, GM=8, num_warps=8, num_stages=3),
         dict(BM=128, BN=128, BK=64, GM=16, num_warps=8, num_stages=3),
         dict(BM=128, BN=128, BK=64, GM=4, num_warps=8, num_stages=3)]
# second-GEMM overrides tried on top of the best SWEEP entry (its BM kept: the blocks are shared)
DOWN_SWEEP = [dict(BN=256, BK=64, GM=4, num_warps=8, num_stages=3), dict(BN=256, BK=64, GM=8, num_warps=8, num_stages=3),
              dict(BN=128, BK=128, GM=4, num_warps=8, num_stages=3), dict(BN=256, BK=32, GM=4, num_warps=8, num_stages=4),
              dict(BN=128, BK=64, GM=4, num_warps=4, num_stages=4), dict(BN=64, BK=128, GM=4, num_warps=4, num_stages=3),
              dict(BN=128, BK=64, GM=1, num_warps=8, num_stages=4)]

# FP8 configurations: BK and the first GEMM's BN are the quantisation block (128); BM, the
# launch options and the second GEMM's BN vary
FP8_SWEEP = [dict(BM=bm, BN=128, BK=128, GM=gm, num_warps=w, num_stages=st, down=dict(BN=dn))
             for bm, gm, w, st, dn in ((16, 1, 4, 3, 64), (16, 1, 4, 4, 128), (16, 1, 4, 2, 32), (32, 1, 4, 3, 64),
                                       (32, 1, 4, 4, 128), (64, 8, 4, 3, 128), (64, 8, 8, 3, 128), (64, 8, 4, 4, 256),
                                       (128, 8, 8, 3, 128), (128, 8, 8, 2, 256), (128, 16, 8, 3, 64))]
# Split-K of the FP8 gate/up GEMM (hyla.ops.triton.fused_moe_fp8, KSPLIT): swept up to this many
# tokens, on the entries of small row blocks (decode sizes, where a few programs per expert block
# stream all of H and K is the dimension that can spread over more SMs)
FP8_SPLIT_K_TOKENS = 64
FP8_KSPLITS = (1, 2, 4, 8)


def fp8_sweep(tokens: int, hidden: int) -> list[dict]:
    """The FP8 configurations to time for `tokens` tokens of hidden size `hidden`: FP8_SWEEP, and up
    to FP8_SPLIT_K_TOKENS tokens its entries of BM <= 32 once per KSPLIT of FP8_KSPLITS (1 written
    out, so a table says it) that ceil(hidden / 128) K groups allow."""
    if tokens > FP8_SPLIT_K_TOKENS:
        return list(FP8_SWEEP)
    ksplits = [s for s in FP8_KSPLITS if s <= -(-hidden // 128)]  # a share holds at least one K group
    configs = []
    for cfg in FP8_SWEEP:
        configs += [dict(cfg, KSPLIT=s) for s in ksplits] if cfg["BM"] <= 32 else [cfg]
    return configs


def build_block(shape: dict, device, dtype=torch.bfloat16, seed: int = 0):
    from hyla.layers import MoE, Qwen3NextSparseMoE

    torch.manual_seed(seed)
    with torch.device(device):
        if shape["family"] == "kimi":
            block = MoE(shape["hidden"], shape["inter"], shape["experts"], shape["top_k"], num_shared_experts=1,
                        routed_scaling_factor=2.446)
        else:
            block = Qwen3NextSparseMoE(shape["hidden"], shape["inter"], shape["experts"], shape["top_k"],
                                       shape["shared"])
    block.to(dtype)
    with torch.no_grad():
        for name, p in block.named_parameters():
            keep = torch.float32 if name.startswith("gate.") else dtype
            p.data = (torch.randn(p.shape, device=device, dtype=torch.float32) * 0.02).to(keep)
        if hasattr(block.gate, "e_score_correction_bias"):
            block.gate.e_score_correction_bias.copy_(torch.randn(shape["experts"], device=device) * 0.01)
    return block.eval().requires_grad_(False)


def graph_ms(fn, repeat: int) -> float:
    """Median ms of CUDA-graph replays of fn (captured after a warm-up on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def floor_bytes(block, distinct: int, tokens: int) -> int:
    """Bytes the block must move: the experts touched, the router and shared expert, x in and out."""
    expert, other = moe_block_parts(block, block.experts.num_experts)
    return distinct * expert + other + 2 * tokens * block.experts.gate_up_proj.shape[2] * 2


def _sweep(run, repeat: int, configs: list[dict] = SWEEP, downs: list[dict] = DOWN_SWEEP) -> tuple[dict, dict]:
    """Time run(config) for every entry of `configs` ("0".."n-1"), then for the `downs` overrides
    on the fastest ("d0".."dn") -> (ms by label, the fastest configuration). A configuration that
    does not fit the device (too much shared memory) is timed as nan."""
    def timed(cfg):
        try:
            return graph_ms(lambda: run(cfg), repeat)
        except Exception as e:  # noqa: BLE001 - a config that does not fit is skipped
            print(f"# config {cfg}: {type(e).__name__}")
            return float("nan")

    def fastest(ms: dict) -> str:
        return min(ms, key=lambda i: ms[i] if ms[i] == ms[i] else float("inf"))

    ms = {str(i): timed(cfg) for i, cfg in enumerate(configs)}
    best = dict(configs[int(fastest(ms))])
    labelled = {str(i): cfg for i, cfg in enumerate(configs)}
    for j, down in enumerate(downs):
        cfg = {**best, "down": down}
        labelled[f"d{j}"] = cfg
        ms[f"d{j}"] = timed(cfg)
    return ms, labelled[fastest(ms)]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="hyla bench moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 8192])
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--sweep", action="store_true", help="also time the Triton block configurations in SWEEP, "
                   "then second-GEMM overrides (DOWN_SWEEP) on the best")
    p.add_argument("--write-configs", type=Path, metavar="DIR",
                   help="with --sweep: write the fastest configuration per shape and token count into DIR "
                        "(hyla.ops.triton.kernel_tables' file per shape and device)")
    p.add_argument("--fp8", action="store_true", help="also the block-FP8 fused MoE on the experts quantised; "
                   "with --sweep its configurations (fp8_sweep: FP8_SWEEP, split-K at small token counts) "
                   "are the ones swept and written")
    p.add_argument("--mxfp4", action="store_true", help="also experts drawn in MXFP4 (as Kimi K3 releases them): "
                   "the packed kernel, the same weights converted to block FP8 at load (exact), and bf16 on them")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("hyla bench moe needs a CUDA device")
    from hyla.ops.fp8 import block_quantize, quantize_gate_up
    from hyla.ops.moe import moe_experts_torch
    from hyla.ops.triton.fused_moe import fused_moe
    from hyla.ops.triton.fused_moe_fp8 import fused_moe_fp8

    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    print(f"# hyla bench moe: torch {torch.__version__}, {torch.cuda.get_device_name()}, copy bandwidth "
          f"{bw / 1e9:.0f} GB/s (read + write); CUDA-graph replays, medians of {args.repeat}")
    rows, tuned, mx_rows = [], {}, []
    for name in args.shapes:
        shape = SHAPES[name]
        block = build_block(shape, device)
        w13, w2 = block.experts.gate_up_proj, block.experts.down_proj
        q = (*quantize_gate_up(w13), *block_quantize(w2)) if args.fp8 else None
        fp8_expert = sum(t.numel() * t.element_size() for t in q) // shape["experts"] if q else 0  # codes + scales
        for m in args.tokens:
            x = torch.randn(m, shape["hidden"], device=device, dtype=torch.bfloat16)
            with torch.inference_mode():
                weights, ids = block.gate(x)
                distinct = int(ids.unique().numel())
                fast = fused_moe(x, w13, w2, weights, ids)
                slow = moe_experts_torch(x, w13, w2, weights, ids)
                err = float((fast.float() - slow.float()).norm() / slow.float().norm())
                t_block = graph_ms(lambda: block(x), args.repeat)
                t_triton = graph_ms(lambda: fused_moe(x, w13, w2, weights, ids), args.repeat)
                t_grouped = graph_ms(lambda: moe_experts_torch(x, w13, w2, weights, ids), args.repeat)
                t_fp8 = fp8_err = fp8_floor = float("nan")
                if q is not None:
                    fp8_err = float((fused_moe_fp8(x, *q, weights, ids).float() - slow.float()).norm()
                                    / slow.float().norm())
                    t_fp8 = graph_ms(lambda: fused_moe_fp8(x, *q, weights, ids), args.repeat)
                    fp8_floor = (distinct * fp8_expert + 2 * m * shape["hidden"] * 2) / bw * 1e3
                if args.mxfp4:
                    mx_rows.append(dict(shape=name, tokens=m, **_mxfp4_times(shape, x, weights, ids, args.repeat)))
                sweep, best_cfg = {}, None
                if args.sweep and q is not None:
                    sweep, best_cfg = _sweep(lambda cfg: fused_moe_fp8(x, *q, weights, ids, config=cfg),
                                             args.repeat, fp8_sweep(m, shape["hidden"]), [])
                    tuned[(name, m)] = best_cfg
                elif args.sweep:
                    sweep, best_cfg = _sweep(lambda cfg: fused_moe(x, w13, w2, weights, ids, config=cfg),
                                             args.repeat)
                    tuned[(name, m)] = best_cfg
            floor = floor_bytes(block, distinct, m) / bw * 1e3
            row = dict(shape=name, tokens=m, distinct=distinct, block_ms=t_block, triton_ms=t_triton,
                       grouped_ms=t_grouped, floor_ms=floor, x_floor=t_block / floor, rel_err=err, sweep=sweep,
                       fp8_ms=t_fp8, fp8_floor_ms=fp8_floor, fp8_rel_err=fp8_err)
            rows.append(row)
            if sweep:
                print(f"# {name} M={m}: sweep " + " ".join(f"{i}:{t:.3f}" for i, t in sweep.items())
                      + f" -> best {best_cfg} ({min(t for t in sweep.values() if t == t):.3f} ms; "
                      f"default {t_triton:.3f} ms)")
        if args.write_configs and any(n == name for n, _ in tuned):
            path = args.write_configs / config_file_name(shape["experts"], shape["inter"], shape["hidden"],
                                                         torch.cuda.get_device_name(device),
                                                         "fp8_w8a8" if args.fp8 else None)
            write_configs(path, {m: cfg for (n, m), cfg in tuned.items() if n == name})
            print(f"# wrote {path}")
        del block, w13, w2, q
        torch.cuda.empty_cache()
    print(f"{'shape':<22} {'tokens':>6} {'experts':>7} {'block ms':>9} {'triton ms':>9} {'grouped ms':>10} "
          f"{'floor ms':>9} {'x floor':>8} {'rel err':>8}")
    for r in rows:
        print(f"{r['shape']:<22} {r['tokens']:>6} {r['distinct']:>7} {r['block_ms']:>9.3f} {r['triton_ms']:>9.3f} "
              f"{r['grouped_ms']:>10.3f} {r['floor_ms']:>9.3f} {r['x_floor']:>7.2f}x {r['rel_err']:>8.1e}")
    if args.fp8:
        print("# routed experts alone, the same routing: bf16 Triton vs block FP8 (rel err vs the grouped bf16 path: "
              "+ e4m3 weights and activations)")
        print(f"{'shape':<22} {'tokens':>6} {'bf16 ms':>8} {'fp8 ms':>8} {'bf16/fp8':>8} {'fp8 floor':>9} "
              f"{'x floor':>8} {'rel err':>8}")
        for r in rows:
            print(f"{r['shape']:<22} {r['tokens']:>6} {r['triton_ms']:>8.3f} {r['fp8_ms']:>8.3f} "
                  f"{r['triton_ms'] / r['fp8_ms']:>7.2f}x {r['fp8_floor_ms']:>9.3f} "
                  f"{r['fp8_ms'] / r['fp8_floor_ms']:>7.2f}x {r['fp8_rel_err']:>8.1e}")
    if mx_rows:
        print("# routed experts drawn in MXFP4, the same routing: packed MXFP4 kernel, converted to block FP8 "
              "(power-of-two scales: exact), bf16 on the dequantised weights")
        print(f"{'shape':<22} {'tokens':>6} {'mxfp4 ms':>9} {'fp8 ms':>8} {'bf16 ms':>8} {'bf16/mxfp4':>10} "
              f"{'bf16/fp8':>8}")
        for r in mx_rows:
            print(f"{r['shape']:<22} {r['tokens']:>6} {r['mxfp4_ms']:>9.3f} {r['fp8_ms']:>8.3f} {r['bf16_ms']:>8.3f} "
                  f"{r['bf16_ms'] / r['mxfp4_ms']:>9.2f}x {r['bf16_ms'] / r['fp8_ms']:>7.2f}x")
    return rows


def _mxfp4_times(shape: dict, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, repeat: int) -> dict:
    """The routed experts of `shape` drawn in MXFP4 (hyla.models.mxfp4.random_mxfp4), timed in CUDA
    graphs on one routing: the packed kernel, the block-FP8 kernel on the experts as
    `mxfp4_experts="fp8"` loads them (Mxfp4Experts.to_fp8), the bf16 kernel on them dequantised
    -> ms each."""
    from hyla.models.mxfp4 import Mxfp4Experts, random_mxfp4
    from hyla.ops.gated_act import SILU
    from hyla.ops.triton.fused_moe import fused_moe
    from hyla.ops.triton.fused_moe_fp8 import fused_moe_fp8
    from hyla.ops.triton.fused_moe_mxfp4 import fused_moe_mxfp4

    E, H, inter = shape["experts"], shape["hidden"], shape["inter"]
    gen = torch.Generator(device=x.device).manual_seed(0)
    w13, w2 = random_mxfp4(E, 2 * inter, H, gen), random_mxfp4(E, H, inter, gen)
    with torch.device(x.device):
        experts = Mxfp4Experts(E, H, inter, SILU)
    experts.load_packed(w13, w2)
    W13, W2 = experts.dequantized(torch.bfloat16)
    fp8 = experts.to_fp8()
    q = (fp8.gate_up_proj, fp8.gate_up_proj_scale_inv, fp8.down_proj, fp8.down_proj_scale_inv)
    with torch.inference_mode():
        return dict(mxfp4_ms=graph_ms(lambda: fused_moe_mxfp4(x, *w13, *w2, weights, ids), repeat),
                    fp8_ms=graph_ms(lambda: fused_moe_fp8(x, *q, weights, ids), repeat),
                    bf16_ms=graph_ms(lambda: fused_moe(x, W13, W2, weights, ids), repeat))
