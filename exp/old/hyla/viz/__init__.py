"""hyla.viz: explanatory figures computed from hyla's own ops (matplotlib, PNG).

`render_all(out_dir)` writes kda_principle.png, kcp.png and decay_stability.png; each figure also
has a `*_data()` function returning the numbers behind its panels. See hyla.viz.plots.
"""

__all__ = ["render_all", "kda_principle_data", "kcp_data", "decay_stability_data"]


def __getattr__(name):
    # Lazy, so `python -m hyla.viz.plots` does not import the module twice.
    if name in __all__:
        from hyla.viz import plots

        return getattr(plots, name)
    raise AttributeError(f"module 'hyla.viz' has no attribute {name!r}")
