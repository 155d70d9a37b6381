"""CUDA graphs for speculative verify steps and their commits (rollback "replay").

Speculative verify steps get graphs as decode steps do (`run_verify`): every row is padded to
the same width W = 1 + k tokens ([x0, d1..dk], missing drafts filled with token 0), so the step
has a fixed shape; the logits of padding positions are computed and ignored. A verify buffer
`vmeta [max_batch, 2 + 2W + width]` holds per row: context length, num_accepted_tokens, the W
token ids, the W state slots (rollback "slots"; "replay" reads the first only) and the block
table. Padding positions write only what nobody reads: with "slots", the states after them go to
the request's own spare slots (never the one the accepted count selects); their KV goes to rows
past the request's length in its own last page, or to the scratch page where no page is
allocated (-1). Every graph has two persistent outputs, logits `[bs, W, V]` and the final-norm
hidden states `[bs, W, hidden]` of every row (what an MTP drafter reads: a replay refreshes
both, so a verify in a graph hands the drafter the same rows as an eager one). With "replay",
the per-token inputs the layers keep for `commit_replay` are the
graph's buffers; the runner hands them back to the caches after every replay.

A commit graph (rollback "replay" only) is captured with its verify graph: it advances every
row's state by the accepted tokens (`model.commit_replay`), reading the accepted counts from one
persistent buffer (`accepted [max_batch]`; padding rows accept 1, their slot is the scratch one).

CUDAGraphRunner = the decode graphs of hyla.engine.cuda_graph (buckets, buffers, scratch slot and
page, capture) + these; ModelRunner holds one when CUDA graphs are on. Like the decode buffers,
the buffers here are filled from pinned host memory asynchronously (hyla.ops.transfer.fill_long):
a copy from pageable memory would wait for every kernel queued before it, so a step's host work
could not overlap the replays before it.

HeadStepGraphs: the MTP head's steps (hyla.engine.spec.mtp.drafter) as graphs of the same batch buckets and
page widths, sharing the runner's memory pool, W rows per request: W = 1 for a draft step (the
head state and newest draft at the next position), W = 1 + k for the catch-up on a verify's
kept rows (1 .. 1 + k of them, the rest padding). `hmeta [max_batch, 2 + W + width]` holds per
row the head's context length, the index of its last real row, its W token ids and the head's
block table; `hidden [max_batch * W, hidden]` the states fed in. Padding rows past a request's
real ones write head rows past its committed ones (overwritten before anything reads them, as
speculative rows are) or, without a page, the head's scratch page; padding requests (context
0, pages -1) write only the scratch page.

Chained greedy drafts (`run_chain`): the k - 1 draft steps after a catch-up as ONE graph per
(batch bucket, k, page width), for batches whose every request drafts greedily. Each step's
argmax is written by a device op straight into the ids the next step embeds, and its head
states are what the next step reads, so a propose needs no host round trip between steps; the
k drafts of every request come back in one copy. Inputs: `chain_hidden [max_batch, hidden]` (the
catch-up's head states), `drafts [max_k, max_batch]` (row 0: the catch-up's argmax, d1; row j:
d_{j+1}, the graph's output) and `cmeta [max_batch, 1 + width]` per width: the head context of
the first draft step (step j runs at context + j - 1) and the head's block table. Every request
runs all k - 1 steps; one that asked for fewer drafts has its extra rows land in pages it owns
(past its committed rows, as speculative rows) or, past its block table (-1), in the scratch
page, and its extra drafts are dropped by the caller: they never influence its kept drafts
(attention is causal, and its kept rows lie inside the pages reserved for its verify).
"""

from __future__ import annotations

import logging

import torch

from hyla.contract import ForwardBatch
from hyla.engine.cuda_graph import DecodeGraphs, width_bucket
from hyla.ops import constants
from hyla.ops.transfer import fill_long, to_device_long

log = logging.getLogger("hyla.engine")


def _verify_pad_row(W: int, width: int) -> list[int]:
    """A padding row of the verify buffer: context 0, 1 accepted, W tokens 0, slots -1, no pages."""
    return [0, 1] + [0] * W + [-1] * W + [-1] * width


