"""A hand-made page / slot allocator that drives `model.forward_batch` (a stand-in for the engine).

    pool = ToyPool(model, num_slots=8, num_pages=64, page_size=4)
    a, b = pool.add(), pool.add()
    logits = pool.step(model, [(a, prompt_a[:10]), (b, prompt_b)])   # [T_total, V]
    pool.step(model, [(a, [tok]), (b, [tok])])                      # batched decode

Each request owns one state slot and the pages covering its tokens; `step` extends the block
tables as needed, builds the ForwardBatch and advances the context lengths.
"""

from __future__ import annotations

import torch

from hyla.contract import ForwardBatch


class ToyPool:
    def __init__(self, model, num_slots: int = 8, num_pages: int = 64, page_size: int = 4):
        self.cache = model.allocate_cache(num_slots, num_pages, page_size)
        self.device = model.device
        self.page_size = page_size
        self.free_pages = list(range(num_pages))[::-1]
        self.free_slots = list(range(num_slots))[::-1]
        self.tables: dict[int, list[int]] = {}
        self.slots: dict[int, int] = {}
        self.lens: dict[int, int] = {}
        self._next = 0

    def add(self) -> int:
        """A new request id, with its state slot."""
        rid = self._next
        self._next += 1
        self.slots[rid] = self.free_slots.pop()
        self.tables[rid] = []
        self.lens[rid] = 0
        return rid

    def take_slot(self) -> int:
        """A spare slot (e.g. a checkpoint destination)."""
        return self.free_slots.pop()

    def batch(self, chunks: list[tuple[int, list[int]]], checkpoints=None) -> ForwardBatch:
        for rid, toks in chunks:
            need = -(-(self.lens[rid] + len(toks)) // self.page_size)
            while len(self.tables[rid]) < need:
                self.tables[rid].append(self.free_pages.pop())
        return ForwardBatch.build(
            [len(t) for _, t in chunks], [self.lens[r] for r, _ in chunks], [self.tables[r] for r, _ in chunks],
            [self.slots[r] for r, _ in chunks], checkpoints=checkpoints, device=self.device,
        )

    def step(self, model, chunks: list[tuple[int, list[int]]], checkpoints=None) -> torch.Tensor:
        """Run one forward_batch over `chunks` ((request id, new token ids) pairs) -> logits
        [T_total, V] fp32 for every new token, in the packed order."""
        batch = self.batch(chunks, checkpoints)
        ids = torch.tensor([t for _, toks in chunks for t in toks], dtype=torch.long, device=self.device)
        with torch.no_grad():
            hidden = model.forward_batch(ids, batch, self.cache)
            logits = model.compute_logits(hidden)
        for rid, toks in chunks:
            self.lens[rid] += len(toks)
        return logits


def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int, prefill_chunk: int | None = None,
                    page_size: int = 4) -> list[list[int]]:
    """Greedy continuation of every prompt, all sequences batched in each step: chunked
    prefill (`prefill_chunk` tokens per sequence per step, None = whole prompts), then
    token-by-token decode. Returns the generated ids per prompt."""
    total = sum(len(p) + max_new_tokens for p in prompts)
    pool = ToyPool(model, num_slots=len(prompts) + 1, num_pages=total // page_size + 2 * len(prompts) + 1,
                   page_size=page_size)
    rids = [pool.add() for _ in prompts]
    done = [0] * len(prompts)
    last = [None] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        chunks, owners = [], []
        for i, (rid, p) in enumerate(zip(rids, prompts)):
            if done[i] < len(p):
                n = len(p) - done[i] if prefill_chunk is None else min(prefill_chunk, len(p) - done[i])
                chunks.append((rid, p[done[i]:done[i] + n]))
                owners.append(i)
                done[i] += n
        logits = pool.step(model, chunks)
        ends = torch.tensor([len(t) for _, t in chunks]).cumsum(0) - 1
        for i, row in zip(owners, ends.tolist()):
            if done[i] == len(prompts[i]):
                last[i] = int(logits[row].argmax())
    out = [[t] for t in last]
    for _ in range(max_new_tokens - 1):
        logits = pool.step(model, [(rid, [o[-1]]) for rid, o in zip(rids, out)])
        for o, row in zip(out, logits.argmax(-1).tolist()):
            o.append(row)
    return out
