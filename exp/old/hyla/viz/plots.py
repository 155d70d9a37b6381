"""Explanatory figures, each computed from hyla's own ops.

Three PNGs (``render_all(out_dir)``, or ``hyla plot --out DIR``):

- ``kda_principle.png``: what the KDA state is and how one token changes it.
- ``kcp.png``: why context parallelism must scan (M, S~) summaries instead of adding states, and
  what it costs to send them compared with softmax context parallelism.
- ``decay_stability.png``: why the textbook K / Gamma chunk form needs a bounded gate and a small
  tile, and that hyla's chunk path does not.

Every figure has a ``*_data()`` function that computes the numbers behind each panel (plain
Python floats / lists and small tensors, deterministic for a given seed) and a ``render_*``
function that draws them; tests check the data against the ops directly. matplotlib is imported
only when rendering, through the Agg canvas (no pyplot, no global backend change).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from hyla.ops import (
    chunk_kda,
    kda_gate,
    max_reciprocal_decay,
    naive_recurrent_kda,
    naive_recurrent_linear_attn,
    safe_chunk_size,
    segment_affine,
)
from hyla.parallel.kcp import kcp_comm_bytes, simulate_kcp, softmax_cp_comm_bytes

__all__ = [
    "render_all",
    "kda_principle_data",
    "kcp_data",
    "decay_stability_data",
    "render_kda_principle",
    "render_kcp",
    "render_decay_stability",
    "direct_sum_vs_scan",
    "demo_inputs",
    "textbook_chunk_kda",
]

F64 = torch.float64


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative Frobenius error in fp64; any inf / NaN counts as infinitely wrong."""
    if not torch.isfinite(actual).all():
        return math.inf
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def demo_inputs(B, T, H, K, V, *, seed, gate_bias=0.0, dtype=F64):
    """The random KDA inputs every figure (and scripts/kcp_demo.py) uses, from a seeded generator.

    Returns q, k: [B, T, H, K], v: [B, T, H, V], g: [B, T, H, K], beta: [B, T, H] in ``dtype``:
    q, v ~ N(0, 1); k = l2norm(N(0, 1)); beta ~ U(0, 1); g = kda_gate(z, A_log=0, dt_bias=gate_bias)
    = -softplus(z + gate_bias) with z ~ N(0, 1) (gate v1), drawn in that order, in fp64.
    """
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    q, k, v, z = r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V), r(B, T, H, K)
    g = kda_gate(z, torch.zeros(H, dtype=F64), torch.full((H * K,), float(gate_bias), dtype=F64))
    beta = torch.rand(B, T, H, generator=gen, dtype=F64)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta))


# ---------------------------------------------------------------------------------------------
# kda_principle.png
# ---------------------------------------------------------------------------------------------


