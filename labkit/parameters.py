"""A notebook's parameters: their declared types, help and bounds, and given values checked against them.

A parameters cell declares one parameter a line, in the typed form papermill's Python translator
reads, so `papermill --help-notebook` and `papermill.inspect_notebook` show each type and help:

    steps: int = 30  # training steps, at least 1

The help's last comma-separated clauses may state bounds: `at least N`, `at most N`, `above N`,
`below N` or `from N to M` (prefixed with `each` for a list, which also states its length:
`at most N values`). A bound may name other parameters instead of a number, multiplied and divided
left to right (`micro_batches: int = 4  # ..., from 1 to batch`, `steps: int = 8  # ..., from 1 to
1348 / world_size / per_rank_batch`): values valid alone but not together are then refused naming them. A number without a declared upper bound may be at most `UNDECLARED_CEILING`,
and a list may not be empty. They are written once, there, and read by
`declared_parameters` both for `python -m labkit repro` and for `check_parameters`, the call in the
cell right after the parameters cell, which guards plain papermill too (papermill injects its values
between the two). Used in 00_start_here.
"""

from __future__ import annotations

import ast
import difflib
import io
import linecache
import math
import operator
import re
import sys
import tokenize
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from labkit.errors import LabkitError

__all__ = ["UNDECLARED_CEILING", "Parameter", "ParameterError", "check_values", "declared_parameters"]  # and repro.check_parameters

SCALAR_TYPES = {"int": int, "float": float, "bool": bool, "str": str}
"""The annotations a parameter may carry: these, or `list[...]` of one of them."""

_ANNOTATIONS = set(SCALAR_TYPES) | {f"list[{kind}]" for kind in SCALAR_TYPES}
# What `ast.literal_eval` may return for the default of an untyped `name = literal` line.
_UNTYPED_KINDS = {"list": list, "dict": dict, "tuple": tuple, "set": set, "bytes": bytes, "complex": complex}
_BOUNDS = {"at least": operator.ge, "at most": operator.le, "above": operator.gt, "below": operator.lt}
_NUMBER = r"-?\d+(?:\.\d+)?(?:e-?\d+)?"
_TERM = rf"(?:{_NUMBER}|[A-Za-z_]\w*)"  # a number, or the name of another parameter of the cell
_OPERAND = rf"{_TERM}(?: [*/] {_TERM})*"  # terms multiplied and divided left to right
_BOUND_CLAUSE = re.compile(rf"(?P<each>each )?(?:(?P<op>at least|at most|above|below) (?P<n>{_OPERAND})"
                           rf"|from (?P<low>{_OPERAND}) to (?P<high>{_OPERAND}))")
_LENGTH_CLAUSE = re.compile(r"at most (?P<n>\d+) values")
UNDECLARED_CEILING = 2**32 - 1
"""The most a number parameter may be when its help declares no upper bound: the largest seed NumPy takes,
far above any count a run finishes with. A parameters cell declares its own, lower ceiling with `at most N`."""
# papermill's own Python translator adds this comment on top of the cell it injects, and its
# `--inject-paths` options add these names, which no parameters cell declares.
_INJECTED_HEADER = "# Parameters"
# The line that opens a cell in a jupytext percent script (a py twin).
_PERCENT_CELL = re.compile(r"^# %%.*$", flags=re.M)
_PAPERMILL_NAMES = frozenset({"PAPERMILL_INPUT_PATH", "PAPERMILL_OUTPUT_PATH"})


