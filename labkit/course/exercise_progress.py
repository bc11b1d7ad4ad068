"""Learner progress that stored outputs cannot fake: every answer is run through its check again.

`python -m labkit progress [FOLDER]` reads each ``NN_*.ipynb`` in FOLDER (an executed student edition, or
an nbgrader ``submitted/<learner>/<assignment>`` folder) and grades each exercise cell's source with
`grading.grade_cell`, and each lab's answer cell with `labkit.labs._isolated.grade_lab_cell` for the
folder's learner (the student of a ``submitted/<student>/...`` folder, else this account's learner),
in a process of its own, as the check cell and nbgrader's autograde do (so the
three agree, and a cell that patches the grader, exits or hangs fails only its own exercise). The
table lists the exercises of the notebooks in FOLDER. Verdicts are never read from outputs, so a
hand-made "passed" output or a check cell replaced by a print counts for nothing; only whether a
pass came after the hint's recipe was shown is read from the stored grade records. A pass whose cell uses
means no lesson calls for (the call stack, raw descriptors, private names: `_answer_review`) is marked for
the instructor to read; it stays a pass. A notebook whose
every exercise cell is the solution notebook's code (comments, the solution markers and layout
aside: a copy of the solutions) is skipped and named. ``--stored``
reads the verdicts the notebooks stored instead (`course_progress`, from the outputs `grading.check`
displays): fast, but forgeable, and the report says so.
"""

from __future__ import annotations

import argparse
import ast
import json
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

from labkit import grading, student
from labkit.course._answer_review import reaches
from labkit.errors import LabkitError
from labkit.exercises import exercise_order, registry
from labkit.labs import catalogue as lab_catalogue
from labkit.labs._check import grade_id
from labkit.labs._draw import learner_key
from labkit.labs._isolated import checked_function as checked_lab_function
from labkit.labs._isolated import grade_lab_cell, lab_of_answer_cell
from labkit.notebooks import NOTEBOOK_GLOB
from labkit.records import stored_records

__all__: list[str] = []

PASSED, NOT_YET, NOT_RUN = "passed", "not yet", "not run"
# How a pass that came after the hint's recipe was shown reads in the table.
AFTER_RECIPE = "passed after the recipe"
# How a pass whose cell the instructor should read (`_answer_review`) reads in the table.
TO_REVIEW = "to review"
# A notebook of the workbook is a few hundred kilobytes; anything far larger is not one.
MAX_NOTEBOOK_BYTES = 50 * 2**20
MISSING = "cell missing"
# What `--stored` reads from each stored grade payload.
GRADE_FIELDS = {"exercise": str, "passed": bool, "message": str}
RECHECKED, STORED = "re-checked", "stored outputs"
# Which verdict wins when several notebooks (a learner's copies) answer one exercise.
_RANK = {PASSED: 3, NOT_YET: 2, MISSING: 1, NOT_RUN: 0}
DEFAULT_SOURCE = Path("notebooks")  # the checkout's solution notebooks, as the other commands default to them


@dataclass(frozen=True)
class Progress:
    """One exercise's standing in a learner's folder: ``passed``, ``not yet`` or ``not run``."""

    notebook: str
    exercise: str
    title: str
    status: str
    message: str
    # the learner's kernel showed the hint's recipe before this exercise passed (read from stored records)
    after_recipe: bool = False
    # what a passing cell uses that no lesson calls for (`_answer_review.reaches`), for the instructor to read
    review: tuple[str, ...] = ()

    def shown_status(self) -> str:
        """The status as the table shows it: a pass after the recipe says so, a pass to review says so."""
        status = AFTER_RECIPE if self.after_recipe else self.status
        return f"{status}, {TO_REVIEW}" if self.review else status


@dataclass
class Report:
    """The course's rows, how they were obtained, and the notebooks skipped as solutions."""

    method: str
    rows: list[Progress]
    skipped: list[str] = field(default_factory=list)