def kda_principle_data(*, T: int = 64, K: int = 16, V: int = 16, seed: int = 0) -> dict:
    """Numbers behind the four panels of ``kda_principle.png`` (one head, fp64).

    state:  the state S [K, V] after T tokens (chunk_kda's final state), gate v1 with
            dt_bias = -4 so that a = exp(g) ~ 0.98 and the state remembers a few dozen tokens.
    step:   the last token split into its three moves, starting from the state after T-1 tokens:
            decay S_dec = Diag(a) S; predict v_hat = S_dec^T k; write b (v - v_hat) along k, giving
            S_new = S_dec + k (b (v - v_hat))^T (equal to ``state``).
    delta:  one key written n_a times with value v_a then n_b times with v_b (b = 0.5, no decay);
            reading that key after each write: delta rule (naive_recurrent_kda with g = 0) vs plain
            linear attention (naive_recurrent_linear_attn); distance to the latest value written.
    gates:  log-decay g versus the raw gate input f (A_log = 0, no bias): gate v1
            -softplus(f) (unbounded below) and gate v2 lower_bound * sigmoid(f).
    """
    q, k, v, g, beta = demo_inputs(1, T, 1, K, V, seed=seed, gate_bias=-4.0)
    _, S_prev = chunk_kda(q[:, :-1], k[:, :-1], v[:, :-1], g[:, :-1], beta[:, :-1], output_final_state=True)
    _, S_T = chunk_kda(q, k, v, g, beta, output_final_state=True)
    S_prev, S_T = S_prev[0, 0], S_T[0, 0]  # [K, V]
    a_t, k_t, v_t, b_t = g[0, -1, 0].exp(), k[0, -1, 0], v[0, -1, 0], beta[0, -1, 0].item()
    S_dec = a_t[:, None] * S_prev
    v_hat = S_dec.T @ k_t
    written = b_t * (v_t - v_hat)
    S_new = S_dec + torch.outer(k_t, written)

    n_a, n_b, b = 12, 12, 0.5
    gen = torch.Generator().manual_seed(seed + 1)
    key = F.normalize(torch.randn(K, generator=gen, dtype=F64), dim=0)
    v_a, v_b = torch.randn(2, V, generator=gen, dtype=F64)
    n = n_a + n_b
    kk = key.expand(1, n, 1, K)
    vv = torch.cat([v_a.expand(n_a, V), v_b.expand(n_b, V)]).view(1, n, 1, V)
    # q = k and scale = 1, so o_t = S_t^T k is "reading the key back" after write t.
    read_delta, _ = naive_recurrent_kda(kk, kk, vv, torch.zeros(1, n, 1, K, dtype=F64),
                                        torch.full((1, n, 1), b, dtype=F64), scale=1.0)
    read_linear, _ = naive_recurrent_linear_attn(kk, kk, vv, scale=1.0)
    latest = vv[0, :, 0]  # [n, V]

    f = torch.linspace(-8.0, 8.0, 161, dtype=F64)
    lower_bound = -5.0
    f4 = f.view(1, -1, 1, 1)
    A_log = torch.zeros(1, dtype=F64)
    return {
        "state": {"S": S_T, "T": T},
        "step": {
            "S_prev": S_prev, "S_decayed": S_dec, "S_new": S_new, "v": v_t, "v_hat": v_hat, "written": written,
            "beta": b_t, "norms": [S_prev.norm().item(), S_dec.norm().item(), S_new.norm().item()],
        },
        "delta": {
            "step": list(range(1, n + 1)), "switch_at": n_a, "beta": b,
            "err_delta": (read_delta[0, :, 0] - latest).norm(dim=-1).tolist(),
            "err_linear": (read_linear[0, :, 0] - latest).norm(dim=-1).tolist(),
        },
        "gates": {
            "f": f.tolist(), "lower_bound": lower_bound,
            "g_v1": kda_gate(f4, A_log).flatten().tolist(),
            "g_v2": kda_gate(f4, A_log, lower_bound=lower_bound).flatten().tolist(),
        },
    }


def render_kda_principle(data: dict, path) -> Path:
    fig = _figure(2, 2, (11, 8.5))
    ax_s, ax_step, ax_d, ax_g = fig.axes

    S = data["state"]["S"]
    lim = S.abs().max().item()
    im = ax_s.imshow(S.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim)
    fig.colorbar(im, ax=ax_s, shrink=0.8)
    ax_s.set_title(f"State S after T={data['state']['T']} tokens: one {S.shape[0]}x{S.shape[1]} matrix")
    ax_s.set_xlabel("value channel")
    ax_s.set_ylabel("key channel")

    st = data["step"]
    x = torch.arange(st["v"].numel()).numpy()
    w = 0.28
    ax_step.bar(x - w, st["v"].numpy(), w, label="v (new value)")
    ax_step.bar(x, st["v_hat"].numpy(), w, label="prediction (decayed S)^T k")
    ax_step.bar(x + w, st["written"].numpy(), w, label=f"written: b (v - prediction), b={st['beta']:.2f}")
    n0, n1, n2 = st["norms"]
    ax_step.set_title("One token: decay -> predict -> write the error")
    ax_step.text(0.02, 0.03, f"|S|: {n0:.2f} -> decay -> {n1:.2f} -> write -> {n2:.2f}",
                 transform=ax_step.transAxes, fontsize=8)
    ax_step.set_xlabel("value channel")
    ax_step.legend(fontsize=8)

    d = data["delta"]
    ax_d.semilogy(d["step"], d["err_delta"], "o-", label=f"delta rule (b={d['beta']})")
    # Linear attention reads the first value back exactly (error ~1e-16); leave that point out
    # rather than stretch the log axis down to it.
    ax_d.semilogy(d["step"], [e if e > 1e-12 else math.nan for e in d["err_linear"]], "s-",
                  label="plain linear attention (S += k v^T): returns the sum")
    ax_d.axvline(d["switch_at"] + 0.5, color="gray", ls="--", lw=1)
    ax_d.text(d["switch_at"] + 0.7, max(d["err_linear"]) / 3, "value changes", fontsize=8, color="gray")
    ax_d.set_title("Delta rule corrects: reading a key converges to its latest value")
    ax_d.set_xlabel("writes of the same key")
    ax_d.set_ylabel("|read - latest value|")
    ax_d.legend(fontsize=8)

    gd = data["gates"]
    ax_g.plot(gd["f"], gd["g_v1"], label="v1: -softplus(f)  (unbounded)")
    ax_g.plot(gd["f"], gd["g_v2"], label=f"v2: {gd['lower_bound']:g} * sigmoid(f)  (bounded)")
    ax_g.axhline(gd["lower_bound"], color="gray", ls="--", lw=1)
    ax_g.set_title("Log-decay g = log a per channel")
    ax_g.set_xlabel("gate input f")
    ax_g.set_ylabel("g")
    ax_g.legend(fontsize=8)
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------
# kcp.png
# ---------------------------------------------------------------------------------------------


