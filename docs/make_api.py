"""Generate docs/API.md, the page listing labkit's public API, and read which notebooks use it.

    python docs/make_api.py           # print the page
    python docs/make_api.py --write   # rewrite docs/API.md
    python docs/make_api.py --check   # exit 1 when docs/API.md is stale

The public API is what labkit/__init__.py's docstring says: the names in `labkit.__all__`, and
`labkit.<module>.<name>` for each name in a public module's `__all__`, where a public module is one
level below the package (`labkit.memory`, not `labkit.memory.measure`) and does not start with `_`;
each object is declared in one `__all__` only. For each public module the page gives its one-line job,
and for each name its docstring's first line and the notebooks whose py twins
(notebooks/py/NN_name.py, read by AST, never run) use it. The pointers from a name to the lessons
that use it are generated, as d2l generates its "Defined in" lines, so they cannot drift.

tests/test_public_api.py fails when the page is stale, and uses `api_violations` and
`pointer_problems` here to hold notebooks, benchmarks and docstrings to the same API.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import pkgutil
import re
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "API.md"
NOTEBOOK_SCRIPTS = ROOT / "notebooks" / "py"
# A notebook named in prose: two digits, an underscore, a lower-case name ("13_memory").
NOTEBOOK_POINTER = re.compile(r"\b(\d{2}_[a-z][a-z0-9_]*[a-z0-9])\b")
REGENERATE = "python docs/make_api.py --write"


@dataclass(frozen=True)
class Use:
    """One name read from a labkit module in a script: `from labkit.M import name`, or `m.name`
    where `m` is bound to labkit.M."""

    module: str
    name: str
    line: int


# ------------------------------------------------------------------ which modules are public


@cache
def all_modules() -> tuple[str, ...]:
    """Every module and package of labkit, private ones included, found by walking the package."""
    import labkit

    walked = [info.name for info in pkgutil.walk_packages(labkit.__path__, "labkit.", onerror=_unimportable)]
    return ("labkit", *sorted(walked))


def _unimportable(package_name: str) -> None:
    # walk_packages would skip the package silently, and every check here would miss its modules
    raise ImportError(f"{package_name} cannot be imported, so its modules cannot be checked: fix the import first")


def is_public(module_name: str) -> bool:
    """The API is the package level: `labkit` and each `labkit.NAME` not starting with `_`. A module inside a
    subpackage (`labkit.memory.measure`, `labkit.runner.paths`) is its package's implementation: the
    package's `__all__` is its API."""
    parts = module_name.split(".")
    return len(parts) <= 2 and not any(part.startswith("_") for part in parts)


def public_modules() -> list[str]:
    return [name for name in all_modules() if is_public(name)]


def declared_names(module_name: str) -> list[str] | None:
    """The module's `__all__`, or None when it declares none."""
    names = getattr(importlib.import_module(module_name), "__all__", None)
    return None if names is None else list(names)


def source_path(module_name: str) -> str:
    module = importlib.import_module(module_name)
    return Path(module.__file__).resolve().relative_to(ROOT).as_posix()


def _is_submodule(module_name: str, name: str) -> bool:
    return f"{module_name}.{name}" in all_modules()


# ------------------------------------------------------------------ reading scripts by AST


