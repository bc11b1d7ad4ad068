"""The verdict that counts comes from a grading process of its own: what an answer cell does (patch the grader
or torch, exit, crash, hang, ignore the time limit, start processes, read the solutions) fails only its own
exercise, in `labkit progress` and in the learner's kernel alike (reliability trials PG5, PG7, PG8, PG10-PG15,
PG21, PG24, PG28, PG30). No kernel starts here: each case is one plain child process (`grading.grade_cell`).
"""

from __future__ import annotations

import linecache
import os
import shutil
import signal
import time
from pathlib import Path

import nbformat
import pytest
import torch

from labkit import grading, student
from labkit.course import exercise_progress
from labkit.errors import LabkitError

ROOT = Path(__file__).resolve().parents[2]
# Each case starts a grading process (Python, torch, labkit: seconds, many more on a loaded machine).
pytestmark = pytest.mark.timeout(900, method="thread")
NAME = "00_start_here.ipynb"
SOLUTIONS = student.find_exercises(nbformat.read(ROOT / "notebooks" / NAME, 4), NAME)
# A distinctive command line, so the test finds the process an answer started and nothing else.
SLEEPER = ["sleep", "313"]


def stub_cell(exercise_id: str) -> str:
    return student.stub_solution(SOLUTIONS[exercise_id].solution, exercise_id)


def answer_cell(exercise_id: str) -> str:
    """The solution as a learner would type it: the solution markers gone."""
    return "\n".join(line for line in SOLUTIONS[exercise_id].solution.split("\n")
                     if line.strip() not in (student.BEGIN_SOLUTION, student.END_SOLUTION))


def grade(exercise_id: str, source: str) -> grading.Result:
    return grading.grade_cell(exercise_id, source, SOLUTIONS[exercise_id].function)


@pytest.fixture
def short_limit(monkeypatch):
    """A 1 s check limit, so an answer that defeats it costs seconds, not the default's minute."""
    monkeypatch.setattr(grading, "CHECK_TIME_LIMIT_S", 1.0)


# Each tried in turn by one cell (PG6, PG8, PG9, PG13, PG15), which then says which of them were refused.
FORBIDDEN = {
    "read the solution": "import pathlib, labkit\n"
                         f"(pathlib.Path(labkit.__file__).parents[1] / 'notebooks' / {NAME!r}).read_text()",
    "write outside": "open('/tmp/labkit-isolation-pwned', 'w').write('x')",
    "start a process": f"import subprocess\nsubprocess.Popen({SLEEPER!r})",
    "ctypes": "import ctypes\nctypes.string_at(0)",
    "signal the grader": "import os, signal\nos.kill(os.getppid(), signal.SIGCONT)",
    "allocate 3 GiB": "bytearray(3 * 2**30)",
}


@pytest.mark.trial("PG6")
@pytest.mark.trial("PG8")
@pytest.mark.trial("PG9")
@pytest.mark.trial("PG13")
@pytest.mark.trial("PG15")
def test_what_an_answer_must_not_do_is_refused_in_the_grading_process():
    tries = "".join(f"try:\n    exec({code!r})\nexcept (PermissionError, MemoryError):\n    refused.append({name!r})\n"
                    for name, code in FORBIDDEN.items())
    cell = ("# exercise 00.1\nrefused = []\n" + tries +
            "def one_training_step(model, optimizer, x, y):\n    raise ValueError('/'.join(refused))\n")
    result = grade("00.1", cell)
    assert f"one_training_step raised ValueError: {'/'.join(FORBIDDEN)}" in result.message
    assert not Path("/tmp/labkit-isolation-pwned").exists()
    assert not _processes_running(SLEEPER)


@pytest.mark.trial("PG14")
@pytest.mark.parametrize(("code", "said"), [
    ("raise KeyboardInterrupt", "the exercise cell raised KeyboardInterrupt"),  # PG14
    ("import os\nos.abort()", "crashed the grading process (SIGABRT)"),  # PG15
], ids=["KeyboardInterrupt", "a crash"])
def test_a_cell_that_interrupts_or_crashes_is_a_verdict(code, said):
    result = grade("00.1", stub_cell("00.1") + "\n" + code)
    assert not result.passed
    assert said in result.message


