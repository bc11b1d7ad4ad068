"""labkit.claims: the catalogue, the verdict record, and reading verdicts back from notebooks."""

import json
import subprocess
import sys

import pytest
import torch
from kernel_facts import CLAIM

from labkit import LabkitError, claims, claims_report


@pytest.fixture(autouse=True)
def fresh_session():
    claims.reset()
    yield
    claims.reset()


def test_catalogue_has_every_family_and_unique_ids():
    ids = list(claims.catalogue())
    assert len(ids) == len(set(ids)) >= 80
    assert {c.family for c in claims.catalogue().values()} == set(claims.families())
    assert all(c.claim and c.question for c in claims.catalogue().values())


def test_unknown_id_is_an_error_that_suggests_close_ids():
    with pytest.raises(LabkitError, match=r"unknown case ID 'A11'.*Did you mean"):
        claims.check("A11", verdict="holds", measured={"x": 1.0})


@pytest.mark.parametrize("verdict, measured, note, message", [
    ("true", {"x": 1.0}, "", "unknown verdict"),
    ("untestable", None, "   ", "needs evidence"),
    ("does-not-hold", None, "it looked fine", "pass the numbers as measured="),
    ("partly", None, "3 of 4 looked fine", "pass the numbers as measured="),
    ("holds", {}, "", "dict of label -> value"),
    ("holds", {"": 1.0}, "", "needs a label"),
    ("holds", {"norms": object()}, "", "the value of 'norms' is a object"),
])
def test_bad_verdicts_are_rejected(verdict, measured, note, message):
    with pytest.raises(LabkitError, match=message):
        claims.check("Z1", verdict=verdict, measured=measured, note=note)


def test_a_measured_yes_or_no_is_evidence_and_a_claimed_one_is_not(capsys):
    claims.check("Z1", verdict="does-not-hold", measured={"modules switched to train mode": True})
    assert "Z1 does-not-hold: modules switched to train mode: yes." in capsys.readouterr().out
    claims_report.validate("Z1", "holds", "switched: yes", {"switched": True})
    with pytest.raises(LabkitError, match="measured numbers"):
        claims_report.validate("Z1", "holds", "switched: yes")


def test_needs_gpu_takes_a_reason_without_numbers(capsys):
    claims.check("A2", verdict="needs-gpu", note="times CUDA kernels; this machine has no CUDA device")
    assert "A2 needs-gpu: Times CUDA kernels; this machine has no CUDA device." in capsys.readouterr().out


def test_rechecking_an_id_replaces_its_verdict_and_table_lists_it(capsys):
    claims.check("Z1", verdict="partly", measured={"cases": "3 of 4"})
    claims.check("Z1", verdict="holds", measured={"cases": "4 of 4"})
    assert [v.verdict for v in claims.recorded()] == ["holds"]
    claims.table()
    text = capsys.readouterr().out
    assert "Z1" in text and "HOLDS" in text and "cases: 4 of 4" in text
    assert claims.format_table([]) == "No claims checked yet."


@pytest.mark.parametrize("evidence, sentence", [
    ("allclose True, deferred: False", "Allclose yes, deferred: no."),
    ("with set_to_none=True the step moved (True)", "With set_to_none=True the step moved (yes)."),
    ("`x.requires_grad` is `False`. It stays", "`x.requires_grad` is `False`. It stays."),
    ("TrueNorm of 3", "TrueNorm of 3."),
    ("with head._compiled = False torch.compile", "With head._compiled = False torch.compile."),
    ("the flag decoupled_weight_decay (default False) gives", "The flag decoupled_weight_decay (default False) gives."),
    ("0 (set_to_none=False) instead of 5", "0 (set_to_none=False) instead of 5."),
])
def test_evidence_reads_as_a_sentence(evidence, sentence):
    assert claims.readable(evidence) == sentence


def test_the_table_is_one_line_per_case_however_long_the_evidence():
    long = "the step moved 3 of 4 weights " + "and then a great deal more happened " * 10
    claims.check("Z1", verdict="holds", measured={long: 3})
    claims.check("B1", verdict="does-not-hold", measured={"steps that carried a gradient": 0, "detail": 1.5})
    claims.check("B3", verdict="untestable", note="needs the article's OCR data; measured 3 steps here")
    lines = claims.format_table(width=100).splitlines()
    assert len(lines) == 3 and all(len(line) <= 100 for line in lines)
    assert lines[0].startswith("Z1") and lines[0].endswith("…")
    assert lines[1] == "B1    ✗ DOES-NOT-HOLD steps that carried a gradient: 0"
    assert lines[2] == "B3    ? UNTESTABLE    Needs the article's OCR data"


