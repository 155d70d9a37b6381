"""Block Attention Residuals (Kimi K3): the residual stream as a bank of block snapshots plus a
running in-block sum, read through a learned softmax mix instead of a plain sum.

State of one forward pass (per token, so packed engine batches work unchanged; it is activation
memory of the step, never cached): bank V_0..V_{n-1} (each [..., H]) and the running sum r.

    mix(norm, proj) = sum_j p_j V_j,  p = softmax_j(<V_j / rms(V_j), norm.weight * proj.weight>)
                      over [V_0, ..., V_{n-1}, r], in fp32 (fp64 stays fp64), rounded once

Layer l reads mix(self_attention_res_*) as its attention input (then input_layernorm). If
l % block_size == 0, r is then appended to the bank and restarts from the attention output
(layer 0 banks the embeddings); otherwise r += attention output. The MLP reads
mix(mlp_res_*) (then post_attention_layernorm) and r += MLP output. After the last layer the
model reads mix(output_attn_res_*) before its final norm. Scorers: an RMSNorm `*_res_norm`
[H] and a Linear `*_res_proj` [1, H] (their product is the one score direction).
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.layers.norm import RMSNorm
from hyla.ops.utils import work_dtype


def mix_blocks(bank: list[torch.Tensor], running: torch.Tensor, norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """bank: n tensors [..., H]; running: [..., H] -> the softmax mix of [bank..., running]
    (see the module docstring), [..., H] in running.dtype. With an empty bank: running."""
    if not bank:
        return running  # the softmax over one row is exactly 1
    work = work_dtype(running)
    rows = torch.stack([*bank, running], dim=-2).to(work)  # [..., R, H]
    direction = norm.weight.to(work) * proj.weight.to(work).reshape(-1)  # [H]
    inv_rms = torch.rsqrt(rows.pow(2).mean(-1) + norm.eps)  # [..., R]
    p = torch.softmax((rows @ direction) * inv_rms, dim=-1)  # [..., R]
    return (p.unsqueeze(-1) * rows).sum(-2).to(running.dtype)


class BlockResidualStream:
    """One forward pass's bank + running sum. h: the embeddings [..., H]."""

    def __init__(self, h: torch.Tensor, block_size: int):
        self.bank: list[torch.Tensor] = []
        self.running: torch.Tensor | None = h
        self.block_size = block_size

    def mix(self, norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
        return mix_blocks(self.bank, self.running, norm, proj)

    def attention_input(self, layer: int, norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
        """The mix before layer `layer`'s attention; at a block start, bank r and restart it."""
        x = self.mix(norm, proj)
        if layer % self.block_size == 0:
            self.bank.append(self.running)
            self.running = None
        return x

    def add(self, delta: torch.Tensor) -> None:
        """r += delta (r restarted: r = delta)."""
        self.running = delta if self.running is None else self.running + delta


def residual_scorer(hidden_size: int, eps: float) -> tuple[RMSNorm, nn.Linear]:
    """The (`*_res_norm`, `*_res_proj`) pair of one mixing point."""
    return RMSNorm(hidden_size, eps), nn.Linear(hidden_size, 1, bias=False)
