"""Every trial the reliability review found failing is replayed by a test of this suite.

The marks are read from the suite's source (by AST), so the check holds whichever tests a run selects."""

import ast
from pathlib import Path

from trials import TRIALS_TO_REPLAY

HERE = Path(__file__).resolve().parent

# Trials not replayed yet, each with the reason; this set only shrinks.
NOT_YET_REPLAYED: dict[str, str] = {}


def _trial_marks(source: str) -> set[str]:
    """The IDs of a test module's `pytest.mark.trial("ID")` marks: on a test, or on one of its
    `pytest.param(..., marks=...)` cases."""
    return {
        call.args[0].value
        for call in ast.walk(ast.parse(source))
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "pytest.mark.trial"
        and call.args and isinstance(call.args[0], ast.Constant)
    }


def _replayed() -> set[str]:
    return set().union(*(_trial_marks(path.read_text()) for path in HERE.glob("test_*.py")))


def test_the_mark_reader_finds_trial_marks_on_tests_and_cases_and_nothing_else():
    source = ('@pytest.mark.trial("T5")\n@pytest.mark.timeout(5)\ndef test_a():\n    pass\n'
              'CASES = [pytest.param(1, marks=pytest.mark.trial("R10"))]\n')
    assert _trial_marks(source) == {"T5", "R10"}


def test_every_failing_trial_is_replayed():
    replayed = _replayed()
    missing = TRIALS_TO_REPLAY - replayed - set(NOT_YET_REPLAYED)
    assert not missing, f"trials with no replaying test: {sorted(missing)}"
    assert not replayed - TRIALS_TO_REPLAY - {"extra"}, "a trial mark names an unknown trial ID"
    assert not set(NOT_YET_REPLAYED) & replayed, "replayed now: drop it from NOT_YET_REPLAYED"
