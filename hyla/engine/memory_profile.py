"""How much device memory the pools get, as vLLM users expect it (`--gpu-memory-utilization`).

    budget = utilization x the device's total memory
             - what is not free on the device once PyTorch handed its cached blocks back (weights,
               CUDA context, other processes, and the free fragments of segments the allocator
               cannot release because a live tensor shares them: pool tensors are too large to
               fit there)
             - the peak of a profiled worst-case step (activations, logits, the sampler's buffers)
             - the decode CUDA graphs captured at startup (profiled the same way: their pool,
               logits buffer and per-graph cost)
             - `reserved_bytes`: weights loaded after the pools (an MTP head) and the buffers of
               copies in flight to a host tier (hyla.engine.host_offload.STAGING_BYTES)

The worst-case step is measured, not estimated: one sequence of max_num_batched_tokens tokens
through the model with throwaway pools of one slot, with logits for max_num_seqs rows and the
sampler's filters over them, under torch.cuda's peak-memory counter. A chunk over a long cached
context takes more than that profiled step (context 0): its attention builds the context's keys
and values a block of at most hyla.layers.prefix_attention.EXPAND_BYTES at a time (MLA gathers
each block's latents; gated attention gathers the context's K / V rows first: 0.5 GB at 262K
tokens on the Qwen3-Next shape); the memory the utilization leaves unused holds that (14 GB on an
H200 at 0.9).
"""

from __future__ import annotations

import gc
import logging
import os

import torch

log = logging.getLogger("hyla.engine")

GiB = 1 << 30
GRAPH_SAMPLES = 8  # further graphs captured to measure what each adds (profile_graph_bytes)


