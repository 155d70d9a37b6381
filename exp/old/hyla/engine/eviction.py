"""What the prefix cache evicts first, shared by the engine (prefix_cache.py) and the simulator
(hyla/bench/cache_sim/hyla_policy.py), and the lazy heap both keep their candidates in.

Pages: the least recently used leaf goes first (key = its last-access stamp).

Checkpoints (one state slot each): GreedyDual-Size, the heap-friendly way to weigh recency
against value. A checkpoint's key is fixed when it is filed or its node is touched:

    key = inflation + position

`position` (the tokens the checkpoint saves recomputing: Marconi's FLOP-aware idea, every slot
costs the same) is the value, and `inflation` is the key of the last checkpoint evicted, so
a checkpoint nobody touches sinks below the newly touched ones as evictions go on: recency
still counts. The lowest key goes. A key never changes while it sits in the heap, so eviction
is one heap pop (O(log n)); the score used before (recency rank + position, each rescaled over
all candidates at every eviction) needed a walk over every checkpoint per slot freed. Keys are
scale-free (multiplying every position by c multiplies every key by c), so there is no weight
to tune.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable


def checkpoint_key(inflation: float, position: int) -> float:
    """The eviction key of a checkpoint at `position` filed or touched now (lowest goes first)."""
    return inflation + position


class LazyHeap:
    """A min-heap with lazy deletion: push (key, item) whenever an item gets a new key or becomes
    evictable; entries that no longer hold (`valid(key, item)` is False: the item was touched
    since, or freed) are dropped when they reach the top. When stale entries outnumber the live
    ones the heap is rebuilt from the valid entries (amortised O(1) per push), so it stays
    proportional to what it holds even when nothing is ever evicted."""

    def __init__(self, valid: Callable[[float, object], bool]):
        self.valid = valid
        self._heap: list = []
        self._tie = itertools.count()
        self._compact_at = 1024

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, key: float, item) -> None:
        heapq.heappush(self._heap, (key, next(self._tie), item))
        if len(self._heap) > self._compact_at:
            self._heap = [e for e in self._heap if self.valid(e[0], e[2])]
            heapq.heapify(self._heap)
            self._compact_at = max(1024, 2 * len(self._heap))

    def peek(self):
        """The lowest valid (key, item), left in the heap; None when there is none."""
        while self._heap:
            key, _, item = self._heap[0]
            if self.valid(key, item):
                return key, item
            heapq.heappop(self._heap)
        return None

    def pop(self):
        """Remove and return the lowest valid (key, item); None when there is none."""
        top = self.peek()
        if top is not None:
            heapq.heappop(self._heap)
        return top


def unlink_leaf(node, root):
    """Take the leaf `node` out of its parent's children (first token -> list of nodes: pages
    sharing a first token are siblings in one list) and mark it dead. Returns the parent when it
    has become a leaf itself (the caller files it as evictable), else None. The engine's tree
    and the simulator's share this shape."""
    node.alive = False
    parent = node.parent
    bucket = parent.children[node.tokens[0]]
    bucket.remove(node)
    if not bucket:
        del parent.children[node.tokens[0]]
    return parent if parent is not root and not parent.children else None
