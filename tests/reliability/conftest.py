"""The reliability suite: bad input and faults, replayed from the reliability review's trials.

Each test carries `@pytest.mark.trial("ID")` with the ID of the trial it replays (a trial of the
review that was not "ok" or "clear error") and asserts the correct behaviour. Every test runs under
a hard time limit, so the suite itself can never hang.
"""

import pytest

# A replayed trial may take this long at most, unless it says otherwise with @pytest.mark.timeout.
HARD_TIMEOUT_S = 60

def pytest_configure(config):
    config.addinivalue_line("markers", "trial(id): the reliability-review trial this test replays")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "reliability" in item.nodeid and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(HARD_TIMEOUT_S, method="thread"))
