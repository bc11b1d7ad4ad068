"""A bare install (`pip install` without extras) runs what it can and, for a command that needs an extra, names
that extra and writes nothing: no traceback of a missing nbformat, no failed run folder of a missing nbclient."""

import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from labkit import __main__ as cli
from labkit.__main__ import main as labkit_main

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


@pytest.fixture
def uninstalled(monkeypatch):
    """Make the installed metadata say that the named packages are not installed (as in a bare install)."""
    def hide(*names):
        real_version = metadata.version

        def version(name):
            if name in names:
                raise metadata.PackageNotFoundError(name)
            return real_version(name)
        monkeypatch.setattr(metadata, "version", version)
    return hide


@pytest.mark.parametrize(("argv", "hidden", "extra"), [
    (["progress", "student"], ("nbformat",), "runner"),
    (["student", "notebooks", "student"], ("nbformat",), "runner"),
    (["course", "create", "00", "--assignment", "ps1", "--dest", "course"], ("nbgrader", "nbformat"), "course"),
    (["repro", "00_start_here", "-p", "steps", "10"], ("papermill", "nbclient"), "runner"),
])
def test_a_command_without_its_extra_names_the_extra_and_writes_nothing(
        argv, hidden, extra, uninstalled, tmp_path, monkeypatch, capsys):
    (tmp_path / "notebooks").mkdir()  # a folder like the workbook's, so only the missing extra can stop it
    monkeypatch.chdir(tmp_path)
    uninstalled(*hidden)
    assert labkit_main(argv) == 2
    message = capsys.readouterr().err
    assert f"labkit {argv[0]} needs the `{extra}` extra" in message
    assert f"pip install -e '.[{extra}]'" in message and "make setup" in message
    assert hidden[0] in message, "say which package is missing"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notebooks"], "nothing written"
    assert list((tmp_path / "notebooks").iterdir()) == []


def test_every_extra_a_command_names_is_one_pyproject_declares():
    for name, (_, _, extras, _) in cli.COMMANDS.items():
        assert set(extras) <= set(EXTRAS), f"{name} names an extra pyproject.toml does not have: {extras}"


def test_with_the_extras_installed_no_command_is_stopped():
    # this environment has every extra (make setup installs dev), so the check must find nothing missing
    assert {name: cli.missing_extras(extras) for name, (_, _, extras, _) in cli.COMMANDS.items()
            if cli.missing_extras(extras)} == {}


def test_a_command_that_needs_no_extra_is_never_stopped(uninstalled):
    uninstalled(*(line.split(">")[0].split("[")[0] for lines in EXTRAS.values() for line in lines))
    assert cli.missing_extras(cli.COMMANDS["claims"][2]) == {}
    assert set(cli.missing_extras(("runner", "course"))) == {"runner", "course"}
