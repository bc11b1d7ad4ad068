"""`labkit progress` re-runs a learner's answers through the checks: stored outputs, faked check cells and
copies of the solution notebook count for nothing, a deleted or renumbered exercise cell is named with the fix,
and deleted check or text cells do not stop an answer from being graded; nothing is ever written.

Nothing here starts a kernel: the answers of 00_start_here run in-process, as the progress command runs them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest

from labkit import grading, student
from labkit.__main__ import main as labkit_main
from labkit.course import exercise_progress
from labkit.errors import LabkitError

ROOT = Path(__file__).resolve().parents[1]
NAME = "00_start_here.ipynb"


@pytest.fixture
def learner(tmp_path) -> Path:
    """A learner's folder holding the student edition of 00, untouched."""
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(ROOT / "notebooks" / NAME, source)
    student.write_student_edition(source, tmp_path / "learner")
    return tmp_path / "learner"


def edit(folder: Path, change) -> None:
    nb = nbformat.read(folder / NAME, 4)
    change(nb)
    nbformat.write(nb, folder / NAME)


def answered(exercise_id: str):
    """The solution of ``exercise_id`` as a learner would type it: the markers gone."""
    solution = student.find_exercises(nbformat.read(ROOT / "notebooks" / NAME, 4), NAME)[exercise_id].solution
    text = "\n".join(line for line in solution.split("\n")
                     if line.strip() not in (student.BEGIN_SOLUTION, student.END_SOLUTION))

    def change(nb):
        (cell,) = [cell for cell in nb.cells if student.exercise_id_of(cell) == exercise_id]
        cell.source = text
    return change


def statuses(folder: Path) -> dict[str, str]:
    report = exercise_progress.recheck_folder(folder)
    assert report.method == exercise_progress.RECHECKED
    return {row.exercise: row.status for row in report.rows if row.exercise.startswith("00.")}


def test_an_untouched_edition_is_not_yet_and_an_answer_passes(learner):
    not_yet = exercise_progress.NOT_YET
    assert statuses(learner) == {"00.1": not_yet, "00.2": not_yet, "00.lab": not_yet}
    edit(learner, answered("00.1"))
    assert statuses(learner) == {"00.1": exercise_progress.PASSED, "00.2": not_yet, "00.lab": not_yet}


def lab_answer_for(key: str):
    """Lab 00's answer cell, right for the variant ``key`` draws: the diagnosis and the untouched stage."""
    from labkit.labs._draw import draw
    from labkit.labs._registry import lab_of

    lab = lab_of("00")
    variant = lab.variants[draw("00", key, len(lab.variants))[0]]
    (stage,) = variant.defect
    repair = {"loss_of": "def loss_of(prediction, target):\n    return F.mse_loss(prediction, target)\n",
              "update": "def update(model, optimizer, loss):\n    optimizer.zero_grad()\n    loss.backward()\n"
                        "    optimizer.step()\n",
              "make_batches": "def make_batches(x, y, batch_size, generator):\n"
                              "    order = torch.randperm(len(x), generator=generator)\n"
                              "    return [(x[order[i:i + batch_size]], y[order[i:i + batch_size]]) "
                              "for i in range(0, len(x), batch_size)]\n"}[stage]
    source = f"# lab 00: your answer\n{repair}\ndef diagnose(lab):\n    return {variant.cause!r}, {stage}\n"

    def change(nb):
        (cell,) = [cell for cell in nb.cells if cell.source.startswith("# lab 00: your answer")]
        cell.source = source
    return change, variant.id


def test_a_lab_answer_is_rechecked_for_the_folder_s_learner(learner, monkeypatch, tmp_path):
    from labkit.labs._draw import learner_key

    monkeypatch.setenv("LABKIT_LEARNER", "lab-tester")
    change, variant = lab_answer_for(learner_key(learner="lab-tester"))
    edit(learner, change)
    assert statuses(learner)["00.lab"] == exercise_progress.PASSED
    # the same notebook handed in to nbgrader by a learner whose variant is another is graded for them
    other = next(name for name in (f"learner{n}" for n in range(50))
                 if lab_answer_for(learner_key(learner=name))[1] != variant)
    submitted = tmp_path / "submitted" / other / "ps1"
    shutil.copytree(learner, submitted)
    row = next(row for row in exercise_progress.recheck_folder(submitted).rows if row.exercise == "00.lab")
    assert row.status == exercise_progress.NOT_YET and "does not fit your run" in row.message


