"""pyproject.toml declares ranges; constraints.txt (the course's lock) and constraints-latest.txt (the newest
releases) pin every package exactly, and each pin must lie inside its range. environment.yml repeats the lock, and
pyproject's [tool.uv] gives it to uv sync and uv run."""

import hashlib
import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
HOOK_PYTHON = ".ci/hook-python"  # the git hooks' Python: the checkout's .venv whatever the PATH
LOCKS = ["constraints.txt", "constraints-latest.txt"]


def normalise(name):
    """pip's spelling rule (PEP 503): PyYAML, pyyaml and py_yaml name one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def declared_requirements():
    """Every requirement pyproject declares, core and extras, except the extras' references to the project itself."""
    table = project()
    requirements = [Requirement(line) for line in table["dependencies"]]
    for extra in table["optional-dependencies"].values():
        requirements += [Requirement(line) for line in extra if Requirement(line).name != table["name"]]
    return requirements


def lock(file):
    pins = {}
    for line in (ROOT / file).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[normalise(name)] = version
    return pins


def test_the_extras_install_today_s_full_set():
    # make setup installs .[dev]; dev pulls lab and runner, so setup still installs every package it did.
    extras = project()["optional-dependencies"]
    assert f"{project()['name']}[lab,runner]" in extras["dev"]
    core = {normalise(r.name) for r in map(Requirement, project()["dependencies"])}
    assert {"torch", "numpy", "matplotlib", "psutil"} <= core
    assert not core & {"jupyterlab", "papermill", "nbformat", "pytest"}, "core must not pull a Jupyter stack"


def test_every_range_has_a_lower_bound():
    unbounded = [str(r) for r in declared_requirements() if not any(s.operator in (">=", "==", "~=") for s in r.specifier)]
    assert not unbounded, f"give these the lowest release the tests pass on: {unbounded}"


@pytest.mark.parametrize("file", LOCKS)
def test_every_lock_pin_satisfies_the_declared_ranges(file):
    pins = lock(file)
    missing = [r.name for r in declared_requirements() if normalise(r.name) not in pins]
    assert not missing, f"{file} does not pin {missing}"
    outside = [f"{r.name}=={pins[normalise(r.name)]} (declared {r.specifier})"
               for r in declared_requirements() if not r.specifier.contains(pins[normalise(r.name)], prereleases=True)]
    assert not outside, f"{file} pins releases pyproject.toml does not admit: {outside}"


