"""Values that carry where they came from.

A memory peak or a bandwidth figure is only useful if you know whether it was measured on this
machine, estimated from formulas, copied from a datasheet, or could not be had at all.
`torch.cuda.max_memory_allocated()` returns 0 on a CPU build; a `Reading` never does that: an
unavailable value has no number and says why. Used in `16_speed_and_memory` and by
`labkit.memory` and `labkit.probes`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from labkit.errors import LabkitError

__all__ = ["UnavailableReading"]  # Reading is declared as labkit.Reading

PROVENANCES = ("measured", "estimated", "datasheet", "unavailable")


def format_bytes(nbytes: float) -> str:
    """A byte count as people read it: ``512 B``, ``1.5 KiB``, ``2.0 MiB``, ``1.25 GiB`` (negative
    counts, such as a change in memory, keep their sign). labkit's one byte formatter."""
    for unit in ("B", "KiB", "MiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} GiB"


class UnavailableReading(LabkitError):
    """Raised when a number is asked of a reading that has none."""


@dataclass(frozen=True)
class Reading:
    """One number with its unit and provenance.

    ``provenance`` is one of ``measured``, ``estimated``, ``datasheet`` or ``unavailable``.
    ``reason`` is required when unavailable; ``source`` says how the number was obtained
    (a method, a datasheet reference).
    """

    value: float | int | None
    unit: str
    provenance: str
    reason: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        if self.provenance not in PROVENANCES:
            raise LabkitError(
                f"unknown provenance {self.provenance!r}: use one of {', '.join(PROVENANCES)}"
            )
        if self.provenance == "unavailable":
            if self.value is not None or not self.reason:
                raise LabkitError("an unavailable reading has value=None and a reason saying why")
        elif self.value is None or (isinstance(self.value, float) and math.isnan(self.value)):
            raise LabkitError(
                f"a {self.provenance} reading needs a number; use Reading.unavailable(unit, reason)"
            )
        elif not isinstance(self.value, numbers.Real) or isinstance(self.value, bool):
            raise LabkitError(f"a reading's value is a number, not {type(self.value).__name__} {self.value!r}: "
                              "pass int(...) or float(...) of it")

    @classmethod
    def unavailable(cls, unit: str, reason: str) -> Reading:
        return cls(None, unit, "unavailable", reason=reason)

    @property
    def available(self) -> bool:
        return self.provenance != "unavailable"

    def _number(self) -> float | int:
        if self.value is None:
            raise UnavailableReading(f"no value in {self.unit}: {self.reason}")
        return self.value

    def __float__(self) -> float:
        return float(self._number())

    def __int__(self) -> int:
        return int(self._number())

    def __str__(self) -> str:
        if self.value is None:
            return f"unavailable ({self.reason})"
        number = f"{self.value:,}" if isinstance(self.value, int) else f"{self.value:.4g}"
        return f"{number} {self.unit} ({self.provenance})"
