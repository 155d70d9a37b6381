"""Gated DeltaNet (GDN), the linear-attention layer of Qwen3-Next, as transformers'
Qwen3NextGatedDeltaNet defines it.

H key heads (q, k: [H, K]) and HV = r * H value heads (v: [HV, V]; grouped value attention: value
head j reads q/k head j // r):

    q, k, v, z = split(in_proj_qkvz(x))        head-interleaved, see below
    b, a       = split(in_proj_ba(x))          one each per value head
    q, k, v    = SiLU(ShortConv_W(q ++ k ++ v))  one depthwise conv1d over 2*H*K + HV*V channels
    g          = -exp(A_log) * softplus(a + dt_bias)   [HV] log-decay (Mamba2 style, fp32)
    beta       = sigmoid(b)                            [HV]
    o          = GDN(q, k, v, g, beta)         q, k L2-normalised in the op, scale K^-1/2
    y          = out_proj(RMSNorm_head(o) * weight * SiLU(z))

Head-interleaved projections (the released checkpoints' layout): in_proj_qkvz's output is
[H, K + K + r*V + r*V] -- for each key head its q, its k, then the v and z of its r value
heads -- and in_proj_ba's is [H, r + r] -- the b then the a of those r value heads. So value head
j = h * r + i is (key head h, i-th of its group) everywhere.

Tensor names: in_proj_qkvz, in_proj_ba, conv1d ([2*H*K + HV*V, 1, W]), dt_bias [HV],
A_log [HV], norm.weight [V], out_proj.

Engine steps (varlen prefill with checkpoints, pool decode, speculative verify, replay) come
from ShortConvDeltaRule; this module supplies the projections, gate and output.
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.layers.delta_rule import ShortConvDeltaRule
from hyla.layers.norm import SiLUGatedRMSNorm
from hyla.ops import chunk_gated_delta_rule, dispatch  # dispatched: Triton on CUDA
from hyla.ops.gate import gdn_gate


class GatedDeltaNet(ShortConvDeltaRule):
    """x: [B, T, hidden] -> [B, T, hidden] (full sequences), or packed [T_total, hidden] with a
    ForwardBatch and a GDNLayerCache (forward_batch, from ShortConvDeltaRule)."""

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel_size: int = 4, norm_eps: float = 1e-6):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.conv_kernel_size = conv_kernel_size
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim, bias=False)
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = SiLUGatedRMSNorm(head_v_dim, eps=norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    @property
    def group(self) -> int:
        """Value heads per key head (r)."""
        return self.num_v_heads // self.num_k_heads

    # -- ShortConvDeltaRule hooks ----------------------------------------------------------------

    def convs(self) -> tuple[nn.Conv1d]:
        return (self.conv1d,)

    def project(self, x: torch.Tensor):
        """x: [..., hidden] -> ([q ++ k ++ v pre-conv, [..., 2*H*K + HV*V]], (z [..., HV, V],
        b [..., HV], a [..., HV])), undoing the head interleaving of the fused projections."""
        H, K, V, r = self.num_k_heads, self.head_k_dim, self.head_v_dim, self.group
        qkvz = self.in_proj_qkvz(x).unflatten(-1, (H, 2 * K + 2 * r * V))
        q, k, v, z = qkvz.split([K, K, r * V, r * V], dim=-1)  # per key head
        b, a = self.in_proj_ba(x).unflatten(-1, (H, 2 * r)).split([r, r], dim=-1)
        mixed = torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2)], dim=-1)
        return [mixed], (z.reshape(*z.shape[:-2], self.num_v_heads, V), b.flatten(-2), a.flatten(-2))

    def heads(self, ys: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ys: [SiLU(conv(q ++ k ++ v))] -> q, k [..., H, K], v [..., HV, V]."""
        q, k, v = ys[0].split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
                k.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
                v.unflatten(-1, (self.num_v_heads, self.head_v_dim)))

    def gates(self, aux) -> tuple[torch.Tensor, torch.Tensor]:
        """-> g [B, T, HV] fp32 log-decay (<= 0), beta [B, T, HV] = sigmoid(b)."""
        _, b, a = aux
        return gdn_gate(a, self.A_log, self.dt_bias), torch.sigmoid(b)

    def output(self, o: torch.Tensor, aux) -> torch.Tensor:
        """o: [..., HV, V] core output -> [..., hidden]."""
        z = aux[0]
        return self.out_proj(self.norm(o, z).flatten(-2))

    # Looked up in this module's namespace at call time (tests may swap in the loop oracle).
    def _chunk(self, *args, **kwargs):
        return chunk_gated_delta_rule(*args, **kwargs)

    def _recurrent(self, *args, **kwargs):  # decode, verify and replay's commit
        return dispatch.fused_recurrent_gated_delta_rule(*args, **kwargs)
