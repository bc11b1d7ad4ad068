"""labkit: the instruments of the Gradient Lab workbook.

The public API is
- the names in `__all__` below, as `from labkit import claims, GradTracer`: the instrument modules
  and the gradient-tracing names nearly every notebook uses; and
- `labkit.<module>.<name>` for each name in a public module's own `__all__`, as
  `from labkit.probes import measure_time` (a module is public when no part of its dotted name
  starts with `_`).

docs/API.md lists every public name with the first line of its docstring and the notebooks that use
it; `python docs/make_api.py --write` regenerates it. A name outside its module's `__all__` is
internal to labkit (used by labkit itself, its command line or its tests) and may change without
notice; notebooks and benchmarks use only the public API, which tests/test_public_api.py checks.
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
