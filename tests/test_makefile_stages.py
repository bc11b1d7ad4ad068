"""The Makefile's serial stage collects only the files listed in SERIAL_TESTS (collecting the whole tree
again to run two tests cost seconds per stage): a `serial` mark in any other file would silently run in
no stage, since the parallel stage deselects it. This test makes that a failure."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.lock_only  # repo text: the same on every stack
SERIAL_MARK = re.compile(r"\bmark\.serial\b")


def makefile_serial_tests() -> set[Path]:
    (line,) = [line for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith("SERIAL_TESTS :=")]
    return {ROOT / name for name in line.split(":=", 1)[1].split()}


def files_with_a_serial_mark() -> set[Path]:
    return {path for path in (ROOT / "tests").rglob("*.py") if path != Path(__file__).resolve()
            and SERIAL_MARK.search(path.read_text())}


def test_every_file_with_a_serial_mark_is_in_the_serial_stage():
    assert files_with_a_serial_mark() <= makefile_serial_tests()


def test_every_serial_stage_file_exists_and_holds_a_serial_test():
    # a listed file without a serial test would make `pytest -m serial` select nothing (exit status 5)
    listed = makefile_serial_tests()
    assert listed, "SERIAL_TESTS lists no file"
    assert listed <= files_with_a_serial_mark()


def test_the_serial_stage_runs_only_the_listed_files():
    recipe_lines = [line.strip() for line in (ROOT / "Makefile").read_text().splitlines() if "-m serial" in line]
    assert len(recipe_lines) == 3  # test, test-unit, test-compat
    assert all("$(SERIAL_TESTS)" in line and "$(UNIT_TESTS)" not in line for line in recipe_lines)