def test_a_faked_check_cell_and_stored_pass_count_for_nothing(learner):
    def fake(nb):
        payload = {"exercise": "00.2", "notebook": "00_start_here", "passed": True, "message": "✓ Exercise 00.2 passed"}
        for cell in nb.cells:
            if 'grading.check("00.2"' in cell.source:
                cell.source = "print('passed')"
                cell.outputs = [nbformat.v4.new_output("display_data", data={grading.GRADE_MIMETYPE: payload})]
    edit(learner, fake)
    assert statuses(learner)["00.2"] == exercise_progress.NOT_YET
    stored = {row.exercise: row.status for row in exercise_progress.stored_report(learner).rows}
    assert stored["00.2"] == exercise_progress.PASSED  # what --stored would have believed


def test_a_copy_of_the_solution_notebook_is_skipped_and_named(learner, capsys):
    shutil.copy(ROOT / "notebooks" / NAME, learner / "00_start_here-Copy1.ipynb")
    report = exercise_progress.recheck_folder(learner)
    assert report.skipped == ["00_start_here-Copy1.ipynb"]
    assert {row.exercise: row.status for row in report.rows}["00.1"] == exercise_progress.NOT_YET
    assert labkit_main(["progress", str(learner)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Re-ran every answer in {learner} through its check (stored outputs ignored).")
    assert "Skipped as copies of solution notebooks: 00_start_here-Copy1.ipynb" in out


def test_the_stored_verdicts_are_totalled_against_the_folder_s_own_notebooks(learner):
    # PG30: a 2-notebook assignment was totalled against all the workbook's exercises (0/35 ... 33 not run);
    # the re-check's count is tests/reliability/test_grading_isolation.py's
    stored = exercise_progress.stored_report(learner).rows
    assert [row.exercise for row in stored] == ["00.1", "00.2", "00.lab"]
    assert exercise_progress.progress_table(stored).splitlines()[-1] == \
        "Total: 0/3 exercises passed (0 not yet, 3 not run)"


def test_a_deleted_exercise_cell_is_named_with_the_fix(learner, capsys):
    edit(learner, lambda nb: nb.cells.remove(next(c for c in nb.cells if student.exercise_id_of(c) == "00.2")))
    row = next(row for row in exercise_progress.recheck_folder(learner).rows if row.exercise == "00.2")
    assert row.status == exercise_progress.MISSING
    assert "00_start_here.ipynb has no cell starting '# exercise 00.2' (deleted?)" in row.message
    assert labkit_main(["progress", str(learner), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["method"], report["total"]["missing"]) == (exercise_progress.RECHECKED, 1)


def test_an_answer_cell_that_never_finishes_is_stopped(learner, monkeypatch):
    monkeypatch.setattr(grading, "CHECK_TIME_LIMIT_S", 0.5)
    edit(learner, answered("00.1"))
    edit(learner, lambda nb: setattr(next(c for c in nb.cells if student.exercise_id_of(c) == "00.1"), "source",
                                     "# exercise 00.1\nwhile True:\n    pass\n"))
    row = next(row for row in exercise_progress.recheck_folder(learner).rows if row.exercise == "00.1")
    assert row.status == exercise_progress.NOT_YET
    assert "the exercise cell did not finish within" in row.message  # 0.5 s of CPU, or 3 s of waiting on a busy machine


def test_stored_mode_says_it_can_be_faked(learner, capsys):
    assert labkit_main(["progress", str(learner), "--stored"]) == 0
    assert "they are not re-checked and can be faked" in capsys.readouterr().out


def test_a_missing_source_folder_is_a_clear_error(learner, tmp_path):
    with pytest.raises(LabkitError, match="no solution notebooks in .*pass --source"):
        exercise_progress.recheck_folder(learner, tmp_path / "nowhere")


def test_the_default_solutions_are_the_current_checkout_s_not_labkit_s_folder(learner, monkeypatch):
    """An installed labkit has no notebooks beside it: the default is the checkout the command runs in."""
    assert exercise_progress.DEFAULT_SOURCE == Path("notebooks")
    monkeypatch.chdir(learner)  # a folder that is no checkout: no notebooks/ in it
    with pytest.raises(LabkitError, match=r"no solution notebooks in notebooks: .*a checkout holds .*run from the checkout"):
        exercise_progress.recheck_folder(learner)


def test_deleted_check_and_text_cells_still_leave_the_answer_graded_and_the_file_untouched(learner):
    edit(learner, answered("00.1"))

    def delete(nb):
        nb.cells = [cell for cell in nb.cells if cell.cell_type == "code" and 'grading.check(' not in cell.source]
    edit(learner, delete)
    before = (learner / NAME).read_bytes()
    assert statuses(learner) == {"00.1": exercise_progress.PASSED, "00.2": exercise_progress.NOT_YET,
                                 "00.lab": exercise_progress.NOT_YET}
    assert (learner / NAME).read_bytes() == before, "labkit progress wrote into the learner's notebook"


def test_an_exercise_renumbered_by_the_learner_is_named_and_nothing_is_written(learner):
    def renumber(nb):
        cell = next(c for c in nb.cells if student.exercise_id_of(c) == "00.2")
        cell.source = cell.source.replace("# exercise 00.2", "# exercise 00.9", 1)
    edit(learner, renumber)
    before = (learner / NAME).read_bytes()
    row = next(row for row in exercise_progress.recheck_folder(learner).rows if row.exercise == "00.2")
    assert row.status == exercise_progress.MISSING
    assert "it has a cell for exercise 00.9, which is not one of 00_start_here's exercises" in row.message
    assert "put back '# exercise 00.2'" in row.message
    assert (learner / NAME).read_bytes() == before


# --- passes to review: what a passing cell uses that no lesson calls for (labkit.course._answer_review) ---

READS_ITS_STACK = "import sys\nCALLER = sys._getframe()\n"


def test_a_pass_whose_cell_reads_the_call_stack_stays_a_pass_marked_to_review(learner, capsys):
    edit(learner, answered("00.1"))

    def read_the_stack(nb):
        (cell,) = [cell for cell in nb.cells if student.exercise_id_of(cell) == "00.1"]
        cell.source += "\n" + READS_ITS_STACK
    edit(learner, read_the_stack)
    (row,) = [row for row in exercise_progress.recheck_folder(learner).rows if row.exercise == "00.1"]
    assert (row.status, row.review) == (exercise_progress.PASSED,
                                        ("the call stack or the garbage collector's objects (sys._getframe)",))
    assert labkit_main(["progress", str(learner)]) == 0
    out = capsys.readouterr().out
    assert "passed, to review" in out and "Total: 1/3 exercises passed" in out
    assert "  00.1 (00_start_here): the call stack or the garbage collector's objects (sys._getframe)" in out
    assert labkit_main(["progress", str(learner), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["total"]["passed"], report["total"]["to_review"]) == (1, 1)
    # a learner's second copy that passes without it wins, and there is nothing to review
    shutil.copy(learner / NAME, learner / "00_start_here-mine.ipynb")
    edit(learner, answered("00.1"))
    (row,) = [row for row in exercise_progress.recheck_folder(learner).rows if row.exercise == "00.1"]
    assert (row.status, row.review) == (exercise_progress.PASSED, ())


@pytest.mark.parametrize(("cell", "means"), [
    ("import inspect as look\ndef f():\n    return look.stack()\n", "the call stack or the garbage collector's objects (inspect.stack)"),
    ("import gc\nfound = gc.get_referrers(1)\n", "the call stack or the garbage collector's objects (gc.get_referrers)"),
    ("def f(error):\n    return error.__traceback__.tb_frame\n", "the call stack or the garbage collector's objects (error.__traceback__.tb_frame)"),
    ("from os import write\nwrite(5, b'x')\n", "raw file descriptors (os.write)"),
    ("with open('/proc/self/clear_refs', 'w') as counts:\n    counts.write('5')\n",
     "the kernel's files of a process ('/proc/self/clear_refs')"),
    ("def diagnose(lab):\n    return lab._variant\n", "private names (lab._variant)"),
    ("from labkit.labs import _lab00\n", "private names (labkit.labs._lab00)"),
    ("import inspect, labkit.labs\ntext = inspect.getsource(labkit.labs)\n", "a function's code or source (inspect.getsource)"),
    ("def f(g):\n    return g.__code__\n", "a function's code or source (g.__code__)"),
    ("from torch import Tensor\nTensor.abs = lambda self: self\n", "a change to a module or to the environment (Tensor.abs)"),
    ("import os\nos.environ['NBGRADER_EXECUTION'] = ''\n", "a change to a module or to the environment (os.environ['NBGRADER_EXECUTION'])"),
    ("import os\nos.environ.pop('NBGRADER_EXECUTION', None)\n", "a change to a module or to the environment (os.environ.pop)"),
    ("setattr(torch, 'allclose', print)\n", "a change to a module or to the environment (setattr(torch, 'allclose', print))"),
    ("def diagnose(lab):\n    return getattr(lab, '_variant')\n", "private names (getattr(lab, '_variant'))"),
    ("HIDDEN = '_variant'\ndef diagnose(lab):\n    return getattr(lab, HIDDEN)\n", "private names ('_variant')"),
    ("writer = __import__('o' + 's')\n", "names made at run time (__import__)"),
    ("def diagnose(lab):\n    return vars(lab)\n", "names made at run time (vars)"),
    ("def diagnose(lab):\n    return lab.__dict__\n", "names made at run time (lab.__dict__)"),
])
def test_each_means_no_lesson_calls_for_is_named_with_its_first_use(cell, means):
    from labkit.course._answer_review import reaches

    assert reaches(cell) == (means,)


def test_a_chain_of_attributes_too_deep_to_read_is_marked_not_a_crash():
    # 1,500 chained attributes compile and run; reading them recursively passed Python's limit and raised
    # RecursionError out of `labkit progress`, ending the whole folder's report
    from labkit.course._answer_review import reaches

    chain = "VALUE = (1)" + ".real" * 1500 + "\n"
    compile(chain, "cell", "exec")
    assert reaches(chain) == ("expressions nested too deeply to read (its syntax tree is deeper than Python's "
                              "recursion limit)",)
    assert reaches("VALUE = (1)" + ".real" * 100_000 + "\n") == ()  # past the parser's own limit: it cannot pass


@pytest.mark.parametrize("cell", [
    "x = torch.stack([torch.ones(2)])\n",  # torch's stack, not inspect's
    "class Probe:\n    def __init__(self):\n        self._seen = []\n",  # the cell's own private attribute
    "from torch.nn.modules.batchnorm import _BatchNorm\nkinds = (_BatchNorm,)\n",  # an idiom of 05's answers
    "def init(layer):\n    layer.weight = nn.Parameter(torch.zeros(2, 2))\n",  # an object's attribute, no module's
    "def write(model):\n    return model\nwrite(1)\n",  # a function of the cell's own named write
    "def evaluate(model, x):\n    model.eval()\n    return getattr(model, 'weight', None)\n",  # a method named eval
    "def layers(model, names):\n    return [getattr(model, name) for name in names]\n",  # 06.2's idiom
    "def f(x):\n    _, index = x.max(0)\n    return index\n",  # an underscore for what is not needed
    "def broken(:\n",  # not Python: its grade says so
])
def test_what_the_lessons_use_is_not_marked(cell):
    from labkit.course._answer_review import reaches

    assert reaches(cell) == ()


def test_no_solution_or_correct_answer_of_the_workbook_is_marked_to_review():
    from exercise_variants import VARIANTS
    from test_labs import REPAIRS, _answer_cell

    from labkit.course._answer_review import reaches
    from labkit.labs._isolated import lab_of_answer_cell

    marked = {}
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(path, 4).cells:
            if cell.cell_type == "code" and (student.exercise_id_of(cell) or lab_of_answer_cell(cell.source)):
                marked.update({f"{path.name}: {cell.source[:30]}": found} if (found := reaches(cell.source)) else {})
    marked.update({f"{eid} alternative": found for eid, variant in VARIANTS.items()
                   if (found := reaches(variant.alternative))})
    marked.update({f"{variant} repair": found for variant in REPAIRS if (found := reaches(_answer_cell(variant)))})
    assert len(REPAIRS) == 52 and marked == {}
