"""Reproducible runs: seeding, device choice and deterministic kernels, what every notebook needs.

Every notebook starts with `repro.check_parameters(globals())` (`labkit.parameters`: the values
papermill or a learner gave, checked against the parameters cell) and `dev = repro.setup(seed=seed,
device=device)`. The command
`python -m labkit repro` (rerunning a notebook with other parameters, sweeps) is
labkit/runner/repro_command.py, outside the kernel; notebook files are `labkit.notebooks`. Used in `00_start_here`.
"""

from __future__ import annotations

import contextlib
import os
import random
import warnings
from collections.abc import Iterator

import numpy as np
import torch

from labkit import figures
from labkit._torch_compat import use_deterministic_algorithms
from labkit.devices import resolve_device
from labkit.errors import LabkitError
from labkit.parameters import check_parameters

__all__ = ["check_parameters", "fastest_kernels", "seed_everything", "setup"]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (every device) from one integer."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise LabkitError(f"seed must be a non-negative int, got {seed!r}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup(seed: int = 0, device: str = "auto", deterministic: bool = True) -> torch.device:
    """Seed everything, choose the device and ask torch for deterministic kernels.

    ``device`` is "auto", "cpu", "cuda", "cuda:N" or "mps" (see `labkit.devices.resolve_device`).
    Returns the `torch.device` the notebook should use. In IPython it also makes every matplotlib
    figure show with its alt text (`labkit.figures`). Deterministic mode lets an op with no
    deterministic kernel (CUDA only) run anyway, without a warning, so a notebook's stored outputs
    stay the same on CPU and GPU.
    """
    dev = resolve_device(device)
    seed_everything(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        # Only CUDA has ops without a deterministic kernel; their warnings would make a GPU run's
        # stored outputs differ from the CPU's, so they are silenced (the op still runs).
        warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation.*")
    # Inductor advises TF32 when it compiles a float32 matmul on an Ampere-or-newer GPU; the
    # notebooks keep IEEE float32 on purpose (TF32 would change the numbers they compare).
    warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores for float32 matrix multiplication")
    figures.install()
    return dev


@contextlib.contextmanager
def fastest_kernels() -> Iterator[None]:
    """Torch's defaults for a timing: deterministic mode off, so cuDNN and cuBLAS may pick any
    kernel (with ``cudnn.benchmark``, the fastest they find). `setup` turns deterministic mode on
    for the stored outputs; a speed claim is measured as users run. Restores the mode on exit.
    Used in ``16_speed_and_memory`` (case K3)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    use_deterministic_algorithms(False)
    try:
        yield
    finally:
        use_deterministic_algorithms(enabled, warn_only=warn_only)
