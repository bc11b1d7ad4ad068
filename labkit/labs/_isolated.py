"""A lab's verdict that counts, computed where the learner's code cannot reach it.

The same grading process as an exercise's (`labkit._grader_process`: a child forked from the clean
zygote, its own session, scratch folder, CPU, memory and wall-clock limits, the verdict back as data)
receives the lab's ID, the learner's key (`labkit.labs._draw`) and the *source* of the learner's answer
cell, the cell that starts ``# lab NN: your answer`` and defines ``diagnose(lab)``. There, before any of
the learner's code runs, the variant and seed are drawn again from the key, the learner's own run and
the two reference runs (defective and defect-free) are trained, and the lab's definition is snapshotted
(`_Namespaces`). That process is the judge only (`judge`): it forks the answer's own process
(`labkit._answer_process`, which holds neither the nonce nor the result pipe), where `serve` runs the
cell, calls ``diagnose`` on the learner's run and, when the judge asks, reruns the training with the
repair, every repaired stage's call followed by putting back what it patched. What comes back is data: the
diagnosis as a string, the names of the repaired stages, and the repaired run's numbers, trace and audit
(`labkit.labs._audit`); the judge compares them with the reference runs it trained itself. A cell that
patches torch or labkit, exits, hangs, ignores SIGALRM, unsets ``NBGRADER_EXECUTION``, or writes to the
pipes it finds can only fail its own lab. The learner's kernel (`labs.check`), nbgrader's autograde
(`labkit.course.isolated_autograde`) and ``labkit progress`` all grade a lab this way, so they agree.

What this does not stop (issue #42, argued in docs/COURSE.md): the repaired run is measured in the answer's
process, so a repaired stage can write a framed reply of its own into the channel (it finds the descriptor by
trying them) and the judge takes it for the run. What it cannot write any more is a defect-free run made *there*:
before the cell runs, the answer process withholds labkit's own defect-free version of every stage the variant
breaks (`_withhold_the_fix`: the function object refuses every call, however the cell reached it: the session, an
import, a name kept) and holds no reference run (the judge trained its own before the fork). So such a forgery
needs numbers its learner's own kernel computed with labkit's fix, pasted into the cell (a strict xfail in
tests/reliability/test_report_forgery.py); every learner's labkit holds that fix, so pasting its text as the repair
is the shorter way to the same pass. A seed the learner cannot know in advance would not close it alone (for most
labs another seed's defect-free run is within the recovery tolerance); closing it needs the judge to train the run
itself, calling only the repaired stages across. The forgery needs means no lesson calls for (raw descriptors),
which `labkit.course._answer_review` marks for the instructor to read.
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

import torch

from labkit.grading import EXERCISE_NAMESPACE, Result
from labkit.labs._check import Repair, check_lab, grade_id, reference_runs, repaired_stages
from labkit.labs._draw import draw
from labkit.labs._lab import Run
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
    reference_runs(lab.id, variant.id, seed)  # cached for the judge; the answer process drops them
    modules = tuple(name for name in sys.modules if name == "labkit.labs" or name.startswith("labkit.labs."))
    mappings = [lab.stages, lab.correct, *(v.defect for v in lab.variants)]
    # What the repaired run is trained by in the answer process, put back after each of the learner's calls.
    # Not the reference runs: the judge compares with its own, and the answer process must not hold them.
    objects = (lab, *lab.variants, *lab.causes, *(m for m in mappings if isinstance(m, dict)))
    return Prepared(lab.id, variant.id, seed, session, modules, objects)


def judge(request: dict, prepared: Prepared, answer) -> Result:
    """The verdict on the answer cell running in ``answer`` (`labkit._answer_process.AnswerProcess`, served by
    `serve`): the diagnosis and the repair's run come back as data and are judged here, against the
    reference runs this process trained before any learner code ran. The answer process ends with it."""
    from labkit._check_sandbox import _CheckTimedOut

    lab = lab_of(prepared.lab_id)
    try:
        status, detail = answer.cell()
        if status != "defined":
            return not_yet_result(lab.id, {
                "timed_out": f"your lab answer did not finish within {detail} (the check stopped it)",
                "raised": f"your lab answer raised {detail}",
                "undefined": f"the lab answer cell does not define {request['function']} any more; keep the line "
                             f"'def {request['function']}(lab):' of the student edition"}[status])
        submitted = _asked(answer, SUBMIT)
        if submitted[0] == "refused":
            return not_yet_result(lab.id, _bounded(submitted[1]))
        _, diagnosis, shown, stages, problem = submitted
        unknown = [name for name in stages if name not in lab.stages]
        if unknown and not problem:
            problem = f"{', '.join(map(str, unknown))} is not one of this lab's stages"
        repair = Repair(tuple(stages), None if problem is None else _bounded(problem),
                        lambda: _trained(_asked(answer, TRAIN)))
        return check_lab(lab.id, prepared.variant, _Shown(shown) if diagnosis is None else diagnosis, repair,
                         seed=prepared.seed, try_number=request["try_number"], follow_up=request["follow_up"])
    except _CheckTimedOut as stopped:
        return not_yet_result(lab.id, f"your lab answer did not finish within {stopped.limit} (the check stopped it)")
    finally:
        answer.end()


# What the judge asks the answer process, in this order: the submission, then (when the diagnosis is
# right and the repair names stages) the repaired run.
SUBMIT, TRAIN = b"submit", b"train"
MAX_PROBLEM_CHARS = 400


class _Shown:
    """A diagnosis that is not a string, as the answer process wrote it (``repr``), for the message."""

    def __init__(self, text: str) -> None:
        self.text = str(text)

    def __repr__(self) -> str:
        return self.text


def _bounded(text: str) -> str:
    return str(text)[:MAX_PROBLEM_CHARS]


def _asked(answer, question: bytes) -> tuple:
    from labkit._check_sandbox import _CheckTimedOut

    reply = answer.ask(question)
    if reply[0] == "timed_out":
        raise _CheckTimedOut(reply[1])
    return reply


def _trained(reply: tuple) -> Run:
    """The repaired run from the answer process's reply, or the stand-in of the error the run raised."""
    from labkit._answer_process import _stand_in_error

    if reply[0] == "raised":
        raise _stand_in_error("Exception", *reply[1:])
    _, metrics, trace, integrity, objects = reply
    return Run(dict(metrics), dict(trace), dict(objects), [str(problem) for problem in integrity])


