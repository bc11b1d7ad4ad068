"""Where each lab is defined: one private module per lab, imported when the lab is first used."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

from labkit.errors import LabkitError
from labkit.labs._lab import Lab

__all__: list[str] = []

# Every module of this package named _labNN is lab NN: adding a lab is adding its module.
LAB_MODULES = {module.name[len("_lab"):]: f"labkit.labs.{module.name}"
               for module in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda found: found.name)
               if re.fullmatch(r"_lab\d\d", module.name)}


def lab_ids() -> list[str]:
    return list(LAB_MODULES)


def lab_of(lab_id: str) -> Lab:
    """The lab with ID ``lab_id`` (its notebook's number, as "05"); LabkitError names the known ones."""
    if lab_id not in LAB_MODULES:
        raise LabkitError(f"no lab {lab_id!r}: the labs are {', '.join(LAB_MODULES)} (a notebook's number, as \"05\")")
    return importlib.import_module(LAB_MODULES[lab_id]).LAB
