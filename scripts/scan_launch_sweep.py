"""hyla's chunk-prefill scan under several launch shapes (value block, warps, pipeline stages) on
every cell of `hyla bench kernels` (3 shapes x 5 variants + the released layouts), hyla only,
one row per cell (ms per column; "!" marks an output off column 0 by more than 1e-3):

    python scripts/scan_launch_sweep.py
"""
import torch

from hyla.bench import kernels as kb
from hyla.ops import triton as ht

CONFIGS = [{}, dict(scan_block_v=64, scan_warps=4), dict(scan_block_v=32, scan_warps=4, scan_stages=3),
           dict(scan_block_v=64, scan_warps=4, scan_stages=3), dict(scan_block_v=64, scan_warps=8, scan_stages=3),
           dict(scan_block_v=128, scan_warps=8), dict(scan_block_v=16, scan_warps=4, scan_stages=3)]
CELLS = [((B, T, 32, 128, 32), gv) for B, T in ((1, 32768), (8, 4096), (32, 1024))
         for gv in (("kda", "gate"), ("kda", "fused-v1"), ("kda", "fused-v2"), ("gdn", "gate"), ("gdn", "fused-v1"))]
CELLS += [(s, gv) for s, gv in kb.RELEASED_LAYOUTS]


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        for (B, T, H, D, HV), (gate, variant) in CELLS:
            q, k, v, g, beta, kw = kb._prefill_inputs(B, T, H, D, gate, variant, gen, HV)
            ours = ht.chunk_kda if gate == "kda" else ht.chunk_gated_delta_rule
            ref = None
            line = []
            for c in CONFIGS:
                try:
                    a = {**kw, **c}
                    o, _ = ours(q, k, v, g, beta, **a)
                    if ref is None:
                        ref = o.float()
                    rel = ((o.float() - ref).norm() / ref.norm()).item()
                    t = kb._bench(lambda: ours(q, k, v, g, beta, **a))
                    line.append(f"{t:6.3f}" + ("!" if rel > 1e-3 else ""))
                except Exception as e:
                    line.append(f"{type(e).__name__[:6]:>6s}")
            print(f"{gate}:{variant:9s} {B}x{T} H{H}/{HV}: " + " ".join(line), flush=True)
            torch.cuda.empty_cache()
    print("columns:", *[f"{i}={c}" for i, c in enumerate(CONFIGS)], sep="\n ")


if __name__ == "__main__":
    main()
