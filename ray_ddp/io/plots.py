"""Figures as PNG bytes, rendered off-screen (no display on a cluster node): the one place
that sets matplotlib up, for the run curves, the sweep plot and the benchmark chart."""

from __future__ import annotations

import io
from typing import Any


def figure(columns: int, size: tuple[float, float], **subplots: Any) -> tuple[Any, Any]:
    """A figure with ``columns`` side-by-side axes, on the Agg (file-only) backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, columns, figsize=size, **subplots)


def integer_ticks(axis: Any) -> None:
    """Whole numbers only on an x axis of epochs or steps."""
    from matplotlib.ticker import MaxNLocator

    axis.xaxis.set_major_locator(MaxNLocator(integer=True))


def png_bytes(fig: Any, dpi: int = 100) -> bytes:
    """The figure as PNG bytes; the figure is closed (pyplot keeps every open one)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    return buffer.getvalue()
