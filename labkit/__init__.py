"""labkit: the instruments of the Gradient Lab workbook.

Notebooks import this small public API; everything else is private to labkit.
"""

from labkit import claims, progress, repro
from labkit.errors import LabkitError
from labkit.readings import Reading

__all__ = ["LabkitError", "Reading", "claims", "progress", "repro"]
