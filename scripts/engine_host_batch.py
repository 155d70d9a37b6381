"""An engine step's host work at a large batch, offline (no server), from the engine's own counters:

    python scripts/engine_host_batch.py DIR [--batch 256] [--prompt 32] [--tokens 128] [--device cpu]

DIR: a shape written by `hyla bench shape DIR --random-config tiny` (random weights, load_format
"dummy"). `--batch` requests of `--prompt` random tokens decode `--tokens` greedy tokens each, all
at once; prints the mean step, the model executions' share (`model_execute_seconds`) and the rest
of the step (scheduling, sampling, emitting, outputs: the host's part), per step.
"""

from __future__ import annotations

import argparse
import random
import time

from hyla import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    llm = LLM(a.model, load_format="dummy", max_num_seqs=a.batch, device=a.device)
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(a.prompt)] for _ in range(a.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
    before = dict(llm.get_metrics())
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.get_metrics()
    steps = after["num_steps"] - before["num_steps"]
    step = (after["engine_step_seconds"] - before["engine_step_seconds"]) / steps
    execute = (after["model_execute_seconds"] - before["model_execute_seconds"]) / steps
    print(f"{steps} steps in {wall:.2f} s: step {1e3 * step:.2f} ms, model execute {1e3 * execute:.2f} ms, "
          f"host in step {1e3 * (step - execute):.2f} ms")


if __name__ == "__main__":
    main()
