"""Marconi (Pan et al., "Marconi: Prefix Caching for the Era of Hybrid LLMs", MLSys 2025).

- Tree: token radix tree (page size 1), a state at a node end.
- Admission: a state only where reuse is likely. (1) The branch point: inserting the prompt
  speculatively shows where it leaves the tree; if that creates a new intermediate node (the
  prompt diverges inside an edge, or continues from a node that already branches and lacks a
  state), the prefill checkpoints there. (2) The sequence end: the state after the last fed
  token (prompt + output - 1), with the KV of prompt + output.
- lookup: the deepest fully matched node with a state, capped at len(prompt) - 1.
- Eviction is FLOP-aware: candidates are leaves (KV + state) and single-child nodes holding a
  state (the state goes, the node merges into its child). Each gets
      utility = recency + alpha * flop_efficiency
  (both min-max normalised over the candidates; flop_efficiency = prefill FLOPs of the prefix
  the node ends / bytes it frees) and the lowest utility goes. alpha is tuned by replaying
  already-seen requests (see `hyla.bench.prefix_cache`); alpha = 0 is plain LRU.
"""

from __future__ import annotations

from hyla.bench.cache_sim.radix import TreePolicy


class MarconiPolicy(TreePolicy):
    name = "marconi"

    def __init__(self, capacity, costs, alpha: float = 1.0):
        super().__init__(capacity, costs)
        self.alpha = alpha

    def lookup(self, prompt) -> int:
        kv, nodes = self.tree.match(prompt)
        limit = len(prompt) - 1
        with_state = [n for n in nodes if n.state and n.end <= limit]
        hit = with_state[-1].end if with_state else 0
        if nodes:
            self.tree.touch(nodes[-1])
        self._branch = None
        if kv > hit:
            inside_edge = not nodes or nodes[-1].end != kv
            at_branching_node = not inside_edge and kv < len(prompt) and nodes[-1].children and not nodes[-1].state
            if inside_edge or at_branching_node:
                self._branch = kv
        return hit

    def admit(self, prompt, output, hit) -> None:
        if self._branch is not None:
            self._cache(prompt, self._branch)
        self._cache(prompt + output, len(prompt) + len(output) - 1)

    def _freed(self, node) -> int:
        kv = 0 if node.children else len(node.key) * self.costs.kv_bytes_per_token
        return kv + node.state * self.costs.state_bytes

    def evict_one(self) -> bool:
        tree = self.tree
        candidates = [x for x in tree.nodes if not x.children or (x.state and len(x.children) == 1)]
        if not candidates:
            return False
        lo = min(x.last for x in candidates)
        span = max(x.last for x in candidates) - lo or 1
        eff = {x: (self.costs.prefill_flops(x.end) if x.state else 0.0) / self._freed(x) for x in candidates}
        top = max(eff.values()) or 1.0
        node = min(candidates, key=lambda x: (x.last - lo) / span + self.alpha * eff[x] / top)
        self.stats["states_evicted"] += node.state
        if node.children:
            tree.drop_state(node)
            tree.merge_into_child(node)
        else:
            parent = node.parent
            tree.remove_leaf(node)
            if parent is not tree.root and len(parent.children) == 1 and not parent.state:
                tree.merge_into_child(parent)
        self._sync_bytes()
        return True
