"""Causal attention of a sequence's new tokens over its cached prefix and themselves: the one
call the prefill paths of hyla.layers.mla and hyla.layers.attention make for each sequence of a
chunked prefill."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyla.layers.masks import causal_after_prefix

# The most score memory one CPU call may build (see attend_after_prefix).
CPU_SCORE_BYTES = 256 << 20


def attend_after_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, T, D]: the last T of L positions; k [B, H, L, D], v [B, H, L, Dv] -> [B, H, T, Dv],
    query i attending keys 0 .. L - T + i.

    Without a prefix (T = L): one plain causal call. With one: the lower-right aligned causal
    bias, which CUDA's kernels apply without building a mask. torch's CPU kernels build that
    bias's [T, L] mask and every head's [T, L] scores (17 GB for 8192 new tokens over a
    131,072-token context at 4 heads), so there the query rows go in blocks whose scores stay
    under CPU_SCORE_BYTES, each block over the keys up to its last row: every row sees the same
    keys and takes the same softmax as in one call."""
    B, H, T, _ = q.shape
    L = k.shape[-2]
    if T == L:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    rows = T if q.device.type != "cpu" else max(1, CPU_SCORE_BYTES // (B * H * L * 4))
    if rows >= T:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_after_prefix(T, L), scale=scale)
    out = []
    for start in range(0, T, rows):
        stop = min(T, start + rows)
        keys = L - T + stop
        out.append(F.scaled_dot_product_attention(q[:, :, start:stop], k[:, :, :keys], v[:, :, :keys],
                                                  attn_mask=causal_after_prefix(stop - start, keys), scale=scale))
    return torch.cat(out, dim=2)
