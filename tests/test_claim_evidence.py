"""The claim evidence stored in the notebooks: every catalogue ID has a verdict, and no evidence
names a torch version (the GPU runner's torch is older than the pin, and a version in evidence
goes stale with every upgrade; the fingerprint records the version instead).

The records are read as `python -m labkit claims --json` prints them, from the stored notebooks; the
`claims.check` calls themselves are read from the py twins: evidence numbers formatted, not typed in, and
each case device-dependent in all of its branches or in none, so a GPU run prints the same claims table.
Whether a verdict can come out both ways is tested per notebook, under papermill, in
tests/test_nbNN_*.py.
"""

import ast
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


# -- numbers typed into evidence ------------------------------------------------------------------
# Every number in a verdict's evidence must be formatted from this run's values. A number written
# into the evidence's literal text is allowed only when it is not a measurement: a figure the
# article states (quoted to set against the measured one), a threshold of the verdict, or a fixed
# setting of the reproduction. Reviewed case by case; a new literal number fails until it is either
# formatted from a value or added here with its reason.
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e-?\d+)?%?x?")
TYPED_NUMBERS_ALLOWED = {
    "A3": "2 3 64 8x 9x",  # the pooling settings compared and the 8x8 = 64 pixels of a digit
    "A4": "32",  # the tiny MLP's width
    "A8": "0.9 10 2.5",  # the article's factors and depth
    "A9": "0",  # "0 times an infinite derivative"
    "B1": "3",  # three backward passes, the reproduction's setting
    "B3": "83.1% 99.2%",  # the article's OCR accuracies
    "B5": "1 2 4 8x 32 32x 4x 64x 75%",  # the article's table rows and its 75 % claim (GPU branch)
    "B6": "8",  # the article's 8 GPUs
    "B8": "2 2x 3",  # two and three backward passes, the reproduction's settings
    "C2": "0 1e-5",  # 0/0 and the fix's eps
    "C4": "1e-3 1e-7 2",  # the article's gradcheck recipe, the float64 tolerance, the missing factor 2
    "C5": "1 1e-10 1e-9 64",  # a batch of one, the tolerances, the batch of 64
    "D3": "1 40",  # batch size 1, 40 steps
    "D4": "1",  # a last batch of 1
    "E1": "1 10 1e-12 90%",  # 1 - lr*wd, the 10-90 % spread, the tolerance
    "E2": "1e-9 2",  # the tolerance, wd/2
    "E3": "0.1 1 1.5x 10 100 1e-2 1e-4",  # the article's lr and the warmup settings compared
    "E4": "0 0.005 0.01 0.02 0.9 1 1e-12 20",  # the article's layer decays and formula, the step compared
    "F1": "2",  # norm_type=2
    "F2": "0.05 1.0 12%",  # the article's range, clip value and recall drop
    "F3": "0.02",  # the verdict's threshold on the mean accuracy gain
    "G1": "0 2 24 25 6.1e-5 65536",  # the article's threshold and scale, fp16's exponents
    "G2": "0.5 0.6 1.5 2 200 2000 24 4 8",  # the article's settings and the alternatives tried
    "G4": "126 1e-3 2 20 4",  # the article's guard, the scales and steps of the reproduction
    "G5": "6.1e-5 65504 65520",  # fp16's limits
    "G6": "0 1.0 1e-3 40 65536",  # the article's guard and scale, the reproduction's steps
    "H1": "0 0.15 0.40 10x 1e-4",
    "H2": "0",
    "H3": "2048",
    "H4": "0 1 2",  # maximum(x, 0) and (x + |x|)/2 name formulas; 1, then 0: clamp's slope at 0 in past releases
    "I1": "1e-5",  # the tolerance
    "I2": "1.5x 2",  # the verdict's threshold, the article's prefetch_factor
    "I4": "4",  # the four samples collated
    "J1": "32",  # the article's multiple
    "J2": "0.12 0.21 1 1.75x 32 64",  # the article's loss stds and batches
    "J3": "1e-12",  # the tolerance
    "K1": "1",  # batch 1
    "K2": "1 12 125 144 16 500 894",  # the article's figures, ViT-B/16
    "K3": "0.6 1.2 2",  # the article's arithmetic
    "K4": "12% 13 28 42",  # the article's figures
    "K5": "4",  # the 4-layer MLP measured (GPU branch)
    "K6": "2048 8 37%",  # the GPU branch's shape, the article's saving
    "K8": "224 50 80",  # the image size, the A100's 80 GB
    "L1": "100x 200 500",  # the article's sampling and lead
    "L3": "0 0.5",  # the article's std and dropout rate
    "L4": "16 1e-6 1x 20",
    "L5": "0.01 0.3 100 1000 128 32 50",  # the article's ranges and the reproduction's settings
    "M1": "0 50%",  # the article's half
    "N2": "1",  # d/dloc = 1
    "N4": "0 1e-9",  # no gradient into padding, the tolerance
    "N5": "0 10% 100 5",  # the timing settings (GPU branch)
    "O1": "0.3",  # a rank 0.3 s late
    "O2": "0 1 256 600 80%",  # the GPUs compared, the copy size, the article's 600 GB/s
    "O2b": "1e-15",  # the tolerance
    "O3": "1e-12",  # the tolerance
}
# Measurements still typed in, each to be formatted from its value (then removed from here: a stale
# entry fails too). None is left: F4's "of 4" and M1's "100%" are formatted from the run's values.
TYPED_MEASUREMENTS_PENDING: dict[tuple[str, str], str] = {}


