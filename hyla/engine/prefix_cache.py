"""Hybrid prefix cache: a radix tree of KV pages plus exact recurrent-state checkpoints.

Tree: every node covers up to one page (page_size tokens) of a token sequence; its children
continue it. A node owns one reference to the physical KV page holding its tokens' KV, and a
map {r: slot} of state checkpoints: slot holds every linear layer's recurrent state + conv window
after the node's first r tokens (r in 1..len(tokens)).

A hit of length L = page_size * a + r needs both: the KV of positions < L (the pages of the
path) and a checkpoint exactly at L, because a recurrent state cannot be cut back to a shorter
prefix. The longest such L wins, capped at num_tokens - 1 (the last token must run for logits).

Contracts:
- match(seq) shares the full pages of the hit (+1 ref each, the request owns those refs from then
  on) and locks the node holding the checkpoint until restore(seq) / unmatch(seq).
- restore(seq) runs after the request has its own slot and pages: it plans the copies (run by
  ModelRunner before the step's forward) of the checkpoint into the request's slot and of the
  first r KV rows of a partially used page into the request's own page (copy-on-write: a request
  never writes into a page someone else reads). The cache itself touches no tensor.
- insert(seq, pos, slot) files the request's pages for positions < pos and the checkpoint slot;
  the tree takes over the slot (the caller must not release it) and adds one page reference.
- Eviction frees only what nobody else uses: a leaf whose page has no reference besides the tree
  (least recently used first), or a checkpoint on any unlocked node (an inner node keeps its KV;
  scored by recency and by the recompute it saves, see evict_slot).
"""

from __future__ import annotations

import itertools

from hyla.engine.memory import MemoryManager

_clock = itertools.count()


class Node:
    __slots__ = ("tokens", "page", "parent", "children", "checkpoints", "last_access", "locks")

    def __init__(self, tokens: tuple[int, ...], page: int | None, parent: Node | None):
        self.tokens = tokens
        self.page = page
        self.parent = parent
        self.children: list[Node] = []
        self.checkpoints: dict[int, int] = {}
        self.last_access = next(_clock)
        self.locks = 0

    def touch(self) -> None:
        self.last_access = next(_clock)