class CUDAGraphRunner(DecodeGraphs):
    """Replays captured decode steps (DecodeGraphs) and verify / commit steps. `capture=False`
    runs the same padded, fixed-shape inputs eagerly (how the CPU tests check the padding)."""

    def __init__(self, model, cache, max_batch: int, capture: bool | None = None,
                 batch_sizes: list[int] | None = None):
        super().__init__(model, cache, max_batch, capture, batch_sizes)
        max_batch = self.max_batch
        self.vmeta: dict[tuple[int, int], torch.Tensor] = {}  # (W, width) -> [max_batch, 2 + 2W + width]
        # (bs, W, width, rollback) -> (graph, (logits [bs, W, V], hidden [bs, W, hidden]), the layers' replay inputs)
        self.verify_graphs: dict[tuple, tuple] = {}
        self.commit_graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # same keys, rollback "replay"
        self.accepted = torch.ones(max_batch, dtype=torch.long, device=self.device)  # commit's input
        self.verify_key: tuple | None = None  # the last verify step's key: its commit pads to its rows

    def can_verify(self, n: int) -> bool:
        return 0 < n <= self.max_batch

    @torch.inference_mode()
    def run_verify(self, tokens: list[list[int]], context_lens: list[int], slots: list[list[int]],
                   accepted: list[int], block_tables: list[list[int]], rollback: str,
                   return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One verify step from python lists, every row W = len(tokens[n]) tokens (the same for
        all; pad missing drafts). slots[n]: the W per-position slots ("slots") or [slot]
        ("replay"); accepted[n]: 1 + the index in slots[n] of the slot holding the current state.
        Returns logits [N, W, V] fp32, and with return_hidden also the final-norm hidden states
        [N, W, hidden]: views of the graph's output buffers (valid until the next replay)."""
        key, rows = self.verify_rows(tokens, context_lens, slots, accepted, block_tables, rollback)
        logits, hidden = self.replay_verify(key, rows)
        n = len(tokens)
        return (logits[:n], hidden[:n]) if return_hidden else logits[:n]

    def verify_rows(self, tokens: list[list[int]], context_lens: list[int], slots: list[list[int]],
                    accepted: list[int], block_tables: list[list[int]], rollback: str
                    ) -> tuple[tuple[int, int, int, str], list[list[int]]]:
        """run_verify's arguments -> (the graph key (batch bucket, W, page width, rollback), the
        vmeta rows of the step, padding rows included)."""
        n, W = len(tokens), len(tokens[0])
        if rollback not in ("slots", "replay"):
            raise ValueError(f"rollback must be 'slots' or 'replay', got {rollback!r}")
        if any(len(t) != W for t in tokens) or any(len(s) != (W if rollback == "slots" else 1) for s in slots):
            raise ValueError("verify rows must all have W tokens and W slots (rollback 'slots') or 1 ('replay')")
        bs = next(b for b in self.buckets if b >= n)
        need = max(-(-(c + W) // self.page_size) for c in context_lens) if self.has_attention else 1
        width = width_bucket(need)
        pad_slots = lambda sl: list(sl) + [-1] * (W - len(sl))  # noqa: E731
        rows = [[c, a] + list(t) + pad_slots(sl) + list(table[:width]) + [-1] * (width - len(table[:width]))
                for t, c, sl, a, table in zip(tokens, context_lens, slots, accepted, block_tables)]
        rows += [_verify_pad_row(W, width)] * (bs - n)
        return (bs, W, width, rollback), rows

    def replay_verify(self, key: tuple[int, int, int, str], rows: list[list[int]], extension=None) -> tuple:
        """Fill vmeta with `rows` and run the verify graph of `key` (captured on first use) ->
        its outputs (logits [bs, W, V], hidden [bs, W, hidden], + what the extension returns).
        extension: more work folded into the same graph after the verify forward (protocol:
        tag, pad(), fill(vmeta rows, rows) -- it writes the verify rows too --, forward(logits,
        hidden); hyla.engine.spec.mtp.fused): its graph is keyed by key + (extension.tag,), its
        commit graph ("replay") too, so that commit_replay finds it through verify_key."""
        if extension is not None:
            key = key + (extension.tag,)
        graph, out, replay = self._verify_graph(key, extension)
        if extension is None:
            fill_long(self.vmeta[key[1:3]][:key[0]], rows)
        else:  # it writes the verify rows with its own (hyla.engine.spec.mtp.fused)
            extension.fill(self.vmeta[key[1:3]][:key[0]], rows)
        self.verify_key = key
        if graph is None:
            out = self._verify_step(key, extension)
        else:
            graph.replay()
            self._restore_replay_inputs(replay)
        return out

    def _verify_step(self, key: tuple, extension) -> tuple:
        """What a verify graph of `key` runs: the verify forward, then the extension's work on its outputs."""
        out = self._verify_forward(*key[:4])
        return out if extension is None else (*out, *extension.forward(*out))

    def pad_accepted(self, accepted: list[int]) -> list[int]:
        """Accepted counts for commit_replay after `run_verify`: padding rows advance by 1 (their
        slot is the scratch slot)."""
        return list(accepted) + [1] * (self.verify_key[0] - len(accepted))

    @torch.inference_mode()
    def commit_replay(self, accepted: list[int]) -> None:
        """After a "replay" `run_verify`: advance every row's state by its accepted tokens
        (model.commit_replay), replaying the commit graph captured with the verify graph."""
        padded = self.pad_accepted(accepted)
        fill_long(self.accepted[:len(padded)], padded)
        self.replay_commit()

    @torch.inference_mode()
    def replay_commit(self) -> None:
        """The commit of the last `run_verify` / `replay_verify` with the accepted counts already
        in `accepted` (from the host, or written on the device: hyla.engine.spec.mtp.overlap)."""
        bs = self.verify_key[0]
        graph = self.commit_graphs.get(self.verify_key)
        if graph is None:
            self.model.commit_replay(self.cache, self.accepted[:bs])
        else:
            graph.replay()
            self._restore_replay_inputs([None] * len(self.cache.layers))  # consumed, as the eager commit does

    def _restore_replay_inputs(self, replay) -> None:
        """Hand each layer's cache the inputs for commit_replay: what the captured step left
        (replay[i] None, as for every attention layer: none)."""
        for layer_cache, inputs in zip(self.cache.layers, replay, strict=True):
            layer_cache.set_replay_inputs(inputs)

    def _verify_forward(self, bs: int, W: int, width: int, rollback: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded verify step over vmeta's first bs rows -> (logits [bs, W, V] fp32,
        final-norm hidden states [bs, W, hidden]): both are graph outputs when captured."""
        meta = self.vmeta[(W, width)]
        ctx, acc = meta[:bs, 0], meta[:bs, 1]
        ids = meta[:bs, 2:2 + W].reshape(-1)
        slots = meta[:bs, 2 + W:2 + 2 * W] if rollback == "slots" else meta[:bs, 2 + W:3 + W]
        positions = (ctx[:, None] + constants.arange(W, self.device)).reshape(-1)
        batch = ForwardBatch(
            cu_seqlens=constants.arange(bs + 1, self.device, step=W), context_lens=ctx, positions=positions,
            block_tables=meta[:bs, 2 + 2 * W:], state_slots=slots, num_accepted_tokens=acc, rollback=rollback,
            seq_lens=[W] * bs, context_lens_list=[1] * bs, cuda_graph=True)
        hidden = self.model.forward_batch(ids, batch, self.cache)
        return self.model.compute_logits(hidden).view(bs, W, -1), hidden.view(bs, W, -1)

    def _verify_graph(self, key: tuple, extension=None):
        bs, W, width, rollback = key[:4]
        if (W, width) not in self.vmeta:
            self.vmeta[(W, width)] = torch.zeros(self.max_batch, 2 + 2 * W + width, dtype=torch.long,
                                                 device=self.device)
        if key in self.verify_graphs:
            return self.verify_graphs[key]
        if not self.capture:
            self.verify_graphs[key] = (None, None, None)
            return self.verify_graphs[key]
        meta = self.vmeta[(W, width)]
        # Warm up on padding rows only: every write lands in scratch.
        meta[:bs] = torch.tensor(_verify_pad_row(W, width), device=self.device)
        if extension is not None:
            extension.pad()
        graph, out = self._capture(lambda: self._verify_step(key, extension))
        replay = [layer_cache.replay_inputs() for layer_cache in self.cache.layers]
        if rollback == "replay":
            # The commit reads the verify graph's buffers: fill them once from the padding rows
            # (a capture does not run), so that the commit's warm-up touches only scratch.
            graph.replay()
            self.accepted[:bs] = 1

            def commit():
                self._restore_replay_inputs(replay)  # commit_replay consumes them
                self.model.commit_replay(self.cache, self.accepted[:bs])
            self.commit_graphs[key], _ = self._capture(commit)
        self._restore_replay_inputs([None] * len(self.cache.layers))  # the capture's inputs are no step to commit
        log.debug("captured a verify CUDA graph for %s", key)
        self.verify_graphs[key] = (graph, out, replay)
        return self.verify_graphs[key]


def _table_row(table: list[int], width: int) -> list[int]:
    """A block table cut or padded (-1: the scratch page) to `width` columns."""
    return list(table[:width]) + [-1] * (width - len(table[:width]))


def _head_pad_row(W: int, width: int) -> list[int]:
    """A padding row of the head-step buffer: context 0, last row 0, W tokens 0, no pages."""
    return [0, 0] + [0] * W + [-1] * width


class HeadStepGraphs:
    """Replays the MTP head's steps (`run`) and chained greedy draft steps (`run_chain`);
    `graphs` (the runner's CUDAGraphRunner) lends its batch buckets, capture flag and memory
    pool. kv: the head's paged KV, whose last page is scratch; max_width: the widest step, 1 + k."""

    def __init__(self, graphs: CUDAGraphRunner, head, model, kv, max_width: int):
        self.graphs, self.head, self.model, self.kv = graphs, head, model, kv
        self.page_size, self.max_width = kv.k.shape[1], max_width
        self.hidden = torch.zeros(graphs.max_batch * max_width, model.config.hidden_size, dtype=model.dtype,
                                  device=graphs.device)
        self.hmeta: dict[tuple[int, int], torch.Tensor] = {}  # (W, width) -> [max_batch, 2 + W + width]
        # (bs, W, width) -> (graph or None, (last rows' head states [bs, hidden], their logits [bs, V]))
        self.steps: dict[tuple[int, int, int], tuple] = {}
        # run_chain's inputs and output (see the module docstring) and its graphs, (bs, k, width) -> graph or None
        self.chain_hidden = torch.zeros(graphs.max_batch, model.config.hidden_size, dtype=model.dtype,
                                        device=graphs.device)
        self.drafts = torch.zeros(max_width - 1, graphs.max_batch, dtype=torch.long, device=graphs.device)
        self.cmeta: dict[int, torch.Tensor] = {}  # width -> [max_batch, 1 + width]
        self.chains: dict[tuple[int, int, int], torch.cuda.CUDAGraph | None] = {}

    def can_run(self, counts: list[int]) -> bool:
        return 0 < len(counts) <= self.graphs.max_batch and max(counts) <= self.max_width

    def can_chain(self, n: int, k: int) -> bool:
        """Whether run_chain takes n requests drafting k tokens each."""
        return 0 < n <= self.graphs.max_batch and 1 <= k < self.max_width

    @torch.inference_mode()
    def run(self, hidden: torch.Tensor, ids: list[int], counts: list[int], context: list[int],
            tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [sum(counts), hidden] head inputs packed per request, ids: the token fed with
        each, context[n]: head rows already in tables[n] -> (the head state of each request's
        last row [N, hidden], its logits [N, V] fp32), views of the graph's output buffers
        (valid until the next replay)."""
        n = len(counts)
        W = 1 if max(counts) == 1 else self.max_width
        bs = next(b for b in self.graphs.buckets if b >= n)
        width = width_bucket(max(-(-(c + W) // self.page_size) for c in context))
        rows, first = [], 0
        for c, m, table in zip(context, counts, tables):
            tokens = ids[first:first + m] + [0] * (W - m)
            rows.append([c, m - 1] + tokens + _table_row(table, width))
            first += m
        rows += [_head_pad_row(W, width)] * (bs - n)
        graph, out = self._graph(bs, W, width)
        fill_long(self.hmeta[(W, width)][:bs], rows)
        dest = [i * W + j for i, m in enumerate(counts) for j in range(m)]  # request i's rows start at i * W
        self.hidden.index_copy_(0, to_device_long(dest, self.hidden.device), hidden.to(self.hidden.dtype))
        if graph is None:
            out = self._forward(bs, W, width)
        else:
            graph.replay()
        y, logits = out
        return y[:n], logits[:n]

    def _forward(self, bs: int, W: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        meta = self.hmeta[(W, width)]
        ctx, last, ids = meta[:bs, 0], meta[:bs, 1], meta[:bs, 2:2 + W].reshape(-1)
        tables = meta[:bs, 2 + W:]
        batch = self._one_row_batch(ctx, tables) if W == 1 else self.rows_batch(ctx, tables, W)
        y = self.head.forward_batch(self.hidden[:bs * W], ids, self.model, batch, self.kv).view(bs, W, -1)
        y = y[constants.arange(bs, y.device), last]  # each request's last real row
        return y, self.model.compute_logits(y)

    def rows_batch(self, ctx: torch.Tensor, tables: torch.Tensor, W: int) -> ForwardBatch:
        """A head step of W rows per request at head context ctx [bs] (rows ctx .. ctx + W - 1),
        block tables [bs, width]: verify-shaped (uniform width W), the form whose attention runs
        without host syncs. A fresh one per step, as `_one_row_batch`."""
        bs, dev = ctx.shape[0], ctx.device
        positions = (ctx[:, None] + constants.arange(W, dev)).reshape(-1)
        # the head has no state: its slots and accepted counts are placeholders (constants, no kernels)
        return ForwardBatch(cu_seqlens=constants.arange(bs + 1, dev, step=W), context_lens=ctx, positions=positions,
                            block_tables=tables, state_slots=constants.full((bs, W), 0, dev),
                            num_accepted_tokens=constants.full((bs,), 1, dev), seq_lens=[W] * bs,
                            context_lens_list=[1] * bs, cuda_graph=True)

    def _one_row_batch(self, ctx: torch.Tensor, tables: torch.Tensor) -> ForwardBatch:
        """A draft step's batch: one row per request at head context ctx [bs] (its position),
        block tables [bs, width]. A fresh one per step: what it memoises (slot mapping) must be
        computed inside a capture."""
        bs = ctx.shape[0]
        return ForwardBatch(cu_seqlens=constants.arange(bs + 1, ctx.device), context_lens=ctx, positions=ctx, block_tables=tables,
                            state_slots=constants.full((bs,), 0, ctx.device), seq_lens=[1] * bs,
                            context_lens_list=[1] * bs, cuda_graph=True)

    def _graph(self, bs: int, W: int, width: int):
        if (W, width) not in self.hmeta:
            self.hmeta[(W, width)] = torch.zeros(self.graphs.max_batch, 2 + W + width, dtype=torch.long,
                                                 device=self.graphs.device)
        key = (bs, W, width)
        if key not in self.steps:
            if not self.graphs.capture:
                self.steps[key] = (None, None)
            else:
                self.hmeta[(W, width)][:bs] = torch.tensor(_head_pad_row(W, width), device=self.graphs.device)
                self.steps[key] = self.graphs._capture(lambda: self._forward(bs, W, width))
                log.debug("captured an MTP head CUDA graph for batch %d, %d rows, %d pages", bs, W, width)
        return self.steps[key]

    @torch.inference_mode()
    def run_chain(self, y: torch.Tensor, logits: torch.Tensor, k: int, context: list[int],
                  tables: list[list[int]]) -> torch.Tensor:
        """k greedy drafts per request, the k - 1 draft steps chained on the device: y [N, hidden]
        the head state at each request's newest committed row and logits [N, V] its logits (a
        catch-up's); context[n]: head rows in tables[n] after that catch-up -> drafts [N, k] int64
        on the device (d1 = argmax(logits), then one per step): a view of a persistent buffer,
        valid until the next run_chain. The host builds one metadata row per request, once."""
        n = len(context)
        torch.argmax(logits, -1, out=self.drafts[0, :n])  # d1
        if k > 1:
            self.chain_hidden[:n].copy_(y)
            self._replay_chain(k, context, tables)
        return self.drafts[:k, :n].T

    def _replay_chain(self, k: int, context: list[int], tables: list[list[int]]) -> None:
        """Draft steps 1 .. k - 1 of run_chain: one metadata row per request to the device (one
        copy), then the chained graph (captured on first use, on padding rows)."""
        n = len(context)
        bs = next(b for b in self.graphs.buckets if b >= n)
        # the last step (j = k - 1) writes head row context + k - 2
        width = width_bucket(max(-(-(c + k - 1) // self.page_size) for c in context))
        graph = self._chain_graph(bs, k, width)
        rows = [[c] + _table_row(table, width) for c, table in zip(context, tables)]
        rows += [[0] + [-1] * width] * (bs - n)
        fill_long(self.cmeta[width][:bs], rows)
        if graph is None:
            self._chain_forward(bs, k, width)
        else:
            graph.replay()

    def _chain_forward(self, bs: int, k: int, width: int) -> None:
        """Draft steps 1 .. k - 1 over the first bs rows: step j feeds (the head state of step
        j - 1, d_j) at head context cmeta[:, 0] + j - 1 and writes d_{j + 1} = argmax into
        drafts[j]. Nothing reads the host: capturable as one graph."""
        meta = self.cmeta[width]
        for j, d in enumerate(self.chain_steps(self.chain_hidden[:bs], self.drafts[0, :bs], meta[:bs, 0],
                                               meta[:bs, 1:], k - 1), 1):
            self.drafts[j, :bs] = d

    def chain_steps(self, y: torch.Tensor, ids: torch.Tensor, ctx: torch.Tensor, tables: torch.Tensor,
                    steps: int) -> list[torch.Tensor]:
        """`steps` one-row head steps: step j feeds (head state, ids) at head context ctx + j
        (y [bs, hidden], ids / ctx [bs], tables [bs, width]) and its argmax is the next step's ids
        -> every step's argmax [bs]. Nothing reads the host: capturable (the draft chain, and
        the fused step's, hyla.engine.spec.mtp.fused)."""
        out = []
        # the chain's rows, one per step, as the columns of one grid: their KV rows, masks and
        # RoPE tables computed once for all the steps
        grid = self.rows_batch(ctx, tables, steps) if steps else None
        for j in range(steps):
            y = self.head.forward_batch(y, ids, self.model, grid.column(j), self.kv)
            ids = self.model.greedy_tokens(y)
            out.append(ids)
        return out

    def _chain_graph(self, bs: int, k: int, width: int) -> torch.cuda.CUDAGraph | None:
        if width not in self.cmeta:
            self.cmeta[width] = torch.zeros(self.graphs.max_batch, 1 + width, dtype=torch.long,
                                            device=self.graphs.device)
        key = (bs, k, width)
        if key not in self.chains:
            if not self.graphs.capture:
                self.chains[key] = None
            else:
                self.cmeta[width][:bs] = torch.tensor([0] + [-1] * width, device=self.graphs.device)
                self.chains[key], _ = self.graphs._capture(lambda: self._chain_forward(bs, k, width))
                log.debug("captured a chained MTP draft CUDA graph for batch %d, %d drafts, %d pages", bs, k, width)
        return self.chains[key]
