import pytest

from labkit import LabkitError, Reading
from labkit.readings import UnavailableReading


def test_measured_reading_converts_and_prints_provenance():
    r = Reading(2.5e9, "B/s", "measured", source="copy")
    assert float(r) == 2.5e9 and int(r) == 2_500_000_000
    assert "measured" in str(r) and r.available


def test_unavailable_reading_has_no_number_and_says_why():
    r = Reading.unavailable("B", "needs a CUDA device")
    assert not r.available and r.value is None
    with pytest.raises(UnavailableReading, match="needs a CUDA device"):
        float(r)
    assert "needs a CUDA device" in str(r)


@pytest.mark.parametrize("kwargs", [
    dict(value=None, unit="B", provenance="measured"),
    dict(value=float("nan"), unit="B", provenance="estimated"),
    dict(value=0, unit="B", provenance="unavailable", reason="x"),
    dict(value=None, unit="B", provenance="unavailable"),
    dict(value=1, unit="B", provenance="guessed"),
])
def test_inconsistent_readings_are_rejected(kwargs):
    with pytest.raises(LabkitError):
        Reading(**kwargs)
