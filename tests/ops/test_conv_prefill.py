"""Triton prefill short conv (hyla.ops.triton.conv_prefill) against the torch op.

Under Triton's interpreter without a GPU. Same fp32 multiply-adds in the same tap order; the
bias is added first rather than last, so results agree to fp32 rounding (1e-6 relative).
Awkward cases: sequences shorter than the window, empty sequences, a window wider than a
sequence, with and without initial windows, bias and SiLU.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from hyla.ops import conv as torch_conv  # noqa: E402
from hyla.ops import triton as hyla_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and not hyla_triton.interpreting():
    pytest.skip("CPU tensors need TRITON_INTERPRET=1 set before triton is imported", allow_module_level=True)

from hyla.ops.triton.conv_prefill import causal_conv1d_fn  # noqa: E402


@pytest.mark.parametrize("lens,D,W,init,bias,act", [
    ([37], 24, 4, False, False, "silu"),
    ([5, 1, 0, 40, 2], 40, 4, True, True, "silu"),
    ([3, 70], 130, 3, True, False, None),
    ([1, 2], 17, 4, True, True, "silu"),
    # 32-token blocks: the third starts W-1 past the second sequence's start (read from x alone)
    # or W-2 past it (its first token still needs the initial window)
    ([61, 40], 24, 4, True, True, "silu"),
    ([62, 40], 24, 4, True, False, "silu"),
])
def test_matches_torch_op(lens, D, W, init, bias, act):
    gen = torch.Generator().manual_seed(sum(lens) + D)
    T = sum(lens)
    x = torch.randn(1, T, D, generator=gen)
    weight = torch.randn(D, 1, W, generator=gen)
    b = torch.randn(D, generator=gen) if bias else None
    N = len(lens)
    h0 = torch.randn(N, D, W - 1, generator=gen) if init else None
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    want_y, want_s = torch_conv.causal_conv1d_fn(x, weight, b, act, h0, True, cu)
    to = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    got_y, got_s = causal_conv1d_fn(to(x), to(weight), to(b), act, to(h0), True, to(cu))
    torch.testing.assert_close(got_y.cpu(), want_y, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_s.cpu(), want_s, rtol=0, atol=0)  # copied inputs: exact


def test_batched_without_cu_seqlens_and_bf16():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 20, 48, generator=gen).bfloat16()
    weight = torch.randn(48, 4, generator=gen)
    want_y, want_s = torch_conv.causal_conv1d_fn(x, weight, None, "silu", None, True)
    got_y, got_s = causal_conv1d_fn(x.to(DEV), weight.to(DEV), None, "silu", None, True)
    assert got_y.dtype == torch.bfloat16 and got_s.dtype == torch.bfloat16
    torch.testing.assert_close(got_y.cpu().float(), want_y.float(), rtol=1e-2, atol=1e-2)  # one bf16 rounding
    torch.testing.assert_close(got_s.cpu(), want_s, rtol=0, atol=0)


def test_column_block_of_a_wider_tensor():
    """x as a column slice of a packed projection output (row stride > D): read in place."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(1, 30, 100, generator=gen)
    x = wide[..., 20:60]
    weight, h0 = torch.randn(40, 4, generator=gen), torch.randn(2, 40, 3, generator=gen)
    cu = torch.tensor([0, 11, 30])
    want_y, want_s = torch_conv.causal_conv1d_fn(x, weight, None, "silu", h0, True, cu)
    got_y, got_s = causal_conv1d_fn(wide.to(DEV)[..., 20:60], weight.to(DEV), None, "silu", h0.to(DEV), True,
                                    cu.to(DEV))
    torch.testing.assert_close(got_y.cpu(), want_y, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_s.cpu(), want_s, rtol=0, atol=0)


def test_bad_initial_state_is_named():
    x = torch.randn(1, 6, 8).to(DEV)
    with pytest.raises(ValueError, match="initial_state must be"):
        causal_conv1d_fn(x, torch.randn(8, 4).to(DEV), initial_state=torch.randn(2, 8, 3).to(DEV),
                         cu_seqlens=torch.tensor([0, 6]).to(DEV))


def test_one_cu_seqlens_serves_several_convs():
    """An engine step's convs share its cu_seqlens tensor (its token tables built once for them):
    convs of other widths on it still match the torch op, and so does one after the tensor is
    changed in place (the tables follow its version)."""
    gen = torch.Generator().manual_seed(11)
    cu = torch.tensor([0, 5, 40, 41])
    for D, new_cu in ((24, None), (40, None), (24, [0, 30, 35, 41])):
        if new_cu is not None:
            cu.copy_(torch.tensor(new_cu))
        x = torch.randn(1, 41, D, generator=gen)
        weight = torch.randn(D, 4, generator=gen)
        h0 = torch.randn(3, D, 3, generator=gen)
        want_y, want_s = torch_conv.causal_conv1d_fn(x, weight, None, "silu", h0, True, cu.clone())
        got_y, got_s = causal_conv1d_fn(x.to(DEV), weight.to(DEV), None, "silu", h0.to(DEV), True,
                                        cu if DEV == "cpu" else cu.to(DEV))
        torch.testing.assert_close(got_y.cpu(), want_y, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_s.cpu(), want_s, rtol=0, atol=0)
