"""The interface every simulated prefix cache shares (the lazy heaps are hyla.engine.eviction's).

A policy serves one request at a time, start to finish (no two requests overlap, so nothing is
locked while the cache evicts):

    hit = policy.lookup(prompt)        longest reusable prefix: KV for all of it and a state
                                       checkpoint exactly at its end, capped at len(prompt) - 1
                                       (the last prompt token must run to produce logits)
    policy.admit(prompt, output, hit)  what the system stores while it prefills prompt[hit:],
                                       decodes `output` and finishes (each policy's own rule)
    policy.shrink()                    evict by the policy's rule until the bytes fit

Memory is one byte budget: cached KV tokens x kv_bytes_per_token (in the policy's allocation
unit: hyla's 16-token pages, vLLM's blocks, single tokens for the token radix trees) plus
checkpoints x state_bytes. A running request's own slot and pages are not part of the cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter

from hyla.bench.cache_sim.costs import Costs


class Policy(ABC):
    name = "?"

    def __init__(self, capacity: int, costs: Costs):
        self.capacity = capacity
        self.costs = costs
        self.used = 0  # bytes held by the cache
        self.stats = Counter()  # states_admitted, states_evicted, ...

    def serve(self, prompt: tuple[int, ...], output: tuple[int, ...]) -> int:
        """Run one request; returns the prompt tokens served from the cache."""
        hit = self.lookup(prompt)
        self.admit(prompt, output, hit)
        self.shrink()
        return hit

    @abstractmethod
    def lookup(self, prompt: tuple[int, ...]) -> int:
        """The hit length; may remember what this request's prefill should checkpoint."""

    @abstractmethod
    def admit(self, prompt: tuple[int, ...], output: tuple[int, ...], hit: int) -> None:
        """Store what the system stores for this request (KV, checkpoints)."""

    @abstractmethod
    def evict_one(self) -> bool:
        """Free one unit by the policy's rule; False when nothing can be freed."""

    def shrink(self) -> None:
        while self.used > self.capacity and self.evict_one():
            pass
