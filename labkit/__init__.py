"""labkit: the instruments of the Gradient Lab workbook.

Notebooks import this small public API; everything else is private to labkit.
"""

from labkit import claims, datasets, distributed, explorers, grading, memory, probes, progress, repro
from labkit.errors import LabkitError
from labkit.readings import Reading
from labkit.tracers import (
    GradTracer,
    autograd_graph,
    compare_grads,
    plot_grad_flow,
    plot_grad_histograms,
    plot_grad_stat,
)

__all__ = [
    "GradTracer",
    "LabkitError",
    "Reading",
    "autograd_graph",
    "claims",
    "compare_grads",
    "datasets",
    "distributed",
    "explorers",
    "grading",
    "memory",
    "plot_grad_flow",
    "plot_grad_histograms",
    "plot_grad_stat",
    "probes",
    "progress",
    "repro",
]
