"""`stored_run` reads back only what nbval proves fresh: the claims and metrics of the cells it compares.

nbval, in the same `make test`, re-executes every notebook and compares its stored outputs, except in a
cell tagged `nbval-ignore-output` (a timing, a machine-dependent or GPU-only result) or `nbval-skip`, or
marked so by a `# NBVAL_...` comment, or never run. A stale value there would pass unnoticed, so
`stored_run` leaves it out and a test that reads it fails, saying to run it fresh. No kernel here: the
notebooks are built with nbformat, their outputs faked under labkit's record mimetypes."""

from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output
from notebook_runs import NOT_COMPARED, nbval_compares, stored_run

from labkit.records import CLAIM_MIME, METRIC_MIME

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PARAMETERS = "seed: int = 0  # seed of every random stream, at least 0\nbug: bool = True  # True runs the planted bug"


def claim_output(case: str, verdict: str) -> nbformat.NotebookNode:
    payload = {"id": case, "verdict": verdict, "evidence": f"{case}'s evidence", "claim": f"Claimed: {case}.",
               "notebook": ""}
    return new_output("display_data", data={CLAIM_MIME: payload, "text/plain": f"{case} {verdict}"})


def metric_output(name: str, value) -> nbformat.NotebookNode:
    return new_output("display_data", data={METRIC_MIME: {"name": name, "value": value},
                                            "text/plain": f"metric {name} = {value}"})


def executed_cell(source: str, outputs: list, tags: list[str] | None = None, count: int | None = 1):
    cell = new_code_cell(source, outputs=outputs, execution_count=count)
    if tags is not None:
        cell.metadata["tags"] = tags
    return cell


def write_notebook(folder: Path, *cells) -> Path:
    """An executed notebook: its tagged parameters cell, then `cells`."""
    notebook = new_notebook(cells=[executed_cell(PARAMETERS, [], tags=["parameters"]), *cells])
    path = folder / "99_synthetic.ipynb"
    nbformat.write(notebook, path)
    return path


def test_a_cell_nbval_ignores_gives_the_stored_run_no_claim_or_metric(tmp_path):
    notebook = write_notebook(
        tmp_path,
        executed_cell("claims.check('Z1', ...)\nclaims.metric('compared', 3)",
                      [claim_output("Z1", "holds"), metric_output("compared", 3)]),
        executed_cell("claims.check('Z2', ...)\nclaims.metric('timed', 0.25)",
                      [claim_output("Z2", "partly"), metric_output("timed", 0.25)], tags=["nbval-ignore-output"]),
    )
    result = stored_run(notebook)
    assert result.status == "ok" and result.parameters == {"seed": 0, "bug": True}
    assert [claim["id"] for claim in result.claims] == ["Z1"]
    assert result.claims[0] == {"id": "Z1", "verdict": "holds", "evidence": "Z1's evidence", "measured": {}}
    assert dict(result.metrics) == {"compared": 3}
    # the left-out records fail loudly, saying why, whichever way a test reads them
    with pytest.raises(KeyError, match=f"'timed'.*{NOT_COMPARED}.*tagged nbval-ignore-output"):
        result.metrics["timed"]
    with pytest.raises(KeyError, match=NOT_COMPARED):
        result.metrics.get("timed", 0.0)
    assert "Z2" in result.claims.not_compared and NOT_COMPARED in result.claims.not_compared["Z2"]
    with pytest.raises(KeyError):
        {claim["id"]: claim["verdict"] for claim in result.claims}["Z2"]  # noqa: B018
    # a name no cell recorded stays an ordinary miss
    assert result.metrics.get("absent", "default") == "default"
    with pytest.raises(KeyError, match="absent"):
        result.metrics["absent"]


