"""Decode and speculative verify over a state pool (PyTorch; same contract as the Triton kernels).

Many sequences, a few tokens each (packed with `cu_seqlens`), step the recurrence token by token.
The loop runs over the longest sequence's token count (1 for decode, 1 + num_spec for verify) and
is vectorised over all sequences and heads, so its cost does not grow with the batch.

State pool addressing (the fla / vLLM contract):
- `ssm_state_indices` [N]: sequence n reads its initial state from slot idx[n] and writes its final
  state back to the same slot, in place.
- `ssm_state_indices` [N, 1 + num_spec] with `num_accepted_tokens` [N]: sequence n starts from slot
  idx[n, num_accepted_tokens[n] - 1] (the state after the last token accepted in the previous
  step) and writes the state after its j-th token (0-based) to slot idx[n, j]. A rejected draft
  therefore only ever lands in a slot the next step does not start from.
- A negative slot index marks a padding row (as vLLM's PAD_SLOT_ID): nothing is read or written
  for it and its outputs are 0.
- The pool [num_slots, HV, K, V] is written in place through whatever strides it has; the Triton
  kernels take it contiguous (fla's layout) or K-last (hyla.contract.state_pool, the engine's).
"""

from __future__ import annotations

import torch

from hyla.ops import utils
from hyla.ops.utils import check_inputs, expand_heads, fused_preprocessing, work_dtype


def _check_pool_args(ssm_state_indices, num_accepted_tokens, initial_state, n, lengths):
    utils.check_slot_indices(ssm_state_indices, initial_state)
    if ssm_state_indices.ndim not in (1, 2) or ssm_state_indices.shape[0] != n:
        raise ValueError(f"`ssm_state_indices` must be [N] or [N, 1+num_spec] with N={n}, "
                         f"got {tuple(ssm_state_indices.shape)}")
    if ssm_state_indices.numel() and utils.any_index_at_least(ssm_state_indices, initial_state.shape[0]):
        raise ValueError(f"`ssm_state_indices` points past the pool's {initial_state.shape[0]} slots")
    if ssm_state_indices.ndim == 2:
        width = ssm_state_indices.shape[1]
        if max(lengths, default=0) > width:
            raise ValueError(f"a sequence has {max(lengths)} tokens but `ssm_state_indices` has {width} slots per row")
        if num_accepted_tokens is None:
            raise ValueError("2-D `ssm_state_indices` (speculative verify) needs `num_accepted_tokens` [N]")
        if num_accepted_tokens.shape != (n,):
            raise ValueError(f"`num_accepted_tokens` must be [{n}], got {tuple(num_accepted_tokens.shape)}")
        if bool(((num_accepted_tokens < 1) | (num_accepted_tokens > width)).any()):
            raise ValueError(f"`num_accepted_tokens` must lie in 1..{width}")
    elif num_accepted_tokens is not None:
        raise ValueError("`num_accepted_tokens` is only valid with 2-D `ssm_state_indices`")


