"""A notebook's parameters cell: its defaults, and given values checked against them.

`python -m labkit repro -p NAME VALUE` and sweeps accept only the names the cell assigns, with
values of the default's type, so a typo fails before a run instead of being silently ignored.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

from labkit.errors import LabkitError
from labkit.notebooks import read_notebook_json

__all__ = ["notebook_parameters", "parameters_cell", "parse_value", "validate_parameters"]


def parameters_cell(nb: dict, where: str = "notebook") -> dict:
    """The cell tagged `parameters`; a clear error when there is none or more than one."""
    tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(tagged) != 1:
        raise LabkitError(f"{where} must have exactly one cell tagged 'parameters', found {len(tagged)}")
    return tagged[0]


def notebook_parameters(path: str | Path) -> dict[str, object]:
    """Name -> default value of a notebook's parameters cell (literal assignments only)."""
    path = Path(path)
    nb = read_notebook_json(path)
    source = "".join(parameters_cell(nb, str(path))["source"])
    params = {}
    for node in ast.parse(source).body:
        # `name = literal`, or `name: type = literal`
        targets = [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else getattr(node, "targets", [])
        if not (isinstance(node, (ast.Assign, ast.AnnAssign)) and len(targets) == 1 and isinstance(targets[0], ast.Name)):
            raise LabkitError(f"{path}: the parameters cell may hold only `name = literal` lines, found {ast.unparse(node)!r}")
        try:
            params[targets[0].id] = ast.literal_eval(node.value)
        except ValueError as error:
            raise LabkitError(f"{path}: parameter {targets[0].id} is not a literal: {error}") from error
    return params


def validate_parameters(path: str | Path, given: dict[str, object]) -> dict[str, object]:
    """Check `given` against the notebook's parameters cell: known names, matching types."""
    defaults = notebook_parameters(path)
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        allowed = ", ".join(f"{k} (default {v!r})" for k, v in defaults.items())
        raise LabkitError(f"{Path(path).name} has no parameter {', '.join(unknown)}; allowed: {allowed}")
    return {name: _coerce(name, value, defaults[name]) for name, value in given.items()}


def _coerce(name: str, value: object, default: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        raise LabkitError(f"parameter {name} must be a finite number, got {value!r}: a run records its "
                          "parameters as JSON, which has no inf or nan; pass a large finite value instead")
    expected = type(default)
    if default is None or isinstance(value, expected) and not (isinstance(value, bool) and expected is int):
        return value
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    raise LabkitError(
        f"parameter {name} expects {expected.__name__} (default {default!r}), got {type(value).__name__} {value!r}"
    )


def parse_value(text: str) -> object:
    """A command-line value as a Python literal when it is one (`8`, `0.1`, `True`), else a string."""
    lowered = {"true": True, "false": False, "none": None}
    if text.lower() in lowered:
        return lowered[text.lower()]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
