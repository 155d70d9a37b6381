"""SGLang's MambaRadixCache with the extra_buffer scheduler strategy (ping-pong track slots).

- Tree: token radix tree (page size 1); a state lives at a node end.
- lookup: match prompt[:-1]; the hit is the deepest fully matched node with a state. When the
  KV match is longer, the branching point is the KV match rounded down to the chunk size
  (`mamba_cache_chunk_size` = 64): `mamba_branching_seqlen`.
- prefill, chunk by chunk (`chunked_prefill_size`): each pass tracks ONE state, at the branching
  point if it falls in the pass, else at the last 64-aligned position of the pass (of the final
  pass: the last one before the final token, so that an identical retry can hit it); after the
  pass the request is cached up to that position (`cache_unfinished_req`).
- decode: the state is tracked again whenever the committed length is a multiple of
  `mamba_track_interval` (256); the ping-pong buffer keeps only the latest.
- finish (`cache_finished_req`): the request is cached up to its last tracked position; the KV
  after it is freed.
- evict: least recently used of (a leaf with its KV and state) and (the state of an inner node,
  which stays as a tombstone); a leaf left without a state after its child went is dropped too.
"""

from __future__ import annotations

from hyla.bench.cache_sim.radix import TreePolicy


class SglangPolicy(TreePolicy):
    name = "sglang"

    def __init__(self, capacity, costs, chunk: int = 64, track_interval: int = 256, chunked_prefill: int = 8192):
        super().__init__(capacity, costs)
        self.chunk, self.track_interval, self.chunked_prefill = chunk, track_interval, chunked_prefill

    def lookup(self, prompt) -> int:
        kv, nodes = self.tree.match(prompt[:len(prompt) - 1])
        with_state = [n for n in nodes if n.state]
        hit = with_state[-1].end if with_state else 0
        if nodes:
            self.tree.touch(nodes[-1])
        branch = kv // self.chunk * self.chunk
        self._branch = branch if kv > hit and branch > hit else None
        return hit

    def admit(self, prompt, output, hit) -> None:
        n, last_track = len(prompt), None
        start = hit
        while start < n:
            end = min(start + self.chunked_prefill, n)
            if self._branch is not None and start < self._branch <= end:
                track = self._branch
            elif end == n:
                track = (end - 1) // self.chunk * self.chunk
            else:
                track = end // self.chunk * self.chunk
            if track > start:
                last_track = track
                self._cache(prompt, track)
            start = end
        total = n + len(output) - 1
        first = -(-n // self.track_interval) * self.track_interval
        if first <= total:
            last_track = total // self.track_interval * self.track_interval
        if last_track:
            self._cache(prompt + output, last_track)

    def evict_one(self) -> bool:
        tree = self.tree
        candidates = [x for x in tree.nodes if not x.children or x.state]
        if not candidates:
            return False
        node = min(candidates, key=lambda x: x.last)
        self.stats["states_evicted"] += node.state
        if node.children:
            tree.drop_state(node)
        else:
            parent = node.parent
            tree.remove_leaf(node)
            while parent is not tree.root and not parent.children and not parent.state:
                grand = parent.parent
                tree.remove_leaf(parent)
                parent = grand
        self._sync_bytes()
        return True
