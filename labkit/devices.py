"""Turn a device request ("auto", "cpu", "cuda", "cuda:N", "mps") into a `torch.device` this machine has.

Every labkit entry point that takes a ``device=`` argument resolves it here, so the spellings it
accepts and the errors it gives are the same everywhere. ``"auto"`` picks CUDA, else the CPU: never
Apple's MPS, which has no float64, and several notebooks (00, 03, 04, 07, 08, 09) compute references
in float64 on the notebook's device. ``"mps"`` is accepted where torch reports it, for a learner who
asks for it; float64 cells then fail with torch's own error. Notebooks reach it through
``repro.setup(device=device)``.
"""

from __future__ import annotations

import torch

from labkit.errors import LabkitError

__all__ = ["AUTO_KINDS", "DEVICE_KINDS", "available_kinds", "resolve_device"]

DEVICE_KINDS = ("cuda", "mps", "cpu")
"""The device types labkit knows."""
AUTO_KINDS = ("cuda", "cpu")
"""The device types ``"auto"`` tries, in order (not MPS: no float64 there)."""


def available_kinds() -> tuple[str, ...]:
    """The device types torch reports on this machine, in `DEVICE_KINDS` order (the CPU always)."""
    present = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(), "cpu": True}
    return tuple(kind for kind in DEVICE_KINDS if present[kind])


def resolve_device(device: str | torch.device | None = "auto", *, kinds: tuple[str, ...] = DEVICE_KINDS,
                   must_exist: bool = True) -> torch.device:
    """The `torch.device` for ``device``; a `LabkitError` naming what this machine has when it cannot be.

    ``device`` is ``"auto"`` (or None), ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or a
    `torch.device`. ``kinds`` are the device types the caller can use (``"auto"`` picks the first
    of `AUTO_KINDS` among them that this machine has). With ``must_exist=False`` a device this machine lacks is still
    returned, for a caller that reports "needs a CUDA device" instead of raising.
    """
    if device is None or device == "auto":
        present = available_kinds()
        return torch.device(next(kind for kind in AUTO_KINDS if kind in present and kind in kinds + ("cpu",)))
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise LabkitError(f"unknown device {device!r}: use {_spellings(kinds)}") from error
    if dev.type not in kinds:
        raise LabkitError(f"device={device!r} is not supported here: use {_spellings(kinds)}")
    if must_exist:
        _check_present(dev, device)
    return dev


def _spellings(kinds: tuple[str, ...]) -> str:
    names = ["'auto'"] + [spelling for kind in ("cpu", "cuda", "mps") if kind in kinds
                          for spelling in ((f"'{kind}'", "'cuda:N'") if kind == "cuda" else (f"'{kind}'",))]
    return ", ".join(names[:-1]) + " or " + names[-1]


def _check_present(dev: torch.device, asked) -> None:
    has = ", ".join(available_kinds())
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LabkitError(f"device={asked!r} was asked for, but this machine has no CUDA device "
                          f"(torch.cuda.is_available() is False; it has {has}); use device='auto' or device='cpu'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise LabkitError(f"device={asked!r} was asked for, but this machine has {torch.cuda.device_count()} "
                          f"CUDA device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}; "
                          "use device='cuda' or device='auto'")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise LabkitError(f"device={asked!r} was asked for, but torch reports no MPS device here "
                          f"(torch.backends.mps.is_available() is False; this machine has {has}); "
                          "use device='auto' or device='cpu'")