class ParameterError(LabkitError):
    """A parameter a run was given that its notebook does not accept: one line naming it and the fix."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a traceback: the one line is the whole story.
        return [f"{type(self).__name__}: {self}"]


@dataclass(frozen=True)
class Parameter:
    """One declared parameter: its type (an annotation such as "int" or "list[float]"), default, help, bounds."""

    name: str
    type: str
    default: object
    help: str = ""
    bounds: tuple[tuple[str, float | str], ...] = ()  # (phrase, a number or an expression naming parameters)
    max_length: int | None = None  # the most values a list parameter takes

    def check(self, value: object) -> object:
        """`value` as this parameter takes it (an int for a float becomes a float), or a `ParameterError`."""
        element = self.type[5:-1] if self.type.startswith("list[") else None
        items = value if element and isinstance(value, list) else [value]
        if not (_fits(self.type, value) and all(_fits(element or self.type, item) for item in items)):
            raise ParameterError(f"parameter {self.name} expects {self._described()}, got "
                                 f"{_given(value)}{_hint(self, value)}")
        if element and not items:
            raise ParameterError(f"parameter {self.name} needs at least one value, got []: e.g. "
                                 f"-y \"{self.name}: {self.default!r}\"")
        if element and self.max_length is not None and len(items) > self.max_length:
            raise ParameterError(f"parameter {self.name} takes at most {self.max_length} values, got {len(items)}: "
                                 f"give at most {self.max_length} (default {self.default!r})")
        for item in items:
            if isinstance(item, float) and not math.isfinite(item):
                raise ParameterError(f"parameter {self.name} must be a finite number, got {item!r}: a run records "
                                     "its parameters as JSON, which has no inf or nan; pass a large finite value instead")
            for phrase, bound in self._number_bounds():
                if not _BOUNDS[phrase](item, bound):
                    must = "must have each element" if element else "must be"
                    raise ParameterError(f"parameter {self.name} {must} {phrase} {_number(bound)}, got {value!r} "
                                         f"(default {self.default!r})")
        if element == "float":
            return [float(item) for item in value]
        return float(value) if self.type == "float" else value

    def _number_bounds(self) -> list[tuple[str, float]]:
        numbers = [(phrase, bound) for phrase, bound in self.bounds if not isinstance(bound, str)]
        numeric = self.type.removeprefix("list[").removesuffix("]") in ("int", "float")
        has_ceiling = any(phrase in ("at most", "below") for phrase, _ in self.bounds)
        return numbers if has_ceiling or not numeric else [*numbers, ("at most", UNDECLARED_CEILING)]

    def _described(self) -> str:
        kind = f"a list of {self.type[5:-1]}" if self.type.startswith("list[") else _with_article(self.type)
        return f"{kind} ({self.help}; default {self.default!r})" if self.help else f"{kind} (default {self.default!r})"


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


def _with_article(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _fits(kind: str, value: object) -> bool:
    if kind == "any":
        return True
    if kind in ("int", "float") and isinstance(value, bool):
        return False
    if kind == "float":
        return isinstance(value, (int, float))
    return isinstance(value, SCALAR_TYPES.get(kind) or _UNTYPED_KINDS[kind.split("[")[0]])


def _given(value: object) -> str:
    return f"the string {value!r}" if isinstance(value, str) else f"{type(value).__name__} {value!r}"


def _hint(parameter: Parameter, value: object) -> str:
    """How to pass the value from a command line, where a string is what a careless `-p` gives."""
    if not isinstance(value, str):
        return ""
    name = parameter.name
    if parameter.type == "bool":
        return f": pass -p {name} False (capitalised) or -y \"{name}: false\""
    if parameter.type in ("int", "float"):
        return f": pass a number, e.g. -p {name} {parameter.default!r}"
    if parameter.type.startswith("list"):
        return f": pass a list, e.g. -y \"{name}: {parameter.default!r}\""
    return ""


def declared_parameters(source: str, where: str = "the parameters cell") -> dict[str, Parameter]:
    """Name -> `Parameter` for a parameters cell's source: one `name: type = literal  # help` a line
    (the untyped `name = literal` is accepted too, typed by its default). Anything else, a type
    papermill cannot show or a bound that does not parse is a `LabkitError` naming the line. Defaults are
    not checked here: `check_values` does that with the values a run is given."""
    comments = _comments(source, where)
    lines = source.splitlines()
    parameters = {}
    for node in ast.parse(source).body:
        parameter = _declaration(node, lines, comments, where)
        parameters[parameter.name] = parameter
    for parameter in parameters.values():
        for _, bound in parameter.bounds:
            for other in _names(bound):
                if getattr(parameters.get(other), "type", None) not in ("int", "float"):
                    raise LabkitError(f"{where}: parameter {parameter.name} is bounded by {other!r}, which is not an "
                                      "int or float parameter of this cell")
    return parameters


def _comments(source: str, where: str) -> dict[int, str]:
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError) as error:
        raise LabkitError(f"{where} is not valid Python: {error}") from None
    return {token.start[0]: token.string.lstrip("#").strip() for token in tokens if token.type == tokenize.COMMENT}


def _declaration(node: ast.stmt, lines: list[str], comments: dict[int, str], where: str) -> Parameter:
    line = ast.unparse(node)
    annotated = isinstance(node, ast.AnnAssign) and node.value is not None and node.simple
    plain = isinstance(node, ast.Assign) and len(node.targets) == 1
    target = node.target if annotated else node.targets[0] if plain else None
    if not isinstance(target, ast.Name):
        raise LabkitError(f"{where} may hold only `name: type = literal  # help` lines, found {line!r}")
    if node.lineno != node.end_lineno or lines[node.lineno - 1].count("=") != 1:
        # papermill reads a parameter from one line and skips a line with a second '='
        raise LabkitError(f"{where}: write {target.id} on one line with a single '=' (papermill skips others), "
                          f"found {line!r}")
    try:
        default = ast.literal_eval(node.value)
    except ValueError as error:
        raise LabkitError(f"{where}: parameter {target.id} is not a literal: {error}") from None
    kind = ast.unparse(node.annotation) if annotated else _kind_of(default)
    if annotated and kind not in _ANNOTATIONS:
        raise LabkitError(f"{where}: parameter {target.id} has type {kind!r}; use one of "
                          f"{', '.join(SCALAR_TYPES)} or list[...] of one (types papermill can show)")
    help_text = comments.get(node.lineno, "")
    clauses = help_text.split(", ")[1:]
    max_length = _max_length(target.id, kind, clauses[-1] if clauses else "", where)
    if max_length is not None:
        clauses.pop()
    return Parameter(target.id, kind, default, help_text, _bounds(target.id, kind, clauses, where), max_length)


def _kind_of(default: object) -> str:
    return "any" if default is None else type(default).__name__


def _max_length(name: str, kind: str, clause: str, where: str) -> int | None:
    """The N of a list's last help clause `at most N values`, else None."""
    match = _LENGTH_CLAUSE.fullmatch(clause.strip())
    if match and not kind.startswith("list"):
        raise LabkitError(f"{where}: parameter {name} ({kind}) cannot be {clause.strip()!r}: only a list has values")
    return int(match["n"]) if match else None


