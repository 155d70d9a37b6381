import math

import pytest
import torch

from hyla.ops.numerics import max_reciprocal_decay, safe_chunk_size


def test_seed_figures():
    assert max_reciprocal_decay(-5, 16) == math.exp(80)
    assert max_reciprocal_decay(-5, 16) == pytest.approx(5.5406e34, rel=1e-4)
    assert safe_chunk_size(-5, torch.bfloat16) == 16
    assert safe_chunk_size(-5, torch.float16) == 1
    assert safe_chunk_size(-8, torch.bfloat16) == 10


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("lower_bound", [-0.37, -1.0, -2.5, -5.0, -5.55, -8.0])
def test_safe_chunk_size_is_the_largest_safe_tile(lower_bound, dtype):
    ceiling = torch.finfo(dtype).max
    try:
        c = safe_chunk_size(lower_bound, dtype)
    except ValueError:
        assert max_reciprocal_decay(lower_bound, 2) > ceiling
        return
    assert c >= 1
    assert max_reciprocal_decay(lower_bound, c + 1) <= ceiling
    assert max_reciprocal_decay(lower_bound, c + 2) > ceiling


def test_safe_tile_keeps_reciprocal_decay_finite_in_dtype():
    # The bound is tight: exp(-lb * (C + 1)) fits in the dtype, one more step overflows.
    for lb, dtype in [(-5.0, torch.bfloat16), (-8.0, torch.bfloat16), (-5.0, torch.float16)]:
        c = safe_chunk_size(lb, dtype)
        inside = torch.tensor(-lb * (c + 1), dtype=torch.float64).exp().to(dtype)
        outside = torch.tensor(-lb * (c + 2), dtype=torch.float64).exp().to(dtype)
        assert torch.isfinite(inside) and not torch.isfinite(outside)


def test_max_reciprocal_decay_overflow_is_inf():
    assert max_reciprocal_decay(-100.0, 1000) == math.inf
    assert max_reciprocal_decay(-3.0, 0) == 1.0


@pytest.mark.parametrize("bad", [0, 0.0, 1.5, float("nan"), float("-inf"), "x", None])
def test_bad_lower_bound(bad):
    with pytest.raises(ValueError, match="lower_bound"):
        max_reciprocal_decay(bad, 16)
    with pytest.raises(ValueError, match="lower_bound"):
        safe_chunk_size(bad, torch.bfloat16)


@pytest.mark.parametrize("bad", [-1, 2.0, True, "16"])
def test_bad_tile(bad):
    with pytest.raises(ValueError, match="tile"):
        max_reciprocal_decay(-5, bad)


@pytest.mark.parametrize("bad", [torch.int32, torch.bool, "bf16", None])
def test_bad_dtype(bad):
    with pytest.raises(ValueError, match="dtype"):
        safe_chunk_size(-5, bad)


def test_no_safe_tile_raises():
    with pytest.raises(ValueError, match="lower_bound"):
        safe_chunk_size(-20.0, torch.float16)
