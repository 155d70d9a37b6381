"""Pools of KV pages and state slots, sized from one memory budget. No policy lives here.

- KV pages (attention / MLA layers): `page_size` tokens each. Pages are ref-counted so that the
  prefix cache can share a page between requests copy-free; a page returns to the free list when
  its count drops to 0.
- State slots (linear layers): one slot = every linear layer's recurrent state + conv windows.
  A running request holds one (1 + k with speculative "slots" rollback); prefix-cache
  checkpoints hold others. The Scheduler decides who gets what; these classes only count.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from hyla.engine.block_table import BlockTable

log = logging.getLogger("hyla.engine")


class PagePool:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.refs = [0] * num_pages
        self._free = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Hand out n fresh pages with ref-count 1; the caller must check `num_free` first."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} pages with only {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Add a reference to pages already in use (a prefix-cache hit)."""
        for p in pages:
            assert self.refs[p] > 0, f"page {p} is not in use"
            self.refs[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refs[p] > 0, f"page {p} released twice"
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)


class SlotPool:
    """A free list of indices 0..n-1 (state slots; also the prefix cache's int8 and host entries)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = deque(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot")
        return self._free.popleft()

    def release(self, slot: int) -> None:
        self._free.append(slot)


class Pools:
    """The engine's page pool and slot pool, with the per-sequence bookkeeping (grow / trim /
    free a block table). Mechanism only: the Scheduler decides who gets what and when (this was
    engine/memory.py's MemoryManager; hyla/models/memory.py is the model's memory report)."""

    def __init__(self, num_pages: int, num_slots: int, page_size: int):
        self.page_size = page_size
        self.pages = PagePool(num_pages)
        self.slots = SlotPool(num_slots)

    def pages_needed(self, seq, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.page_size) - len(seq.block_table))

    def can_allocate(self, seq, num_new_tokens: int) -> bool:
        return self.pages_needed(seq, num_new_tokens) <= self.pages.num_free

    def allocate(self, seq, num_new_tokens: int) -> None:
        """Grow seq's block table to cover its computed tokens + num_new_tokens (query first).
        The new pages' single reference belongs to seq until `trim` / `free` gives it back."""
        seq.block_table.extend(self.pages.allocate(self.pages_needed(seq, num_new_tokens)))

    def trim(self, seq) -> None:
        """Release pages past the next position to write (speculative positions that were rejected)."""
        keep = -(-(seq.num_computed_tokens + 1) // self.page_size)
        self.pages.release(seq.block_table[keep:])
        del seq.block_table[keep:]

    def free(self, seq) -> None:
        """Give back everything a sequence holds (finish, abort or preemption)."""
        self.pages.release(seq.block_table)
        seq.block_table = BlockTable()
        for slot in seq.spec_slots or ([seq.slot] if seq.slot is not None else []):
            self.slots.release(slot)
        seq.slot, seq.spec_slots = None, []


# With a prefix cache, the state slots (the running requests' and the checkpoints') may take this
# share of the pool budget: half, as the slots' cap without one (SGLang's default split of its
# hybrid pools, --mamba-full-memory-ratio 0.9, is about the same).
CHECKPOINT_SHARE = 0.5


def size_pools(model, *, budget: int | None, max_num_seqs: int, max_model_len: int, page_size: int,
               state_dtype: torch.dtype, device: torch.device, extra_slots: int = 0,
               slots_per_seq: int = 1, extra_kv_bytes_per_token: int = 0,
               reserved_bytes: int = 0, checkpoint_share: float = 0.0) -> tuple[int, int]:
    """Split one byte budget into (num_slots, num_pages).

    A page holds page_size tokens of every attention layer's KV plus extra_kv_bytes_per_token
    per token (a drafter's layer kept in the same pages: the MTP head's attention).

    Slots first, slots_per_seq for each of up to max_num_seqs running requests (1 + k with
    speculative "slots" rollback) + extra_slots for checkpoints, but never
    more than half the budget; pages take the rest and must hold at least one request of
    max_model_len tokens. budget None: what the configuration needs at most (every request at full
    length), capped on CUDA at 90% of the free memory less reserved_bytes (weights loaded after the
    pools: an MTP head), on the CPU at 256 MiB; when it fits, every wanted slot is granted. (The
    engine passes its budget from hyla.engine.memory_profile on CUDA.)

    checkpoint_share (a prefix cache, whose checkpoints are state slots): from a budget beyond what
    the configuration needs at most (the wanted slots, every request's pages at max_model_len),
    the slots grow to this share of the budget. A hybrid model's cached prefix is usable only up
    to a checkpoint, so pages alone cache little: with a fixed reserve of max_num_seqs
    checkpoints, an agent trace of 16 sessions on a 256 MiB budget hit 49% of its prompt tokens
    (71% reusable) and left the pages 95% empty.
    """
    slot_bytes = max(1, model.state_bytes_per_slot(state_dtype))
    has_pages = model.kv_bytes_per_token() + extra_kv_bytes_per_token > 0  # without, pages cost nothing
    page_bytes = max(1, (model.kv_bytes_per_token() + extra_kv_bytes_per_token) * page_size)
    pages_per_seq = -(-max_model_len // page_size)
    wanted_slots = max_num_seqs * slots_per_seq + extra_slots
    slot_cap = None
    if budget is None:
        want = wanted_slots * slot_bytes + max_num_seqs * pages_per_seq * page_bytes
        if device.type == "cuda":  # what the configuration needs at most, within 90% of the free memory
            free, _ = torch.cuda.mem_get_info(device)
            cap = max(0, int(free * 0.9) - reserved_bytes)
        else:
            cap = 256 << 20
        if want <= cap:
            slot_cap = wanted_slots  # everything fits: no need to ration slots
        budget = min(want, cap)
    if slot_cap is None:
        slot_cap = max(slots_per_seq, (budget // 2) // slot_bytes)
    num_slots = min(wanted_slots, slot_cap)
    if checkpoint_share > 0:
        need = max_num_seqs * pages_per_seq * page_bytes if has_pages else 0  # every request at full length
        spare = (budget - num_slots * slot_bytes - need) // slot_bytes
        num_slots += max(0, min(int(budget * checkpoint_share) // slot_bytes - num_slots, spare))
    num_pages = (budget - num_slots * slot_bytes) // page_bytes
    if not has_pages:  # no attention layer: pages cost nothing,
        num_pages = max_num_seqs * pages_per_seq  # only the block tables need their ids
    if num_pages < pages_per_seq:
        raise ValueError(
            f"memory_budget of {budget} bytes cannot hold one request of max_model_len={max_model_len} tokens "
            f"({pages_per_seq} pages of {page_bytes} bytes) plus a state slot of {slot_bytes} bytes")
    return num_slots, int(num_pages)
