"""The chunk-prefill cells of `hyla bench kernels --vs fla` one at a time, each row printed as soon
as it is timed (the table command prints at the end, so a time limit loses every cell).

    python scripts/prefill_cells.py --shapes 1x32768 8x4096 32x1024 --layouts
    python scripts/prefill_cells.py --variants gdn:gate gdn:fused-v1 --launch KEY=INT   # an A / B of an option
"""

from __future__ import annotations

import argparse

import torch

from hyla.bench import kernels as kb

VARIANTS = [("kda", "gate"), ("kda", "fused-v1"), ("kda", "fused-v2"), ("gdn", "gate"), ("gdn", "fused-v1")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=["1x32768", "8x4096", "32x1024"])
    ap.add_argument("--variants", nargs="*", default=[f"{g}:{v}" for g, v in VARIANTS], help="gate:variant")
    ap.add_argument("--layouts", action="store_true", help="also the released head layouts (RELEASED_LAYOUTS)")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--launch", nargs="*", default=[], metavar="KEY=INT",
                    help="extra chunk_fwd launch parameters for hyla, e.g. scan_warps=8")
    args = ap.parse_args()
    launch = {key: int(value) for key, value in (item.split("=", 1) for item in args.launch)}
    copy_bw, mm_rate = kb._ceilings()
    print(f"copy {copy_bw / 1e12:.2f} TB/s, bf16 matmul {mm_rate / 1e12:.0f} TFLOP/s", flush=True)
    cells = [((*map(int, s.split("x")), 32, 128), tuple(gv.split(":"))) for s in args.shapes for gv in args.variants]
    with torch.inference_mode():
        for shape, gv in cells:
            row = kb.run_prefill([shape], [gv], copy_bw, mm_rate, not args.no_fla, launch=launch)[0]
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        if args.layouts:
            for row in kb.run_prefill([], [], copy_bw, mm_rate, not args.no_fla, layouts=kb.RELEASED_LAYOUTS,
                                      launch=launch):
                print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)


if __name__ == "__main__":
    main()