def common_prefix_len(a, b) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    def __init__(self, memory: MemoryManager, checkpoint_interval: int | None = None):
        self.memory = memory
        self.page_size = memory.page_size
        self.checkpoint_interval = checkpoint_interval
        self.root = Node((), None, None)
        self.stats = {"checkpoints_stored": 0, "checkpoints_evicted": 0, "pages_evicted": 0}

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
            matches = [(c, common_prefix_len(c.tokens, chunk)) for c in node.children]
            matches = sorted((x for x in matches if x[1] > 0), key=lambda x: -x[1])
            if not matches:
                return
            yield depth, matches
            best, best_m = matches[0]
            if best_m < self.page_size or len(best.tokens) < self.page_size:
                return
            node, depth = best, depth + 1

    def match(self, seq) -> None:
        """Find the longest hit for a waiting request and plan the checkpoints its prefill exports."""
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
            node.touch()
        seq.cache_query_tokens = len(tokens)
        seq.pending_checkpoints = self._plan(seq, kv_match, hit[0] if hit else 0)
        if hit is None:
            return
        pos, node, r, depth = hit
        full = [n.page for n in path[:depth]] + ([node.page] if r == self.page_size else [])
        self.memory.pages.share(full)
        seq.block_table = full
        seq.num_computed_tokens = pos
        seq.cache_hit = (node, r)
        node.locks += 1

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

    def unmatch(self, seq) -> None:
        """Undo match() for a request that could not be admitted after all."""
        hit = getattr(seq, "cache_hit", None)
        if hit is not None:
            hit[0].locks -= 1
            seq.cache_hit = None
        self.memory.pages.release(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def restore(self, seq) -> tuple[int, list[tuple[int, int]], list[tuple[int, int, int]]]:
        """Plan the copies of the hit's checkpoint into seq.slot and of the partial page's rows into
        seq's own page -> (tokens served from the cache, [(src slot, dst slot)], [(src page, dst
        page, rows)]). The copies must run before anything else writes those slots / pages
        (ModelRunner.apply_copies at the start of the step)."""
        hit = getattr(seq, "cache_hit", None)
        if hit is None:
            return 0, [], []
        node, r = hit
        node.locks -= 1
        seq.cache_hit = None
        page_copies = []
        if r < self.page_size:
            page_copies.append((node.page, seq.block_table[seq.num_computed_tokens // self.page_size], r))
        return seq.num_computed_tokens, [(node.checkpoints[r], seq.slot)], page_copies

    # ---- admission -----------------------------------------------------------------------
    def insert(self, seq, pos: int, slot: int | None) -> None:
        """File seq's KV for positions < pos (its pages) and, if given, the checkpoint slot at pos."""
        tokens = seq.token_ids
        node = self.root
        n_pages = -(-pos // self.page_size)
        for i in range(n_pages):
            chunk = tuple(tokens[i * self.page_size : min((i + 1) * self.page_size, pos)])
            page = seq.block_table[i]
            child = next((c for c in node.children if c.tokens[: len(chunk)] == chunk), None)
            if child is None:
                child = next((c for c in node.children if chunk[: len(c.tokens)] == c.tokens and c.page == page), None)
                if child is not None:
                    child.tokens = chunk  # the same physical page, now holding more tokens
                else:
                    child = Node(chunk, page, node)
                    self.memory.pages.share([page])
                    node.children.append(child)
            child.touch()
            node = child
        if slot is None:
            return
        r = pos - (n_pages - 1) * self.page_size
        if r in node.checkpoints:
            self.memory.slots.release(slot)  # an identical state is already filed
        else:
            node.checkpoints[r] = slot
            self.stats["checkpoints_stored"] += 1

    # ---- eviction ------------------------------------------------------------------------
    def _nodes(self):
        stack = list(self.root.children)
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            yield node

    def evict_slot(self) -> bool:
        """Drop the unlocked checkpoint worth least; False if there is none.

        Every checkpoint costs one slot, so value per byte is the recompute a hit saves, which
        grows with its position (Marconi's FLOP-aware idea); recency still counts. Score =
        recency rank + position, both scaled to [0, 1]; the lowest goes.
        """
        cands = [(n, r, d * self.page_size + r) for n, d in self._nodes_with_depth()
                 if n.locks == 0 for r in n.checkpoints]
        if not cands:
            return False
        order = sorted({n.last_access for n, _, _ in cands})
        rank = {t: i / max(1, len(order) - 1) for i, t in enumerate(order)}
        top = max(p for _, _, p in cands)
        node, r, _ = min(cands, key=lambda c: rank[c[0].last_access] + c[2] / top)
        self.memory.slots.release(node.checkpoints.pop(r))
        self.stats["checkpoints_evicted"] += 1
        return True

    def _nodes_with_depth(self):
        stack = [(c, 0) for c in self.root.children]
        while stack:
            node, depth = stack.pop()
            stack.extend((c, depth + 1) for c in node.children)
            yield node, depth

    def evict_pages(self, n: int) -> bool:
        """Free up to n pages by dropping least recently used leaves nobody else references."""
        freed = 0
        while freed < n:
            leaves = [x for x in self._nodes() if not x.children and x.locks == 0
                      and self.memory.pages.refs[x.page] == 1]
            if not leaves:
                break
            leaf = min(leaves, key=lambda x: x.last_access)
            for slot in leaf.checkpoints.values():
                self.memory.slots.release(slot)
                self.stats["checkpoints_evicted"] += 1
            leaf.parent.children.remove(leaf)
            self.memory.pages.release([leaf.page])
            self.stats["pages_evicted"] += 1
            freed += 1
        return freed > 0

    def usage(self) -> dict:
        nodes = list(self._nodes())
        return {"cached_pages": len(nodes), "cached_checkpoints": sum(len(n.checkpoints) for n in nodes), **self.stats}