def direct_sum_vs_scan(*, T: int = 64, n_segments: int = 4, B: int = 1, H: int = 1, K: int = 16, V: int = 16,
                       chunk_size: int = 16, seed: int = 0) -> dict:
    """Compare two ways of recombining per-segment states with the true ones (fp64).

    Inputs from ``demo_inputs(seed=seed)`` (gate v1 with A_log = dt_bias = 0); T tokens cut into
    n_segments equal segments. The truth is chunk_kda on the whole sequence, with checkpoints at
    the segment boundaries.
    direct: sum_r S~_r, the states each segment reaches from zero, just added;
    scan:   the KCP prefix scan of the (M_r, S~_r) summaries (``simulate_kcp``).
    Returns relative Frobenius (``*_rel``) and max-abs (``*_max``) errors of the final state, the
    scan's max-abs error over all incoming states and its output error, and the state's rms.
    """
    if T % n_segments:
        raise ValueError(f"T={T} must be a multiple of n_segments={n_segments}")
    q, k, v, g, beta = demo_inputs(B, T, H, K, V, seed=seed)
    L = T // n_segments
    bounds = [L * (r + 1) for r in range(n_segments - 1)]
    o_ref, S_ref, ck = chunk_kda(q, k, v, g, beta, output_final_state=True, chunk_size=chunk_size,
                                 checkpoint_positions=[bounds] * B)
    o, S_scan, _, S_all, incoming = simulate_kcp(q, k, v, g, beta, [L] * n_segments, chunk_size=chunk_size)
    true_in = torch.cat([torch.zeros_like(S_ref)[None], torch.stack(ck, dim=1)])  # [W, B, H, K, V]
    S_direct = S_all.sum(0)
    return {
        "direct_rel": _rel(S_direct, S_ref), "direct_max": (S_direct - S_ref).abs().max().item(),
        "scan_rel": _rel(S_scan, S_ref), "scan_max": (S_scan - S_ref).abs().max().item(),
        "scan_incoming_max": (incoming - true_in).abs().max().item(),
        "output_rel": _rel(o, o_ref), "state_rms": S_ref.pow(2).mean().sqrt().item(),
        "setup": dict(T=T, n_segments=n_segments, B=B, H=H, K=K, V=V, chunk_size=chunk_size, seed=seed),
    }


