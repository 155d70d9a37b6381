"""hyla.ops.utils.host_values: the host copy of a step's cu_seqlens without a device sync."""

from __future__ import annotations

import torch

from hyla.ops.utils import cached_on, host_values, remember_host_values


def test_remembered_values_are_returned_until_the_tensor_changes():
    t = remember_host_values(torch.tensor([0, 3, 7]), [0, 3, 7])
    t._hyla_host = (t._version, [0, 3, 99])  # what was remembered is what comes back (no copy)
    assert host_values(t) == [0, 3, 99]
    t[2] = 8  # an in-place write bumps the version: the values are read again
    assert host_values(t) == [0, 3, 8]


def test_cached_on_builds_once_per_version():
    t = torch.tensor([0, 4])
    calls = []
    build = lambda: calls.append(1) or len(calls)  # noqa: E731
    assert cached_on(t, "x", build) == 1 and cached_on(t, "x", build) == 1
    t += 1
    assert cached_on(t, "x", build) == 2


def test_inference_tensors_are_remembered_too():
    with torch.inference_mode():
        t = remember_host_values(torch.tensor([0, 2]), [0, 2])
        assert host_values(t) == [0, 2]
        assert cached_on(t, "y", lambda: "built") == "built"
