"""What a uv user does from a clean copy of the checkout (issue 40): `uv sync`, then `uv run pytest
tests/test_install.py`. uv reads no constraints.txt, only pyproject's [tool.uv] (constraint-dependencies
generated from it, the dev group, torch from PyTorch's CPU index): the environment it makes must be the lock's,
as `make setup`'s is, and the install tests must pass in it.

`make test-uv` runs it (CI does, after make test): a minute with uv's cache cold, half that warm
(docs/INSTALL.md, uv). Where PyTorch's CPU index is out of reach but pip's configuration finds torch's CPU wheel
in a local folder (find-links), the test points uv's `pytorch-cpu` index at a one-package index holding that wheel,
with uv's own environment variables, as a maintainer would; pyproject.toml is not edited."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
UV = "uv==0.13.8"  # the uv the test installs for itself (pip, into its own folder): the one docs/INSTALL.md was checked with
# Installed beside the lock's packages and pinned by neither lock, as pip freeze leaves them out: the project itself,
# pip (the dev group's, pyproject.toml) and setuptools (torch's requirement).
OUTSIDE_THE_LOCK = {canonicalize_name(PROJECT["name"]), "pip", "setuptools"}
# The variables that would send uv elsewhere than the copy, or that are the outer test's own
DROPPED = {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "LABKIT_UV_TEST", "LABKIT_COLAB_TEST"}


def locked_versions() -> dict[str, str]:
    """constraints.txt as {normalised name: version}, torch as its CPU build outside macOS (pyproject's torch source)."""
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if line.strip() and not line.startswith("#"))
    pins = {canonicalize_name(name): version.strip() for name, version in pins.items()}
    if sys.platform != "darwin":
        pins["torch"] += "+cpu"
    return pins


def dev_requirements() -> set[str]:
    """The names `make setup` installs by request: the core, the dev extra with the extras it names, and pip."""
    extras, self_name = PROJECT["optional-dependencies"], canonicalize_name(PROJECT["name"])
    names, pending, expanded = {canonicalize_name(Requirement(line).name) for line in PROJECT["dependencies"]}, ["dev"], set()
    while pending:
        extra = pending.pop()
        expanded.add(extra)
        for requirement in map(Requirement, extras[extra]):
            if canonicalize_name(requirement.name) == self_name:
                pending += sorted(requirement.extras - expanded)
            else:
                names.add(canonicalize_name(requirement.name))
    return names | {"pip"}


def differences_from_the_lock(installed: dict[str, str]) -> list[str]:
    """What makes an environment ({name: version}) other than the lock's with the dev extra, one line each."""
    installed = {canonicalize_name(name): version for name, version in installed.items()}
    locked = locked_versions()
    return ([f"{name} {version} instead of the lock's {locked[name]}" for name, version in sorted(installed.items())
             if name in locked and version != locked[name]]
            + [f"{name} {version}, which the lock does not pin" for name, version in sorted(installed.items())
               if name not in locked and name not in OUTSIDE_THE_LOCK]
            + [f"{name} is missing (the dev extra asks for it)" for name in sorted(dev_requirements() - set(installed))])


@pytest.mark.lock_only  # the check's own logic, on made-up environments
def test_the_check_names_each_way_an_environment_leaves_the_lock():
    as_locked = {**locked_versions(), PROJECT["name"]: PROJECT["version"], "pip": "25.3", "setuptools": "80.9.0"}
    del as_locked["tensorboard"]  # the bench extra's: make setup leaves it out too
    assert differences_from_the_lock(as_locked) == []
    # what uv sync gave before [tool.uv]: PyPI's newest torch (CUDA) and numpy, nvidia-*, and no dev extra
    uv_without_the_lock = {**as_locked, "torch": "2.15.0", "numpy": "2.5.5", "nvidia-cublas": "13.1.1.3"}
    del uv_without_the_lock["pytest"]
    assert differences_from_the_lock(uv_without_the_lock) == [
        "numpy 2.5.5 instead of the lock's " + locked_versions()["numpy"],
        "torch 2.15.0 instead of the lock's " + locked_versions()["torch"],
        "nvidia-cublas 13.1.1.3, which the lock does not pin",
        "pytest is missing (the dev extra asks for it)"]


# ---- The real uv sync ---------------------------------------------------------------------------------------

