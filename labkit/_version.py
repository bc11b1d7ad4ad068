"""Which labkit made a record: its version (pyproject.toml's, the one source) and the git commit it came from.

`labkit.__version__` and `python -m labkit --version` read them here, and every run record carries them
(`labkit.runner.run.RunResult`: each run's and sweep point's result.json, a workbook's summary.json, a
sweep's rows). Standard library only, so reading them imports no torch.
"""

from __future__ import annotations

import functools
import subprocess
import tomllib
from importlib import metadata
from pathlib import Path

__all__: list[str] = []

DISTRIBUTION = "gradient-lab-workbook"
"""pyproject.toml's project name, under which labkit is installed (a distribution called "labkit" is another project)."""
UNKNOWN_VERSION = "0+unknown"
"""The version of a labkit that is neither installed nor imported from its source tree (PEP 440, sorts first)."""
GIT_SECONDS = 5.0  # a git that answers later than this (a network file system) gives no commit, not a hang

_SOURCE_TREE = Path(__file__).resolve().parents[1]  # the checkout, when labkit is imported from one


def labkit_version() -> str:
    """The installed distribution's version; where labkit runs from a checkout that is not installed (the
    GPU runner's PYTHONPATH), the version in that checkout's pyproject.toml; else `UNKNOWN_VERSION`."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return _source_tree_version()


def _source_tree_version() -> str:
    try:
        project = tomllib.loads((_SOURCE_TREE / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    except (OSError, tomllib.TOMLDecodeError, KeyError):
        return UNKNOWN_VERSION
    return project["version"] if project.get("name") == DISTRIBUTION and "version" in project else UNKNOWN_VERSION


@functools.cache
def git_commit() -> str | None:
    """The commit (`git rev-parse HEAD`) of the checkout labkit is imported from; None for an installed wheel,
    a copy without git metadata, or no git. Never raises: a record without a commit beats no record."""
    try:
        answer = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=_SOURCE_TREE,
                                capture_output=True, text=True, timeout=GIT_SECONDS)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = answer.stdout.split()
    # labkit/ must sit at the top of the checkout: site-packages inside some other repository is not ours
    if answer.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != _SOURCE_TREE:
        return None
    return lines[1]


def describe() -> str:
    """One line for `python -m labkit --version`: 'labkit 0.1.0 (git commit 1a2b...)' or 'labkit 0.1.0'."""
    commit = git_commit()
    return f"labkit {labkit_version()}" + (f" (git commit {commit})" if commit else "")