# ---- the answer process's side ------------------------------------------------------------------------


def serve(channel, request: dict, prepared: Prepared, namespaces) -> None:
    """In the answer process (forked after `prepare`, so the learner's run is here): run the answer cell,
    then answer `judge`'s questions, putting back what the learner's code patched after each of its calls."""
    from labkit import _answer_process as across
    from labkit._check_sandbox import _CheckTimedOut, _time_limit

    _withhold_the_fix(prepared)
    namespace = dict(EXERCISE_NAMESPACE)
    try:
        ran = across.run_cell(request, namespace)
    finally:
        namespaces.restore()
    across._reply(channel, ran)
    if ran[0] != "defined":
        return
    repair: dict[str, Callable] = {}
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                _time_limit(request["time_limit_s"]):
            while (question := across._receive(channel)) is not None:
                namespaces.restore()
                if question == SUBMIT:
                    reply = _submission_here(prepared, namespace[request["function"]], namespaces, repair)
                else:
                    reply = _repaired_run_here(prepared, repair, namespaces)
                across._reply(channel, reply)
    except _CheckTimedOut as stopped:
        across._reply(channel, ("timed_out", stopped.limit))


def _withhold_the_fix(prepared: Prepared) -> None:
    """In the answer process, before the cell runs: labkit's own defect-free version of each stage the learner's
    variant breaks refuses every call, however the cell reaches it (the session's lab, an import, a name kept),
    and the cached reference runs, which hold the defect-free run's numbers, are dropped (the judge trained its
    own before the fork). The repaired run needs neither: the learner's repair replaces those stages."""
    lab = lab_of(prepared.lab_id)
    for name in lab.variant(prepared.variant).defect:
        fix = lab.correct[name]
        fix.__code__ = _refusing(fix.__code__, WITHHELD.format(stage=name))
    reference_runs.cache_clear()


