"""hyla.ops.triton._interpreter under Triton's CPU interpreter: the scans with a custom combine
function (run as a doubling scan) against a left-to-right loop, forwards and reversed, along
either axis; @triton.jit helpers calling the standard library inside a launch (the per-launch
language patch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.ops.triton_env import triton_module

_, DEVICE = triton_module("common")  # skips without triton; sets up the interpreter on a CPU box

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hyla.ops.triton import _interpreter  # noqa: E402

_interpreter.apply()


@triton.jit
def _seg_add(a, fa, b, fb):
    return tl.where(fb, b, a + b), fa | fb


@triton.jit
def _affine(a1, b1, a2, b2):
    # x -> a x + b composed: first (a1, b1), then (a2, b2); associative, not commutative
    return a1 * a2, b1 * a2 + b2


@triton.jit
def _scan_kernel(x, flag, a, out_seg, out_a, out_b, R: tl.constexpr, C: tl.constexpr,
                 AXIS: tl.constexpr, REVERSE: tl.constexpr):
    off = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    v = tl.load(x + off)
    f = tl.load(flag + off) != 0
    m = tl.load(a + off)
    s, _ = tl.associative_scan((v, f), AXIS, _seg_add, reverse=REVERSE)
    pa, pb = tl.associative_scan((m, v), AXIS, _affine, reverse=REVERSE)
    tl.store(out_seg + off, s)
    tl.store(out_a + off, pa)
    tl.store(out_b + off, pb)


def _loop_scan(arrays, combine, axis, reverse):
    """Inclusive scan of the tuple `arrays` along axis, one element at a time (the definition)."""
    arrays = [np.moveaxis(a if a.dtype == bool else a.astype(np.float64), axis, 0).copy() for a in arrays]
    n = arrays[0].shape[0]
    order = range(n - 1, -1, -1) if reverse else range(n)
    prev = None
    for i in order:
        if prev is not None:
            now = combine(*[a[prev] for a in arrays], *[a[i] for a in arrays])
            for a, v in zip(arrays, now):
                a[i] = v
        prev = i
    return [np.moveaxis(a, 0, axis) for a in arrays]


@pytest.mark.parametrize("rows,cols", [(64, 8), (1, 16), (16, 1)])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("reverse", [False, True])
def test_custom_combine_scans_equal_the_left_to_right_definition(rows, cols, axis, reverse):
    g = torch.Generator().manual_seed(rows * 100 + cols + axis + 7 * reverse)
    x = torch.randn(rows, cols, generator=g)
    flag = (torch.rand(rows, cols, generator=g) < 0.25).to(torch.int32)
    a = 0.5 + torch.rand(rows, cols, generator=g)
    outs = [torch.empty(rows, cols) for _ in range(3)]
    args = [t.to(DEVICE) for t in (x, flag, a, *outs)]
    _scan_kernel[(1,)](*args, rows, cols, axis, reverse)
    seg, pa, pb = (t.cpu().double().numpy() for t in args[3:])

    want_seg, _ = _loop_scan([x.numpy(), flag.numpy().astype(bool)],
                             lambda v1, f1, v2, f2: (np.where(f2, v2, v1 + v2), f1 | f2), axis, reverse)
    want_a, want_b = _loop_scan([a.numpy(), x.numpy()],
                                lambda a1, b1, a2, b2: (a1 * a2, b1 * a2 + b2), axis, reverse)
    # fp32 sums in another association order: a few ulps of the running values
    np.testing.assert_allclose(seg, want_seg, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pa, want_a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pb, want_b, rtol=1e-5, atol=1e-5)


@triton.jit
def _row_stats(v):
    # a helper calling the standard library (whose functions name triton.language.core)
    return tl.sum(v, axis=1), tl.max(v, axis=1), tl.cumsum(v, axis=1)


@triton.jit
def _stats_kernel(x, out_sum, out_max, out_cum, C: tl.constexpr):
    r = tl.program_id(0)
    o = tl.arange(0, C)
    v = tl.load(x + r * C + o)[None, :]
    s, m, c = _row_stats(v)
    tl.store(out_sum + r + tl.arange(0, 1), s)
    tl.store(out_max + r + tl.arange(0, 1), m)
    tl.store(out_cum + r * C + o[None, :], c)


def test_helpers_using_the_standard_library_in_every_program_and_launch():
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(3))
    for _ in range(2):  # a second launch after the first one's patch was restored
        outs = [torch.empty(5), torch.empty(5), torch.empty(5, 16)]
        args = [t.to(DEVICE) for t in (x, *outs)]
        _stats_kernel[(5,)](*args, 16)
        s, m, c = (t.cpu() for t in args[1:])
        torch.testing.assert_close(s, x.sum(1), rtol=1e-6, atol=1e-6)
        assert torch.equal(m, x.max(1).values)
        torch.testing.assert_close(c, x.cumsum(1), rtol=1e-6, atol=1e-6)


def test_tuple_type_names_read_as_triton_formats_them():
    types, fields = [tl.float32, tl.pointer_type(tl.int32)], ["a", ""]
    t = tl.core.tuple_type(types, fields)
    assert t.name == str(t) == "[a:fp32,:pointer<int32>]"
    assert tl.core.tuple_type([tl.int1]).name == "[:int1]"
    assert t == tl.core.tuple_type(list(types), list(fields)) and t != tl.core.tuple_type(types)