def kcp_data(*, seed: int = 0) -> dict:
    """Numbers behind ``kcp.png``.

    errors: ``direct_sum_vs_scan`` on T = 256 tokens cut into 2, 4, 8, 16 segments (fp64).
    comm:   bytes one rank sends per layer as the total context T grows, world = 8 ranks, batch 1,
            8 heads, K = V = 128: KCP sends the fp32 (M, S~) summary (``kcp_comm_bytes``); softmax
            all-gather CP sends its slice's bf16 K and V (``softmax_cp_comm_bytes``). ``measured``
            holds the nbytes of real summaries from ``segment_affine`` on slices of a few lengths.
    """
    segs = [2, 4, 8, 16]
    runs = [direct_sum_vs_scan(T=256, n_segments=n, seed=seed) for n in segs]
    world, B, H, K, V = 8, 1, 8, 128, 128
    T_total = [2 ** p for p in range(7, 21)]
    measured_T, measured = [128, 512, 2048], []
    for T in measured_T:
        q, k, v, g, beta = demo_inputs(B, T // world, H, K, V, seed=seed, dtype=torch.float32)
        M, S = segment_affine(k, v, g, beta)
        measured.append(M.nbytes + S.nbytes)
    return {
        "errors": {"segments": segs, "T": 256, "direct": [r["direct_rel"] for r in runs],
                   "scan": [r["scan_rel"] for r in runs]},
        "comm": {
            "world": world, "batch": B, "heads": H, "K": K, "V": V, "T": T_total,
            "kcp_bytes": [kcp_comm_bytes(B, H, K, V, torch.float32) for _ in T_total],
            "softmax_bytes": [softmax_cp_comm_bytes(B, H, K, V, T // world, torch.bfloat16) for T in T_total],
            "measured_T": measured_T, "measured_bytes": measured,
        },
    }


def render_kcp(data: dict, path) -> Path:
    fig = _figure(1, 2, (12, 4.8))
    ax_e, ax_c = fig.axes
    e = data["errors"]
    floor = 1e-18  # an exact 0 cannot sit on a log axis
    ax_e.semilogy(e["segments"], [max(x, floor) for x in e["direct"]], "o-", label="direct sum of segment states")
    ax_e.semilogy(e["segments"], [max(x, floor) for x in e["scan"]], "s-", label="KCP prefix scan of (M, S~)")
    ax_e.set_xscale("log", base=2)
    ax_e.set_title(f"Final-state error vs one pass (T={e['T']}, fp64)")
    ax_e.set_xlabel("segments (ranks)")
    ax_e.set_ylabel("relative error")
    ax_e.legend(fontsize=8)

    c = data["comm"]
    ax_c.loglog(c["T"], c["softmax_bytes"], "o-", label="softmax CP: slice K, V (bf16)")
    ax_c.loglog(c["T"], c["kcp_bytes"], "s-", label="KCP: (M, S~) (fp32)")
    ax_c.loglog(c["measured_T"], c["measured_bytes"], "k^", ms=8, label="KCP measured (segment_affine)")
    ax_c.set_title(f"Bytes sent per rank per layer ({c['world']} ranks, {c['heads']} heads, K=V={c['K']})")
    ax_c.set_xlabel("total context T (tokens)")
    ax_c.set_ylabel("bytes")
    ax_c.legend(fontsize=8)
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------
# decay_stability.png
# ---------------------------------------------------------------------------------------------


def textbook_chunk_kda(q, k, v, g, beta, *, chunk_size: int, scale=None, dtype=torch.float32):
    """Chunkwise KDA in the textbook K / Gamma form -- kept only to show how it overflows.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g, beta as chunk_kda (H = HV). Inside a chunk with
    cumulative log-decay G and Gamma = exp(G), the decayed Gram matrices are formed as single
    matmuls, A = tril((X * Gamma) @ (K / Gamma)^T); K / Gamma = k * exp(-G) grows like
    exp(-lower_bound * C) and turns into inf (then inf * 0 = NaN) once that exceeds the dtype.
    Computes everything in ``dtype``. Returns o: [B, T, H, V].
    """
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dtype).transpose(1, 2) for x in (q, k, v, g, beta))  # [B, H, T, ...]
    S = q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        qc, kc, vc, bc = q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], beta[:, :, s:e, None]
        G = g[:, :, s:e].cumsum(2)
        gam, inv = G.exp(), (-G).exp()  # inv is the factor that overflows
        k_bar, k_hat, q_bar = kc * gam, kc * inv, qc * gam
        C = e - s
        A_kk = (bc * (k_bar @ k_hat.transpose(-1, -2))).tril(-1)
        A_qk = (q_bar @ k_hat.transpose(-1, -2)).tril()
        eye = torch.eye(C, dtype=dtype)
        uw = torch.linalg.solve_triangular(eye + A_kk, torch.cat([bc * vc, bc * k_bar], -1), upper=False)
        u = uw[..., : vc.shape[-1]] - uw[..., vc.shape[-1]:] @ S
        outs.append(scale * (q_bar @ S + A_qk @ u))
        S = gam[:, :, -1, :, None] * S + (gam[:, :, -1:, :] * k_hat).transpose(-1, -2) @ u
    return torch.cat(outs, 2).transpose(1, 2)