@pytest.mark.trial("PG10")
def test_a_cell_that_ignores_the_alarm_and_loops_is_stopped(short_limit):
    code = "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass"
    result = grade("00.1", stub_cell("00.1") + "\n" + code)
    assert not result.passed
    # the CPU cap, or on a loaded machine the wall-clock bound, whichever comes first
    assert "(the grader stopped it)" in result.message


@pytest.mark.trial("PG11")
def test_a_cell_that_swallows_the_stop_and_waits_is_stopped_by_the_wall_clock(short_limit):
    code = "import time\nwhile True:\n    try:\n        time.sleep(0.5)\n    except BaseException:\n        pass"
    started = time.monotonic()
    result = grade("00.1", stub_cell("00.1") + "\n" + code)
    assert "did not finish within 6 s of waiting" in result.message
    assert time.monotonic() - started < grading.CHECK_TIME_LIMIT_S * 6 + exercise_progress_startup_bound()


def exercise_progress_startup_bound() -> float:
    from labkit import _grader_process

    return _grader_process.STARTUP_ALLOWANCE_S


@pytest.mark.trial("PG12")
def test_a_thread_the_answer_leaves_behind_does_not_keep_the_grader_waiting():
    code = "import threading, time\nthreading.Thread(target=time.sleep, args=(300,)).start()"
    started = time.monotonic()
    assert grade("00.1", answer_cell("00.1") + "\n" + code).passed
    assert time.monotonic() - started < 300


@pytest.mark.trial("PG28")
def test_a_torch_patch_at_cell_level_cannot_pass_a_wrong_answer():
    wrong = ("# exercise 00.2\ntorch.Tensor.abs = lambda self: self * 0\n\n"
             "def grad_of_each_call(w, inputs):\n    return [torch.full_like(w, 123.0) for _ in inputs]\n")
    result = grade("00.2", wrong)
    assert not result.passed, result.message


@pytest.mark.trial("PG28")
def test_in_the_learners_kernel_check_grades_the_exercise_cell_apart(monkeypatch, capsys):
    monkeypatch.setattr(grading, "_SESSION", {})
    monkeypatch.setattr(grading, "_FAILED_TRIES", {})
    monkeypatch.setattr(torch.Tensor, "abs", torch.Tensor.abs)  # the cell below replaces it; put it back after
    wrong = ("# exercise 00.2\ntorch.Tensor.abs = lambda self: self * 0\n\n"
             "def grad_of_each_call(w, inputs):\n    return [torch.full_like(w, 123.0) for _ in inputs]\n")
    cell_file = "/tmp/ipykernel_4242/1234567.py"  # how IPython names a cell's code, which linecache holds
    monkeypatch.setitem(linecache.cache, cell_file, (len(wrong), None, wrong.splitlines(True), cell_file))
    namespace = dict(grading.EXERCISE_NAMESPACE)
    exec(compile(wrong, cell_file, "exec"), namespace)  # noqa: S102 (the cell, as the kernel runs it)
    grading.check("00.2", namespace["grad_of_each_call"])
    assert capsys.readouterr().out.startswith("✗ Exercise 00.2 not yet")


# ---- progress: a whole folder, one learner cell cannot stop or fool the run ----------------------


@pytest.fixture
def learner(tmp_path) -> Path:
    """A learner's folder holding the student edition of 00, untouched."""
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(ROOT / "notebooks" / NAME, source)
    student.write_student_edition(source, tmp_path / "learner")
    return tmp_path / "learner"


def set_cell(folder: Path, exercise_id: str, source: str) -> None:
    nb = nbformat.read(folder / NAME, 4)
    (cell,) = [cell for cell in nb.cells if student.exercise_id_of(cell) == exercise_id]
    cell.source = source
    nbformat.write(nb, folder / NAME)


