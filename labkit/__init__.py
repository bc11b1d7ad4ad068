"""labkit: the instruments of the Gradient Lab workbook.

The public API is the package level:
- the names in `__all__` below, as `from labkit import claims, GradTracer`: the instrument modules
  and the gradient-tracing names nearly every notebook uses; and
- `labkit.<module>.<name>` for each name in a public module's own `__all__`, as
  `from labkit.probes import measure_time`, where a public module is one level below labkit and
  does not start with `_` (a module inside a subpackage, such as `labkit.memory.measure`, is that
  package's implementation).

Each object is declared in one `__all__` only, so it has one spelling. docs/API.md lists every
public name with the first line of its docstring and the notebooks that use it; `python
docs/make_api.py --write` regenerates it. A name outside its module's `__all__` is internal to
labkit (used by labkit itself, its command line or its tests) and may change without notice;
notebooks and benchmarks use only the public API, which tests/test_public_api.py checks.

The names are imported when first read, so `import labkit` (and every `python -m labkit` command
that needs no instrument) imports no torch; the installed torch's version is checked at import,
from its package metadata.
"""

import re
import warnings
from importlib import metadata

from labkit._lazy import lazy_attributes
from labkit._version import labkit_version
from labkit.errors import LabkitError

__version__ = labkit_version()
"""The installed labkit's version: pyproject.toml's, read from the distribution's metadata (no torch)."""

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


def _installed_torch() -> str | None:
    """The installed torch's version, read from its package metadata: checking it does not import torch."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None  # no torch: the modules that need it fail on their own `import torch`, naming it


# Every part of labkit is imported after this package, so the check runs before any of them imports torch.
if (_torch_version := _installed_torch()) is not None:
    _check_torch_version(_torch_version)

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

# Read lazily (PEP 562): `import labkit` imports no torch, and `labkit.GradTracer` imports labkit.tracers.
_HOMES = {name: f"labkit.{name}" for name in
          ("claims", "datasets", "distributed", "explorers", "grading", "memory", "probes", "progress", "repro")}
_HOMES |= {"Reading": "labkit.readings"}
_HOMES |= {name: "labkit.tracers" for name in
           ("GradTracer", "autograd_graph", "compare_grads", "plot_grad_flow", "plot_grad_histograms", "plot_grad_stat")}
__getattr__, __dir__ = lazy_attributes(__name__, _HOMES)
