"""ModelRunner: owns the model, its pools (HybridCache) and every tensor of a step.

One call to `run` turns a ScheduledBatch into one `forward_batch` over all its sequences (varlen
prefill chunks and decodes packed together) and returns fp32 logits for the rows that need them.
On CUDA, pure-decode steps replay a CUDA graph captured per batch-size bucket unless
`enforce_eager`; the CPU path is always eager.
"""

from __future__ import annotations

import torch

from hyla.models.batch import ForwardBatch


class ModelRunner:
    def __init__(self, model, num_slots: int, num_pages: int, page_size: int, state_dtype: torch.dtype):
        self.model = model
        self.device = model.device
        self.page_size = page_size
        self.cache = model.allocate_cache(num_slots, num_pages, page_size=page_size, state_dtype=state_dtype)

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
        return torch.tensor(ids, dtype=torch.long, device=self.device), batch

    @torch.inference_mode()
    def run(self, seqs, num_new_tokens, logit_rows: list[list[int]], checkpoints=None) -> torch.Tensor:
        """Run one step. logit_rows[n]: offsets within sequence n's new tokens whose logits are
        wanted (usually [n_new - 1] when it finishes its prompt or decodes, [] mid-prompt).
        Returns logits [sum(len(rows)), V] fp32 in that order."""
        ids, batch = self.build_batch(seqs, num_new_tokens, checkpoints)
        hidden = self.model.forward_batch(ids, batch, self.cache)
        starts = batch.cu_seqlens[:-1].tolist()
        index = [start + r for start, rows in zip(starts, logit_rows) for r in rows]
        if not index:
            return hidden.new_zeros(0, self.model.config.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden[torch.tensor(index, device=hidden.device)])

    def copy_slot(self, src: int, dst: int) -> None:
        self.cache.copy_slot(src, dst)

    def copy_page_rows(self, src: int, dst: int, rows: int) -> None:
        self.cache.copy_page_rows(src, dst, rows)
