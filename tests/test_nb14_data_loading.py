"""14_data_loading under papermill with other parameters: duplicated augmentations come and go with `bug`,
and I2's verdict follows the loader it measures: items that wait 10 ms each load several times faster
with four workers, items that cost nothing do not (worker hand-off then dominates)."""

from pathlib import Path

import pytest
from notebook_runs import run_on_cpu, run_student_edition_on_cpu

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "14_data_loading.ipynb"
# On two cores beside a second test process (pytest-xdist, or a pip install) the notebook's DataLoader
# hit its 60 s limit in 3 of 6 runs, and in none that had the machine to itself. The cause is not
# known; the workers the article blames run four threads each.
pytestmark = pytest.mark.serial
SMALL = {"seed": 5, "samples": 64, "batch_size": 32, "epochs": 1, "noisy_samples": 16, "worker_counts": [0, 4]}


@pytest.mark.parametrize(("bug", "sleep_ms", "i2"), [(True, 10.0, "partly"), (False, 0.0, "does-not-hold")])
def test_dataset_owned_generator_duplicates_noise_only_with_the_bug(tmp_path, student_editions, bug, sleep_ms, i2):
    parameters = dict(SMALL, bug=bug, sleep_ms=sleep_ms)
    if bug:
        result = run_on_cpu(NOTEBOOK, tmp_path, parameters)
    else:  # the fix, on the student edition: it also runs as a learner's untouched edition must
        result = run_student_edition_on_cpu(student_editions[NOTEBOOK], NOTEBOOK, tmp_path, parameters)
    assert result.status == "ok", result.error
    verdicts = {claim["id"]: claim["verdict"] for claim in result.claims}
    assert verdicts["I1"] == "does-not-hold"
    assert verdicts["I2"] == i2
    assert verdicts["I3"] == "partly"
    assert verdicts["I4"] == "does-not-hold"
    if bug:
        # Two workers forked from one dataset draw the same stream: every sample's noise has a twin.
        assert result.metrics["duplicated_share"] == 1.0
    else:
        assert result.metrics["duplicated_share"] == 0.0
