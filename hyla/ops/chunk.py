"""Chunkwise-parallel prefill for KDA, Gated DeltaNet and DeltaNet (PyTorch, differentiable).

Inside a chunk of C tokens, with G_t = sum_{s <= t} g_s the cumulative log-decay from the chunk
start (so G is non-increasing and every G_i - G_j with j <= i is <= 0), the delta-rule writes
u_t = b_t (v_t - (Diag(a_t) S_{t-1})^T k_t) satisfy a unit-lower-triangular system:

    (I + M) u = Diag(b) V - Diag(b) (K * e^G) S0,    M[i, j] = b_i sum_d k_id k_jd e^{G_id - G_jd}, j < i

so u = U - W S0 with U = (I+M)^-1 Diag(b) V and W = (I+M)^-1 Diag(b) (K * e^G) (the UT / WY form).
Then, per chunk and in order:

    o_i  = scale * [ (q_i * e^{G_i}) S0 + sum_{j <= i} A[i, j] u_j ],   A[i, j] = sum_d q_id k_jd e^{G_id - G_jd}
    S_r  = Diag(e^{G_r}) S0 + sum_{j <= r} (k_j * e^{G_r - G_j}) u_j^T       (r = C gives the next chunk's S0)

The last line at any r is what `checkpoint_positions` returns: the exact state after any token
count, exported from the same pass without splitting it.

Numerical stability: the textbook form factors e^{G_i - G_j} = e^{G_i} * e^{-G_j}, and e^{-G_j}
overflows once a chunk's cumulative decay passes ~88 (fp32) -- 64 tokens of softplus gates easily
reach -1e3 per token. Here no positive exponent is ever evaluated: A and M are built in 16-token
sub-blocks; off-diagonal sub-blocks split the decay at a reference token n (the first token of the
row sub-block, so i >= n > j and both e^{G_i - G_n} and e^{G_n - G_j} are <= 1) and become matmuls;
diagonal sub-blocks use masked pairwise differences. Tiny factors may underflow to 0, which is
exact to working precision because the true product is smaller still.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyla.ops.utils import (check_checkpoints, check_chunk_pool, check_inputs, expand_heads, fused_preprocessing,
                            work_dtype)

SUB_BLOCK = 16


# Decay span up to which a block is computed in factorised form, e^{G_i - G_j} = e^{G_i - G_r} *
# e^{G_r - G_j} around a reference token r inside it: every factor then lies in [e^-span, e^span],
# inside the working dtype's normal range (fp32: e^-87 .. e^88), and each product carries the
# same relative rounding as the direct exponential. Products below the diagonal are <= |x||y|;
# only the masked ones above it can overflow, and those are discarded with torch.where. Blocks
# that decay further (unbounded v1 gates) take the sub-block / masked forms, which never
# evaluate a positive exponent.
FACTORED_SPAN = {torch.float32: 80.0, torch.float64: 600.0}


def _factored(x, y, G, ref, limit, dt):
    """Factors of sum_d x_id y_jd e^{G_id - G_jd} around `ref`: returns (x * e^{G - ref},
    (y * e^{ref - G})^T). x, y, G: [..., R, K]. The clamp only bites in blocks over the span
    limit, whose values are recomputed: they stay finite, so no inf * 0 reaches autograd."""
    rel = (G - ref).to(dt).clamp(-limit, limit)  # the fp64 subtraction keeps small gaps exact
    return x * rel.exp(), (y * (-rel).exp()).transpose(-1, -2)


def _masked_blocks(qb, kb, Gb, tri, strict):
    """Diagonal sub-blocks by masked pairwise differences: exponents only where j <= i (all <= 0).
    qb, kb: [M, S, K]; Gb: [M, S, K] fp64. Returns two [M, S, S]."""
    diff = (Gb[..., :, None, :] - Gb[..., None, :, :]).masked_fill(~tri[..., None], 0.0)
    kE = kb[..., None, :, :] * diff.to(kb.dtype).exp()  # [M, S(i), S(j), K]
    return (torch.einsum("...ik,...ijk->...ij", qb, kE) * tri,
            torch.einsum("...ik,...ijk->...ij", kb, kE) * strict)


def _replace(full, unsafe, fn):
    """Recompute the entries selected by the boolean mask `unsafe` with fn(index) (out of place)."""
    if not bool(unsafe.any()):
        return full
    idx = unsafe.nonzero(as_tuple=True)
    return tuple(f.index_put(idx, r) for f, r in zip(full, fn(idx)))


def _masks(n, device):
    tri = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return tri, tri & ~torch.eye(n, dtype=torch.bool, device=device)


def _kda_intra(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decayed Gram matrices of one chunk, per-channel gate.

    q, k: [..., C, K] (work dtype); G: [..., C, K] cumulative log-decay in fp64.
    Returns A_qk [..., C, C] (j <= i) and A_kk [..., C, C] (j < i) with
    A_xk[i, j] = sum_d x_id k_jd exp(G_id - G_jd); entries above the diagonal are 0.

    Chunks whose whole span is within FACTORED_SPAN are two matmuls (reference: the chunk start).
    The others go to `_kda_intra_blocked`.
    """
    dt, limit = q.dtype, FACTORED_SPAN[q.dtype]
    tri, strict = _masks(q.shape[-2], q.device)
    xq, k_inv = _factored(q, k, G, 0.0, limit, dt)
    xk, _ = _factored(k, k, G, 0.0, limit, dt)
    # torch.where, not a multiply: above the diagonal the factored products may overflow to inf
    # (e^{G_i - G_j} with j > i), and inf * 0 would be NaN.
    zero = q.new_zeros(())
    full = (torch.where(tri, xq @ k_inv, zero), torch.where(strict, xk @ k_inv, zero))
    unsafe = (-G[..., -1, :]).amax(-1) > limit  # G is non-increasing: its last row is the span
    return _replace(full, unsafe, lambda idx: _kda_intra_blocked(q[idx], k[idx], G[idx]))


