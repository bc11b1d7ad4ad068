"""Real nbgrader on a course laid out by `make course` (labkit.course.layout): generate_assignment on 00, 02,
04 and 05, then one autograde of four learners. alice hands in 00's solutions and her own lab 00 answer (full
points), bob 04's release whose stubs attack the grader (0 points: 04.1's cell ignores SIGALRM, 04.2's function
calls os._exit), carol a release of 00 with 00.1 answered, 00.2's stub cell unsetting NBGRADER_EXECUTION,
replacing grading.check and patching torch, 00.2's check cell replaced by a faked pass (nbgrader restores the
locked cell, and labkit's regrade in isolation scores the stub), and alice's lab answer in her lab cell, which
also unsets NBGRADER_EXECUTION and replaces labs.check (carol's variant is another: 0 on the lab, 1 of 3),
erin a release of 00 with only her own lab answer (her variant is not alice's: the lab's point, 1 of 3).
`labkit progress` on the same submissions gives the same scores (reliability trials NG1, NG2). Bad input fails
before anything is written.

One autograde run executes four notebooks, one kernel each; everything else reuses it. Each case needs one
notebook: the solutions, a stub, a learner's edit. The untouched release is 04's, not 00's, so that the run
also grades a second notebook of the assignment and its checks' points; 04 is among the cheapest notebooks
(8-9 s of Run All on a quiet machine, benchmarks/results/notebook_runtime.md). nbgrader executes only the notebooks a
learner handed in, so 02 and 05 cost no kernel: they are in the assignment for the release's checks.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit import grading, student
from labkit.__main__ import main as labkit_main
from labkit.course import exercise_progress, layout, marks
from labkit.errors import LabkitError
from labkit.labs._draw import draw, learner_key
from labkit.labs._registry import lab_of

pytest.importorskip("nbgrader", reason="nbgrader is in the course extra: pip install -e '.[course]'")
from nbgrader.api import Gradebook  # noqa: E402 (after the skip)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = [ROOT / "notebooks" / f"{stem}.ipynb" for stem in
             ("00_start_here", "02_gradients_accumulate", "04_autograd_modes", "05_batchnorm_finetuning")]
ASSIGNMENT = "ps1"
AUTOGRADE_TIMEOUT_S = 1200
# The one autograde executes four notebooks (about 40 s of CPU); a busy machine stretches that several times.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(AUTOGRADE_TIMEOUT_S + 300)]


def nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, capture_output=True, text=True,
                          timeout=AUTOGRADE_TIMEOUT_S, env=layout.environment_with_tools())


def hand_in(course: Path, learner: str, notebooks: dict[str, nbformat.NotebookNode]) -> None:
    folder = course / "submitted" / learner / ASSIGNMENT
    folder.mkdir(parents=True)
    for name, nb in notebooks.items():
        nbformat.write(nb, folder / name)


def released(course: Path, name: str) -> nbformat.NotebookNode:
    return nbformat.read(course / "release" / ASSIGNMENT / name, 4)


# Lines a learner adds to an answer cell to fool a grader that runs in their kernel.
UNSET_NBGRADER = "import os\nos.environ.pop('NBGRADER_EXECUTION', None)\n"  # NG2
REPLACE_CHECK = "import labkit.grading as _g\n_g.check = lambda *a, **k: print('✓ passed (patched)')\n"  # NG1
PATCH_TORCH = "torch.Tensor.abs = lambda self: self * 0\n"  # PG28
IGNORE_ALARM = "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"  # PG10
READS_ITS_STACK = "import sys\nCALLER = sys._getframe()\n"
EXIT_IN_FUNCTION = "\ndef mean_output(gru, padded, lengths):\n    import os\n    os._exit(0)\n"  # PG5


# Lab 00's answer cell, right for each variant: the diagnosis and the repaired stage.
LAB_REPAIRS = {
    "00.a": "def loss_of(prediction, target):\n    return (prediction - target).pow(2).mean()\n",
    "00.b": "def update(model, optimizer, loss):\n    model.zero_grad()\n    loss.backward()\n    optimizer.step()\n",
    "00.c": "def make_batches(x, y, batch_size, generator):\n    order = torch.randperm(len(x), generator=generator)\n"
            "    return list(zip(x[order].split(batch_size), y[order].split(batch_size)))\n",
}
UNSET_AND_REPLACE_LABS = ("import os\nos.environ.pop('NBGRADER_EXECUTION', None)\n"
                          "from labkit import labs as _labs\n_labs.check = lambda *a, **k: print('✓ Lab 00 passed')\n")


def lab_variant(learner: str) -> str:
    """The variant of lab 00 nbgrader's student ``learner`` is graded on."""
    lab = lab_of("00")
    return lab.variants[draw("00", learner_key(learner=learner), len(lab.variants))[0]].id