def _bounds(name: str, kind: str, clauses: list[str], where: str) -> tuple[tuple[str, float], ...]:
    bounds = []
    for clause in reversed(clauses):
        match = _BOUND_CLAUSE.fullmatch(clause.strip())
        if not match:
            break
        numeric = kind.removeprefix("list[").removesuffix("]") in ("int", "float")
        if not numeric or bool(match["each"]) != kind.startswith("list"):
            raise LabkitError(f"{where}: parameter {name} ({kind}) cannot be {clause.strip()!r}: bounds are for "
                              "numbers, and for a list of numbers they start with 'each'")
        if match["op"]:
            bounds.append((match["op"], _operand(match["n"])))
        else:
            bounds += [("at least", _operand(match["low"])), ("at most", _operand(match["high"]))]
    return tuple(reversed(bounds))


def _operand(text: str) -> float | str:
    """A bound as a number, or as its text where it names parameters (evaluated with a run's values)."""
    return text if _names(text) else _evaluate(text, {})


def _names(bound: float | str) -> list[str]:
    terms = re.split(r" [*/] ", bound) if isinstance(bound, str) else []
    return [term for term in terms if term[0].isalpha() or term[0] == "_"]


def _evaluate(expression: str, values: Mapping[str, object]) -> float:
    """A bound's value: its terms (numbers, or parameters' values) multiplied and divided left to right."""
    terms = re.split(r" ([*/]) ", expression)
    total = _term(terms[0], values)
    for op, term in zip(terms[1::2], terms[2::2]):
        total = total * _term(term, values) if op == "*" else total / _term(term, values)
    return total


def _term(term: str, values: Mapping[str, object]) -> float:
    return values[term] if term in values else float(term)


def check_values(declared: Mapping[str, Parameter], given: Mapping[str, object],
                 where: str = "this notebook") -> dict[str, object]:
    """`given` checked against `declared`: known names, declared types (an int passes for a float), bounds.
    Returns the values as the notebook takes them; a `ParameterError` names the first one that is wrong."""
    unknown = [name for name in given if name not in declared]
    if unknown:
        allowed = ", ".join(f"{p.name} (default {p.default!r})" for p in declared.values())
        close = difflib.get_close_matches(unknown[0], list(declared), n=1)
        suggestion = f". Did you mean {close[0]}?" if close else ""
        raise ParameterError(f"{where} has no parameter {', '.join(unknown)}; allowed: {allowed}{suggestion}")
    checked = {name: declared[name].check(value) for name, value in given.items()}
    _check_together(declared, {**{name: p.default for name, p in declared.items()}, **checked})
    return checked


def _check_together(declared: Mapping[str, Parameter], values: Mapping[str, object]) -> None:
    """A `ParameterError` naming the parameters where a bound naming other parameters fails."""
    for parameter in declared.values():
        value = values[parameter.name]
        for phrase, bound in parameter.bounds:
            others = _names(bound)
            if others and not all(_BOUNDS[phrase](item, _evaluate(bound, values))
                                  for item in (value if isinstance(value, list) else [value])):
                name = parameter.name
                given = ", ".join(f"{other}={values[other]!r}" for other in others)
                defaults = ", ".join(f"{other}={declared[other].default!r}" for other in others)
                raise ParameterError(
                    f"parameters {', '.join([name, *others[:-1]])} and {others[-1]} do not fit together: {name} must be {phrase} "
                    f"{bound}, got {name}={value!r} with {given} (defaults {name}={parameter.default!r}, {defaults}); "
                    "change one of them")


