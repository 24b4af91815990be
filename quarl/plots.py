"""Figures and number formats shared by ``quarl report`` (:mod:`quarl.trainer.report`) and
``quarl suite report`` (:mod:`quarl.experiments.results`).

Figures are bare ``matplotlib.figure.Figure`` objects: they render with Agg when saved and
never touch pyplot's global state (no backend switch, nothing to close).
"""

from __future__ import annotations

import io
from pathlib import Path

from quarl.io import write_bytes_atomic


def figure(n_axes: int, title: str, max_cols: int = 2, panel: tuple[float, float] = (6.0, 3.4)):
    """A figure of ``n_axes`` subplots, at most ``max_cols`` a row, each ``panel`` inches;
    the grid's unused cells are hidden. Returns ``(fig, axes)``."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ValueError("quarl's reports need matplotlib: pip install matplotlib") from e
    cols = min(n_axes, max_cols)
    rows = -(-n_axes // cols)
    fig = Figure(figsize=(panel[0] * cols, panel[1] * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[n_axes:]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, list(axes[:n_axes])


def png(fig, dpi: int = 100) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def save_png(fig, path: Path, dpi: int = 110) -> None:
    write_bytes_atomic(path, png(fig, dpi))


def color(i: int) -> str:
    """The ``i``-th series' colour (matplotlib's cycle of ten)."""
    return f"C{i % 10}"


def ema(values: list[float], span: int) -> list[float]:
    """Exponential moving average over ``span`` points, started at the first value."""
    alpha, out, acc = 2.0 / (span + 1), [], values[0]
    for v in values:
        acc = alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def fmt_sig(v: float | None) -> str:
    """Four significant digits; "-" for None."""
    return "-" if v is None else f"{v:.4g}"


def fmt_table(v: float | None) -> str:
    """A table cell's number: three significant digits, whole numbers from 100, exponent
    notation below 0.01 and from 10^4; "-" for None."""
    if v is None:
        return "-"
    a = abs(v)
    if a != 0 and (a < 1e-2 or a >= 1e4):
        return f"{v:.2e}"
    return f"{v:.3g}" if a < 100 else f"{v:.0f}"
