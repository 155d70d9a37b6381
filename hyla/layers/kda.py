"""Kimi Delta Attention (KDA): the linear-attention layer of Kimi-Linear.

    q, k, v = SiLU(ShortConv_4(x W_{q,k,v}^T))             per head [K]; q, k L2-normalised in the core
    g       = gate(f_b(f_a(x)), A_log, dt_bias)            per channel log-decay [H, K] (v1 or safe gate v2)
    beta    = sigmoid(b_proj(x))                            [H]
    o       = KDA(q, k, v, g, beta)                         hyla.ops (chunk for prefill, recurrent for decode)
    y       = o_proj(RMSNorm_head(o) * sigmoid(g_b(g_a(x))))   (or the full-rank g_proj(x))

Tensor names follow the released checkpoints: q_proj, k_proj, v_proj, q_conv1d / k_conv1d /
v_conv1d ([D, 1, W], nn.Conv1d's depthwise layout), f_a_proj, f_b_proj, dt_bias [H*K], A_log
[1, 1, H, 1], b_proj, g_a_proj + g_b_proj (or g_proj), o_norm [K], o_proj.

The pieces (projections, conv, gate, core, output) are the hooks of ShortConvDeltaRule
(hyla.layers.delta_rule), which runs them over whole sequences and over the engine's pools.

`prepare_for_inference()` packs the six projections from x (q, k, v, f_a, b, g_a / g_proj) into
one weight (PackedLinears: the official parameters become views of it), so they run as one GEMM;
a decode step then runs the three convs in one launch over that GEMM's output, g and beta in one
launch, and the gated output norm in one launch.
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.layers.delta_rule import PackedConvInput, PackedLinears, ShortConvDeltaRule, plain_weight
from hyla.layers.norm import GatedRMSNorm
from hyla.ops import chunk_kda, dispatch  # dispatched: Triton on CUDA


class KimiDeltaAttention(ShortConvDeltaRule):
    """x: [B, T, hidden] -> [B, T, hidden] (full sequences), or packed [T_total, hidden] with a
    ForwardBatch and a KDALayerCache (forward_batch, from ShortConvDeltaRule)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_kernel_size: int = 4,
                 lower_bound: float | None = None, full_rank_gate: bool = False, norm_eps: float = 1e-5,
                 a_log_shape: tuple[int, ...] | None = None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.conv_kernel_size = conv_kernel_size
        self.lower_bound = lower_bound
        D = num_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, D, bias=False)
        self.k_proj = nn.Linear(hidden_size, D, bias=False)
        self.v_proj = nn.Linear(hidden_size, D, bias=False)
        self.q_conv1d = nn.Conv1d(D, D, conv_kernel_size, groups=D, bias=False)
        self.k_conv1d = nn.Conv1d(D, D, conv_kernel_size, groups=D, bias=False)
        self.v_conv1d = nn.Conv1d(D, D, conv_kernel_size, groups=D, bias=False)
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, D, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(D, dtype=torch.float32))
        # Kimi stores A_log as [1, 1, H, 1], GLM-5-Next as [H], Kimi K3 as [K] (first H used).
        self.A_log = nn.Parameter(torch.zeros(a_log_shape or (1, 1, num_heads, 1), dtype=torch.float32))
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        if full_rank_gate:
            self.g_proj = nn.Linear(hidden_size, D, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
            self.g_b_proj = nn.Linear(head_dim, D, bias=False)
        self.full_rank_gate = full_rank_gate
        self.o_norm = GatedRMSNorm(head_dim, eps=norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(D, hidden_size, bias=False)
        self._packed: PackedLinears | None = None

    def _x_linears(self) -> list[nn.Linear]:
        """The projections from x, in the packed order: q, k, v, f_a, g_a (or g_proj), b. The
        write strength b (one column a head) goes last: block-FP8 packing needs every part but
        the last to fill whole 128-row blocks (PackedFp8Linears), and b before g_a left the FP8
        models' six projections unpacked."""
        gate = self.g_proj if self.full_rank_gate else self.g_a_proj
        return [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, gate, self.b_proj]

    def prepare_for_inference(self) -> None:
        """Pack the projections from x into one weight (one GEMM per step); state_dict unchanged."""
        self._packed = PackedLinears(self._x_linears())

    # -- pieces -------------------------------------------------------------------------------

    def convs(self) -> tuple[nn.Conv1d, nn.Conv1d, nn.Conv1d]:
        return self.q_conv1d, self.k_conv1d, self.v_conv1d

    def project_qkv(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x: [..., hidden] -> [q, k, v], each [..., H*K], before the short conv."""
        return [self.q_proj(x), self.k_proj(x), self.v_proj(x)]

    def project_all(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x: [..., hidden] -> [q, k, v, f_a(x), g_a(x) (or g_proj(x)), b(x)]: one GEMM once packed."""
        if self._packed is not None:
            return self._packed(x)
        return [lin(x) for lin in self._x_linears()]

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden] -> g: [B, T, H, K] fp32 log-decay (<= 0)."""
        return self.gates((self.f_a_proj(x), self.b_proj(x), None))[0]

    def write_strength(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] -> beta: [..., H] in (0, 1)."""
        return torch.sigmoid(self.b_proj(x))

    def output(self, o: torch.Tensor, aux) -> torch.Tensor:
        """o: [..., H, V] core output, aux: project's (f_a(x), b(x), g_a(x) | g_proj(x)) -> [..., hidden]."""
        g_in = aux[2]
        up = None if self.full_rank_gate else self.g_b_proj
        w_up = plain_weight(up)
        if w_up is not None and o.dim() == 4:
            y = dispatch.lowrank_gated_rms_norm(o, g_in, w_up, self.o_norm.weight, self.o_norm.eps,
                                                self.o_norm.activation, self.o_norm.fp8_output)
            return self.o_proj(y.flatten(-2))
        gate = g_in if up is None else up(g_in)
        y = self.o_norm(o, gate.unflatten(-1, (self.num_heads, self.head_dim)))
        return self.o_proj(y.flatten(-2))

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (self.num_heads, self.head_dim))

    # -- ShortConvDeltaRule hooks ----------------------------------------------------------------

    def project(self, x: torch.Tensor):
        """-> (pre-conv q, k, v: a PackedConvInput over the packed GEMM's columns once packed, else
        three tensors; aux = (f_a(x), b(x), g_a(x) | g_proj(x)) for the gates and the output)."""
        q, k, v, fa, ga, b = self.project_all(x)
        if self._packed is not None and self._packed.weight() is not None and self._packed.contiguous:
            D = self.num_heads * self.head_dim
            packed = q.as_strided((*q.shape[:-1], 3 * D), q.stride())  # q ++ k ++ v: adjacent columns
            return PackedConvInput(packed, [[D], [D], [D]]), (fa, b, ga)
        return [q, k, v], (fa, b, ga)

    def heads(self, ys: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (self._heads(t) for t in ys)
        return q, k, v

    def gates(self, aux) -> tuple[torch.Tensor, torch.Tensor]:
        """aux: (f_a(x), b(x), ...) -> g [..., H, K] fp32 log-decay, beta [..., H] (one launch on CUDA)."""
        fa, b = aux[0], aux[1]
        # One A_log per head: Kimi K3 stores head_dim values and uses the first num_heads.
        a_log = self.A_log.reshape(-1)[: self.num_heads]
        w_up = plain_weight(self.f_b_proj)
        if w_up is not None and fa.dim() == 3:
            return dispatch.kda_lowrank_gate_beta(fa, w_up, b, a_log, self.dt_bias, self.lower_bound)
        f = self.f_b_proj(fa).unflatten(-1, (self.num_heads, self.head_dim))
        return dispatch.kda_gate_beta(f, b, a_log, self.dt_bias, self.lower_bound)

    # The ops are looked up in this module's namespace at call time, so that tests can swap in
    # the loop oracle (monkeypatch hyla.layers.kda.chunk_kda).
    def _chunk(self, *args, **kwargs):
        return chunk_kda(*args, **kwargs)

    def _recurrent(self, *args, **kwargs):  # decode, verify and replay's commit
        return dispatch.fused_recurrent_kda(*args, **kwargs)
