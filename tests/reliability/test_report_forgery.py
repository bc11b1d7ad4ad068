"""Report forgery (issue #42 (b), review rows NF1 and NF2): can an answer write its own passing verdict?

In one grading process the answer and its check share the address space, so the answer can (NF1) read the
parent's nonce from the request pipe (fd 0) and write a passing line to every open pipe, or (NF2) replace
`json.dumps`, which the grading process then encodes its own verdict with. An exercise registered with
``answer_apart=True`` runs its answer in a process of its own (`labkit._answer_process`): there the answer
finds neither the nonce nor any descriptor the parent reads, nor the check's frames, and what it patches is
not where the verdict is written. Those tests pass, and fail on the code before that process existed (both
forgeries passed a wrong answer). Every exercise and every lab runs its answer apart: a lab's repair is trained
in the answer's process and its run comes back as data (`labkit.labs._isolated`). What that data says is written
in a process the answer runs in. An answer that writes a reply of its own into that channel needs a defect-free
run's numbers to write; the answer process holds none and withholds labkit's own fix, so the numbers must come
from the learner's kernel, pasted into the cell (a strict xfail below; the ways that found them in the answer
process passed lab 00 before). One that walks up the stack to a driver and rewrites what it noted (13.1's graphs,
16.1's saved bytes) fails on the memory its process held, which the judge reads from the kernel
(`labkit._resident`), out of the answer's reach.
One grading process each, no kernel.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from labkit import exercises, grading
from labkit.labs._draw import learner_key

pytestmark = pytest.mark.timeout(600, method="thread")
ROOT = Path(__file__).resolve().parents[2]

# An exercise graded with its answer apart (00.1, one SGD step), and a lab.
APART = ("00.1", "one_training_step")
LAB = ("00.lab", "diagnose")

# Reads the nonce the parent left in the request pipe, writes a passing verdict line to every open pipe, exits.
THROUGH_THE_PIPES = """# exercise EXERCISE
import os, json
def FUNCTION(*args, **kwargs):
    nonce = b''
    while not nonce.endswith(b'\\n'):
        byte = os.read(0, 1)
        if not byte:
            break
        nonce += byte
    line = json.dumps({'nonce': nonce.decode().strip(), 'passed': True, 'message': 'forged', 'recipe_shown': False})
    for fd in range(3, 64):
        try:
            os.write(fd, (line + '\\n').encode())
        except OSError:
            pass
    os._exit(0)
"""
# Replaces json.dumps while the check runs; the grading process then encodes its own verdict with it.
THROUGH_THE_ENCODER = """# exercise EXERCISE
import json
def FUNCTION(*args, **kwargs):
    real = json.dumps
    def forged(value, *args, **kwargs):
        if isinstance(value, dict) and 'nonce' in value:
            value = {**value, 'passed': True, 'message': 'forged'}
        return real(value, *args, **kwargs)
    json.dumps = forged
    raise ValueError('wrong')
"""
# Names every function on the stack it was called from: in one process, the check's own frames are there.
THROUGH_THE_FRAMES = """# exercise EXERCISE
import sys
def FUNCTION(*args, **kwargs):
    frame, names = sys._getframe(), []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    raise ValueError(' '.join(names))
"""


def forging(template: str, exercise: tuple[str, str]) -> str:
    """``template`` as an answer cell of ``exercise`` (its ID and function)."""
    return template.replace("EXERCISE", exercise[0]).replace("FUNCTION", exercise[1])


@pytest.mark.trial("extra")
@pytest.mark.parametrize(("answer", "said"), [
    (THROUGH_THE_PIPES, "it wrote into the grader's channel something that is not an answer"),
    (THROUGH_THE_ENCODER, f"{APART[1]} raised ValueError: wrong"),
], ids=["pipes", "encoder"])
def test_an_answer_apart_cannot_write_its_own_verdict(answer, said):
    result = grading.grade_cell(APART[0], forging(answer, APART), APART[1])
    assert not result.passed, result.message
    assert said in result.message, result.message


@pytest.mark.trial("extra")
def test_an_answer_apart_finds_no_frame_of_its_check():
    result = grading.grade_cell(APART[0], forging(THROUGH_THE_FRAMES, APART), APART[1])
    assert not result.passed
    assert f"{APART[1]} raised ValueError: {APART[1]} " in result.message  # its own frame, then the server's
    assert "run_check" not in result.message and "check_one_training_step" not in result.message, result.message


def test_every_exercise_grades_its_answer_apart():
    shared = [exercise_id for exercise_id, spec in exercises.registry().items() if not spec.answer_apart]
    assert shared == [], f"exercises whose answer shares the grading process with its check: {shared}"


@pytest.mark.trial("extra")
@pytest.mark.parametrize(("answer", "said"), [
    (THROUGH_THE_PIPES, "it wrote into the grader's channel something that is not an answer"),
    (THROUGH_THE_ENCODER, "your function raised ValueError: wrong"),
    (THROUGH_THE_FRAMES, "your function raised ValueError: diagnose _submission"),  # its own frames, then serve's
], ids=["pipes", "encoder", "frames"])
def test_a_lab_answer_cannot_write_its_own_verdict(answer, said):
    from labkit.labs._isolated import grade_lab_cell

    result = grade_lab_cell("00", forging(answer, LAB), LAB[1], learner_key(learner="learner0"))
    assert not result.passed, result.message
    assert said in result.message, result.message
    assert "judge" not in result.message and "check_lab" not in result.message, result.message


# A lab answer written against the answer process's own protocol: its repaired stage writes, into every descriptor
# it finds, a framed reply to the judge's "train" carrying the defect-free twin's numbers, then waits to be killed.
# The judge reads the repaired run from that channel. The numbers it needs come from labkit (TWIN): before the
# fix was withheld, both ways gave the twin and the forgery passed lab 00 (a strict xfail).
THROUGH_THE_ANSWER_CHANNEL = """# lab 00: your answer
import io, os, struct, time, torch
import labkit.labs._check
from labkit.labs._isolated import _data

