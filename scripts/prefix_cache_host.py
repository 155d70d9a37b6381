"""Host time of the prefix cache's tree work for one long request, on the engine thread: filing a
new prompt's pages (insert), filing them again with a turn's new tokens, and matching the next
turn (match + unmatch), without a model.

    python scripts/prefix_cache_host.py [--tokens 60000] [--page-size 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import random
import time

from hyla.engine.pools import Pools
from hyla.engine.prefix_cache import PrefixCache
from hyla.engine.sampling_params import SamplingParams
from hyla.engine.sequence import Sequence


def _seq(tokens: list[int], rid: str) -> Sequence:
    return Sequence(rid, None, list(tokens), SamplingParams(max_tokens=4), 4, None)


def file_request(pools: Pools, cache: PrefixCache, tokens: list[int], rid: str, checkpoint: bool = True) -> float:
    """Seconds of insert() for a finished request that ran `tokens` (with its final state's slot
    filed as a checkpoint, or only its pages). scripts/gc_pause.py files its trees with it too."""
    s = _seq(tokens, rid)
    s.slot = pools.slots.allocate() if checkpoint else None
    s.block_table = pools.pages.allocate(-(-len(tokens) // pools.page_size))
    s.num_computed_tokens = len(tokens)
    began = time.perf_counter()
    cache.insert(s, len(tokens), s.slot)
    seconds = time.perf_counter() - began
    pools.pages.release(s.block_table)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=60000)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(1, 150_000) for _ in range(args.tokens)]
    pages = 3 * (args.tokens // args.page_size) + 64
    rows = {"insert, new": [], "insert, again + 500": [], "match + 500": []}
    warm = Pools(pages, 8, args.page_size)  # the process's first tree takes longer (allocation, the collector)
    file_request(warm, PrefixCache(warm), tokens, "warm")
    for _ in range(args.repeat):
        pools = Pools(pages, 8, args.page_size)
        cache = PrefixCache(pools)
        rows["insert, new"].append(file_request(pools, cache, tokens, "first"))
        rows["insert, again + 500"].append(file_request(pools, cache, tokens + [7] * 500, "second"))
        s = _seq(tokens + [5] * 500, "next")
        began = time.perf_counter()
        hit = cache.match(s)
        rows["match + 500"].append(time.perf_counter() - began)
        cache.unmatch(s, hit)
    print(f"{args.tokens} tokens, pages of {args.page_size}: ms per call, best of {args.repeat}")
    for name, seconds in rows.items():
        print(f"  {name:22s} {min(seconds) * 1e3:8.2f}")


if __name__ == "__main__":
    main()
