"""What the tracers' plots and the graph drawing share: a matplotlib figure, imported lazily."""

from __future__ import annotations

from typing import Any

__all__ = ["subplots"]


def subplots(*args: Any, **kwargs: Any) -> tuple:
    """``plt.subplots`` with the constrained layout every tracer figure uses."""
    # pyplot, so that the active backend (inline, widget, Agg) owns the figure; never shown here.
    # Imported on first use, so that `import labkit` does not load matplotlib.
    import matplotlib.pyplot as plt

    return plt.subplots(*args, layout="constrained", **kwargs)