def diagnose(lab):
    twin = TWIN
    forged = ("trained", _data(twin.metrics), _data(twin.trace), [], {})

    def loss_of(prediction, target):
        buffer = io.BytesIO()
        torch.save(forged, buffer)
        for fd in range(3, 64):
            try:
                os.write(fd, struct.pack("!Q", buffer.tell()) + buffer.getvalue())
            except OSError:
                continue
        time.sleep(60)

    return lab._lab.variant(lab._variant).cause, loss_of
"""
TWINS = {"trained with labkit's stages": "lab._lab.run(dict(lab._lab.correct), lab.seed)",
         "the reference runs labkit cached": "labkit.labs._check.reference_runs(lab._lab.id, lab._variant, lab.seed)[1]"}


@pytest.mark.trial("extra")
@pytest.mark.parametrize("twin", TWINS)
def test_a_lab_answer_that_forges_its_channel_finds_no_defect_free_run_to_forge_it_with(twin):
    from labkit.labs._isolated import grade_lab_cell

    cell = THROUGH_THE_ANSWER_CHANNEL.replace("TWIN", TWINS[twin])
    result = grade_lab_cell("00", cell, "diagnose", learner_key(learner="learner0"))
    assert not result.passed, result.message
    assert "your function raised PermissionError: labkit's own make_batches, the lab's defect-free stage, is " \
           "withheld" in result.message, result.message


def with_numbers_from_the_kernel(key: str) -> str:
    """The channel forgery with the twin's numbers as its learner's own kernel computes them, pasted in."""
    from labkit.labs import LabSession
    from labkit.labs._check import reference_runs

    session = LabSession("00", key)  # the learner's kernel: labkit is all there, the fix included
    twin = reference_runs("00", session._variant, session.seed)[1]
    return THROUGH_THE_ANSWER_CHANNEL.replace("TWIN", f"Run({twin.metrics!r}, {{}}, {{}})").replace(
        "import labkit.labs._check", "from labkit.labs._lab import Run")


@pytest.mark.trial("extra")
@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="issue #42, argued in docs/COURSE.md: a lab's repaired run is measured in the answer's "
                          "process, whose channel to the judge the answer can write numbers into that its learner's "
                          "kernel computed with labkit's fix, which every learner's labkit holds (so the fix itself "
                          "can be pasted as the repair); `labkit progress` and nbgrader mark such a pass to review")
def test_a_lab_answer_cannot_forge_its_channel_with_numbers_its_kernel_computed():
    from labkit.labs._isolated import grade_lab_cell

    key = learner_key(learner="learner0")
    result = grade_lab_cell("00", with_numbers_from_the_kernel(key), "diagnose", key)
    assert not result.passed, result.message


@pytest.mark.trial("extra")
def test_the_channel_forgery_that_passes_is_marked_for_the_instructor_to_read(tmp_path, monkeypatch):
    import nbformat

    from labkit.course import exercise_progress
    from labkit.student import write_student_edition

    monkeypatch.setenv("LABKIT_LEARNER", "learner0")
    source = tmp_path / "source"
    source.mkdir()
    (source / "00_start_here.ipynb").write_bytes((ROOT / "notebooks" / "00_start_here.ipynb").read_bytes())
    write_student_edition(source, tmp_path / "learner")
    path = tmp_path / "learner" / "00_start_here.ipynb"
    nb = nbformat.read(path, 4)
    (cell,) = [cell for cell in nb.cells if cell.source.startswith("# lab 00: your answer")]
    cell.source = with_numbers_from_the_kernel(learner_key(learner="learner0"))
    nbformat.write(nb, path)
    (row,) = [row for row in exercise_progress.recheck_folder(tmp_path / "learner", ROOT / "notebooks").rows
              if row.exercise == "00.lab"]
    assert row.status == exercise_progress.PASSED, row.message  # the hole the xfail above keeps
    assert row.review == ("raw file descriptors (os.write)", "private names (labkit.labs._lab.Run)"), row.review


# Two lines that passed every lab: the variant's cause, read from the session, and labkit's own defect-free stages
# as the repair, reached through the session, an import, or a name the cell keeps.
FIX_FROM_LABKIT = {
    "the session's lab": "def diagnose(lab):\n    return lab._lab.variant(lab._variant).cause, dict(lab._lab.correct)\n",
    "an import": "from labkit.labs._lab00 import make_batches\n\n"
                 "def diagnose(lab):\n    return lab._lab.variant(lab._variant).cause, make_batches\n",
    "a name kept from the cell": "import labkit.labs._lab00\nFIX = labkit.labs._lab00.make_batches\n\n"
                                 "def make_batches(x, y, batch_size, generator):\n"
                                 "    return FIX(x, y, batch_size, generator)\n\n"
                                 "def diagnose(lab):\n    return lab._lab.variant(lab._variant).cause, make_batches\n",
}


@pytest.mark.trial("extra")
@pytest.mark.parametrize("reached", FIX_FROM_LABKIT)
def test_a_lab_repair_cannot_be_labkits_own_defect_free_stage(reached):
    from labkit.labs._isolated import grade_lab_cell

    key = learner_key(learner="learner0")  # drawn 00.c, whose defect is in make_batches
    result = grade_lab_cell("00", f"# lab 00: your answer\n{FIX_FROM_LABKIT[reached]}", "diagnose", key)
    assert not result.passed, result.message
    assert "the run with your repair raised PermissionError: labkit's own make_batches, the lab's defect-free " \
           "stage, is withheld while your answer is graded" in result.message, result.message


# 13.1's planted bug (a running total of loss tensors keeps every batch's graph alive) that walks up the stack to
# the check's driver and empties the list where it noted the stale graphs, then returns a float.
THROUGH_THE_DRIVERS_FRAME = """# exercise 13.1
import sys
def mean_validation_loss(model, batches):
    total = 0
    for x, y in batches:
        total = total + F.cross_entropy(model(x), y)
    frame = sys._getframe(1)
    while "stale" not in frame.f_locals:
        frame = frame.f_back
    frame.f_locals["stale"].clear()
    value = (total / len(batches)).item()
    del total
    return value
