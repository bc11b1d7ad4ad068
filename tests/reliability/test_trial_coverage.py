"""Every trial the reliability review found failing is replayed by a test of this suite."""

from pathlib import Path

import pytest
from trials import TRIALS_TO_REPLAY

HERE = Path(__file__).resolve().parent

# Trials not replayed yet, each with the reason; this set only shrinks.
NOT_YET_REPLAYED: dict[str, str] = {}


def _replayed_ids(session_items) -> set[str]:
    return {mark.args[0] for item in session_items for mark in item.iter_markers("trial")}


def test_every_failing_trial_is_replayed(request):
    replayed = _replayed_ids(request.session.items)
    if not {item.path.name for item in request.session.items} - {Path(__file__).name}:
        pytest.skip("run with the whole reliability suite (pytest tests/reliability)")
    missing = TRIALS_TO_REPLAY - replayed - set(NOT_YET_REPLAYED)
    assert not missing, f"trials with no replaying test: {sorted(missing)}"
    assert not replayed - TRIALS_TO_REPLAY - {"extra"}, "a trial mark names an unknown trial ID"
    assert not set(NOT_YET_REPLAYED) & replayed, "replayed now: drop it from NOT_YET_REPLAYED"
