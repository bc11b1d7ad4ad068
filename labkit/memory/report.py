"""The report every memory method returns: named byte counts as Readings, a table, stacked bars."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from labkit.errors import LabkitError
from labkit.readings import Reading, format_bytes

__all__ = ["MemoryReport", "plot_reports"]


@dataclass(frozen=True)
class MemoryReport:
    """Named byte counts, each a :class:`Reading`; prints as a table, draws a stacked bar.

    The total is the sum of the rows. It is ``measured`` only when every row is, ``unavailable``
    (with the reasons) when any row is, else ``estimated``. ``int(report)`` is the total in bytes
    and raises instead of returning 0 when it is unavailable.
    """

    title: str
    rows: tuple[tuple[str, Reading], ...]
    notes: tuple[str, ...] = ()

    @property
    def total(self) -> Reading:
        missing = [f"{label}: {reading.reason}" for label, reading in self.rows if not reading.available]
        if missing:
            return Reading.unavailable("B", "; ".join(missing))
        provenance = "measured" if all(r.provenance == "measured" for _, r in self.rows) else "estimated"
        return Reading(sum(int(r) for _, r in self.rows), "B", provenance, source="sum of the rows")

    def __int__(self) -> int:
        return int(self.total)

    def __getitem__(self, label: str) -> Reading:
        for name, reading in self.rows:
            if name == label:
                return reading
        raise LabkitError(f"no row {label!r} in {self.title!r}: rows are {[n for n, _ in self.rows]}")

    def __str__(self) -> str:
        width = max([len(label) for label, _ in self.rows] + [5])
        lines = [self.title]
        for label, reading in [*self.rows, ("total", self.total)]:
            lines.append(f"  {label:<{width}}  {_reading_cell(reading)}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def plot(self, ax=None):
        """A stacked bar of the rows; returns the matplotlib Figure (see :func:`plot_reports`)."""
        return plot_reports(self, ax=ax)


def _reading_cell(reading: Reading) -> str:
    if not reading.available:
        return f"{'unavailable':>14}  ({reading.reason})"
    value = int(reading)
    source = f"  {reading.source}" if reading.source else ""
    return f"{value:>14,} B  {format_bytes(value):>10}  {reading.provenance:<9}{source}"


def plot_reports(*reports: MemoryReport, ax=None):
    """Side-by-side stacked bars, one per report, in MiB; returns the matplotlib Figure.

    Use it to put an estimate next to a measurement. Unavailable rows are left out of the bar and
    named under it. Without ``ax`` the figure is new and not left open in pyplot: it shows once as
    a cell's last value in Jupyter (pyplot's import sets up the inline display), and in a script
    ``.savefig(...)`` writes it. With ``ax`` it draws there. Used in ``13_memory``.
    """
    from matplotlib.patches import Patch

    if not reports:
        raise LabkitError("plot_reports needs at least one MemoryReport")
    if ax is None:
        import matplotlib.pyplot as plt

        figure, ax = plt.subplots(figsize=(2.5 + 2.0 * len(reports), 4.2), layout="constrained")
        # closed in pyplot so that the inline backend does not show it a second time at cell end
        plt.close(figure)
    labels = list(dict.fromkeys(label for report in reports for label, _ in report.rows))
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    for x, report in enumerate(reports):
        _stack_bar(ax, x, report, colors)
    ax.set_xticks(range(len(reports)), [_bar_label(r) for r in reports])
    ax.set_ylabel("MiB")
    handles = [Patch(color=colors[label]) for label in labels]
    ax.legend(handles, labels, fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax.figure


def _stack_bar(ax, x: int, report: MemoryReport, colors: dict[str, str]) -> None:
    bottom = 0.0
    for label, reading in report.rows:
        if reading.available:
            height = int(reading) / 2**20
            ax.bar(x, height, bottom=bottom, color=colors[label], width=0.6)
            bottom += height
    total = report.total
    ax.annotate(
        f"{int(total) / 2**20:.2f} MiB" if total.available else "unavailable",
        (x, bottom), ha="center", va="bottom", fontsize="small",
    )


def _bar_label(report: MemoryReport) -> str:
    missing = [label for label, reading in report.rows if not reading.available]
    title = textwrap.fill(report.title, 20)
    return title + (f"\n(unavailable: {', '.join(missing)})" if missing else "")