def test_measured_values_render_one_sentence_one_table_and_one_json_record(capsys):
    claims.check("Z1", verdict="holds", rule="max |diff| is 0 and the growth above 10x", note="the article quotes 73x",
                 measured={"max |diff|": torch.tensor(0.0), "norm growth (x)": 37.46, "exact": True,
                           "params": 4702208, "tiny": 1.234e-7, "loss by batch": {"8": 0.51, "512": 2.0},
                           "spread": [1.5, float("nan")], "change": "+0.012", "img/s": [1240.5, 13202]})
    text = capsys.readouterr().out
    [record] = claims.recorded()
    assert record.measured == {"max |diff|": 0.0, "norm growth (x)": 37.5, "exact": True, "params": 4702208,
                               "tiny": 1.2e-7, "loss by batch": {"8": 0.51, "512": 2.0}, "spread": [1.5, "nan"],
                               "change": "+0.012", "img/s": [1240.0, 13202]}  # floats as the evidence shows them
    assert record.evidence == ("max |diff|: 0; norm growth (x): 37.5; exact: yes; params: 4,702,208; tiny: 1.2e-07; "
                               "loss by batch: 8 0.51, 512 2; spread: 1.5, nan; change: +0.012; img/s: 1240, 13202. "
                               "The article quotes "
                               "73x. Verdict rule: max |diff| is 0 and the growth above 10x")
    assert " ".join(text.split()).startswith("✓ Z1 holds: max |diff|: 0; norm growth (x): 37.5; exact: yes")
    assert claims.format_table() == "Z1    ✓ HOLDS         max |diff|: 0"
    html = claims._verdict_html(record)
    assert "<td>norm growth (x)</td><td>37.5</td>" in html and "Verdict rule: max |diff| is 0" in html
    json.dumps(record.measured, allow_nan=False)


def test_metric_names_must_be_identifiers():
    with pytest.raises(LabkitError, match="identifier"):
        claims.metric("eval acc", 0.5)


# The notebook that records a verdict and a metric is run once per session, with the other facts that
# need a kernel (tests/kernel_facts.py); these tests read copies of it.


def test_verdicts_are_read_back_from_stored_outputs_without_execution(kernel_facts, tmp_path):
    assert kernel_facts.result.metrics == {"grad_norm": 1.5}
    notebook = kernel_facts.copy_to(tmp_path)
    stored = kernel_facts.cell(CLAIM).outputs[0]["data"]
    assert "<td>max |diff|</td><td>0</td>" in "".join(stored["text/html"]) and "holds" in "".join(stored["text/plain"])
    records = claims_report.collect([notebook])
    assert [(r["id"], r["verdict"], r["notebook"]) for r in records] == [("Z1", "holds", "01_fixture")]
    cli = subprocess.run([sys.executable, "-m", "labkit", "claims", "--json", str(notebook)],
                         capture_output=True, text=True, check=True)
    assert json.loads(cli.stdout) == [
        {"id": "Z1", "notebook": "01_fixture", "verdict": "holds", "evidence": "max |diff|: 0; values compared: 8",
         "measured": {"max |diff|": 0.0, "values compared": 8}}
    ]


def test_cli_rejects_a_stored_notebook_with_a_bad_id(kernel_facts, tmp_path):
    notebook = kernel_facts.copy_to(tmp_path)
    notebook.write_text(notebook.read_text().replace('"Z1"', '"Q9"'))
    cli = subprocess.run([sys.executable, "-m", "labkit", "claims", "--json", str(notebook)],
                         capture_output=True, text=True)
    assert cli.returncode == 2
    assert "unknown case ID 'Q9'" in cli.stderr and "01_fixture.ipynb" in cli.stderr


def test_device_dependent_verdicts_are_named_but_not_shown_in_the_table():
    claims.check("Z1", verdict="holds", measured={"agreed": "2 of 2"})
    claims.check("A2", verdict="needs-gpu", note="times CUDA kernels; no CUDA device here")
    claims.check("B1", verdict="partly", measured={"agreed on this device": "1 of 2"}, device_dependent=True)
    text = claims.format_table()
    assert "HOLDS" in text and "NEEDS-GPU" not in text and "PARTLY" not in text
    assert text.endswith("A2, B1")
    assert [v.device_dependent for v in claims.recorded()] == [False, True, True]
