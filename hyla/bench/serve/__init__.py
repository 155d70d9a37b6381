"""`hyla bench serve`: a load generator for any OpenAI-compatible server (hyla serve, vllm serve),
with `vllm bench serve`'s flags, figures and result keys.

    hyla serve &                                   # the bundled default model on :8000
    hyla bench serve --dataset-name random --random-input-len 128 --random-output-len 32 \\
        --num-prompts 64 --request-rate 8 --max-concurrency 16 --save-result --plot figs/

One concern per module: tokens (writing prompts of a token length), datasets (random, sharegpt,
prefix, agent), client (one streamed request, timed), load (arrivals and ramps, warm-ups,
concurrency), metrics (the figures), server_metrics (prefix-cache counters of /metrics), report
(result JSON, printed table), plots (PNG figures), cli (flags and the run).
"""

from hyla.bench.serve.cli import main

__all__ = ["main"]
