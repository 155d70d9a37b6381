"""hyla.contract: the bottom of the stack, and the replay-inputs hooks of the layer caches."""

import subprocess
import sys

import pytest
import torch

from hyla.contract import (GDNLayerCache, HybridCache, KDALayerCache, KVLayerCache, LayerCache, MLALayerCache,
                           state_pool)


ABOVE_THE_CONTRACT = ("hyla.layers", "hyla.models", "hyla.engine", "hyla.server", "hyla.bench", "hyla.parallel")


def test_contract_imports_nothing_above_it():
    code = ("import sys, hyla.contract; "
            f"print(sorted(m for m in sys.modules if m.startswith({ABOVE_THE_CONTRACT!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _caches():
    state, conv = torch.zeros(3, 2, 4, 4), torch.zeros(3, 8, 3)
    return [KDALayerCache(state, (conv, conv, conv)), GDNLayerCache(state, (conv,)),
            MLALayerCache(torch.zeros(2, 4, 6)), KVLayerCache(torch.zeros(2, 4, 1, 5), torch.zeros(2, 4, 1, 5))]


def test_replay_inputs_default_none():
    for cache in _caches():
        assert isinstance(cache, LayerCache)
        assert cache.replay_inputs() is None
        cache.set_replay_inputs(None)  # clearing is accepted by every cache
        assert cache.replay_inputs() is None


def test_linear_caches_keep_replay_inputs_paged_refuse_them():
    kda, gdn, mla, kv = _caches()
    for cache in (kda, gdn):
        inputs = {"k": torch.ones(1)}
        cache.set_replay_inputs(inputs)
        assert cache.replay_inputs() is inputs and cache.replay is inputs  # the field the layers write
        cache.set_replay_inputs(None)
        assert cache.replay_inputs() is None
    for cache in (mla, kv):
        with pytest.raises(ValueError, match="keeps no replay inputs"):
            cache.set_replay_inputs({"k": torch.ones(1)})


def test_hybrid_cache_sorts_layers_by_kind():
    caches = _caches()
    pools = HybridCache(caches, num_slots=3, num_pages=2, page_size=4)
    assert pools.linear_layers == caches[:2] and pools.attention_layers == caches[2:]


def test_state_pool_is_k_last_and_the_torch_path_reads_and_writes_it():
    """state_pool: a zeroed [slots, H, K, V] view of K-last memory; slot copies keep the layout,
    and a decode step over it through the torch path equals the same step over a contiguous pool."""
    from hyla.ops.recurrent import fused_recurrent_kda

    pool = state_pool(5, 2, 3, 4, torch.float32, "cpu")
    assert pool.shape == (5, 2, 3, 4) and pool.stride() == (24, 12, 1, 3) and not pool.any()
    gen = torch.Generator().manual_seed(0)
    pool.copy_(torch.randn(5, 2, 3, 4, generator=gen))
    caches = HybridCache([KDALayerCache(pool, (torch.zeros(5, 6, 3),) * 3)], num_slots=5, num_pages=0, page_size=4)
    caches.copy_slot(1, 4)
    assert torch.equal(pool[4], pool[1]) and pool.stride() == (24, 12, 1, 3)
    contiguous = pool.contiguous()
    q, k, v = (torch.randn(3, 1, 2, n, generator=gen) for n in (3, 3, 4))
    g = -torch.rand(3, 1, 2, 3, generator=gen)
    beta = torch.rand(3, 1, 2, generator=gen)
    idx = torch.tensor([4, 0, 2])
    o, _ = fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx)
    o_ref, _ = fused_recurrent_kda(q, k, v, g, beta, initial_state=contiguous, ssm_state_indices=idx)
    assert torch.equal(o, o_ref) and torch.equal(pool, contiguous) and pool.stride() == (24, 12, 1, 3)
