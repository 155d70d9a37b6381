"""Kimi Delta Attention (KDA): the linear-attention layer of Kimi-Linear.

    q, k, v = SiLU(ShortConv_4(x W_{q,k,v}^T))             per head [K]; q, k L2-normalised in the core
    g       = gate(f_b(f_a(x)), A_log, dt_bias)            per channel log-decay [H, K] (v1 or safe gate v2)
    beta    = sigmoid(b_proj(x))                            [H]
    o       = KDA(q, k, v, g, beta)                         hyla.ops (chunk for prefill, recurrent for decode)
    y       = o_proj(RMSNorm_head(o) * sigmoid(g_b(g_a(x))))   (or the full-rank g_proj(x))

Tensor names follow the released checkpoints: q_proj, k_proj, v_proj, q_conv1d / k_conv1d /
v_conv1d ([D, 1, W], nn.Conv1d's depthwise layout), f_a_proj, f_b_proj, dt_bias [H*K], A_log
[1, 1, H, 1], b_proj, g_a_proj + g_b_proj (or g_proj), o_norm [K], o_proj.

The pieces (projections, conv, gate, core, output) are separate methods so that speculative
verify (2-D state slots) can reuse them.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from hyla.layers.norm import GatedRMSNorm
from hyla.ops import dispatch
from hyla.ops.chunk import chunk_kda
from hyla.ops.conv import causal_conv1d_fn, causal_conv1d_update, depthwise_valid_conv
from hyla.ops.gate import kda_gate
from hyla.ops.recurrent import fused_recurrent_kda


class KimiDeltaAttention(nn.Module):
    """x: [B, T, hidden] -> [B, T, hidden] (full sequences), or packed [T_total, hidden] with a
    ForwardBatch and a KDALayerCache (forward_batch)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_kernel_size: int = 4,
                 lower_bound: float | None = None, full_rank_gate: bool = False, norm_eps: float = 1e-5):
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
        self.A_log = nn.Parameter(torch.zeros(1, 1, num_heads, 1, dtype=torch.float32))
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        if full_rank_gate:
            self.g_proj = nn.Linear(hidden_size, D, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
            self.g_b_proj = nn.Linear(head_dim, D, bias=False)
        self.full_rank_gate = full_rank_gate
        self.o_norm = GatedRMSNorm(head_dim, eps=norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(D, hidden_size, bias=False)

    # -- pieces -------------------------------------------------------------------------------

    def convs(self) -> tuple[nn.Conv1d, nn.Conv1d, nn.Conv1d]:
        return self.q_conv1d, self.k_conv1d, self.v_conv1d

    def project_qkv(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x: [..., hidden] -> [q, k, v], each [..., H*K], before the short conv."""
        return [self.q_proj(x), self.k_proj(x), self.v_proj(x)]

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden] -> g: [B, T, H, K] fp32 log-decay (<= 0)."""
        f = self.f_b_proj(self.f_a_proj(x)).unflatten(-1, (self.num_heads, self.head_dim))
        return kda_gate(f, self.A_log, self.dt_bias, self.lower_bound)

    def write_strength(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] -> beta: [..., H] in (0, 1)."""
        return torch.sigmoid(self.b_proj(x))

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o: [..., H, V] core output, x: [..., hidden] layer input -> [..., hidden]."""
        gate = self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        y = self.o_norm(o, gate.unflatten(-1, (self.num_heads, self.head_dim)))
        return self.o_proj(y.flatten(-2))

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (self.num_heads, self.head_dim))

    # -- full sequences -----------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden] whole sequences from position 0 (no cache) -> [B, T, hidden]."""
        qkv = [
            causal_conv1d_fn(t, conv.weight, activation="silu")[0]
            for t, conv in zip(self.project_qkv(x), self.convs())
        ]
        q, k, v = (self._heads(t) for t in qkv)
        o, _ = chunk_kda(q, k, v, self.forget_gate(x), self.write_strength(x), use_qk_l2norm_in_kernel=True)
        return self.output(o, x)

    # -- engine step --------------------------------------------------------------------------

    def forward_batch(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        """x: [T_total, hidden] packed new tokens; batch: ForwardBatch; cache: KDALayerCache,
        read at batch.state_slots and overwritten with the state after this step's tokens.
        Returns [T_total, hidden]."""
        if batch.is_verify:
            return self._verify(x, batch, cache)
        if batch.is_decode:
            return self._decode(x, batch, cache)
        return self._prefill(x, batch, cache)

    def _verify(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        """Speculative verify: sequence n feeds 1..S tokens starting from the state in slot
        state_slots[n, num_accepted_tokens[n] - 1]. Outputs for every position. Rollback "slots":
        the state and conv windows after its j-th token are written to slot state_slots[n, j], so
        the next step picks the accepted one by index (no copy). Rollback "replay": nothing is
        written; the per-token inputs (k, v, g, beta, pre-conv inputs) are kept on the cache and
        `commit_replay` advances the state by the accepted tokens only."""
        idx, acc = batch.state_slots, batch.num_accepted_tokens
        N, S = idx.shape[0], max(batch.seq_lens)  # S: padded width of the per-sequence token rows
        start = idx.gather(1, (acc - 1)[:, None])[:, 0]  # [N] slot holding each sequence's state
        seq_ids = batch.token_seq_ids()
        offs = torch.arange(batch.num_tokens, device=x.device) - batch.cu_seqlens[:-1][seq_ids]  # [T_total]
        padded = seq_ids * S + offs  # [T_total] row in the [N * S] padded layout
        xs = x[None]  # [1, T_total, hidden]
        qkv, inputs, windows0 = [], [], []
        for t, pool, conv in zip(self.project_qkv(xs), cache.conv, self.convs()):
            tp = t.new_zeros(N * S, t.shape[-1]).index_copy(0, padded, t[0]).view(N, S, -1)  # [N, S, D]
            w0 = pool[start]  # [N, D, W-1]
            y, windows = _conv_with_windows(tp, w0, conv.weight)
            if batch.rollback == "slots":
                pool[idx[seq_ids, offs]] = windows.flatten(0, 1)[padded].to(pool.dtype)
            inputs.append(tp)
            windows0.append(w0)
            qkv.append(y.flatten(0, 1)[padded][None])  # [1, T_total, D]
        q, k, v = (self._heads(t) for t in qkv)
        g, beta = self.forget_gate(xs), self.write_strength(xs)
        if batch.rollback == "slots":
            o, _ = fused_recurrent_kda(q, k, v, g, beta, initial_state=cache.state, ssm_state_indices=idx,
                                       num_accepted_tokens=acc, cu_seqlens=batch.cu_seqlens,
                                       use_qk_l2norm_in_kernel=True)
        else:
            work = torch.float64 if x.dtype == torch.float64 else torch.float32
            o, _ = fused_recurrent_kda(q, k, v, g, beta, initial_state=cache.state[start].to(work),
                                       cu_seqlens=batch.cu_seqlens, use_qk_l2norm_in_kernel=True)
            cache.replay = dict(k=k, v=v, g=g, beta=beta, inputs=inputs, windows0=windows0, start=start,
                                cu=batch.cu_seqlens_list)
        return self.output(o, xs)[0]

    def commit_replay(self, cache, accepted: list[int]) -> None:
        """After a "replay" verify: advance sequence n's state and conv windows by its first
        accepted[n] verified tokens (1 <= accepted[n] <= its verified tokens)."""
        r, cache.replay = cache.replay, None
        cu = r["cu"]
        keep = [cu[n] + j for n, a in enumerate(accepted) for j in range(a)]
        sel = torch.tensor(keep, dtype=torch.long, device=r["k"].device)
        new_cu = torch.tensor([0] + list(itertools.accumulate(accepted)), dtype=torch.long, device=sel.device)
        k, v, g, beta = (t[:, sel] for t in (r["k"], r["v"], r["g"], r["beta"]))
        fused_recurrent_kda(k, k, v, g, beta, initial_state=cache.state, ssm_state_indices=r["start"],
                            cu_seqlens=new_cu, use_qk_l2norm_in_kernel=True)  # outputs unused
        width = self.conv_kernel_size - 1
        shift = torch.tensor(accepted, device=sel.device)
        for pool, tp, w0 in zip(cache.conv, r["inputs"], r["windows0"]):
            ext = torch.cat([w0, tp.transpose(1, 2).to(w0.dtype)], dim=2)  # [N, D, W-1+S]
            cols = shift[:, None] + torch.arange(width, device=sel.device)  # [N, W-1]
            pool[r["start"]] = ext.gather(2, cols[:, None, :].expand(-1, ext.shape[1], -1)).to(pool.dtype)

    def _decode(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        """One new token per sequence: the pool-indexed recurrent path, states updated in place."""
        slots = batch.state_slots
        # A one-token prompt: its slot may hold an old request's state (the CUDA-graph runner
        # zeroes such slots before a replay: its context_lens_list is a placeholder).
        if not batch.cuda_graph and 0 in batch.context_lens_list:
            fresh = slots[~batch.has_context()]
            for t in (cache.state, *cache.conv):
                t[fresh] = 0
        xs = x[:, None]  # [N, 1, hidden]: B = N sequences of one token
        qkv = [
            causal_conv1d_update(t, pool, conv.weight, activation="silu", conv_state_indices=slots)
            for t, pool, conv in zip(self.project_qkv(xs), cache.conv, self.convs())
        ]
        q, k, v = (self._heads(t) for t in qkv)  # [N, 1, H, K]
        # dispatched: the Triton kernel on CUDA (no host sync, so CUDA graphs can capture it)
        o, _ = dispatch.fused_recurrent_kda(q, k, v, self.forget_gate(xs), self.write_strength(xs),
                                            initial_state=cache.state, ssm_state_indices=slots,
                                            use_qk_l2norm_in_kernel=True)
        if _checkpoint_positions(batch) is not None:  # p can only be 1: the state after the step
            src = batch.state_slots.tolist()
            for n, pairs in enumerate(batch.checkpoints):
                for _, dest in pairs:
                    for t in (cache.state, *cache.conv):
                        t[dest] = t[src[n]]
        return self.output(o, xs)[:, 0]

    def _prefill(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        """Any mix of lengths: the varlen chunk path, states gathered from and scattered to the pool."""
        slots, cu = batch.state_slots, batch.cu_seqlens
        resume = batch.has_context()  # [N]: sequences without context start from zeros
        positions = _checkpoint_positions(batch)
        xs = x[None]  # [1, T_total, hidden], sequences packed along T
        qkv = []
        for t, pool, conv in zip(self.project_qkv(xs), cache.conv, self.convs()):
            init = torch.where(resume[:, None, None], pool[slots], 0)  # [N, D, W-1]
            y, final = causal_conv1d_fn(t, conv.weight, activation="silu", initial_state=init,
                                        output_final_state=True, cu_seqlens=cu)
            if positions is not None:
                _write_conv_checkpoints(pool, init, t[0], batch)
            pool[slots] = final
            qkv.append(y)
        q, k, v = (self._heads(t) for t in qkv)  # [1, T_total, H, K]
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        s0 = torch.where(resume[:, None, None, None], cache.state[slots].to(work), 0)
        out = chunk_kda(q, k, v, self.forget_gate(xs), self.write_strength(xs), initial_state=s0,
                        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                        checkpoint_positions=positions)
        cache.state[slots] = out[1].to(cache.state.dtype)
        if positions is not None:
            for n, pairs in enumerate(batch.checkpoints):
                for (_, dest), s in zip(pairs, out[2][n]):
                    cache.state[dest] = s.to(cache.state.dtype)
        return self.output(out[0], xs)[0]


def _conv_with_windows(tp: torch.Tensor, w0: torch.Tensor, weight: torch.Tensor):
    """Depthwise causal conv of S new tokens after the window w0, plus the window after each token.

    tp: [N, S, D] pre-conv inputs; w0: [N, D, W-1] the W-1 inputs before them; weight: [D, 1, W].
    Returns SiLU(conv) [N, S, D] and windows [N, S, D, W-1] (window after token j = inputs j-W+2..j).
    """
    width = weight.shape[-1] - 1
    ext = torch.cat([w0, tp.transpose(1, 2).to(w0.dtype)], dim=2)  # [N, D, W-1+S]
    work = torch.float64 if ext.dtype == torch.float64 else torch.float32
    y = F.silu(depthwise_valid_conv(ext.to(work), weight.to(work).flatten(1))).to(tp.dtype)  # [N, D, S]
    windows = ext.unfold(2, width, 1)[:, :, 1:]  # [N, D, S, W-1]
    return y.transpose(1, 2), windows.permute(0, 2, 1, 3)


def _checkpoint_positions(batch) -> list[list[int]] | None:
    if not batch.checkpoints or not any(batch.checkpoints):
        return None
    return [[p for p, _ in pairs] for pairs in batch.checkpoints]


def _write_conv_checkpoints(pool: torch.Tensor, init: torch.Tensor, t: torch.Tensor, batch) -> None:
    """The conv window after the first p new tokens of sequence n is columns p .. p+W-2 of
    [its initial window (W-1 columns) ++ its new pre-conv inputs].

    pool: [num_slots, D, W-1]; init: [N, D, W-1]; t: [T_total, D] this step's pre-conv inputs."""
    width = pool.shape[-1]
    cu = batch.cu_seqlens_list
    for n, pairs in enumerate(batch.checkpoints):
        if not pairs:
            continue
        ext = torch.cat([init[n], t[cu[n]:cu[n + 1]].t().to(init.dtype)], dim=1)  # [D, W-1 + new]
        for p, dest in pairs:
            pool[dest] = ext[:, p:p + width]
