"""Host time to stage one decode step's graph inputs (hyla.engine.cuda_graph._MetaStage: token,
context, slot and page columns per row) against rebuilding every row's page list each step, at
long contexts: `OMP_NUM_THREADS=1 python scripts/decode_meta_host.py`."""

from __future__ import annotations

import time

import torch

from hyla.engine.block_table import BlockTable
from hyla.engine.cuda_graph import _decode_pad_row, _MetaStage, width_bucket
from hyla.ops.transfer import fill_long

PAGE = 16


def rebuilt(tokens, ctx, slots, tables, bs, width, dst) -> None:
    rows = [[t, c, s] + list(table[:width]) + [-1] * (width - len(table))
            for t, c, s, table in zip(tokens, ctx, slots, tables)]
    fill_long(dst[:bs], rows + [_decode_pad_row(width)] * (bs - len(rows)))


def main() -> None:
    print("batch | context | page width | rebuilt ms | staged ms (steady decode)")
    for n, ctx in [(1, 4096), (1, 131072), (1, 1048576), (16, 131072), (64, 8192), (256, 1280)]:
        pages = -(-(ctx + 1) // PAGE)
        width = width_bucket(pages)
        tables = [BlockTable(range(i * pages, (i + 1) * pages)) for i in range(n)]
        dst = torch.empty(n, 3 + width, dtype=torch.long)
        args = ([1] * n, [ctx] * n, list(range(n)), tables, n)
        start = time.perf_counter()
        for _ in range(5):
            rebuilt(*args[:4], n, width, dst)
        t_rebuilt = (time.perf_counter() - start) / 5
        stages = [_MetaStage(n, width, pinned=False) for _ in range(2)]
        for s in stages:
            s.fill(*args)
        start = time.perf_counter()
        for i in range(20):
            dst.copy_(stages[i % 2].fill(*args))
        t_staged = (time.perf_counter() - start) / 20
        print(f"{n} | {ctx} | {width} | {t_rebuilt * 1e3:.2f} | {t_staged * 1e3:.3f}")


if __name__ == "__main__":
    main()
