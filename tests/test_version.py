"""Which labkit made a record: `labkit.__version__`, `python -m labkit --version` and the git commit
(labkit/_version.py). The run records that carry them are checked in tests/test_repro.py, the GPU
runner's report in tests/test_probes.py, and that --version imports no torch in tests/test_import_layers.py."""

import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import labkit
from labkit import _version
from labkit.__main__ import main as labkit_main

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT_VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


@pytest.fixture
def fresh_commit():
    """git_commit() is cached per process: forget it before and after a test that moves the source tree."""
    _version.git_commit.cache_clear()
    yield
    _version.git_commit.cache_clear()


def head() -> str | None:
    if shutil.which("git") is None:
        return None
    answer = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    return answer.stdout.strip() if answer.returncode == 0 else None


def test_the_version_has_one_source_pyproject_through_the_installed_metadata():
    # read under the project's own name: a distribution called "labkit" (PyPI's) would be another's version
    assert _version.DISTRIBUTION == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    assert labkit.__version__ == metadata.version(_version.DISTRIBUTION) == PYPROJECT_VERSION


def test_python_m_labkit_version_names_the_version_and_the_checkouts_commit():
    result = subprocess.run([sys.executable, "-m", "labkit", "--version"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    commit = head()
    expected = f"labkit {PYPROJECT_VERSION}" + (f" (git commit {commit})" if commit else "")
    assert result.stdout.strip() == expected


def test_a_labkit_not_installed_reads_its_checkouts_pyproject(monkeypatch, tmp_path):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_version.metadata, "version", not_installed)
    assert _version.labkit_version() == PYPROJECT_VERSION  # the GPU runner's PYTHONPATH checkout
    monkeypatch.setattr(_version, "_SOURCE_TREE", tmp_path)
    assert _version.labkit_version() == _version.UNKNOWN_VERSION  # a bare copy: still a version, never a crash
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\nversion = "9.9"\n')
    assert _version.labkit_version() == _version.UNKNOWN_VERSION  # another project's version is not labkit's


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to make a repository around the copy")
def test_no_commit_outside_labkits_own_checkout(monkeypatch, tmp_path, fresh_commit):
    assert _version.git_commit() == head(), "in this checkout the commit is HEAD's"
    # site-packages inside some other repository (a venv in a user's project) is not labkit's checkout
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, timeout=30)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "x"], check=True, timeout=30)
    site = tmp_path / "venv" / "site-packages"
    site.mkdir(parents=True)
    monkeypatch.setattr(_version, "_SOURCE_TREE", site)
    _version.git_commit.cache_clear()
    assert _version.git_commit() is None
    # no git at all: a record without a commit, not a failure
    monkeypatch.setattr(_version, "_SOURCE_TREE", ROOT)
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools-here"))
    _version.git_commit.cache_clear()
    assert _version.git_commit() is None
    assert _version.describe() == f"labkit {PYPROJECT_VERSION}"


def test_version_with_arguments_says_it_takes_none(capsys):
    assert labkit_main(["--version", "claims"]) == 2
    error = capsys.readouterr().err
    assert "--version takes no arguments, got 'claims'" in error and "unknown command" not in error
