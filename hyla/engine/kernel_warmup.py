"""Kernel warm-up at startup: the prefill-shaped steps a server meets, run once before it serves.

Triton compiles a kernel once per specialisation: its constexprs (tile tables keyed by row
counts, the norm's variant, ...), and for every other argument whether an integer is 1 or a
multiple of 16 and whether a pointer is 16-byte aligned. Decode steps replay CUDA graphs captured
at startup, but prefill and mixed steps run eagerly with new token counts, offsets and batch
compositions, so a fresh machine kept compiling for its first minutes of serving: the first 48B
server of an H100 ran its agent trace's model steps 90 s longer than the same server warm
(docs/perf-log/2026-12-06-h100-host-tier-same-step.md). On a machine whose Triton cache already
holds the kernels, the warm-up costs only its steps.

The steps run through a throwaway ModelRunner with pools of its own (random tokens, nothing the
engine holds is touched), before the engine's pools are sized: one row of T tokens for T on a
geometric ladder from 1 to max_num_batched_tokens (and T + 1: the other divisibility), rows over
a context (prefix-cache hits, later chunks), batches of several prefill and decode rows, crowds of 16
and 17 decode rows beside a prefill (a loaded server's mixed steps, which run eagerly), and,
with the prefix cache, prefills that export state checkpoints. Under the Triton interpreter on
the tiny Kimi MoE shape (max_num_batched_tokens 512), a random workload with prefix hits compiled
62 specialisations over its first rounds; after the warm-up (71 of its own) the same rounds
compiled 7 (`python scripts/triton_variants.py MODEL --rounds 3 --warmup`), with the step inputs
staged on 16-byte boundaries (hyla.ops.transfer.stage_long; 16 without). A crowd of 16 requests
at once (`--crowd 16 24`) then compiled MLA's split combine for 16 decode rows, which the crowds
here cover (72 of its own); what else it compiled were pure decode steps, which a server replays
in CUDA graphs captured at startup. On a fresh H100 the 48B shape's warm-up took 40 s (70 steps, a
cold Triton cache: compiles included).
"""

from __future__ import annotations

import logging
import random
import time

import torch

from hyla.engine.step_plan import StepPlan

log = logging.getLogger("hyla.engine")

GROWTH = 1.5  # the ladder of single-row prefill lengths
PREFILL_ROWS = 8  # the most prefill rows a warm-up step holds
# Mixed steps of a loaded server carry many decode rows beside a prefill chunk, eagerly: rows a
# multiple of 16 and not (their count is an integer argument of the attention kernels)
CROWDS = (16, 17)
MAX_ROWS = max(CROWDS) + 1  # the widest warm-up step: a crowd of decode rows and one prefill
CONTEXT = 1024  # the longest context a warm-up row extends


