"""The block-FP8 GEMM of the dense projections on the device: every tile configuration of
GEMM_SWEEP timed at the weight shapes a released model runs, per row count, beside the built-in
heuristic, cuBLAS (torch._scaled_mm with block scales, where it takes the shape) and bf16 F.linear;
`--write-configs DIR` writes the fastest Triton configuration per shape and row count
(hyla.ops.triton.kernel_tables), the tables `fp8_gemm` then reads.

    python -m hyla.bench fp8-gemm --write-configs hyla/assets/kernel_configs/fp8_gemm

The shapes: the [N, K] weights `fp8_linear` sees in one forward of the shape's first four layers
(every layer kind of the released hybrids), drawn in block FP8 on the device. Times: medians of
CUDA-graph replays of the GEMM alone (the activations quantised once before; the quantiser is the
same for every configuration).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from hyla.bench.moe import graph_ms
from hyla.bench.random_models import RANDOM_CONFIGS, random_model

# BK is the 128 quantisation block; BM, BN, GM and the launch options vary. Narrow column tiles
# (BN 16 / 32) give a decode-sized GEMM more programs: 2048 outputs in tiles of 64 are 32 programs
# for 132 SMs, each streaming a 64-row slice of the weight.
GEMM_SWEEP = [dict(BM=bm, BN=bn, GM=gm, num_warps=w, num_stages=st) for bm, bn, gm, w, st in (
    (16, 16, 1, 2, 4), (16, 16, 1, 4, 6), (16, 32, 1, 2, 6), (16, 32, 1, 4, 4), (16, 64, 1, 4, 4), (16, 64, 1, 4, 6), (16, 128, 1, 4, 3), (16, 128, 1, 8, 4),
    (32, 64, 1, 4, 4), (32, 128, 1, 4, 3), (64, 64, 8, 4, 4), (64, 128, 8, 4, 3), (64, 256, 8, 8, 3),
    (128, 128, 8, 8, 3), (128, 128, 8, 4, 4), (128, 256, 8, 8, 3), (256, 128, 8, 8, 3))]
SHAPES = ("kimi-linear-48b-a3b", "qwen3-next-80b-a3b")


def model_shapes(name: str, device: torch.device) -> list[tuple[int, int]]:
    """The [N, K] weight shapes fp8_linear multiplies in one forward of `name`'s first 4 layers
    in block FP8, in first-seen order."""
    from hyla.ops.triton import fp8_gemm

    model = random_model(name, dtype=torch.bfloat16, device=device, layers=4, quantization="fp8")
    seen: list[tuple[int, int]] = []
    inner = fp8_gemm.fp8_linear

    def record(x, w, *args, **kwargs):
        if tuple(w.shape) not in seen:
            seen.append(tuple(w.shape))
        return inner(x, w, *args, **kwargs)
    fp8_gemm.fp8_linear = record
    try:
        with torch.inference_mode():
            model(torch.randint(3, 1000, (1, 16), device=device))
    finally:
        fp8_gemm.fp8_linear = inner
    return seen


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="hyla bench fp8-gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=sorted(RANDOM_CONFIGS))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096, 8192])
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--write-configs", type=Path, metavar="DIR",
                   help="write the fastest configuration per shape and row count into DIR")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("hyla bench fp8-gemm needs a CUDA device")
    from hyla.ops.fp8 import block_dequantize, block_quantize
    from hyla.ops.triton import fp8_gemm
    from hyla.ops.triton.kernel_tables import _device_name, gemm_file_name, write_configs

    device = torch.device("cuda")
    print(f"# hyla bench fp8-gemm: torch {torch.__version__}, {torch.cuda.get_device_name()}; GEMM alone, "
          f"medians of {args.repeat} CUDA-graph replays, ms")
    print(f"{'N':>6} {'K':>6} {'rows':>5} {'heuristic':>9} {'tuned':>8} {'config':<34} {'cuBLAS':>8} {'bf16':>8}")
    shapes = []
    for name in args.shapes:
        shapes += [s for s in model_shapes(name, device) if s not in shapes]
    best_by_shape: dict[tuple[int, int], dict[int, dict]] = {}
    for n, k in shapes:
        w_bf16 = (torch.randn(n, k, device=device) / k ** 0.5).to(torch.bfloat16)
        w, s = block_quantize(w_bf16)
        w_deq = block_dequantize(w, s).to(torch.bfloat16)
        for m in args.tokens:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            xq, xs = fp8_gemm.per_token_group_quant(x)
            ref = fp8_gemm.fp8_gemm(xq, xs, w, s, x.dtype, config=fp8_gemm.gemm_config(m, n))
            heuristic = graph_ms(lambda: fp8_gemm.fp8_gemm(xq, xs, w, s, x.dtype, config=fp8_gemm.gemm_config(m, n)),
                                 args.repeat)
            times = {}
            for i, cfg in enumerate(GEMM_SWEEP):
                if cfg["BM"] > max(16, 4 * m):  # rows of padding only
                    continue
                try:
                    out = fp8_gemm.fp8_gemm(xq, xs, w, s, x.dtype, config=cfg)
                    err = float((out.float() - ref.float()).norm() / ref.float().norm())
                    if not err <= 2e-3:  # fp32 sums in another MMA shape, rounded to bf16: an ulp here and there
                        raise AssertionError(f"rel err {err:.1e} against the heuristic's output")
                    times[i] = graph_ms(lambda: fp8_gemm.fp8_gemm(xq, xs, w, s, x.dtype, config=cfg), args.repeat)
                except Exception as e:  # noqa: BLE001 - a configuration that does not fit is skipped
                    print(f"# N={n} K={k} rows={m} config {cfg}: {type(e).__name__}: {str(e)[:80]}")
            if not times:
                continue
            best = min(times, key=times.get)
            best_by_shape.setdefault((n, k), {})[m] = GEMM_SWEEP[best]
            cublas = float("nan")
            if fp8_gemm.scaled_mm_supports(x, w):
                try:
                    cublas = graph_ms(lambda: fp8_gemm.fp8_linear_scaled_mm(x, w, s), args.repeat)
                except RuntimeError:
                    pass
            bf16 = graph_ms(lambda: F.linear(x, w_deq), args.repeat)
            cfg = GEMM_SWEEP[best]
            label = f"{cfg['BM']}x{cfg['BN']} GM{cfg['GM']} w{cfg['num_warps']} s{cfg['num_stages']}"
            print(f"{n:>6} {k:>6} {m:>5} {heuristic:>9.4f} {times[best]:>8.4f} {label:<34} {cublas:>8.4f} {bf16:>8.4f}")
    if args.write_configs:
        dev_name = _device_name(device.index)
        for (n, k), table in best_by_shape.items():
            write_configs(args.write_configs / gemm_file_name(n, k, dev_name), table)
        print(f"# wrote {len(best_by_shape)} tables to {args.write_configs}")
    return best_by_shape


if __name__ == "__main__":
    main()
