"""A token-granular radix tree (page size 1, as SGLang's and Marconi's) with states at node ends.

Each node holds an edge of tokens (their KV) and at most one state checkpoint, taken after its
last token; `end` is that position. Splitting an edge puts a new node in front of the old one,
so a state can be placed at any position. Byte accounting is left to the caller through
`kv_tokens` and `n_states`.
"""

from __future__ import annotations

import itertools

from hyla.bench.cache_sim.base import Policy


class RNode:
    __slots__ = ("key", "children", "parent", "state", "last", "end")

    def __init__(self, key: tuple, parent: RNode | None, end: int):
        self.key = key
        self.children: dict[int, RNode] = {}
        self.parent = parent
        self.state = False
        self.last = 0
        self.end = end


class TokenTree:
    def __init__(self):
        self.root = RNode((), None, 0)
        self.kv_tokens = 0
        self.n_states = 0
        self.nodes: set[RNode] = set()
        self._clock = itertools.count(1)

    def match(self, tokens) -> tuple[int, list[RNode]]:
        """(tokens matched, the nodes whose whole edge matched, root first)."""
        node, pos, full = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = 0
            for a, b in zip(child.key, tokens[pos:]):
                if a != b:
                    break
                k += 1
            pos += k
            if k < len(child.key):
                break
            full.append(child)
            node = child
        return pos, full

    def node_at(self, tokens) -> RNode:
        """The node ending exactly at len(tokens), splitting an edge or adding a leaf for the part
        not in the tree (its KV is counted)."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = RNode(tuple(tokens[pos:]), node, len(tokens))
                node.children[tokens[pos]] = leaf
                self.nodes.add(leaf)
                self.kv_tokens += len(leaf.key)
                return leaf
            k = 0
            for a, b in zip(child.key, tokens[pos:]):
                if a != b:
                    break
                k += 1
            if k < len(child.key):
                child = self.split(child, k)
            pos += k
            node = child
        return node

    def split(self, node: RNode, k: int) -> RNode:
        """Cut node's edge after k tokens; returns the new front node (no state, same stamp)."""
        front = RNode(node.key[:k], node.parent, node.end - len(node.key) + k)
        front.last = node.last
        node.parent.children[front.key[0]] = front
        node.key = node.key[k:]
        node.parent = front
        front.children[node.key[0]] = node
        self.nodes.add(front)
        return front

    def set_state(self, node: RNode) -> bool:
        """Give node a state; False if it already had one."""
        if node.state:
            return False
        node.state = True
        self.n_states += 1
        return True

    def drop_state(self, node: RNode) -> None:
        node.state = False
        self.n_states -= 1

    def remove_leaf(self, node: RNode) -> None:
        if node.state:
            self.drop_state(node)
        del node.parent.children[node.key[0]]
        self.nodes.discard(node)
        self.kv_tokens -= len(node.key)

    def merge_into_child(self, node: RNode) -> None:
        """Fold a stateless node with one child into that child (keeps the tree compressed)."""
        (child,) = node.children.values()
        child.key = node.key + child.key
        child.parent = node.parent
        node.parent.children[child.key[0]] = child
        self.nodes.discard(node)

    def touch(self, node: RNode) -> None:
        """Most recently used: node, then its ancestors slightly older (deeper = more recent)."""
        chain = []
        while node is not None and node is not self.root:
            chain.append(node)
            node = node.parent
        for n in reversed(chain):
            n.last = next(self._clock)


class TreePolicy(Policy):
    """A policy over one TokenTree of KV + states (Marconi, SGLang): the shared bookkeeping."""

    def __init__(self, capacity, costs):
        super().__init__(capacity, costs)
        self.tree = TokenTree()
        self._branch = None  # a position whose state lookup decided to cache at admission

    def _sync_bytes(self) -> None:
        self.used = self.tree.kv_tokens * self.costs.kv_bytes_per_token + self.tree.n_states * self.costs.state_bytes

    def _cache(self, tokens, pos: int) -> None:
        """Insert tokens[:pos] with a state at pos (a duplicate state is released)."""
        node = self.tree.node_at(tokens[:pos])
        if self.tree.set_state(node):
            self.stats["states_admitted"] += 1
        self.tree.touch(node)
        self._sync_bytes()
