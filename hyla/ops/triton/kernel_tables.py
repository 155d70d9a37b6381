"""Tuned block configurations of hyla's Triton kernels, per device and shape: the fused MoE's and
the block-FP8 GEMM's.

`hyla bench moe --sweep --write-configs DIR` times the fused-MoE kernels on the device and writes
one JSON file per expert shape (the scheme vLLM uses for its fused-MoE kernel), named

    E=<experts>,N=<intermediate>,H=<hidden>,device=<device name, spaces as _>.json

mapping token counts to a configuration: the keys of `_config` in hyla.ops.triton.fused_moe
(BM, BN, BK, GM, num_warps, num_stages) plus an optional "down" dict whose keys override them
for the second GEMM (BM is shared: both GEMMs read the same expert-aligned blocks); the FP8
kernel's tables (",dtype=fp8_w8a8") may also set KSPLIT, its gate/up GEMM's split-K
(hyla.ops.triton.fused_moe_fp8). The files shipped with hyla live in
hyla/assets/kernel_configs/fused_moe/.

`hyla bench fp8-gemm --write-configs DIR` does the same for the block-FP8 GEMM of the dense
projections (hyla.ops.triton.fp8_gemm), one file per weight shape [N, K] (vLLM's
w8a8_block_fp8_matmul tables are kept the same way):

    N=<out features>,K=<in features>,device=<device name>,dtype=fp8_w8a8,block_shape=[128,128].json

mapping row counts to BM, BN, GM, num_warps, num_stages (BK is the 128 block). Shipped in
hyla/assets/kernel_configs/fp8_gemm/.

A table entry is used for M tokens (rows) when its key is within a factor of two of M; otherwise
the built-in heuristic decides, so a table tuned at prefill sizes never picks the blocks of a
decode step.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parents[2] / "assets" / "kernel_configs" / "fused_moe"
GEMM_CONFIG_DIR = CONFIG_DIR.parent / "fp8_gemm"


def config_file_name(num_experts: int, intermediate: int, hidden: int, device_name: str,
                     dtype: str | None = None) -> str:
    """dtype: None for the bf16 kernels, "fp8_w8a8" for the block-FP8 ones (",dtype=..." before
    ".json", vLLM's naming)."""
    tag = f",dtype={dtype}" if dtype else ""
    return f"E={num_experts},N={intermediate},H={hidden},device={device_name.replace(' ', '_')}{tag}.json"


@functools.cache
def _device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


@functools.cache
def _table(num_experts: int, intermediate: int, hidden: int, device_name: str, directory: Path,
           dtype: str | None) -> dict[int, dict]:
    """The table of one shape on one device kind, read once (every MoE layer call asks)."""
    return _load(directory / config_file_name(num_experts, intermediate, hidden, device_name, dtype))


def _load(path: Path) -> dict[int, dict]:
    if not path.is_file():
        return {}
    return {int(m): cfg for m, cfg in json.loads(path.read_text()).items()}


def tuned_config(tokens: int, num_experts: int, intermediate: int, hidden: int,
                 device: torch.device, directory: Path = CONFIG_DIR, dtype: str | None = None) -> dict | None:
    """The tuned configuration for `tokens` rows on `device` (a copy), or None; dtype: which
    kernels' tables (see config_file_name)."""
    if device.type != "cuda" or tokens <= 0:
        return None
    table = _table(num_experts, intermediate, hidden, _device_name(device.index), directory, dtype)
    cfg = _nearest(table, tokens)
    if cfg is not None and "down" in cfg:
        cfg["down"] = dict(cfg["down"])
    return cfg


def _nearest(table: dict[int, dict], tokens: int) -> dict | None:
    """A copy of the entry whose key is nearest `tokens` (log scale), if within a factor of two."""
    if not table:
        return None
    key = min(table, key=lambda m: abs(math.log(m / tokens)))
    if not key / 2 <= tokens <= key * 2:
        return None
    return dict(table[key])


def gemm_file_name(n: int, k: int, device_name: str) -> str:
    """The block-FP8 GEMM table of weight shape [n, k] on a device kind (module docstring)."""
    return f"N={n},K={k},device={device_name.replace(' ', '_')},dtype=fp8_w8a8,block_shape=[128,128].json"


@functools.cache
def _gemm_table(n: int, k: int, device_name: str, directory: Path) -> dict[int, dict]:
    return _load(directory / gemm_file_name(n, k, device_name))


def tuned_gemm_config(rows: int, n: int, k: int, device: torch.device,
                      directory: Path = GEMM_CONFIG_DIR) -> dict | None:
    """The block-FP8 GEMM's tuned configuration for `rows` activation rows times a [n, k] weight
    on `device` (a copy), or None."""
    if device.type != "cuda" or rows <= 0:
        return None
    return _nearest(_gemm_table(n, k, _device_name(device.index), directory), rows)


def write_configs(path: Path, table: dict[int, dict]) -> None:
    """Merge `table` (tokens -> configuration) into the JSON file at `path`."""
    old = {int(k): v for k, v in json.loads(path.read_text()).items()} if path.is_file() else {}
    old.update(table)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({str(k): old[k] for k in sorted(old)}, indent=2) + "\n")
    _table.cache_clear()
    _gemm_table.cache_clear()
