"""Int8 checkpoints (hyla.engine.checkpoint_codec) and the tier copies (hyla.engine.cache_tiers)
on a tiny model's real pools: the per-row bound, exact round trips of host copies."""

import pytest
import torch

from hyla.contract.cache import state_pool
from hyla.engine.cache_tiers import CacheTiers, TierSizes, int8_entry_bytes
from hyla.engine.checkpoint_codec import dequantize_rows, quantize_rows, restore_error_bound, rows_of
from hyla.models.presets import random_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_int8_rows_restore_within_the_per_row_bound(dtype):
    g = torch.Generator().manual_seed(3)
    H, K, V = 3, 37, 19  # awkward sizes
    state = state_pool(2, H, K, V, dtype, "cpu")
    scales = torch.logspace(-4, 2, V, dtype=torch.float64)  # columns of very different magnitudes
    state[0].copy_(torch.randn(H, K, V, generator=g, dtype=torch.float64) * scales)
    state[0, 1, :, 4] = 0  # a zero row
    q, s = quantize_rows(rows_of(state[0]))
    assert q.dtype == torch.int8 and s.shape == (H, V) and int(q.abs().max()) <= 127
    dequantize_rows(q, s, rows_of(state[1]))
    err = (state[1].double() - state[0].double()).abs().amax(dim=-2)  # per row [H, V]
    bound = restore_error_bound(state[0]).double()
    # rounding to the nearest multiple of the scale (half a scale), plus the running dtype's own
    # rounding of the restored value (bf16: 2^-9 relative)
    slack = {torch.float32: 1e-6, torch.bfloat16: 2.0**-8, torch.float64: 1e-12}[dtype]
    amax = rows_of(state[0]).double().abs().amax(-1)
    assert bool((err <= bound * (1 + 1e-6) + slack * amax).all())
    assert bool((state[1, 1, :, 4] == 0).all())


def _tiny_cache(num_slots=4, num_pages=6, kv_cache_dtype="auto"):
    model = random_model("tiny", layers=4)
    model.kv_cache_dtype = kv_cache_dtype
    cache = model.allocate_cache(num_slots, num_pages, page_size=4, state_dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    for layer in cache.layers:
        for t in layer.tensors():
            t.copy_(torch.randn(t.shape, generator=g))
    return cache


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_host_copies_of_pages_and_checkpoints_are_bit_exact(kv_cache_dtype):
    cache = _tiny_cache(kv_cache_dtype=kv_cache_dtype)  # fp8: e4m3 pages with their fp32 scales
    tiers = CacheTiers(cache, TierSizes(host_pages=2, host_checkpoints=2))
    slot2 = [t[2].clone() for layer in cache.linear_layers for t in layer.tensors()]
    page3 = [t[3].clone() for layer in cache.attention_layers for t in layer.tensors()]
    tiers.apply([("ckpt_out", "slot", 2, 1), ("page_out", 3, 0), ("ckpt_in", 1, 0), ("page_in", 0, 5)])
    assert all(torch.equal(t[0], ref) for t, ref in zip((t for layer in cache.linear_layers for t in layer.tensors()),
                                                         slot2))
    assert all(torch.equal(_bits(t[5]), _bits(ref)) for t, ref in zip((t for layer in cache.attention_layers
                                                                        for t in layer.tensors()), page3))
    if kv_cache_dtype == "fp8":
        assert {t.dtype for layer in cache.attention_layers for t in layer.tensors()} == {torch.float8_e4m3fn,
                                                                                          torch.float32}
    moved = sum(r.numel() * r.element_size() for r in slot2 + page3)
    assert tiers.stats["bytes_to_host"] == moved and tiers.stats["bytes_from_host"] == moved


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_page_transfers_move_as_batches_bit_exact(kv_cache_dtype, monkeypatch):
    """Consecutive page transfers of one direction are one batch (a gather, a copy per run of
    consecutive host pages, a scatter): scattered device pages, host pages in runs and alone, a
    host page written twice in one batch (the later write wins), every byte where it belongs."""
    from hyla.engine import cache_tiers

    cache = _tiny_cache(num_pages=12, kv_cache_dtype=kv_cache_dtype)
    tiers = CacheTiers(cache, TierSizes(host_pages=8))
    page_tensors = [t for layer in cache.attention_layers for t in layer.tensors()]
    before = [t.clone() for t in page_tensors]
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, **kw: copies.append(1) or real_copy(self, src, **kw))
    out = [(9, 4), (2, 5), (7, 6), (11, 0), (3, 2), (5, 2)]  # host 4-6 a run, 0 and 2 alone; host 2: page 5 wins
    tiers.apply([("page_out", p, h) for p, h in out])
    assert len(copies) == 3 * len(page_tensors)  # three runs of host pages, per attention tensor
    copies.clear()
    back = [(4, 1), (5, 10), (6, 0), (0, 8), (2, 4)]  # into other device pages
    tiers.apply([("page_in", h, p) for h, p in back])
    assert len(copies) == 3 * len(page_tensors)
    source = {h: p for p, h in out}  # host page -> the device page whose bytes it holds
    for t, ref in zip(page_tensors, before):
        for h, p in back:
            assert torch.equal(_bits(t[p]), _bits(ref[source[h]]))
        untouched = [i for i in range(12) if i not in {p for _, p in back}]
        assert torch.equal(_bits(t[untouched]), _bits(ref[untouched]))
    assert cache_tiers._runs([0, 1, 2, 5, 7, 8]) == [(0, 3), (3, 4), (4, 6)] and cache_tiers._runs([]) == []