def _overflow_case(f_shift: float, lower_bound, chunk_size: int, *, seed: int, T: int = 64, K: int = 16) -> tuple:
    """Relative output error of the textbook form and of chunk_kda, both fp32, vs the fp64 loop."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    q, k, v = r(1, T, 1, K), F.normalize(r(1, T, 1, K), dim=-1), r(1, T, 1, K)
    g = kda_gate(r(1, T, 1, K) + f_shift, torch.zeros(1, dtype=F64), lower_bound=lower_bound)
    beta = torch.rand(1, T, 1, generator=gen, dtype=F64)
    o_ref, _ = naive_recurrent_kda(q, k, v, g, beta)
    f32 = [x.float() for x in (q, k, v, g, beta)]
    o_text = textbook_chunk_kda(*f32, chunk_size=chunk_size)
    o_hyla, _ = chunk_kda(*f32, chunk_size=chunk_size)
    return _rel(o_text, o_ref), _rel(o_hyla, o_ref)


def decay_stability_data(*, seed: int = 0) -> dict:
    """Numbers behind the four panels of ``decay_stability.png``.

    bound:  max_reciprocal_decay(lower_bound, tile) for tiles 1..64 and three lower bounds, with
            the largest finite fp16 / bf16 / fp32 values.
    safe:   safe_chunk_size(lower_bound, dtype) for lower bounds -0.5..-20 (0 where no tile is safe).
    tiles:  bounded gate v2 (lower_bound = -5, f ~ N(2, 1) so g sits near the bound), fp32: output
            error of the textbook K / Gamma form and of chunk_kda vs the fp64 loop, per chunk size.
    shifts: unbounded gate v1 -softplus(f + shift), tile 16, fp32: the same two errors per shift.
    An error of inf means the output had inf / NaN.
    """
    tiles = list(range(1, 65))
    bounds = [-1.0, -5.0, -8.0]
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    ceilings = {str(d).replace("torch.", ""): torch.finfo(d).max for d in dtypes}
    lbs = [-0.5 * i for i in range(1, 41)]

    def safe(lb, dtype):
        try:
            return safe_chunk_size(lb, dtype)
        except ValueError:  # not even one token fits
            return 0

    chunk_sizes = [8, 16, 32, 64]
    by_tile = [_overflow_case(2.0, -5.0, c, seed=seed) for c in chunk_sizes]
    shifts = [0.0, 3.0, 6.0, 9.0]
    by_shift = [_overflow_case(s, None, 16, seed=seed) for s in shifts]
    return {
        "bound": {"tiles": tiles, "ceilings": ceilings,
                  "curves": {lb: [max_reciprocal_decay(lb, t) for t in tiles] for lb in bounds}},
        "safe": {"lower_bounds": lbs,
                 "sizes": {name: [safe(lb, d) for lb in lbs]
                           for name, d in (("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                           ("float32", torch.float32))}},
        "tiles": {"lower_bound": -5.0, "chunk_sizes": chunk_sizes, "safe_fp32": safe(-5.0, torch.float32),
                  "textbook": [t for t, _ in by_tile], "hyla": [h for _, h in by_tile]},
        "shifts": {"chunk_size": 16, "shifts": shifts,
                   "textbook": [t for t, _ in by_shift], "hyla": [h for _, h in by_shift]},
    }


def _error_panel(ax, x, textbook, hyla, xlabel):
    """Log-scale errors; non-finite (overflowed) points are drawn as red crosses at the top."""
    finite = [e for e in textbook + hyla if math.isfinite(e) and e > 0]
    top = max(finite + [1.0]) * 1e3
    floor = 1e-18
    ax.semilogy(x, [e if math.isfinite(e) else math.nan for e in textbook], "o-", ms=11, mfc="none", mew=2,
                label="textbook K / Gamma form")
    ax.semilogy(x, [max(e, floor) for e in hyla], "s-", ms=5, label="hyla chunk_kda")
    bad = [xi for xi, e in zip(x, textbook) if not math.isfinite(e)]
    if bad:
        ax.plot(bad, [top] * len(bad), "rx", ms=12, mew=3, label="overflow: inf / NaN output")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("relative output error (fp32 vs fp64 loop)")
    ax.legend(fontsize=8)


def render_decay_stability(data: dict, path) -> Path:
    fig = _figure(2, 2, (11, 8.5))
    ax_b, ax_s, ax_t, ax_f = fig.axes

    b = data["bound"]
    for lb, ys in b["curves"].items():
        ax_b.semilogy(b["tiles"], [y if math.isfinite(y) else math.nan for y in ys], label=f"lower bound {lb:g}")
    for i, (name, ceil) in enumerate(b["ceilings"].items()):
        ax_b.axhline(ceil, ls="--", lw=1, color="gray")
        # bf16 and fp32 share an exponent range: put their labels at opposite ends of the line.
        left = i % 2 == 1
        ax_b.text(b["tiles"][0 if left else -1], ceil, f"{name} max", fontsize=7, va="bottom",
                  ha="left" if left else "right", color="gray")
    ax_b.set_title("Largest 1/gamma in a tile: exp(-lower_bound * tile)")
    ax_b.set_xlabel("tile size (tokens)")
    ax_b.legend(fontsize=8)

    s = data["safe"]
    for (name, ys), style in zip(s["sizes"].items(), [dict(lw=4, alpha=0.5), dict(lw=1.5), dict(lw=1.5, ls="--")]):
        ax_s.plot(s["lower_bounds"], ys, drawstyle="steps-mid", label=name, **style)
    ax_s.set_yscale("symlog", linthresh=1)
    ax_s.set_title("safe_chunk_size(lower_bound, dtype)  (bf16 = fp32 range)")
    ax_s.set_xlabel("gate lower bound")
    ax_s.set_ylabel("largest safe tile (0 = none)")
    ax_s.legend(fontsize=8)

    t = data["tiles"]
    _error_panel(ax_t, t["chunk_sizes"], t["textbook"], t["hyla"], "chunk size")
    ax_t.axvline(t["safe_fp32"], ls="--", lw=1, color="gray")
    ax_t.set_xscale("log", base=2)
    ax_t.set_title(f"Bounded gate (lower bound {t['lower_bound']:g}), fp32: safe tile is {t['safe_fp32']}")

    f = data["shifts"]
    _error_panel(ax_f, f["shifts"], f["textbook"], f["hyla"], "gate input shift s in -softplus(f + s)")
    ax_f.set_title(f"Unbounded gate v1, tile {f['chunk_size']}, fp32")
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def _figure(rows: int, cols: int, size):
    try:
        from matplotlib.figure import Figure
    except ImportError as err:  # matplotlib is the optional "plot" extra
        raise ImportError("hyla plots need matplotlib: pip install 'hyla[plot]'") from err
    fig = Figure(figsize=size, layout="constrained")
    fig.subplots(rows, cols)
    return fig


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")  # a bare Figure renders through the Agg canvas
    return path


def render_all(out_dir) -> dict[str, Path]:
    """Compute and draw every figure into ``out_dir``. Returns {name: path of the PNG}."""
    out = Path(out_dir)
    return {
        "kda_principle": render_kda_principle(kda_principle_data(), out / "kda_principle.png"),
        "kcp": render_kcp(kcp_data(), out / "kcp.png"),
        "decay_stability": render_decay_stability(decay_stability_data(), out / "decay_stability.png"),
    }


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Render hyla's explanatory plots (PNG).")
    parser.add_argument("--out", required=True, help="output directory")
    for name, p in render_all(parser.parse_args().out).items():
        print(f"{name}: {p}")
