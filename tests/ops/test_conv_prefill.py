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


def _packed_case(lens, parts, W, pool_dtype, gen, channels=False, ck=(), x_dtype=torch.float32):
    """Inputs of causal_conv1d_prefill_packed: x [T, cols] (two spare columns), one pool per conv
    (parts: per conv, its output parts), weights, the state slots (reversed, beyond N), which
    sequences resume, and checkpoints (sequence, p, slot)."""
    T, N = sum(lens), len(lens)
    total = sum(sum(p) for p in parts)
    x = torch.randn(T, total + 2, generator=gen).to(x_dtype)
    pools = [torch.randn(N + 6 + len(ck), sum(p), W - 1, generator=gen).to(pool_dtype) for p in parts]
    weights = [torch.randn(sum(p), 1, W, generator=gen) for p in parts]
    slots = torch.arange(N + 2, 2, -1)[:N]  # distinct slots, not 0..N-1
    ctx = torch.tensor([i % 3 != 1 for i in range(N)])
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    cols = torch.randperm(total + 2, generator=gen)[:total] if channels else None
    cks = None
    if ck:
        cks = tuple(torch.tensor(v) for v in zip(*[(n, p, N + 3 + i) for i, (n, p) in enumerate(ck)]))
    return x, pools, weights, slots, ctx, cu, cols, cks


def _by_composition(x, pools, weights, parts, slots, ctx, cu, cols, cks, act):
    """What the layers did before the packed op: per conv, the initial windows gathered and
    masked, causal_conv1d_fn, each checkpoint's window from [initial ++ inputs], the final window
    scattered back."""
    xs = x.index_select(-1, cols) if cols is not None else x
    out, c0, N = [], 0, len(slots)
    for pool, w, part in zip(pools, weights, parts):
        d = sum(part)
        t = xs[:, c0:c0 + d]
        init = torch.where(ctx[:, None, None], pool[slots], 0)
        y, final = torch_conv.causal_conv1d_fn(t[None], w, None, act, init, True, cu)
        P = pool.shape[-1]
        if cks is not None:
            for n, p, dest in zip(*(v.tolist() for v in cks)):
                ext = torch.cat([init[n], t[cu[n]:cu[n + 1]].T.to(pool.dtype)], dim=1)  # [D, P + len]
                pool[dest] = ext[:, p:p + P]
        pool[slots] = final.to(pool.dtype)
        out.extend(y[0].split(list(part), dim=-1))
        c0 += d
    return out


@pytest.mark.parametrize("lens,parts,W,pool_dtype,channels,ck,x_dtype", [
    ([37, 0, 2, 70], [[24], [24], [16]], 4, torch.float32, False, [(0, 1), (0, 32), (3, 64), (2, 2)],
     torch.float32),  # KDA: three pools
    ([5, 1, 40], [[8, 8, 12]], 4, torch.float32, True, [(2, 16)], torch.float32),  # GDN: one pool, three parts
    ([61, 40], [[24], [24], [24]], 4, torch.bfloat16, False, [], torch.float32),  # an interior block, bf16 windows
    ([3, 9], [[20], [20]], 3, torch.float32, False, [(1, 1), (1, 9)], torch.float32),
    ([33, 70], [[16], [16], [16]], 4, torch.bfloat16, False, [(1, 2), (1, 64)], torch.bfloat16),  # a bf16 model
])
def test_prefill_packed_matches_per_conv_composition(lens, parts, W, pool_dtype, channels, ck, x_dtype):
    """causal_conv1d_prefill_packed, torch and Triton, against the per-conv path the layers ran:
    outputs to fp32 rounding, every pool slot (finals, checkpoints, untouched ones) exact (copied
    inputs). Awkward: an empty sequence, sequences shorter than the window, checkpoints inside the
    first W-1 tokens (their windows partly from the initial one), sequences without context.
    bf16 outputs: within one rounding (the products summed in fp32 in another order)."""
    from hyla.ops.triton.conv_prefill import causal_conv1d_prefill_packed as triton_packed

    gen = torch.Generator().manual_seed(sum(lens) + W)
    x, pools, weights, slots, ctx, cu, cols, cks = _packed_case(lens, parts, W, pool_dtype, gen, channels, ck,
                                                                x_dtype)
    tol = 1e-6 if x_dtype == torch.float32 else 8e-3
    want_pools = [p.clone() for p in pools]
    want = _by_composition(x, want_pools, weights, parts, slots, ctx, cu, cols, cks, "silu")
    for impl, dev in ((torch_conv.causal_conv1d_prefill_packed, "cpu"), (triton_packed, DEV)):
        got_pools = [p.clone().to(dev) for p in pools]
        to = lambda t: None if t is None else t.to(dev)  # noqa: E731
        got = impl(x.to(dev), got_pools, [w.to(dev) for w in weights], parts, "silu", state_indices=slots.to(dev),
                   has_context=ctx.to(dev), cu_seqlens=cu.to(dev), channels=to(cols),
                   checkpoints=None if cks is None else tuple(to(t) for t in cks))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.cpu(), w, rtol=tol, atol=tol)
        for g, w in zip(got_pools, want_pools):
            torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)


def test_prefill_packed_refuses_bad_arguments():
    gen = torch.Generator().manual_seed(3)
    x, pools, weights, slots, ctx, cu, _, _ = _packed_case([4, 5], [[8], [8]], 4, torch.float32, gen)
    kw = dict(state_indices=slots, has_context=ctx, cu_seqlens=cu)
    with pytest.raises(ValueError, match="state_indices"):
        torch_conv.causal_conv1d_prefill_packed(x, pools, weights, [[8], [8]], **{**kw, "state_indices": slots[:1]})
    with pytest.raises(ValueError, match="checkpoints"):
        torch_conv.causal_conv1d_prefill_packed(x, pools, weights, [[8], [8]], checkpoints=(cu, cu), **kw)
    with pytest.raises(ValueError, match="packed along T"):
        torch_conv.causal_conv1d_prefill_packed(x[None].expand(2, -1, -1), pools, weights, [[8], [8]], **kw)