def test_int8_pack_unpack_and_through_the_host():
    cache = _tiny_cache()
    tiers = CacheTiers(cache, TierSizes(int8_entries=2, host_checkpoints=2))
    before = [t[1].clone() for layer in cache.linear_layers for t in layer.tensors()]
    tiers.apply([("pack", 1, 0), ("ckpt_out", "int8", 0, 0), ("ckpt_in", 0, 2), ("unpack", 0, 3),
                 ("ckpt_out", "slot", 1, 1), ("ckpt_in", 1, 0)])
    for slot in (0, 2, 3):  # a slot packed on its way to the host, an int8 entry through the host, the entry
        for layer, (state_ref, *conv_ref) in zip(cache.linear_layers, _split(cache, before)):
            state, *conv = layer.tensors()
            assert bool(((state[slot] - state_ref).abs() <= restore_error_bound(state_ref).unsqueeze(-2) + 1e-6).all())
            assert all(torch.equal(c[slot], r) for c, r in zip(conv, conv_ref))  # conv windows stay exact
    expected = sum(layer.state[0].numel() * (1 + 4 / layer.state.shape[-2])
                   + sum(c[0].numel() * c.element_size() for c in layer.conv) for layer in cache.linear_layers)
    assert int8_entry_bytes(cache) == expected


def test_int8_checkpoints_of_the_48b_shape_take_under_a_third_of_a_slot():
    from hyla.models.kimi_linear import kda_mla_pools
    from hyla.models.presets import model_config

    from hyla.models.memory import state_bytes_per_slot

    config = model_config("kimi-linear-48b-a3b")
    cache = kda_mla_pools(config, 1, 1, 16, torch.float32, "meta", torch.bfloat16)
    ratio = int8_entry_bytes(cache) / state_bytes_per_slot(config, torch.float32, torch.bfloat16)
    assert 0.27 < ratio < 0.29  # 1/4 + 4/128 of the fp32 state, the bf16 conv windows as they are


def _split(cache, flat):
    out, i = [], 0
    for layer in cache.linear_layers:
        n = len(layer.tensors())
        out.append(flat[i:i + n])
        i += n
    return out


def test_a_plan_needing_tiers_fails_clearly_without_them():
    from hyla.engine.cache_tiers import plain_transfers

    with pytest.raises(ValueError, match="tiers"):
        plain_transfers(_tiny_cache(), [("page_out", 0, 0)])
