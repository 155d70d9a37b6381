"""One long prompt through the engine, as a user runs it: `python scripts/long_context.py DIR
--lengths 4096 131072 1048576` over a shape written by `hyla bench shape DIR --random-config NAME`
(random weights: load_format "dummy"). For each length: one request of that many random prompt
tokens (chunked prefill, max_num_batched_tokens per step), then `--decode` greedy tokens. Prints
the time to the first token (prefill tokens/s), the median decode step through the engine
(CUDA graphs, async scheduling), its ratio to the first length's, and the request's memory
(KV pages + its state slot). `--quantization fp8`: the weights in block FP8, as `hyla serve
--quantization fp8` serves them. A length that leaves no room for the decode tokens within the
model's max_position_embeddings (1,048,576 for Kimi-Linear) is cut to what does, and says so."""

from __future__ import annotations

import argparse
import random
import statistics
import time

from hyla.engine import EngineConfig, LLMEngine, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 131072])
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--quantization", choices=["fp8"], help="block-FP8 weights (drawn in FP8)")
    a = p.parse_args()
    limit = EngineConfig(model=a.model, load_format="dummy").model_limit  # the engine's own rule
    room = limit - a.decode - 1
    for L in a.lengths:
        if L > room:
            print(f"# {L} tokens cut to {room}: max_position_embeddings {limit} - {a.decode} decode tokens - 1")
    a.lengths = [min(L, room) for L in a.lengths]
    top = max(a.lengths) + a.decode + 1
    engine = LLMEngine(EngineConfig(model=a.model, load_format="dummy", max_model_len=top, max_num_seqs=4,
                                    max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=False,
                                    quantization=a.quantization))
    vocab = engine.vocab_size
    slot_gib = engine.model.state_bytes_per_slot(engine.config.state_dtype) / 2**30
    rng = random.Random(0)
    base = None
    print("prompt tokens | TTFT s | prefill tok/s | decode step ms (median) | x first | KV GiB + state GiB")
    for L in a.lengths:
        ids = [rng.randrange(10, vocab - 10) for _ in range(L)]
        params = SamplingParams(temperature=0.0, max_tokens=a.decode, ignore_eos=True)
        engine.add_request(f"long-{L}", None, params, prompt_token_ids=ids)
        start = time.perf_counter()
        ttft, stamps = None, []
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            if outs and outs[0].outputs[0].token_ids:
                if ttft is None:
                    ttft = now - start
                stamps.append(now)
        steps = [b - a_ for a_, b in zip(stamps, stamps[1:])]
        step_ms = statistics.median(steps) * 1e3 if steps else float("nan")
        base = base or step_ms
        pages = -(-(L + a.decode) // engine.config.page_size)
        kv_gib = pages * engine.kv_bytes_per_page / 2**30
        print(f"{L} | {ttft:.2f} | {L / ttft:,.0f} | {step_ms:.3f} | {step_ms / base:.2f} | "
              f"{kv_gib:.2f} + {slot_gib:.3f}", flush=True)


if __name__ == "__main__":
    main()
