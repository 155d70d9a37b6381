"""Short causal depthwise convolution (the q/k/v "short conv" of KDA / GDN layers).

y[t, d] = act(bias[d] + sum_{j=0}^{W-1} weight[d, j] * x[t - (W-1) + j, d])

where positions before a sequence's start come from its conv state: the last W-1 PRE-conv
inputs seen so far, oldest first (``state[n, d, W-2]`` is the most recent). A fresh sequence
starts from zeros. This is the layout of the vLLM / SGLang conv-state pool
``[num_slots, D, W-1]``.

Prefill (:func:`causal_conv1d_fn`) packs every sequence into one "extended" stream in which each
sequence is preceded by its W-1 state columns; one depthwise conv over that stream then never
mixes sequences, with no Python loop over tokens or sequences. Decode
(:func:`causal_conv1d_update`) does the same per slot for 1..L new tokens and writes the new
window back into the pool in place. Speculative verify (:func:`causal_conv1d_verify`) reads each
row's window from one slot and writes the window after every verified token to a slot of its
own. hyla.ops.dispatch routes the last two to Triton kernels on CUDA.

:func:`causal_conv1d_update_packed` is a decode step's convs at once when their pre-conv inputs
are columns of one tensor (a fused projection's output): KDA's three convs, or GDN's one conv cut
into its q / k / v parts. The Triton version runs them in one launch, reads x in place (any row
stride, optionally through a column map) and writes each output part contiguously.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyla.ops.dtypes import work_dtype

from hyla.ops import utils

__all__ = ["causal_conv1d_fn", "causal_conv1d_update", "causal_conv1d_verify", "causal_conv1d_update_packed"]

_ACTIVATIONS = (None, "silu", "swish")


def _check_weight_bias(weight, bias, D: int) -> torch.Tensor:
    """Return weight as [D, W]; accepts nn.Conv1d's [D, 1, W] too."""
    if not isinstance(weight, torch.Tensor):
        raise ValueError("weight must be a tensor [D, W]")
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 1:
        raise ValueError(f"weight must be [D={D}, W], got shape {tuple(weight.shape)}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (D,)):
        got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias must be [D={D}] or None, got {got}")
    return weight


def _check_activation(activation) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")


def depthwise_valid_conv(ext: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Valid depthwise conv as W shifted multiply-adds. ext: [N, D, L + W - 1]; weight: [D, W].
    Returns [N, D, L]. With W = 4 this is several times faster on the CPU than a grouped
    F.conv1d (whose oneDNN path is slow for depthwise kernels, and dominated decode steps)."""
    W = weight.shape[-1]
    L = ext.shape[-1] - W + 1
    y = ext[..., :L] * weight[:, :1]
    for w in range(1, W):
        y = y + ext[..., w : w + L] * weight[:, w : w + 1]
    return y


def _conv(ext: torch.Tensor, weight: torch.Tensor, bias, activation) -> torch.Tensor:
    """Valid depthwise conv. ext: [N, D, L + W - 1] (work dtype) -> [N, D, L]."""
    dt = ext.dtype
    y = depthwise_valid_conv(ext, weight.to(dt))
    if bias is not None:
        y = y + bias.to(dt)[:, None]
    return F.silu(y) if activation is not None else y


def _check_cu_seqlens(cu_seqlens, B: int, T: int) -> torch.Tensor:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D integer tensor [N+1]")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
        raise ValueError(f"cu_seqlens must be integer, got {cu_seqlens.dtype}")
    if B != 1:
        raise ValueError(f"with cu_seqlens, x must have batch size 1 (packed), got B={B}")
    cu = cu_seqlens.long()
    if int(cu[0]) != 0 or int(cu[-1]) != T or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T={T}, got {cu.tolist()}")
    return cu


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal depthwise conv over whole sequences (prefill).

    x: [B, T, D]; weight: [D, W] (or [D, 1, W]); bias: [D] | None; activation: None | "silu";
    initial_state: [N, D, W-1] | None (None = zeros); cu_seqlens: [N+1] | None (then B == 1 and
    sequences are packed along T; otherwise N = B).
    Returns y: [B, T, D] in x.dtype, and final_state: [N, D, W-1] (the last W-1 pre-conv inputs
    of each sequence, left-filled from its initial state or zeros when it is shorter than W-1;
    dtype of initial_state if given, else x.dtype) or None.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        raise ValueError("x must be a floating-point tensor [B, T, D]")
    B, T, D = x.shape
    weight = _check_weight_bias(weight, bias, D)
    _check_activation(activation)
    P = weight.shape[1] - 1  # state width
    if cu_seqlens is None:
        N = B
        cu = torch.arange(B + 1, device=x.device) * T
    else:
        cu = _check_cu_seqlens(cu_seqlens, B, T).to(x.device)
        N = cu.numel() - 1
    if initial_state is not None and (
        not isinstance(initial_state, torch.Tensor) or initial_state.shape != (N, D, P)
    ):
        got = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else initial_state
        raise ValueError(f"initial_state must be [N={N}, D={D}, W-1={P}], got {got}")

    dt = work_dtype(x)
    xs = x.reshape(B * T, D).to(dt)
    # Extended stream: sequence n occupies [cu[n] + n*P, cu[n+1] + (n+1)*P), its first P rows
    # being its state. Token t of sequence n sits at t + (n+1)*P.
    seq = torch.searchsorted(cu[1:], torch.arange(B * T, device=x.device), right=True)  # [B*T]
    tok_pos = torch.arange(B * T, device=x.device) + (seq + 1) * P
    state_pos = (cu[:-1] + torch.arange(N, device=x.device) * P)[:, None] + torch.arange(
        P, device=x.device
    )  # [N, P]
    ext = xs.new_zeros(B * T + N * P, D)
    ext[tok_pos] = xs
    if initial_state is not None:
        ext[state_pos.reshape(-1)] = initial_state.transpose(1, 2).reshape(N * P, D).to(dt)

    if B * T > 0:
        y_ext = _conv(ext.t().unsqueeze(0), weight, bias, activation)[0]  # [D, B*T + (N-1)*P]
        # The output at extended position p is stored at index p - P.
        y = y_ext[:, tok_pos - P].t().reshape(B, T, D).to(x.dtype)
    else:
        y = x.new_zeros(B, T, D)

    final = None
    if output_final_state:
        end = cu[1:] + (torch.arange(N, device=x.device) + 1) * P  # [N], one past the last row
        rows = end[:, None] - P + torch.arange(P, device=x.device)  # [N, P]
        out_dtype = x.dtype if initial_state is None else initial_state.dtype
        final = ext[rows.reshape(-1)].reshape(N, P, D).transpose(1, 2).to(out_dtype).contiguous()
    return y, final


def _check_conv_state(conv_state, D: int, P: int) -> None:
    if not isinstance(conv_state, torch.Tensor) or conv_state.dim() != 3 or conv_state.shape[1:] != (D, P):
        got = tuple(conv_state.shape) if isinstance(conv_state, torch.Tensor) else conv_state
        raise ValueError(f"conv_state must be [num_slots, D={D}, W-1={P}], got {got}")


def _check_update_args(x, conv_state, weight, bias, activation, conv_state_indices):
    """Checks of causal_conv1d_update (shared with the Triton version) -> (x as [N, L, D], whether
    x was [N, D], weight [D, W], the slot index per row as int64). The range check reads the
    indices on the host, so it is skipped while a CUDA graph is being captured."""
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or not x.is_floating_point():
        raise ValueError("x must be a floating-point tensor [N, L, D] or [N, D]")
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(1) if squeeze else x
    N, L, D = x3.shape
    weight = _check_weight_bias(weight, bias, D)
    _check_activation(activation)
    _check_conv_state(conv_state, D, weight.shape[1] - 1)
    if conv_state_indices is None:
        if conv_state.shape[0] < N:
            raise ValueError(f"conv_state has {conv_state.shape[0]} slots, fewer than N={N} rows")
        return x3, squeeze, weight, torch.arange(N, device=x.device)
    if (
        not isinstance(conv_state_indices, torch.Tensor)
        or conv_state_indices.shape != (N,)
        or conv_state_indices.is_floating_point()
    ):
        got = getattr(conv_state_indices, "shape", conv_state_indices)
        raise ValueError(f"conv_state_indices must be an integer tensor [N={N}], got {got}")
    idx = conv_state_indices.long().to(x.device)
    if utils.any_index_at_least(conv_state_indices, conv_state.shape[0]):
        raise ValueError(f"conv_state_indices out of range for {conv_state.shape[0]} slots")
    return x3, squeeze, weight, idx


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    conv_state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv for 1..L new tokens per sequence (decode / verify), state in place.

    x: [N, L, D] (or [N, D] for one token); conv_state: [num_slots, D, W-1], read and written IN
    PLACE; weight: [D, W]; bias: [D] | None; conv_state_indices: [N] | None (None = rows 0..N-1).
    A negative index marks a padding row: its state is untouched and its output is zeros (while a
    CUDA graph is being captured, nothing is checked and a padding row writes the pool's last slot).
    Two live rows must not share a slot. Returns y with the shape and dtype of x.
    """
    x3, squeeze, weight, idx = _check_update_args(x, conv_state, weight, bias, activation, conv_state_indices)
    N, L, D = x3.shape
    P = weight.shape[1] - 1

    live = idx >= 0  # [N]
    dt = work_dtype(x)
    old = conv_state[idx.clamp(min=0)].to(dt)  # [N, D, P]
    ext = torch.cat([old, x3.transpose(1, 2).to(dt)], dim=2)  # [N, D, P + L]
    y = _conv(ext, weight, bias, activation)  # [N, D, L]
    y = torch.where(live[:, None, None], y, torch.zeros((), dtype=dt, device=y.device))
    if P > 0 and utils.is_capturing(idx):
        # Boolean selection would sync, which a CUDA graph capture forbids: a padding row writes
        # conv_state[-1] instead (python indexing), so a capturing caller keeps the last slot as scratch.
        conv_state[idx] = ext[:, :, -P:].to(conv_state.dtype)
    elif P > 0:
        # Boolean selection keeps padding rows from writing anything (a clamped index would race
        # with a live row that owns slot 0).
        conv_state[idx[live]] = ext[live][:, :, -P:].to(conv_state.dtype)
    y = y.transpose(1, 2).to(x.dtype)
    return y.squeeze(1) if squeeze else y


def _check_verify_args(x, conv_state, weight, bias, activation, read_indices, write_indices) -> torch.Tensor:
    """Shape checks of causal_conv1d_verify (shared with the Triton version); returns weight [D, W]."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        raise ValueError("x must be a floating-point tensor [N, L, D]")
    N, L, D = x.shape
    weight = _check_weight_bias(weight, bias, D)
    _check_activation(activation)
    _check_conv_state(conv_state, D, weight.shape[1] - 1)
    if (not isinstance(read_indices, torch.Tensor) or read_indices.shape != (N,)
            or read_indices.is_floating_point()):
        raise ValueError(f"read_indices must be an integer tensor [N={N}]")
    if write_indices is not None and (not isinstance(write_indices, torch.Tensor)
                                      or write_indices.shape != (N, L) or write_indices.is_floating_point()):
        raise ValueError(f"write_indices must be an integer tensor [N={N}, L={L}] or None")
    return weight


def causal_conv1d_verify(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    read_indices: torch.Tensor,
    write_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv of a speculative verify step: L tokens per row, per-position windows.

    x: [N, L, D] the pre-conv inputs of each row's verified tokens (a row shorter than L is
    zero-padded; its padding positions must not be written); conv_state: [num_slots, D, W-1];
    read_indices: [N] the slot holding each row's window before its first token; write_indices:
    [N, L] or None: the window after token j of row n goes to slot write_indices[n, j] when that
    is >= 0 (while a CUDA graph is captured a -1 writes the pool's last slot, kept as scratch).
    Returns y: [N, L, D] in x.dtype. Rows whose read index is -1 (padding) read the pool's last
    slot; their outputs mean nothing.
    """
    weight = _check_verify_args(x, conv_state, weight, bias, activation, read_indices, write_indices)
    N, L, D = x.shape
    P = weight.shape[1] - 1
    w0 = conv_state[read_indices]  # [N, D, P]
    ext = torch.cat([w0, x.transpose(1, 2).to(w0.dtype)], dim=2)  # [N, D, P + L]
    y = _conv(ext.to(work_dtype(ext)), weight, bias, activation).to(x.dtype)  # [N, D, L]
    if write_indices is not None and P > 0:
        windows = ext.unfold(2, P, 1)[:, :, 1:].permute(0, 2, 1, 3).flatten(0, 1)  # [N * L, D, P]
        dst = write_indices.reshape(-1)
        if utils.is_capturing(dst):
            conv_state[dst] = windows.to(conv_state.dtype)
        else:
            keep = dst >= 0
            conv_state[dst[keep]] = windows[keep].to(conv_state.dtype)
    return y.transpose(1, 2)


def _check_packed_args(x, conv_states, weights, sizes, channels):
    """Checks of causal_conv1d_update_packed (shared with the Triton version) -> (x as
    [N, L, cols], squeeze, total channels)."""
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or not x.is_floating_point():
        raise ValueError("x must be a floating-point tensor [N, L, cols] or [N, cols]")
    if not (len(conv_states) == len(weights) == len(sizes)) or not conv_states:
        raise ValueError("conv_states, weights and sizes need one entry per conv")
    for st, part in zip(conv_states, sizes):
        if not part or any(int(d) <= 0 for d in part) or st.dim() != 3 or st.shape[1] != sum(part):
            raise ValueError(f"conv state {tuple(st.shape)} does not have sum({list(part)}) channels")
    total = sum(sum(part) for part in sizes)
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(1) if squeeze else x
    if channels is None:
        if x3.shape[-1] < total:
            raise ValueError(f"x has {x3.shape[-1]} columns, fewer than the convs' {total} channels")
    elif (not isinstance(channels, torch.Tensor) or channels.shape != (total,) or channels.is_floating_point()):
        raise ValueError(f"channels must be an integer tensor [{total}]")
    return x3, squeeze, total


def causal_conv1d_update_packed(
    x: torch.Tensor,
    conv_states,
    weights,
    sizes,
    activation: str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    channels: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """causal_conv1d_update of several convs whose pre-conv inputs are columns of one tensor.

    x: [N, L, cols] or [N, cols]; channels: None (the convs' channels are x's first columns, in
    order) or an integer tensor [sum of all sizes] giving x's column of each channel;
    conv_states: one pool [num_slots, D_i, W-1] per conv, updated in place; weights: one [D_i, W]
    (or nn.Conv1d's [D_i, 1, W]) per conv; sizes: per conv, the sizes of the output parts its D_i
    channels are cut into (sum = D_i). conv_state_indices as in causal_conv1d_update.
    Returns the output parts in order, each [N, L, part] (or [N, part]) in x.dtype.
    """
    x3, squeeze, total = _check_packed_args(x, conv_states, weights, sizes, channels)
    xs = x3.index_select(-1, channels.to(x.device).long()) if channels is not None else x3[..., :total]
    out, c0 = [], 0
    for st, w, part in zip(conv_states, weights, sizes):
        d = sum(part)
        y = causal_conv1d_update(xs[..., c0:c0 + d], st, w, None, activation, conv_state_indices)
        out.extend(y.split(list(part), dim=-1))
        c0 += d
    return [y.squeeze(1) for y in out] if squeeze else out


def _check_prefill_packed_args(x, conv_states, weights, sizes, channels, state_indices, has_context,
                               cu_seqlens, checkpoints):
    """Checks of causal_conv1d_prefill_packed (shared with the Triton version) -> (x as [T, cols],
    total channels, N)."""
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or (x.dim() == 3 and x.shape[0] != 1):
        raise ValueError("x must be a tensor [T, cols] or [1, T, cols] (sequences packed along T)")
    x2 = x[0] if x.dim() == 3 else x
    _, _, total = _check_packed_args(x2[:, None], conv_states, weights, sizes, channels)
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a tensor [N+1]")
    N = cu_seqlens.numel() - 1
    for name, t in (("state_indices", state_indices), ("has_context", has_context)):
        if not isinstance(t, torch.Tensor) or t.shape != (N,):
            raise ValueError(f"{name} must be a tensor [N={N}]")
    if checkpoints is not None and (len(checkpoints) != 3 or any(
            not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape != checkpoints[0].shape for t in checkpoints)):
        raise ValueError("checkpoints must be three equal-length tensors (sequence, tokens, slot) or None")
    return x2, total, N


def causal_conv1d_prefill_packed(
    x: torch.Tensor,
    conv_states,
    weights,
    sizes,
    activation: str | None = None,
    *,
    state_indices: torch.Tensor,
    has_context: torch.Tensor,
    cu_seqlens: torch.Tensor,
    channels: torch.Tensor | None = None,
    checkpoints: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """The prefill of several short convs whose pre-conv inputs are columns of one tensor, their
    windows kept in pools: an engine step's causal_conv1d_fn for each conv, with the pool reads
    and writes around it.

    x: [T, cols] or [1, T, cols], the new tokens of N sequences back to back (cu_seqlens [N+1]);
    channels, weights, sizes: as causal_conv1d_update_packed. conv_states: one pool [num_slots,
    D_i, W-1] per conv. Sequence n starts from the window in slot state_indices[n] where
    has_context[n] (bool), from zeros elsewhere; the window after its last token is written back
    to that slot. checkpoints: None or (sequence [C], tokens p [C], slot [C]) integer tensors:
    the window after the first p (>= 1) new tokens of that sequence is also written to that slot
    (slots distinct from one another and from state_indices). Returns the output parts in order,
    each [T, part] (or [1, T, part]) in x.dtype.
    """
    x2, total, N = _check_prefill_packed_args(x, conv_states, weights, sizes, channels, state_indices,
                                              has_context, cu_seqlens, checkpoints)
    xs = x2.index_select(-1, channels.to(x.device).long()) if channels is not None else x2[:, :total]
    idx = state_indices.long()
    out, c0 = [], 0
    for pool, w, part in zip(conv_states, weights, sizes):
        d = sum(part)
        t = xs[:, c0:c0 + d]
        init = torch.where(has_context.bool()[:, None, None], pool[idx], 0).to(pool.dtype)  # [N, D, W-1]
        y, final = causal_conv1d_fn(t[None], w, None, activation, init, True, cu_seqlens)
        if checkpoints is not None and checkpoints[0].numel():
            pool[checkpoints[2].long()] = _windows_after(init, t, cu_seqlens.to(x.device), *checkpoints[:2]).to(pool.dtype)
        pool[idx] = final.to(pool.dtype)
        out.extend(y[0].split(list(part), dim=-1))
        c0 += d
    return [y[None] for y in out] if x.dim() == 3 else out


def _windows_after(init: torch.Tensor, t: torch.Tensor, cu: torch.Tensor, seq: torch.Tensor,
                   p: torch.Tensor) -> torch.Tensor:
    """init [N, D, W-1], t [T, D], cu [N+1]; seq, p [C] -> [C, D, W-1]: the window after the
    first p[c] new tokens of sequence seq[c], i.e. columns p .. p+W-2 of [init ++ its tokens]."""
    P = init.shape[-1]
    cols = p.long()[:, None] + torch.arange(P, device=t.device)  # [C, P] columns of the extended row
    from_init = cols < P
    rows = (cu.long()[seq.long()][:, None] + cols - P).clamp(min=0)  # [C, P] token rows of t
    old = init[seq.long()[:, None], :, cols.clamp(max=P - 1)]  # [C, P, D]
    new = t[rows].to(init.dtype)  # [C, P, D]
    return torch.where(from_init[..., None], old, new).transpose(1, 2)