@pytest.mark.trial("PG5")
@pytest.mark.trial("PG7")
@pytest.mark.trial("PG30")
def test_progress_grades_every_exercise_after_a_cell_that_patches_the_grader_or_exits(learner):
    other = "02_gradients_accumulate.ipynb"  # a second notebook, untouched: its exercises count, the rest do not
    student.write_student_edition(ROOT / "notebooks", learner.parent / "all")
    shutil.copy(learner.parent / "all" / other, learner)
    patch = ("import labkit.grading as g\n"
             "g.run_check = lambda eid, answer, **k: g.Result(eid, '00_start_here', True, 'trust me')\n"
             "g.grade_cell = g.run_check\nimport os\nos._exit(0)")
    set_cell(learner, "00.1", stub_cell("00.1") + "\n" + patch)
    set_cell(learner, "00.2", answer_cell("00.2"))
    report = exercise_progress.recheck_folder(learner)
    statuses = {row.exercise: row.status for row in report.rows}
    assert statuses == {"00.1": "not yet", "00.2": "passed", "00.lab": "not yet", "02.1": "not yet", "02.2": "not yet",
                        "02.lab": "not yet"}
    assert "Total: 1/6 exercises passed (5 not yet, 0 not run)" in exercise_progress.progress_table(report.rows)


@pytest.mark.trial("PG24")
def test_a_solution_copy_without_its_markers_is_still_a_copy(learner):
    nb = nbformat.read(ROOT / "notebooks" / NAME, 4)
    for cell in nb.cells:
        cell.source = "\n".join(line for line in cell.source.split("\n")
                                if line.strip() not in (student.BEGIN_SOLUTION, student.END_SOLUTION))
    nbformat.write(nb, learner / NAME)
    assert exercise_progress.recheck_folder(learner).skipped == [NAME]


@pytest.mark.trial("PG21")
def test_a_fifo_named_like_a_notebook_is_a_clear_error(learner):
    (learner / NAME).unlink()
    os.mkfifo(learner / NAME)
    with pytest.raises(LabkitError, match="is not a regular file"):
        exercise_progress.recheck_folder(learner)


def test_a_pass_after_the_recipe_is_said_in_the_report(learner):
    nb = nbformat.read(learner / NAME, 4)
    (cell,) = [cell for cell in nb.cells if student.exercise_id_of(cell) == "00.2"]
    cell.source = answer_cell("00.2")
    payload = {"exercise": "00.2", "notebook": "00_start_here", "passed": True, "message": "✓", "after_recipe": True}
    check = next(cell for cell in nb.cells if cell.cell_type == "code" and 'grading.check("00.2"' in cell.source)
    check.outputs = [nbformat.v4.new_output("display_data", data={grading.GRADE_MIMETYPE: payload})]
    nbformat.write(nb, learner / NAME)
    report = exercise_progress.recheck_folder(learner)
    assert {row.exercise: row.after_recipe for row in report.rows}["00.2"] is True
    assert exercise_progress.AFTER_RECIPE in exercise_progress.progress_table(report.rows)