def recheck_folder(folder: Path, source: Path = DEFAULT_SOURCE) -> Report:
    """The exercises of ``folder``'s notebooks with their standing, each answer graded again in isolation."""
    paths = _learner_notebooks(folder)
    solutions = _solutions(source)
    key = learner_of_folder(Path(folder))
    best: dict[str, Progress] = {}
    skipped = []
    for path in paths:
        answers = _answers(path)
        if answers and all(eid in solutions and _same_code(solutions[eid].solution, text) for eid, text in answers.items()):
            skipped.append(path.name)
            continue
        for row in _notebook_rows(path, answers, solutions) + _lab_rows(path, key):
            if row.exercise not in best or _better(row, best[row.exercise]):
                best[row.exercise] = row
    numbers = _numbers_of(paths)
    rows = [best.get(eid) or Progress(spec.notebook, eid, spec.title, NOT_RUN, "")
            for eid, spec in registry().items() if spec.notebook[:2] in numbers]
    rows += [best.get(lab["grade_id"]) or Progress(lab["notebook"], lab["grade_id"], lab["title"], NOT_RUN, "")
             for lab in _labs() if lab["notebook"][:2] in numbers]
    return Report(RECHECKED, sorted(rows, key=lambda row: exercise_order(row.exercise)), skipped)


def _better(row: Progress, than: Progress) -> bool:
    """Whether ``row`` outranks ``than`` (a learner's copies answer one exercise): a pass wins, and a pass with
    nothing to review wins over one to review."""
    return (_RANK[row.status], not row.review) > (_RANK[than.status], not than.review)


def learner_of_folder(folder: Path) -> str:
    """The key a folder's labs are drawn for: the student of nbgrader's ``submitted/<student>/<assignment>``
    (or ``autograded/...``) folder, as its autograde draws; else this account's learner (`learner_key`)."""
    resolved = folder.resolve()
    if resolved.parent.parent.name in ("submitted", "autograded"):
        return learner_key(learner=resolved.parent.name)
    return learner_key()


def _labs() -> list[dict]:
    return [{**lab, "grade_id": grade_id(lab["id"]), "title": f"Lab: {lab['title']}"} for lab in lab_catalogue()]


def _lab_rows(path: Path, key: str) -> list[Progress]:
    """The lab of ``path``'s notebook, its answer cell graded again in isolation for ``key``."""
    labs = [lab for lab in _labs() if lab["notebook"] == path.stem]
    if not labs:
        return []
    (lab,) = labs
    nb = nbformat.read(path, as_version=4)
    cells = [cell for cell in nb.cells if cell.cell_type == "code" and lab_of_answer_cell(cell.source) == lab["id"]]
    if not cells:
        message = (f"{path.name} has no cell starting '# lab {lab['id']}: your answer' (deleted?); copy it back from "
                   "a fresh student edition (make student DEST=elsewhere) and answer it again")
        return [Progress(lab["notebook"], lab["grade_id"], lab["title"], MISSING, message)]
    function = next((found for cell in nb.cells if cell.cell_type == "code"
                     and (found := checked_lab_function(cell.source))), "diagnose")
    result = grade_lab_cell(lab["id"], cells[-1].source, function, key, where=f"{path.name} lab {lab['id']}",
                            follow_up=False)
    return [Progress(lab["notebook"], lab["grade_id"], lab["title"], PASSED if result.passed else NOT_YET,
                     result.message, review=reaches(cells[-1].source) if result.passed else ())]


def _numbers_of(paths: list[Path]) -> set[str]:
    """The workbook numbers (NN of NN_name) of a folder's notebooks: its exercises are those notebooks' only,
    so an assignment of two notebooks is totalled against its own exercises, not the workbook's (PG30)."""
    return {path.name[:2] for path in paths}


def _learner_notebooks(folder: Path) -> list[Path]:
    folder = Path(folder)
    if not folder.is_dir():
        raise LabkitError(f"no folder {folder}: write the student edition with `make student`, then run its notebooks")
    paths = sorted(folder.glob(NOTEBOOK_GLOB))
    if not paths:
        raise LabkitError(f"no notebooks in {folder} (named NN_name.ipynb): pass the folder of a learner's notebooks")
    return paths


def _solutions(source: Path) -> dict[str, student.ExerciseCells]:
    source = Path(source)
    paths = sorted(source.glob(NOTEBOOK_GLOB)) if source.is_dir() else []
    if not paths:
        raise LabkitError(f"no solution notebooks in {source}: re-checking compares each answer with the workbook's "
                          "solutions, which a checkout holds (an installed labkit does not); run from the checkout, "
                          "or pass --source with its notebooks/ folder")
    found = {}
    for path in paths:
        found.update(student.find_exercises(nbformat.read(path, as_version=4), path.name))
    return found


def _same_code(solution: str, answer: str) -> bool:
    """Whether ``answer`` is the solution's code, whatever its comments (the solution markers) and layout."""
    try:
        return ast.dump(ast.parse(solution)) == ast.dump(ast.parse(answer))
    except (SyntaxError, ValueError):
        return False