# (tags, source's first line, execution count, compared?)
CELLS = {
    "untagged": ([], "", 1, True),
    "nbval-ignore-output": (["nbval-ignore-output"], "", 1, False),
    "nbval-skip": (["nbval-skip"], "", 1, False),
    "comment NBVAL_IGNORE_OUTPUT": ([], "# NBVAL_IGNORE_OUTPUT", 1, False),
    "comment NBVAL_SKIP": ([], "#NBVAL_SKIP", 1, False),
    "never run": ([], "", None, False),
    # raises-exception lets the cell raise; nbval still compares its outputs
    "raises-exception": (["raises-exception"], "", 1, True),
    "nbval-raises-exception": (["nbval-raises-exception"], "", 1, True),
    "other tags": (["hide-input", "parameters-explained"], "", 1, True),
    # a comment wins over a tag, the later of two tags over the earlier
    "comment NBVAL_CHECK_OUTPUT over the ignore tag": (["nbval-ignore-output"], "# NBVAL_CHECK_OUTPUT", 1, True),
    "check tag after the ignore tag": (["nbval-ignore-output", "nbval-check-output"], "", 1, True),
    "ignore tag after the check tag": (["nbval-check-output", "nbval-ignore-output"], "", 1, False),
}


@pytest.mark.parametrize("case", list(CELLS))
def test_the_stored_run_keeps_a_record_exactly_when_nbval_compares_its_cell(tmp_path, case):
    tags, first_line, count, compared = CELLS[case]
    source = f"{first_line}\nclaims.metric('value', 1)".lstrip()
    cell = executed_cell(source, [metric_output("value", 1)] if count else [], tags=tags, count=count)
    assert nbval_compares(cell) is compared
    if count is None:
        return  # an unrun cell holds no output to read back (nbval fails one that does)
    metrics = stored_run(write_notebook(tmp_path, cell)).metrics
    assert ("value" in metrics) is compared


@pytest.mark.filterwarnings("ignore:Conflicting metadata tags found")  # nbval's, for the two-tag cases
@pytest.mark.parametrize("case", list(CELLS))
def test_nbval_compares_agrees_with_nbval_s_own_reading_of_the_cell(case):
    """The options nbval's collector gives a cell, under `--nbval` (compare unless told otherwise)."""
    plugin = pytest.importorskip("nbval.plugin")
    tags, first_line, count, compared = CELLS[case]
    cell = executed_cell(f"{first_line}\nx = 1".lstrip(), [], tags=tags, count=count)
    options = dict(plugin.find_metadata_tags(cell.metadata))
    options.update(dict(plugin.find_comment_markers(cell.source)))
    options.setdefault("check", True)
    by_nbval = not options.get("skip", False) and options["check"] and cell.execution_count is not None
    assert nbval_compares(cell) is by_nbval is compared


# The workbook's own records that nbval does not compare (cells tagged nbval-ignore-output).
IGNORED = [
    ("08_gradient_health", "claim", "L1"),
    ("08_gradient_health", "metric", "l1_lead"),
    ("08_gradient_health", "metric", "first_exploding_alert"),
    ("08_gradient_health", "metric", "ratio_signal_lead"),
    ("08_gradient_health", "metric", "plateau_signal_lead"),
    ("08_gradient_health", "metric", "twin_ratio_signal_step"),
    ("10_mixed_precision", "metric", "fp16_lost_weight_grad_pct"),
    ("10_mixed_precision", "metric", "scaled_lost_weight_grad_pct"),
    ("13_memory", "metric", "held_bytes_per_step"),
    ("16_speed_and_memory", "claim", "K6"),
    ("01_computation_graph", "claim", "A2"),
    ("01_computation_graph", "claim", "A4"),
    ("02_gradients_accumulate", "claim", "B5"),
    ("04_autograd_modes", "claim", "N5"),
]


@pytest.mark.parametrize(("stem", "kind", "name"), IGNORED)
def test_the_workbook_s_stored_runs_leave_out_what_nbval_ignores(stem, kind, name):
    result = stored_run(NOTEBOOKS / f"{stem}.ipynb")
    if kind == "claim":
        assert name not in {claim["id"] for claim in result.claims}
        assert NOT_COMPARED in result.claims.not_compared[name]
    else:
        with pytest.raises(KeyError, match=NOT_COMPARED):
            result.metrics[name]


def test_the_stored_run_keeps_what_nbval_compares():
    # 08's L2 and L3 verdicts sit in compared cells
    verdicts = {claim["id"]: claim["verdict"] for claim in stored_run(NOTEBOOKS / "08_gradient_health.ipynb").claims}
    assert verdicts["L2"] == "holds" and verdicts["L3"] == "does-not-hold"