def lab_answer(variant: str, extra: str = "") -> str:
    stage = LAB_REPAIRS[variant].split("def ", 1)[1].split("(", 1)[0]
    return (f"# lab 00: your answer\n{extra}{LAB_REPAIRS[variant]}\n"
            f"def diagnose(lab):\n    return {lab_of('00').variant(variant).cause!r}, {stage}\n")


def with_lab_answer(nb: nbformat.NotebookNode, source: str) -> nbformat.NotebookNode:
    (cell,) = [cell for cell in nb.cells if cell.cell_type == "code" and cell.source.startswith("# lab 00: your answer")]
    cell.source = source
    return nb


def with_lines(nb: nbformat.NotebookNode, exercise_id: str, lines: str) -> None:
    (cell,) = [cell for cell in nb.cells if student.exercise_id_of(cell) == exercise_id]
    cell.source += "\n" + lines


def attacking_04(course: Path) -> nbformat.NotebookNode:
    """The release of 04, stubs kept, with lines that defeat the time limit or end the process."""
    nb = released(course, "04_autograd_modes.ipynb")
    with_lines(nb, "04.1", IGNORE_ALARM)
    with_lines(nb, "04.2", EXIT_IN_FUNCTION)
    return nb


def faked_00(course: Path) -> nbformat.NotebookNode:
    """The release of 00 with 00.1 answered, 00.2's stub cell patching the grader, and 00.2's check replaced
    by a hand-made "passed" display; its lab cell holds alice's answer and unsets nbgrader and labs.check."""
    nb = with_lab_answer(released(course, "00_start_here.ipynb"), lab_answer(lab_variant("alice"),
                                                                             UNSET_AND_REPLACE_LABS))
    solution = student.find_exercises(nbformat.read(NOTEBOOKS[0], 4), "00_start_here.ipynb")["00.1"].solution
    with_lines(nb, "00.2", UNSET_NBGRADER + REPLACE_CHECK + PATCH_TORCH)
    for cell in nb.cells:
        if student.exercise_id_of(cell) == "00.1":
            cell.source = solution
        if marks.checked_exercise(cell, "cell") == "00.2":
            payload = {"exercise": "00.2", "notebook": "00_start_here", "passed": True, "message": "✓ Exercise 00.2 passed"}
            cell.source = f"display({json.dumps({grading.GRADE_MIMETYPE: payload})}, raw=True)"
            cell.outputs = [nbformat.v4.new_output("display_data", data={grading.GRADE_MIMETYPE: payload})]
    return nb


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Path:
    """A course with ps1 = 00, 02, 04, 05, autograded once for alice, bob, carol and erin."""
    # Lab 00 draws a variant per student: carol's and erin's are not alice's, so alice's answer is wrong for them.
    assert lab_variant("carol") != lab_variant("alice") and lab_variant("erin") != lab_variant("alice")
    root = tmp_path_factory.mktemp("course") / "course"
    layout.create_course(NOTEBOOKS, root, ASSIGNMENT)
    # the instructor's source: the solutions, with the metadata the release carries (the lab check's included)
    alice = with_lab_answer(nbformat.read(root / "source" / ASSIGNMENT / NOTEBOOKS[0].name, 4),
                            lab_answer(lab_variant("alice")))
    hand_in(root, "alice", {"00_start_here.ipynb": alice})
    hand_in(root, "bob", {"04_autograd_modes.ipynb": attacking_04(root)})
    hand_in(root, "carol", {"00_start_here.ipynb": faked_00(root)})
    # erin's right answer also reads the call stack: it passes, marked for the grader to read
    erin = with_lab_answer(released(root, "00_start_here.ipynb"), lab_answer(lab_variant("erin"), READS_ITS_STACK))
    hand_in(root, "erin", {"00_start_here.ipynb": erin})
    done = nbgrader(root, "autograde", ASSIGNMENT)
    assert done.returncode == 0, done.stderr[-2000:]
    (root / "autograde.log").write_text(done.stderr)
    return root


