"""Token-by-token loop references: the oracle every fast path is tested against.

One recurrence covers all four variants (state S is [K, V] per head):

    S_t = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T        o_t = scale * S_t^T q_t

executed literally in this order: decay, predict with the decayed state, write b * error, read.
KDA: a_t = exp(g_t) per channel; Gated DeltaNet: one a_t per head; DeltaNet: a_t = 1;
plain linear attention: no delta correction (S += k v^T).

These are slow by design (a Python loop over T); use them only for testing and tiny inputs.
"""

from __future__ import annotations

import torch

from hyla.ops.norm import l2norm
from hyla.ops.utils import check_inputs, expand_heads, seq_bounds, work_dtype


def _loop(q, k, v, g, beta, state, scale, gate, delta):
    """Run one sequence batch. q, k: [B, T, HV, K]; v: [B, T, HV, V]; g: [B, T, HV(, K)] or None;
    beta: [B, T, HV] or None; state: [B, HV, K, V]. Returns o [B, T, HV, V] and the final state."""
    outs = []
    for t in range(q.shape[1]):
        if gate == "kda":
            state = state * g[:, t].exp()[..., None]
        elif gate == "gdn":
            state = state * g[:, t].exp()[..., None, None]
        k_t = k[:, t]
        if delta:
            predicted = torch.einsum("bhk,bhkv->bhv", k_t, state)
            error = beta[:, t, :, None] * (v[:, t] - predicted)
        else:
            error = v[:, t]
        state = state + k_t[..., None] * error[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, state))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, state


def _naive(q, k, v, g, beta, *, gate, delta, scale, initial_state, output_final_state,
           use_qk_l2norm_in_kernel, cu_seqlens):
    check_inputs(q, k, v, g, beta, gate=gate, initial_state=initial_state, cu_seqlens=cu_seqlens)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dt = work_dtype(q)
    scale = K ** -0.5 if scale is None else scale
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q.to(dt)), l2norm(k.to(dt))
    q, k = expand_heads(q.to(dt), HV), expand_heads(k.to(dt), HV)
    v = v.to(dt)
    g = None if g is None else g.to(dt)
    beta = None if beta is None else beta.to(dt)

    o = torch.full((B, T, HV, V), float("nan"), dtype=dt, device=q.device)
    finals = []
    for idx, (b, s, e) in enumerate(seq_bounds(cu_seqlens, B, T)):
        if initial_state is None:
            state = torch.zeros(1, HV, K, V, dtype=dt, device=q.device)
        else:
            state = initial_state[idx : idx + 1].to(dt)
        sl = lambda x: None if x is None else x[b : b + 1, s:e]  # noqa: E731
        o_n, state = _loop(sl(q), sl(k), sl(v), sl(g), sl(beta), state, scale, gate, delta)
        o[b : b + 1, s:e] = o_n
        finals.append(state)
    final = torch.cat(finals, 0) if output_final_state else None
    return o, final


def _out(o, final, v_dtype):
    return o.to(v_dtype), final


def naive_recurrent_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False,
                                use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """Plain (ungated, no delta) linear attention: S += k v^T, o = scale * S^T q.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; initial_state: [N, HV, K, V]; cu_seqlens: [N+1].
    Returns (o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] or None).
    """
    vd = v.dtype
    o, f = _naive(q, k, v, None, None, gate=None, delta=False, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                  cu_seqlens=cu_seqlens)
    return _out(o, f, vd)


def naive_recurrent_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """DeltaNet (a_t = 1). beta: [B, T, HV]. Other shapes as `naive_recurrent_linear_attn`."""
    vd = v.dtype
    o, f = _naive(q, k, v, None, beta, gate=None, delta=True, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                  cu_seqlens=cu_seqlens)
    return _out(o, f, vd)


def naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     cu_seqlens=None):
    """Gated DeltaNet: g: [B, T, HV] log-decay (<= 0), one per head; beta: [B, T, HV]."""
    vd = v.dtype
    o, f = _naive(q, k, v, g, beta, gate="gdn", delta=True, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                  cu_seqlens=cu_seqlens)
    return _out(o, f, vd)


def naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """Kimi Delta Attention: g: [B, T, HV, K] per-channel log-decay (<= 0); beta: [B, T, HV]."""
    vd = v.dtype
    o, f = _naive(q, k, v, g, beta, gate="kda", delta=True, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                  cu_seqlens=cu_seqlens)
    return _out(o, f, vd)