def _kda_intra_blocked(q, k, G):
    """`_kda_intra` for chunks with a large decay span. q, k: [M, C, K]; G: [M, C, K] fp64.

    16-token sub-blocks: an off-diagonal block uses the first token r of its row block as the
    reference (i >= r > j, so both factors are <= 1) and is a matmul; a diagonal block is factored
    around its own first token when its span allows, and uses masked differences otherwise.
    """
    C = q.shape[-2]
    dt, limit, dev = q.dtype, FACTORED_SPAN[q.dtype], q.device
    S = SUB_BLOCK if C % SUB_BLOCK == 0 else C
    nb = C // S
    qb, kb, Gb = (x.unflatten(-2, (nb, S)) for x in (q, k, G))  # [M, nb, S, K]
    tri, strict = _masks(S, dev)

    xq, k_inv = _factored(qb, kb, Gb, Gb[..., :1, :], limit, dt)
    xk, _ = _factored(kb, kb, Gb, Gb[..., :1, :], limit, dt)
    zero = q.new_zeros(())
    diag = (torch.where(tri, xq @ k_inv, zero), torch.where(strict, xk @ k_inv, zero))  # [M, nb, S, S]
    unsafe = (Gb[..., 0, :] - Gb[..., -1, :]).amax(-1) > limit  # [M, nb]
    d_qk, d_kk = _replace(diag, unsafe, lambda idx: _masked_blocks(qb[idx], kb[idx], Gb[idx], tri, strict))
    if nb == 1:
        return d_qk.squeeze(-3), d_kk.squeeze(-3)

    G_ref = Gb[..., 1:, 0, :]  # [M, nb-1, K]: reference token of row blocks 1..nb-1
    row_scale = (Gb[..., 1:, :, :] - G_ref[..., None, :]).to(dt).exp()  # [M, nb-1, S, K], <= 1
    col_ok = torch.arange(C, device=dev)[None, :] < (torch.arange(1, nb, device=dev) * S)[:, None]  # j < r
    col_exp = (G_ref[..., :, None, :] - G[..., None, :, :]).masked_fill(~col_ok[..., None], 0.0)
    k_col = (k[..., None, :, :] * col_exp.to(dt).exp() * col_ok[..., None]).transpose(-1, -2)  # [M, nb-1, K, C]
    off_qk = (qb[..., 1:, :, :] * row_scale) @ k_col  # [M, nb-1, S, C]
    off_kk = (kb[..., 1:, :, :] * row_scale) @ k_col

    def assemble(diag, off):
        rows = []
        for a in range(nb):
            parts = [off[..., a - 1, :, : a * S]] if a else []
            parts.append(diag[..., a, :, :])
            if (a + 1) * S < C:
                parts.append(diag.new_zeros(*diag.shape[:-3], S, C - (a + 1) * S))
            rows.append(torch.cat(parts, dim=-1))
        return torch.cat(rows, dim=-2)

    return assemble(d_qk, off_qk), assemble(d_kk, off_kk)