def labkit_uses(source: str) -> list[Use]:
    """Every name the script reads from a labkit module, by AST (the script is not run).

    Follows the names bound to labkit modules by `import labkit[.M] [as m]` and
    `from labkit[.M] import N [as n]` (when N is a submodule), so `memory._human()` after
    `from labkit import memory` is seen as reading `_human` from labkit.memory.
    """
    tree = ast.parse(source)
    bound: dict[str, str] = {}
    uses: list[Use] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _in_labkit(alias.name):
                    bound[alias.asname or "labkit"] = alias.name if alias.asname else "labkit"
                    uses += _chain(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _in_labkit(node.module):
            uses += _chain(node.module, node.lineno)
            for alias in node.names:
                uses.append(Use(node.module, alias.name, node.lineno))
                if _is_submodule(node.module, alias.name):
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def module_of(expression: ast.expr) -> str | None:
        if isinstance(expression, ast.Name):
            return bound.get(expression.id)
        if isinstance(expression, ast.Attribute):
            parent = module_of(expression.value)
            if parent is not None and _is_submodule(parent, expression.attr):
                return f"{parent}.{expression.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (module := module_of(node.value)) is not None:
            uses.append(Use(module, node.attr, node.lineno))
    return sorted(uses, key=lambda use: (use.line, use.module, use.name))


def _in_labkit(module_name: str | None) -> bool:
    return module_name is not None and (module_name == "labkit" or module_name.startswith("labkit."))


def _chain(dotted: str, line: int) -> list[Use]:
    """`labkit.a.b` reads `a` from labkit and `b` from labkit.a."""
    parts = dotted.split(".")
    return [Use(".".join(parts[:i]), parts[i], line) for i in range(1, len(parts))]


def api_violations(source: str, where: str) -> list[str]:
    """One line per name the script reads from labkit outside the public API, with the fix."""
    return [f"{where}:{use.line}: {problem}" for use in labkit_uses(source) if (problem := _use_problem(use))]


def _use_problem(use: Use) -> str | None:
    qualified = f"{use.module}.{use.name}"
    if use.name == "*":
        return f"`from {use.module} import *`: import the public names the script uses by name"
    if use.name.startswith("_"):
        return f"{qualified} is private to labkit: use a public name (see docs/API.md)"
    if not is_public(use.module):
        return f"{use.module} is a private module: {_public_instead(use.module)}"
    if _is_submodule(use.module, use.name):
        return None if is_public(qualified) else f"{qualified} is a private module: {_public_instead(qualified)}"
    names = declared_names(use.module)
    if names is None:
        return (f"{use.module} declares no __all__, so none of its names is public yet: add `__all__` to "
                f"{source_path(use.module)} and run `{REGENERATE}`")
    if use.name not in names:
        return (f"{qualified} is not in {use.module}.__all__: use a public name, or add it to __all__ "
                f"(then `{REGENERATE}`) if users are meant to have it")
    return None


def _public_instead(module_name: str) -> str:
    parts = module_name.split(".")
    package = ".".join(parts[:2])
    if len(parts) > 2 and is_public(package):
        return f"it is {package}'s implementation; use the names in {package}.__all__ (see docs/API.md)"
    return "use a public name (see docs/API.md)"


# ------------------------------------------------------------------ one spelling per object


def spellings() -> dict[int, list[str]]:
    """Each public object (by identity) with every public spelling of it: `MODULE.NAME` for each public
    module whose `__all__` lists it. Plain values (str, numbers, None) are left out: equal ones may be
    one object by interning, not by re-export."""
    found: dict[int, list[str]] = {}
    for module_name in public_modules():
        module = importlib.import_module(module_name)
        for name in declared_names(module_name) or []:
            value = getattr(module, name, None)
            if not isinstance(value, (str, bytes, int, float, complex, type(None))):
                found.setdefault(id(value), []).append(f"{module_name}.{name}")
    return found


def duplicate_spellings() -> list[str]:
    """One line per public object declared under more than one spelling, with the fix."""
    return [f"{' and '.join(names)} are one object: keep it in one `__all__` (the spelling the notebooks use), "
            f"drop it from the others, and run `{REGENERATE}`"
            for names in spellings().values() if len(names) > 1]


@cache
def notebook_uses() -> dict[str, tuple[tuple[str, object], ...]]:
    """For each notebook's py twin: the (name, object) pairs it reads from labkit."""
    return {path.stem: tuple(_resolved(use) for use in labkit_uses(path.read_text(encoding="utf-8")))
            for path in sorted(NOTEBOOK_SCRIPTS.glob("[0-9][0-9]_*.py"))}


def _resolved(use: Use) -> tuple[str, object]:
    if _is_submodule(use.module, use.name):
        return use.name, importlib.import_module(f"{use.module}.{use.name}")
    return use.name, getattr(importlib.import_module(use.module), use.name, None)


def notebooks_using(name: str, value: object) -> list[str]:
    """The notebooks that read this object under this name (from any module that exports it)."""
    return [notebook for notebook, uses in notebook_uses().items() if _exports(list(uses), name, value)]


def notebooks_using_module(module_name: str) -> list[str]:
    """The notebooks that read the module itself, any name in its `__all__`, or an object it defines
    (`labkit.GradTracer` uses labkit.tracers: each object has one spelling, not always its module's)."""
    module = importlib.import_module(module_name)
    exported = [(name, getattr(module, name, None)) for name in declared_names(module_name) or []]
    return [notebook for notebook, uses in notebook_uses().items()
            if any(used is module or _exports(exported, name, used) or _defined_in(used, module_name)
                   for name, used in uses)]


def _defined_in(value: object, module_name: str) -> bool:
    home = getattr(value, "__module__", None) if inspect.isroutine(value) or inspect.isclass(value) else None
    return isinstance(home, str) and (home == module_name or home.startswith(f"{module_name}."))


def _exports(exported: list[tuple[str, object]], name: str, value: object) -> bool:
    # by identity: the same object under the same name, wherever the notebook imported it from
    return any(name == exported_name and value is exported_value for exported_name, exported_value in exported)


# ------------------------------------------------------------------ docstrings


def own_docstring(value: object) -> str:
    """The object's own docstring: none for plain values, none inherited, none auto-generated."""
    if not (inspect.isroutine(value) or inspect.isclass(value) or inspect.ismodule(value)):
        return ""
    doc = vars(value).get("__doc__") if inspect.isclass(value) else value.__doc__
    if not doc or (inspect.isclass(value) and doc.startswith(f"{value.__name__}(")):
        return ""  # a dataclass without a docstring gets its signature as one
    return inspect.cleandoc(doc)


def summary(doc: str) -> str:
    """The docstring's first line, continued to the end of its sentence when it wraps."""
    lines: list[str] = []
    for line in doc.splitlines():
        if not line.strip():
            break
        lines.append(line.strip())
        if line.rstrip().endswith((".", ":")):
            break
    return " ".join(lines)


def pointer_problems(module_name: str) -> list[str]:
    """Each `NN_name` in the module's docstrings that names no notebook, or one that does not use it.

    A docstring points at notebooks as "Used in NN_name": what this checks is use (the notebook's
    code reads the name), not that the notebook's prose teaches it, so the phrase says use too.

    A name's docstring may point only to notebooks that use that name; the module's docstring only
    to notebooks that use the module. A module with nothing to import (empty `__all__`, such as an
    exercise-check module) can be used by no notebook, so its pointers need only name a notebook.
    """
    module = importlib.import_module(module_name)
    names = declared_names(module_name)
    problems = [f"{module_name} (module docstring): {problem}"
                for problem in _pointer_problems(own_docstring(module),
                                                 lambda: notebooks_using_module(module_name), bool(names))]
    for name in names or []:
        value = getattr(module, name, None)
        if inspect.ismodule(value):
            continue  # its docstring is checked as that module's
        problems += [f"{module_name}.{name}: {problem}"
                     for problem in _pointer_problems(own_docstring(value),
                                                      lambda: notebooks_using(name, value), True)]
    return problems


def _pointer_problems(doc: str, users, must_use: bool) -> list[str]:
    problems = []
    for pointer in sorted(set(NOTEBOOK_POINTER.findall(doc))):
        if not (NOTEBOOK_SCRIPTS / f"{pointer}.py").exists():
            problems.append(f"names {pointer}, but there is no notebooks/py/{pointer}.py")
        elif must_use and pointer not in users():
            used_in = ", ".join(users()) or "no notebook"
            problems.append(f"names {pointer}, which does not use it (used in: {used_in}): correct or drop the pointer")
    return problems


# ------------------------------------------------------------------ the page


def render() -> str:
    modules = public_modules()
    empty = [name for name in modules if declared_names(name) == []]
    lines = [
        "# labkit's public API",
        "",
        f"Generated by `{REGENERATE}` from each public module's `__all__` and the notebooks' py twins",
        "(`notebooks/py/*.py`, read by AST); do not edit it by hand. tests/test_public_api.py fails when",
        "it is stale.",
        "",
        "The public API is the package level, every name below: `from labkit import NAME` for the names",
        "of `labkit` itself, and `labkit.MODULE.NAME` (`from labkit.MODULE import NAME`) for the others.",
        "Each object has one spelling, listed once. A module inside a subpackage (`labkit.memory.measure`)",
        "is that package's implementation, and any name not listed is internal: it may change without",
        "notice, and notebooks and benchmarks do not use it. \"Used in\" lists the notebooks whose code",
        "reads the name.",
        "",
    ]
    for name in modules:
        if name not in empty:
            lines += _module_section(name)
    lines += ["## Modules with nothing to import", "",
              "Each is used through the command line or by labkit itself; its `__all__` is empty.", "",
              "| module | its job |", "| --- | --- |"]
    lines += [f"| `{name}` | {_job(name)} |" for name in empty]
    return "\n".join(lines) + "\n"


def _job(module_name: str) -> str:
    return _cell(summary(own_docstring(importlib.import_module(module_name)))) or "(no docstring)"


def _module_section(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    lines = [f"## `{module_name}`", "", f"{_job(module_name)} (`{source_path(module_name)}`)", ""]
    names = declared_names(module_name)
    if names is None:
        return lines + [f"**Declares no `__all__` yet**, so none of its names is public: add `__all__` to "
                        f"`{source_path(module_name)}` and run `{REGENERATE}`.", ""]
    lines += ["| name | what it is | used in |", "| --- | --- | --- |"]
    for name in names:
        value = getattr(module, name, None)
        if inspect.ismodule(value):
            users, what = notebooks_using_module(value.__name__), f"module: {_job(value.__name__)}"
        else:
            users = notebooks_using(name, value)
            what = _cell(summary(own_docstring(value))) or f"a `{type(value).__name__}` value"
        lines.append(f"| `{name}` | {what} | {_links(users)} |")
    return lines + [""]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _links(notebooks: list[str]) -> str:
    if not notebooks:
        return "no notebook"
    if notebooks == list(notebook_uses()):
        return "every notebook"
    return ", ".join(f"[{name[:2]}](../notebooks/{name}.ipynb)" for name in notebooks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help=f"rewrite {PAGE.relative_to(ROOT)}")
    action.add_argument("--check", action="store_true", help="exit 1 when the page is stale")
    args = parser.parse_args(argv)
    page = render()
    if args.write:
        PAGE.write_text(page, encoding="utf-8")
    elif args.check:
        stale = not PAGE.exists() or PAGE.read_text(encoding="utf-8") != page
        if stale:
            print(f"{PAGE.relative_to(ROOT)} is stale: run `{REGENERATE}`", file=sys.stderr)
        return int(stale)
    else:
        print(page, end="")
    return 0


if __name__ == "__main__":
    # Document the labkit of this checkout, not another one installed in the environment.
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
