"""Hook-based gradient tracers: which parameters got a gradient, how big, and when it went wrong.

Three instruments, each in its own module, with the notebooks that use them:

- `GradTracer` (``08_gradient_health``, `labkit.tracers.grad_tracer`): per-parameter gradient
  statistics from PyTorch's ``register_post_accumulate_grad_hook``, optional activation statistics
  (forward hooks) and update:data ratios (optimizer step hooks), alerts and a bounded history;
  its plots (`plot_grad_flow`, `plot_grad_stat`, `plot_grad_histograms`) are in
  `labkit.tracers.plots`.
- `compare_grads` (``02_gradients_accumulate``, ``11_compile_drift``, `labkit.tracers.compare`):
  an exact / allclose / max-diff report between two sets of gradients.
- `autograd_graph` (``01_computation_graph``, `labkit.tracers.graph`): the autograd graph behind a
  tensor, with the tensors each node saved and the parameters the output cannot reach.

`labkit` declares the instruments themselves (`labkit.GradTracer`, `labkit.compare_grads`,
`labkit.autograd_graph`, `labkit.plot_grad_*`); this package declares what they return and their
settings. The modules above are its implementation.
"""

# The instruments themselves, declared as labkit.GradTracer and so on: labkit/__init__.py reads them here.
from labkit.tracers.compare import (
    GradComparison,
    GradDiff,
    compare_grads,  # noqa: F401
)
from labkit.tracers.grad_tracer import (
    ACTIVATION_KEYS,
    ALERT_KINDS,
    EXPLODE_MIN_BASELINE,
    HISTOGRAM_SAMPLE,
    HISTORY_KEYS,
    NUMERIC_GRAD_STATS,
    SATURATED_DERIVATIVE,
    Alert,
    GradTracer,  # noqa: F401
)
from labkit.tracers.graph import (
    AutogradGraph,
    GraphNode,
    SavedTensor,
    autograd_graph,  # noqa: F401
)
from labkit.tracers.plots import plot_grad_flow, plot_grad_histograms, plot_grad_stat  # noqa: F401

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
    "GraphNode",
    "SavedTensor",
]
