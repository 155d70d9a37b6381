"""Random inputs and comparison helpers shared by the ops tests."""

import torch
import torch.nn.functional as F

from hyla.ops import dispatch


def use_backend(monkeypatch, choice: str) -> None:
    """dispatch.set_backend(choice) for the rest of the test: monkeypatch puts the choice in force
    before it back afterwards (the backend is read once, not from HYLA_BACKEND on each call)."""
    monkeypatch.setattr(dispatch, "_backend", dispatch.get_backend())  # what teardown restores
    dispatch.set_backend(choice)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative Frobenius error; NaN anywhere counts as infinitely wrong."""
    if not torch.isfinite(actual).all():
        return float("inf")
    denom = expected.double().norm().clamp_min(1e-300)
    return ((actual.double() - expected.double()).norm() / denom).item()


def make_inputs(B, T, H, K, V, *, gate="kda", dtype=torch.float64, hv=None, g_scale=1.0, seed=0):
    """Fresh random q, k, v, g, beta, h0 in fla layout. g is a log-decay (<= 0) of magnitude ~g_scale."""
    gen = torch.Generator().manual_seed(seed)
    hv = hv or H
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q = r(B, T, H, K)
    k = F.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, hv, V)
    if gate == "kda":
        g = -torch.rand(B, T, hv, K, generator=gen, dtype=torch.float64) * g_scale
    elif gate == "gdn":
        g = -torch.rand(B, T, hv, generator=gen, dtype=torch.float64) * g_scale
    else:
        g = None
    beta = torch.rand(B, T, hv, generator=gen, dtype=torch.float64)
    h0 = r(B, hv, K, V)
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(g), cast(beta), h0