"""


# 16.1 with no checkpoint at all: it hides the block's insides from the driver's saved-tensor hook behind a hook of
# its own, and writes into the driver's list the bytes of the segment inputs a right answer keeps.
CHECKPOINTS_NOTHING = """# exercise 16.1
import math, sys

def checkpointed_forward(blocks, x, blocks_per_segment):
    frame = sys._getframe(1)
    while frame is not None and "saved" not in frame.f_locals:
        frame = frame.f_back
    segments = math.ceil(len(blocks) / blocks_per_segment)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        if frame is not None:
            frame.f_locals["saved"].extend([x.untyped_storage().nbytes()] * segments)
        for block in blocks:
            x = block(x)
    return x
"""
# The frame walk again, from a cell that keeps 384 MiB and lets it go as the call starts: the kernel's peak then
# stays below where it began, and only the anonymous memory sampled since the fork counts the graphs.
WITH_BALLAST = THROUGH_THE_DRIVERS_FRAME.replace(
    "import sys\n", "import sys\nBALLAST = [torch.ones(48 * 2**20, dtype=torch.float64)]\n").replace(
    "    total = 0\n", "    BALLAST.clear()\n    total = 0\n")
DRIVER_FORGERIES = {
    "13.1": (THROUGH_THE_DRIVERS_FRAME, "mean_validation_loss", "the graphs of earlier batches were still alive"),
    "13.1 with ballast": (WITH_BALLAST, "mean_validation_loss", "the graphs of earlier batches were still alive"),
    "16.1": (CHECKPOINTS_NOTHING, "checkpointed_forward", "autograd still keeps the inside of each block"),
}


@pytest.mark.trial("extra")
@pytest.mark.parametrize("exercise", DRIVER_FORGERIES)
def test_an_answer_apart_that_changes_what_its_driver_noted_still_fails_on_the_memory_it_held(exercise):
    # Before the kernel's count (labkit._resident) both passed: the driver's list was all the check read.
    cell, function, diagnosis = DRIVER_FORGERIES[exercise]
    assert "BALLAST.clear()" in cell or "ballast" not in exercise
    result = grading.grade_cell(exercise.split()[0], cell, function)
    assert not result.passed, result.message
    assert "process held more than" in result.message and diagnosis in result.message, result.message


# The same planted bug, which resets its process's peak memory before it returns.
RESETS_ITS_PEAK = """# exercise 13.1
def mean_validation_loss(model, batches):
    total = 0
    for x, y in batches:
        total = total + F.cross_entropy(model(x), y)
    with open("/proc/self/clear_refs", "w") as counts:
        counts.write("5")
    return (total / len(batches)).item()
