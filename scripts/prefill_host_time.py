"""The host's share of an eager prefill step on the Triton path, measured on the CPU.

    python scripts/prefill_host_time.py MODEL_DIR [--tokens 16 64] [--requests 1 8] [--profile 30]

Every hyla op takes its Triton route (HYLA_BACKEND=triton under TRITON_INTERPRET=1) but each Triton
launch returns at once, its kernel not run: what remains of a step is what the host does on a GPU
before and between launches (scheduling, step inputs, the layers' Python, the torch ops on tiny
tensors), plus the interpreter's argument handling, which stands in for Triton's launcher. The
outputs are garbage (requests may fail on non-finite logits; the time is all this measures). Keep
the steps small: the torch ops still compute on the CPU, which at hundreds of rows (bf16 on a CPU)
outgrows the host work being measured.
--prefix-cache turns the cache on (each prompt exports checkpoints). Prints ms per step and Triton
launches per step; --profile N adds cProfile's top N by own time (the first --tokens, the last --requests).
It undercounts what a GPU's host does: it runs neither Triton's real launcher nor CUDA's dispatch.
On an H100 a 12-layer FP8 prefill step of 1,024 tokens took ~40 ms of wall for 18 ms of kernels
(scripts/prefill_wall.py, docs/perf-log/2026-12-06-h100-defaults-and-prefill-host.md), where this
script had estimated ~6 ms of host for those layers: the launch counts and the ranking are its use.
A model of the released layer pattern at tiny sizes: `hyla bench shape DIR --random-config
tiny-kimi-moe`, then its config.json's num_hidden_layers and linear_attn_config set to the 48B's
(docs/perf-log/2026-12-06-h100-engine-at-scale.md).
"""
import argparse
import collections
import os
import random
import statistics
import time

os.environ["HYLA_BACKEND"] = "triton"
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from triton.runtime import interpreter  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--prefix-cache", action="store_true", help="the prefix cache on: prefills export state "
                    "checkpoints (at whole pages), as a server's do")
    args = ap.parse_args()
    launches: collections.Counter = collections.Counter()

    def skipped(self, *a, **kw):  # the launch is counted, its kernel not run
        launches[self.fn.__name__] += 1

    interpreter.GridExecutor.__call__ = skipped
    from hyla.engine import EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model=args.model, load_format="dummy", dtype="bfloat16", max_model_len=8192,
                                    max_num_seqs=64, max_num_batched_tokens=max(8192, max(args.tokens)),
                                    enable_prefix_caching=args.prefix_cache, enforce_eager=True))
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def step_ms(tokens: int, requests: int) -> float:
        for _ in range(requests):
            engine.add_request(f"r{rng.random()}", None, params,
                               prompt_token_ids=[rng.randrange(10, 500) for _ in range(tokens)])
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return (time.perf_counter() - start) * 1e3

    import logging
    logging.getLogger("hyla").setLevel(logging.CRITICAL)  # garbage logits fail requests: expected here
    for _ in range(3):
        step_ms(64, 1)
    print("tokens | requests | host ms per step | Triton launches per step")
    for tokens in args.tokens:
        for requests in args.requests:
            launches.clear()
            ms = statistics.median(step_ms(tokens, requests) for _ in range(args.repeat))
            print(f"{tokens} | {requests} | {ms:.1f} | {sum(launches.values()) / args.repeat:.0f}", flush=True)
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.repeat):
            step_ms(args.tokens[0], args.requests[-1])
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
