"""A notebook's parameters cell read from its file, and given values checked against it.

`python -m labkit repro -p NAME VALUE` and sweeps accept only the names the cell declares, with
values of the declared type within the declared bounds, so a typo fails before a run instead of
being silently ignored. Declarations and checks are `labkit.parameters`, the same ones the
notebook's own `check_parameters` cell applies in the kernel.
"""

from __future__ import annotations

import ast
from pathlib import Path

from labkit.errors import LabkitError
from labkit.parameters import Parameter, check_values, declared_parameters
from labkit.records import read_notebook_json

__all__ = ["notebook_declarations", "notebook_parameters", "parameters_cell", "parse_value", "validate_parameters"]


def parameters_cell(nb: dict, where: str = "notebook") -> dict:
    """The cell tagged `parameters`; a clear error when there is none or more than one."""
    tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(tagged) != 1:
        raise LabkitError(f"{where} must have exactly one cell tagged 'parameters', found {len(tagged)}")
    return tagged[0]


def notebook_declarations(path: str | Path) -> dict[str, Parameter]:
    """Name -> `labkit.parameters.Parameter` (type, default, help, bounds) of a notebook's parameters cell."""
    path = Path(path)
    cell = parameters_cell(read_notebook_json(path), str(path))
    source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
    return declared_parameters(source, f"{path}: the parameters cell")


def notebook_parameters(path: str | Path) -> dict[str, object]:
    """Name -> default value of a notebook's parameters cell."""
    return {name: parameter.default for name, parameter in notebook_declarations(path).items()}


def validate_parameters(path: str | Path, given: dict[str, object]) -> dict[str, object]:
    """Check `given` against the notebook's parameters cell: known names, declared types and bounds
    (`labkit.parameters.check_values`). Returns the values as the notebook takes them."""
    return check_values(notebook_declarations(path), given, Path(path).name)


def parse_value(text: str) -> object:
    """A command-line value as a Python literal when it is one (`8`, `0.1`, `True`), else a string."""
    lowered = {"true": True, "false": False, "none": None}
    if text.lower() in lowered:
        return lowered[text.lower()]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
