"""An MTP head step's fc input (hyla.ops.mtp_input): the torch reference against the head's
spelled-out formula, and the Triton kernel (TRITON_INTERPRET=1 on the CPU) against the reference
at awkward widths, a hidden state read through a row stride, repeated token ids."""

from __future__ import annotations

import pytest
import torch

from hyla.ops import mtp_input as ref
from hyla.ops.norm import rms_norm_zero_centred
from tests.ops.triton_env import triton_module


def _case(T, D, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (T,), generator=g)
    ids[-1] = ids[0]  # a repeated id
    embed = torch.randn(V, D, generator=g).to(dtype)
    hidden = torch.randn(T, D + 5, generator=g).to(dtype)[:, :D]  # a row stride past D
    w_e, w_h = (torch.randn(D, generator=g) * 0.2 for _ in range(2))
    return ids, embed, hidden, w_e, w_h


def test_reference_is_the_heads_formula():
    ids, embed, hidden, w_e, w_h = _case(5, 24, 50, torch.float64)
    want = torch.cat([rms_norm_zero_centred(embed[ids], w_e), rms_norm_zero_centred(hidden, w_h)], -1)
    assert torch.equal(ref.mtp_fc_input(ids, embed, hidden, w_e, w_h), want)


@pytest.mark.parametrize("T,D", [(1, 24), (7, 100), (4, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_equals_reference(T, D, dtype):
    """fp32 to 1e-6 (the sum of squares in another order); bf16 to one bf16 step of the values
    (a rounding may fall the other way after that)."""
    tk, dev = triton_module("mtp_input")
    args = [a.to(dev) for a in _case(T, D, 97, dtype, seed=T)]
    got, want = tk.mtp_fc_input(*args), ref.mtp_fc_input(*args)
    assert got.shape == (T, 2 * D) and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    assert ((got.float() - want.float()).abs() <= tol * want.float().abs().clamp_min(1)).all()


def test_bad_shapes_name_the_problem():
    ids, embed, hidden, w_e, w_h = _case(3, 8, 20, torch.float32)
    with pytest.raises(ValueError, match="mtp_fc_input expects"):
        ref.mtp_fc_input(ids[:2], embed, hidden, w_e, w_h)
    with pytest.raises(ValueError, match="norm weights"):
        ref.mtp_fc_input(ids, embed, hidden, w_e[:3], w_h)


def test_triton_reads_ids_through_their_stride():
    """A head-step graph of one row per request passes its ids as a column of its meta buffer
    (meta[:, 2:3].reshape(-1) is a view with the buffer's row stride); the other columns hold
    contexts and -1 pages, which the kernel must not read as token ids."""
    tk, dev = triton_module("mtp_input")
    ids, embed, hidden, w_e, w_h = (a.to(dev) for a in _case(5, 24, 50, torch.float32, seed=3))
    meta = torch.full((5, 7), -1, dtype=torch.long, device=dev)
    meta[:, 2] = ids
    column = meta[:, 2:3].reshape(-1)
    assert column.stride(0) == 7
    got = tk.mtp_fc_input(column, embed, hidden, w_e, w_h)
    want = ref.mtp_fc_input(ids, embed, hidden, w_e, w_h)
    assert ((got - want).abs() <= 1e-6 * want.abs().clamp_min(1)).all()
