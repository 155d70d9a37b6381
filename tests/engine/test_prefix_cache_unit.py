"""PrefixCache without a model: match / the CacheHit handle, eviction order, the lock contract,
and the restore copies it plans (it touches no tensor)."""

from hyla.engine.eviction import LazyHeap, checkpoint_key
from hyla.engine.pools import Pools
from hyla.engine.prefix_cache import CacheHit, PrefixCache
from hyla.engine.sampling_params import SamplingParams
from hyla.engine.sequence import Sequence

P = 4  # page size


def seq(tokens, rid="r"):
    return Sequence(rid, None, list(tokens), SamplingParams(max_tokens=4), 4, None)


def setup(num_pages=32, num_slots=16, interval=None):
    memory = Pools(num_pages, num_slots, P)
    return memory, PrefixCache(memory, interval)


def finished(memory, cache, tokens, rid="done"):
    """A request that ran `tokens` and finished: its pages and final state go to the tree."""
    s = seq(tokens, rid)
    s.slot = memory.slots.allocate()
    s.block_table = memory.pages.allocate(-(-len(tokens) // P))
    s.num_computed_tokens = len(tokens)
    cache.insert(s, len(tokens), s.slot)
    memory.pages.release(s.block_table)  # the request is gone: only the tree holds its pages
    return s


def test_match_returns_a_handle_with_the_longest_hit_and_shares_the_full_pages():
    memory, cache = setup()
    finished(memory, cache, range(10))  # checkpoint at 10 = page 2 (depth 2), r = 2
    s = seq(list(range(10)) + [99, 98])
    hit = cache.match(s)
    assert isinstance(hit, CacheHit) and hit.num_tokens == 10 and hit.r == 2 and hit.node.locks == 1
    assert s.num_computed_tokens == 10 and len(s.block_table) == 2  # the two full pages, shared
    assert all(memory.pages.refs[p] == 2 for p in s.block_table)
    s.slot = memory.slots.allocate()
    memory.allocate(s, s.num_uncomputed)
    served = cache.restore(s, hit)
    assert served == 10 and hit.node.locks == 0
    assert hit.node.checkpoints[2][0] == "slot"
    assert cache.take_transfers() == [("copy_rows", hit.node.page, s.block_table[2], 2),  # copy-on-write
                                      ("copy_slot", hit.node.checkpoints[2][1], s.slot)]
    assert cache.take_transfers() == []


def test_no_hit_without_a_checkpoint_and_hit_capped_below_the_prompt_length():
    memory, cache = setup()
    finished(memory, cache, range(8))
    assert cache.match(seq([50, 51, 52])) is None
    s = seq(range(8))  # the same tokens: the last one must run, and there is no state at 7
    assert cache.match(s) is None and s.num_computed_tokens == 0
    assert s.pending_checkpoints == [7]  # prompt end - 1 is planned, so a retry hits next time


def test_unmatch_unlocks_and_gives_back_the_shared_pages():
    memory, cache = setup()
    finished(memory, cache, range(9))
    free = memory.pages.num_free
    s = seq(list(range(9)) + [77])
    hit = cache.match(s)
    assert hit is not None and memory.pages.num_free == free
    cache.unmatch(s, hit)
    assert hit.node.locks == 0 and s.block_table == [] and s.num_computed_tokens == 0
    assert all(memory.pages.refs[n.page] == 1 for bucket in cache.root.children.values() for n in bucket)


def test_locked_checkpoint_and_page_survive_eviction():
    memory, cache = setup()
    finished(memory, cache, range(6))
    s = seq(list(range(6)) + [1])
    hit = cache.match(s)
    assert not cache.evict_slot()  # the only checkpoint is locked
    assert not cache.evict_pages(5)  # its node is locked, its parent has a child
    s.slot = memory.slots.allocate()
    memory.allocate(s, s.num_uncomputed)
    cache.restore(s, hit)  # unlocks
    assert cache.evict_slot() and cache.usage()["cached_checkpoints"] == 0


def test_pages_go_least_recently_used_leaf_first_and_parents_follow():
    memory, cache = setup()
    finished(memory, cache, [1] * 8, "a")  # two pages: [1]*4 -> [1]*4
    finished(memory, cache, [2] * 4, "b")  # one page
    s = seq([1] * 8 + [3])
    cache.unmatch(s, cache.match(s))  # touches a's path: b's page is now the oldest leaf
    cache.evict_pages(1)
    assert 2 not in cache.root.children and cache.usage()["cached_pages"] == 2
    cache.evict_pages(1)  # a's leaf, then its parent (a leaf now)
    cache.evict_pages(1)
    assert cache.root.children == {} and memory.pages.num_free == memory.pages.num_pages
    assert memory.slots.num_free == memory.slots.num_slots  # checkpoints went with their pages


def test_pages_a_running_request_references_are_kept():
    memory, cache = setup()
    s = seq([5] * 4)
    s.slot, s.block_table, s.num_computed_tokens = memory.slots.allocate(), memory.pages.allocate(1), 4
    cache.insert(s, 4, None)  # still running: the page has 2 references
    assert not cache.evict_pages(1)
    memory.pages.release(s.block_table)
    assert cache.evict_pages(1)


def test_checkpoints_go_lowest_key_first():
    memory, cache = setup()
    finished(memory, cache, [1] * 3, "short")  # position 3
    finished(memory, cache, [2] * 12, "long")  # position 12, newer
    cache.evict_slot()
    assert [r for n in cache.root.children[2] for r in n.checkpoints] == []  # a page-level node: no state here
    # keys: inflation 0 + position; the short one (3) went first, the long one stays
    assert cache.usage()["cached_checkpoints"] == 1
    leaf = cache.root.children[2][0].children[2][0].children[2][0]
    assert list(leaf.checkpoints) == [4]
    assert cache.inflation == checkpoint_key(0.0, 3)
    # a checkpoint filed after an eviction starts above the inflation: recency still counts
    finished(memory, cache, [3] * 2, "newer")  # key = 3 + 2 = 5 < 12: it goes next
    cache.evict_slot()
    assert 3 in cache.root.children and not cache.root.children[3][0].checkpoints
    assert list(leaf.checkpoints) == [4]


def test_children_are_keyed_by_their_first_token():
    memory, cache = setup()
    finished(memory, cache, [1, 2, 3, 4, 5], "a")
    finished(memory, cache, [1, 2, 9, 9, 5], "b")  # shares the first two tokens of a's first page
    finished(memory, cache, [7, 7, 7, 7], "c")
    assert sorted(cache.root.children) == [1, 7] and len(cache.root.children[1]) == 2
    s = seq([1, 2, 9, 9, 5, 6])
    hit = cache.match(s)
    assert hit.num_tokens == 5


def test_lazy_heap_drops_stale_entries_and_stays_small():
    live = {}
    heap = LazyHeap(lambda key, item: live.get(item) == key)
    for i in range(5000):
        live[i % 10] = i
        heap.push(i, i % 10)
    assert len(heap) < 2100  # rebuilt from the valid entries as stale ones pile up
    assert heap.pop() == (4990, 0) and heap.peek() == (4991, 1)


def salted(tokens, salt, rid="r"):
    return Sequence(rid, None, list(tokens), SamplingParams(max_tokens=4, cache_salt=salt), 4, None)


def test_a_salt_hits_only_what_its_own_requests_filed_and_its_tree_goes_with_its_last_node():
    memory, cache = setup(num_pages=8)
    s = salted(range(10), "tenant-a", "filed")
    s.slot = memory.slots.allocate()
    s.block_table = memory.pages.allocate(3)
    cache.insert(s, 10, s.slot)
    memory.pages.release(s.block_table)
    prompt = list(range(10)) + [99]
    assert cache.match(seq(prompt)) is None  # unsalted: another tree
    other = salted(prompt, "tenant-b")
    assert cache.match(other) is None and other.num_computed_tokens == 0
    assert "tenant-b" not in cache._salted  # a lookup plants no tree
    same = salted(prompt, "tenant-a")
    hit = cache.match(same)
    assert hit is not None and hit.num_tokens == 10
    cache.unmatch(same, hit)
    assert cache.evict_pages(8) and cache.num_pages == 0
    assert cache._salted == {} and cache._salt_of == {}  # nothing left of the salt's tree
    assert memory.pages.num_free == 8
