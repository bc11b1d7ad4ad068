import io

import pytest

from labkit import LabkitError
from labkit.progress import track


def test_track_yields_everything_and_prints_a_few_deterministic_lines():
    out = io.StringIO()
    assert list(track(range(10), "train", updates=2, stream=out)) == list(range(10))
    assert out.getvalue().splitlines() == ["train: 5/10", "train: 10/10 done"]


def test_track_needs_a_total_for_generators():
    with pytest.raises(LabkitError, match="total="):
        list(track(iter([1, 2]), "x"))
