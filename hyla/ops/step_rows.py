"""The next fused MTP step's input rows, derived on the device from the step before it (torch
reference; hyla.engine.spec.mtp.overlap launches that next step before the host has read the
previous one's results, see hyla.engine.spec.mtp.fused.DerivedExtension).

Per request n (W = k + 1 verify rows, S stop ids):

    prev[n]  = [a_0 .. a_{W-1}, acc, d'_1 .. d'_k]     the previous step's packed outputs: the
               target's argmax per verify row, the drafts it accepted, the head's next drafts
    base[n]  = [context + 1, head rows + 1, stop_1 .. stop_S]   the host's state before that
               step (stop ids -1: none), + 1 so that adding acc gives the advanced values

    kept tokens    a_0 .. a_acc (the accepted drafts equal a_0 .. a_{acc-1}; a_acc is the bonus)
    stopped        any kept token is a stop id: the request finishes in the previous step, and
                   its rows of the next step are padding rows (nothing of it may be written)
    kept count     stopped: 1 + the index of the first kept stop token (the host keeps the
                   tokens up to it); else acc + 1
                   (stopped and kept count: kept_through_stop, the stop rule's device form;
                   hyla.engine.spec.acceptance states the rule with its host form)
    vmeta[n]       [context + 1 + acc, slot, a_acc, d'_1 .. d'_k, <slots and pages as given>]
                   slot: 1 with rollback "replay" (the state is in the row's one slot, committed
                   before the verify), else acc + 1 (the slot after the kept tokens)
    emeta[n]       [head rows + 1 + acc, d'_1 .. d'_k, <pages as given>]
    stopped rows   vmeta[n] = vpad, emeta[n] = epad (whole rows)
    kept[n]        ("replay" only) the kept count; rows n..bs-1 of kept (padding) get 1

hyla.ops.dispatch sends CUDA calls to hyla.ops.triton.step_rows (one launch instead of ~15
small ops and their host time per step).
"""

from __future__ import annotations

import torch

__all__ = ["derive_step_rows", "check_step_rows", "kept_through_stop"]


def kept_through_stop(top: torch.Tensor, acc: torch.Tensor, stops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stop rule on the device (hyla.engine.spec.acceptance holds it beside its host form,
    Sequence.check_stop's): top [n, W] a verify step's tokens, of which request i keeps the
    first acc[i] + 1 (acc [n, 1] int64); stops [n, S] its stop ids (-1: none) -> (stopped [n, 1]
    bool: a kept token is a stop id; kept [n, 1] int64: the tokens the host keeps, 1 + the index
    of the first kept stop token when stopped, else acc + 1). Reads nothing on the host."""
    W = top.shape[1]
    kept_ids = torch.where(torch.arange(W, device=top.device)[None, :] <= acc, top, -2)  # -2: matches no stop id
    hit = (kept_ids[:, :, None] == stops[:, None, :]).any(-1)  # [n, W]
    stopped = hit.any(-1, keepdim=True)  # [n, 1]
    return stopped, torch.where(stopped, hit.int().argmax(-1, keepdim=True) + 1, acc + 1)


def check_step_rows(base: torch.Tensor, prev: torch.Tensor, vmeta: torch.Tensor, emeta: torch.Tensor,
                    vpad: torch.Tensor, epad: torch.Tensor, kept: torch.Tensor | None) -> int:
    """Validate derive_step_rows' arguments -> W."""
    n = base.shape[0]
    W = prev.shape[1] // 2 if prev.ndim == 2 else 0
    if (base.ndim != 2 or base.shape[1] < 2 or prev.ndim != 2 or prev.shape[1] != 2 * W or W < 1
            or prev.shape[0] < n or vmeta.ndim != 2 or vmeta.shape[0] != n or vmeta.shape[1] < 2 + W
            or emeta.ndim != 2 or emeta.shape[0] != n or emeta.shape[1] < W):
        raise ValueError(f"derive_step_rows expects base [n, 2 + S], prev [>= n, 2W], vmeta [n, >= 2 + W], "
                         f"emeta [n, >= W]; got {tuple(base.shape)}, {tuple(prev.shape)}, {tuple(vmeta.shape)}, "
                         f"{tuple(emeta.shape)}")
    if vpad.shape != vmeta.shape[1:] or epad.shape != emeta.shape[1:]:
        raise ValueError(f"the padding rows must be [{vmeta.shape[1]}] and [{emeta.shape[1]}], got "
                         f"{tuple(vpad.shape)} and {tuple(epad.shape)}")
    if kept is not None and (kept.ndim != 1 or kept.shape[0] < n):
        raise ValueError(f"kept must be [>= {n}], got {tuple(kept.shape)}")
    tensors = [base, prev, vmeta, emeta, vpad, epad] + ([kept] if kept is not None else [])
    if any(t.dtype != torch.long for t in tensors) or len({t.device for t in tensors}) != 1:
        raise ValueError("derive_step_rows takes int64 tensors on one device")
    return W


def derive_step_rows(base: torch.Tensor, prev: torch.Tensor, vmeta: torch.Tensor, emeta: torch.Tensor,
                     vpad: torch.Tensor, epad: torch.Tensor, kept: torch.Tensor | None = None) -> None:
    """base [n, 2 + S], prev [>= n, 2W] (its first n rows are read), vmeta [n, VW] and emeta
    [n, EW] (written in place), vpad [VW], epad [EW], kept [bs >= n] or None (rollback
    "replay": written) -> None. int64 throughout; see the module docstring."""
    W = check_step_rows(base, prev, vmeta, emeta, vpad, epad, kept)
    n, k = base.shape[0], W - 1
    prev = prev[:n]
    acc = prev[:, W:W + 1]  # [n, 1]
    top, nxt = prev[:, :W], prev[:, W + 1:]
    stopped, kept_count = kept_through_stop(top, acc, base[:, 2:])
    if kept is not None:
        kept[:n] = kept_count[:, 0]
        kept[n:] = 1
        slot = torch.ones_like(acc)
    else:
        slot = acc + 1
    row = torch.cat([base[:, :1] + acc, slot, top.gather(1, acc), nxt, vmeta[:, 2 + W:]], 1)
    vmeta.copy_(torch.where(stopped, vpad[None, :], row))
    row = torch.cat([base[:, 1:2] + acc, nxt, emeta[:, k + 1:]], 1)
    emeta.copy_(torch.where(stopped, epad[None, :], row))
