"""Installing the workbook where learners are: the supported torch range, the notebooks' first cell when
labkit is missing (a clear message, or on Colab an install), and an install that keeps a supported torch."""

import ast
import importlib.metadata
import json
import os
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
from labkit._notebook_meta import install_line

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
REPOSITORY = PYPROJECT["urls"]["Repository"]
# What the first line installs on Colab: the distribution's own name (tests/test_install_name.py), never "labkit".
COLAB_INSTALL = f"install '{PYPROJECT['name']}[colab] @ git+{REPOSITORY}'"
# For the tests whose subject is labkit's or the repository's own text and logic (the range guard under a
# faked torch version, the notebooks' first cell, the Makefile's check): the same on every stack, so
# `make test-compat` leaves them out. What a newer stack can change stays in it: the installed torch
# importing silently, papermill's stop at the first cell, pip keeping a supported torch.
same_on_every_stack = pytest.mark.lock_only


def first_code_cell(notebook):
    return next(cell for cell in nbformat.read(notebook, as_version=4).cells if cell.cell_type == "code")


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
def test_every_notebook_s_first_code_line_is_the_generated_install_line(notebook):
    assert first_code_cell(notebook).source.split("\n")[0] == install_line(), \
        "run `python -m labkit._notebook_meta --write`, then the jupytext sync (pre-commit does it)"


@same_on_every_stack
def test_the_install_line_installs_the_colab_extra_from_the_declared_repository():
    line = install_line()
    assert len(line.split("#")[0]) < 240, "one short line: what else the cell needs lives in labkit/start.py"
    # pip through IPython's system(), not %pip, which prints "you may need to restart" after any install
    assert f'get_ipython().system("pip {COLAB_INSTALL}")' in line and "%pip" not in line
    colab = [Requirement(line).name for line in PYPROJECT["optional-dependencies"]["colab"]]
    assert not {"pandas", "jupyterlab", "ipykernel", "jupytext", "torch"} & set(colab), "Colab brings its own"
    assert "README, Install" in line.split("#")[1], "without labkit the traceback shows this line: say what to do"


def run_install_line(monkeypatch, on_colab):
    """exec the line's statements before `import labkit.start` in this process, with `labkit` unimportable."""
    monkeypatch.setitem(sys.modules, "labkit", None)
    if on_colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    commands = []
    shell = types.SimpleNamespace(system=commands.append)
    before_import = install_line().split("; import labkit.start")[0]
    exec(before_import, {"get_ipython": lambda: shell})
    return commands


@same_on_every_stack
def test_on_colab_without_labkit_the_line_runs_pip_once(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None if name == "labkit" else object())
    assert run_install_line(monkeypatch, on_colab=True) == [f"pip {COLAB_INSTALL}"]