def scores(course: Path, learner: str) -> dict[str, tuple[float, float]]:
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", layout.COURSE_ID) as gradebook:
        submission = gradebook.find_submission(ASSIGNMENT, learner)
        return {nb.name: (nb.score, nb.max_score) for nb in submission.notebooks}


def test_the_solutions_get_full_points(course):
    assert scores(course, "alice")["00_start_here"] == (3.0, 3.0)
    assert check_scores(course, "alice")["check_lab_00"] == 1.0


def test_two_learners_with_different_variants_each_pass_the_lab_with_their_own_answer(course):
    assert lab_variant("erin") != lab_variant("alice")
    assert check_scores(course, "alice")["check_lab_00"] == check_scores(course, "erin")["check_lab_00"] == 1.0
    assert scores(course, "erin")["00_start_here"] == (1.0, 3.0)
    log = (course / "autograde.log").read_text()
    assert "labkit regraded lab 00 for alice in isolation: passed" in log
    assert "labkit regraded lab 00 for erin in isolation: passed" in log


def test_a_pass_whose_cell_reads_the_call_stack_keeps_its_point_with_a_line_to_review(course):
    graded = nbformat.read(course / "autograded" / "erin" / ASSIGNMENT / "00_start_here.ipynb", 4)
    (check,) = [cell for cell in graded.cells if cell.metadata.get("nbgrader", {}).get("grade_id") == "check_lab_00"]
    shown = [output.get("text", "") for output in check.outputs if output.output_type == "stream"]
    assert shown == ["To review: the answer cell uses what no lesson calls for, so it may be written against its "
                     "check, not the lesson; read it before you trust the pass: the call stack or the garbage "
                     "collector's objects (sys._getframe)\n"]
    assert "labkit: 00.lab passed with a cell to read before you trust the pass" in (course / "autograde.log").read_text()
    # alice's answer, the same but for that line, shows the verdict alone
    graded = nbformat.read(course / "autograded" / "alice" / ASSIGNMENT / "00_start_here.ipynb", 4)
    (check,) = [cell for cell in graded.cells if cell.metadata.get("nbgrader", {}).get("grade_id") == "check_lab_00"]
    assert [output.output_type for output in check.outputs] == ["display_data"]


def test_another_learners_lab_answer_with_nbgrader_unset_and_the_check_replaced_gets_nothing(course):
    assert check_scores(course, "carol")["check_lab_00"] == 0.0
    assert "labkit regraded lab 00 for carol in isolation: not yet" in (course / "autograde.log").read_text()
    graded = nbformat.read(course / "autograded" / "carol" / ASSIGNMENT / "00_start_here.ipynb", 4)
    (check,) = [cell for cell in graded.cells if cell.metadata.get("nbgrader", {}).get("grade_id") == "check_lab_00"]
    assert "does not fit your run" in check.outputs[0]["data"]["text/plain"]


def test_stubs_that_ignore_the_alarm_or_exit_get_nothing(course):
    assert scores(course, "bob")["04_autograd_modes"] == (0.0, 3.0)


def test_a_stub_that_unsets_nbgrader_replaces_the_check_and_patches_torch_gets_nothing(course):
    assert scores(course, "carol")["00_start_here"] == (1.0, 3.0)
    assert check_scores(course, "carol") == {"check_00_1": 1.0, "check_00_2": 0.0, "check_lab_00": 0.0}
    assert "labkit regraded exercise 00.2 in isolation: not yet" in (course / "autograde.log").read_text()


