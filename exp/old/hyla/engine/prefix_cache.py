"""Hybrid prefix cache: a radix tree of KV pages plus exact recurrent-state checkpoints.

Tree: every node covers up to one page (page_size tokens) of a token sequence; its children
continue it, indexed by their first token (a bucket per first token: two pages may share their
first tokens and diverge mid-page, and a page cannot be split). A node owns one reference to the
physical KV page holding its tokens' KV, and a map {r: slot} of state checkpoints: slot holds
every linear layer's recurrent state + conv window after the node's first r tokens (r in
1..len(tokens)).

A hit of length L = page_size * a + r needs both: the KV of positions < L (the pages of the
path) and a checkpoint exactly at L, because a recurrent state cannot be cut back to a shorter
prefix. The longest such L wins, capped at num_tokens - 1 (the last token must run for logits).

Contracts:
- match(seq) -> CacheHit | None shares the full pages of the hit (+1 ref each, the request owns
  those refs from then on) and locks the node holding the checkpoint until restore(seq, hit) /
  unmatch(seq, hit): nothing evicts a locked node's page or checkpoints.
- restore(seq, hit) runs after the request has its own slot and pages: it plans the copies (run
  by ModelRunner before the step's forward) of the checkpoint into the request's slot and of the
  first r KV rows of a partially used page into the request's own page (copy-on-write: a request
  never writes into a page someone else reads). The cache itself touches no tensor.
- insert(seq, pos, slot) files the request's pages for positions < pos and the checkpoint slot;
  the tree takes over the slot (the caller must not release it) and adds one page reference.
- Eviction frees only what nobody else uses: a leaf whose page has no reference besides the tree
  (least recently used first), or a checkpoint on any unlocked node (an inner node keeps its KV;
  lowest key first, see hyla.engine.eviction). Both come off lazy heaps: O(log n) per page or
  slot freed (plus re-pushing the few candidates a running request still references).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hyla.engine.eviction import LazyHeap, checkpoint_key, unlink_leaf
from hyla.engine.pools import Pools

_clock = itertools.count()


class Node:
    __slots__ = ("tokens", "page", "parent", "children", "checkpoints", "last_access", "locks", "depth", "alive")

    def __init__(self, tokens: tuple[int, ...], page: int | None, parent: Node | None):
        self.tokens = tokens
        self.page = page
        self.parent = parent
        self.depth = -1 if parent is None else parent.depth + 1  # pages before this one on the path
        self.children: dict[int, list[Node]] = {}  # first token -> the children starting with it
        self.checkpoints: dict[int, int] = {}
        self.last_access = next(_clock)
        self.locks = 0
        self.alive = True


@dataclass
class CacheHit:
    """The handle match() returns: the checkpoint at `node`'s first r tokens serves the first
    `num_tokens` tokens of the request. Its node stays locked until restore() or unmatch()."""

    node: Node
    r: int
    num_tokens: int


def common_prefix_len(a, b) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    def __init__(self, pools: Pools, checkpoint_interval: int | None = None):
        self.pools = pools
        self.page_size = pools.page_size
        self.checkpoint_interval = checkpoint_interval
        self.root = Node((), None, None)
        self.num_pages = 0
        self.num_checkpoints = 0
        self.inflation = 0.0  # the key of the last checkpoint evict_slot dropped (eviction.py)
        self._leaves = LazyHeap(lambda stamp, n: n.alive and not n.children and n.last_access == stamp)
        self._checkpoints = LazyHeap(lambda key, c: c[0].alive and c[1] in c[0].checkpoints
                                     and c[0].last_access == c[2])
        self.stats = {"checkpoints_stored": 0, "checkpoints_evicted": 0, "pages_evicted": 0}

    def _touch(self, node: Node) -> None:
        """A new recency stamp: the node's heap entries are pushed again (the old ones go stale)."""
        node.last_access = next(_clock)
        if not node.children:
            self._leaves.push(node.last_access, node)
        for r in node.checkpoints:
            self._push_checkpoint(node, r)

    def _push_checkpoint(self, node: Node, r: int) -> None:
        key = checkpoint_key(self.inflation, node.depth * self.page_size + r)
        self._checkpoints.push(key, (node, r, node.last_access))

    # ---- lookup --------------------------------------------------------------------------
    def _walk(self, tokens):
        """Yield (depth, matches) per page depth along the best-matching path, where matches is
        [(child, m)] for every child of the current node sharing m >= 1 leading tokens with
        `tokens` at that depth, best first. A checkpoint may sit on any of them: siblings that
        hold different continuations still share their first m tokens' KV."""
        node, depth = self.root, 0
        while True:
            chunk = tokens[depth * self.page_size : (depth + 1) * self.page_size]
            if not chunk:
                return
            bucket = node.children.get(chunk[0], ())
            matches = sorted(((c, common_prefix_len(c.tokens, chunk)) for c in bucket), key=lambda x: -x[1])
            if not matches:
                return
            yield depth, matches
            best, best_m = matches[0]
            if best_m < self.page_size or len(best.tokens) < self.page_size:
                return
            node, depth = best, depth + 1

    def match(self, seq) -> CacheHit | None:
        """Find the longest hit for a waiting request and plan the checkpoints its prefill exports.
        On a hit, seq's block table starts with the shared full pages and num_computed_tokens
        with the hit; the returned handle must reach restore() or unmatch()."""
        tokens = seq.token_ids
        limit = len(tokens) - 1
        path, hit, kv_match = [], None, 0
        for depth, matches in self._walk(tokens):
            path.append(matches[0][0])
            kv_match = depth * self.page_size + matches[0][1]
            for node, m in matches:
                for r in node.checkpoints:
                    pos = depth * self.page_size + r
                    if r <= m and pos <= limit and (hit is None or pos > hit[0]):
                        hit = (pos, node, r, depth)
        for node in path:
            self._touch(node)
        seq.pending_checkpoints = self._plan(seq, kv_match, hit[0] if hit else 0)
        if hit is None:
            return None
        pos, node, r, depth = hit
        full = [n.page for n in path[:depth]] + ([node.page] if r == self.page_size else [])
        self.pools.pages.share(full)
        seq.block_table = full
        seq.num_computed_tokens = pos
        node.locks += 1
        return CacheHit(node, r, pos)

    def _plan(self, seq, kv_match: int, hit: int) -> list[int]:
        """Positions whose state this request's prefill exports: the junction with what the tree
        already holds (the exact end of the shared KV, when it is past the state hit: the next
        request sharing it hits all of it, partial page included), the prompt end, and optional
        periodic checkpoints. "Prompt end" is taken one token early, at prompt_len - 1: an
        identical retry can hit at most that much (its last token must run for logits), and a
        longer prompt that extends this one loses one token of recompute at most."""
        limit = len(seq.token_ids) - 1
        plan = set()
        junction = min(kv_match, limit)
        if junction > hit:
            plan.add(junction)
        prompt_end = len(seq.prompt_token_ids)
        if prompt_end <= limit + 1:
            plan.add(prompt_end - 1)
        if self.checkpoint_interval:
            plan.update(range(self.checkpoint_interval, limit + 1, self.checkpoint_interval))
        return sorted(p for p in plan if p > hit)

    def unmatch(self, seq, hit: CacheHit | None) -> None:
        """Undo match() for a request that could not be admitted after all."""
        if hit is not None:
            hit.node.locks -= 1
        self.pools.pages.release(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def restore(self, seq, hit: CacheHit | None) -> tuple[int, list[tuple[int, int]], list[tuple[int, int, int]]]:
        """Plan the copies of the hit's checkpoint into seq.slot and of the partial page's rows into
        seq's own page -> (tokens served from the cache, [(src slot, dst slot)], [(src page, dst
        page, rows)]), and unlock the hit. The copies must run before anything else writes those
        slots / pages (ModelRunner.apply_copies at the start of the step): the source checkpoint
        may be evicted (and its slot handed out) later in the same schedule."""
        if hit is None:
            return 0, [], []
        node, r = hit.node, hit.r
        node.locks -= 1
        page_copies = []
        if r < self.page_size:
            page_copies.append((node.page, seq.block_table[hit.num_tokens // self.page_size], r))
        return hit.num_tokens, [(node.checkpoints[r], seq.slot)], page_copies

    # ---- admission -----------------------------------------------------------------------
    def insert(self, seq, pos: int, slot: int | None) -> None:
        """File seq's KV for positions < pos (its pages) and, if given, the checkpoint slot at pos."""
        tokens = seq.token_ids
        node = self.root
        n_pages = -(-pos // self.page_size)
        for i in range(n_pages):
            chunk = tuple(tokens[i * self.page_size : min((i + 1) * self.page_size, pos)])
            page = seq.block_table[i]
            bucket = node.children.setdefault(chunk[0], [])
            child = next((c for c in bucket if c.tokens[: len(chunk)] == chunk), None)
            if child is None:
                child = next((c for c in bucket if chunk[: len(c.tokens)] == c.tokens and c.page == page), None)
                if child is not None:
                    child.tokens = chunk  # the same physical page, now holding more tokens
                else:
                    child = Node(chunk, page, node)
                    self.pools.pages.share([page])
                    bucket.append(child)
                    self.num_pages += 1
            self._touch(child)
            node = child
        if slot is None:
            return
        r = pos - (n_pages - 1) * self.page_size
        if r in node.checkpoints:
            self.pools.slots.release(slot)  # an identical state is already filed
        else:
            node.checkpoints[r] = slot
            self.num_checkpoints += 1
            self._push_checkpoint(node, r)
            self.stats["checkpoints_stored"] += 1

    # ---- eviction ------------------------------------------------------------------------
    def evict_slot(self) -> bool:
        """Drop the unlocked checkpoint with the lowest key (hyla.engine.eviction: GreedyDual over
        recency and the position it saves recomputing); False if there is none."""
        locked = []
        while (top := self._checkpoints.pop()) is not None and top[1][0].locks:
            locked.append(top)
        for key, item in locked:
            self._checkpoints.push(key, item)
        if top is None:
            return False
        key, (node, r, _) = top
        self.inflation = key
        self.pools.slots.release(node.checkpoints.pop(r))
        self.num_checkpoints -= 1
        self.stats["checkpoints_evicted"] += 1
        return True

    def evict_pages(self, n: int) -> bool:
        """Free up to n pages by dropping least recently used leaves nobody else references (a
        parent that becomes a leaf joins the heap)."""
        freed, skipped = 0, []
        refs = self.pools.pages.refs
        while freed < n and (top := self._leaves.pop()) is not None:
            leaf = top[1]
            if leaf.locks or refs[leaf.page] != 1:  # a running request reads it: not now
                skipped.append(top)
                continue
            for slot in leaf.checkpoints.values():
                self.pools.slots.release(slot)
                self.stats["checkpoints_evicted"] += 1
            self.num_checkpoints -= len(leaf.checkpoints)
            if (parent := unlink_leaf(leaf, self.root)) is not None:
                self._leaves.push(parent.last_access, parent)
            self.pools.pages.release([leaf.page])
            self.num_pages -= 1
            self.stats["pages_evicted"] += 1
            freed += 1
        for stamp, leaf in skipped:
            self._leaves.push(stamp, leaf)
        return freed > 0

    def usage(self) -> dict:
        return {"cached_pages": self.num_pages, "cached_checkpoints": self.num_checkpoints, **self.stats}
