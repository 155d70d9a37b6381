"""The tiny released-layout FP8 checkpoints (tests/models/test_fp8.py) on CUDA against the CPU's
W8A8 definition, fp32 both sides: the relative error of tests/gpu/test_fp8_model.py's first
check, for one tree of hyla at a time (a bisection across .revs/ trees).

    python scripts/fp8_cuda_vs_cpu.py --build /tmp/fp8ckpt          # with the working tree
    PYTHONPATH=.revs/REV python scripts/fp8_cuda_vs_cpu.py --compare /tmp/fp8ckpt
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--build", type=Path, help="write the checkpoints here (needs the repository's tests/)")
    p.add_argument("--compare", type=Path, help="load them from here and print the errors")
    args = p.parse_args()
    if args.build:
        sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests/, after the tree's hyla
        from tests.models.test_fp8 import FAMILIES, IDS, write_fp8

        args.build.mkdir(parents=True, exist_ok=True)
        (args.build / "ids.json").write_text(json.dumps(IDS.tolist()))  # the test's prompts, for --compare
        for family, (build, skip) in FAMILIES.items():
            src, dst, deq = (args.build / f"{family}-{kind}" for kind in ("src", "fp8", "deq"))
            build(src)
            write_fp8(src, dst, deq, skip)
    if args.compare:
        import hyla
        from hyla.models import load_model

        ids = torch.tensor(json.loads((args.compare / "ids.json").read_text()))
        for family in ("kimi", "qwen3_next"):
            dst = args.compare / f"{family}-fp8"
            with torch.no_grad():
                cuda = load_model(dst, dtype=torch.float32, device="cuda")(ids.cuda()).double().cpu()
                cpu = load_model(dst, dtype=torch.float32, fp8_weights="fp8")(ids).double()
            print(f"{Path(hyla.__file__).parent.parent.name:>12} {family:>10}: CUDA vs CPU W8A8 rel err "
                  f"{((cuda - cpu).norm() / cpu.norm()).item():.2e}")


if __name__ == "__main__":
    main()
