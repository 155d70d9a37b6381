"""hyla.contract: the bottom of the stack, and the replay-inputs hooks of the layer caches."""

import subprocess
import sys

import pytest
import torch

from hyla.contract import GDNLayerCache, HybridCache, KDALayerCache, KVLayerCache, LayerCache, MLALayerCache


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
