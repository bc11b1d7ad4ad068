"""`GradTracer`'s alert rules: which gradient failures a step's rows show, as `Alert` records."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from labkit.tracers._rows import _ActivationRow, _GradRow

__all__ = ["ALERT_KINDS", "EXPLODE_MIN_BASELINE", "Alert"]

ALERT_KINDS = ("vanishing", "exploding", "nonfinite", "dead_units", "missing", "skipped_step")
# An exploding alert compares a norm with the median of the parameter's last finite norms, and
# waits until it has this many (or all `baseline_steps`, if fewer): the median of one or two norms
# is just those steps' own, often the large, noisy norms of the first steps after initialisation,
# while the median of five is unmoved by up to two outliers.
EXPLODE_MIN_BASELINE = 5


@dataclass(frozen=True)
class Alert:
    """A gradient failure seen at one step, as `GradTracer.alerts` returns it: ``kind`` is one of
    `ALERT_KINDS`, ``name`` the parameter (or module, for dead units), ``value`` the measured
    number and ``limit`` the threshold it crossed. ``str(alert)`` is the sentence to print."""

    kind: str
    step: int
    name: str
    value: float | None
    limit: float | None
    message: str

    def __str__(self) -> str:
        return self.message


def _gradient_alerts(
    rows: list[_GradRow], baselines: list[deque], vanish_ratio: float, explode_factor: float
) -> list[Alert]:
    """The alerts of one step's rows; each parameter's finite norm joins its baseline after."""
    received = [row for row in rows if not row.missing and math.isfinite(row.norm)]
    largest_rms = max((_rms(row) for row in received), default=0.0)
    alerts = []
    for row, baseline in zip(rows, baselines):
        alert = _row_alert(row, baseline, largest_rms, vanish_ratio, explode_factor)
        if alert is not None:
            alerts.append(alert)
        if not row.missing and math.isfinite(row.norm):
            baseline.append(row.norm)
    return alerts


def _median(values: Iterable[float]) -> float:
    # statistics.median costs several times more, and this runs per parameter per step.
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _rms(row: _GradRow) -> float:
    return row.norm / math.sqrt(row.numel)


def _row_alert(
    row: _GradRow, baseline: deque, largest_rms: float, vanish_ratio: float, explode_factor: float
) -> Alert | None:
    step, name = row.step, row.param
    if row.missing:
        if row.frozen:
            return None  # freezing is a decision; the record still says missing and frozen
        return Alert("missing", step, name, None, None,
                     f"step {step}: '{name}' requires grad but received no gradient this step "
                     "(detached from the loss, or not used in the forward pass)")  # fmt: skip
    if row.nonfinite:
        return Alert("nonfinite", step, name, float(row.nonfinite), 0.0,
                     f"step {step}: '{name}' has {row.nonfinite} non-finite gradient values "
                     f"of {row.numel}")  # fmt: skip
    if len(baseline) >= min(EXPLODE_MIN_BASELINE, baseline.maxlen):
        typical = _median(baseline)
        if typical > 0 and row.norm > explode_factor * typical:
            return Alert("exploding", step, name, row.norm, explode_factor * typical,
                         f"step {step}: '{name}' gradient norm {row.norm:.3g} is "
                         f"{row.norm / typical:.3g}x its rolling median {typical:.3g} "
                         f"(limit {explode_factor:g}x)")  # fmt: skip
    rms = _rms(row)
    if math.isfinite(rms) and rms <= vanish_ratio * largest_rms:
        return Alert("vanishing", step, name, rms, vanish_ratio * largest_rms,
                     f"step {step}: '{name}' rms gradient {rms:.3g} is at most {vanish_ratio:g} x "
                     f"the step's largest ({largest_rms:.3g})")  # fmt: skip
    return None


def _skipped_step_alert(step: int) -> Alert:
    return Alert("skipped_step", step, "(optimizer)", None, None,
                 f"step {step}: its gradients were zeroed for the next step without optimizer.step() "
                 "running (GradScaler skips it when it finds inf/NaN gradients): recorded, "
                 "no update applied")  # fmt: skip


def _dead_unit_alerts(rows: list[_ActivationRow], dead_above: float) -> list[Alert]:
    return [
        Alert("dead_units", row.step, row.module, row.dead, dead_above,
              f"step {row.step}: {row.dead:.0%} of the units of {row.kind} '{row.module}' never "
              f"fired (output 0 for every sample; limit {dead_above:.0%})")  # fmt: skip
        for row in rows
        if row.dead is not None and row.dead >= dead_above
    ]
