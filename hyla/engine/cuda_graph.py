"""CUDA graphs for pure-decode steps: one graph per (batch-size bucket, page-width bucket).

This module: the decode graphs (DecodeGraphs) and what every graph shares (buckets, scratch,
capture). Speculative verify and commit graphs: hyla.engine.cuda_graph_verify, whose
CUDAGraphRunner (DecodeGraphs + verify / commit) is what ModelRunner holds.

A decode step of a hybrid model is about a thousand small kernels (projections, short convs,
gates, norms, the recurrent kernel) over a few rows; launched one by one from Python their
launch overhead, not the GPU, sets the step time. A graph replays the whole step
(`forward_batch` + `compute_logits`) with one launch.

What a graph writes: the step's fp32 logits into one [max_batch, V] buffer and, beside them, each
row's argmax (-1 where the row's largest logit is not finite) into one int64 [max_batch] buffer: a
batch whose every draw is that argmax (greedy, no logit processing or logprobs) takes its tokens
from there, with no sampler pass (hyla.engine.sampler.PendingSample's `argmax`).

What a graph reads: one persistent int64 buffer per page width, `meta [max_batch, 3 + width]`:

    meta[:, 0] token id   meta[:, 1] context length (= position of the new token)
    meta[:, 2] state slot meta[:, 3:] block table (-1 past the sequence's pages)

Before a replay the step's rows are copied in with one host -> device copy. Rows past the step's
sequences, up to the bucket, are padding: token 0, context 0, slot -1, pages -1. The pools get one
scratch slot and one scratch page at their end (`SCRATCH`, allocated by ModelRunner), which
python indexing reaches as slot -1 / page -1: a padding row's conv windows and latent land there,
and the recurrent kernel skips slot < 0 outright. So padding rows read and write nothing a
request owns.

Buckets: batch sizes 1, 2, 4, 8, 16, 24, ... (multiples of 8, as vLLM) up to `max_batch`, or
the configured EngineConfig.cuda_graph_sizes; page widths 1, 2, 3, 4, 6, 8, 12, 16, 24, ...
(the kernels read a sequence's own pages only; the width sets the table and, for GQA, the grid).
The engine captures every batch size at the widths up to max_model_len at startup
(`capture_all`, at most 1024 graphs: wider ones on first use), after its memory was accounted
before the pools were sized (hyla.engine.memory_profile.profile_graph_bytes). All graphs share
one memory pool and one logits buffer.

MoE layers are captured like the rest: routing and the expert-sorted grouped GEMMs
(hyla.ops.moe) run on the device with shapes fixed by the batch size. Left to the eager path:
steps with state checkpoints, batches larger than `max_batch`, and a model with a module that
declares `graph_safe = False` (none does today).
"""

from __future__ import annotations

import logging

import torch

from hyla.contract import ForwardBatch
from hyla.ops import constants
from hyla.engine.block_table import table_key
from hyla.engine.sampler import argmax_ids
from hyla.ops.transfer import long_tensor

log = logging.getLogger("hyla.engine")

SCRATCH = 1  # extra state slots and KV pages at the end of the pools, written by padding rows


def graph_safe(model) -> bool:
    """True when the model's decode forward has no host sync: no module declares
    `graph_safe = False`."""
    return all(getattr(m, "graph_safe", True) for m in model.modules())


def use_cuda_graphs(model, enforce_eager: bool) -> bool:
    if enforce_eager or model.device.type != "cuda":
        return False
    from hyla.ops import dispatch, triton as hyla_triton

    probe = torch.empty(1, 1, 1, 1, device=model.device, dtype=model.dtype)
    if dispatch.backend_for(probe, probe, []) != "triton" or not hyla_triton.is_available():
        # fp64 models, HYLA_BACKEND=torch or no triton: the torch recurrences read lengths on
        # the host, which a capture cannot do.
        log.info("CUDA graphs off: the linear layers run the torch ops (fp64 or HYLA_BACKEND=torch)")
        return False
    if not graph_safe(model):
        log.info("CUDA graphs off: a module of the model declares graph_safe = False")
        return False
    return True


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