def literal_numbers(expression):
    """The numbers in an expression's string constants, f-string literal parts included, formatted
    values ({...}) left out."""
    if isinstance(expression, ast.Constant):
        return NUMBER.findall(expression.value) if isinstance(expression.value, str) else []
    if isinstance(expression, ast.FormattedValue):  # its format spec (":.2f") is no text
        return literal_numbers(expression.value)
    return [number for child in ast.iter_child_nodes(expression) for number in literal_numbers(child)]


def claim_checks(path):
    """The ``claims.check("ID", ...)`` calls of a py twin whose case id is written out (one computed at
    run time cannot be followed statically; ``grading.check`` is an exercise's, not a verdict)."""
    return [node for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "check"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "claims"
            and node.args and isinstance(node.args[0], ast.Constant)]  # fmt: skip


TWINS = sorted((ROOT / "notebooks" / "py").glob("*.py"))


def typed_numbers_in_evidence():
    """(case, number) for each number in the literal text of a claims.check evidence in the py twins."""
    found = []
    for path in TWINS:
        for node in claim_checks(path):
            evidence = next((k.value for k in node.keywords if k.arg == "evidence"), None)
            if evidence is not None:
                found += [(node.args[0].value, number) for number in literal_numbers(evidence)]
    return found


def test_evidence_numbers_are_formatted_from_values_not_typed_in():
    found = set(typed_numbers_in_evidence())
    typed = sorted({(case, number) for case, number in found
                    if number not in TYPED_NUMBERS_ALLOWED.get(case, "").split()} - set(TYPED_MEASUREMENTS_PENDING))
    assert set(TYPED_MEASUREMENTS_PENDING) <= found, "a pending typed measurement was fixed: remove its entry"
    assert typed == [], (
        f"numbers typed into claim evidence: {typed}; format the measured value into the f-string, or, for an "
        "article's figure, a threshold or a fixed setting, add it to TYPED_NUMBERS_ALLOWED with its reason"
    )


def test_the_typed_number_scan_sees_literal_text_and_not_formatted_values():
    source = 'claims.check("Z1", verdict="holds", evidence=f"grew {growth:>6.0f}x in 12 steps, " + "lost 3.5%")'
    evidence = ast.parse(source).body[0].value.keywords[1].value
    assert literal_numbers(evidence) == ["12", "3.5%"]


def device_dependence(call):
    """Whether a ``claims.check`` call marks its verdict device-dependent, as `claims.check` decides it:
    the argument, else the catalogue's gpu_only or a literal needs-gpu verdict; "unknown" when that
    rests on a verdict computed at run time."""
    given = {keyword.arg: keyword.value for keyword in call.keywords}
    if isinstance(given.get("device_dependent"), ast.Constant):
        return given["device_dependent"].value
    if claims.case(call.args[0].value).gpu_only:
        return True
    verdict = given.get("verdict")
    return verdict.value == "needs-gpu" if isinstance(verdict, ast.Constant) else "unknown"


@pytest.mark.parametrize("twin", TWINS, ids=[path.stem for path in TWINS])
def test_a_case_is_device_dependent_in_all_of_its_branches_or_in_none(twin):
    # The GPU runner compares the same stored outputs: a case that is device-dependent (named without
    # its verdict in the claims table) on one device and not on the other changes the table.
    marks = {}
    for call in claim_checks(twin):
        marks.setdefault(call.args[0].value, {})[call.lineno] = device_dependence(call)
    mixed = {case_id: by_line for case_id, by_line in marks.items() if len(set(by_line.values())) > 1}
    assert mixed == {}, f"pass the same device_dependent= in every claims.check of a case (by line): {mixed}"