def test_the_release_names_no_variant_and_holds_no_defect_code(course):
    from test_student import revealed_variants

    assert revealed_variants([released(course, path.name) for path in NOTEBOOKS]) == []


def test_progress_on_the_same_submissions_gives_the_same_scores(course):
    for learner in ("bob", "carol", "erin"):
        handed_in = {path.stem for path in (course / "submitted" / learner / ASSIGNMENT).glob("*.ipynb")}
        gradebook = {name: score for name, score in scores(course, learner).items() if name in handed_in}
        rechecked = exercise_progress.recheck_folder(course / "submitted" / learner / ASSIGNMENT,
                                                     course / "source" / ASSIGNMENT).rows
        # --stored on what autograde wrote: the verdicts its regrade stored, labs included
        stored = exercise_progress.stored_report(course / "autograded" / learner / ASSIGNMENT).rows
        for rows in (rechecked, stored):
            passed: dict[str, float] = {}
            for row in rows:
                passed[row.notebook] = passed.get(row.notebook, 0.0) + (row.status == exercise_progress.PASSED)
            assert set(passed) == handed_in
            assert {name: (points, gradebook[name][1]) for name, points in passed.items()} == gradebook, learner
            assert {row.exercise for row in rows} >= {"00.lab"} or learner == "bob"


def check_scores(course: Path, learner: str) -> dict[str, float]:
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", layout.COURSE_ID) as gradebook:
        submission = gradebook.find_submission_notebook("00_start_here", ASSIGNMENT, learner)
        return {grade.name: grade.score for grade in submission.grades}


def test_a_faked_check_output_is_restored_and_scored_honestly(course):
    assert scores(course, "carol")["00_start_here"] == (1.0, 3.0)
    assert "Attribute 'checksum' for cell check_00_2 has changed" in (course / "autograde.log").read_text()
    graded = nbformat.read(course / "autograded" / "carol" / ASSIGNMENT / "00_start_here.ipynb", 4)
    (check,) = [cell for cell in graded.cells if cell.metadata.get("nbgrader", {}).get("grade_id") == "check_00_2"]
    assert check.source == 'grading.check("00.2", grad_of_each_call)'
    assert any(output.get("ename") == "AssertionError" for output in check.outputs)


def test_the_release_is_the_student_edition_but_for_the_stub_line(course, tmp_path):
    student.write_student_edition(ROOT / "notebooks", tmp_path / "student")
    for path in NOTEBOOKS:
        ours, theirs = nbformat.read(tmp_path / "student" / path.name, 4), released(course, path.name)
        assert len(ours.cells) == len(theirs.cells)
        differing = []
        for a, b in zip(ours.cells, theirs.cells):
            assert a.source.count("\n") == b.source.count("\n")
            differing += [(x.strip(), y.strip()) for x, y in zip(a.source.split("\n"), b.source.split("\n")) if x != y]
            nbgrader_adds = ("checksum", "cell_type")
            assert {k: v for k, v in b.metadata.get("nbgrader", {}).items() if k not in nbgrader_adds} == \
                a.metadata.get("nbgrader", {})
            assert [a.metadata.get(lock) for lock in ("deletable", "editable")] == \
                [b.metadata.get(lock) for lock in ("deletable", "editable")]
        exercises = student.find_exercises(nbformat.read(path, 4), path.name)
        assert differing == [(student.STUB[1].format(id=eid), "raise NotImplementedError()") for eid in exercises]


# ---- bad input: clear errors, nothing written ----------------------------------------------------


def renumbered(tmp_path: Path, old: str, new: str) -> Path:
    """A copy of 00 whose exercise ``old`` is called ``new`` in all three cells, metadata included."""
    nb = nbformat.read(NOTEBOOKS[0], 4)
    for cell in nb.cells:
        if old in cell.source and cell.cell_type == "code":
            cell.source = cell.source.replace(old, new)
            meta = cell.metadata.get("nbgrader")
            if meta:
                meta["grade_id"] = meta["grade_id"].replace(old.replace(".", "_"), new.replace(".", "_"))
    path = tmp_path / "notebooks" / NOTEBOOKS[0].name
    path.parent.mkdir()
    nbformat.write(nb, path)
    return path