def width_bucket(pages: int) -> int:
    """Smallest of 1, 2, 3, 4, 6, 8, 12, ... (2^k and 3 * 2^(k-1)) that is >= pages."""
    p = 1
    while True:
        for w in (p, p * 3 // 2) if p >= 2 else (p,):
            if w >= pages:
                return w
        p *= 2


def startup_widths(max_context: int, page_size: int, has_attention: bool, num_batch_sizes: int,
                   max_graphs: int = 1024) -> list[int]:
    """The page-width buckets whose decode graphs are captured at startup: those a context of up
    to max_context tokens needs, smallest first, as many as keep num_batch_sizes x widths within
    max_graphs (at least one)."""
    pages = -(-(max_context + 1) // page_size) if has_attention else 1
    widths, w = [], 0
    while w < pages:
        w = width_bucket(w + 1)
        widths.append(w)
    return widths[:max(1, max_graphs // max(1, num_batch_sizes))]


def _decode_pad_row(width: int) -> list[int]:
    """A padding row of the decode buffer: token 0, context 0, slot -1, no pages."""
    return [0, 0, -1] + [-1] * width


_warmup_streams: dict[torch.device, torch.cuda.Stream] = {}


def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream graph warm-ups run on, per device. cuBLAS keeps a workspace (32 MiB
    on Hopper) for every stream it has run on, for the process's life: a stream per capture
    took one from each of the pool's 32 streams, and made every sampled capture of
    memory_profile.profile_graph_bytes look 45 MiB dearer than the 3.2 MiB a graph holds."""
    if device not in _warmup_streams:
        _warmup_streams[device] = torch.cuda.Stream(device)
    return _warmup_streams[device]


class _MetaStage:
    """One host copy of a width's decode buffer `meta [max_batch, 3 + width]` and what its rows
    hold, kept between steps: a row whose block table is the same BlockTable, unchanged, as the
    last time this buffer was filled keeps its page columns, so a step writes three numbers per
    row, not the whole table (at a 128K context, 8192 page ids a row). Pinned on CUDA; `copied`
    marks its transfer, which the next `fill` waits for before writing (the engine alternates
    two stages per width, so that wait is for the copy of two steps before)."""

    def __init__(self, max_batch: int, width: int, pinned: bool):
        self.host = torch.full((max_batch, 3 + width), -1, dtype=torch.long, pin_memory=pinned)
        self.host[:, :2] = 0
        self.keys: list = [_PAD] * max_batch  # per row: its table's key, _PAD, or None (rewrite)
        self.lengths = [0] * max_batch  # per row: page columns written (the rest hold -1)
        self.event = None

    def fill(self, token_ids, context_lens, slots, block_tables, bs: int) -> torch.Tensor:
        """Rows 0 .. n-1 from the step's lists, n .. bs-1 padding -> host[:bs]."""
        if self.event is not None:
            self.event.synchronize()
        n, width = len(token_ids), self.host.shape[1] - 3
        self.host[:n, :3] = long_tensor([token_ids, context_lens, slots]).T
        for i, table in enumerate(block_tables):
            key = table_key(table)
            if key is None or key != self.keys[i]:
                self._pages(i, table[:width])
                self.keys[i] = key
        for i in range(n, bs):
            if self.keys[i] is not _PAD:
                self.host[i, :3] = torch.tensor([0, 0, -1])
                self._pages(i, ())
                self.keys[i] = _PAD
        return self.host[:bs]

    def _pages(self, row: int, pages) -> None:
        k = len(pages)
        if k:
            self.host[row, 3:3 + k] = long_tensor(pages)
        if self.lengths[row] > k:
            self.host[row, 3 + k:3 + self.lengths[row]] = -1
        self.lengths[row] = k

    def copied(self) -> None:
        self.event = torch.cuda.Event()
        self.event.record()


_PAD = ("pad",)  # a padding row's key


class DecodeGraphs:
    """Replays captured decode steps. `capture=False` runs the same padded, fixed-shape inputs
    eagerly (how the CPU tests check the padding without a GPU)."""

    def __init__(self, model, cache, max_batch: int, capture: bool | None = None,
                 batch_sizes: list[int] | None = None):
        """batch_sizes: the batch-size buckets (EngineConfig.cuda_graph_sizes; default
        batch_buckets(max_batch)); the largest is the most rows a graph takes."""
        self.model, self.cache = model, cache
        self.device = model.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.buckets = sorted(set(batch_sizes)) if batch_sizes else batch_buckets(max_batch)
        max_batch = self.buckets[-1]
        self.max_batch = max_batch
        self.page_size = cache.page_size
        self.has_attention = bool(cache.attention_layers)
        self.meta: dict[int, torch.Tensor] = {}  # width -> [max_batch, 3 + width]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._stages: dict[int, list[_MetaStage]] = {}  # width -> two host buffers, used in turn
        self._turn = 0
        # every decode graph writes its logits here (rows :bs): one [max_batch, V] buffer, not
        # one per captured (batch, width); and each row's argmax (-1: not finite) to self.argmax
        self.logits = None
        self.argmax = None
        self._pads: dict[int, torch.Tensor] = {}  # width -> a padding row of meta, on the device

    def can_run(self, plan) -> bool:
        """Whether a plain StepPlan (hyla.engine.step_plan) is a pure decode a graph takes."""
        return (0 < plan.num_rows <= self.max_batch and all(n == 1 for n in plan.seq_lens)
                and not (plan.checkpoints and any(plan.checkpoints)) and all(r in ([], [0]) for r in plan.logit_rows))

    def run(self, plan) -> tuple[torch.Tensor, torch.Tensor]:
        """A pure-decode plan (one new token per row) -> (fp32 logits [R, V] of the R rows asked
        for, their argmax [R] int64: a view of the graph's buffer, valid until the next replay)."""
        logits = self.run_decode(plan.token_ids, plan.context_lens, plan.state_slots, plan.block_tables)
        argmax = self.argmax[:plan.num_rows]
        keep = [n for n, rows in enumerate(plan.logit_rows) if rows]
        if len(keep) == plan.num_rows:
            return logits.clone(), argmax  # the logits buffer is overwritten by the next replay
        index = torch.tensor(keep, dtype=torch.long, device=logits.device)  # keep may be empty
        return logits[index], argmax[index]

    @torch.inference_mode()
    def run_decode(self, token_ids: list[int], context_lens: list[int], slots: list[int],
                   block_tables: list[list[int]]) -> torch.Tensor:
        """One decode step from python lists -> logits [N, V] fp32, a view of the graph's output
        buffer (valid until the next replay)."""
        graph, out, n = self.prepare(token_ids, context_lens, slots, block_tables)
        if graph is None:
            out = self._forward(*self._key)
        else:
            graph.replay()
        return out[:n]

    @torch.inference_mode()
    def run_fed(self, tokens: torch.Tensor, skip: torch.Tensor, context_lens: list[int], slots: list[int],
                block_tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step whose token ids are on the device, not read by the host (the previous
        step's draws: hyla.engine.overlap): tokens [N] int64; a row with skip [N] set runs as a
        padding row (its request stopped on that token, or its draw failed: nothing it owns is
        written). The graph of the step's bucket must be captured already (`ready`). -> (logits
        [N, V] fp32, argmax [N] int64), views of the graph's buffers (valid until the next replay)."""
        n = len(context_lens)
        graph, out, _ = self.prepare([0] * n, context_lens, slots, block_tables)
        width = self._key[1]
        rows = self.meta[width][:n]
        rows[:, 0] = tokens
        pad = self._pads.get(width)
        if pad is None:
            pad = self._pads[width] = torch.tensor(_decode_pad_row(width), device=self.device)
        torch.where(skip[:, None], pad, rows, out=rows)  # two launches a step: this and the ids' copy
        if graph is None:
            out = self._forward(*self._key)
        else:
            graph.replay()
        return out[:n], self.argmax[:n]

    def ready(self, context_lens: list[int]) -> bool:
        """Whether a decode step of these rows replays a graph captured already (or runs the
        padded inputs eagerly: capture off), so that it can be queued behind unread work."""
        if not 0 < len(context_lens) <= self.max_batch:
            return False
        return not self.capture or self._bucket(context_lens) in self.graphs

    def _bucket(self, context_lens: list[int]) -> tuple[int, int]:
        """(batch-size bucket, page-width bucket) of a decode step of these rows."""
        bs = next(b for b in self.buckets if b >= len(context_lens))
        need = max(-(-(c + 1) // self.page_size) for c in context_lens) if self.has_attention else 1
        return bs, width_bucket(need)

    @torch.inference_mode()
    def prepare(self, token_ids, context_lens, slots, block_tables):
        """Copy a step's rows (and padding) into the graph's input buffer, capturing its graph on
        first use -> (graph or None when not capturing, its output buffer, N)."""
        n = len(token_ids)
        bs, width = self._bucket(context_lens)
        for slot, ctx in zip(slots, context_lens):
            if ctx == 0:  # a one-token prompt: its slot may hold an old request's state
                self.cache.zero_slot(slot)
        graph, out = self._graph(bs, width)
        stage = self._stages.get(width)
        if stage is None:  # (not setdefault: its default, two pinned buffers, would be built every step)
            stage = self._stages[width] = [_MetaStage(self.max_batch, width, self.capture) for _ in range(2)]
        self._turn ^= 1
        host = stage[self._turn].fill(token_ids, context_lens, slots, block_tables, bs)
        dst = self.meta[width][:bs]
        if dst.device.type == "cuda":  # from pinned memory, asynchronously: no wait for the previous replay
            dst.copy_(host, non_blocking=True)
            stage[self._turn].copied()
        else:
            dst.copy_(host)
        self._key = (bs, width)
        return graph, out, n

    def _forward(self, bs: int, width: int) -> torch.Tensor:
        meta = self.meta[width]
        # A fresh ForwardBatch each call: what it memoises (slot mapping) must be computed inside
        # the capture, never carried over from the warm-up.
        batch = ForwardBatch(
            cu_seqlens=constants.arange(bs + 1, self.device), context_lens=meta[:bs, 1], positions=meta[:bs, 1],
            block_tables=meta[:bs, 3:], state_slots=meta[:bs, 2], seq_lens=[1] * bs,
            context_lens_list=[1] * bs, cuda_graph=True)
        hidden = self.model.forward_batch(meta[:bs, 0], batch, self.cache)
        logits = self.model.compute_logits(hidden)
        if self.logits is None:
            self.logits = logits.new_empty(self.max_batch, logits.shape[-1])
            self.argmax = torch.full((self.max_batch,), -1, dtype=torch.long, device=self.device)
        out = self.logits[:bs]
        out.copy_(logits)
        self.argmax[:bs] = argmax_ids(out)  # the sampler's greedy rule
        return out

    def capture_all(self, max_context: int, max_graphs: int = 1024) -> tuple[int, int]:
        """Capture the decode graph of every batch-size bucket at every page-width bucket a
        context of up to max_context tokens needs, smallest widths first, at most max_graphs of
        them (wider ones are captured on first use) -> (graphs captured, the widest width)."""
        if not self.capture:
            return 0, 0
        widths = startup_widths(max_context, self.page_size, self.has_attention, len(self.buckets), max_graphs)
        for width in widths:
            for bs in self.buckets:
                self._graph(bs, width)
        return len(widths) * len(self.buckets), widths[-1]

    def _graph(self, bs: int, width: int):
        if width not in self.meta:
            self.meta[width] = torch.zeros(self.max_batch, 3 + width, dtype=torch.long, device=self.device)
        key = (bs, width)
        if key in self.graphs:
            return self.graphs[key]
        if not self.capture:
            self.graphs[key] = (None, None)
            return self.graphs[key]
        meta = self.meta[width]
        # Warm up on padding rows only: every write lands in scratch.
        meta[:bs] = torch.tensor(_decode_pad_row(width), device=self.device)
        graph, out = self._capture(lambda: self._forward(bs, width))
        log.debug("captured a decode CUDA graph for batch %d, %d pages", bs, width)
        self.graphs[key] = (graph, out)
        return self.graphs[key]

    def _capture(self, step):
        """Run `step` once on a side stream (Triton compiles, cuBLAS picks kernels, outside the
        capture), then capture it -> (graph, what the captured call returned)."""
        stream = warmup_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = step()
        except BaseException:
            # A capture that fails (out of memory mid-capture, say) can leave the caching allocator
            # still "recording" into this pool, and every later capture into it then fails too:
            # the graphs captured from now on share a fresh pool instead. The step itself fails;
            # the engine retries its requests (LLMEngine.recover).
            log.warning("a CUDA graph capture failed: later graphs take a new memory pool")
            self.pool = torch.cuda.graph_pool_handle()
            raise
        return graph, out
