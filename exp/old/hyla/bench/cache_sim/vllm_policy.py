"""vLLM's hybrid prefix caching, mamba_cache_mode="align" (the default with prefix caching on).

- Blocks: attention KV is cached in blocks of `block_size` tokens (the page-unification size,
  1,920 for the reference model), found by the hash of the whole prefix they end; a state block
  holds the state at a block boundary. Everything sits in one LRU free queue (a finished
  request's blocks are freed tail first, so a prefix's deeper blocks go before its shallower).
- States only at block-aligned step ends: the scheduler cuts the prefill at the last block
  boundary of the prompt (`last_cache_position`; or the kernel exports it in-pass, same
  result), at block-aligned chunk ends when the prompt exceeds the step budget, and at the
  junction; decode registers a state at every block boundary it crosses.
- Junction (Marconi-style APC, on by default): when the attention hit is longer than the state
  hit, the prefill also stops at the attention hit rounded down to a block (`shared_prefix_
  boundary`) and stores the state there, for the requests after it.
- lookup: the longest prefix of cached full blocks within len(prompt) - 1, then the rightmost
  state inside it.
- `match_unit` (--prefix-match-unit, e.g. 64): hashes every 64 tokens; the prompt's tail up to its
  last 64-aligned position is cached as a partial block (KV + state at that position, a whole
  block of memory), so a retry or the next turn can hit there. The junction still rounds to a
  block (fine_junction = --enable-mamba-shared-prefix-checkpoint keeps it exact).
- Simplification (in vLLM's favour): a block whose hash is already cached is not stored twice.
"""

from __future__ import annotations

import itertools

from hyla.bench.cache_sim.base import Policy
from hyla.engine.eviction import LazyHeap


class _Block:
    __slots__ = ("nbytes", "last")

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.last = 0


class VllmAlignPolicy(Policy):
    name = "vllm-align"

    def __init__(self, capacity, costs, block_size: int | None = None, match_unit: int | None = None,
                 step_budget: int = 8192, junction: bool = True, fine_junction: bool = False):
        super().__init__(capacity, costs)
        self.B = block_size or costs.vllm_block_size
        self.unit = match_unit or self.B
        if self.B % self.unit:
            raise ValueError(f"match unit {self.unit} must divide the block size {self.B}")
        self.step_budget, self.junction, self.fine_junction = max(step_budget, self.B), junction, fine_junction
        if match_unit and match_unit < self.B:
            self.name = f"vllm-align+pmu{match_unit}"
        self.blocks: dict[tuple, _Block] = {}
        self._lru = LazyHeap(lambda s, key: key in self.blocks and self.blocks[key].last == s)
        self._clock = itertools.count(1)
        self._plan_junction = None

    # ---- keys ----------------------------------------------------------------------------------
    def _chain(self, tokens) -> list[int]:
        """hash of tokens[:(k + 1) * B] for every full block k."""
        out, h = [], 0
        for k in range(len(tokens) // self.B):
            h = hash((h, tuple(tokens[k * self.B:(k + 1) * self.B])))
            out.append(h)
        return out

    def _key(self, kind: str, tokens, chain: list[int], pos: int) -> tuple:
        k = pos // self.B
        if pos % self.B == 0:
            return kind, chain[k - 1]
        return "partial", hash((chain[k - 1] if k else 0, tuple(tokens[k * self.B:pos])))

    # ---- lookup --------------------------------------------------------------------------------
    def lookup(self, prompt) -> int:
        B, limit = self.B, len(prompt) - 1
        chain = self._chain(prompt[:limit])
        full = 0
        while full < len(chain) and ("kv", chain[full]) in self.blocks:
            full += 1
        attn_hit, hit, hit_key = full * B, 0, None
        for k in range(full + 1):
            if k and ("state", chain[k - 1]) in self.blocks:
                hit, hit_key = k * B, ("state", chain[k - 1])
            if self.unit < B:
                for p in range(k * B + self.unit, min((k + 1) * B, limit + 1), self.unit):
                    key = self._key("partial", prompt, chain, p)
                    if key in self.blocks:
                        attn_hit = max(attn_hit, p)
                        hit, hit_key = p, key
        touched = [("kv", h) for h in chain[:hit // B]] + ([hit_key] if hit_key else [])
        self._stamp(reversed(touched))
        self._plan_junction = None
        if self.junction and attn_hit > hit:
            j = attn_hit if self.fine_junction else attn_hit // B * B
            if j > hit:
                self._plan_junction = j
        return hit

    # ---- admission -----------------------------------------------------------------------------
    def admit(self, prompt, output, hit) -> None:
        B, n = self.B, len(prompt)
        tokens = prompt + output
        total = n + len(output) - 1  # tokens fed: the prompt, then every output but the last
        chain = self._chain(tokens[:total])
        states = {n // B * B}  # last_cache_position
        pos = hit
        while n - pos > self.step_budget:  # budget-limited steps end on block boundaries
            pos = (pos + self.step_budget) // B * B
            states.add(pos)
        if self._plan_junction:
            states.add(self._plan_junction)
        if self.unit < B:
            states.add(n // self.unit * self.unit)  # the prompt's tail, cached as a partial block
        positions = sorted(p for p in states if hit < p <= n) + list(range(n // B * B + B, total + 1, B))
        # The request frees each state block once it has moved past it; at the end it frees the
        # one it still holds, then its KV blocks tail first (vLLM frees a request's blocks in
        # reverse, so a prefix's deeper blocks leave the free queue before its shallower ones).
        for p in positions + positions[-1:]:
            self._store(self._key("state", tokens, chain, p))
        for k in reversed(range(len(chain))):
            self._store(("kv", chain[k]))

    def _store(self, key: tuple) -> None:
        block = self.blocks.get(key)
        if block is None:
            kind = key[0]
            nbytes = (self.B * self.costs.kv_bytes_per_token if kind in ("kv", "partial") else 0) \
                + (self.costs.state_bytes if kind in ("state", "partial") else 0)
            block = self.blocks[key] = _Block(nbytes)
            self.used += nbytes
            if kind != "kv":
                self.stats["states_admitted"] += 1
        self._stamp([key])

    def _stamp(self, keys) -> None:
        for key in keys:
            block = self.blocks[key]
            block.last = next(self._clock)
            self._lru.push(block.last, key)

    # ---- eviction ------------------------------------------------------------------------------
    def evict_one(self) -> bool:
        top = self._lru.pop()
        if top is None:
            return False
        key = top[1]
        block = self.blocks.pop(key)
        self.used -= block.nbytes
        if key[0] != "kv":
            self.stats["states_evicted"] += 1
        return True
