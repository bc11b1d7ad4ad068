"""Installing the workbook where learners are: the supported torch range, the notebooks' first cell when
labkit is missing (a clear message, or on Colab an install), and an install that keeps a supported torch."""

import ast
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import types
import zipfile
from pathlib import Path

import nbformat
import pytest
from packaging.requirements import Requirement

import labkit

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
REPOSITORY = PYPROJECT["urls"]["Repository"]
# What the first cell installs on Colab: the distribution's own name (tests/test_install_name.py), never "labkit".
COLAB_INSTALL = f'install "{PYPROJECT["name"]}[lab] @ git+{REPOSITORY}"'
# For the tests whose subject is labkit's or the repository's own text and logic (the range guard under a
# faked torch version, the notebooks' first cell, the Makefile's check): the same on every stack, so
# `make test-compat` leaves them out. What a newer stack can change stays in it: the installed torch
# importing silently, papermill's stop at the first cell, pip keeping a supported torch.
same_on_every_stack = pytest.mark.lock_only


def first_code_cell(notebook):
    return next(cell for cell in nbformat.read(notebook, as_version=4).cells if cell.cell_type == "code")


def install_guard(notebook):
    """The first cell's `try: import labkit ... except` statement, on its own."""
    tree = ast.parse(first_code_cell(notebook).source)
    guard = next(node for node in tree.body if isinstance(node, ast.Try))
    return compile(ast.Module(body=[guard], type_ignores=[]), str(notebook), "exec")


# ---- The supported torch range -------------------------------------------------------------------------

@same_on_every_stack
def test_labkit_checks_the_torch_range_pyproject_declares():
    torch_requirement = next(Requirement(line) for line in PYPROJECT["dependencies"] if line.startswith("torch"))
    lowest, beyond = labkit._SUPPORTED_TORCH
    assert str(torch_requirement.specifier) == f"<{beyond[0]}.{beyond[1]},>={lowest[0]}.{lowest[1]}"


def import_labkit_under_torch(version):
    """`import labkit` where torch's package metadata says `version` (labkit reads it there, importing no torch)."""
    code = ("from importlib import metadata\nreal = metadata.version\n"
            f"metadata.version = lambda name: {version!r} if name == 'torch' else real(name)\nimport labkit")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


@same_on_every_stack
def test_a_torch_below_the_range_makes_import_refuse_with_the_range():
    result = import_labkit_under_torch("2.10.2+cpu")
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("labkit.errors.LabkitError: labkit needs torch>=2.11,<2.16")
    assert "torch 2.10.2+cpu" in last_line


@same_on_every_stack
def test_a_torch_above_the_range_imports_with_a_warning():
    result = import_labkit_under_torch("2.16.0")
    assert result.returncode == 0, result.stderr
    assert "labkit is tested on torch>=2.11,<2.16; torch 2.16.0 is newer" in result.stderr