def prefer_expandable_segments() -> bool:
    """Ask PyTorch's CUDA allocator for expandable segments, unless the user configured it
    (PYTORCH_CUDA_ALLOC_CONF) or CUDA already allocated: -> whether this call set it.

    Why: loading leaves holes in the fixed-size segments (tensors freed as prepare_for_inference
    stacks experts, load temporaries) that empty_cache cannot hand back while a live tensor
    shares the segment. The 48B shape in block FP8 on an H100: 46.5 GiB of tensors held 61.5 GiB
    of the card (14.4 GiB of inactive splits) and left the pools nothing; with expandable
    segments the same load holds 47.2 GiB (docs/perf-log/2026-12-06-h100-engine-at-scale.md).
    The variable is read when the allocator starts, so this runs before the model loads; worker
    processes started later inherit it."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return False
    if torch.cuda.is_initialized():
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return True


@torch.inference_mode()
def profile_step_bytes(model, *, num_tokens: int, num_logit_rows: int, page_size: int,
                       state_dtype: torch.dtype) -> int:
    """Bytes a step of `num_tokens` tokens with `num_logit_rows` sampled rows allocates on the
    model's CUDA device beyond what is allocated before it (0 off CUDA: nothing to size there)."""
    from hyla.engine.model_runner import ModelRunner
    from hyla.engine.sampler import probs_batch
    from hyla.engine.sampling_params import SamplingParams
    from hyla.engine.step_plan import StepPlan

    device = model.device
    if device.type != "cuda":
        return 0
    pages = -(-num_tokens // page_size)
    runner = ModelRunner(model, 1, pages, page_size, state_dtype, enforce_eager=True)
    rows = list(range(num_tokens - min(num_logit_rows, num_tokens), num_tokens))
    # num_tokens fresh tokens in slot 0 and pages 0..n-1
    plan = StepPlan(token_ids=[(7 * i + 1) % model.config.vocab_size for i in range(num_tokens)],
                    seq_lens=[num_tokens], context_lens=[0], block_tables=[list(range(pages))], state_slots=[0],
                    logit_rows=[rows])
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    logits = runner.execute(plan).logits
    probs = probs_batch(logits, [SamplingParams(top_p=0.9, top_k=50, min_p=0.01)] * logits.shape[0])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del runner, logits, probs
    torch.cuda.empty_cache()
    return max(0, peak)


@torch.inference_mode()
def profile_graph_bytes(model, *, batch_sizes: list[int], widths: list[int], page_size: int,
                        state_dtype: torch.dtype) -> int:
    """Device bytes the decode CUDA graphs the engine captures at startup (every batch size at
    every page width of `widths`) will hold (0 off CUDA), over throwaway pools of one slot and one
    page (every row padding): the largest batch size's graph at the widest width is captured
    first, and holds the graphs' shared memory pool (the step's activations, the attention's split
    partials, which grow with the width) and logits buffer; then up to GRAPH_SAMPLES more, the
    first ones capture_all takes, whose mean is what each further graph adds (the driver's copy of
    its kernels, new pool blocks). The estimate is first + (num_graphs - 1) x that mean.

    The captures warm up on one stream (cuda_graph.warmup_stream): with a new stream each, every
    sample also paid cuBLAS's per-stream workspace, 45 MiB a graph against the 3.2 MiB it holds
    (48B shape in FP8 on an H100: estimate 2.73 GiB, 1.96 GiB captured; docs/perf-log/
    2026-12-06-h100-defaults-and-prefill-host.md)."""
    from hyla.engine.cuda_graph import SCRATCH
    from hyla.engine.cuda_graph_verify import CUDAGraphRunner

    device = model.device
    num_graphs = len(batch_sizes) * len(widths)
    if device.type != "cuda" or num_graphs == 0:
        return 0
    cache = model.allocate_cache(1 + SCRATCH, 1 + SCRATCH, page_size=page_size, state_dtype=state_dtype)
    graphs = CUDAGraphRunner(model, cache, max_batch=max(batch_sizes), batch_sizes=batch_sizes)
    first = (graphs.buckets[-1], max(widths))
    order = [(bs, w) for w in sorted(widths) for bs in graphs.buckets if (bs, w) != first]  # capture_all's
    costs = []
    for bs, width in [first] + order[:min(GRAPH_SAMPLES, num_graphs - 1)]:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(device)[0]
        graphs._graph(bs, width)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the warm-up's blocks: not the graphs'
        costs.append(max(0, free - torch.cuda.mem_get_info(device)[0]))
    del cache, graphs
    torch.cuda.empty_cache()
    each = sum(costs[1:]) / len(costs[1:]) if len(costs) > 1 else 0
    estimate = costs[0] + int((num_graphs - 1) * each)
    log.info("decode graphs: %d to capture, estimated %.2f GiB (the first %.2f GiB, each further %.1f MiB: "
             "the mean of %d)", num_graphs, estimate / GiB, costs[0] / GiB, each / 2**20, len(costs) - 1)
    return estimate


def device_pool_budget(device: torch.device, utilization: float, step_bytes: int, reserved_bytes: int = 0) -> int:
    """The pools' bytes on a CUDA device (see the module docstring); ValueError when nothing is
    left, naming the figures and the setting to change."""
    gc.collect()  # an engine the caller dropped may sit in a reference cycle: its pools are free memory
    torch.cuda.empty_cache()  # loading's temporaries: cached blocks go back to the driver
    total = torch.cuda.get_device_properties(device).total_memory
    free, _ = torch.cuda.mem_get_info(device)
    # What empty_cache could not release lies in segments shared with live tensors: counting it
    # as free ran the 80B FP8 cut out of memory on an H100 (11 GiB cached, a 2.4 GiB page tensor
    # refused), so it is held like the weights, the context and other processes.
    held = total - free
    budget = int(utilization * total) - held - step_bytes - reserved_bytes
    allocated = torch.cuda.memory_allocated(device)
    log.info("memory: gpu_memory_utilization %.2f of %.1f GiB = %.1f GiB; in use %.1f GiB (%.1f GiB of tensors: "
             "weights, and the prefill graphs' buffers and pool when captured; the rest the CUDA context, other processes, unreleasable fragments); worst-case step and "
             "decode graphs %.2f GiB; reserved (weights loaded later, host-tier buffers) %.2f GiB; pools %.1f GiB",
             utilization, total / GiB, utilization * total / GiB, held / GiB, allocated / GiB, step_bytes / GiB,
             reserved_bytes / GiB, max(budget, 0) / GiB)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization} of {total / GiB:.1f} GiB leaves nothing for the KV "
                         f"pages and state slots: {held / GiB:.1f} GiB are in use and a worst-case step with the "
                         f"decode graphs takes {step_bytes / GiB:.2f} GiB; raise gpu_memory_utilization, or lower "
                         "max_num_batched_tokens / max_num_seqs / max_model_len, or set memory_budget")
    return budget
