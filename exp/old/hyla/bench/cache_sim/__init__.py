"""Trace-driven simulation of hybrid-model prefix caches (hyla, vLLM align, SGLang, Marconi).

    traces.py         deterministic traces (a)-(d)
    costs.py          bytes per KV token / per state checkpoint, prefill FLOPs (reference model)
    base.py           the Policy interface (lookup / admit / evict_one) and a lazy LRU heap
    radix.py          token radix tree shared by the SGLang and Marconi simulations
    hyla_policy.py    hyla/engine/prefix_cache.py's rules
    vllm_policy.py    vLLM mamba_cache_mode="align" (+ --prefix-match-unit)
    sglang_policy.py  SGLang MambaRadixCache, extra_buffer strategy
    marconi_policy.py Marconi (branch point + sequence end, FLOP-aware eviction)
"""

from hyla.bench.cache_sim.base import Policy
from hyla.bench.cache_sim.costs import Costs, reference_costs
from hyla.bench.cache_sim.hyla_policy import HylaPolicy
from hyla.bench.cache_sim.marconi_policy import MarconiPolicy
from hyla.bench.cache_sim.sglang_policy import SglangPolicy
from hyla.bench.cache_sim.traces import Request, Trace, make_traces
from hyla.bench.cache_sim.vllm_policy import VllmAlignPolicy

__all__ = ["Policy", "Costs", "reference_costs", "HylaPolicy", "MarconiPolicy", "SglangPolicy", "VllmAlignPolicy",
           "Request", "Trace", "make_traces"]
