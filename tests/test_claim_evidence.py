"""The claim evidence stored in the notebooks: every catalogue ID has a verdict, and no evidence
names a torch version (the GPU runner's torch is older than the pin, and a version in evidence
goes stale with every upgrade; the fingerprint records the version instead).

The records are read as `python -m labkit claims --json` prints them, from the stored notebooks.
Whether a verdict can come out both ways is tested per notebook, under papermill, in
tests/test_nbNN_*.py.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit import claims

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = ".".join(torch.__version__.split(".")[:2])
# "torch 2.13", "PyTorch 2.11", "torch v2.0", and the bare pinned, GPU-image and installed versions
# (not inside a longer number such as 2.134).
VERSION_PATTERNS = [
    re.compile(r"\b(?:py)?torch\s+v?\d+\.\d+", re.IGNORECASE),
    re.compile(rf"(?<![\d.])(?:2\.11|2\.13|{re.escape(INSTALLED)})(?![\d])"),
]


@pytest.fixture(scope="module")
def stored_claims():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "labkit", "claims", "--json"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120, check=True)
    return json.loads(result.stdout)


def test_every_catalogue_id_has_a_stored_verdict(stored_claims):
    assert set(claims.catalogue()) - {r["id"] for r in stored_claims} == set()


def test_no_evidence_names_a_torch_version(stored_claims):
    naming = [(r["id"], r["notebook"], match.group(0))
              for r in stored_claims for pattern in VERSION_PATTERNS
              for match in [pattern.search(r["evidence"])] if match]
    assert naming == [], f"evidence names a torch version (say 'the installed torch'): {naming}"


@pytest.mark.parametrize("text", ["on torch 2.13 the hook", "PyTorch 2.0 changed it", f"as of {INSTALLED}, it"])
def test_the_version_patterns_catch_a_version(text):
    assert any(pattern.search(text) for pattern in VERSION_PATTERNS)


@pytest.mark.parametrize("text", ["test loss 2.1499 vs 1.8595", "lead 213 steps", "21.13 MB"])
def test_the_version_patterns_leave_measured_numbers_alone(text):
    assert not any(pattern.search(text) for pattern in VERSION_PATTERNS)