@same_on_every_stack
def test_the_line_installs_nothing_elsewhere_or_where_labkit_is_there(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert run_install_line(monkeypatch, on_colab=False) == []
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    assert run_install_line(monkeypatch, on_colab=True) == []


# ---- labkit.start: what the line runs once labkit is importable -----------------------------------------

def test_a_package_replaced_on_disk_after_its_import_is_named_with_both_versions():
    from labkit import start

    numpy_now = types.SimpleNamespace(__version__=importlib.metadata.version("numpy"))
    numpy_before = types.SimpleNamespace(__version__="2.1.3")
    torch_local = types.SimpleNamespace(__version__=importlib.metadata.version("torch"))
    assert start.replaced_in_memory({"numpy": numpy_now, "torch": torch_local, "numpy.linalg": numpy_before}) == {}
    assert start.replaced_in_memory({"numpy": numpy_before}) == {
        "numpy": ("2.1.3", importlib.metadata.version("numpy"))}


@pytest.fixture
def colab(monkeypatch):
    """This process as a Colab kernel: a stand-in google.colab whose widget manager records being turned on."""
    enabled = []
    output = types.SimpleNamespace(enable_custom_widget_manager=lambda: enabled.append(True))
    google_colab = types.ModuleType("google.colab")
    google_colab.output = output
    monkeypatch.setitem(sys.modules, "google.colab", google_colab)
    return enabled


def test_on_colab_set_up_turns_the_widget_manager_on_and_says_labkit_is_ready(colab, capsys):
    from labkit import start

    start.set_up()
    assert colab == [True]
    assert capsys.readouterr().out == f"labkit {labkit.__version__} is ready (Colab's widget manager is on, for the explorers).\n"


def test_on_colab_a_replaced_imported_package_stops_the_run_with_colab_s_restart_button(colab, monkeypatch):
    from labkit import start

    monkeypatch.setitem(sys.modules, "numpy", types.SimpleNamespace(__version__="2.1.3"))
    shown = []
    monkeypatch.setattr(start, "_show_colab_restart_button", shown.append)
    with pytest.raises(start.RestartNeeded) as stopped:
        start.set_up()
    assert shown == [["numpy"]] and colab == []
    message = stopped.value._render_traceback_()
    assert message == [str(stopped.value)] and "Restart needed" in message[0] and "Runtime > Restart session" in message[0]
    assert f"numpy 2.1.3 -> {importlib.metadata.version('numpy')}" in message[0]


def test_elsewhere_set_up_does_nothing_and_prints_nothing(capsys, monkeypatch):
    from labkit import start

    monkeypatch.setitem(sys.modules, "numpy", types.SimpleNamespace(__version__="2.1.3"))  # would need a restart
    start.set_up()
    assert capsys.readouterr() == ("", "")


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
    # the traceback shows the line, whose comment says where the install is described
    assert "README, Install" in "\n".join(failed.value.traceback)
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


# ---- A Colab-like runtime: the first cell installs beside what the runtime has imported --------------------

# Colab's own versions where this machine's package index has them (its published pip freeze of 2026-08:
# pandas 2.2.3, scikit-learn 1.6.1, ipykernel 6.17.1 with IPython 7.34.0, ipywidgets 7.7.1, matplotlib 3.10.0,
# psutil 5.9.5); numpy 2.4.1, not Colab's 2.1.3, which labkit's range (>=2.4) would replace (that case needs
# a restart: benchmarks/results/colab_install.md). torch is the lock's 2.13.0+cpu, the one CPU build here,
# hard-linked from this environment with its dependencies instead of installed again (pip unlinking a link
# leaves this environment's file in place).
COLAB_STACK = ["numpy==2.4.1", "pandas==2.2.3", "scikit-learn==1.6.1", "ipykernel==6.17.1", "ipython==7.34.0",
               "ipywidgets==7.7.1", "matplotlib==3.10.0", "psutil==5.9.5"]
TORCH_AND_ITS_DEPENDENCIES = ["torch", "filelock", "typing_extensions", "sympy", "mpmath", "networkx", "jinja2",
                              "markupsafe", "fsspec"]
# What Colab imports before the first cell (its own module, then numpy and pandas), and torch, which a
# learner's earlier cell may have imported: pip must leave all of them as they are.
IMPORTED_FIRST = ["google.colab", "torch", "numpy", "pandas"]
KEPT = ["torch", "numpy", "pandas", "scikit-learn", "ipykernel", "ipython"]
STAND_IN_COLAB = '''"""A stand-in for Colab's google.colab: its widget manager switch records being called."""
import os
from types import SimpleNamespace


def _enable():
    with open(os.environ["COLAB_WIDGET_MANAGER_LOG"], "a") as log:
        log.write("enabled\\n")


output = SimpleNamespace(enable_custom_widget_manager=_enable)
'''


def link_distributions(names, site):
    """Hard-link the installed files of these distributions into another environment's site-packages."""
    for name in names:
        distribution = importlib.metadata.distribution(name)
        for file in distribution.files:
            source, target = Path(distribution.locate_file(file)).resolve(), site / file
            if source.is_file() and not str(file).startswith(".."):
                target.parent.mkdir(parents=True, exist_ok=True)
                if not target.exists():
                    target.hardlink_to(source)


def repository_snapshot(folder):
    """A git repository holding what building the workbook reads, as in this checkout now (edits included)."""
    folder.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(ROOT / name, folder / name)
    shutil.copytree(ROOT / "labkit", folder / "labkit", ignore=shutil.ignore_patterns("__pycache__"))
    identity = {"GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@example.org", "GIT_COMMITTER_NAME": "test",
                "GIT_COMMITTER_EMAIL": "test@example.org", "PATH": "/usr/bin:/bin", "HOME": str(folder)}
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "snapshot"]):
        subprocess.run(["git", *command], cwd=folder, env=identity, check=True, timeout=60)


