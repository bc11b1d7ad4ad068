"""An nbgrader course directory laid out from the workbook's notebooks (`make course`).

`python -m labkit course create [NAMES] [--assignment NAME] [--dest course]` checks the named solution
notebooks (default: all) against the exercise convention and the registry, copies them to
``DEST/source/ASSIGNMENT/`` (each lab's check cell made a locked, graded test: `student.with_lab_checks`), writes ``DEST/nbgrader_config.py`` (only when missing: it is the
instructor's to edit) and ``DEST/kernels/gradientlab/`` (a kernel that runs this Python with this
labkit), then runs nbgrader's ``generate_assignment``, which writes ``DEST/release/ASSIGNMENT/`` and
the gradebook. It refuses a folder it did not lay out and an assignment learners have handed in,
and checks everything before it writes anything.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat

from labkit import student
from labkit.course.marks import registered_in
from labkit.errors import LabkitError
from labkit.exercises import registry
from labkit.messages import first_line

__all__: list[str] = []

COURSE_ID = "gradientlab"
KERNEL_NAME = "gradientlab"
# Per-cell limit for nbgrader's autograde and validate; its default, 30 s, is too short for the
# slowest cell, 09_residual_design's training sweep. That cell is at most the whole notebook's 50 s
# on a 2-core machine (README's notebook table); with eight jobs sharing two cores it took 240 s of
# CPU and 2147 s of wall time, which no limit should wait for. Six times the bound leaves room for a
# slow or moderately shared machine.
SLOWEST_CELL_S = 50
CELL_TIMEOUT_S = 6 * SLOWEST_CELL_S
# Folders where nbgrader keeps what learners handed in, per student and assignment.
STUDENT_WORK = ("submitted", "autograded", "feedback")
# Written into every course this module lays out, so a rerun recognises its own folder.
MARKER = ".labkit-course"
# nbgrader's collect for a room of accounts (labkit/course/exchange.py), named in the course's config.
OWNERS_COLLECT = "labkit.course.exchange.OwnersCollect"
NBGRADER_TIMEOUT_S = 300

CONFIG = '''\
# nbgrader's configuration of the Gradient Lab course, written by `make course` (labkit/course/layout.py)
# when it was missing: edit it freely. Run nbgrader from this folder, in the project's environment.
import os
from pathlib import Path

c = get_config()  # noqa: F821 (nbgrader defines it)
here = Path(__file__).resolve().parent
c.CourseDirectory.root = str(here)
c.CourseDirectory.course_id = "{course_id}"
# Grade in the course's kernel (kernels/{kernel}: the Python and labkit that laid out the course), not
# whichever python3 kernel this machine happens to list first.
os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(here), os.environ.get("JUPYTER_PATH")]))
c.Execute.kernel_name = "{kernel}"
# Seconds per cell: the slowest cell of the workbook (09's training sweep) needs up to {slowest} s on 2 cores.
c.Execute.timeout = {timeout}
# Release, fetch, submit and collect through an exchange folder beside the course; on a shared hub
# point every user's configuration at one folder all of them can write to.
c.Exchange.root = str(here / "exchange")
# Collect each submission as the account's that wrote it: on the workshop hub every learner is an account,
# and nbgrader alone would file a folder under whichever learner's name it claims.
c.ExchangeFactory.collect = "{collect}"
# Autograde scores labkit's exercises from outside the learner's kernel: after executing a notebook,
# each exercise cell is graded again in a process of its own and its check cell gets that verdict
# (labkit/course/isolated_autograde.py), so an answer cell that patches the grader scores nothing.
from labkit.course.isolated_autograde import AUTOGRADE_PREPROCESSORS  # noqa: E402

c.Autograde.autograde_preprocessors = AUTOGRADE_PREPROCESSORS
'''


def create_course(notebooks: list[Path], root: Path, assignment: str) -> list[Path]:
    """Lay out ``assignment`` of the course at ``root`` from ``notebooks``; return the released notebooks."""
    root = Path(root)
    if not assignment.isidentifier():
        raise LabkitError(f"assignment name {assignment!r} must be letters, digits and underscores (such as ps1)")
    if importlib.util.find_spec("nbgrader") is None:
        raise LabkitError("nbgrader is not installed: pip install --constraint constraints.txt --editable '.[course]'")
    checked = {path.name: _checked_notebook(path) for path in notebooks}
    _refuse_to_overwrite(root, assignment)
    _write_course(root, assignment, checked)
    _generate(root, assignment)
    return sorted((root / "release" / assignment).glob("*.ipynb"))


def _checked_notebook(path: Path) -> nbformat.NotebookNode:
    """The notebook, once its exercises follow the convention and match the registry exactly."""
    nb = nbformat.read(path, as_version=4)
    found = student.find_exercises(nb, path.name)
    for exercise_id in found:
        registered_in(exercise_id, path.stem, path.name)
    missing = [eid for eid, spec in registry().items() if spec.notebook == path.stem and eid not in found]
    if missing:
        raise LabkitError(f"{path.name} has no cells for exercise {', '.join(missing)}, which labkit.exercises "
                          "registers for it; restore them or drop the check from labkit/exercises/")
    return student.with_lab_checks(nb, path.name)


def _refuse_to_overwrite(root: Path, assignment: str) -> None:
    if root.exists() and not root.is_dir():
        raise LabkitError(f"{root} is a file; pass a folder for the course")
    if root.exists() and any(root.iterdir()) and not (root / MARKER).exists():
        raise LabkitError(f"{root} exists and was not laid out by `make course`; pick another folder (COURSE=...)")
    handed_in = [str(path) for folder in STUDENT_WORK for path in sorted((root / folder).glob(f"*/{assignment}"))]
    if handed_in:
        raise LabkitError(
            f"learners have handed in assignment {assignment} ({', '.join(handed_in[:3])}); releasing it again "
            "would change the gradebook under their work. Pick another assignment name (ASSIGNMENT=...)"
        )


def _write_course(root: Path, assignment: str, notebooks: dict[str, nbformat.NotebookNode]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER).write_text("laid out by python -m labkit course create\n")
    if not (root / "nbgrader_config.py").exists():
        (root / "nbgrader_config.py").write_text(CONFIG.format(
            course_id=COURSE_ID, kernel=KERNEL_NAME, slowest=SLOWEST_CELL_S, timeout=CELL_TIMEOUT_S,
            collect=OWNERS_COLLECT))
    _write_kernel(root / "kernels" / KERNEL_NAME)
    # The new source is complete before the old one goes, so a failure leaves one of them whole.
    (root / "source").mkdir(exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{assignment}-", dir=root / "source"))
    for name, nb in notebooks.items():
        nbformat.write(nb, staging / name)
    target = root / "source" / assignment
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)


def _write_kernel(folder: Path) -> None:
    """A kernelspec that runs this Python with the labkit this process imported first on the path: the folder
    that holds it (a checkout's root, or site-packages for an installed labkit), so nbgrader's kernel grades
    with the same labkit."""
    import labkit

    folder.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Gradient Lab (labkit)",
        "language": "python",
        "env": {"PYTHONPATH": str(Path(labkit.__file__).resolve().parents[1])},
    }
    (folder / "kernel.json").write_text(json.dumps(spec, indent=1) + "\n")


def environment_with_tools() -> dict[str, str]:
    """This process's environment with its Python's scripts folder first on PATH: nbgrader runs the
    ``alembic`` command it installed there, and `make` calls .venv/bin/python without activating .venv."""
    scripts = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": os.pathsep.join([scripts, os.environ.get("PATH", "")])}


def _generate(root: Path, assignment: str) -> None:
    command = [sys.executable, "-m", "nbgrader", "generate_assignment", assignment, "--force"]
    try:
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=NBGRADER_TIMEOUT_S,
                              env=environment_with_tools())
    except subprocess.TimeoutExpired as error:
        raise LabkitError(f"nbgrader generate_assignment did not finish within {NBGRADER_TIMEOUT_S} s") from error
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["no output"]
        errors = [line for line in lines if "ERROR" in line or "Error" in line] or lines[-1:]
        raise LabkitError(f"nbgrader generate_assignment {assignment} failed (exit {done.returncode}): "
                          f"{first_line(' | '.join(errors[-3:]), 400)}")
