"""The one door to torch's private APIs.

labkit's instruments lean on a few private torch names (fake tensors, dispatch modes, saved-tensor
handles, profiler internals, foreach kernels). Every one of them is reached through this module and
nowhere else, so a torch upgrade that moves or changes one breaks here, with a `TorchCompatError`
naming the entry and the installed torch version, instead of somewhere deep inside an instrument.
`tests/test_torch_compat.py` exercises every entry.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from labkit.errors import LabkitError

__all__ = [
    "TorchCompatError",
    "foreach_copy_",
    "foreach_norm",
    "foreach_sub",
]


class TorchCompatError(LabkitError):
    """A private torch API that labkit relies on is missing or changed in the installed torch."""


def private(module: str, name: str) -> Any:
    """``module.name`` from torch, or a `TorchCompatError` naming it and the installed torch."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise TorchCompatError(
            f"torch {torch.__version__} has no {module}.{name}, a private API labkit relies on "
            f"({error}): install a torch in the range pyproject.toml declares, or report it"
        ) from error


foreach_copy_ = private("torch", "_foreach_copy_")
foreach_sub = private("torch", "_foreach_sub")
foreach_norm = private("torch", "_foreach_norm")
