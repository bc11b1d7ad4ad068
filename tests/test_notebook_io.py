"""labkit.notebooks and labkit.records (notebook files: reading, records, normalising, the jupytext pair, the fingerprint
stamp), the `normalise` command, and labkit.messages."""

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch

from labkit import LabkitError, notebooks, probes, records
from labkit.messages import describe_error, first_line

ROOT = Path(__file__).resolve().parents[1]
WIDGET = notebooks.WIDGET_VIEW_MIME


def widget_notebook(*model_ids: str):
    nb = nbformat.v4.new_notebook()
    for model_id in model_ids:
        cell = nbformat.v4.new_code_cell("slider")
        cell.outputs = [nbformat.v4.new_output("display_data", data={
            WIDGET: {"model_id": model_id, "version_major": 2, "version_minor": 0}, "text/plain": "IntSlider(value=1)"})]
        nb.cells.append(cell)
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    return nb


def model_ids(nb) -> list[str]:
    return [o["data"][WIDGET]["model_id"] for c in nb.cells for o in c.get("outputs", []) if WIDGET in o.get("data", {})]


def test_widget_model_ids_become_deterministic_and_stay_distinct():
    first, rerun = widget_notebook("c9fa14ab", "87082e36"), widget_notebook("33b9c318", "0d1e2f3a")
    notebooks.normalise(first)
    notebooks.normalise(rerun)
    assert model_ids(first) == model_ids(rerun)
    assert len(set(model_ids(first))) == 2 and all(len(i) == 32 for i in model_ids(first))
    assert "widgets" not in first.metadata  # the widget state is dropped with the rest of the notebook metadata
    assert first.cells[0].outputs[0]["data"]["text/plain"] == "IntSlider(value=1)"


def test_normalise_command_rewrites_only_what_needs_it_and_exits_1_then_0(tmp_path):
    path = tmp_path / "w.ipynb"
    nbformat.write(widget_notebook("c9fa14ab"), path)
    command = [sys.executable, "-m", "labkit", "normalise", str(path)]
    changed = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert changed.returncode == 1 and f"{path}: normalised" in changed.stdout, changed.stderr
    again = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 0 and again.stdout == "", again.stderr
    assert model_ids(nbformat.read(path, as_version=4)) == model_ids(_normalised(widget_notebook("x")))


def _normalised(nb):
    notebooks.normalise(nb)
    return nb


def test_normalise_file_names_a_file_it_cannot_read(tmp_path):
    (tmp_path / "broken.ipynb").write_text("{not json")
    with pytest.raises(LabkitError, match="cannot read notebook .*broken.ipynb"):
        notebooks.normalise_file(tmp_path / "broken.ipynb")


def test_the_kept_cell_metadata_comes_from_jupytext_toml():
    config = (ROOT / "jupytext.toml").read_text()
    assert f'cell_metadata_filter = "{notebooks.jupytext_filters()["cell_metadata_filter"]}"' in config
    assert notebooks.kept_cell_metadata() == ("tags", "nbgrader", "jupyter")


def test_the_pairing_config_is_the_checkout_s_found_from_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT / "notebooks" / "py")
    assert notebooks.jupytext_config_file() == ROOT / "jupytext.toml"
    monkeypatch.chdir(tmp_path)  # no checkout here: what an installed labkit sees outside one
    nbformat.write(widget_notebook("a"), tmp_path / "00_x.ipynb")
    with pytest.raises(LabkitError, match=rf"no jupytext.toml in {tmp_path} or any folder above it: .*runs in a "
                                          r"checkout of the workbook; run it from the checkout"):
        notebooks.normalise_file(tmp_path / "00_x.ipynb")


def test_stored_records_reads_one_mimetype_and_names_the_notebook(tmp_path):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [nbformat.v4.new_output("display_data", data={"application/x-a+json": {"v": 1}, "text/plain": "a"}),
                    nbformat.v4.new_output("display_data", data={"application/x-b+json": {"v": 2}, "text/plain": "b"})]
    nb.cells.append(cell)
    nbformat.write(nb, tmp_path / "07_x.ipynb")
    assert records.stored_records(tmp_path / "07_x.ipynb", "application/x-a+json") == [{"v": 1, "notebook": "07_x"}]
    with pytest.raises(LabkitError, match="cannot read notebook"):
        records.read_notebook_json(tmp_path / "missing.ipynb")