def versions(python, names):
    code = f"import importlib.metadata as m; print({{n: m.version(n) for n in {names!r}}})"
    return ast.literal_eval(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True,
                                           timeout=60).stdout)


@pytest.mark.slow
@pytest.mark.colab_like
@pytest.mark.skipif(os.environ.get("LABKIT_COLAB_TEST") != "1",
                    reason="builds a Colab-like venv and installs into it (minutes): `make test-colab` runs it")
def test_in_a_colab_like_runtime_the_first_cell_keeps_its_packages_and_00_runs(tmp_path, monkeypatch):
    import time

    import nbclient

    venv = tmp_path / "colab"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    installed = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-compile", *COLAB_STACK],
                               capture_output=True, text=True, timeout=900)
    assert installed.returncode == 0, installed.stderr[-3000:]
    link_distributions(TORCH_AND_ITS_DEPENDENCIES, site)
    (site / "google" / "colab").mkdir(parents=True)
    (site / "google" / "colab" / "__init__.py").write_text(STAND_IN_COLAB)
    before = versions(python, KEPT)

    # The cell's own text, with its git address served from a snapshot of this checkout (git's insteadOf)
    source = tmp_path / "source"
    repository_snapshot(source)
    widget_log = tmp_path / "widget-manager.log"
    kernel_dir = tmp_path / "kernels" / "colab-like"
    kernel_dir.mkdir(parents=True)
    launcher = f"import {', '.join(IMPORTED_FIRST)}; from ipykernel import kernelapp; kernelapp.launch_new_instance()"
    (kernel_dir / "kernel.json").write_text(json.dumps({
        "argv": [python, "-c", launcher, "-f", "{connection_file}"], "display_name": "Colab-like", "language": "python",
        "env": {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "COLAB_WIDGET_MANAGER_LOG": str(widget_log),
                "GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": f"url.file://{source}.insteadOf",
                "GIT_CONFIG_VALUE_0": REPOSITORY}}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    work = tmp_path / "work"
    work.mkdir()
    notebook = nbformat.read(ROOT / "notebooks" / "00_start_here.ipynb", as_version=4)
    started = time.monotonic()
    nbclient.NotebookClient(notebook, kernel_name="colab-like", timeout=900,
                            resources={"metadata": {"path": str(work)}}).execute()
    whole = time.monotonic() - started

    first = next(cell for cell in notebook.cells if cell.cell_type == "code")
    timing = first.metadata["execution"]
    seen = "".join(output.get("text", "") for output in first.outputs if output.output_type == "stream")
    print(f"\nColab-like runtime: first cell {timing['iopub.execute_input']} -> {timing['shell.execute_reply']}, "
          f"whole notebook {whole:.0f} s\nkept: {before}\nafter: {versions(python, KEPT + ['ipywidgets', 'matplotlib', 'psutil'])}\n"
          f"the learner saw:\n{seen}")
    assert versions(python, KEPT) == before, "the install replaced a package the runtime has"
    assert f"Collecting {PYPROJECT['name']}" in seen and "Successfully installed" in seen, "pip says what it does"
    assert seen.rstrip().endswith(f"labkit {PYPROJECT['version']} is ready (Colab's widget manager is on, for the explorers).")
    assert "Restart needed" not in seen and "pandas" not in seen.split("Successfully installed")[1]
    assert widget_log.read_text() == "enabled\n"
