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

from labkit import _notebook_meta, claims

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


@pytest.mark.parametrize(("case", "code"), [
    ("H2", "head._compiled = False"), ("E2", "(default False)"), ("B7", "(set_to_none=False)"),
])
def test_rendered_evidence_keeps_code_literals_as_written(stored_claims, case, code):
    evidence = next(r["evidence"] for r in stored_claims if r["id"] == case)
    assert code in evidence and code in claims.readable(evidence)


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
# formatted from a value or added, with its reason, to `[typed_numbers_allowed]` in the metadata
# block of the notebook that checks the case (notebooks/meta/NN_name.toml).
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e-?\d+)?%?x?")
TYPED_NUMBERS_ALLOWED: dict[str, str] = _notebook_meta.typed_numbers_allowed()
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


EVIDENCE_ARGUMENTS = ("measured", "note", "rule")


def typed_values(measured):
    """The numbers written as a measured dict's values (``{"growth": 37}``): a measurement typed in."""
    if not isinstance(measured, ast.Dict):
        return []
    return [str(value.value) for value in measured.values
            if isinstance(value, ast.Constant) and type(value.value) in (int, float)]


def typed_numbers(call):
    """The numbers typed into one claims.check's evidence: in the literal text of its labels, note and
    rule, and as a measured value."""
    return [number for keyword in call.keywords if keyword.arg in EVIDENCE_ARGUMENTS
            for number in literal_numbers(keyword.value)
            + (typed_values(keyword.value) if keyword.arg == "measured" else [])]


def typed_numbers_in_evidence():
    """(case, number) for each number typed into a claims.check's evidence in the py twins."""
    return [(node.args[0].value, number) for path in TWINS for node in claim_checks(path)
            for number in typed_numbers(node)]


def test_evidence_numbers_are_formatted_from_values_not_typed_in():
    found = set(typed_numbers_in_evidence())
    typed = sorted({(case, number) for case, number in found
                    if number not in TYPED_NUMBERS_ALLOWED.get(case, "").split()} - set(TYPED_MEASUREMENTS_PENDING))
    assert set(TYPED_MEASUREMENTS_PENDING) <= found, "a pending typed measurement was fixed: remove its entry"
    assert typed == [], (
        f"numbers typed into claim evidence: {typed}; format the measured value into the f-string, or, for an "
        "article's figure, a threshold or a fixed setting, add it to [typed_numbers_allowed] with its reason in the "
        "notebook's metadata block (notebooks/meta/NN_name.toml)"
    )


def test_the_typed_number_scan_sees_literal_text_and_typed_values_and_not_formatted_values(tmp_path, monkeypatch):
    twin = tmp_path / "99_scan.py"
    twin.write_text('claims.check("Z1", verdict="holds", note=f"grew {growth:>6.0f}x in 12 steps, " + "lost 3.5%",\n'
                    '             measured={f"loss at batch {batch}": loss, "growth at 8 steps": growth, "lead": 71,\n'
                    '                       "spread": round(spread, 3)}, rule="lead above 200 steps")\n')
    monkeypatch.setattr(sys.modules[__name__], "TWINS", [twin])
    assert sorted(typed_numbers_in_evidence()) == sorted(
        [("Z1", "12"), ("Z1", "3.5%"), ("Z1", "8"), ("Z1", "71"), ("Z1", "200")])


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
