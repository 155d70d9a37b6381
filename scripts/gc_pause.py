"""A full garbage collection's pause in a server process: the objects an engine's startup makes
(the bundled model, torch, the server's modules), then a prefix-cache tree of --tree-tokens tokens
filed after them, timed before and after gc.freeze() (what `hyla serve` does once started).

    python scripts/gc_pause.py [--tree-tokens 1000000]
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from hyla import LLM
from hyla.engine.pools import Pools
from hyla.engine.prefix_cache import PrefixCache
from hyla.models.default import default_model_path
from hyla.server import create_app
from prefix_cache_host import file_request  # scripts/, on the path when run as a script


def full_collection_ms(repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        began = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - began)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree-tokens", type=int, default=1_000_000, help="tokens filed in a prefix cache after startup")
    args = p.parse_args()
    llm = LLM(default_model_path())
    create_app(llm.engine, "default")
    print(f"startup: {len(gc.get_objects())} tracked objects, full collection {full_collection_ms():.1f} ms")
    cache = file_tree(args.tree_tokens)
    print(f"+ a tree of {cache.num_pages} pages: {len(gc.get_objects())} tracked objects, "
          f"full collection {full_collection_ms():.1f} ms")
    del cache
    gc.collect()
    gc.freeze()  # startup's objects, as `hyla serve` does before it serves; the tree comes after
    cache = file_tree(args.tree_tokens)
    print(f"startup frozen, the same tree after it: full collection {full_collection_ms():.1f} ms")


def file_tree(num_tokens: int, page: int = 16) -> PrefixCache:
    """A prefix cache holding num_tokens tokens' pages: requests of 50K tokens, nothing shared."""
    pools = Pools(num_tokens // page + 64, 8, page)
    cache = PrefixCache(pools)
    rng = random.Random(0)
    for i in range(0, num_tokens, 50_000):
        tokens = [rng.randrange(1, 150_000) for _ in range(min(50_000, num_tokens - i))]
        file_request(pools, cache, tokens, str(i), checkpoint=False)
    return cache

if __name__ == "__main__":
    main()
