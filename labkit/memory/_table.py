"""The analytic activation table: one line per module, printed beside the exact count."""

from __future__ import annotations

from dataclasses import dataclass, replace

from labkit.memory.saved import SavedTensors

__all__ = ["ActivationLine", "ActivationTable", "AnalyticBytes"]


@dataclass(frozen=True)
class ActivationLine:
    """One module's share of the activations: what its backward needs kept, and the bytes.

    ``has_formula=False`` marks an *unexplained* line: bytes autograd saved (counted exactly, on
    fake tensors, in the same trace) that no module or op formula accounts for; ``layer`` then
    names the op that saved them (``unexplained: MyFunctionBackward``)."""

    module: str
    layer: str
    saves: str
    bytes: int
    exact: int | None = None
    has_formula: bool = True


class AnalyticBytes(int):
    """`analytic_activation_bytes`'s answer: an int (all the bytes), which also says how many of
    them a formula explains (``formula_bytes``) and which ops saved the rest (``unexplained``)."""

    formula_bytes: int
    unexplained: tuple[str, ...]

    def __new__(cls, total: int, formula_bytes: int, unexplained: tuple[str, ...]) -> AnalyticBytes:
        value = super().__new__(cls, total)
        value.formula_bytes, value.unexplained = formula_bytes, unexplained
        return value

    @property
    def unexplained_bytes(self) -> int:
        return int(self) - self.formula_bytes


@dataclass(frozen=True)
class ActivationTable:
    """Per-layer formula for what autograd saves, one line per module, in call order.

    A tensor two layers need (a ReLU's output that the next Linear also saves) is counted on the
    first line only, as autograd stores it once. ``against(saved_tensors(...))`` fills in the exact
    count per module so the two can be read side by side.

    Module formulas cover the standard layers; the code around them (functional calls, custom
    modules) is covered op by op; whatever autograd saved that neither explains gets an
    *unexplained* line naming the op that saved it, with its exact bytes. ``total`` (and
    ``int(table)``) counts every line; ``formula_bytes`` the explained ones, ``unexplained_bytes``
    the rest, and ``uncovered`` names the unexplained lines.
    """

    lines: tuple[ActivationLine, ...]
    title: str = "Activations saved for backward, per layer (analytic)"

    @property
    def total(self) -> int:
        return sum(line.bytes for line in self.lines)

    @property
    def formula_bytes(self) -> int:
        return sum(line.bytes for line in self.lines if line.has_formula)

    @property
    def unexplained_bytes(self) -> int:
        return self.total - self.formula_bytes

    @property
    def uncovered(self) -> tuple[str, ...]:
        """The unexplained lines, as ``module (op that saved it)``."""
        return tuple(f"{line.module} ({line.layer.removeprefix('unexplained: ')})"
                     for line in self.lines if not line.has_formula)

    def __int__(self) -> int:
        return self.total

    def against(self, exact: SavedTensors) -> ActivationTable:
        """This table with the exact count of each module beside the formula."""
        remaining = dict(exact.per_module)
        lines = [replace(line, exact=remaining.pop(line.module, 0)) for line in self.lines]
        lines += [ActivationLine(name, "-", "no line in the analytic table", 0, nbytes)
                  for name, nbytes in remaining.items()]
        return replace(self, lines=tuple(lines), title=self.title + " vs exact count")

    def __str__(self) -> str:
        compared = any(line.exact is not None for line in self.lines)
        rows = [self.title, _table_row("module", "layer", "analytic", "exact" if compared else "", "what it saves")]
        rows += [_table_row(line.module, line.layer, f"{line.bytes:,}",
                            f"{line.exact:,}" if line.exact is not None else "", line.saves)
                 for line in self.lines]
        rows.append(_table_row("total (bytes)", "", f"{self.total:,}", self._exact_total(), self._difference()))
        rows.append(f"  formula-backed: {self.formula_bytes:,} B of {self.total:,} B"
                    + (f"; unexplained (exact bytes, no formula): {', '.join(self.uncovered)}" if self.uncovered else ""))
        return "\n".join(rows)

    def _exact_total(self) -> str:
        exact = [line.exact for line in self.lines if line.exact is not None]
        return f"{sum(exact):,}" if exact else ""

    def _difference(self) -> str:
        exact = sum(line.exact or 0 for line in self.lines)
        if not exact:
            return ""
        return f"analytic - exact = {self.total - exact:+,} B ({(self.total - exact) / exact:+.2%})"


def _table_row(module, layer, analytic, exact, saves) -> str:
    return f"  {module:<24} {layer:<20} {analytic:>13} {exact:>13}   {saves}"
