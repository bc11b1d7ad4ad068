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

import re
import warnings

import torch

from labkit.errors import LabkitError

# The torch releases labkit is tested on: pyproject.toml's range (tests/test_install.py keeps the two
# equal). Below it the instruments fail in obscure places (labkit/_torch_compat.py reads private torch
# APIs), so import refuses; above it they may work, so import only warns.
_SUPPORTED_TORCH = ((2, 11), (2, 16))  # lowest supported minor release, first unsupported one


def _check_torch_version(version: str) -> None:
    lowest, beyond = _SUPPORTED_TORCH
    supported = f"torch>={lowest[0]}.{lowest[1]},<{beyond[0]}.{beyond[1]}"
    found = re.match(r"(\d+)\.(\d+)", version)
    minor = (int(found[1]), int(found[2])) if found else (0, 0)
    if minor < lowest:
        raise LabkitError(
            f"labkit needs {supported}, and this Python has torch {version}. Install a supported torch, e.g. "
            f"pip install '{supported}', or the course's exact stack with make setup (README, Install)"
        )
    if minor >= beyond:
        warnings.warn(f"labkit is tested on {supported}; torch {version} is newer, and some instruments may "
                      "fail or print other numbers than the notebooks' stored outputs", stacklevel=2)


_check_torch_version(torch.__version__)

from labkit import claims, datasets, distributed, explorers, grading, memory, probes, progress, repro  # noqa: E402
from labkit.readings import Reading  # noqa: E402
from labkit.tracers import (  # noqa: E402
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