def _answers(path: Path) -> dict[str, str]:
    """Each exercise cell's source in a learner's notebook, by exercise ID."""
    _refuse_unreadable(path)
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as error:  # nbformat raises JSON, validation and OS errors alike for a damaged file
        raise LabkitError(f"cannot read {path} ({type(error).__name__}); restore it from the student edition") from error
    return {eid: cell["source"] for cell in nb.cells if (eid := student.exercise_id_of(cell)) is not None}


def _refuse_unreadable(path: Path) -> None:
    """A clear error for what is named like a notebook but cannot be one: a FIFO or device would block
    or never end, a huge file would fill memory."""
    mode = path.stat().st_mode
    if not stat.S_ISREG(mode):
        raise LabkitError(f"{path} is not a regular file (a FIFO, device or folder named like a notebook); "
                          "remove it or restore the notebook from the student edition")
    if path.stat().st_size > MAX_NOTEBOOK_BYTES:
        raise LabkitError(f"{path} is larger than {MAX_NOTEBOOK_BYTES >> 20} MiB, far more than a notebook of the "
                          "workbook; restore it from the student edition or clear its outputs")


def _notebook_rows(path: Path, answers: dict[str, str], solutions: dict) -> list[Progress]:
    number = path.name[:2]
    stored = _stored_grades(path)
    rows = []
    exercises = registry()
    # Exercise cells whose ID is not one of this notebook's (renumbered by hand, or pasted from another notebook).
    strangers = [eid for eid in answers if eid not in exercises or not exercises[eid].notebook.startswith(number + "_")]
    for eid, spec in exercises.items():
        if not spec.notebook.startswith(number + "_"):
            continue
        if eid not in answers:
            found = (f"; it has a cell for exercise {', '.join(strangers)}, which is not one of {spec.notebook}'s "
                     f"exercises: put back '# exercise {eid}' as that cell's first line if it is this one"
                     if strangers else "")
            message = (f"{path.name} has no cell starting '# exercise {eid}' (deleted?); copy it back from a fresh "
                       f"student edition (make student DEST=elsewhere) and answer it again{found}")
            rows.append(Progress(spec.notebook, eid, spec.title, MISSING, message))
            continue
        result = recheck(eid, answers[eid], solutions[eid].function, f"{path.name} exercise {eid}")
        after_recipe = result.passed and bool(stored.get(eid, {}).get("after_recipe"))
        rows.append(Progress(spec.notebook, eid, spec.title, PASSED if result.passed else NOT_YET, result.message,
                             after_recipe, reaches(answers[eid]) if result.passed else ()))
    return rows


def recheck(exercise_id: str, cell_source: str, function: str, where: str) -> grading.Result:
    """Grade an exercise cell's source in a process of its own (`grading.grade_cell`), as a report does."""
    return grading.grade_cell(exercise_id, cell_source, function, where=where, follow_up=False)


def _stored_grades(path: Path) -> dict[str, dict]:
    """The grade records a notebook stored, for the one thing a report takes from them: whether a pass
    came after the recipe. A damaged record only loses that note."""
    try:
        return read_grades(path)
    except LabkitError:
        return {}


def stored_report(folder: Path) -> Report:
    """The verdicts the notebooks stored when they ran (`course_progress`): forgeable."""
    return Report(STORED, course_progress(Path(folder)))


def read_grades(path: Path) -> dict[str, dict]:
    """The grade payloads stored in one executed notebook, by exercise; a later output wins.

    A payload without its fields, or with one of the wrong type, is a LabkitError naming the file.
    """
    return {payload["exercise"]: payload for payload in stored_records(path, grading.GRADE_MIMETYPE, GRADE_FIELDS)}


def course_progress(folder: Path) -> list[Progress]:
    """Every exercise (and lab) of ``folder``'s notebooks with its standing in their stored outputs."""
    folder = Path(folder)
    if not folder.is_dir():
        raise LabkitError(f"no folder {folder}: write the student edition with `make student`, then run its notebooks")
    paths = sorted(folder.glob("*.ipynb"))
    if not paths:
        raise LabkitError(f"no notebooks in {folder}: pass the folder that holds your executed student notebooks")
    known = registry()
    grades = _merge_grades(paths)
    labs = {f"{lab['id']}.lab": lab for lab in lab_catalogue()}
    numbers = _numbers_of(paths)
    rows = [_progress_row(spec.notebook, spec.id, spec.title, grades.get(spec.id)) for spec in known.values()
            if spec.notebook[:2] in numbers]
    rows += [_progress_row(lab["notebook"], grade_id, f"Lab: {lab['title']}", grades.get(grade_id))
             for grade_id, lab in labs.items() if lab["notebook"][:2] in numbers]
    # A notebook from an older or newer course edition may grade an exercise this labkit does not know.
    rows += [
        _progress_row(payload["notebook"], eid, "(not in this labkit)", payload)
        for eid, payload in grades.items()
        if eid not in known and eid not in labs
    ]
    return sorted(rows, key=lambda row: exercise_order(row.exercise))


