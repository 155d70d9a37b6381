"""The input of a multi-token-prediction head step (hyla.models.qwen3_5_mtp), torch reference:

    mtp_fc_input(ids, embed, hidden, w_e, w_h) = cat(norm(embed[ids], w_e), norm(hidden, w_h))

with norm the zero-centred RMSNorm (hyla.ops.norm.rms_norm_zero_centred: fp32, times 1 + w,
rounded once to the input dtype). The result feeds the head's `fc`. hyla.ops.dispatch sends CUDA
calls to hyla.ops.triton.mtp_input (one launch instead of the embedding gather, two norms and
the concatenation).
"""

from __future__ import annotations

import torch

from hyla.ops.norm import rms_norm_zero_centred

__all__ = ["mtp_fc_input"]


def check_fc_input(ids: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor, w_e: torch.Tensor,
                   w_h: torch.Tensor) -> None:
    if ids.ndim != 1 or hidden.ndim != 2 or embed.ndim != 2 or hidden.shape != (ids.shape[0], embed.shape[1]):
        raise ValueError(f"mtp_fc_input expects ids [T], embed [V, hidden], hidden [T, hidden]; got "
                         f"{tuple(ids.shape)}, {tuple(embed.shape)}, {tuple(hidden.shape)}")
    if w_e.shape != (embed.shape[1],) or w_h.shape != (embed.shape[1],):
        raise ValueError(f"the norm weights must be [{embed.shape[1]}], got {tuple(w_e.shape)}, {tuple(w_h.shape)}")


def mtp_fc_input(ids: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor, w_e: torch.Tensor,
                 w_h: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """ids: [T] token ids; embed: [V, hidden] the embedding table; hidden: [T, hidden] the
    target's final-norm states (any row stride); w_e, w_h: [hidden] zero-centred norm weights
    -> [T, 2 * hidden] in embed.dtype (the embedding's norm first)."""
    check_fc_input(ids, embed, hidden, w_e, w_h)
    return torch.cat([rms_norm_zero_centred(embed[ids], w_e, eps), rms_norm_zero_centred(hidden, w_h, eps)], -1)
