"""hyla.ops.dispatch: a Triton kernel that does not fit the device falls back to torch."""

from __future__ import annotations

import pytest
import torch

from hyla.ops import chunk as torch_chunk
from hyla.ops import dispatch
from tests.ops.helpers import use_backend


class OutOfResources(Exception):  # the name Triton's launcher raises (triton.runtime.errors)
    pass


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 9, 2, 8, generator=g) for _ in range(2))
    v = torch.randn(1, 9, 2, 8, generator=g)
    gate = -torch.rand(1, 9, 2, 8, generator=g)
    beta = torch.rand(1, 9, 2, generator=g)
    return q, k, v, gate, beta


@pytest.fixture
def triton_that_does_not_fit(monkeypatch):
    calls = []

    def fail(*args, **kwargs):
        calls.append(1)
        raise OutOfResources("shared memory, required 278528, hardware limit 232448")

    monkeypatch.setattr(dispatch, "backend_for", lambda *a, **k: "triton")
    monkeypatch.setattr(dispatch._triton, "chunk_kda", fail, raising=False)
    monkeypatch.setattr(dispatch, "_NO_FIT", set())
    return calls


def test_out_of_resources_runs_the_torch_path_and_is_remembered(triton_that_does_not_fit, monkeypatch, caplog):
    use_backend(monkeypatch, "auto")
    args = _inputs()
    want = torch_chunk.chunk_kda(*args)[0]
    with caplog.at_level("WARNING", logger="hyla.ops"):
        got = dispatch.chunk_kda(*args)[0]
    assert torch.equal(got, want) and "does not fit" in caplog.text
    dispatch.chunk_kda(*args)  # the second call does not try the kernel again
    assert len(triton_that_does_not_fit) == 1


def test_forced_triton_raises(triton_that_does_not_fit, monkeypatch):
    use_backend(monkeypatch, "triton")
    with pytest.raises(OutOfResources):
        dispatch.chunk_kda(*_inputs())


def test_other_errors_are_not_swallowed(monkeypatch):
    monkeypatch.setattr(dispatch, "backend_for", lambda *a, **k: "triton")
    monkeypatch.setattr(dispatch._triton, "chunk_kda", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")),
                        raising=False)
    with pytest.raises(RuntimeError, match="boom"):
        dispatch.chunk_kda(*_inputs())


def test_the_backend_is_read_once_and_set_explicitly(monkeypatch):
    """HYLA_BACKEND is read when hyla.ops.dispatch is imported (a copy of the module imported with
    it set picks it up), never on an op call; set_backend changes the choice (-> the previous
    one) and names the choices when given anything else."""
    import importlib.util

    monkeypatch.setenv("HYLA_BACKEND", " Torch ")
    spec = importlib.util.spec_from_file_location("dispatch_copy", dispatch.__file__)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    assert copy.get_backend() == "torch"
    before = dispatch.get_backend()
    monkeypatch.setenv("HYLA_BACKEND", "triton")
    assert dispatch.get_backend() == before  # the environment is not read again
    use_backend(monkeypatch, "torch")
    assert dispatch.backend_for(*_inputs()[:2], []) == "torch"
    assert dispatch.set_backend("auto") == "torch" and dispatch.get_backend() == "auto"
    with pytest.raises(ValueError, match="auto.*torch.*triton"):
        dispatch.set_backend("cuda")
    assert dispatch.get_backend() == "auto"
