"""Plots of a `GradTracer`'s history: gradient flow at one step, one statistic over steps, and
gradient-value histograms."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from labkit.errors import LabkitError
from labkit.tracers._common import subplots
from labkit.tracers.grad_tracer import NUMERIC_GRAD_STATS, GradTracer

__all__ = ["plot_grad_flow", "plot_grad_histograms", "plot_grad_stat"]


def plot_grad_flow(source: GradTracer | list[dict], step: int | None = None) -> Any:
    """Gradient flow per parameter at one step: bars of max |g| and mean |g| on a log scale, and
    "no grad" under every parameter that received none. Used in ``08_gradient_health``.

    ``source`` is a tracer or its `GradTracer.history` records. mean |g| is measured on
    full-statistics steps, so ``step`` defaults to the latest one. Returns the figure."""
    records = _records(source)
    full_steps = sorted({r["step"] for r in records if r["mean_abs"] is not None})
    if not full_steps:
        raise LabkitError(
            "mean |g| is measured on full-statistics steps and none was recorded: "
            "use GradTracer(model, full_every=N) with N >= 1"
        )
    chosen = full_steps[-1] if step is None else step
    rows = [r for r in records if r["step"] == chosen]
    if not rows or chosen not in full_steps:
        raise LabkitError(f"step {chosen} has no full statistics: pick one of {full_steps[-10:]}")
    fig, ax = subplots(figsize=(max(6.0, 0.5 * len(rows)), 4.0))
    positions = range(len(rows))
    ax.bar(positions, [_plottable(r["max_abs"]) for r in rows], color="c", alpha=0.4, label="max |g|")
    ax.bar(positions, [_plottable(r["mean_abs"]) for r in rows], color="b", label="mean |g|")
    for position, record in zip(positions, rows):
        if record["missing"]:
            ax.text(position, 0.02, "no grad", color="red", rotation=90, ha="center",
                    va="bottom", transform=ax.get_xaxis_transform())  # fmt: skip
    ax.set_xticks(list(positions), [r["param"] for r in rows], rotation=90)
    ax.set_yscale("log")
    ax.set_ylabel("gradient magnitude")
    ax.set_title(f"gradient flow, step {chosen}")
    ax.legend()
    return fig


def plot_grad_stat(
    source: GradTracer | list[dict], stat: str = "norm", params: Iterable[str] | None = None
) -> Any:
    """One gradient statistic over steps, a line per parameter, log scale. Used in
    ``08_gradient_health``. ``stat`` is one of `NUMERIC_GRAD_STATS`. Returns the figure."""
    if stat not in NUMERIC_GRAD_STATS:
        raise LabkitError(f"unknown statistic {stat!r}: use one of {', '.join(NUMERIC_GRAD_STATS)}")
    records = [r for r in _selected(_records(source), params) if r[stat] is not None]
    if not records:
        raise LabkitError(
            f"no step recorded {stat!r}: max_abs, mean_abs and zero_frac come from full-statistics "
            "steps (GradTracer(model, full_every=N)), update_ratio from update_ratio=True"
        )
    fig, ax = subplots(figsize=(7.0, 4.0))
    for name in dict.fromkeys(r["param"] for r in records):
        points = [(r["step"], r[stat]) for r in records if r["param"] == name]
        ax.plot([s for s, _ in points], [_plottable(v) for _, v in points], label=name)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(stat)
    ax.legend(fontsize="small", ncols=2)
    return fig


def plot_grad_histograms(
    source: GradTracer | list[dict], step: int | None = None, params: Iterable[str] | None = None
) -> Any:
    """Histograms of gradient values at one full-statistics step (the latest by default), one
    panel per parameter, log counts; a panel whose counts come from a sample says so in its title
    ("sampled: 16,384 of 1.2 M values", see ``GradTracer``'s ``histogram_sample``). Used in
    ``08_gradient_health``. Returns the figure."""
    records = [r for r in _selected(_records(source), params) if r["hist_counts"] is not None]
    if not records:
        raise LabkitError(
            "no gradient histogram recorded: histograms come from full-statistics steps, "
            "use GradTracer(model, full_every=N) with N >= 1"
        )
    from matplotlib.ticker import MaxNLocator

    chosen = records[-1]["step"] if step is None else step
    rows = [r for r in records if r["step"] == chosen]
    if not rows:
        raise LabkitError(f"step {chosen} has no histograms: full-statistics steps are multiples of full_every")
    columns = min(4, len(rows))
    lines = math.ceil(len(rows) / columns)
    fig, axes = subplots(lines, columns, figsize=(3.2 * columns, 2.4 * lines), squeeze=False)
    for ax, record in zip(axes.flat, rows):
        counts = record["hist_counts"]
        width = (record["hist_hi"] - record["hist_lo"]) / len(counts)
        edges = [record["hist_lo"] + k * width for k in range(len(counts) + 1)]
        ax.stairs(counts, edges, fill=True)
        ax.set_yscale("log")
        ax.set_title(f"{record['param']}{_sample_note(record)}", fontsize="small")
        # Gradient values are tiny and span a narrow range: plain tick labels run into each other
        # ("-0.0001000005"); three ticks with a shared power of ten read cleanly.
        ax.xaxis.set_major_locator(MaxNLocator(3))
        ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 0), useOffset=False)
    for ax in list(axes.flat)[len(rows):]:
        ax.set_visible(False)
    fig.suptitle(f"gradient values, step {chosen}")
    return fig


def _sample_note(record: dict) -> str:
    sample, numel = record.get("hist_sample"), record["numel"]
    if sample is None or sample >= numel:
        return ""
    return f"\nsampled: {sample:,} of {_count_text(numel)} values"


def _count_text(count: int) -> str:
    return f"{count / 1e6:.1f} M" if count >= 1e6 else f"{count:,}"


def _records(source: GradTracer | list[dict]) -> list[dict]:
    records = source.history() if isinstance(source, GradTracer) else list(source)
    if not records:
        raise LabkitError("no gradient records to plot: trace at least one step first")
    return records


def _selected(records: list[dict], params: Iterable[str] | None) -> list[dict]:
    if params is None:
        return records
    wanted = set([params] if isinstance(params, str) else params)
    unknown = wanted - {r["param"] for r in records}
    if unknown:
        raise LabkitError(f"no records for {sorted(unknown)}: use names from tracer.names")
    return [r for r in records if r["param"] in wanted]


def _plottable(value: float | None) -> float:
    # A log axis cannot show 0, None or inf; NaN leaves a gap instead of breaking the plot.
    return value if value is not None and math.isfinite(value) and value > 0 else math.nan
