"""Random paged-KV block tables for the paged attention op tests (MLA and gated attention)."""

from __future__ import annotations

import torch


def random_block_tables(lens: list[int], ps: int, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """Block tables [S, width] for sequences of lens[s] tokens in pages of ps: pages drawn
    without replacement from a pool of num_pages (two spare), each row padded with -1 (at least
    one padding column) -> (tables int64, num_pages)."""
    width = max(-(-n // ps) for n in lens) + 1
    num_pages = sum(-(-n // ps) for n in lens) + 2
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = torch.full((len(lens), width), -1, dtype=torch.long)
    for s, n in enumerate(lens):
        for j in range(-(-n // ps)):
            tables[s, j] = perm.pop()
    return tables, num_pages