def _processes_running(command: list[str]) -> list[int]:
    """The PIDs running exactly ``command``; any found are killed (an answer's leftover, started by this test)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")[:-1]
        except OSError:
            continue
        if [arg.decode(errors="replace") for arg in argv] == command:
            found.append(int(entry.name))
            os.kill(int(entry.name), signal.SIGKILL)
    return found


# --- the zygote (labkit._grader_zygote): one import, a fresh forked process per answer ---

def _raised(result: grading.Result) -> str:
    return result.message.split("raised RuntimeError: ", 1)[1].split(".")[0].split(" ")[0]


def test_each_answer_runs_in_a_fresh_process_forked_from_a_zygote_that_no_answer_reached():
    from labkit import _grader_process
    patcher = "import os, torch\ntorch.tensor = None\nos.environ['LEFT_BEHIND'] = '1'\nraise RuntimeError(str(os.getpid()))\n"
    looker = ("import os, torch\n"
              "raise RuntimeError(f\"{os.getpid()}-{torch.tensor is None}-{'LEFT_BEHIND' in os.environ}\")\n")
    first = _raised(grade("00.1", patcher))
    second_pid, patched, left = _raised(grade("00.1", looker)).split("-")
    zygote = _grader_process._zygote().process.pid
    assert len({first, second_pid, str(zygote)}) == 3
    assert (patched, left) == ("False", "False")


def test_answers_are_graded_on_the_cpu_with_no_gpu_in_sight():
    looker = ("import os, torch\n"
              "raise RuntimeError(f\"[{os.environ.get('CUDA_VISIBLE_DEVICES')}]-{torch.cuda.device_count()}\")\n")
    assert _raised(grade("00.1", looker)) == "[]-0"


def test_a_zygote_that_ended_is_replaced_and_an_interrupted_check_leaves_no_stale_reply(monkeypatch):
    from labkit import _grader_process
    _grader_process._zygote().process.kill()
    assert grade("00.1", answer_cell("00.1")).passed

    def interrupted(stream, wall_limit_s):
        raise KeyboardInterrupt

    monkeypatch.setattr(_grader_process, "_collect", interrupted)
    zygote = _grader_process._zygote()
    with pytest.raises(KeyboardInterrupt):
        grade("00.1", answer_cell("00.1"))
    assert zygote.process.poll() is not None  # discarded: its next reply would have been the stopped child's
    monkeypatch.undo()
    assert "exit code 3" in grade("00.1", "import os\nos._exit(3)\n").message
    assert grade("00.1", answer_cell("00.1")).passed


# --- an answer graded apart (labkit._answer_process): its own process, confined as the grading process was ---

APART = "06.1"  # registered answer_apart=True: the check calls adamw_update across a process boundary
APART_FUNCTION = "adamw_update"


def apart_cell(body: str, prelude: str = "") -> str:
    """An answer cell for 06.1 whose function runs ``body`` (indented lines) when the check calls it."""
    return f"# exercise {APART}\n{prelude}\ndef {APART_FUNCTION}(*args, **kwargs):\n{body}\n"


def test_an_answer_apart_is_refused_what_an_answer_must_not_do_and_holds_no_pipe_of_the_grader():
    tries = "".join(f"    try:\n        exec({code!r})\n    except (PermissionError, MemoryError):\n"
                    f"        refused.append({name!r})\n" for name, code in FORBIDDEN.items())
    body = ("    import os\n    refused = []\n" + tries +
            "    raise ValueError('/'.join(refused) + f' stdin {os.read(0, 1)!r}')\n")
    result = grading.grade_cell(APART, apart_cell(body), APART_FUNCTION)
    # every refusal as in the grading process; fd 0 is /dev/null, not the pipe that holds the nonce
    assert f"{APART_FUNCTION} raised ValueError: {'/'.join(FORBIDDEN)} stdin b''" in result.message
    assert not Path("/tmp/labkit-isolation-pwned").exists()
    assert not _processes_running(SLEEPER)


@pytest.mark.parametrize(("body", "said"), [
    ("    import os\n    os.abort()", "crashed the grading process (SIGABRT)"),
    ("    import os\n    os._exit(3)", "ended the grading process (exit code 3)"),
    ("    raise KeyboardInterrupt('stop')", f"{APART_FUNCTION} raised KeyboardInterrupt: stop"),
    ("    import signal\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n    while True:\n        pass",
     "(the grader stopped it)"),
    # the judge once raised OSError here: it tried to set SIGKILL's handler to die the same way
    ("    import signal\n    signal.raise_signal(signal.SIGKILL)", "used more CPU time or memory than a check allows"),
    ("    import os\n    for fd in range(3, 64):\n        try:\n            os.write(fd, b'not a reply')\n"
     "        except OSError:\n            continue", "it wrote into the grader's channel something that is not an answer"),
    ("    import contextlib, os, time\n    for fd in range(3, 64):\n        with contextlib.suppress(OSError):\n"
     "            os.close(fd)\n    time.sleep(60)", "it wrote into the grader's channel something that is not an answer"),
], ids=["a crash", "an exit", "KeyboardInterrupt", "an endless loop that ignores the alarm", "a SIGKILL of its own",
        "bytes written into the channel", "the channel closed by a process that lives on"])
def test_an_answer_apart_that_crashes_exits_or_loops_is_a_verdict(body, said, short_limit):
    result = grading.grade_cell(APART, apart_cell(body), APART_FUNCTION)
    assert not result.passed
    assert said in result.message, result.message


def test_an_answer_apart_that_sleeps_in_the_call_is_stopped_by_the_wall_clock(short_limit):
    body = "    import time\n    while True:\n        try:\n            time.sleep(0.5)\n        except BaseException:\n            pass"
    result = grading.grade_cell(APART, apart_cell(body), APART_FUNCTION)
    assert not result.passed
    assert "6 s of waiting" in result.message, result.message