def copy_of_the_checkout(folder: Path) -> Path:
    """The files git tracks, and new ones it does not ignore, as they are now: no .venv, uv.lock or caches."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, f"the test copies a git checkout: {listed.stderr}"
    for name in filter(None, listed.stdout.split("\0")):
        if (ROOT / name).is_file():  # a tracked file deleted in the work tree is left out, as in the checkout
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, folder / name)
    return folder


def pip_find_links() -> list[Path]:
    """The local folders pip's configuration (pip.conf or PIP_FIND_LINKS) names in find-links."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            timeout=60).stdout
    values = [line.split("=", 1)[1].strip("'\"") for line in listed.splitlines() if re.match(r"[^=]*find-links=", line)]
    folders = [Path(item.removeprefix("file://")) for value in values for item in value.split()]
    return [folder for folder in dict.fromkeys(folders) if folder.is_dir()]


def local_torch_wheel() -> Path | None:
    """The lock's torch, CPU build, in one of pip's find-links folders, for this Python and platform."""
    wanted, tags = locked_versions()["torch"], set(sys_tags())
    for folder in pip_find_links():
        for wheel in sorted(folder.glob("torch-*.whl")):
            _, version, _, wheel_tags = parse_wheel_filename(wheel.name)
            if str(version) == wanted and wheel_tags & tags:
                return wheel
    return None


def index_of_one_wheel(wheel: Path, folder: Path) -> str:
    """A package index (PEP 503, as a folder) that holds this one wheel; its file:// address."""
    package = folder / canonicalize_name(parse_wheel_filename(wheel.name)[0])
    package.mkdir(parents=True)
    (package / "index.html").write_text(f'<a href="{wheel.as_uri()}">{wheel.name}</a>\n')
    return folder.as_uri()


def uv_environment(uv_bin: Path, torch_index: str | None) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in DROPPED}
    outer_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([str(uv_bin), *(p for p in env.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                                                  if p != outer_bin)])
    env["UV_PYTHON"] = sys.executable  # this Python (3.11.5+, as [tool.uv] environments asks), not the first on PATH
    env["UV_PYTHON_DOWNLOADS"] = "never"  # never fetch a Python: fail naming the one missing
    if torch_index:
        # uv has no way to mark an index given on the command line explicit (torch only), so without unsafe-best-match
        # it would also look there for macOS's torch, which it does not hold, and the universal lock would fail
        env.update(UV_INDEX=f"pytorch-cpu={torch_index}", UV_INDEX_STRATEGY="unsafe-best-match")
    return env


def run(command: list[str], cwd: Path, env: dict[str, str], timeout: int) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - started


@pytest.mark.slow
@pytest.mark.uv_sync
@pytest.mark.skipif(os.environ.get("LABKIT_UV_TEST") != "1",
                    reason="uv sync in a copy of the checkout (a minute, PyPI): `make test-uv` runs it, and CI")
def test_uv_sync_in_a_clean_copy_installs_the_lock_and_the_install_tests_pass(tmp_path):
    tool = tmp_path / "uv-tool"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(tool), UV],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    wheel = local_torch_wheel()
    env = uv_environment(tool / "bin", index_of_one_wheel(wheel, tmp_path / "torch-index") if wheel else None)
    copy = copy_of_the_checkout(tmp_path / "checkout")

    synced, sync_seconds = run(["uv", "sync"], copy, env, timeout=900)
    assert synced.returncode == 0, (
        "uv sync failed" + ("" if wheel else " (pip's find-links hold no torch CPU wheel, so uv asked PyTorch's CPU "
                            "index: docs/INSTALL.md, uv)") + ":\n" + synced.stderr[-3000:])
    listing = subprocess.run([str(copy / ".venv" / "bin" / "python"), "-c", "import importlib.metadata as m, json; "
                              "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"],
                             cwd=copy, capture_output=True, text=True, check=True, timeout=120)
    environment = json.loads(listing.stdout)
    tested, test_seconds = run(["uv", "run", "pytest", "tests/test_install.py", "-q"], copy, env, timeout=900)

    counts = "; ".join(line for line in synced.stderr.splitlines() if re.match(r"(Resolved|Prepared|Installed) \d+", line))
    print(f"\nuv sync {sync_seconds:.0f} s ({counts}), "
          f"torch {environment.get('torch')} from {'a local index of ' + wheel.name if wheel else 'PyTorch CPU index'}; "
          f"uv run pytest tests/test_install.py {test_seconds:.0f} s: {tested.stdout.strip().splitlines()[-1:]}")
    differences = differences_from_the_lock(environment)
    assert not differences, "uv sync did not install the lock with the dev extra:\n" + "\n".join(differences)
    assert tested.returncode == 0, tested.stdout[-4000:] + tested.stderr[-2000:]
    assert re.search(r"^\d+ passed", tested.stdout.strip().splitlines()[-1]), tested.stdout[-2000:]
    assert (copy / "uv.lock").is_file() and (copy / ".venv").is_dir(), "uv wrote its lock and environment in the copy"