def test_the_installed_torch_imports_silently():
    result = subprocess.run([sys.executable, "-W", "error", "-c", "import labkit"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr


# ---- The notebooks' first cell ---------------------------------------------------------------------------

@same_on_every_stack
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_the_first_cell_guards_the_labkit_import_and_installs_from_the_declared_repository(notebook):
    source = first_code_cell(notebook).source
    assert source.startswith("import sys\n\ntry:"), "the guard must run before any other import"
    # IPython's %pip, not a subprocess: on Colab it says when the runtime must restart, and pip's progress shows
    assert f"""\n    get_ipython().run_line_magic("pip", '{COLAB_INSTALL}')\n""" in source, \
        "install pyproject's name from its [project.urls]"


@pytest.fixture
def labkit_missing(monkeypatch):
    """This process as a kernel whose Python has no labkit: `import labkit` raises ModuleNotFoundError."""
    monkeypatch.setitem(sys.modules, "labkit", None)


@same_on_every_stack
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_without_labkit_the_first_cell_stops_with_the_install_command(labkit_missing, notebook):
    with pytest.raises(ModuleNotFoundError) as stopped:
        exec(install_guard(notebook), {"sys": sys, "get_ipython": pytest.fail})
    message = str(stopped.value)
    assert "make setup" in message and "the pip install below" in message
    assert stopped.value.__suppress_context__, "the message stands alone, without the import's own traceback"


@same_on_every_stack
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_on_colab_the_first_cell_installs_labkit_from_the_repository(labkit_missing, monkeypatch, notebook):
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    magics = []
    ipython = types.SimpleNamespace(run_line_magic=lambda name, line: magics.append((name, line)))
    monkeypatch.setattr("IPython.get_ipython", lambda: ipython)  # the cell imports it: the kernel's shell
    exec(install_guard(notebook), {"sys": sys})
    assert magics == [("pip", COLAB_INSTALL)]


@pytest.mark.slow
def test_papermill_stops_at_the_first_cell_in_a_kernel_without_labkit(tmp_path, monkeypatch):
    # A kernel whose Python cannot import labkit (the project is installed editable into this venv, so the
    # kernel blocks the name before IPython starts), as on a laptop or a hub that has only the .ipynb.
    kernel_dir = tmp_path / "kernels" / "no-labkit"
    kernel_dir.mkdir(parents=True)
    launcher = "import sys; sys.modules['labkit'] = None; from ipykernel import kernelapp; kernelapp.launch_new_instance()"
    (kernel_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-c", launcher, "-f", "{connection_file}"],
        "display_name": "Python without labkit", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    import papermill

    with pytest.raises(papermill.PapermillExecutionError) as failed:
        papermill.execute_notebook(str(ROOT / "notebooks/00_start_here.ipynb"), str(tmp_path / "out.ipynb"),
                                   kernel_name="no-labkit", cwd=str(tmp_path), progress_bar=False)
    assert failed.value.exec_count == 1, "the run must stop at the first code cell"
    assert failed.value.ename == "ModuleNotFoundError"
    assert "make setup" in failed.value.evalue and "pip install below" in failed.value.evalue
    executed = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    ran = [cell for cell in executed.cells if cell.cell_type == "code" and cell.get("execution_count")]
    assert len(ran) == 1, "no later cell runs, so no cascade of NameErrors"


# ---- pip keeps a supported torch that is already installed -------------------------------------------------

@pytest.mark.slow
def test_installing_the_project_keeps_a_supported_torch_already_there(tmp_path):
    # An environment with torch 2.14.1 (inside the range, not the lock's 2.13.0): Colab, a course image.
    # Only its metadata is needed for pip to see it installed.
    venv = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python3*/site-packages"))
    dist_info = site / "torch-2.14.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.14.1\n")
    (dist_info / "INSTALLER").write_text("pip\n")
    (dist_info / "RECORD").write_text("")
    report = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), "install", "--quiet", "--dry-run",
         "--report", str(report), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    installs = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    assert PYPROJECT["name"] in installs and "numpy" in installs, "the report must list what pip would install"
    assert "torch" not in installs, f"pip would replace the installed torch 2.14.1 with {installs.get('torch')}"


# ---- The licence ships with every copy ---------------------------------------------------------------------

STEM = f"{PYPROJECT['name'].replace('-', '_')}-{PYPROJECT['version']}"


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The folder holding the project's wheel and sdist, built once for this file's tests.

    Built from a copy of what setuptools reads (no build/ or egg-info left in the checkout), with the
    installed setuptools (pyproject's build requirement), through the PEP 517 hooks pip and build call."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "tests", source / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "labkit", source / "labkit", ignore=shutil.ignore_patterns("__pycache__"))
    code = "from setuptools import build_meta as b; b.build_wheel('dist'); b.build_sdist('dist')"
    result = subprocess.run([sys.executable, "-c", code], cwd=source, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return source / "dist"


def test_the_wheel_and_the_sdist_carry_the_mit_licence_and_the_sdist_no_tests(dist):
    # MIT asks for its notice in every copy: the LICENSE file, named by License-File in the metadata.
    licence = (ROOT / "LICENSE").read_text()
    assert licence.startswith("MIT License") and "Copyright (c) 2026 the Gradient Lab authors" in licence
    assert PYPROJECT["license"] == "MIT" and PYPROJECT["license-files"] == ["LICENSE"]
    stem = STEM
    with zipfile.ZipFile(dist / f"{stem}-py3-none-any.whl") as wheel:
        wheel_metadata = wheel.read(f"{stem}.dist-info/METADATA").decode()
        assert wheel.read(f"{stem}.dist-info/licenses/LICENSE").decode() == licence
    with tarfile.open(dist / f"{stem}.tar.gz") as sdist:
        sdist_metadata = sdist.extractfile(f"{stem}/PKG-INFO").read().decode()
        assert sdist.extractfile(f"{stem}/LICENSE").read().decode() == licence
        # the tests run from a checkout only (conftest, helpers, notebooks): an sdist with some would not collect
        assert [name for name in sdist.getnames() if name.startswith(f"{stem}/tests")] == []
    for metadata in (wheel_metadata, sdist_metadata):
        assert "License-Expression: MIT" in metadata.splitlines()
        assert "License-File: LICENSE" in metadata.splitlines()


# ---- The wheel, installed by its name into a fresh venv, used from an empty folder --------------------------

# One process (one torch import) for the commands and a grade, as a learner's script would: the console
# script itself is run for --version.
USE = """
import importlib.metadata as metadata
import torch.nn.functional as F
import labkit
from labkit import grading
from labkit.__main__ import main

print("labkit from", labkit.__file__, metadata.distribution("gradient-lab-workbook").locate_file(""))
for command in (["claims", "--catalogue"], ["claims", "notebooks"], ["student", "notebooks", "student"]):
    print("exit", main(command))

def one_training_step(model, optimizer, x, y):  # 00's planted bug: no zero_grad
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()
grading.check("00.1", one_training_step)

def one_training_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()
grading.check("00.1", one_training_step)
"""


@pytest.mark.slow
def test_the_wheel_installs_by_its_name_into_a_fresh_venv_and_works_from_an_empty_folder(dist, tmp_path):
    # What a user outside the repository meets (issue 40). The venv borrows the packages labkit needs from this
    # test's environment (a .pth line; the folder it names is only put on sys.path, so the editable install of
    # the checkout in it stays inactive) and gets the wheel itself with --no-deps: no download. It does not
    # prove that pip resolves the wheel's declared dependencies, nor a Python or torch other than this one's.
    venv = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python3*/site-packages"))
    (site / "borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                                "--quiet", "--no-deps", "--no-index", str(dist / f"{STEM}-py3-none-any.whl")],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    empty = tmp_path / "empty"
    (empty / "notebooks").mkdir(parents=True)
    shutil.copy(ROOT / "notebooks" / "00_start_here.ipynb", empty / "notebooks")
    (empty / "use.py").write_text(USE)
    plain = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no PYTHONPATH, no activated venv

    def run(*command):
        done = subprocess.run(command, cwd=empty, env=plain, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-3000:])
        return done.stdout

    assert run(str(venv / "bin" / "labkit"), "--version").strip() == f"labkit {PYPROJECT['version']}"
    output = run(str(venv / "bin" / "python"), "use.py")
    # labkit and its distribution's metadata come from the wheel, not from the checkout's editable install
    assert f"labkit from {site / 'labkit' / '__init__.py'} {site}\n" in output, output[:500]
    assert output.count("exit 0") == 3, output[-2000:]
    assert len([line for line in output.splitlines() if re.match(r"[A-Z]\d+[a-z]? ", line)]) >= 80  # cases.json is in the wheel
    assert "Z1    00_start_here                holds" in output
    assert "wrote the student edition of 1 notebook(s)" in output and (empty / "student" / "00_start_here.ipynb").exists()
    verdicts = [line.split(":")[0] for line in output.splitlines() if "Exercise 00.1" in line]
    assert verdicts == ["✗ Exercise 00.1 not yet", "✓ Exercise 00.1 passed"], output[-2000:]
    assert sorted(path.name for path in empty.iterdir()) == ["notebooks", "student", "use.py"], "written elsewhere"


# ---- make test-compat without its Python -----------------------------------------------------------------

@same_on_every_stack
def test_make_test_compat_without_python_3_12_names_the_python_to_install(tmp_path):
    # Neither a missing interpreter nor one of another version gets as far as the recipe's rm -rf of
    # .venv-compat. (A real 3.12 would rebuild it, so the test never passes one.)
    other_version = tmp_path / "python3.12"
    other_version.write_text("#!/bin/sh\nexit 1\n")  # answers like a Python whose version is not 3.12
    other_version.chmod(0o755)
    for python in ["/nonexistent/python3.12", other_version]:
        result = subprocess.run(["make", "--no-print-directory", "-B", f"COMPAT_PYTHON={python}",
                                 ".venv-compat/.installed-stamp"], cwd=ROOT, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "make test-compat needs Python 3.12" in result.stdout
        assert "pyenv install 3.12" in result.stdout
