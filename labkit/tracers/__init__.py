"""Hook-based gradient tracers: which parameters got a gradient, how big, and when it went wrong.

Three instruments, each taught in a notebook, each in its own module:

- `GradTracer` (``08_gradient_health``, `labkit.tracers.grad_tracer`): per-parameter gradient
  statistics from PyTorch's ``register_post_accumulate_grad_hook``, optional activation statistics
  (forward hooks) and update:data ratios (optimizer step hooks), alerts and a bounded history;
  its plots (`plot_grad_flow`, `plot_grad_stat`, `plot_grad_histograms`) are in
  `labkit.tracers.plots`.
- `compare_grads` (``02_gradients_accumulate``, ``11_compile_drift``, `labkit.tracers.compare`):
  an exact / allclose / max-diff report between two sets of gradients.
- `autograd_graph` (``01_computation_graph``, `labkit.tracers.graph`): the autograd graph behind a
  tensor, with the tensors each node saved and the parameters the output cannot reach.

This package re-exports every public name of those modules.
"""

from labkit.tracers.compare import GradComparison, GradDiff, compare_grads
from labkit.tracers.grad_tracer import (
    ACTIVATION_KEYS,
    ALERT_KINDS,
    EXPLODE_MIN_BASELINE,
    HISTOGRAM_SAMPLE,
    HISTORY_KEYS,
    NUMERIC_GRAD_STATS,
    SATURATED_DERIVATIVE,
    Alert,
    GradTracer,
)
from labkit.tracers.graph import AutogradGraph, GraphNode, SavedTensor, autograd_graph
from labkit.tracers.plots import plot_grad_flow, plot_grad_histograms, plot_grad_stat

__all__ = [
    "ACTIVATION_KEYS",
    "ALERT_KINDS",
    "EXPLODE_MIN_BASELINE",
    "HISTOGRAM_SAMPLE",
    "HISTORY_KEYS",
    "NUMERIC_GRAD_STATS",
    "SATURATED_DERIVATIVE",
    "Alert",
    "AutogradGraph",
    "GradComparison",
    "GradDiff",
    "GradTracer",
    "GraphNode",
    "SavedTensor",
    "autograd_graph",
    "compare_grads",
    "plot_grad_flow",
    "plot_grad_histograms",
    "plot_grad_stat",
]
