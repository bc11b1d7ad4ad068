"""Where each lab is defined: one private module per lab, imported when the lab is first used."""

from __future__ import annotations

import importlib

from labkit.errors import LabkitError
from labkit.labs._lab import Lab

__all__: list[str] = []

LAB_MODULES = {"00": "labkit.labs._lab00", "02": "labkit.labs._lab02", "05": "labkit.labs._lab05",
               "09": "labkit.labs._lab09", "10": "labkit.labs._lab10", "16": "labkit.labs._lab16",
               "13": "labkit.labs._lab13"}


def lab_ids() -> list[str]:
    return list(LAB_MODULES)


def lab_of(lab_id: str) -> Lab:
    """The lab with ID ``lab_id`` (its notebook's number, as "05"); LabkitError names the known ones."""
    if lab_id not in LAB_MODULES:
        raise LabkitError(f"no lab {lab_id!r}: the labs are {', '.join(LAB_MODULES)} (a notebook's number, as \"05\")")
    return importlib.import_module(LAB_MODULES[lab_id]).LAB