def test_an_exercise_the_registry_does_not_know_is_refused(tmp_path):
    path = renumbered(tmp_path, "00.2", "00.9")
    with pytest.raises(LabkitError, match=r"exercise 00\.9, which labkit.exercises does not register"):
        layout.create_course([path], tmp_path / "course", ASSIGNMENT)
    assert not (tmp_path / "course").exists()


def test_a_notebook_whose_exercise_cells_were_deleted_is_refused(tmp_path):
    nb = nbformat.read(NOTEBOOKS[0], 4)
    nb.cells = [cell for cell in nb.cells if student.exercise_id_of(cell) != "00.2"
                and marks.checked_exercise(cell, "cell") != "00.2"]
    (tmp_path / "notebooks").mkdir()
    nbformat.write(nb, tmp_path / "notebooks" / NOTEBOOKS[0].name)
    with pytest.raises(LabkitError, match=r"00_start_here.ipynb: exercise 00\.2 has no solution or check cell"):
        layout.create_course([tmp_path / "notebooks" / NOTEBOOKS[0].name], tmp_path / "course", ASSIGNMENT)
    assert not (tmp_path / "course").exists()


def test_an_unlocked_check_cell_is_refused(tmp_path, capsys):
    nb = nbformat.read(NOTEBOOKS[0], 4)
    for cell in nb.cells:
        if marks.checked_exercise(cell, "cell") == "00.1":
            cell.metadata["nbgrader"]["locked"] = False
    (tmp_path / "notebooks").mkdir()
    nbformat.write(nb, tmp_path / "notebooks" / NOTEBOOKS[0].name)
    with pytest.raises(LabkitError, match=r"check of exercise 00\.1\) is not a locked nbgrader test cell"):
        layout.create_course([tmp_path / "notebooks" / NOTEBOOKS[0].name], tmp_path / "course", ASSIGNMENT)
    assert not (tmp_path / "course").exists()


def test_a_course_with_handed_in_work_is_not_released_again(course, capsys):
    before = {path: path.read_bytes() for path in [course / "gradebook.db", *(course / "submitted").rglob("*.ipynb")]}
    assert labkit_main(["course", "create", "00", "--assignment", ASSIGNMENT, "--dest", str(course)]) == 2
    assert "learners have handed in assignment ps1" in capsys.readouterr().err
    assert {path: path.read_bytes() for path in before} == before


def test_a_folder_the_course_command_did_not_lay_out_is_refused(tmp_path):
    (tmp_path / "course").mkdir()
    (tmp_path / "course" / "notes.txt").write_text("mine")
    with pytest.raises(LabkitError, match="was not laid out by `make course`"):
        layout.create_course(NOTEBOOKS[:1], tmp_path / "course", ASSIGNMENT)
    assert [path.name for path in (tmp_path / "course").iterdir()] == ["notes.txt"]


def test_the_course_config_names_the_course_kernel_and_timeout(course):
    config = (course / "nbgrader_config.py").read_text()
    assert f'c.Execute.kernel_name = "{layout.KERNEL_NAME}"' in config
    assert f"c.Execute.timeout = {layout.CELL_TIMEOUT_S}" in config
    kernel = json.loads((course / "kernels" / layout.KERNEL_NAME / "kernel.json").read_text())
    assert kernel["argv"][0] == sys.executable


def test_a_rerun_for_a_new_assignment_keeps_the_gradebook(course):
    second = course.parent / "second"
    shutil.copytree(course, second)
    layout.create_course(NOTEBOOKS[:1], second, "ps2")
    assert scores(second, "alice")["00_start_here"] == (3.0, 3.0)
    assert (second / "release" / "ps2" / "00_start_here.ipynb").exists()
