"""Static checks of code CPU CI never executes (GPU-only notebook cells, GPU branches of labkit):
the torch attributes it names, and the Python scripts notebooks hold as strings to run in a fresh
process. A CPU build of torch defines the CUDA API too (its functions raise when called), so every
name a GPU path uses can be looked up here."""

from __future__ import annotations

import ast
import importlib
import re

SCRIPT = re.compile(r"^import torch\b", re.MULTILINE)


def held_scripts(tree: ast.Module) -> list[str]:
    """The Python scripts a notebook holds as strings, to run in a process of their own: strings with
    a line that starts ``import torch`` (a sentence that mentions it is no script)."""
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and SCRIPT.search(node.value)]  # fmt: skip


def torch_aliases(tree: ast.Module) -> dict[str, str]:
    """The names a script's imports bind to torch modules and objects: ``F`` -> torch.nn.functional."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or "torch": a.name if a.asname else "torch"
                        for a in node.names if a.name.split(".")[0] == "torch"}  # fmt: skip
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            aliases |= {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names}
    return aliases


def torch_attribute_paths(tree: ast.Module) -> list[tuple[int, str]]:
    """Every dotted attribute chain rooted at a torch import, as (line, full dotted path)."""
    aliases, inner, found = torch_aliases(tree), set(), []
    for node in ast.walk(tree):  # breadth first: a chain's outermost attribute comes before its inner ones
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            parts, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                inner.add(id(value))
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:
                found.append((node.lineno, ".".join([aliases[value.id], *reversed(parts)])))
    return found


def resolve(dotted: str) -> object:
    """The object a dotted path names, importing submodules on the way (torch.distributed.nn is one)."""
    parts = dotted.split(".")
    found = importlib.import_module(parts[0])
    for depth, part in enumerate(parts[1:], start=2):
        try:
            found = getattr(found, part)
        except AttributeError:
            found = importlib.import_module(".".join(parts[:depth]))
    return found


def missing_torch_attributes(name: str, scripts: list[ast.Module]) -> list[str]:
    """``name:line: dotted.path (why)`` for each torch attribute the scripts name that this torch lacks."""
    missing = []
    for script in scripts:
        for line, dotted in torch_attribute_paths(script):
            try:
                resolve(dotted)
            except (AttributeError, ImportError) as error:
                missing.append(f"{name}:{line}: {dotted} ({error})")
    return missing