def warmup_rows(max_tokens: int, checkpoints: bool, seed: int = 0) -> list[list[tuple[int, int, int]]]:
    """The warm-up steps: each a list of rows (new tokens, context tokens, checkpoints to export:
    0, 1 or 2), every step within max_tokens new tokens and every row within MAX_ROWS a step."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    rng = random.Random(seed)
    lengths, t = set(), 1.0
    while t <= max_tokens:
        lengths.update({int(t), min(int(t) + 1, max_tokens)})
        t *= GROWTH
    lengths.update(n for n in (16, 64, 256, 1024, 4096, max_tokens) if n <= max_tokens)
    steps: list[list[tuple[int, int, int]]] = [[(n, 0, 0)] for n in sorted(lengths)]
    # one row over a context: a prefix-cache hit or a prompt's later chunk, offsets on and off 16
    for n, c in ((1, 37), (5, 16), (17, 100), (64, 256), (100, CONTEXT - 24), (max_tokens // 2, 513)):
        steps.append([(max(1, min(n, max_tokens)), c, 0)])
    # several rows: prefill chunks over contexts, and decode rows beside one prefill (a mixed step)
    for k in range(2, PREFILL_ROWS + 1):
        share = max(1, max_tokens // k)
        steps.append([(rng.randrange(1, share + 1), rng.randrange(0, CONTEXT // 2), 0) for _ in range(k)])
        if max_tokens > k:
            steps.append([(1, rng.randrange(1, CONTEXT // 2), 0) for _ in range(k - 1)]
                         + [(rng.randrange(1, max_tokens - k + 2), 0, 0)])
    # a crowd of decode rows beside one prefill; the widest row 32 pages of 16 tokens, then 33
    # (the table's width, an integer argument too, a multiple of 16 and not)
    for d, widest in zip(CROWDS, (32 * 16 - 2, 33 * 16 - 2)):
        if max_tokens > d:
            contexts = [rng.randrange(16, CONTEXT // 2) for _ in range(d - 1)] + [widest]
            steps.append([(1, c, 0) for c in contexts] + [(min(100, max_tokens - d), 0, 0)])
    if checkpoints:
        steps.append([(min(200, max_tokens), 0, 1), (min(33, max_tokens), 17, 0)])
        steps.append([(max_tokens, 64, 2)])
    return [step for step in steps if sum(r[0] for r in step) <= max_tokens]  # the checkpoint pair may not fit


def step_pages(rows: list[tuple[int, int, int]], page_size: int) -> int:
    """The pages `rows_plan` gives a step's rows (new tokens, context tokens, ...), side by side."""
    return sum(-(-(context + n + 1) // page_size) for n, context, *_ in rows)


def rows_plan(rows: list[tuple[int, int, int]], vocab: int, page_size: int, rng: random.Random) -> StepPlan:
    """A step of `rows` (new tokens, context tokens, checkpoints to export: 0, 1 or 2) -> its
    StepPlan over random token ids: row i in state slot i, its pages after the rows' before it
    (step_pages in all), its last token sampled; checkpoints after whole pages of its prefill,
    into slots MAX_ROWS and MAX_ROWS + 1."""
    ids, lens, contexts, tables, logit_rows, exports = [], [], [], [], [], []
    first = 0
    for n, context, ckpts in rows:
        ids.extend(rng.randrange(vocab) for _ in range(n))
        lens.append(n)
        contexts.append(context)
        pages = step_pages([(n, context)], page_size)
        tables.append(list(range(first, first + pages)))
        first += pages
        logit_rows.append([n - 1])
        exports.append([(page_size * (j + 1), MAX_ROWS + j) for j in range(ckpts) if page_size * (j + 1) < n])
    return StepPlan(ids, lens, contexts, tables, list(range(len(rows))), logit_rows,
                    exports if any(exports) else None)


@torch.inference_mode()
def warm_up_kernels(model, *, max_num_batched_tokens: int, page_size: int, state_dtype: torch.dtype,
                    kv_cache_dtype: str | None = None, checkpoints: bool = False, seed: int = 0) -> int:
    """Run `warmup_rows`' steps through a throwaway ModelRunner over pools of its own -> the number
    of steps run. Token ids are random; outputs are dropped. checkpoints: the engine's prefix
    cache is on (its prefills export state checkpoints)."""
    from hyla.engine.model_runner import ModelRunner

    steps = warmup_rows(max_num_batched_tokens, checkpoints, seed)
    slots = MAX_ROWS + 2  # a state slot per row, and two for checkpoints
    num_pages = max(step_pages(step, page_size) for step in steps)
    start = time.perf_counter()
    runner = ModelRunner(model, slots, num_pages, page_size, state_dtype, enforce_eager=True,
                         kv_cache_dtype=kv_cache_dtype)
    rng = random.Random(seed)
    for step in steps:
        runner.execute(rows_plan(step, model.config.vocab_size, page_size, rng))
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    del runner
    log.info("kernel warm-up: %d prefill-shaped steps in %.1f s (Triton compiles them once per machine; "
             "kernel_warmup=False skips it)", len(steps), time.perf_counter() - start)
    return len(steps)
