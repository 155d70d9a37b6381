"""What a step costs the first time its shape comes, after the engine's startup kernel warm-up:
the agent trace's pattern (a returning turn of ~549 new tokens after a context that grows each
turn, beside one decode row; then the rest of the burst at that context), replayed through a
ModelRunner as a server runs it; --fresh adds lone fresh prompts beside a decode row (the trace
with the cache off). Per step: the first call's wall, a repeat's wall, the Triton kernels compiled
in the first call with where each new variant's cache key first differs from the nearest earlier
variant of that kernel (which argument's specialisation, or which constexpr, was new); then a
cProfile of the slowest first call.

    python scripts/first_steps.py --layers 12 -q fp8
    python scripts/first_steps.py --layers 4 -q fp8 --contexts 610 --burst 2 --fresh 1159
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
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
    p.add_argument("--fresh", type=int, nargs="*", default=[], help="also lone fresh prompts of these lengths "
                   "beside one decode row (the trace with the prefix cache off)")
    args = p.parse_args()
    from triton import knobs

    compiled: list[str] = []
    variants: dict[str, list[str]] = {}  # kernel -> the cache key of each compiled variant

    def on_compile(**kw) -> bool:
        compiled.append(kw["fn"].name)
        variants.setdefault(kw["fn"].name, []).append(str(kw["compile"]["key"]))
        return False
    knobs.runtime.jit_post_compile_hook = on_compile
    model = random_model(args.random_config, dtype=torch.bfloat16, device=DEVICE, layers=args.layers,
                         quantization=args.quantization)
    t0 = time.perf_counter()
    warm_up_kernels(model, max_num_batched_tokens=8192, page_size=PAGE, state_dtype=torch.float32, checkpoints=True)
    print(f"# warm-up {time.perf_counter() - t0:.1f} s, {len(compiled)} compiles")
    budget = max(args.contexts + [n + 64 for n in args.fresh]) + args.new + 64
    runner = make_runner(model, max(MAX_ROWS + 2, args.burst + 2), budget, prefill_tokens=(args.burst + 2) * budget)
    vocab = model.config.vocab_size
    print("| step | first ms | again ms | compiled in the first call |")
    print("|---|---|---|---|")
    slowest = (0.0, None, "")
    patterns = [{f"lone {n} fresh and 1 decode": [(n, 0, 0), (1, n + 64, 0)]} for n in args.fresh]
    patterns += [{f"lone {args.new}+{ctx} and 1 decode": [(args.new, ctx, 1), (1, ctx + 7, 0)],
                  f"{args.burst} x {args.new}+{ctx} and 1 decode": [(args.new, ctx, 1)] * args.burst + [(1, ctx + 7, 0)]}
                 for ctx in args.contexts]
    for steps in patterns:
        ctx = sum(r[0] + r[1] for rows in steps.values() for r in rows)  # a seed
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
            for kernel in first_compiles:  # where the new variant's key first differs from the nearest earlier one
                *old, new = variants[kernel]
                if not old:
                    print(f"#   {kernel}: its first variant")
                    continue
                common = max(len(os.path.commonprefix([o, new])) for o in old)
                print(f"#   {kernel}: ...{new[max(0, common - 160):common + 40]}...")
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
