"""What a step costs the first time its shape comes, after the engine's startup kernel warm-up:
the agent trace's pattern (a returning turn of ~549 new tokens after a context that grows each
turn, beside one decode row; then the rest of the burst at that context), replayed through a
ModelRunner as a server runs it. Per step: the first call's wall, a repeat's wall, the Triton
kernels compiled in the first call; then a cProfile of the slowest first call.

    python scripts/first_steps.py --layers 12 -q fp8
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time

import torch

from hyla.bench.random_models import RANDOM_CONFIGS, random_model
from hyla.bench.step_bench import PAGE, make_runner
from hyla.engine.kernel_warmup import MAX_ROWS, rows_plan, warm_up_kernels


DEVICE = "cuda"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--random-config", default="kimi-linear-48b-a3b", choices=sorted(RANDOM_CONFIGS))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--quantization", "-q", choices=["fp8"], default=None)
    p.add_argument("--new", type=int, default=549)
    p.add_argument("--contexts", type=int, nargs="+", default=[610, 1222, 1834, 2446, 3058])
    p.add_argument("--burst", type=int, default=14, help="prompts in the step after the lone one")
    args = p.parse_args()
    from triton import knobs

    compiled: list[str] = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name) or False
    model = random_model(args.random_config, dtype=torch.bfloat16, device=DEVICE, layers=args.layers,
                         quantization=args.quantization)
    t0 = time.perf_counter()
    warm_up_kernels(model, max_num_batched_tokens=8192, page_size=PAGE, state_dtype=torch.float32, checkpoints=True)
    print(f"# warm-up {time.perf_counter() - t0:.1f} s, {len(compiled)} compiles")
    budget = max(args.contexts) + args.new + 64
    runner = make_runner(model, max(MAX_ROWS + 2, args.burst + 2), budget, prefill_tokens=(args.burst + 2) * budget)
    vocab = model.config.vocab_size
    print("| step | first ms | again ms | compiled in the first call |")
    print("|---|---|---|---|")
    slowest = (0.0, None, "")
    for ctx in args.contexts:
        steps = {f"lone {args.new}+{ctx} and 1 decode": [(args.new, ctx, 1), (1, ctx + 7, 0)],
                 f"{args.burst} x {args.new}+{ctx} and 1 decode": [(args.new, ctx, 1)] * args.burst + [(1, ctx + 7, 0)]}
        for name, rows in steps.items():
            plan = rows_plan(rows, vocab, PAGE, random.Random(ctx))
            walls = []
            for _ in range(2):
                compiled.clear()
                torch.cuda.synchronize()
                t = time.perf_counter()
                runner.execute(plan)
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t) * 1e3)
                if len(walls) == 1:
                    first_compiles = sorted(set(compiled))
            print(f"| {name} | {walls[0]:.1f} | {walls[1]:.1f} | {', '.join(first_compiles) or '-'} |")
            if walls[0] - walls[1] > slowest[0]:
                slowest = (walls[0] - walls[1], rows, name)
    if slowest[1] is None:
        return
    # the slowest first call's shape once more at a context not seen yet, under cProfile
    rows = [(n, c + 5 * PAGE + 3, e) for n, c, e in slowest[1]]
    plan = rows_plan(rows, vocab, PAGE, random.Random(1))
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    t = time.perf_counter()
    prof.enable()
    runner.execute(plan)
    torch.cuda.synchronize()
    prof.disable()
    print(f"\n# cProfile of '{slowest[2]}' at context +{5 * PAGE + 3}: {(time.perf_counter() - t) * 1e3:.1f} ms")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
    print("\n".join("# " + line for line in out.getvalue().splitlines()[6:50] if line.strip()))


if __name__ == "__main__":
    main()
