"""A verdict's evidence from the values a notebook measured: one structure, rendered three ways.

A notebook passes `claims.check(..., measured={label: value, ...})`; this module checks the values,
turns them into plain JSON for the stored record (so tests and `python -m labkit claims --json` read
the numbers, not a sentence), and renders the sentence, the HTML table and the claims table's line
from that one structure, so the three always show the same numbers.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence

from labkit.errors import LabkitError

__all__: list[str] = []

Scalar = bool | int | float | str


def as_json(case_id: str, measured: Mapping) -> dict:
    """The measured values as plain JSON: tensors and NumPy scalars become numbers, tuples lists,
    non-finite floats the strings "nan", "inf" and "-inf" (JSON has no such numbers), and a float
    the number the evidence shows (`formatted`): a stored output that nbval compares holds no digit
    below what the reader sees, which another torch or BLAS may round differently."""
    if not isinstance(measured, Mapping) or not measured:
        raise LabkitError(f"{case_id}: measured= takes a dict of label -> value, such as "
                          "{'max |diff|': diff, 'steps clipped': share}; got " + repr(measured)[:80])
    return {_label(case_id, label): _plain(case_id, label, value) for label, value in measured.items()}


def _label(case_id: str, label: object) -> str:
    if not isinstance(label, str) or not label.strip():
        raise LabkitError(f"{case_id}: each measured value needs a label (a non-empty string); got {label!r}")
    return label.strip()


def _plain(case_id: str, label: str, value: object):
    if hasattr(value, "item") and hasattr(value, "shape") and _size(value) == 1:
        value = value.item()  # a one-value tensor or NumPy scalar
    if isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return float(formatted(value, grouped=False)) if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(key): _plain(case_id, label, item) for key, item in value.items()}
    if isinstance(value, Sequence):
        return [_plain(case_id, label, item) for item in value]
    raise LabkitError(f"{case_id}: the value of {label!r} is a {type(value).__name__}; pass a number, a bool, "
                      "a string, or a list or dict of those (call .item() or .tolist() on a tensor)")


def _size(value) -> int:
    shape = tuple(value.shape)
    return math.prod(shape)


def formatted(value, grouped: bool = True) -> str:
    """One measured value as the evidence prints it: three significant figures, thousands grouped (not
    inside a list or dict, whose items a comma separates), yes/no for a bool, a list or dict item by item;
    a string as the notebook formatted it."""
    group = "," if grouped else ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:{group}}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:{group}.0f}"
        return f"{value:.3g}" if value == 0 or abs(value) >= 1e-3 else f"{value:.2g}"
    if isinstance(value, dict):
        return ", ".join(f"{key} {formatted(item, grouped=False)}" for key, item in value.items())
    if isinstance(value, list):
        return ", ".join(formatted(item, grouped=False) for item in value)
    return str(value)


def items(measured: dict) -> list[str]:
    """Each measured value as "label: value"."""
    return [f"{label}: {formatted(value)}" for label, value in measured.items()]


def sentence(measured: dict, note: str, rule: str) -> str:
    """The evidence as one text: the measured values, then the note, then the rule that decides."""
    parts = ["; ".join(items(measured))] if measured else []
    parts += [_capitalised(note.strip().rstrip("."))] if note.strip() else []
    parts += [f"Verdict rule: {rule.strip().rstrip('.')}"] if rule.strip() else []
    return ". ".join(parts)


def _capitalised(text: str) -> str:
    return text[:1].upper() + text[1:]


def html_table(measured: dict) -> str:
    """The measured values as a two-column HTML table."""
    rows = "".join(f"<tr><td>{html.escape(label)}</td><td>{html.escape(formatted(value))}</td></tr>"
                   for label, value in measured.items())
    return f'<table class="labkit-evidence"><tbody>{rows}</tbody></table>'
