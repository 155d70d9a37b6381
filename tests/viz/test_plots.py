"""The explanatory plots: files are written, and every panel's data is what the ops compute."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hyla.ops import chunk_kda, kda_gate, max_reciprocal_decay, naive_recurrent_kda, safe_chunk_size
from hyla.parallel import kcp_comm_bytes, softmax_cp_comm_bytes
from hyla.viz import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_render_all_writes_three_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    paths = plots.render_all(tmp_path / "figs")
    assert set(paths) == {"kda_principle", "kcp", "decay_stability"}
    for name, path in paths.items():
        assert path == tmp_path / "figs" / f"{name}.png"
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC), name
        assert len(data) > 20_000, f"{name} is suspiciously small ({len(data)} bytes)"


def test_kda_principle_panels():
    d = plots.kda_principle_data(T=40, K=8, V=12, seed=5)
    q, k, v, g, beta = plots.demo_inputs(1, 40, 1, 8, 12, seed=5, gate_bias=-4.0)

    # state: the loop oracle reaches the same matrix.
    _, S_loop = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    assert (d["state"]["S"] - S_loop[0, 0]).abs().max() <= 1e-12

    # step: decay, predict, write reproduce the op's last step.
    st = d["step"]
    _, S_prev = naive_recurrent_kda(q[:, :-1], k[:, :-1], v[:, :-1], g[:, :-1], beta[:, :-1], output_final_state=True)
    assert (st["S_prev"] - S_prev[0, 0]).abs().max() <= 1e-12
    assert torch.allclose(st["S_decayed"], g[0, -1, 0].exp()[:, None] * st["S_prev"], rtol=0, atol=0)
    assert torch.allclose(st["v_hat"], st["S_decayed"].T @ k[0, -1, 0], rtol=1e-14, atol=1e-14)
    assert torch.allclose(st["written"], beta[0, -1, 0] * (v[0, -1, 0] - st["v_hat"]), rtol=1e-14, atol=1e-14)
    assert (st["S_new"] - S_loop[0, 0]).abs().max() <= 1e-12
    assert st["norms"] == pytest.approx([st[x].norm().item() for x in ("S_prev", "S_decayed", "S_new")])

    # delta: with a unit key, no decay and q = k, n writes of v leave (1 - (1-b)^n) v behind the key;
    # linear attention reads back n v.
    dl = d["delta"]
    n_a, b = dl["switch_at"], dl["beta"]
    gen = torch.Generator().manual_seed(5 + 1)
    _key = torch.randn(8, generator=gen, dtype=torch.float64)  # drawn first, as in kda_principle_data
    v_a = torch.randn(2, 12, generator=gen, dtype=torch.float64)[0]
    for n in range(1, n_a + 1):
        assert dl["err_delta"][n - 1] == pytest.approx((1 - b) ** n * v_a.norm().item(), rel=1e-10)
        assert dl["err_linear"][n - 1] == pytest.approx((n - 1) * v_a.norm().item(), rel=1e-10, abs=1e-12)
    assert dl["err_delta"][-1] < 1e-2 * dl["err_delta"][n_a]  # converged to the new value
    assert dl["err_linear"][-1] > dl["err_linear"][n_a]  # keeps the old one forever

    # gates: the two kda_gate variants, one bounded and one not.
    gt = d["gates"]
    f = torch.tensor(gt["f"], dtype=torch.float64)
    assert gt["g_v1"] == pytest.approx((-F.softplus(f)).tolist(), rel=1e-12)
    assert gt["g_v2"] == pytest.approx((gt["lower_bound"] * torch.sigmoid(f)).tolist(), rel=1e-12)
    assert min(gt["g_v2"]) > gt["lower_bound"] > min(gt["g_v1"])


def test_kcp_panels():
    d = plots.kcp_data(seed=0)
    e = d["errors"]
    assert e["segments"] == [2, 4, 8, 16]
    assert all(x > 0.1 for x in e["direct"])
    assert all(x <= 1e-14 for x in e["scan"])
    r = plots.direct_sum_vs_scan(T=256, n_segments=8, seed=0)
    assert e["direct"][2] == r["direct_rel"] and e["scan"][2] == r["scan_rel"]

    c = d["comm"]
    B, H, K, V, W = c["batch"], c["heads"], c["K"], c["V"], c["world"]
    assert c["kcp_bytes"] == [kcp_comm_bytes(B, H, K, V, torch.float32)] * len(c["T"])
    assert c["kcp_bytes"][0] == B * H * (K * K + K * V) * 4
    assert c["measured_bytes"] == [c["kcp_bytes"][0]] * len(c["measured_T"])
    assert c["softmax_bytes"] == [softmax_cp_comm_bytes(B, H, K, V, T // W, torch.bfloat16) for T in c["T"]]
    assert c["softmax_bytes"][-1] / c["softmax_bytes"][0] == c["T"][-1] / c["T"][0]  # linear in T
    assert c["softmax_bytes"][0] < c["kcp_bytes"][0] < c["softmax_bytes"][-1]  # the curves cross


def test_decay_stability_panels():
    d = plots.decay_stability_data(seed=0)
    b = d["bound"]
    for lb, ys in b["curves"].items():
        assert ys == [max_reciprocal_decay(lb, t) for t in b["tiles"]]
    assert b["curves"][-5.0][15] == pytest.approx(math.exp(80))  # tile 16: 5.54e34, seed 003 §5.3
    assert b["ceilings"]["bfloat16"] == torch.finfo(torch.bfloat16).max

    s = d["safe"]
    i5, i8 = s["lower_bounds"].index(-5.0), s["lower_bounds"].index(-8.0)
    assert s["sizes"]["bfloat16"][i5] == 16 and s["sizes"]["float16"][i5] == 1 and s["sizes"]["bfloat16"][i8] == 10
    assert s["sizes"]["float16"][s["lower_bounds"].index(-20.0)] == 0  # nothing fits: recorded as 0
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        assert s["sizes"][name] == [safe_chunk_size(lb, dtype) for lb in s["lower_bounds"]]

    # The textbook form overflows exactly past the safe tile; hyla's path never does.
    t = d["tiles"]
    assert t["safe_fp32"] == safe_chunk_size(-5.0, torch.float32) == 16
    for c, text, hy in zip(t["chunk_sizes"], t["textbook"], t["hyla"]):
        assert hy <= 1e-5, c
        assert (text <= 1e-5) if c <= t["safe_fp32"] else math.isinf(text), c
    f = d["shifts"]
    assert all(h <= 1e-5 for h in f["hyla"])
    assert f["textbook"][0] <= 1e-5 and math.isinf(f["textbook"][-1])


def test_textbook_form_is_correct_when_it_fits():
    """The overflow demonstration compares against a correct algorithm, not a buggy one."""
    gen = torch.Generator().manual_seed(1)
    B, T, H, K, V = 2, 50, 2, 8, 6
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    g = kda_gate(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), torch.zeros(H, dtype=torch.float64))
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    o_ref, _ = naive_recurrent_kda(q, k, v, g, beta)
    o = plots.textbook_chunk_kda(q, k, v, g, beta, chunk_size=16, dtype=torch.float64)
    assert (o - o_ref).abs().max() <= 1e-10
    o_chunk, _ = chunk_kda(q, k, v, g, beta, chunk_size=16)
    assert (o - o_chunk).abs().max() <= 1e-10