def test_show_record_prints_outside_ipython(capsys):
    records.show_record("the text", "application/x-a+json", {"v": 1})
    assert capsys.readouterr().out == "the text\n"


def test_show_record_appends_to_the_records_log_when_one_is_named(tmp_path, monkeypatch, capsys):
    import json
    log = tmp_path / "records.jsonl"
    monkeypatch.setenv("LABKIT_RECORDS_LOG", str(log))
    records.show_record("one", "application/x-a+json", {"v": 1})
    records.show_record("two", "application/x-b+json", {"v": 2})
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines == [{"mime": "application/x-a+json", "v": 1}, {"mime": "application/x-b+json", "v": 2}]
    monkeypatch.setenv("LABKIT_RECORDS_LOG", str(tmp_path / "no-such-folder" / "log"))
    with pytest.raises(LabkitError, match="cannot append to LABKIT_RECORDS_LOG=.*writable file or unset it"):
        records.show_record("three", "application/x-a+json", {"v": 3})


def test_notebook_selection_by_stem_or_prefix(tmp_path):
    for name in ("00_a", "01_b", "10_c"):
        nbformat.write(nbformat.v4.new_notebook(), tmp_path / f"{name}.ipynb")
    (tmp_path / "scratch.ipynb").write_text("{}")
    assert [p.stem for p in notebooks.workbook_notebooks(tmp_path)] == ["00_a", "01_b", "10_c"]
    assert [p.stem for p in notebooks.select_notebooks(["0"], tmp_path)] == ["00_a", "01_b"]
    with pytest.raises(LabkitError, match="no notebook matches 2; have 00_a, 01_b, 10_c"):
        notebooks.select_notebooks(["2"], tmp_path)


def test_first_line_cuts_with_a_marker_and_describe_error_names_the_type():
    assert first_line("  short\nsecond", 10) == "short"
    assert first_line("x" * 12, 10) == "x" * 9 + "…"
    assert first_line("", 10) == ""
    assert describe_error(ValueError("boom\ndetail"), 160) == "ValueError: boom"
    assert describe_error(KeyboardInterrupt(), 160) == "KeyboardInterrupt"


def test_describe_error_says_what_a_dataloader_worker_raised_not_that_it_caught_something():
    from torch._utils import ExceptionWrapper

    try:
        raise PermissionError("the worker's own words\nand more")
    except PermissionError:
        wrapper = ExceptionWrapper(sys.exc_info(), where="in DataLoader worker process 0")
    with pytest.raises(PermissionError) as raised:
        wrapper.reraise()
    assert describe_error(raised.value, 160) == "PermissionError: in DataLoader worker process 0: the worker's own words"


def test_stamp_notebook_in_memory_keeps_other_metadata_and_copies_the_fingerprint():
    nbformat = pytest.importorskip("nbformat")  # the GPU image may lack it; the GPU tests here must still run
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    fp = probes.fingerprint()
    stamped = notebooks.stamp_notebook(notebook, fp)
    assert stamped is notebook
    assert notebook.metadata["labkit"]["fingerprint"] == fp
    assert notebook.metadata["kernelspec"]["name"] == "python3"
    fp["torch"] = "edited later"
    assert notebook.metadata["labkit"]["fingerprint"]["torch"] == torch.__version__


def test_stamp_notebook_on_disk_writes_a_valid_notebook(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    path = tmp_path / "run.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")]), path)
    notebooks.stamp_notebook(path)
    reread = nbformat.read(path, as_version=4)
    nbformat.validate(reread)
    assert reread.metadata["labkit"]["fingerprint"]["torch"] == torch.__version__
    assert reread.cells[0].source == "1 + 1"


def test_stamp_notebook_rejects_what_is_not_a_notebook_or_not_json(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    with pytest.raises(LabkitError, match="notebook path"):
        notebooks.stamp_notebook(42)
    with pytest.raises(LabkitError, match="no notebook at"):
        notebooks.stamp_notebook(tmp_path / "missing.ipynb")
    with pytest.raises(LabkitError, match="plain JSON"):
        notebooks.stamp_notebook(nbformat.v4.new_notebook(), {"when": object()})
