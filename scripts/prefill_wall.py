"""A prefill step's wall time against its kernel time, by prompt length: where an eager prefill
step is host-bound (the GPU waits on python launching kernels) and where it is device-bound.

    python scripts/prefill_wall.py --layers 12 -q fp8 --lengths 256 1024 4096 8192
    python scripts/prefill_wall.py --layers 12 -q fp8 --lengths 1024 4096 --align-max-pairs 8192 65536
    python scripts/prefill_wall.py --layers 12 -q fp8 --lengths 8192 --rows 1 4 16
    python scripts/prefill_wall.py --layers 12 -q fp8 --lengths 1024 8192 --rows 16 --context 3072 --mla-groups on off
    python scripts/prefill_wall.py --layers 12 -q fp8 --lengths 8192 --rows 16 --context 3072 --top 12
    python scripts/prefill_wall.py --layers 12 -q fp8 --lengths 256 549 1024 2048 --context 3072 --prefill-graphs off on
    python scripts/prefill_wall.py --layers 12 -q fp8 --lengths 1024 --decode-rows 0 24 --decode-context 1280 --top 12
    py-spy record -f raw -o host.txt -- python scripts/prefill_wall.py --layers 12 -q fp8 --lengths 1024 --loop 20

One step of --rows prompts (default one) through ModelRunner.execute (what the engine runs), random weights on the
device; wall = median of 5 after a warm-up (hyla.bench.floor.median_ms); kernel = the summed GPU
time of one call (torch.profiler, floor.kernel_times). --align-max-pairs times each value of the fused MoE's one-program alignment
bound (hyla.ops.triton.fused_moe.ONE_PROGRAM_MAX_PAIRS) side by side in the same process;
--prefill-graphs off on the eager step against the spans replayed as CUDA graphs
(hyla.engine.prefill_graphs, buckets up to --graph-max-tokens, captured once before the table).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from hyla.bench.floor import describe_kernels, kernel_times, median_ms
from hyla.bench.random_models import RANDOM_CONFIGS, random_model
from hyla.bench.step_bench import PAGE, make_runner
from hyla.engine.kernel_warmup import rows_plan
from hyla.engine.step_plan import StepPlan
from hyla.layers import mla
from hyla.ops.triton import fused_moe


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--random-config", default="kimi-linear-48b-a3b", choices=sorted(RANDOM_CONFIGS))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096, 8192])
    p.add_argument("--rows", type=int, nargs="*", default=[1], help="split each length over this many prompts "
                   "(a step of several sequences, as a burst of requests makes)")
    p.add_argument("--context", type=int, default=0, help="each prompt resumes after this many cached tokens "
                   "(a returning turn on a prefix-cache hit)")
    p.add_argument("--decode-rows", type=int, nargs="+", default=[0], help="one-token rows of running requests "
                   "in the same step (a chunked-prefill step mixes them in), each after --decode-context tokens")
    p.add_argument("--decode-context", type=int, default=1280)
    p.add_argument("--mla-groups", nargs="+", choices=["on", "off"], default=["on"],
                   help="MLA prefill with its prompts expanded in groups (on, hyla.layers.mla) or one by one "
                        "(off): both in one process, which host-bound A / Bs need")
    p.add_argument("--prefill-graphs", nargs="+", choices=["off", "on"], default=["off"],
                   help="prefill steps eager (off) or with their spans as CUDA graphs (on), side by side")
    p.add_argument("--graph-max-tokens", type=int, default=2048, help="the prefill graphs' largest bucket")
    p.add_argument("--align-max-pairs", type=int, nargs="*", default=[], help="one-program alignment bounds to compare")
    p.add_argument("--quantization", "-q", choices=["fp8"], default=None, help="block-FP8 weights")
    p.add_argument("--top", type=int, default=0, help="after each row, the step's N costliest kernels")
    p.add_argument("--loop", type=float, default=0, help="then run the last row's step for this many seconds "
                   "(for a sampling profiler outside: most of its samples are then that step's host work)")
    args = p.parse_args()
    model = random_model(args.random_config, dtype=torch.bfloat16, device="cuda", layers=args.layers,
                         quantization=args.quantization)
    # pages for the longest step: its tokens plus each prompt's context and last partial pages
    decode = max(args.decode_rows)
    runner = make_runner(model, max(args.rows) + decode, max_context=16,
                         prefill_tokens=max(args.lengths) + (args.context + 32) * max(args.rows)
                         + (args.decode_context + 32) * decode)
    bounds = args.align_max_pairs or [fused_moe.ONE_PROGRAM_MAX_PAIRS]
    graphs = None
    if "on" in args.prefill_graphs:
        from hyla.engine.prefill_graphs import PrefillGraphs

        start = time.perf_counter()
        graphs = PrefillGraphs(model, args.graph_max_tokens)
        n = graphs.capture_all()
        torch.cuda.synchronize()
        print(f"# prefill graphs: {n} captured for buckets {graphs.buckets} in {time.perf_counter() - start:.1f} s")
    print(f"# {args.random_config}, {args.layers} layers, {args.quantization or 'bf16'}, "
          f"{torch.cuda.get_device_name()}: one prompt per prefill step")
    grouped = mla.expansion_groups
    print(f"# each prompt after {args.context} cached tokens")
    print("| tokens | prompts | decode rows | align max pairs | MLA groups | prefill graphs | wall ms | kernel ms "
          "| wall / kernel | tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for T, rows, dec, bound, groups, pg in ((T, r, d, b, g, pg) for T in args.lengths for r in args.rows
                                            for d in args.decode_rows for b in bounds for g in args.mla_groups
                                            for pg in args.prefill_graphs):
        runner.prefill_graphs = graphs if pg == "on" else None
        plan = split_plan(T, rows, model.config.vocab_size, args.context, dec, args.decode_context)
        fused_moe.ONE_PROGRAM_MAX_PAIRS = bound
        mla.expansion_groups = grouped if groups == "on" else (lambda seqs, *_: [[s] for s in seqs])
        run = lambda: runner.execute(plan)  # noqa: E731
        wall = median_ms(run, 5)  # after one untimed call; CUDA events span the host's launching too
        kernels = kernel_times(run)
        kern = sum(k[0] for k in kernels) / 1e3
        print(f"| {T} | {rows} | {dec} | {bound} | {groups} | {pg} | {wall:.2f} | {kern:.2f} | {wall / kern:.2f}x | "
              f"{T / wall * 1e3:,.0f} |")
        if args.top:
            print("# " + describe_kernels(kernels, args.top))
    if args.loop:
        steps, stop = 0, time.perf_counter() + args.loop
        while time.perf_counter() < stop:
            run()
            torch.cuda.synchronize()
            steps += 1
        print(f"# looped {steps} steps in {args.loop:.0f} s")


def split_plan(tokens: int, rows: int, vocab: int, context: int = 0, decode_rows: int = 0,
               decode_context: int = 0) -> StepPlan:
    """A prefill step of `tokens` new tokens over `rows` prompts (lengths differing by at most
    one), each after `context` cached tokens (random pages and state), in its own state slot and
    pages, every prompt's last row sampled (the warm-up's rows_plan); then `decode_rows` one-token
    rows after `decode_context` tokens each."""
    lens = [tokens // rows + (i < tokens % rows) for i in range(rows)]
    return rows_plan([(n, context, 0) for n in lens] + [(1, decode_context, 0)] * decode_rows, vocab, PAGE,
                     random.Random(0))

if __name__ == "__main__":
    main()
