"""Figures of one `hyla bench serve` run (`--plot DIR`), drawn with matplotlib's Agg canvas (no
display needed, no global backend change).

- latency_cdf.png: the empirical CDFs of TTFT, ITL and E2EL (ms) with the median and p99 marked;
- latency_over_time.png: each request's TTFT and E2EL against the time it was sent, failed
  requests marked on the time axis; below, every inter-token gap against the time it ended.

Both read the per-request lists of a result (vLLM's keys: start_times, ttfts, itls, latencies,
errors; an empty error is a success), so a result JSON saved with --save-detailed can be drawn
again: `python -m hyla.bench.serve.plots RESULT.json --out DIR`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _figure(rows: int, size: tuple[float, float], **subplots):
    try:
        from matplotlib.figure import Figure
    except ImportError as err:  # matplotlib is the optional "plot" extra
        raise ImportError("hyla bench serve --plot needs matplotlib: pip install 'hyla[plot]'") from err
    fig = Figure(figsize=size, layout="constrained")
    fig.subplots(rows, **subplots)
    return fig


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")  # a bare Figure renders through the Agg canvas
    return path


def _successes(result: dict) -> list[int]:
    return [i for i, error in enumerate(result["errors"]) if not error]


def _cdf_panel(ax, values_ms: list[float], name: str) -> None:
    if not values_ms:
        ax.text(0.5, 0.5, "no value", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(name)
        return
    v = np.sort(np.asarray(values_ms))
    ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post")
    for q, style, y, side in ((50, ":", 0.02, "left"), (99, "--", 0.1, "right")):
        x = float(np.percentile(v, q))
        ax.axvline(x, color="gray", ls=style, lw=1)
        label = f" p{q} {x:.1f} " if side == "left" else f"p{q} {x:.1f} "
        ax.text(x, y, label, fontsize=7, color="gray", ha=side)
    ax.set_title(f"{name} ({len(v)} values)")
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction ≤ x")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def render_latency_cdf(result: dict, path) -> Path:
    ok = _successes(result)
    fig = _figure(1, (13, 3.8), ncols=3)
    ax_ttft, ax_itl, ax_e2el = fig.axes
    _cdf_panel(ax_ttft, [result["ttfts"][i] * 1e3 for i in ok], "TTFT")
    _cdf_panel(ax_itl, [gap * 1e3 for i in ok for gap in result["itls"][i]], "ITL")
    _cdf_panel(ax_e2el, [result["latencies"][i] * 1e3 for i in ok], "E2EL")
    return _save(fig, Path(path))


def render_latency_over_time(result: dict, path) -> Path:
    ok = _successes(result)
    failed = sorted(set(range(len(result["errors"]))) - set(ok))
    fig = _figure(2, (11, 7), sharex=True)
    ax_req, ax_itl = fig.axes
    start = [result["start_times"][i] for i in ok]
    ax_req.scatter(start, [result["latencies"][i] * 1e3 for i in ok], s=10, label="E2EL")
    ax_req.scatter(start, [result["ttfts"][i] * 1e3 for i in ok], s=10, label="TTFT")
    if failed:
        ax_req.scatter([result["start_times"][i] for i in failed], [0.0] * len(failed), marker="x", color="red",
                       label=f"failed ({len(failed)})")
    ax_req.set_ylabel("ms")
    ax_req.set_title("Each request's latency, by the time it was sent")
    ax_req.legend(fontsize=8)
    ax_req.grid(alpha=0.3)

    ends, gaps = [], []
    for i in ok:
        token_times = result["start_times"][i] + result["ttfts"][i] + np.cumsum(result["itls"][i])
        ends.extend(token_times.tolist())
        gaps.extend(g * 1e3 for g in result["itls"][i])
    ax_itl.scatter(ends, gaps, s=4, alpha=0.5)
    ax_itl.set_ylabel("ITL (ms)")
    ax_itl.set_xlabel("time since the benchmark's start (s)")
    ax_itl.set_title("Every inter-token gap, by the time its token arrived")
    ax_itl.grid(alpha=0.3)
    return _save(fig, Path(path))


def render_serve_plots(result: dict, out_dir) -> dict[str, Path]:
    """Draw both figures into out_dir. Returns {name: path of the PNG}."""
    missing = [k for k in ("start_times", "ttfts", "itls", "latencies", "errors") if k not in result]
    if missing:
        raise ValueError(f"the result lacks the per-request lists {missing} (saved with --save-detailed)")
    out = Path(out_dir)
    return {
        "latency_cdf": render_latency_cdf(result, out / "latency_cdf.png"),
        "latency_over_time": render_latency_over_time(result, out / "latency_over_time.png"),
    }


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description="Draw the figures of a `hyla bench serve` result JSON.")
    parser.add_argument("result", help="a result JSON saved with --save-result --save-detailed")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args()
    for name, p in render_serve_plots(json.loads(Path(args.result).read_text()), args.out).items():
        print(f"{name}: {p}")
