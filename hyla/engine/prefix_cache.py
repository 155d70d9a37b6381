"""Hybrid prefix cache: a radix tree of KV pages plus exact recurrent-state checkpoints.

Tree: every node covers up to one page (page_size tokens) of a token sequence; its children
continue it, indexed by their first token (a bucket per first token: two pages may share their
first tokens and diverge mid-page, and a page cannot be split). A node owns one reference to the
physical KV page holding its tokens' KV (or a host page, below), and a map {r: (tier, index)} of
state checkpoints: every linear layer's recurrent state + conv window after the node's first r
tokens (r in 1..len(tokens)), kept in a state slot, an int8 entry or a host entry.

A hit of length L = page_size * a + r needs both: the KV of positions < L (the pages of the
path) and a checkpoint exactly at L, because a recurrent state cannot be cut back to a shorter
prefix. The longest such L wins, capped at num_tokens - 1 (the last token must run for logits).

Contracts:
- match(seq) -> CacheHit | None shares the full device pages of the hit (+1 ref each, the request
  owns those refs from then on) and locks the node holding the checkpoint and the hit's host
  nodes until restore(seq, hit) / unmatch(seq, hit): nothing evicts a locked node's pages or
  checkpoints.
- restore(seq, hit) runs after the request has its own slot and pages: it plans the copies (run
  by ModelRunner before the step's forward) of the checkpoint into the request's slot, of the
  hit's host pages into the request's own pages, and of the first r KV rows of a partially used
  page into the request's own page (copy-on-write: a request never writes into a page someone
  else reads). The cache itself touches no tensor.
- insert(seq, pos, slot) files the request's pages for positions < pos and the checkpoint slot;
  the tree takes over the slot (the caller must not release it) and adds one page reference.
- Eviction frees only what nobody else uses: a leaf whose page has no reference besides the tree
  (least recently used first), or a checkpoint on any unlocked node (an inner node keeps its KV;
  lowest key first, see hyla.engine.eviction). Both come off lazy heaps: O(log n) per page or
  slot freed (plus re-pushing the few candidates a running request still references).

Salts: a request whose params carry a cache_salt walks a tree of its own, under a root per salt
(created by its first insert, dropped with its last node), so it hits only what requests with the
same salt filed; unsalted requests share `root`. Eviction sees every tree's nodes alike.

Tiers (hyla.engine.cache_tiers holds their tensors; this class their indices). A checkpoint is
filed in the state slot it was exported into. When a slot is needed, the checkpoint with the
lowest key leaves it: with checkpoint_dtype "int8" it is packed into an int8 entry (whose own
lowest key moves on in turn), else it goes to the host tier, else it is dropped. So slots no
request holds keep exact checkpoints, and the int8 entries hold ~3.6x as many more in the bytes
of the slots they replace. With a host tier (host_cache_bytes), what the device tier
evicts is copied to the host first and keeps its tree node: a device "leaf" is then a node with no
device-resident child, so the device-resident nodes stay a prefix of every path (a host node's
children are host nodes); the host tier drops its own least recently used leaves and checkpoints.
A hit may reach host-resident pages and a host checkpoint: the request's own fresh pages and slot
receive them (page_in / ckpt_in) before its first step, and the tree keeps the host copies until
a request that holds the same KV on the device files it again (insert promotes the node back).
Every copy is appended to `transfers`, in the order planned; the engine runs them (take_transfers)
before any later step's work, so an index may be reused as soon as its copy is planned.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hyla.engine.block_table import BlockTable
from hyla.engine.cache_tiers import TierSizes
from hyla.engine.eviction import LazyHeap, checkpoint_key, unlink_leaf
from hyla.engine.pools import Pools, SlotPool

_clock = itertools.count()

SLOT, INT8, HOST = "slot", "int8", "host"  # where a checkpoint lives (see the module docstring)


class Node:
    __slots__ = ("tokens", "page", "host_page", "parent", "children", "checkpoints", "last_access", "locks",
                 "depth", "alive")

    def __init__(self, tokens: tuple[int, ...], page: int | None, parent: Node | None):
        self.tokens = tokens
        self.page = page  # the device page, or None while the KV is on the host
        self.host_page: int | None = None
        self.parent = parent
        self.depth = -1 if parent is None else parent.depth + 1  # pages before this one on the path
        self.children: dict[int, list[Node]] = {}  # first token -> the children starting with it
        self.checkpoints: dict[int, tuple[str, int]] = {}  # r -> (tier, index in that tier)
        self.last_access = next(_clock)
        self.locks = 0
        self.alive = True

    def child_nodes(self):
        return (c for bucket in self.children.values() for c in bucket)


@dataclass
class CacheHit:
    """The handle match() returns: the checkpoint at `node`'s first r tokens serves the first
    `num_tokens` tokens of the request. `host_nodes`: the hit's full pages that are on the host
    (block index, node), loaded into the request's own pages at restore. The node and the host
    nodes stay locked until restore() or unmatch()."""

    node: Node
    r: int
    num_tokens: int
    host_nodes: list[tuple[int, Node]] = field(default_factory=list)

    @property
    def locked(self) -> list[Node]:
        return [self.node] + [n for _, n in self.host_nodes]

    @property
    def from_host(self) -> bool:
        """Whether restoring the hit copies anything from the host tier (pages or checkpoint)."""
        return self.node.checkpoints[self.r][0] == HOST or bool(self.host_nodes) or self.node.page is None


def common_prefix_len(a, b) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    def __init__(self, pools: Pools, checkpoint_interval: int | None = None, tiers: TierSizes | None = None):
        self.pools = pools
        self.page_size = pools.page_size
        self.checkpoint_interval = checkpoint_interval
        self.tiers = tiers or TierSizes()
        self.int8 = SlotPool(self.tiers.int8_entries) if self.tiers.int8_entries else None  # indices only
        self.host_pages = SlotPool(self.tiers.host_pages)
        self.host_checkpoints = SlotPool(self.tiers.host_checkpoints)
        self.root = Node((), None, None)  # the unsalted tree's
        self._salted: dict[str, Node] = {}  # cache_salt -> the root of that salt's tree
        self._salt_of: dict[Node, str] = {}  # the reverse, to drop a salt's root with its last node
        self.num_pages = 0  # nodes in the tree (device or host)
        self.num_checkpoints = 0
        self.inflation = 0.0  # the key of the last checkpoint evict_slot dropped (eviction.py)
        self.transfers: list[tuple] = []  # copies planned, not yet handed to the runner (take_transfers)
        self._leaves = LazyHeap(lambda stamp, n: n.alive and n.page is not None and n.last_access == stamp
                                and not self._has_device_child(n))
        self._checkpoints = {tier: LazyHeap(lambda key, c, tier=tier: c[0].alive and c[0].last_access == c[2]
                                            and c[0].checkpoints.get(c[1], (None,))[0] == tier)
                             for tier in (SLOT, INT8)}  # GreedyDual keys, one heap per device tier
        self._host_leaves = LazyHeap(lambda stamp, n: n.alive and n.page is None and not n.children
                                     and n.last_access == stamp)
        self._host_checkpoints = LazyHeap(lambda stamp, c: c[0].alive and c[0].checkpoints.get(c[1], (SLOT,))[0] == HOST
                                          and c[0].last_access == stamp)
        self.stats = {"checkpoints_stored": 0, "checkpoints_evicted": 0, "checkpoints_to_int8": 0, "pages_evicted": 0,
                      "pages_to_host": 0, "checkpoints_to_host": 0, "pages_from_host": 0, "checkpoints_from_slot": 0,
                      "checkpoints_from_int8": 0, "checkpoints_from_host": 0,
                      "host_pages_evicted": 0, "host_checkpoints_evicted": 0, "hits_device": 0, "hits_host": 0,
                      "hit_tokens_device": 0, "hit_tokens_host": 0}

    @staticmethod
    def _has_device_child(node: Node) -> bool:
        return any(c.page is not None for c in node.child_nodes())

    def _touch(self, node: Node, may_be_leaf: bool = True) -> None:
        """A new recency stamp: the node's heap entries are pushed again (the old ones go stale).
        may_be_leaf=False: the caller knows a device child of node, so it is filed as no leaf."""
        node.last_access = next(_clock)
        if may_be_leaf:
            self._file_node(node)
        for r in node.checkpoints:
            self._file_checkpoint(node, r)

    def _touch_path(self, path: list[Node]) -> None:
        """_touch each node of a downward path, in order. A node whose successor on the path is on
        the device has a device child, so it is no leaf: its children need not be looked through
        (on a 60K-token path that look was a quarter of match's time)."""
        for node, successor in itertools.zip_longest(path, path[1:]):
            self._touch(node, may_be_leaf=successor is None or successor.page is None)

    def _root_of(self, seq, create: bool) -> Node | None:
        """The root of the tree seq's salt selects (None: that salt has no tree and create is false)."""
        salt = seq.params.cache_salt
        if salt is None:
            return self.root
        root = self._salted.get(salt)
        if root is None and create:
            root = self._salted[salt] = Node((), None, None)
            self._salt_of[root] = salt
        return root

    def _file_node(self, node: Node) -> None:
        """Push node on the heap of its tier's leaves when it is one."""
        if node.parent is None:  # a root
            return
        if node.page is not None:
            if not self._has_device_child(node):
                self._leaves.push(node.last_access, node)
        elif not node.children:
            self._host_leaves.push(node.last_access, node)

    def _file_checkpoint(self, node: Node, r: int) -> None:
        if node.checkpoints[r][0] == HOST:
            self._host_checkpoints.push(node.last_access, (node, r))
        else:
            key = checkpoint_key(self.inflation, node.depth * self.page_size + r)
            self._checkpoints[node.checkpoints[r][0]].push(key, (node, r, node.last_access))

    def take_transfers(self) -> list[tuple]:
        """The copies planned since the last call, in order (hyla.engine.cache_tiers runs them)."""
        plan, self.transfers = self.transfers, []
        return plan

    # ---- lookup --------------------------------------------------------------------------
    def _walk(self, tokens, root: Node | None):
        """Yield (depth, matches) per page depth along the best-matching path, where matches is
        [(child, m)] for every child of the current node sharing m >= 1 leading tokens with
        `tokens` at that depth, best first, in the tree under `root` (None: an empty tree). A
        checkpoint may sit on any of them: siblings that hold different continuations still share
        their first m tokens' KV."""
        if root is None:
            return
        node, depth = root, 0
        while True:
            chunk = tuple(tokens[depth * self.page_size : (depth + 1) * self.page_size])
            if not chunk:
                return
            bucket = node.children.get(chunk[0], ())
            if len(bucket) == 1:  # the common case along a path: one child, usually all of it equal
                child = bucket[0]
                matches = [(child, len(chunk) if child.tokens == chunk else common_prefix_len(child.tokens, chunk))]
            else:
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
        On a hit, seq's block table starts with the shared full pages on the device and
        num_computed_tokens with the hit; the returned handle must reach restore() or unmatch()."""
        tokens = seq.token_ids
        limit = len(tokens) - 1
        path, hit, kv_match = [], None, 0
        for depth, matches in self._walk(tokens, self._root_of(seq, create=False)):
            path.append(matches[0][0])
            kv_match = depth * self.page_size + matches[0][1]
            for node, m in matches:
                for r in node.checkpoints:
                    pos = depth * self.page_size + r
                    if r <= m and pos <= limit and (hit is None or pos > hit[0]):
                        hit = (pos, node, r, depth)
        self._touch_path(path)
        seq.pending_checkpoints = self._plan(seq, kv_match, hit[0] if hit else 0)
        if hit is None:
            return None
        pos, node, r, depth = hit
        full = path[:depth] + ([node] if r == self.page_size else [])
        on_device = [n.page for n in itertools.takewhile(lambda n: n.page is not None, full)]
        host_nodes = list(enumerate(full))[len(on_device):]
        assert all(n.page is None for _, n in host_nodes), "a host node above a device node"
        self.pools.pages.share(on_device)
        seq.block_table = BlockTable(on_device)
        seq.num_computed_tokens = pos
        found = CacheHit(node, r, pos, host_nodes)
        for n in found.locked:
            n.locks += 1
        return found

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
            for n in hit.locked:
                n.locks -= 1
        self.pools.pages.release(seq.block_table)
        seq.block_table = BlockTable()
        seq.num_computed_tokens = 0

    def restore(self, seq, hit: CacheHit | None) -> int:
        """Plan the copies that give seq its hit, once it has its own slot and pages: the
        checkpoint into seq.slot, the host-resident full pages into seq's own pages, and the
        partial page's first r rows into seq's own page (copy-on-write: a request never writes
        into a page someone else reads). Unlocks the hit; returns the tokens served. The copies
        go to `transfers` and run before anything else writes those slots / pages (the source
        entries may be evicted, and their indices handed out, later in the same schedule)."""
        if hit is None:
            return 0
        node, r = hit.node, hit.r
        for n in hit.locked:
            n.locks -= 1
        for i, n in hit.host_nodes:
            self.transfers.append(("page_in", n.host_page, seq.block_table[i]))
            self.stats["pages_from_host"] += 1
        if r < self.page_size:
            dst = seq.block_table[hit.num_tokens // self.page_size]
            if node.page is not None:
                self.transfers.append(("copy_rows", node.page, dst, r))
            else:
                self.transfers.append(("page_in", node.host_page, dst))
                self.stats["pages_from_host"] += 1
        tier, index = node.checkpoints[r]
        self.transfers.append({SLOT: ("copy_slot", index, seq.slot), INT8: ("unpack", index, seq.slot),
                               HOST: ("ckpt_in", index, seq.slot)}[tier])
        from_host = hit.from_host
        self.stats[f"checkpoints_from_{tier}"] += 1
        self.stats["hits_host" if from_host else "hits_device"] += 1
        self.stats["hit_tokens_host" if from_host else "hit_tokens_device"] += hit.num_tokens
        return hit.num_tokens

    # ---- admission -----------------------------------------------------------------------
    def insert(self, seq, pos: int, slot: int | None) -> None:
        """File seq's KV for positions < pos (its pages) and, if given, the checkpoint slot at pos.
        The tree takes over the slot (the caller must not release it). A host-resident node
        whose tokens seq's page holds in full comes back to the device on seq's page."""
        tokens = seq.token_ids
        node, path = self._root_of(seq, create=True), []
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
            elif child.page is None and len(child.tokens) == len(chunk):
                self.pools.pages.share([page])  # promoted: seq's page holds the same tokens' KV
                child.page = page
                self.host_pages.release(child.host_page)
                child.host_page = None
            path.append(child)
            node = child
        self._touch_path(path)
        if slot is None:
            return
        r = pos - (n_pages - 1) * self.page_size
        if r in node.checkpoints:
            self.pools.slots.release(slot)  # an identical state is already filed
            return
        node.checkpoints[r] = (SLOT, slot)
        self.num_checkpoints += 1
        self._file_checkpoint(node, r)
        self.stats["checkpoints_stored"] += 1

    # ---- eviction ------------------------------------------------------------------------
    @staticmethod
    def _pop_unlocked(heap: LazyHeap, node_of=lambda item: item[0]):
        """The lowest valid entry of heap whose node is unlocked (locked ones are pushed back)."""
        locked = []
        while (top := heap.pop()) is not None and node_of(top[1]).locks:
            locked.append(top)
        for key, item in locked:
            heap.push(key, item)
        return top

    def _free_int8_entry(self) -> int | None:
        """An int8 entry, moving the int8 checkpoint with the lowest key on if none is free."""
        if self.int8.num_free == 0 and not self._evict_checkpoint(INT8):
            return None
        return self.int8.allocate()

    def _evict_checkpoint(self, tier: str) -> bool:
        """Move the unlocked checkpoint of `tier` with the lowest key (hyla.engine.eviction:
        GreedyDual over recency and the position it saves recomputing) one tier down."""
        top = self._pop_unlocked(self._checkpoints[tier])
        if top is None:
            return False
        key, (node, r, _) = top
        self.inflation = key
        self._demote_checkpoint(node, r)
        return True

    def _demote_checkpoint(self, node: Node, r: int) -> None:
        """Free the device home of node's checkpoint r: a slot's goes to an int8 entry when that
        tier exists and one can be found, else (and an int8 entry's) to a host entry, else the
        checkpoint is dropped."""
        tier, index = node.checkpoints[r]
        node.locks += 1  # making room below must not take this checkpoint
        entry = self._free_int8_entry() if tier == SLOT and self.int8 is not None else None
        host = self._free_host_checkpoint() if entry is None else None
        node.locks -= 1
        if entry is not None:
            self.transfers.append(("pack", index, entry))
            node.checkpoints[r] = (INT8, entry)
            self._file_checkpoint(node, r)
            self.stats["checkpoints_to_int8"] += 1
        elif host is not None:
            self.transfers.append(("ckpt_out", tier, index, host))
            node.checkpoints[r] = (HOST, host)
            self._file_checkpoint(node, r)
            self.stats["checkpoints_to_host"] += 1
        else:
            del node.checkpoints[r]
            self.num_checkpoints -= 1
            self.stats["checkpoints_evicted"] += 1
        self._release_home(tier, index)

    def _release_home(self, tier: str, index: int) -> None:
        if tier == SLOT:
            self.pools.slots.release(index)
        elif tier == INT8:
            self.int8.release(index)
        else:
            self.host_checkpoints.release(index)

    def _free_host_checkpoint(self) -> int | None:
        """A host checkpoint entry, dropping the least recently used unlocked one if none is free."""
        if not self.host_checkpoints.num_slots:
            return None
        if self.host_checkpoints.num_free == 0:
            top = self._pop_unlocked(self._host_checkpoints)
            if top is None:
                return None
            node, r = top[1]
            self.host_checkpoints.release(node.checkpoints.pop(r)[1])
            self.num_checkpoints -= 1
            self.stats["host_checkpoints_evicted"] += 1
        return self.host_checkpoints.allocate()

    def _free_host_page(self) -> int | None:
        """A host page, dropping the least recently used unlocked host leaf if none is free."""
        if not self.host_pages.num_slots:
            return None
        if self.host_pages.num_free == 0:
            top = self._pop_unlocked(self._host_leaves, node_of=lambda node: node)
            if top is None:
                return None
            self._remove(top[1])
            self.stats["host_pages_evicted"] += 1
        return self.host_pages.allocate()

    def _remove(self, leaf: Node) -> None:
        """Take a leaf (no children) out of the tree, with everything it holds in any tier."""
        for tier, index in leaf.checkpoints.values():
            self._release_home(tier, index)
        self.stats["checkpoints_evicted"] += len(leaf.checkpoints)
        self.num_checkpoints -= len(leaf.checkpoints)
        leaf.checkpoints = {}
        if leaf.page is not None:
            self.pools.pages.release([leaf.page])
        else:
            self.host_pages.release(leaf.host_page)
        self.num_pages -= 1
        unlink_leaf(leaf, self.root)
        parent = leaf.parent
        if parent in self._salt_of and not parent.children:  # a salt's last node
            del self._salted[self._salt_of.pop(parent)]
        self._file_node(parent)  # it may have become a leaf of its tier

    def _drop_subtree(self, node: Node) -> None:
        """Remove node and everything below it (its descendants are host nodes nobody locks)."""
        for child in list(node.child_nodes()):
            self._drop_subtree(child)
        self._remove(node)

    def evict_slot(self) -> bool:
        """Free a state slot held by a checkpoint: the unlocked one with the lowest key moves one
        tier down (int8, host) or is dropped; False if there is none."""
        return self._evict_checkpoint(SLOT)

    def evict_pages(self, n: int) -> bool:
        """Free up to n device pages, least recently used device leaves first (a node no request
        references and with no device-resident child). With a host tier the page and its device
        checkpoints go to the host and the node stays; otherwise (or when the host has no room)
        the node goes, with what hangs below it. A parent that becomes a device leaf joins the heap."""
        freed, skipped = 0, []
        refs = self.pools.pages.refs
        while freed < n and (top := self._leaves.pop()) is not None:
            leaf = top[1]
            if leaf.locks or refs[leaf.page] != 1:  # a running request reads it: not now
                skipped.append(top)
                continue
            leaf.locks += 1  # making room on the host must not remove it
            host = self._free_host_page()
            leaf.locks -= 1
            if host is None:
                self._drop_subtree(leaf)
            else:
                self.transfers.append(("page_out", leaf.page, host))
                self.pools.pages.release([leaf.page])
                leaf.page, leaf.host_page = None, host
                self.stats["pages_to_host"] += 1
                for r in [r for r, (tier, _) in leaf.checkpoints.items() if tier != HOST]:
                    self._demote_checkpoint(leaf, r)
                self._file_node(leaf)
                self._file_node(leaf.parent)
            self.stats["pages_evicted"] += 1
            freed += 1
        for stamp, leaf in skipped:
            self._leaves.push(stamp, leaf)
        return freed > 0

    def usage(self) -> dict:
        on_host = self.tiers.host_pages - self.host_pages.num_free
        return {"cached_pages": self.num_pages - on_host, "cached_checkpoints": self.num_checkpoints,
                "host_cached_pages": on_host,
                "host_cached_checkpoints": self.tiers.host_checkpoints - self.host_checkpoints.num_free,
                **self.stats}
