"""hyla's prefix cache (hyla/engine/prefix_cache.py), rule for rule, without tensors.

Tree: nodes of up to page_size tokens (one KV page each, children indexed by first token but
kept in insertion order, as the engine's list) with exact state checkpoints {r: state after the
node's first r tokens}. Same walk, same hit rule, same plan, same insert, same LRU stamps:

- lookup: walk the best-matching child page by page; the hit is the deepest checkpoint on any
  child at each depth (siblings included) whose first r tokens match, capped at len(prompt) - 1;
- admit: the prefill exports the junction (the exact end of the shared KV, when the KV match is
  longer than the hit) and the prompt end taken at prompt_len - 1 (and every
  `checkpoint_interval` tokens when set); the finished request files its running slot at
  prompt + output - 1;
- evict: the least recently used leaf page nobody else references (with its checkpoints), or the
  checkpoint with the lowest key (hyla.engine.eviction: the same score function and lazy heaps
  as the engine). The engine keeps pages and state slots in two pools and evicts from the one
  that is short; here both live in one byte budget, so the older of the two candidates goes
  first (the checkpoint on a tie).
"""

from __future__ import annotations

import itertools

from hyla.bench.cache_sim.base import Policy
from hyla.engine.eviction import LazyHeap, checkpoint_key, unlink_leaf
from hyla.engine.prefix_cache import common_prefix_len


class _Node:
    __slots__ = ("tokens", "page", "parent", "children", "checkpoints", "last", "alive", "depth")

    def __init__(self, tokens, page, parent):
        self.depth = -1 if parent is None else parent.depth + 1
        self.tokens = tokens
        self.page = page
        self.parent = parent
        self.children: dict[int, list[_Node]] = {}
        self.checkpoints: dict[int, bool] = {}
        self.last = 0
        self.alive = True


class HylaPolicy(Policy):
    name = "hyla"

    def __init__(self, capacity, costs, page_size: int = 16, checkpoint_interval: int | None = None):
        super().__init__(capacity, costs)
        self.page_size = page_size
        self.checkpoint_interval = checkpoint_interval
        self.page_bytes = page_size * costs.kv_bytes_per_token
        self.root = _Node((), None, None)
        self._clock = itertools.count(1)
        self._pages = itertools.count(1)
        self._leaves = LazyHeap(lambda stamp, n: n.alive and n.last == stamp and not n.children)
        self._checkpoints = LazyHeap(lambda key, c: c[0].alive and c[1] in c[0].checkpoints and c[0].last == c[2])
        self._inflation = 0.0
        self._block_table: list[int] = []
        self._plan: list[int] = []

    # ---- lookup (PrefixCache.match / _plan) ------------------------------------------------
    def _walk(self, tokens):
        P, node, depth = self.page_size, self.root, 0
        while True:
            chunk = tokens[depth * P:(depth + 1) * P]
            if not chunk:
                return
            matches = sorted(((c, common_prefix_len(c.tokens, chunk)) for c in node.children.get(chunk[0], ())),
                             key=lambda x: -x[1])
            if not matches:
                return
            yield depth, matches
            best, best_m = matches[0]
            if best_m < P or len(best.tokens) < P:
                return
            node, depth = best, depth + 1

    def lookup(self, prompt) -> int:
        P, limit = self.page_size, len(prompt) - 1
        path, hit, kv_match = [], None, 0
        for depth, matches in self._walk(prompt):
            path.append(matches[0][0])
            kv_match = depth * P + matches[0][1]
            for node, m in matches:
                for r in node.checkpoints:
                    pos = depth * P + r
                    if r <= m and pos <= limit and (hit is None or pos > hit[0]):
                        hit = (pos, node, r, depth)
        for node in path:
            self._touch(node)
        hit_len = hit[0] if hit else 0
        self._plan = self._checkpoint_plan(prompt, kv_match, hit_len)
        self._block_table = []
        if hit is not None:
            pos, node, r, depth = hit
            self._block_table = [n.page for n in path[:depth]] + ([node.page] if r == P else [])
        return hit_len

    def _checkpoint_plan(self, prompt, kv_match: int, hit: int) -> list[int]:
        limit = len(prompt) - 1
        plan = set()
        junction = min(kv_match, limit)
        if junction > hit:
            plan.add(junction)
        plan.add(len(prompt) - 1)
        if self.checkpoint_interval:
            plan.update(range(self.checkpoint_interval, limit + 1, self.checkpoint_interval))
        return sorted(p for p in plan if p > hit)

    # ---- admission (PrefixCache.insert, called from the engine's step and on_finish) -------
    def admit(self, prompt, output, hit) -> None:
        for pos in self._plan:
            self._insert(prompt, pos)
        self._insert(prompt + output, len(prompt) + len(output) - 1)

    def _page(self, i: int) -> int:
        """The request's page for positions [i * P, (i + 1) * P): shared on a hit, else its own."""
        while len(self._block_table) <= i:
            self._block_table.append(next(self._pages))
        return self._block_table[i]

    def _insert(self, tokens, pos: int) -> None:
        P, node = self.page_size, self.root
        n_pages = -(-pos // P)
        for i in range(n_pages):
            chunk = tuple(tokens[i * P:min((i + 1) * P, pos)])
            page = self._page(i)
            bucket = node.children.setdefault(chunk[0], [])
            child = next((c for c in bucket if c.tokens[:len(chunk)] == chunk), None)
            if child is None:
                child = next((c for c in bucket if chunk[:len(c.tokens)] == c.tokens and c.page == page), None)
                if child is not None:
                    child.tokens = chunk  # the same physical page, now holding more tokens
                else:
                    child = _Node(chunk, page, node)
                    bucket.append(child)
                    self.used += self.page_bytes
            self._touch(child)
            node = child
        r = pos - (n_pages - 1) * P
        if r not in node.checkpoints:
            node.checkpoints[r] = True
            self.used += self.costs.state_bytes
            self.stats["states_admitted"] += 1
            self._push_checkpoint(node, r)

    def _touch(self, node: _Node) -> None:
        node.last = next(self._clock)
        if not node.children:
            self._leaves.push(node.last, node)
        for r in node.checkpoints:
            self._push_checkpoint(node, r)

    def _push_checkpoint(self, node: _Node, r: int) -> None:
        self._checkpoints.push(checkpoint_key(self._inflation, node.depth * self.page_size + r), (node, r, node.last))

    # ---- eviction (PrefixCache.evict_slot / evict_pages, one budget) -----------------------
    def evict_one(self) -> bool:
        leaf = self._leaves.peek()
        ckpt = self._checkpoints.peek()
        if ckpt is not None and (leaf is None or ckpt[1][0].last <= leaf[0]):
            self._checkpoints.pop()
            self._inflation = ckpt[0]
            node, r, _ = ckpt[1]
            del node.checkpoints[r]
            self.used -= self.costs.state_bytes
            self.stats["states_evicted"] += 1
            return True
        if leaf is None:
            return False
        self._leaves.pop()
        node = leaf[1]
        self.used -= self.page_bytes + len(node.checkpoints) * self.costs.state_bytes
        self.stats["states_evicted"] += len(node.checkpoints)
        if (parent := unlink_leaf(node, self.root)) is not None:
            self._leaves.push(parent.last, parent)
        return True
