"""Colours, fonts and axis helpers shared by the plots of ``launch/plot_perf.py`` (not a script)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

# One colour per role, the same in every plot.
OURS = "#1f5fa8"
OURS_ALT = "#5fa2e0"
OURS_EAGER = "#8c6bb1"
BASELINE = "#d9541e"
BASELINE_ALT = "#f2a541"
BASELINE_OTHER = "#7a7a7a"
GOAL = "#2a9d4b"

STYLE = {
    "font.family": "DejaVu Sans",
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 9,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "figure.dpi": 110,
    "savefig.dpi": 110,
}


def load_json(data: Path, name: str):
    path = data / name
    if not path.exists():
        print(f"plot_perf: {path} not found, its plot is skipped", file=sys.stderr)
        return None
    return json.loads(path.read_text())


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def number(v: float, _pos=None) -> str:
    """Tick labels on log axes: 1, 10, 100, 1k, 10k, 4096 (no powers of ten)."""
    if v >= 1000 and v % 1000 == 0:
        return f"{v / 1000:g}k"
    return f"{v:g}"


def log_axis(ax, axis: str, subs: tuple[float, ...] = (1.0, 2.0, 5.0)) -> None:
    target = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    target.set_major_locator(LogLocator(base=10, subs=subs))
    target.set_major_formatter(FuncFormatter(number))
    target.set_minor_formatter(NullFormatter())


def ticks_at(ax, xs) -> None:
    """x ticks at the measured points only (a log axis otherwise labels every 1-2-5 step)."""
    ax.set_xticks(list(xs), [number(x) for x in xs])
    ax.xaxis.set_minor_locator(LogLocator(base=10, subs=()))


def title(fig, what: str, gpu: str, date: str, command: str) -> None:
    fig.suptitle(f"{what}\n{gpu}, {date}", fontsize=12, fontweight="bold")
    fig.supxlabel(f"reproduce on a GPU: {command}", fontsize=8, family="DejaVu Sans Mono", color="#444")


def save(fig, out: Path, name: str, written: list[Path]) -> None:
    path = out / name
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    written.append(path)


def bar_labels(ax, bars, fmt: str) -> None:
    """The value at the end of each horizontal bar."""
    for bar in bars:
        v = bar.get_width()
        ax.annotate(
            format(v, fmt),
            (v, bar.get_y() + bar.get_height() / 2),
            xytext=(3, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
        )