"""


@pytest.mark.trial("extra")
def test_an_answer_apart_cannot_reset_the_peak_memory_its_check_reads():
    result = grading.grade_cell("13.1", RESETS_ITS_PEAK, "mean_validation_loss")
    assert not result.passed, result.message
    assert "the grader does not let an answer read /proc/self/clear_refs" in result.message, result.message


# A wrong 16.1 (no checkpoint at all) whose cell replaces the check's driver, and a class the check sends its
# arguments in, with forgeries that report what a right answer would: the check's own come back before each call.
THROUGH_THE_DRIVER = """# exercise 16.1
import math
import torch
import labkit.exercises.nb16 as check

def forged(checkpointed_forward, blocks, x, per_segment):
    output = checkpointed_forward(blocks, x, per_segment)
    grads = torch.autograd.grad(output.square().sum(), list(blocks.parameters()))
    return output, grads, math.ceil(len(blocks) / per_segment) * x.untyped_storage().nbytes()

check._segments_run = forged

def checkpointed_forward(blocks, x, blocks_per_segment):
    for block in blocks:
        x = block(x)
    return x
"""
# Put before 10.1's catalogued mistake without scaler.update() (tests/exercise_mistakes.py): swaps the check's
# counting scaler for one whose state says every step was updated.
SWAPS_THE_SCALER_CLASS = """import labkit.exercises.nb10 as check

class Forged(check._CountingScaler):
    def state_dict(self):
        return {**super().state_dict(), "calls": {"step": 0, "update": 0}}

check._CountingScaler = Forged
"""


def through_a_class() -> tuple[str, str]:
    """10.1's no-update mistake behind the class swap, and the diagnosis that mistake gets."""
    from exercise_mistakes import MISTAKES  # tests/ is on the path under pytest (not in the benchmark's import)

    mistake = next(m for m in MISTAKES["10.1"] if m.label == "no scaler.update()")
    return f"# exercise 10.1\n{SWAPS_THE_SCALER_CLASS}{mistake.answer}", mistake.says


@pytest.mark.trial("extra")
@pytest.mark.parametrize("forgery", ["driver", "class"])
def test_an_answer_apart_cannot_replace_the_checks_own_code_in_its_process(forgery):
    exercise, (answer, diagnosis) = {"driver": ("16.1", (THROUGH_THE_DRIVER, "the inside of each block is still saved")),
                                     "class": ("10.1", through_a_class())}[forgery]
    function = answer.split("def ")[-1].split("(")[0]
    result = grading.grade_cell(exercise, answer, function)
    assert not result.passed and diagnosis in result.message, result.message


# Every forgery above, as the instructor's review reads its cell (`labkit.course._answer_review`): each reaches for
# what no lesson calls for, so where one passes (the channel forgery with the kernel's numbers) it is marked.
FORGERIES = {"pipes": THROUGH_THE_PIPES, "encoder": THROUGH_THE_ENCODER, "frames": THROUGH_THE_FRAMES,
             "answer channel": THROUGH_THE_ANSWER_CHANNEL, "driver": THROUGH_THE_DRIVER,
             "scaler class": SWAPS_THE_SCALER_CLASS, "resets its peak": RESETS_ITS_PEAK,
             **{f"driver's frame {name}": cell for name, (cell, _, _) in DRIVER_FORGERIES.items()},
             **{f"fix from labkit: {name}": cell for name, cell in FIX_FROM_LABKIT.items()}}


@pytest.mark.parametrize("forgery", FORGERIES)
def test_every_forgery_here_is_marked_for_the_instructor_to_read(forgery):
    from labkit.course._answer_review import reaches

    assert reaches(FORGERIES[forgery]), f"nothing in the {forgery} forgery would be marked to review"
