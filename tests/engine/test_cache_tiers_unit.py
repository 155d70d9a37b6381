"""PrefixCache's storage tiers without a model: what moves to the host tier on eviction, what a
hit reaching host entries plans, promotion on insert, int8 checkpoints, host LRU and locks."""

from hyla.engine.cache_tiers import TierSizes
from hyla.engine.pools import Pools
from hyla.engine.prefix_cache import HOST, INT8, PrefixCache
from tests.engine.test_prefix_cache_unit import P, finished, seq



def setup(num_pages=32, num_slots=16, **tiers):
    pools = Pools(num_pages, num_slots, P)
    return pools, PrefixCache(pools, None, TierSizes(**tiers))


def admit(pools, cache, s):
    """What the scheduler does for a waiting request: match, own slot and pages, restore."""
    hit = cache.match(s)
    s.slot = pools.slots.allocate()
    pools.allocate(s, s.num_uncomputed)
    return hit, cache.restore(s, hit)


def path_nodes(cache, tokens):
    node, out = cache.root, []
    for i in range(0, len(tokens), P):
        node = next(c for c in node.children[tokens[i]] if c.tokens == tuple(tokens[i:i + P]))
        out.append(node)
    return out


def test_evicted_pages_and_their_checkpoints_go_to_the_host_and_keep_their_nodes():
    pools, cache = setup(host_pages=8, host_checkpoints=4)
    finished(pools, cache, range(10))
    cache.take_transfers()
    nodes = path_nodes(cache, list(range(10)))
    device_pages = [n.page for n in nodes]
    assert cache.evict_pages(3)  # the leaf first, then its parent, then the root's child
    assert all(n.alive and n.page is None for n in nodes)
    plan = cache.take_transfers()
    assert [op for op, *_ in plan] == ["page_out", "ckpt_out", "page_out", "page_out"]
    assert plan[0] == ("page_out", device_pages[2], nodes[2].host_page)
    assert nodes[2].checkpoints[2][0] == HOST and plan[1][1] == "slot" and plan[1][3] == nodes[2].checkpoints[2][1]
    assert pools.pages.num_free == 32 and pools.slots.num_free == 16  # everything device-side given back
    usage = cache.usage()
    assert usage["cached_pages"] == 0 and usage["host_cached_pages"] == 3 and usage["host_cached_checkpoints"] == 1


def test_a_hit_on_host_entries_loads_them_into_the_requests_own_pages_and_slot():
    pools, cache = setup(host_pages=8, host_checkpoints=4)
    finished(pools, cache, range(10))
    cache.evict_pages(2)  # pages 1 and 2 (tokens 4..9) to the host; page 0 stays
    cache.take_transfers()
    nodes = path_nodes(cache, list(range(10)))
    assert nodes[0].page is not None and nodes[1].page is None and nodes[2].page is None
    s = seq(list(range(10)) + [99])
    hit, served = admit(pools, cache, s)
    assert served == 10 and hit.host_nodes == [(1, nodes[1])]
    assert s.block_table[0] == nodes[0].page and pools.pages.refs[nodes[0].page] == 2  # shared from the device
    assert cache.take_transfers() == [("page_in", nodes[1].host_page, s.block_table[1]),
                                      ("page_in", nodes[2].host_page, s.block_table[2]),  # the partial page
                                      ("ckpt_in", nodes[2].checkpoints[2][1], s.slot)]
    assert all(n.locks == 0 for n in nodes)
    usage = cache.usage()
    assert usage["hits_host"] == 1 and usage["hit_tokens_host"] == 10 and usage["hits_device"] == 0


def test_insert_promotes_host_nodes_the_request_holds_on_the_device():
    pools, cache = setup(host_pages=8, host_checkpoints=4)
    finished(pools, cache, range(10))
    cache.evict_pages(2)
    s = seq(list(range(10)) + [99])
    admit(pools, cache, s)
    nodes = path_nodes(cache, list(range(10)))
    host_free = cache.host_pages.num_free
    s.num_computed_tokens = 11
    cache.insert(s, 11, None)
    assert nodes[1].page == s.block_table[1] and nodes[1].host_page is None  # a full page: back on the device
    assert nodes[2].page is None  # tokens 8..9 vs the request's 8..10: a new sibling holds them
    assert cache.host_pages.num_free == host_free + 1


