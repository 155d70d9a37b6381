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

`prepare_for_inference()` packs in_proj_qkvz and in_proj_ba into one weight (one GEMM; the
official parameters become views of it). The head interleaving is then undone without copies:
the decode conv reads q ++ k ++ v through a column map and writes q, k, v as separate contiguous
tensors, the gate kernel reads b / a as strided views, and the output norm reads z in place.

A checkpoint may keep in_proj_ba in the model dtype beside an FP8 in_proj_qkvz (Qwen's FP8
release: its modules_to_not_convert): the two then run as a GEMM each (MixedPackedLinears). At a
decode step (few token rows, on the Triton path: dispatch.gdn_projected_gate_in_kernel) b and a
are not projected at all: the gate kernel computes them from x and in_proj_ba's rows
(dispatch.gdn_projected_gate_beta), one launch for the GEMV and the gate.

Qwen3_5GatedDeltaNet: the same layer with Qwen3.5's four separate, non-interleaved projections
(in_proj_qkv, in_proj_z, in_proj_b, in_proj_a); only the projection hooks differ.
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.layers.delta_rule import (MixedPackedLinears, PackedConvInput, PackedLinears, ShortConvDeltaRule,
                                    plain_weight)
from hyla.layers.norm import SiLUGatedRMSNorm
from hyla.ops import chunk_gated_delta_rule, dispatch  # dispatched: Triton on CUDA


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
        self.make_projections(hidden_size)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = SiLUGatedRMSNorm(head_v_dim, eps=norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self._packed: PackedLinears | None = None
        self._columns: dict = {}  # device -> the conv channels' columns in in_proj_qkvz's output

    def make_projections(self, hidden_size: int) -> None:
        """The input projections (Qwen3-Next's head-interleaved pair; see Qwen3_5GatedDeltaNet)."""
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * self.num_v_heads, bias=False)

    def prepare_for_inference(self) -> None:
        """Pack in_proj_qkvz and in_proj_ba into one weight (one GEMM per step); state_dict unchanged."""
        self._packed = PackedLinears([self.in_proj_qkvz, self.in_proj_ba])
        self._columns = {}
        self.conv_columns(self.in_proj_qkvz.weight.device)

    def conv_columns(self, device) -> torch.Tensor:
        """[2*H*K + HV*V] int64: the column of in_proj_qkvz's output holding each conv channel (q of
        every key head, then k, then v). Made once per device (outside CUDA-graph capture: the
        engine warms up first)."""
        device = torch.device(device)
        if device not in self._columns:
            H, K, V, r = self.num_k_heads, self.head_k_dim, self.head_v_dim, self.group
            E = 2 * K + 2 * r * V
            h = torch.arange(H)[:, None] * E
            q = (h + torch.arange(K)).flatten()
            k = (h + K + torch.arange(K)).flatten()
            v = (h + 2 * K + torch.arange(r * V)).flatten()
            self._columns[device] = torch.cat([q, k, v]).to(device)
        return self._columns[device]

    @property
    def group(self) -> int:
        """Value heads per key head (r)."""
        return self.num_v_heads // self.num_k_heads

    # -- b and a inside the gate kernel ------------------------------------------------------------

    def ba_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(w_b, w_a), each [H, r, hidden]: the rows of in_proj_ba's weight holding the b and the a of
        value head h * r + i (views), when in_proj_ba runs as a GEMM of its own (see
        `_own_gemm_weights`); None otherwise."""
        ws = self._own_gemm_weights([self.in_proj_ba])
        if ws is None:
            return None
        w_b, w_a = ws[0].unflatten(0, (self.num_k_heads, 2 * self.group)).split(self.group, dim=1)
        return w_b, w_a

    def _own_gemm_weights(self, linears: list[nn.Module]) -> list[torch.Tensor] | None:
        """The weights of the b / a projections `linears` when they are bias-free nn.Linears in the
        model dtype packed apart from the FP8 projections (MixedPackedLinears' model-dtype GEMM,
        nothing else in it), so that leaving them to the gate kernel saves that GEMM; else None."""
        packed = self._packed
        if not (isinstance(packed, MixedPackedLinears) and packed.weight() is not None
                and packed.plain_parts() == linears):
            return None
        ws = [plain_weight(lin) for lin in linears]
        return None if any(w is None for w in ws) else ws

    def _ba_in_gate_kernel(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(x, w_b, w_a) when the gate kernel projects this step's b and a from x (a decode step: few
        token rows on the Triton path), so that `project` leaves them out; else None."""
        weights = self.ba_weights()
        if weights is None or not dispatch.gdn_projected_gate_in_kernel(x, *weights, self.A_log, self.dt_bias):
            return None
        return (x, *weights)

    # -- ShortConvDeltaRule hooks ----------------------------------------------------------------

    def convs(self) -> tuple[nn.Conv1d]:
        return (self.conv1d,)

    def project(self, x: torch.Tensor):
        """x: [..., hidden] -> (q ++ k ++ v pre-conv, (z, b, a, None)) as `_project` gives them, or
        (z, None, None, (x, w_b, w_a)) at a decode step whose gate kernel projects b and a
        (`_ba_in_gate_kernel`)."""
        return self._project(x, in_gate=self._ba_in_gate_kernel(x))

    def project_prefill(self, x: torch.Tensor):
        """`_project` with b and a from their GEMM at any row count: a prefill step's tensors keep one
        layout (ShortConvDeltaRule.project_prefill)."""
        return self._project(x, in_gate=None)

    def _project(self, x: torch.Tensor, in_gate: tuple | None):
        """x: [..., hidden] -> (q ++ k ++ v pre-conv [..., 2*H*K + HV*V], (z [..., HV, V], b, a, None)),
        undoing the head interleaving of the fused projections. Once packed (prepare_for_inference,
        no grad): one GEMM; q ++ k ++ v is a PackedConvInput reading its columns through
        `conv_columns`; z is a view [..., H, r, V] and b, a views [..., H, r] (value head h * r + i).
        in_gate: `_ba_in_gate_kernel`'s (x, w_b, w_a): in_proj_ba's GEMM is not run, aux is
        (z, None, None, in_gate) for the gate kernel."""
        H, K, V, r = self.num_k_heads, self.head_k_dim, self.head_v_dim, self.group
        packed = self._packed is not None and self._packed.weight() is not None
        if packed:
            qkvz_flat, ba_flat = self._packed(x) if in_gate is None else self._packed(x, skip_plain=True)
        else:
            qkvz_flat, ba_flat = self.in_proj_qkvz(x), self.in_proj_ba(x)
        qkvz = qkvz_flat.unflatten(-1, (H, 2 * K + 2 * r * V))
        q, k, v, z = qkvz.split([K, K, r * V, r * V], dim=-1)  # per key head
        b, a = (None, None) if in_gate is not None else ba_flat.unflatten(-1, (H, 2 * r)).split([r, r], dim=-1)
        if packed:
            z = z.unflatten(-1, (r, V))  # [..., H, r, V]: rows in value-head order, read in place
            pre = PackedConvInput(qkvz_flat, [[self.key_dim, self.key_dim, self.value_dim]],
                                  self.conv_columns(x.device))
            return pre, (z, b, a, in_gate)
        mixed = torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2)], dim=-1)
        return [mixed], (z.reshape(*z.shape[:-2], self.num_v_heads, V), b.flatten(-2), a.flatten(-2), None)

    def heads(self, ys: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ys: [SiLU(conv(q ++ k ++ v))], or its parts [q, k, v] -> q, k [..., H, K], v [..., HV, V]."""
        q, k, v = ys if len(ys) == 3 else ys[0].split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
                k.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
                v.unflatten(-1, (self.num_v_heads, self.head_v_dim)))

    def gates(self, aux) -> tuple[torch.Tensor, torch.Tensor]:
        """aux: project's (z, b, a, None), or (z, None, None, (x, w_b, w_a)) -> g [B, T, HV] fp32
        log-decay (<= 0), beta [B, T, HV] = sigmoid(b) (one launch on CUDA; with x, b and a projected
        in it too)."""
        _, b, a, in_gate = aux
        if in_gate is not None:
            return dispatch.gdn_projected_gate_beta(*in_gate, self.A_log, self.dt_bias)
        return dispatch.gdn_gate_beta(a, b, self.A_log, self.dt_bias)

    def output(self, o: torch.Tensor, aux) -> torch.Tensor:
        """o: [..., HV, V] core output -> [..., hidden]. z: [..., HV, V], or the packed path's view
        [..., H, r, V] (same rows in order)."""
        z = aux[0]
        return self.out_proj(self.norm(o, z).flatten(-2))

    # Looked up in this module's namespace at call time (tests may swap in the loop oracle).
    def _chunk(self, *args, **kwargs):
        return chunk_gated_delta_rule(*args, **kwargs)

    def _recurrent(self, *args, **kwargs):  # decode, verify and replay's commit
        return dispatch.fused_recurrent_gated_delta_rule(*args, **kwargs)


class Qwen3_5GatedDeltaNet(GatedDeltaNet):
    """Gated DeltaNet with Qwen3.5's four separate input projections (transformers'
    Qwen3_5GatedDeltaNet); the conv, gate, delta rule and output are Qwen3-Next's.

        in_proj_qkv: [2*H*K + HV*V, hidden]   q of every key head, then k, then v: already the
                                              conv's channel order, no head interleaving
        in_proj_z:   [HV*V, hidden]           in_proj_b, in_proj_a: [HV, hidden]

    Value head j reads key head j // r, as in Qwen3-Next. `prepare_for_inference()` packs the four
    into one weight; the conv then reads the first 2*H*K + HV*V columns of that GEMM's output in
    place, and z, b, a are views of the columns after them. A checkpoint keeping in_proj_b and
    in_proj_a in the model dtype beside FP8 qkv and z leaves them to the gate kernel at a decode
    step, as Qwen3-Next's in_proj_ba."""

    def make_projections(self, hidden_size: int) -> None:
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, self.num_v_heads, bias=False)

    def _linears(self) -> list[nn.Linear]:
        return [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]

    def prepare_for_inference(self) -> None:
        """Pack the four projections into one weight (one GEMM per step); state_dict unchanged."""
        self._packed = PackedLinears(self._linears())

    def ba_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(in_proj_b's weight, in_proj_a's), each [HV, hidden], when they run as a GEMM of their own
        (see GatedDeltaNet._own_gemm_weights); None otherwise."""
        ws = self._own_gemm_weights([self.in_proj_b, self.in_proj_a])
        return None if ws is None else (ws[0], ws[1])

    def _project(self, x: torch.Tensor, in_gate: tuple | None):
        """x: [..., hidden] -> (q ++ k ++ v pre-conv [..., 2*H*K + HV*V], (z [..., HV, V], b [..., HV],
        a [..., HV], None)). Packed: one GEMM, every piece a view of its output (the conv reads
        q ++ k ++ v in place as a PackedConvInput). in_gate: (x, w_b, w_a), b and a are not
        projected, aux is (z, None, None, in_gate) for the gate kernel."""
        packed = self._packed is not None and self._packed.weight() is not None
        if packed:
            qkv, z, b, a = self._packed(x) if in_gate is None else self._packed(x, skip_plain=True)
        else:
            qkv, z, b, a = [lin(x) for lin in self._linears()]
        aux = (z.unflatten(-1, (self.num_v_heads, self.head_v_dim)), b, a, in_gate)
        if packed:
            return PackedConvInput(qkv, [[self.key_dim, self.key_dim, self.value_dim]]), aux
        return [qkv], aux
