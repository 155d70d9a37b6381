"""The layer contract: what an engine step hands a model and each of its layers.

It sits below hyla.layers (it imports nothing above hyla.ops): hyla.layers, hyla.models and
hyla.engine all import it from below.

- `ForwardBatch` (batch.py): one engine step's sequences, their new tokens packed along one axis,
  and the two indirections into the pools (block tables for pages, state slots);
- the layer caches (cache.py): `LayerCache` and its two kinds, `LinearLayerCache` (state slots:
  KDALayerCache, GDNLayerCache) and `PagedLayerCache` (KV pages: MLALayerCache, DSALayerCache,
  KVLayerCache),
  and `HybridCache`, a model's per-layer pools; `state_pool` allocates a state slot pool
  (K-last), `as_k_last` copies states into that layout.

A token mixer runs an engine step as `forward_batch(x [T_total, hidden], batch: ForwardBatch,
cache: <its LayerCache>) -> [T_total, hidden]`; a stateful one (ShortConvDeltaRule) also has
`commit_replay(cache, accepted)`, which consumes the cache's `replay_inputs()`.
"""

from hyla.contract.batch import ForwardBatch
from hyla.contract.cache import (
    DSALayerCache,
    GDNLayerCache,
    HybridCache,
    KDALayerCache,
    KVLayerCache,
    LayerCache,
    LinearLayerCache,
    MLALayerCache,
    PagedLayerCache,
    as_k_last,
    state_pool,
)

__all__ = [
    "ForwardBatch", "LayerCache", "LinearLayerCache", "PagedLayerCache", "KDALayerCache", "GDNLayerCache",
    "MLALayerCache", "DSALayerCache", "KVLayerCache", "HybridCache", "state_pool", "as_k_last",
]