def _merge_grades(paths: list[Path]) -> dict[str, dict]:
    """Each exercise's verdict across notebooks; a pass anywhere counts, so a saved copy cannot hide it."""
    grades: dict[str, dict] = {}
    for path in paths:
        for exercise_id, payload in read_grades(path).items():
            if exercise_id not in grades or payload["passed"]:
                grades[exercise_id] = payload
    return grades


def _progress_row(notebook: str, exercise_id: str, title: str, payload: dict | None) -> Progress:
    if payload is None:
        return Progress(notebook, exercise_id, title, NOT_RUN, "")
    passed = payload["passed"]
    return Progress(notebook, exercise_id, title, PASSED if passed else NOT_YET, payload["message"],
                    passed and payload.get("after_recipe") is True)


def describe(report: Report, folder: str) -> str:
    """The report as text: how it was made, the table, and what was skipped."""
    how = (f"Re-ran every answer in {folder} through its check (stored outputs ignored)." if report.method == RECHECKED
           else f"Read the verdicts stored in {folder}'s outputs; they are not re-checked and can be faked.")
    lines = [how, progress_table(report.rows)]
    if report.skipped:
        lines.append(f"Skipped as copies of solution notebooks: {', '.join(report.skipped)}")
    reviewed = [row for row in report.rows if row.review]
    if reviewed:
        lines.append(f"Passes {TO_REVIEW}: each cell uses what no lesson calls for and could be written against its "
                     "check, not the lesson; read it before you trust the pass (docs/COURSE.md):")
        lines += [f"  {row.exercise} ({row.notebook}): {'; '.join(row.review)}" for row in reviewed]
    missing = [row.message for row in report.rows if row.status == MISSING]
    return "\n".join(lines + missing)


def progress_table(rows: list[Progress]) -> str:
    """The rows as an aligned text table with a total line."""
    header = ("notebook", "exercise", "status", "title")
    lines = [header] + [(row.notebook, row.exercise, row.shown_status(), row.title) for row in rows]
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    text = ["  ".join(value.ljust(width) for value, width in zip(line, widths)).rstrip() for line in lines]
    counts = _counts(rows)
    # Statuses beyond these three (`MISSING`, of a re-checked folder) are counted after them.
    others = "".join(f", {count} {status}" for status, count in counts.items() if status not in (PASSED, NOT_YET, NOT_RUN))
    text.append(
        f"Total: {counts[PASSED]}/{len(rows)} exercises passed "
        f"({counts[NOT_YET]} not yet, {counts[NOT_RUN]} not run{others})"
    )
    return "\n".join(text)


def _counts(rows: list[Progress]) -> dict[str, int]:
    statuses = dict.fromkeys([PASSED, NOT_YET, NOT_RUN] + [row.status for row in rows])
    return {status: sum(row.status == status for row in rows) for status in statuses}


def main(argv: list[str]) -> int:
    """`python -m labkit progress [folder] [--source notebooks] [--stored] [--json]`: which exercises pass."""
    parser = argparse.ArgumentParser(prog="python -m labkit progress", description=main.__doc__)
    parser.add_argument("folder", nargs="?", default="student", help="a learner's notebooks (default: student)")
    parser.add_argument("--source", default=str(DEFAULT_SOURCE), help="the solution notebooks (default: notebooks)")
    parser.add_argument("--stored", action="store_true", help="read stored verdicts instead of re-checking (forgeable)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    report = stored_report(Path(args.folder)) if args.stored else recheck_folder(Path(args.folder), Path(args.source))
    if args.json:
        counts = {status: sum(row.status == status for row in report.rows) for status in _RANK}
        total = {"exercises": len(report.rows), "passed": counts[PASSED], "not_yet": counts[NOT_YET],
                 "missing": counts[MISSING], "not_run": counts[NOT_RUN],
                 "to_review": sum(bool(row.review) for row in report.rows)}
        print(json.dumps({"folder": args.folder, "method": report.method, "skipped": report.skipped,
                          "exercises": [asdict(row) for row in report.rows], "total": total}, indent=2))
    else:
        print(describe(report, args.folder))
    return 0