WITHHELD = ("labkit's own {stage}, the lab's defect-free stage, is withheld while your answer is graded: write the "
            "stage yourself, in your answer cell")


def _refusal(*args, **kwargs):
    raise PermissionError("MESSAGE")


def _refusing(code, message: str):
    """``code`` (a stage's) as code that raises PermissionError(message): it keeps the stage's name, so a
    traceback still reads as the stage the learner called."""
    refusal = _refusal.__code__
    consts = tuple(message if const == "MESSAGE" else const for const in refusal.co_consts)
    return refusal.replace(co_consts=consts, co_name=code.co_name, co_qualname=code.co_qualname,
                           co_filename=code.co_filename)


def _submission_here(prepared: Prepared, diagnose: Callable, namespaces, repair: dict) -> tuple:
    """("refused", why) or ("submitted", diagnosis or None, its repr, stage names, problem or None);
    the repaired stages stay here, in ``repair``, for the run the judge may ask for next."""
    from labkit._check_sandbox import _plain_str
    from labkit.labs import _submission

    lab = lab_of(prepared.lab_id)
    try:
        diagnosis, given, problem = _submission(prepared.session, diagnose, None)
    finally:
        namespaces.restore()
    if problem is not None:
        return ("refused", problem)
    try:
        stages, problem = repaired_stages(lab, given)  # a repair given as text runs here
        text = _plain_str(diagnosis)
        shown = "" if text is not None else _repr(diagnosis)
    finally:
        namespaces.restore()
    repair.update({name: _restoring(stage, namespaces) for name, stage in stages.items()})
    return ("submitted", text, shown, sorted(stages), problem)


def _repr(value: object) -> str:
    try:
        return _bounded(repr(value))
    except Exception:  # a diagnosis whose __repr__ fails is still named in the message, by its type
        return f"<a {type(value).__name__}>"


def _repaired_run_here(prepared: Prepared, repair: dict, namespaces) -> tuple:
    """("trained", metrics, trace, integrity, the objects that are data) or ("raised", type name, message)."""
    from labkit._check_sandbox import _CheckTimedOut

    lab = lab_of(prepared.lab_id)
    try:
        run = lab.run({**lab.stages_of(lab.variant(prepared.variant)), **repair}, prepared.seed)
    except _CheckTimedOut:
        raise
    except BaseException as error:  # the learner's stage raised it, KeyboardInterrupt and SystemExit included
        return ("raised", type(error).__name__, str(error))
    finally:
        namespaces.restore()
    objects = {name: data for name, value in run.objects.items() if (data := _data(value)) is not _NOT_DATA}
    return ("trained", _data(run.metrics), _data(run.trace), list(run.integrity), objects)


_NOT_DATA = object()


def _data(value):
    """``value`` as data the judge reads back with ``weights_only`` (numbers, strings, tensors and containers of
    them), or `_NOT_DATA` (a model, an optimizer): a container keeps only its items that are data."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().as_subclass(torch.Tensor).clone()
    if isinstance(value, dict):
        return {key: item for key, item in ((k, _data(v)) for k, v in value.items()) if item is not _NOT_DATA}
    if isinstance(value, list | tuple):
        items = [item for item in map(_data, value) if item is not _NOT_DATA]
        return items if isinstance(value, list) else tuple(items)
    return _NOT_DATA


def _restoring(stage: Callable, namespaces) -> Callable:
    """``stage`` as the training calls it, with what the call patched put back after each call."""
    def call(*args, **kwargs):
        try:
            return stage(*args, **kwargs)
        finally:
            namespaces.restore()

    call.__name__ = getattr(stage, "__name__", "stage")
    return call