def _recurrent(q, k, v, g, beta, *, gate, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
               cu_seqlens, ssm_state_indices, num_accepted_tokens, use_gate_in_kernel, A_log, dt_bias,
               lower_bound, use_beta_sigmoid_in_kernel):
    pooled = ssm_state_indices is not None
    n = check_inputs(q, k, v, g, beta, gate=gate, initial_state=initial_state, cu_seqlens=cu_seqlens,
                     check_gate_sign=not use_gate_in_kernel, state_is_pool=pooled)
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    dev = q.device
    if cu_seqlens is None:
        starts = torch.arange(n, device=dev) * T
        lengths = [T] * n
    else:
        cu = cu_seqlens.to(device=dev, dtype=torch.long)
        starts = cu[:-1]
        lengths = (cu[1:] - cu[:-1]).tolist()
    if pooled:
        _check_pool_args(ssm_state_indices, num_accepted_tokens, initial_state, n, lengths)
    dt = work_dtype(q)
    out_dtype = v.dtype
    scale = K ** -0.5 if scale is None else scale
    q, k, g, beta = fused_preprocessing(
        q, k, g, beta, gate=gate, dt=dt, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    # Flatten to the packed token axis: [B*T, HV, ...]; sequence n owns [starts[n], starts[n] + len_n).
    q, k = (expand_heads(x.to(dt), HV).flatten(0, 1) for x in (q, k))
    v = v.to(dt).flatten(0, 1)
    g = None if g is None else g.to(dt).flatten(0, 1)
    beta = beta.to(dt).flatten(0, 1)

    lens = torch.tensor(lengths, device=dev)
    if pooled:
        idx = ssm_state_indices.long()
        row0 = idx if idx.ndim == 1 else idx.gather(1, (num_accepted_tokens.long() - 1)[:, None])[:, 0]
        live = row0 >= 0
        state = torch.zeros(n, HV, K, V, dtype=dt, device=dev)
        state[live] = initial_state[row0[live]].to(dt)
    elif initial_state is not None:
        state = initial_state.to(dt).clone()
        live = torch.ones(n, dtype=torch.bool, device=dev)
    else:
        state = torch.zeros(n, HV, K, V, dtype=dt, device=dev)
        live = torch.ones(n, dtype=torch.bool, device=dev)

    # NaN-filled so that an unwritten element cannot pass a test; padding rows are zeroed below.
    o = torch.full((B * T, HV, V), float("nan"), dtype=dt, device=dev)
    for t in range(max(lengths, default=0)):
        active = (lens > t) & live  # [N]
        rows = (starts + t).clamp(max=max(B * T - 1, 0))
        mask = active[:, None, None, None]
        if gate == "kda":
            decayed = state * g[rows].exp()[..., None]
        elif gate == "gdn":
            decayed = state * g[rows].exp()[..., None, None]
        else:
            decayed = state
        k_t = k[rows]
        error = beta[rows][..., None] * (v[rows] - torch.einsum("nhk,nhkv->nhv", k_t, decayed))
        stepped = decayed + k_t[..., None] * error[..., None, :]
        state = torch.where(mask, stepped, state)
        out_t = torch.einsum("nhk,nhkv->nhv", q[rows] * scale, state)
        o[rows[active]] = out_t[active]
        if pooled and idx.ndim == 2:
            dst = idx[:, t]
            w = active & (dst >= 0)
            initial_state[dst[w]] = state[w].to(initial_state.dtype)
    for n_dead in (~live).nonzero().flatten().tolist():
        o[starts[n_dead] : starts[n_dead] + lengths[n_dead]] = 0
    if pooled:
        if idx.ndim == 1:
            w = live
            initial_state[idx[w]] = state[w].to(initial_state.dtype)
        final = initial_state
    else:
        final = state if output_final_state else None
    return o.view(B, T, HV, V).to(out_dtype), final


_DOC = """
    q, k: [B, T, H, K]; v: [B, T, HV, V]; beta: [B, T, HV]; cu_seqlens: [N+1] (B must be 1).
    Without `ssm_state_indices`: initial_state [N, HV, K, V]; returns (o, final_state or None).
    With `ssm_state_indices` ([N] decode, or [N, 1+num_spec] verify with `num_accepted_tokens` [N]):
    initial_state is the pool [num_slots, HV, K, V], updated in place; returns (o, pool).
"""


def fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, cu_seqlens=None, ssm_state_indices=None,
                        num_accepted_tokens=None, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                        lower_bound=None, use_beta_sigmoid_in_kernel=False):
    """KDA decode / verify. g: [B, T, HV, K] log-decay, or raw gate input with `use_gate_in_kernel`."""
    return _recurrent(q, k, v, g, beta, gate="kda", scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                      cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices,
                      num_accepted_tokens=num_accepted_tokens, use_gate_in_kernel=use_gate_in_kernel,
                      A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                      use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                                     ssm_state_indices=None, num_accepted_tokens=None, use_gate_in_kernel=False,
                                     A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False):
    """Gated DeltaNet decode / verify. g: [B, T, HV] log-decay, or raw gate input with `use_gate_in_kernel`."""
    return _recurrent(q, k, v, g, beta, gate="gdn", scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                      cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices,
                      num_accepted_tokens=num_accepted_tokens, use_gate_in_kernel=use_gate_in_kernel,
                      A_log=A_log, dt_bias=dt_bias, lower_bound=None,
                      use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)


for _f in (fused_recurrent_kda, fused_recurrent_gated_delta_rule):
    _f.__doc__ += _DOC
