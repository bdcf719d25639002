"""Plotting shared by the benches: grouped bar panels on the Agg canvas (matplotlib, imported on use)."""
from __future__ import annotations

import math

import numpy as np

from .report import short_num

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def figure(ncols: int, width: float = 6.4, height: float = 4.6):
    """A figure drawn on the Agg canvas directly (no pyplot, no GUI backend, no global state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width * ncols, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, axes


def bars(ax, groups, series, values, *, lo=None, hi=None, log=False, ylabel="", label_fmt=short_num):
    """Grouped bars: one group per entry of `groups`, one bar per series; values[s][i] (None = missing)."""
    x = np.arange(len(groups), dtype=float)
    width = 0.8 / max(len(series), 1)
    top, low = 0.0, math.inf
    for i, s in enumerate(series):
        pos = x - 0.4 + width * (i + 0.5)
        keep = [j for j, v in enumerate(values[s]) if v is not None and math.isfinite(v) and v > 0]
        if not keep:
            ax.bar([], [], width, label=s, color=COLORS[i % len(COLORS)])
            continue
        v = np.array([values[s][j] for j in keep], float)
        yerr = None
        if lo is not None and hi is not None:
            yerr = np.array([[values[s][j] - lo[s][j] for j in keep], [hi[s][j] - values[s][j] for j in keep]], float)
            top = max(top, float(np.max(v + yerr[1])))
            low = min(low, float(np.min(v - yerr[0])))
        ax.bar(pos[keep], v, width, label=s, color=COLORS[i % len(COLORS)], yerr=yerr,
               capsize=3 if yerr is not None else 0, error_kw={"elinewidth": 1})
        top, low = max(top, float(v.max())), min(low, float(v.min()))
        tips = v if yerr is None else v + yerr[1]
        for p, val, tip in zip(pos[keep], v, tips):
            ax.annotate(label_fmt(val), (p, tip), xytext=(0, 2), textcoords="offset points", ha="center",
                        va="bottom", fontsize=7, rotation=90 if len(series) * len(groups) > 12 else 0)
    ax.set_xticks(x)
    ax.set_xticklabels(groups)
    if ylabel:
        ax.set_ylabel(ylabel)
    if log and top > 0:
        ax.set_yscale("log")
        ax.set_ylim(low / 3 if 0 < low < math.inf else None, top * 6)
    elif top > 0:
        ax.set_ylim(0, top * 1.18)
    ax.grid(axis="y", alpha=0.3)


def panel_series(all_backends, runs, groups=("cold", "warm")):
    """(backends, groups, pick) of one panel: the measured backends in bench order, the groups (r["cache"]: a
    pass or cold/warm) present, and pick(backend, group, key) -> that run's value or None."""
    backends = [b for b in all_backends if any(r["backend"] == b for r in runs)]
    present = [c for c in groups if any(r["cache"] == c for r in runs)]

    def pick(b, c, k):
        return next((r[k] for r in runs if r["backend"] == b and r["cache"] == c), None)
    return backends, present, pick
