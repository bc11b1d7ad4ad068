"""labkit's public API is declared, documented, and the only part of labkit the notebooks use.

The API is what labkit/__init__.py's docstring says: `labkit.__all__`, and `labkit.<module>.<name>`
for each name in a public module's `__all__`. Every public module found by walking the package is
covered, so a new module is held to the rule from its first commit. docs/make_api.py reads scripts
by AST (nothing is executed) and writes docs/API.md.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_make_api():
    spec = importlib.util.spec_from_file_location("make_api", ROOT / "docs" / "make_api.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


api = load_make_api()
MODULES = api.public_modules()
# Benchmarks that replay trials against labkit's machinery itself (the grading process, the hub's helpers, the
# parameter checks), which no user calls: they are the reliability suite's harness, not an example of the API.
INTERNAL_HARNESSES = {"benchmarks/reliability_trials.py"}
SCRIPTS = sorted((ROOT / "notebooks" / "py").glob("[0-9][0-9]_*.py")) + sorted(
    path for path in (ROOT / "benchmarks").glob("*.py") if path.relative_to(ROOT).as_posix() not in INTERNAL_HARNESSES)


def test_the_walk_finds_the_instrument_modules():
    # Guards the parametrisations below: a walk that found nothing would make them vacuous.
    assert {"labkit", "labkit.claims", "labkit.grading", "labkit.exercises", "labkit.memory", "labkit.tracers"} <= set(
        MODULES)
    assert "labkit.__main__" not in MODULES and "labkit._torch_compat" not in MODULES
    # the package level only: a subpackage's modules are its implementation
    assert {"labkit.exercises.nb00", "labkit.memory.measure", "labkit.runner.paths"} <= set(api.all_modules())
    assert not [name for name in MODULES if name.count(".") > 1]


def test_each_public_object_has_one_spelling():
    duplicates = api.duplicate_spellings()
    assert not duplicates, "\n".join(duplicates)
    assert len(api.spellings()) > 100, "the check saw almost no objects: it would pass vacuously"


def test_the_spelling_check_fails_on_a_re_export(monkeypatch):
    tracers = importlib.import_module("labkit.tracers")
    monkeypatch.setattr(tracers, "__all__", [*tracers.__all__, "GradTracer"])
    assert api.duplicate_spellings() == [
        "labkit.GradTracer and labkit.tracers.GradTracer are one object: keep it in one `__all__` (the spelling "
        f"the notebooks use), drop it from the others, and run `{api.REGENERATE}`"
    ]


@pytest.mark.parametrize("module_name", MODULES)
def test_public_module_has_a_docstring_and_declares_all_of_names_it_has(module_name):
    module = importlib.import_module(module_name)
    where = api.source_path(module_name)
    assert (module.__doc__ or "").strip(), f"{module_name} has no docstring: open {where} with one saying its one job"
    names = getattr(module, "__all__", None)
    assert names is not None, (
        f"{module_name} declares no __all__: add `__all__ = [...]` to {where}, listing the names meant for users "
        f"(`__all__: list[str] = []` if none), then run `{api.REGENERATE}`"
    )
    missing = [name for name in names if not hasattr(module, name)]
    private = [name for name in names if name.startswith("_")]
    assert not missing, f"{module_name}.__all__ names what {where} does not define: {missing}"
    assert not private, f"{module_name}.__all__ lists private names: {private}"
    assert len(set(names)) == len(names), f"{module_name}.__all__ lists a name twice: {names}"


def test_the_api_page_is_up_to_date():
    page = api.PAGE.read_text(encoding="utf-8") if api.PAGE.exists() else ""
    fresh = api.render()
    diff = "".join(list(difflib.unified_diff(page.splitlines(True), fresh.splitlines(True), "docs/API.md",
                                             "generated"))[:40])
    if page != fresh:  # pytest.fail, not assert: the unified diff says more than pytest's string comparison
        pytest.fail(f"docs/API.md is stale: run `{api.REGENERATE}`\n{diff}")


@pytest.mark.parametrize("script", SCRIPTS, ids=[path.relative_to(ROOT).as_posix() for path in SCRIPTS])
def test_notebooks_and_benchmarks_use_only_the_public_api(script):
    where = script.relative_to(ROOT).as_posix()
    violations = api.api_violations(script.read_text(encoding="utf-8"), where)
    assert not violations, "use only labkit's public API (docs/API.md):\n" + "\n".join(violations)


@pytest.mark.parametrize(
    "snippet",
    [
        "from labkit import memory\nmemory._human(1)\n",
        "from labkit import claims, grading\ngrading._SESSION.clear()\n",
        "import labkit.grading as g\ng._SESSION.clear()\n",
        "import labkit\nlabkit.grading._SESSION.clear()\n",
        "from labkit.grading import _SESSION\n",
        "from labkit import _torch_compat\n",
        "from labkit.claims import catalogue\n",
        "from labkit import claims\nclaims.catalogue()\n",
        "from labkit import grading as marking\nmarking.run_check('00.1', print)\n",
        "from labkit.claims import *\n",
        "from labkit.memory.measure import peak_bytes_during\n",
        "from labkit.tracers import graph\n",
        "import labkit.runner.paths\n",
        "from labkit.tracers import GradTracer\n",
    ],
    ids=["memory._human", "grading._SESSION", "import-as", "dotted", "from-import private", "private module",
         "from-import outside __all__", "attribute outside __all__", "aliased module", "star import",
         "implementation module", "implementation module imported from its package", "dotted implementation module",
         "a second spelling"],
)
def test_the_checker_catches_a_name_outside_the_public_api(snippet):
    assert len(api.api_violations(snippet, "cell")) >= 1, snippet


def test_the_checker_flags_exactly_the_private_helper_after_from_labkit_import_memory():
    """The import style every notebook uses; the regex test this file replaced missed it."""
    assert api.api_violations("from labkit import memory\nmemory._human(1)\n", "cell") == [
        "cell:2: labkit.memory._human is private to labkit: use a public name (see docs/API.md)"
    ]


def test_the_checker_passes_public_names_however_they_are_imported():
    legal = (
        "import labkit\nimport labkit.progress as progress_lines\n"
        "from labkit import GradTracer, claims, grading\nfrom labkit.distributed import run_ranks\n"
        "claims.check('Z1', verdict='holds', measured={'x': 1})\ngrading.score()\nlabkit.claims.table()\n"
        "progress_lines.track(range(3))\nlabkit.exercises.NotYet\n"
    )
    assert api.api_violations(legal, "cell") == []


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_pointers_name_a_notebook_that_uses_the_name(module_name):
    problems = api.pointer_problems(module_name)
    assert not problems, (
        "a docstring's `NN_name` must name a notebook whose notebooks/py twin uses that name "
        "(see docs/API.md for where each is used):\n" + "\n".join(problems)
    )


def test_the_pointer_check_reads_names_from_the_notebooks():
    # Independent facts from the notebooks' imports: 15 alone runs ranks, and 00 shows a fingerprint.
    assert api.notebooks_using("run_ranks", importlib.import_module("labkit.distributed").run_ranks) == [
        "15_distributed"
    ]
    assert "00_start_here" in api.notebooks_using_module("labkit.probes")
    assert api._pointer_problems("Taught in 99_nowhere.", lambda: [], True) == [
        "names 99_nowhere, but there is no notebooks/py/99_nowhere.py"
    ]
