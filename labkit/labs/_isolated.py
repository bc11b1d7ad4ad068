"""A lab's verdict that counts, computed where the learner's code cannot reach it.

The same grading process as an exercise's (`labkit._grader_process`: a child forked from the clean
zygote, its own session, scratch folder, CPU, memory and wall-clock limits, the verdict back as data)
receives the lab's ID, the learner's key (`labkit.labs._draw`) and the *source* of the learner's answer
cell, the cell that starts ``# lab NN: your answer`` and defines ``diagnose(lab)``. There, before any of
the learner's code runs, the variant and seed are drawn again from the key, the learner's own run and
the two reference runs (defective and defect-free) are trained, and the lab's definition is snapshotted
(`_Namespaces`). Then the cell runs, ``diagnose`` is called on the learner's run, and the check reruns
the training with the repair, every repaired stage's call followed by putting back what it patched. A
cell that patches torch or labkit, exits, hangs, ignores SIGALRM or unsets ``NBGRADER_EXECUTION`` can
only fail its own lab. The learner's kernel (`labs.check`), nbgrader's autograde
(`labkit.course.isolated_autograde`) and ``labkit progress`` all grade a lab this way, so they agree.

What this does not stop, as for exercises (`labkit._grader_child`): a thread the repair starts that keeps
patching between two restores, an in-place change to a list inside a reference run's trace, and an answer
written against the grading protocol itself (it shares the grading process with the check, so it can
write its own verdict: the repair is a training stage whose outputs the rerun backpropagates through, which
`labkit._answer_process` cannot carry across a process boundary).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import linecache
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

from labkit.grading import EXERCISE_NAMESPACE, Result
from labkit.labs._check import check_lab, grade_id, reference_runs, repaired_stages
from labkit.labs._draw import draw
from labkit.labs._registry import LAB_MODULES, lab_of

__all__: list[str] = []

# The first line of a lab's answer cell and its check call, as every notebook's lab writes them.
ANSWER_HEADER = re.compile(r"^# lab (\d{2}): your answer\s*$")
CHECK_CALL = re.compile(r"""^labs\.check\(\s*lab\s*,\s*([A-Za-z_]\w*)\s*\)\s*$""")
# CPU seconds for a lab's whole check in the grading process: the learner's run, the two reference runs
# and the repaired one (each well under a second for the labs of today, 15 s the most a lab may take).
LAB_TIME_LIMIT_S = 30.0


def process_events(lab_id: str) -> tuple[str, ...]:
    """The audited events the grading process lets lab ``lab_id`` raise: a lab whose training runs in worker
    processes declares ``PROCESS_EVENTS`` (forking them, stopping its own children); the others none."""
    lab_of(lab_id)  # a LabkitError for an unknown lab
    return tuple(getattr(importlib.import_module(LAB_MODULES[lab_id]), "PROCESS_EVENTS", ()))


def lab_of_answer_cell(source: str) -> str | None:
    """The lab ID in a cell's first line when it is a lab's answer cell (``# lab NN: your answer``)."""
    match = ANSWER_HEADER.match(source.lstrip().split("\n", 1)[0])
    return match.group(1) if match else None


def checked_function(source: str) -> str | None:
    """The function a lab's check cell (``labs.check(lab, diagnose)``) checks, or None for any other cell."""
    match = CHECK_CALL.match(source.strip())
    return match.group(1) if match else None


def not_attempted(function: str) -> str:
    return (f"{function} is not attempted yet (it still raises NotImplementedError): replace its "
            "'# YOUR CODE HERE' and 'raise' lines with your answer")


def answer_cell(lab_id: str, answer: Callable) -> str | None:
    """The source of the notebook cell that defined ``answer``, when it is lab ``lab_id``'s answer cell."""
    filename = getattr(getattr(answer, "__code__", None), "co_filename", "")
    if not isinstance(filename, str) or "ipykernel_" not in filename and not filename.startswith("<ipython-input"):
        return None
    source = "".join(linecache.getlines(filename))
    return source if lab_of_answer_cell(source) == lab_id else None


def grade_lab_cell(lab_id: str, cell_source: str, function: str, key: str, *, where: str = "",
                   try_number: int = 1, follow_up: bool = True) -> Result:
    """Grade a lab's answer cell for the learner ``key`` in a grading process of its own."""
    from labkit._check_sandbox import WALL_LIMIT_FACTOR
    from labkit._grader_process import grade_in_child
    from labkit._stub_answer import is_untouched_stub

    lab = lab_of(lab_id)
    if is_untouched_stub(cell_source, function):  # its verdict cannot differ, so no process is started for it
        return not_yet_result(lab_id, not_attempted(function))
    request = {"lab": lab.id, "key": key, "source": cell_source, "function": function,
               "where": where or f"lab {lab.id}", "try_number": try_number, "follow_up": follow_up,
               "time_limit_s": LAB_TIME_LIMIT_S}
    outcome = grade_in_child(request, LAB_TIME_LIMIT_S * WALL_LIMIT_FACTOR)
    if outcome.verdict is None:
        hint = f" Hint: {outcome.hint.rstrip('.')}." if outcome.hint else ""
        return not_yet_result(lab.id, f"your lab answer cell could not be checked: {outcome.failure}", hint)
    return Result(grade_id(lab.id), lab.notebook, bool(outcome.verdict["passed"]), str(outcome.verdict["message"]))


def not_yet_result(lab_id: str, problem: str, after: str = "") -> Result:
    lab = lab_of(lab_id)
    return Result(grade_id(lab.id), lab.notebook, False, f"✗ Lab {lab.id} not yet: {problem}.{after}")


# ---- the grading process's side ----------------------------------------------------------------------


@dataclass
class Prepared:
    """What the grading process readies before the learner's code runs: the draw, the runs, the guards."""

    lab_id: str
    variant: str
    seed: int
    session: object
    modules: tuple[str, ...]
    objects: tuple


def prepare(request: dict) -> Prepared:
    """Draw the learner's variant from their key, train their run and the reference runs, list what to guard."""
    from labkit.labs import LabSession

    lab = lab_of(request["lab"])
    index, seed = draw(lab.id, request["key"], len(lab.variants))
    variant = lab.variants[index]
    session = LabSession(lab.id, request["key"])
    defective, twin = reference_runs(lab.id, variant.id, seed)
    modules = tuple(name for name in sys.modules if name == "labkit.labs" or name.startswith("labkit.labs."))
    mappings = [lab.stages, lab.correct, *(v.defect for v in lab.variants)]
    runs = [defective, twin]
    objects = (lab, *lab.variants, *lab.causes, *(m for m in mappings if isinstance(m, dict)),
               *runs, *(run.metrics for run in runs), *(run.trace for run in runs))
    return Prepared(lab.id, variant.id, seed, session, modules, objects)


def judge(request: dict, prepared: Prepared, namespaces, time_limit) -> Result:
    """Run the answer cell, call its ``diagnose`` on the learner's run, and check the diagnosis and repair.

    ``namespaces`` (`labkit._check_sandbox._Namespaces`) is restored after the cell, after ``diagnose``
    and after every call of a repaired stage; ``time_limit`` bounds all of it.
    """
    from labkit._check_sandbox import _CheckTimedOut, _plain_str
    from labkit.labs import _submission
    from labkit.messages import describe_error

    function, lab = request["function"], lab_of(prepared.lab_id)
    namespace = dict(EXERCISE_NAMESPACE)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                time_limit(request["time_limit_s"]):
            try:
                exec(compile(request["source"], request["where"], "exec"), namespace)  # noqa: S102 (the answer cell)
            finally:
                namespaces.restore()
            if not callable(namespace.get(function)):
                return not_yet_result(lab.id, f"the lab answer cell does not define {function} any more; keep the "
                                              f"line 'def {function}(lab):' of the student edition")
            try:
                diagnosis, repair, problem = _submission(prepared.session, namespace[function], None)
            finally:
                namespaces.restore()
            if problem is not None:
                return not_yet_result(lab.id, problem)
            try:
                stages, problem = repaired_stages(lab, repair)  # a repair given as text runs here
            finally:
                namespaces.restore()
            # with a problem, check_lab words it (after the diagnosis, with the lab's hints)
            repaired = repair if problem else {name: _restoring(stage, namespaces) for name, stage in stages.items()}
            text = _plain_str(diagnosis)
            return check_lab(lab.id, prepared.variant, diagnosis if text is None else text, repaired,
                             seed=prepared.seed, try_number=request["try_number"], follow_up=request["follow_up"])
    except _CheckTimedOut as stopped:
        return not_yet_result(lab.id, f"your lab answer did not finish within {stopped.limit} (the check stopped it)")
    except BaseException as error:  # SystemExit and KeyboardInterrupt too: the code raising them is the learner's
        return not_yet_result(lab.id, f"your lab answer raised {describe_error(error, 160)}")
    finally:
        namespaces.restore()


def _restoring(stage: Callable, namespaces) -> Callable:
    """``stage`` as the training calls it, with what the call patched put back after each call."""
    def call(*args, **kwargs):
        try:
            return stage(*args, **kwargs)
        finally:
            namespaces.restore()

    call.__name__ = getattr(stage, "__name__", "stage")
    return call
