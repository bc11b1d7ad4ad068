"""labkit's import layers: what a notebook's kernel imports never imports the tooling, and the command
line imports no torch.

Runtime is every labkit module a notebook imports (read from notebooks/py by AST) and what
`from labkit import NAME` reaches, with everything those import in turn. Tooling is the notebook-file
and course code (`labkit.notebooks`, `labkit.claims_report`, `labkit.runner`, `labkit.course`,
`labkit.student`, the command line) and the packages only it needs (nbformat, jupytext, papermill,
nbclient, nbgrader). The static check reads every import statement, lazy ones inside functions
included, so a tooling import that runs only on some call is caught too.
"""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import labkit

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "labkit"
TOOLING_MODULES = ("labkit.notebooks", "labkit.claims_report", "labkit.runner", "labkit.course", "labkit.student",
                   "labkit.__main__")
TOOLING_PACKAGES = ("nbformat", "jupytext", "papermill", "nbclient", "nbgrader")


def module_sources() -> dict[str, str]:
    """Every labkit module's source, by dotted name (a package by its own name, from its __init__.py)."""
    sources = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        sources[name] = path.read_text(encoding="utf-8")
    return sources


def imports_of(name: str, source: str, modules: set[str]) -> set[str]:
    """The modules `source` imports, anywhere in it: labkit modules by full name (with the packages whose
    __init__ each one runs), other packages by their top-level name."""
    found: set[str] = set()
    is_package = any(module.startswith(f"{name}.") for module in modules)
    package = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                else node.module
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    resolved = set()
    for imported in found:
        if imported.split(".")[0] != "labkit":
            resolved.add(imported.split(".")[0])
            continue
        parts = imported.split(".")
        resolved |= {".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules}
    return resolved - {name}


def runtime_roots() -> set[str]:
    """The labkit modules a notebook imports, and the homes of the names `from labkit import ...` gives."""
    roots = {"labkit"} | set(labkit._HOMES.values())
    for script in (ROOT / "notebooks" / "py").glob("[0-9][0-9]_*.py"):
        for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("labkit"):
                roots.add(node.module)
                roots |= {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                roots |= {alias.name for alias in node.names if alias.name.startswith("labkit")}
    return roots & set(module_sources())


def is_tooling(module: str) -> bool:
    return any(module == t or module.startswith(f"{t}.") for t in TOOLING_MODULES) or module in TOOLING_PACKAGES


def tooling_reached(sources: dict[str, str], roots: set[str]) -> list[str]:
    """Each import chain from a runtime root to a tooling module, as 'a -> b -> tooling'."""
    modules = set(sources)
    graph = {name: imports_of(name, source, modules) for name, source in sources.items()}
    chains, seen, frontier = [], set(roots), [[root] for root in sorted(roots)]
    while frontier:
        chain = frontier.pop()
        for imported in sorted(graph.get(chain[-1], ())):
            if is_tooling(imported):
                chains.append(" -> ".join([*chain, imported]))
            elif imported not in seen and imported in graph:
                seen.add(imported)
                frontier.append([*chain, imported])
    return sorted(chains)


def test_the_runtime_roots_are_what_the_notebooks_import():
    # Guards the check below: an empty or tiny set of roots would make it pass vacuously.
    assert {"labkit.claims", "labkit.grading", "labkit.repro", "labkit.probes", "labkit.progress",
            "labkit.tracers", "labkit.memory", "labkit.predict", "labkit.parameters"} <= runtime_roots()


def test_runtime_modules_never_import_tooling():
    chains = tooling_reached(module_sources(), runtime_roots())
    assert not chains, ("a module a notebook's kernel imports reaches the tooling; move what it needs into a "
                        "runtime module (e.g. labkit/records.py):\n" + "\n".join(chains))


@pytest.mark.parametrize(("module", "line", "reached"), [
    ("labkit.claims", "from labkit import notebooks", "labkit.claims -> labkit.notebooks"),
    ("labkit.claims", "from labkit.runner.run import run_notebook", "labkit.claims -> labkit.runner"),
    ("labkit.progress", "import nbformat", "labkit.progress -> nbformat"),
    ("labkit.readings", "from . import notebooks", "labkit.readings -> labkit.notebooks"),
])
def test_the_layer_check_fails_when_a_runtime_module_imports_tooling(module, line, reached):
    sources = module_sources()
    sources[module] += f"\n\ndef later():\n    {line}\n"  # a lazy import counts: it runs when called
    assert any(chain.endswith(reached) for chain in tooling_reached(sources, runtime_roots())), reached


def test_a_kernel_importing_labkit_loads_no_tooling():
    """The same rule at run time: import every runtime root, then look at sys.modules."""
    code = ("import importlib, sys\n"
            f"for name in {sorted(runtime_roots())!r}: importlib.import_module(name)\n"
            f"print(sorted(m for m in sys.modules if any(m == t or m.startswith(t + '.') "
            f"for t in {TOOLING_MODULES + TOOLING_PACKAGES!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def imported_by_command(*args: str, cwd: Path = ROOT) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `python -X importtime -m labkit ARGS` and return it with the names of the modules it imported."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "labkit", *args], capture_output=True,
                            text=True, timeout=300, cwd=cwd)
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:") and line.count("|") == 2}
    return result, imported


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["claims", "--json"], ["claims", "--catalogue"]],
                         ids=lambda args: " ".join(args))
def test_commands_that_read_files_import_no_torch(args):
    result, imported = imported_by_command(*args)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "labkit.__main__" in imported or "labkit" in imported, "importtime saw no labkit: the check is vacuous"
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}, f"python -m labkit {' '.join(args)}"


def test_the_pre_commit_normaliser_imports_no_torch(tmp_path):
    notebook = tmp_path / "00_start_here.ipynb"
    shutil.copy(ROOT / "notebooks" / "00_start_here.ipynb", notebook)
    result, imported = imported_by_command("normalise", str(notebook))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "nbformat" in imported, "the normaliser imported no nbformat: the check is vacuous"
    assert "torch" not in imported


def test_names_read_from_labkit_are_imported_on_first_use():
    code = ("import sys, labkit\nbefore = 'torch' in sys.modules\nfrom labkit import GradTracer, claims\n"
            "print(before, 'torch' in sys.modules, GradTracer.__name__, labkit.GradTracer is GradTracer, "
            "claims.__name__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True", "GradTracer", "True", "labkit.claims"]


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'labkit' has no attribute 'GradTrace'"):
        labkit.GradTrace  # noqa: B018


@pytest.mark.parametrize("package", ["labkit", "labkit.runner"])
def test_no_lazy_name_is_shadowed_by_a_submodule_of_that_name(package):
    """Importing `package.NAME` sets the attribute NAME to the submodule, hiding a function of that name
    (as labkit/runner/sweep.py hid `runner.sweep`): a lazy name may share its name only with its home."""
    homes = importlib.import_module(package)._HOMES
    clashes = [name for name, home in homes.items()
               if f"{package}.{name}" in module_sources() and home != f"{package}.{name}"]
    assert not clashes, f"rename the submodule(s) of {package} named like a name they do not define: {clashes}"
