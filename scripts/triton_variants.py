"""Which Triton kernels a serving workload compiles more than once, on the CPU.

Triton compiles a kernel once per specialisation: its constexpr values and, for every other
integer argument, whether it is 1 or divisible by 16 (and 32 / 64 bit), for every pointer whether
it is 16-byte aligned. A server sees new token counts, pair counts and offsets step after step, so
a fresh machine keeps compiling while it serves: on an H100 the first 48B server of a machine ran
its agent trace's model steps 90 s longer than the same server warm
(docs/perf-log/2026-12-06-h100-host-tier-same-step.md). This runs prompts of random lengths (with
prefix-cache hits) through `LLM` under the Triton interpreter and prints, round after round, the
specialisations that had not been seen yet, then per kernel how many there were and which
arguments differed. An argument that only bounds a loop or a mask is a candidate for
`do_not_specialize` (time it on the device: a bound divisible by 16 can vectorise masked loads).

    python scripts/triton_variants.py MODEL_DIR [--rounds 2] [--warmup] [--crowd 20 40]

--warmup runs the engine's startup kernel warm-up (hyla.engine.kernel_warmup, which the engine
runs on CUDA only) first and counts what it compiled apart: what the rounds still add is what a
warmed-up server compiles while it serves.
    (MODEL_DIR e.g. from `hyla bench shape /tmp/tkm --random-config tiny-kimi-moe`)
"""
import argparse
import collections
import inspect
import os
import random

os.environ["HYLA_BACKEND"] = "triton"
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from triton.runtime import interpreter  # noqa: E402


def _spec(v):
    """What Triton's cache key keeps of a runtime argument (an approximation of its rules)."""
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int):
        return ("i64" if not -2**31 <= v < 2**31 else "i32", v == 1, v % 16 == 0)
    if isinstance(v, torch.Tensor):
        return (str(v.dtype), v.data_ptr() % 16 == 0)
    return type(v).__name__


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", action="store_true", help="the engine's kernel warm-up first")
    ap.add_argument("--crowd", type=int, nargs="*", default=[],
                    help="after the rounds, N short prompts at once per value: steps of many decode rows beside "
                         "prefill chunks, as a server with N running requests takes (eager in mixed steps)")
    args = ap.parse_args()
    seen: dict[str, list] = collections.defaultdict(list)
    fresh: list[str] = []
    launch = interpreter.GridExecutor.__call__

    def recording(self, *a, **kw):
        sig = inspect.signature(self.fn)
        bound = sig.bind_partial(*a, **{k: v for k, v in kw.items() if k in sig.parameters})
        key = (tuple((n, v if n in self.constexprs else _spec(v)) for n, v in bound.arguments.items()),
               tuple(sorted((k, v) for k, v in kw.items() if k not in sig.parameters and k != "grid")))
        if key not in seen[self.fn.__name__]:
            seen[self.fn.__name__].append(key)
            fresh.append(self.fn.__name__)
        return launch(self, *a, **kw)

    interpreter.GridExecutor.__call__ = recording
    from hyla import LLM, SamplingParams

    llm = LLM(args.model, load_format="dummy", device="cpu", dtype="bfloat16", enforce_eager=True,
              enable_prefix_caching=True, max_num_batched_tokens=512, max_model_len=4096)
    if args.warmup:
        from hyla.engine.kernel_warmup import warm_up_kernels

        cfg = llm.engine.config
        warm_up_kernels(llm.engine.model, max_num_batched_tokens=cfg.max_num_batched_tokens, page_size=cfg.page_size,
                        state_dtype=cfg.state_dtype, checkpoints=True)
        print(f"warm-up: {len(fresh)} specialisations", flush=True)
        fresh.clear()
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def prompts(n: int, lo: int, hi: int) -> list[list[int]]:
        return [[rng.randrange(5, 200) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]

    base = prompts(3, 20, 200)
    llm.generate(base, sp, use_tqdm=False)
    print(f"first round: {len(fresh)} {'new' if args.warmup else 'specialisations'}", flush=True)
    for r in range(args.rounds):
        fresh.clear()
        llm.generate(prompts(3, 20, 400), sp, use_tqdm=False)
        llm.generate([p + [7] * rng.randrange(1, 90) for p in base], sp, use_tqdm=False)  # prefix hits
        print(f"round {r + 1}: {len(fresh)} new: {', '.join(sorted(collections.Counter(fresh)))}", flush=True)
    for n in args.crowd:
        fresh.clear()
        llm.generate(prompts(n, 8, 60), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
        print(f"crowd of {n}: {len(fresh)} new: {', '.join(sorted(collections.Counter(fresh)))}", flush=True)
    print("kernel | specialisations | arguments that differ")
    for name, keys in sorted(seen.items(), key=lambda kv: -len(kv[1])):
        differ = {n for key in keys[1:] for (n, x), (_, y) in zip(key[0], keys[0][0]) if x != y}
        if any(key[1] != keys[0][1] for key in keys[1:]):
            differ.add("launch options")
        print(f"{name} | {len(keys)} | {', '.join(sorted(differ))}")


if __name__ == "__main__":
    main()