def test_host_tier_drops_its_least_recently_used_leaf_when_full():
    pools, cache = setup(host_pages=2, host_checkpoints=2)
    finished(pools, cache, [1, 1, 1, 1, 5, 5], "a")
    finished(pools, cache, [2, 2, 2, 2, 6, 6], "b")
    assert cache.evict_pages(2)  # both leaves (tokens 4..5 of a, then of b) to the host: it is full
    cache.take_transfers()
    assert cache.evict_pages(1)  # a's first page: the host drops a's leaf (least recent) to take it
    a0 = cache.root.children[1][0]
    assert a0.page is None and not a0.children and cache.stats["host_pages_evicted"] == 1
    assert cache.usage()["host_cached_pages"] == 2
    assert cache.match(seq([1, 1, 1, 1, 5, 5, 7])) is None  # a's state went with its leaf


def test_host_nodes_of_a_pending_hit_are_not_dropped_before_its_restore():
    pools, cache = setup(num_pages=6, host_pages=2, host_checkpoints=2)
    finished(pools, cache, [1, 1, 1, 1, 5, 5], "a")
    cache.evict_pages(2)  # both of a's pages on the host, which is now full
    s = seq([1, 1, 1, 1, 5, 5, 7])
    hit = cache.match(s)
    assert hit is not None and [n.locks for _, n in hit.host_nodes] == [1]
    finished(pools, cache, [3, 3, 3, 3], "c")
    c = cache.root.children[3][0]
    assert cache.evict_pages(1)  # the host is full of locked nodes: c's page is dropped, not moved
    assert not c.alive and cache.stats["host_pages_evicted"] == 0
    assert hit.node.alive and all(n.alive for _, n in hit.host_nodes)
    cache.unmatch(s, hit)
    assert hit.node.locks == 0


def test_without_host_room_an_evicted_device_leaf_goes_with_its_host_children():
    pools, cache = setup(host_pages=1, host_checkpoints=1)
    finished(pools, cache, range(8))
    assert cache.evict_pages(1)  # the leaf to the host (now full)
    cache.host_pages._free.clear()  # nothing can be freed on the host: the next eviction drops
    cache._host_leaves._heap.clear()
    assert cache.evict_pages(1)
    assert not cache.root.children and cache.num_pages == 0


def test_a_checkpoint_leaving_its_slot_is_packed_into_int8_and_restored_from_there():
    pools, cache = setup(num_slots=4, int8_entries=2)
    a = finished(pools, cache, range(6), "a")
    leaf = path_nodes(cache, list(range(6)))[1]
    assert leaf.checkpoints == {2: ("slot", a.slot)} and cache.take_transfers() == []  # filed in its slot
    assert cache.evict_slot()  # a slot is needed: the checkpoint moves to an int8 entry
    ((op, slot, entry),) = cache.take_transfers()
    assert (op, slot) == ("pack", a.slot) and leaf.checkpoints == {2: (INT8, entry)}
    assert pools.slots.num_free == 4 and not cache.evict_slot()  # no checkpoint holds a slot now
    s = seq(list(range(6)) + [9])
    admit(pools, cache, s)
    assert cache.take_transfers()[-1] == ("unpack", entry, s.slot)


def test_int8_entries_full_move_their_lowest_key_to_the_host_or_drop_it():
    pools, cache = setup(num_slots=4, int8_entries=1, host_pages=4, host_checkpoints=1)
    finished(pools, cache, [1, 1, 1, 1, 1], "a")
    assert cache.evict_slot()  # a's checkpoint: slot -> int8
    finished(pools, cache, [2, 2, 2, 2, 2, 2], "b")
    assert cache.evict_slot()  # b's: slot -> int8, whose entry a's leaves for the host first
    plan = cache.take_transfers()
    assert [op for op, *_ in plan] == ["pack", "ckpt_out", "pack"]
    assert plan[1][1:3] == ("int8", plan[0][2]) and plan[2][2] == plan[0][2]  # read out before it is reused
    finished(pools, cache, [3, 3, 3, 3, 3, 3, 3], "c")
    assert cache.evict_slot()  # c's to int8, b's to the host, which drops a's (least recent)
    assert cache.stats["host_checkpoints_evicted"] == 1 and cache.num_checkpoints == 2
    nodes = [c for n in cache.root.child_nodes() for c in [n, *n.child_nodes()]]
    tiers = sorted(t for c in nodes for t, _ in c.checkpoints.values())
    assert tiers == [HOST, INT8]


def test_slot_checkpoints_evicted_for_slots_go_to_the_host():
    pools, cache = setup(num_slots=2, host_pages=4, host_checkpoints=2)
    finished(pools, cache, range(6), "a")
    assert pools.slots.num_free == 1 and cache.evict_slot()
    assert pools.slots.num_free == 2
    (op, tier, slot, host), = cache.take_transfers()
    assert op == "ckpt_out" and tier == "slot"
    s = seq(list(range(6)) + [1])
    admit(pools, cache, s)
    assert cache.take_transfers()[-1] == ("ckpt_in", host, s.slot)
