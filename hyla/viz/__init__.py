"""hyla.viz: explanatory figures computed from hyla's own ops (matplotlib, PNG).

`render_all(out_dir)` writes kda_principle.png, kcp.png and decay_stability.png; each figure also
has a `*_data()` function returning the numbers behind its panels. See hyla.viz.plots.
"""

from hyla.viz.plots import decay_stability_data, kcp_data, kda_principle_data, render_all

__all__ = ["render_all", "kda_principle_data", "kcp_data", "decay_stability_data"]