def _scalar_intra(q, k, G):
    """Same as `_kda_intra` for one gate per head (G: [..., C]) or no gate (G None): the decay
    matrix e^{G_i - G_j} is a [C, C] factor, evaluated only on the lower triangle."""
    C = q.shape[-2]
    tri = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = tri & ~torch.eye(C, dtype=torch.bool, device=q.device)
    a_qk = q @ k.transpose(-1, -2)
    a_kk = k @ k.transpose(-1, -2)
    if G is not None:
        decay = (G[..., :, None] - G[..., None, :]).masked_fill(~tri, 0.0).exp().to(q.dtype)
        a_qk, a_kk = a_qk * decay, a_kk * decay
    return a_qk * tri, a_kk * strict


class _Packing:
    """Maps packed varlen tokens [1, T] (or a fixed-length batch [B, T]) to a padded layout
    [N, NC * C] where every sequence starts at a chunk boundary. Padding tokens get k = v = g =
    beta = 0, which leaves the state untouched, so final states need no special casing."""

    def __init__(self, cu_seqlens, B, T, chunk_size, device):
        if cu_seqlens is None:
            self.lengths = [T] * B
            self.dest = None
        else:
            cu = cu_seqlens.to(device=device, dtype=torch.long)
            self.lengths = (cu[1:] - cu[:-1]).tolist()
        longest = max(self.lengths, default=0)
        # Short inputs use a smaller chunk (a multiple of the sub-block): same math, less padding.
        c = min(chunk_size, max(SUB_BLOCK, -(-longest // SUB_BLOCK) * SUB_BLOCK))
        self.C = c if chunk_size >= SUB_BLOCK else chunk_size
        self.NC = -(-longest // self.C)
        self.N = len(self.lengths)
        self.Tp = self.NC * self.C
        if cu_seqlens is not None:
            seq = torch.repeat_interleave(torch.arange(self.N, device=device), cu[1:] - cu[:-1])
            self.dest = seq * self.Tp + torch.arange(T, device=device) - cu[:-1][seq]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [N, Tp, ...] with zeros in the padding."""
        if self.dest is None:
            return F.pad(x, (0, 0) * (x.ndim - 2) + (0, self.Tp - x.shape[1]))
        flat = x.new_zeros(self.N * self.Tp, *x.shape[2:])
        return flat.index_copy(0, self.dest, x[0]).view(self.N, self.Tp, *x.shape[2:])

    def unpad(self, x: torch.Tensor, T: int) -> torch.Tensor:
        """[N, Tp, ...] -> [B, T, ...]."""
        if self.dest is None:
            return x[:, :T]
        return x.reshape(self.N * self.Tp, *x.shape[2:]).index_select(0, self.dest).unsqueeze(0)


def _to_chunks(x: torch.Tensor, nc: int, c: int) -> torch.Tensor:
    """[N, NC*C, H, ...] -> [N, H, NC, C, ...]."""
    x = x.unflatten(1, (nc, c))
    return x.movedim(3, 1)


def _chunk_forward(q, k, v, g, beta, scale, S0, packing: _Packing, gate, ckpts):
    """Padded core. q, k: [N, Tp, HV, K]; v: [N, Tp, HV, V]; g: [N, Tp, HV(, K)] or None;
    beta: [N, Tp, HV]; S0: [N, HV, K, V]. Returns o [N, Tp, HV, V], final state, checkpoints."""
    NC, C = packing.NC, packing.C
    qc, kc, vc = (_to_chunks(x, NC, C) for x in (q, k, v))  # [N, HV, NC, C, K|V]
    bc = _to_chunks(beta, NC, C)  # [N, HV, NC, C]
    dt = q.dtype
    # The cumulative log-decay is accumulated in fp64 even for fp32 work: with unbounded gates G
    # reaches ~-1e5 inside a chunk, where an fp32 ulp (~0.01) would corrupt the small differences
    # G_i - G_j between later tokens. Every exponential is cast back to the working dtype.
    if gate == "kda":
        G = _to_chunks(g, NC, C).double().cumsum(-2)  # [N, HV, NC, C, K]
        a_qk, a_kk = _kda_intra(qc, kc, G)
        decay_to = G.to(dt).exp()  # e^{G_i}, <= 1 (G's own rounding only matters where e^G underflows)
        k_tail = kc * (G[..., -1:, :] - G).to(dt).exp()  # differences formed in fp64
        gamma_last = decay_to[..., -1, :, None]  # [N, HV, NC, K, 1]
    elif gate == "gdn":
        G = _to_chunks(g, NC, C).double().cumsum(-1)  # [N, HV, NC, C]
        a_qk, a_kk = _scalar_intra(qc, kc, G)
        decay_to = G.to(dt).exp()[..., None]
        k_tail = kc * (G[..., -1:] - G).to(dt).exp()[..., None]
        gamma_last = decay_to[..., -1, :, None]  # [N, HV, NC, 1, 1]
    else:
        G = None
        a_qk, a_kk = _scalar_intra(qc, kc, None)
        decay_to = torch.ones_like(qc[..., :1])
        k_tail = kc
        gamma_last = torch.ones_like(qc[..., :1, :1])

    rhs = torch.cat([bc[..., None] * vc, bc[..., None] * (kc * decay_to)], dim=-1)
    uw = torch.linalg.solve_triangular(bc[..., None] * a_kk, rhs, upper=False, unitriangular=True)
    Vd = v.shape[-1]
    U, W = uw[..., :Vd], uw[..., Vd:]
    q_dec = qc * decay_to * scale
    a_qk = a_qk * scale

    by_chunk: dict[int, list[tuple[int, int, int]]] = {}
    for n, ps in enumerate(ckpts or []):
        for i, p in enumerate(ps):
            by_chunk.setdefault((p - 1) // C, []).append((n, i, p - (p - 1) // C * C))
    found: dict[tuple[int, int], torch.Tensor] = {}

    S = S0
    outs = []
    for c in range(NC):
        v_new = U[:, :, c] - W[:, :, c] @ S  # [N, HV, C, V]: the u_t of this chunk
        outs.append(q_dec[:, :, c] @ S + a_qk[:, :, c] @ v_new)
        for n, i, r in by_chunk.get(c, []):
            found[(n, i)] = _state_at(S[n], kc[n, :, c, :r], v_new[n, :, :r], G, n, c, r, gate)
        S = gamma_last[:, :, c] * S + k_tail[:, :, c].transpose(-1, -2) @ v_new

    o = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape[0], v.shape[2], 0, C, Vd)
    o = o.flatten(2, 3).movedim(1, 2)  # [N, Tp, HV, V]
    ck = None
    if ckpts is not None:
        ck = [torch.stack([found[(n, i)] for i in range(len(ps))]) if ps else S0.new_zeros(0, *S0.shape[1:])
              for n, ps in enumerate(ckpts)]
    return o, S, ck


def _state_at(S0, k, u, G, n, c, r, gate):
    """State after the first r tokens of chunk c of sequence n. S0: [HV, K, V] (chunk start);
    k: [HV, r, K]; u: [HV, r, V]."""
    if gate == "kda":
        Gc = G[n, :, c, :r]  # [HV, r, K]
        dt = S0.dtype
        return Gc[:, -1, :, None].exp().to(dt) * S0 + (k * (Gc[:, -1:, :] - Gc).exp().to(dt)).transpose(-1, -2) @ u
    if gate == "gdn":
        Gc = G[n, :, c, :r]  # [HV, r]
        dt = S0.dtype
        return (Gc[:, -1, None, None].exp().to(dt) * S0
                + (k * (Gc[:, -1:] - Gc).exp().to(dt)[..., None]).transpose(-1, -2) @ u)
    return S0 + k.transpose(-1, -2) @ u


def _chunk(q, k, v, g, beta, *, gate, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
           cu_seqlens, chunk_size, checkpoint_positions, use_gate_in_kernel, A_log, dt_bias, lower_bound,
           use_beta_sigmoid_in_kernel, ssm_state_indices, has_initial_state):
    if not isinstance(chunk_size, int) or chunk_size < 1 or (chunk_size > SUB_BLOCK and chunk_size % SUB_BLOCK):
        raise ValueError(f"`chunk_size` must be <= {SUB_BLOCK} or a multiple of {SUB_BLOCK}, got {chunk_size}")
    pooled = ssm_state_indices is not None
    n = check_inputs(q, k, v, g, beta, gate=gate, initial_state=initial_state, cu_seqlens=cu_seqlens,
                     check_gate_sign=not use_gate_in_kernel, state_is_pool=pooled)
    check_chunk_pool(initial_state, ssm_state_indices, has_initial_state, n)
    B, T, H, K = q.shape
    HV = v.shape[2]
    dt = work_dtype(q)
    scale = K ** -0.5 if scale is None else scale
    q, k, g, beta = fused_preprocessing(
        q, k, g, beta, gate=gate, dt=dt, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    q, k = expand_heads(q.to(dt), HV), expand_heads(k.to(dt), HV)

    packing = _Packing(cu_seqlens, B, T, chunk_size, q.device)
    ckpts = None if checkpoint_positions is None else check_checkpoints(checkpoint_positions, packing.lengths)
    if initial_state is None:
        S0 = q.new_zeros(packing.N, HV, K, v.shape[-1])
    elif pooled:
        slots = ssm_state_indices.long()
        S0 = initial_state.index_select(0, slots).to(dt)
        if has_initial_state is not None:
            S0 = torch.where(has_initial_state[:, None, None, None], S0, 0)
    else:
        S0 = initial_state.to(dt)
    pad = packing.pad
    o, S, ck = _chunk_forward(pad(q), pad(k), pad(v.to(dt)), None if g is None else pad(g.to(dt)),
                              pad(beta.to(dt)), scale, S0, packing, gate, ckpts)
    o = packing.unpad(o, T).to(v.dtype)
    if pooled:  # the slots are distinct: as pool[idx] = S
        initial_state.index_copy_(0, slots, S.to(initial_state.dtype))
        final = initial_state
    else:
        final = S if output_final_state else None
    return (o, final) if ckpts is None else (o, final, ck)


_DOC_ARGS = """
    q, k: [B, T, H, K]; v: [B, T, HV, V] (HV a multiple of H: grouped value heads);
    beta: [B, T, HV]; initial_state: [N, HV, K, V]; cu_seqlens: [N+1] (B must be 1).
    checkpoint_positions: one list of token counts p (0 < p <= len) per sequence; when given, a
    third element is returned: a list with one [len(p_n), HV, K, V] tensor per sequence holding the
    state after exactly p tokens of that sequence, in the order given.
    Returns (o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] fp32 (fp64 for fp64 inputs) or None).
    State pool (the recurrent ops' contract, without padding rows): with `ssm_state_indices` [N]
    (distinct slots >= 0), `initial_state` is a pool [num_slots, HV, K, V] (contiguous or K-last);
    sequence n starts from slot idx[n] (from zeros where `has_initial_state` [N] bool is False)
    and its final state is written back to that slot in place, whatever `output_final_state`
    says; final_state is then the pool itself.
"""


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64, checkpoint_positions=None,
              use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
              use_beta_sigmoid_in_kernel=False, ssm_state_indices=None, has_initial_state=None):
    """Chunkwise KDA. g: [B, T, HV, K] per-channel log-decay (<= 0), or the raw gate input when
    `use_gate_in_kernel` (then g = kda_gate(g, A_log, dt_bias, lower_bound))."""
    return _chunk(q, k, v, g, beta, gate="kda", scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                  cu_seqlens=cu_seqlens, chunk_size=chunk_size, checkpoint_positions=checkpoint_positions,
                  use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                  lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                  ssm_state_indices=ssm_state_indices, has_initial_state=has_initial_state)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64,
                           checkpoint_positions=None, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                           use_beta_sigmoid_in_kernel=False, ssm_state_indices=None, has_initial_state=None):
    """Chunkwise Gated DeltaNet. g: [B, T, HV] log-decay per head (<= 0), or the raw gate input
    when `use_gate_in_kernel` (then g = gdn_gate(g, A_log, dt_bias))."""
    return _chunk(q, k, v, g, beta, gate="gdn", scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                  cu_seqlens=cu_seqlens, chunk_size=chunk_size, checkpoint_positions=checkpoint_positions,
                  use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=None,
                  use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, ssm_state_indices=ssm_state_indices,
                  has_initial_state=has_initial_state)


def chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64, checkpoint_positions=None,
                     use_beta_sigmoid_in_kernel=False, ssm_state_indices=None, has_initial_state=None):
    """Chunkwise DeltaNet (no decay)."""
    return _chunk(q, k, v, None, beta, gate=None, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                  cu_seqlens=cu_seqlens, chunk_size=chunk_size, checkpoint_positions=checkpoint_positions,
                  use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
                  use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, ssm_state_indices=ssm_state_indices,
                  has_initial_state=has_initial_state)


for _f in (chunk_kda, chunk_gated_delta_rule, chunk_delta_rule):
    _f.__doc__ += _DOC_ARGS