def check_parameters(namespace: Mapping[str, object]) -> None:
    """Check the notebook's parameters as its kernel holds them: call it as
    `repro.check_parameters(globals())` in the cell right after the parameters cell.

    It finds the parameters cell and any cell papermill injected after it among the cells the
    kernel ran, so plain papermill is checked as `python -m labkit repro` is: an injected name the
    cell does not declare, a value of the wrong type or out of bounds raises a one-line
    `ParameterError` naming the parameter. Used in 00_start_here.
    """
    cells = _cells_run(namespace)
    found = next(((i, declared) for i, declared in reversed(list(enumerate(map(_typed_cell, cells)))) if declared),
                 None)
    if found is None:
        raise ParameterError("check_parameters found no typed parameters cell among the cells run so far: "
                             "run the cell tagged 'parameters' first, then this one")
    index, declared = found
    missing = [name for name in declared if name not in namespace]
    if missing:
        raise ParameterError(f"parameter {missing[0]} is not defined: run the cell tagged 'parameters' again")
    injected = {name for source in cells[index + 1:] if source.startswith(_INJECTED_HEADER)
                for name in _assigned_names(source)}
    names = list(declared) + sorted(injected - set(declared) - _PAPERMILL_NAMES)
    check_values(declared, {name: namespace[name] for name in names if name in namespace})


def _cells_run(namespace: Mapping[str, object]) -> list[str]:
    """The sources of the cells this kernel ran, oldest first: IPython's input history (`_ih`), or, for
    a client that runs cells without history (nbval does), the cell sources IPython keeps in
    `linecache` for its tracebacks (entries without a file time, in the order they were first run),
    or, for a py twin run as a plain script, its `# %%` cells."""
    history = [str(source) for source in namespace.get("_ih") or []]
    if any(map(_typed_cell, history)):
        return history
    cached = ["".join(entry[2]) for entry in list(linecache.cache.values()) if len(entry) == 4 and entry[1] is None]
    cached = [source for source in cached if _parses(source)]
    if any(map(_typed_cell, cached)) or not str(namespace.get("__file__", "")).endswith(".py"):
        return cached
    script = Path(str(namespace["__file__"])).read_text(encoding="utf-8")
    return [source for source in _PERCENT_CELL.split(script) if _parses(source)]


def _parses(source: str) -> bool:
    """Whether cached code can be read as a cell: code other libraries generate may look typed, not parse."""
    try:
        _typed_cell(source)
    except LabkitError:
        return False
    return True


def _typed_cell(source: str) -> dict[str, Parameter] | None:
    """The declarations of a cell made only of typed parameters, else None."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return None
    if not body or not all(isinstance(node, ast.AnnAssign) for node in body):
        return None
    return declared_parameters(source, "the parameters cell")


def _assigned_names(source: str) -> list[str]:
    return [target.id for node in ast.parse(source).body if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name)]


def guard_injected_cells(shell) -> None:
    """Make IPython ``shell`` refuse, before anything in it runs, a cell papermill injected (it starts with
    papermill's ``# Parameters`` comment) that does more than bind names to values: papermill writes each
    ``-p NAME VALUE`` as ``NAME = VALUE``, so a name such as ``x=1;open('f','w').write('x');y`` would run as code
    one cell before `check_parameters` sees it (PM10). Such a cell is replaced by a one-line `ParameterError`."""
    if _refuse_code_in_injected_cell not in shell.input_transformers_post:
        shell.input_transformers_post.append(_refuse_code_in_injected_cell)


def _refuse_code_in_injected_cell(lines: list[str]) -> list[str]:
    source = "".join(lines)
    if not source.startswith(_INJECTED_HEADER):
        return lines
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return lines  # IPython reports it, and nothing of it runs
    for node in body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and _is_value(node.value)):
            code = ast.get_source_segment(source, node) or ast.unparse(node)
            message = (f"papermill injected {code[:120]!r}, which is not NAME = VALUE: a parameter name is a "
                       "Python name (letters, digits and _), so nothing of that cell was run")
            return [f"raise __import__('labkit.parameters').parameters.ParameterError({message!r})\n"]
    return lines


def _is_value(node: ast.expr) -> bool:
    """Whether ``node`` is data as papermill writes it: literals, containers of them, float('nan') and the like."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        return _is_value(node.operand)
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return all(map(_is_value, node.elts))
    if isinstance(node, ast.Dict):
        return all(key is not None and _is_value(key) for key in node.keys) and all(map(_is_value, node.values))
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "float"
            and not node.keywords and len(node.args) == 1 and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str))


def _guard_this_kernel() -> None:
    """Guard the IPython kernel this module is imported in (every notebook imports it before its parameters
    cell); IPython is only looked up, never imported, so a plain Python pays nothing."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None and hasattr(shell, "input_transformers_post"):
        guard_injected_cells(shell)


_guard_this_kernel()