@pytest.mark.parametrize("file", LOCKS)
def test_each_lock_pins_exactly_and_once(file):
    names = [normalise(line.split("==")[0]) for line in (ROOT / file).read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert len(names) == len(set(names)), f"{file} pins a package twice"
    assert normalise(project()["name"]) not in names, f"{file} must not pin the project itself"


def test_the_course_lock_is_torch_2_13_and_the_latest_lock_is_newer():
    assert lock("constraints.txt")["torch"] == "2.13.0"
    latest = tuple(int(part) for part in lock("constraints-latest.txt")["torch"].split(".")[:2])
    assert latest > (2, 13)


def test_environment_yml_installs_the_course_lock():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert "python=3.11" in env["dependencies"]
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    pins = {normalise(line.split("==")[0]): line.split("==")[1] for line in pip_section if "==" in line}
    locked = lock("constraints.txt")
    disagree = {name: (version, locked.get(name)) for name, version in pins.items() if locked.get(name) != version}
    assert not disagree, f"environment.yml disagrees with constraints.txt (yml, lock): {disagree}"
    assert {normalise(r.name) for r in declared_requirements()} <= set(pins), "environment.yml misses a direct dependency"


def load_uv_constraints():
    spec = importlib.util.spec_from_file_location("uv_constraints", ROOT / ".ci" / "uv_constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_uv_sync_installs_the_course_lock_with_the_dev_extra():
    # uv sync and uv run read no constraints file: they took torch 2.15's CUDA build and left the dev extra out
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())
    uv, uv_constraints = table["tool"]["uv"], load_uv_constraints()
    assert len(uv_constraints.pins()) == len(lock("constraints.txt"))
    assert uv["constraint-dependencies"] == uv_constraints.pins(), "run .ci/hook-python .ci/uv_constraints.py --write"
    # uv sync's default group is make setup's: the dev extra, and pip, which a uv environment otherwise lacks
    assert table["dependency-groups"]["dev"] == [f"{project()['name']}[dev]", "pip>=23.2"]
    # torch from PyTorch's CPU index, and only torch: PyPI's Linux torch is the CUDA build with unpinned nvidia-* packages
    (index,) = table["tool"]["uv"]["index"]
    assert (index["url"], index["explicit"]) == ("https://download.pytorch.org/whl/cpu", True)
    assert [source["index"] for source in table["tool"]["uv"]["sources"]["torch"]] == [index["name"]]


def test_the_uv_list_is_rewritten_from_a_changed_lock(tmp_path):
    uv_constraints = load_uv_constraints()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert uv_constraints.rewritten(pyproject) == pyproject
    changed = (ROOT / "constraints.txt").read_text().replace("torch==2.13.0\n", "torch==2.14.1\nzzz-new==1.0\n")
    (tmp_path / "constraints.txt").write_text(changed)
    rewritten = tomllib.loads(uv_constraints.rewritten(pyproject, tmp_path))
    listed = rewritten["tool"]["uv"]["constraint-dependencies"]
    assert "torch==2.14.1" in listed and "zzz-new==1.0" in listed and "torch==2.13.0" not in listed
    assert rewritten["project"] == project() and rewritten["tool"]["uv"]["environments"]


def test_git_hooks_run_pinned_local_tools_and_download_nothing():
    # pre-commit fetches a hook repository or builds a hook environment for anything but a local,
    # system hook; those would bypass the pins and fail on a machine without network.
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    assert [repo["repo"] for repo in config["repos"]] == ["local"]
    assert {hook["language"] for hook in hooks} == {"system"}
    assert not [hook["id"] for hook in hooks if "additional_dependencies" in hook]
    # each runs the project's Python (.ci/hook-python), never the `python` a commit's PATH happens to give
    assert not [hook["id"] for hook in hooks if hook["entry"].split()[0] != HOOK_PYTHON], HOOK_PYTHON
    declared = {normalise(r.name) for r in declared_requirements()}
    tools = {hook["entry"].split()[2].split(".")[0] for hook in hooks if hook["entry"].split()[1] == "-m"}
    assert {"jupytext", "ruff"} <= tools, "no tool found in the entries: the check below would be vacuous"
    assert tools - {"labkit"} <= declared, f"hooks run tools that pyproject does not declare: {tools - declared}"


def plain_path_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A commit's environment from an IDE or an unactivated shell: the system's PATH, no venv, no conda."""
    return {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PRE_COMMIT_HOME": str(tmp_path / "pre-commit"), **extra}


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "pre-commit").exists(), reason="needs make setup's .venv")
def test_git_hooks_run_from_a_path_without_the_venv(tmp_path):
    # Files that only checking hooks take: ruff, the API page (which imports torch) and the notebook table.
    result = subprocess.run([str(ROOT / ".venv" / "bin" / "pre-commit"), "run", "--files", "labkit/_version.py",
                             "README.md"], cwd=ROOT, env=plain_path_env(tmp_path), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    ran = [line for line in result.stdout.splitlines() if line.endswith("Passed")]
    assert len(ran) == 3 and "No module named" not in result.stdout, result.stdout


def test_without_a_venv_the_hooks_say_to_run_make_setup(tmp_path):
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / HOOK_PYTHON, tmp_path / HOOK_PYTHON)
    result = subprocess.run([str(tmp_path / HOOK_PYTHON), "-m", "ruff", "--version"], cwd=tmp_path,
                            env=plain_path_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"{tmp_path} has no .venv/bin/python" in result.stderr and "run make setup" in result.stderr
    # an activated environment (conda's, here faked by a venv) is used where the checkout has no .venv
    active = tmp_path / "env"
    (active / "bin").mkdir(parents=True)
    (active / "bin" / "python").symlink_to(sys.executable)
    result = subprocess.run([str(tmp_path / HOOK_PYTHON), "-c", "print('ran')"], cwd=tmp_path,
                            env=plain_path_env(tmp_path, CONDA_PREFIX=str(active)), capture_output=True, text=True,
                            timeout=60)
    assert (result.returncode, result.stdout) == (0, "ran\n"), result.stderr


def test_ci_runs_the_readme_test_commands_on_both_locks():
    # and then what a uv user does: uv sync must give the same lock (tests/test_uv_sync.py)
    commands = re.findall(r"^timed make ([a-z-]+)", (ROOT / ".ci" / "run").read_text(), flags=re.M)
    assert commands == ["test", "test-compat", "test-uv"]


@pytest.mark.lock_only  # repository text
def test_make_test_compat_installs_with_the_uv_the_uv_test_pins():
    (compat,) = re.findall(r"^COMPAT_UV_REQUIREMENT := (\S+)$", (ROOT / "Makefile").read_text(), flags=re.M)
    (tested,) = re.findall(r'^UV = "([^"]+)"', (ROOT / "tests" / "test_uv_sync.py").read_text(), flags=re.M)
    assert compat == tested, "make test-compat and tests/test_uv_sync.py install different uv releases"


@pytest.mark.lock_only  # repository text; and make compat-verified runs test-compat before it writes the record
def test_the_newest_release_lock_passed_make_test_compat_whole():
    # CI runs only the instruments' unit tests on the newest releases (.ci/run): the rest ran when the lock changed
    recorded = (ROOT / ".ci" / "compat-verified").read_text().split()
    lock = hashlib.sha256((ROOT / "constraints-latest.txt").read_bytes()).hexdigest()
    assert lock in recorded, ("constraints-latest.txt changed since make test-compat last passed whole on it "
                              "(.ci/compat-verified): run `make compat-verified` (about 20 minutes) and commit the record")
