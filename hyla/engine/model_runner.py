"""ModelRunner: owns the model, its pools (HybridCache) and every tensor of a step.

One call, `execute(plan)`, runs a step (hyla.engine.step_plan.StepPlan): a plain one (varlen
prefill chunks and decodes packed in one `forward_batch`, fp32 logits for the rows that need
them) or a speculative verify over [x0, d1..dk] rows, optionally with a proposer's graph
extension in the same graph, and returns a StepResult (logits, hidden states, the extension's
outputs, and whether it ran in a graph: what a "replay" verify's `commit_replay` needs; the
runner keeps nothing between calls). On CUDA, pure-decode steps and padded verify steps replay
CUDA graphs captured per batch-size bucket unless `enforce_eager`; the CPU path is always eager.
"""

from __future__ import annotations

import torch

from hyla.contract import ForwardBatch
from hyla.ops.transfer import to_device_long
from hyla.engine.cache_tiers import CacheTiers, TierSizes, plain_transfers
from hyla.engine.cuda_graph import SCRATCH, use_cuda_graphs
from hyla.engine.cuda_graph_verify import CUDAGraphRunner
from hyla.engine.device_timer import DeviceTimer
from hyla.engine.step_plan import StepPlan, StepResult


class ModelRunner:
    def __init__(self, model, num_slots: int, num_pages: int, page_size: int, state_dtype: torch.dtype,
                 enforce_eager: bool = False, kv_cache_dtype: str | None = None,
                 cuda_graph_sizes: list[int] | None = None, prefill_graphs=None):
        """kv_cache_dtype: how the attention pages are stored ("auto", "fp8": hyla.ops.kv_fp8);
        None = the model's own (model.kv_cache_dtype). cuda_graph_sizes: the decode graphs'
        batch-size buckets (default: 1, 2, 4, 8, 16, 24, ... up to num_slots). prefill_graphs: a
        hyla.engine.prefill_graphs.PrefillGraphs of this model: the prefill steps it can take run
        through it."""
        self.model = model
        self.device = model.device
        self.page_size = page_size
        graphs = use_cuda_graphs(model, enforce_eager)  # padding rows write one scratch slot / page
        extra = SCRATCH if graphs else 0
        kv = {} if kv_cache_dtype is None else {"kv_cache_dtype": kv_cache_dtype}
        self.cache = model.allocate_cache(num_slots + extra, num_pages + extra, page_size=page_size,
                                          state_dtype=state_dtype, **kv)
        sizes = sorted({min(b, num_slots) for b in cuda_graph_sizes}) if cuda_graph_sizes else None  # <= requests
        self.graphs = CUDAGraphRunner(model, self.cache, max_batch=num_slots, batch_sizes=sizes) if graphs else None
        self.prefill_graphs = prefill_graphs
        self.tiers: CacheTiers | None = None  # the prefix cache's int8 / host tiers (attach_tiers)
        self.execute_time = DeviceTimer(self.device)  # the device time of `execute` calls

    @torch.inference_mode()
    def execute(self, plan: StepPlan, *, return_hidden: bool = False, device_logits: bool = False,
                extension=None, fed: tuple[torch.Tensor, torch.Tensor] | None = None) -> StepResult | None:
        """Run one step: a plain plan's rows (prefill chunks and decodes packed in one forward)
        or a verify plan's [x0, d1..dk] rows. The StepResult holds the logits of the rows asked
        for (every verify row), with return_hidden also their final-norm hidden states (on the
        device: what an MTP drafter reads; a plain step then runs eagerly), and `in_graph`, which
        a "replay" verify's commit_replay takes. A pure-decode plain step replays a decode graph;
        a verify whose rows may be padded to pad_to tokens replays a verify graph (when the
        runner has graphs). device_logits: the caller accepts on the device (every request
        argmax-accepting: one argmax, a copy of ids), so a graph's logits stay there too; else
        they come to the host in one copy (a sampling acceptance reads them row by row).
        extension: work folded into the verify graph (CUDAGraphRunner.replay_verify's protocol,
        hyla.engine.spec.mtp.fused): the result is then the graph's outputs for the batch bucket
        ([bs, W, V] logits, [bs, W, hidden] hidden states, the extension's: views of its buffers,
        valid until the next replay), or None (nothing ran) when the step cannot run padded in a
        graph. fed = (tokens [N], skip [N]): a pure-decode plan whose token ids are these device
        values instead of plan.token_ids, a row with skip set running as padding (a step launched
        before the previous one's draws were read: hyla.engine.overlap; `can_feed` first); its
        logits are a view of the graph's output buffer, valid until the next replay. Its device
        time adds to `execute_time` (hyla.engine.device_timer)."""
        with self.execute_time.measure():
            return self._execute(plan, return_hidden, device_logits, extension, fed)

    def _execute(self, plan: StepPlan, return_hidden: bool, device_logits: bool, extension,
                 fed: tuple[torch.Tensor, torch.Tensor] | None) -> StepResult | None:
        if fed is not None:
            logits, argmax = self.graphs.run_fed(*fed, plan.context_lens, plan.state_slots, plan.block_tables)
            return StepResult(logits, in_graph=True, argmax=argmax)
        if plan.is_verify:
            return self._verify(plan, return_hidden, device_logits, extension)
        if not return_hidden and self.graphs is not None and self.graphs.can_run(plan):
            logits, argmax = self.graphs.run(plan)
            return StepResult(logits, in_graph=True, argmax=argmax)
        batch = ForwardBatch.build(seq_lens=plan.seq_lens, context_lens=plan.context_lens,
                                   block_tables=plan.block_tables, state_slots=plan.state_slots,
                                   checkpoints=plan.checkpoints, device=self.device)
        ids = to_device_long(plan.token_ids, self.device)
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(batch):
            hidden = self.prefill_graphs.run(ids, batch, self.cache)  # a static buffer's rows
            if return_hidden:
                hidden = hidden.clone()
        else:
            hidden = self.model.forward_batch(ids, batch, self.cache)
        starts = batch.cu_seqlens_list[:-1]  # host values: no sync before the logits
        index = [start + r for start, rows in zip(starts, plan.logit_rows) for r in rows]
        if not index:
            logits = hidden.new_zeros(0, self.model.config.vocab_size, dtype=torch.float32)
        else:
            logits = self.model.compute_logits(hidden[to_device_long(index, hidden.device)])
        return StepResult(logits, hidden if return_hidden else None)

    def capture_graphs(self, max_context: int) -> tuple[int, int]:
        """Capture the decode graphs up front (DecodeGraphs.capture_all) -> (graphs, widest width)."""
        return self.graphs.capture_all(max_context) if self.graphs is not None else (0, 0)

    def can_feed(self, plan: StepPlan) -> bool:
        """Whether `execute(plan, fed=...)` can run plan: a pure decode whose graph is ready."""
        return self.graphs is not None and self.graphs.can_run(plan) and self.graphs.ready(plan.context_lens)

    def _verify(self, plan: StepPlan, return_hidden: bool, device_logits: bool, extension) -> StepResult | None:
        """execute's verify steps: in a graph (with the extension, or padded: _verify_in_graph)
        or eagerly, the rows as they are."""
        graphed = self._graph_verifies(plan)
        if extension is not None:
            if not graphed:
                return None
            key, vrows = self.graphs.verify_rows(plan.padded_rows(), plan.context_lens, plan.state_slots,
                                                 plan.accepted, plan.block_tables, plan.rollback)
            logits, hidden, *ext = self.graphs.replay_verify(key, vrows, extension)
            return StepResult(logits, hidden, tuple(ext), in_graph=True)
        if graphed:
            return self._verify_in_graph(plan, return_hidden, device_logits)
        batch = ForwardBatch.build(seq_lens=plan.seq_lens, context_lens=plan.context_lens,
                                   block_tables=plan.block_tables, state_slots=plan.state_slots, device=self.device,
                                   num_accepted_tokens=plan.accepted, rollback=plan.rollback)
        hidden = self.model.forward_batch(to_device_long(plan.token_ids, self.device), batch, self.cache)
        return StepResult(self.model.compute_logits(hidden), hidden if return_hidden else None)

    def _graph_verifies(self, plan: StepPlan) -> bool:
        """Whether the verify plan runs padded to pad_to tokens per row in a graph."""
        return bool(self.graphs is not None and plan.pad_to and self.graphs.can_verify(plan.num_rows)
                    and all(n <= plan.pad_to for n in plan.seq_lens)
                    and (plan.rollback == "replay" or all(len(s) == plan.pad_to for s in plan.state_slots)))

    def _verify_in_graph(self, plan: StepPlan, return_hidden: bool, device_logits: bool) -> StepResult:
        """The padded verify: run_verify's [N, W, ...] outputs without their padding rows."""
        W = plan.pad_to
        logits, hidden = self.graphs.run_verify(plan.padded_rows(), plan.context_lens, plan.state_slots,
                                                plan.accepted, plan.block_tables, plan.rollback, return_hidden=True)
        # the real rows, flat: row n's first seq_lens[n] positions of the [N, W] grid
        keep = [n * W + i for n, length in enumerate(plan.seq_lens) for i in range(length)]
        if device_logits:  # a gather on the device: the graph's buffer is overwritten by the next replay
            index = to_device_long(keep, logits.device)
            logits = logits.flatten(0, 1)[index]
        else:
            logits = logits.cpu().flatten(0, 1)[keep]  # one copy (the caller accepts on the host)
            index = to_device_long(keep, hidden.device) if return_hidden else None
        # the hidden rows: a copy on the device (the graph's buffer is overwritten by the next replay)
        return StepResult(logits, hidden.flatten(0, 1)[index] if return_hidden else None, in_graph=True)

    def commit_replay(self, accepted: list[int], in_graph: bool) -> None:
        """After a "replay" verify: advance each sequence's state by its accepted tokens.
        in_graph: the verify's StepResult.in_graph (it ran in a graph: the commit graph captured
        with it replays)."""
        if in_graph:
            self.graphs.commit_replay(accepted)
        else:
            self.model.commit_replay(self.cache, accepted)

    def copy_slot(self, src: int, dst: int) -> None:
        self.cache.copy_slot(src, dst)

    def copy_page_rows(self, src: int, dst: int, rows: int) -> None:
        self.cache.copy_page_rows(src, dst, rows)

    def attach_tiers(self, sizes: TierSizes) -> None:
        """Allocate the prefix cache's int8 / host tiers beside the pools (hyla.engine.cache_tiers)."""
        self.tiers = CacheTiers(self.cache, sizes)

    def execute_seconds(self) -> float:
        """The device time `execute` took so far (steps still in flight count later)."""
        return self.execute_time.seconds

    def tier_stats(self) -> dict:
        """Bytes moved to / from the host tier and the time its restores took (CacheTiers.stats;
        zeros without one)."""
        if self.tiers is None:
            return {"bytes_to_host": 0, "bytes_from_host": 0, "restore_seconds": 0.0}
        return self.tiers.stats  # a fresh dict each read

    @torch.inference_mode()
    def apply_transfers(self, transfers: list[tuple]) -> None:
        """The copies a ScheduledBatch (or the prefix cache after a step) planned, in order, before
        anything else touches those slots / pages: restores, and moves between the cache's tiers."""
        if self.tiers is not None:
            self.tiers.apply(transfers)
        elif transfers:
            plain_transfers(self.cache, transfers)
