"""ModelRunner: owns the model, its pools (HybridCache) and every tensor of a step.

One call to `run` turns a ScheduledBatch into one `forward_batch` over all its sequences (varlen
prefill chunks and decodes packed together) and returns fp32 logits for the rows that need them.
On CUDA, pure-decode steps replay a CUDA graph captured per batch-size bucket unless
`enforce_eager`; the CPU path is always eager.
"""

from __future__ import annotations

import torch

from hyla.contract import ForwardBatch
from hyla.ops.transfer import to_device_long
from hyla.engine.cache_tiers import CacheTiers, TierSizes, plain_transfers
from hyla.engine.cuda_graph import SCRATCH, use_cuda_graphs
from hyla.engine.cuda_graph_verify import CUDAGraphRunner


class ModelRunner:
    def __init__(self, model, num_slots: int, num_pages: int, page_size: int, state_dtype: torch.dtype,
                 enforce_eager: bool = False, kv_cache_dtype: str | None = None):
        """kv_cache_dtype: how the attention pages are stored ("auto", "fp8": hyla.ops.kv_fp8);
        None = the model's own (model.kv_cache_dtype)."""
        self.model = model
        self.device = model.device
        self.page_size = page_size
        graphs = use_cuda_graphs(model, enforce_eager)  # padding rows write one scratch slot / page
        extra = SCRATCH if graphs else 0
        kv = {} if kv_cache_dtype is None else {"kv_cache_dtype": kv_cache_dtype}
        self.cache = model.allocate_cache(num_slots + extra, num_pages + extra, page_size=page_size,
                                          state_dtype=state_dtype, **kv)
        self.graphs = CUDAGraphRunner(model, self.cache, max_batch=num_slots) if graphs else None
        self.verified_in_graph = False  # the last verify step ran padded in a graph (commit_replay)

    def build_batch(self, seqs, num_new_tokens, checkpoints=None) -> tuple[torch.Tensor, ForwardBatch]:
        """Pack the new tokens of every scheduled sequence: ids [T_total] and the ForwardBatch."""
        ids: list[int] = []
        for seq, n in zip(seqs, num_new_tokens):
            ids.extend(seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n])
        batch = ForwardBatch.build(
            seq_lens=list(num_new_tokens),
            context_lens=[seq.num_computed_tokens for seq in seqs],
            block_tables=[seq.block_table for seq in seqs],
            state_slots=[seq.slot for seq in seqs],
            checkpoints=checkpoints,
            device=self.device,
        )
        return to_device_long(ids, self.device), batch

    @torch.inference_mode()
    def run(self, seqs, num_new_tokens, logit_rows: list[list[int]], checkpoints=None, return_hidden: bool = False
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run one step. logit_rows[n]: offsets within sequence n's new tokens whose logits are
        wanted (usually [n_new - 1] when it finishes its prompt or decodes, [] mid-prompt).
        Returns logits [sum(len(rows)), V] fp32 in that order; with return_hidden also the
        final-norm hidden states of every new token [T_total, hidden] (packed as the tokens; an
        MTP drafter reads the prompt's), and the step then runs eagerly."""
        if (not return_hidden and self.graphs is not None
                and self.graphs.can_run(seqs, num_new_tokens, logit_rows, checkpoints)):
            return self.graphs.run(seqs, logit_rows)
        ids, batch = self.build_batch(seqs, num_new_tokens, checkpoints)
        hidden = self.model.forward_batch(ids, batch, self.cache)
        starts = batch.cu_seqlens_list[:-1]  # host values: no sync before the logits
        index = [start + r for start, rows in zip(starts, logit_rows) for r in rows]
        if not index:
            logits = hidden.new_zeros(0, self.model.config.vocab_size, dtype=torch.float32)
        else:
            logits = self.model.compute_logits(hidden[to_device_long(index, hidden.device)])
        return (logits, hidden) if return_hidden else logits

    @torch.inference_mode()
    def verify(self, seqs, drafts: list[list[int]], rollback: str, pad_to: int | None = None,
               return_hidden: bool = False, device_logits: bool = False
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One verify forward over [x0, d1..dk] per sequence -> logits at every position
        [sum(1 + k_n), V] fp32, and with return_hidden also the final-norm hidden states of the
        same rows [sum(1 + k_n), hidden] (on the device; what an MTP drafter reads). "slots":
        seq.spec_slots are the per-position slots and seq.slot (one of them) holds the current
        state; "replay": seq.slot only. pad_to: W = 1 + k when every row may be padded to W
        tokens (each request has W state slots with "slots"): the step then replays a CUDA graph
        when the runner has them. device_logits: the caller accepts on the device (every request
        argmax-accepting: one argmax, a copy of ids), so a graph's logits stay there too; else they
        come to the host in one copy (a sampling acceptance reads them row by row)."""
        rows, accepted = self._verify_slots(seqs, rollback)
        self.verified_in_graph = False
        if self._graph_verifies(seqs, drafts, rows, rollback, pad_to):
            return self._verify_in_graph(seqs, drafts, rows, accepted, rollback, pad_to, return_hidden,
                                         device_logits)
        ids = [t for seq, d in zip(seqs, drafts) for t in [seq.last_token_id, *d]]
        batch = ForwardBatch.build(
            seq_lens=[1 + len(d) for d in drafts], context_lens=[seq.num_computed_tokens for seq in seqs],
            block_tables=[seq.block_table for seq in seqs], state_slots=rows, device=self.device,
            num_accepted_tokens=accepted, rollback=rollback)
        hidden = self.model.forward_batch(to_device_long(ids, self.device), batch, self.cache)
        logits = self.model.compute_logits(hidden)
        return (logits, hidden) if return_hidden else logits

    @staticmethod
    def _verify_slots(seqs, rollback: str) -> tuple[list[list[int]], list[int]]:
        """Per sequence (its state slots, 1 + the index of the one holding the current state)."""
        if rollback == "slots":
            return [seq.spec_slots for seq in seqs], [seq.spec_slots.index(seq.slot) + 1 for seq in seqs]
        return [[seq.slot] for seq in seqs], [1] * len(seqs)

    def _graph_verifies(self, seqs, drafts, rows, rollback: str, pad_to: int | None) -> bool:
        """Whether the verify of seqs runs padded to pad_to tokens per row in a graph."""
        return bool(self.graphs is not None and pad_to and self.graphs.can_verify(len(seqs))
                    and all(len(d) < pad_to for d in drafts)
                    and (rollback == "replay" or all(len(r) == pad_to for r in rows)))

    @torch.inference_mode()
    def verify_extended(self, seqs, drafts: list[list[int]], rollback: str, pad_to: int, extension) -> tuple | None:
        """verify in a graph with `extension` (CUDAGraphRunner.replay_verify) folded into the same
        graph -> the graph's outputs for the batch bucket ([bs, W, V] logits, [bs, W, hidden] hidden
        states, then the extension's: views of its buffers, valid until the next replay); None
        (nothing ran) when the step cannot run padded in a graph."""
        rows, accepted = self._verify_slots(seqs, rollback)
        self.verified_in_graph = False
        if not self._graph_verifies(seqs, drafts, rows, rollback, pad_to):
            return None
        tokens = [[seq.last_token_id, *d] + [0] * (pad_to - 1 - len(d)) for seq, d in zip(seqs, drafts)]
        key, vrows = self.graphs.verify_rows(tokens, [seq.num_computed_tokens for seq in seqs], rows, accepted,
                                             [seq.block_table for seq in seqs], rollback)
        out = self.graphs.replay_verify(key, vrows, extension)
        self.verified_in_graph = True  # commit_replay: the commit graph captured with it
        return out

    def _verify_in_graph(self, seqs, drafts, rows, accepted, rollback, pad_to, return_hidden, device_logits=False):
        """verify's padded path: run_verify's [N, W, ...] outputs without their padding rows."""
        tokens = [[seq.last_token_id, *d] + [0] * (pad_to - 1 - len(d)) for seq, d in zip(seqs, drafts)]
        logits, hidden = self.graphs.run_verify(tokens, [seq.num_computed_tokens for seq in seqs], rows, accepted,
                                                [seq.block_table for seq in seqs], rollback, return_hidden=True)
        self.verified_in_graph = True
        # the real rows, flat: row n's first 1 + len(d) positions of the [N, W] grid
        keep = [n * pad_to + i for n, d in enumerate(drafts) for i in range(1 + len(d))]
        if device_logits:  # a gather on the device: the graph's buffer is overwritten by the next replay
            index = to_device_long(keep, logits.device)
            logits = logits.flatten(0, 1)[index]
        else:
            logits = logits.cpu().flatten(0, 1)[keep]  # one copy (the caller accepts on the host)
            index = to_device_long(keep, hidden.device) if return_hidden else None
        if not return_hidden:
            return logits
        # a copy on the device: the graph's buffer is overwritten by the next replay
        return logits, hidden.flatten(0, 1)[index]

    def commit_replay(self, accepted: list[int]) -> None:
        """After a "replay" verify: advance each sequence's state by its accepted tokens."""
        if self.verified_in_graph:
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

    def tier_stats(self) -> dict:
        """Bytes moved to / from the host tier and the time its restores took (zeros without one)."""
        tiers = getattr(self, "tiers", None)
        return dict(tiers.stats) if tiers is not None else {"bytes_to_host": 0, "bytes_from_host": 0,
                                                             "restore_seconds": 0.0}

    @torch.inference_mode()
    def apply_transfers(self, plan: list[tuple]) -> None:
        """The copies a ScheduledBatch (or the prefix cache after a step) planned, in order, before
        anything else touches those slots / pages: restores, and moves between the cache's tiers."""
        if not plan:
            return
        tiers = getattr(self, "tiers", None)
        if tiers is not None:
            tiers.apply(plan)
        else:
            plain_transfers(self.cache, plan)
