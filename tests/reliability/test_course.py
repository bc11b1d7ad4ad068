"""The course tools under bad input and hostile answers: grading.check (time limit, global state,
comparisons an answer cannot patch, exits), the student edition (a learner's work is never lost)
and `progress` / `claims` over malformed notebooks (a LabkitError naming the file)."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
import warnings
from dataclasses import asdict

import nbformat
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit import _check_sandbox, claims_report, grading, records, student
from labkit.__main__ import main as labkit_main
from labkit.course import exercise_progress
from labkit.errors import LabkitError

SHORT_LIMIT_S = 1.0


@pytest.fixture(scope="module", autouse=True)
def warmed_up_checks():
    """Pay torch's one-off first-use costs (lazy imports on the first optimizer step) before the
    tests that run checks under a one-second limit."""
    assert grading.run_check("00.1", correct_step).passed
    assert grading.run_check("03.1", layer_norm_rows).passed


def correct_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


def layer_norm_rows(x, eps):
    centred = x - x.mean(dim=-1, keepdim=True)
    return centred / torch.sqrt(centred.pow(2).mean(dim=-1, keepdim=True) + eps)


# ---- grading.check: IDs, time limit, exits ---------------------------------------------------------


@pytest.mark.trial("G1b")
@pytest.mark.parametrize("bad_id", [["00.1"], {"00.1": 1}, 0.1])
def test_an_unhashable_or_non_string_id_is_a_labkit_error(bad_id):
    with pytest.raises(LabkitError, match="no exercise .*copy the ID"):
        grading.check(bad_id, correct_step)


@pytest.mark.trial("G4")
def test_an_endless_loop_is_stopped_and_the_notebook_goes_on(monkeypatch, capsys):
    def spinning_step(model, optimizer, x, y):
        while True:
            pass

    monkeypatch.setattr(grading, "CHECK_TIME_LIMIT_S", SHORT_LIMIT_S)
    monkeypatch.setattr(grading, "_SESSION", {})
    started = time.monotonic()
    grading.check("00.1", spinning_step)
    assert time.monotonic() - started < 10 * SHORT_LIMIT_S
    out = capsys.readouterr().out
    assert out.startswith("✗ Exercise 00.1 not yet: your function spinning_step did not return within 1 s")
    # the next check in the same kernel runs normally
    assert grading.run_check("00.1", correct_step).passed


@pytest.mark.trial("G4b")
def test_a_blocking_sleep_is_stopped():
    def sleeping_step(model, optimizer, x, y):
        time.sleep(3600)

    started = time.monotonic()
    result = grading.run_check("00.1", sleeping_step, time_limit_s=SHORT_LIMIT_S)
    assert time.monotonic() - started < 10 * SHORT_LIMIT_S
    assert not result.passed
    assert "sleeping_step did not return within 6 s of waiting" in result.message


@pytest.mark.trial("extra")
def test_an_answer_that_swallows_exceptions_is_still_stopped():
    def stubborn_step(model, optimizer, x, y):
        while True:
            try:
                time.sleep(10)
            except Exception:
                pass

    result = grading.run_check("00.1", stubborn_step, time_limit_s=SHORT_LIMIT_S)
    assert "did not return within 6 s of waiting" in result.message


@pytest.mark.trial("extra")
def test_a_check_in_a_worker_thread_is_stopped_by_the_watchdog():
    def spinning_step(model, optimizer, x, y):
        while True:
            pass

    results = []
    worker = threading.Thread(
        target=lambda: results.append(grading.run_check("00.1", spinning_step, time_limit_s=SHORT_LIMIT_S))
    )
    worker.start()
    worker.join(30)
    assert not worker.is_alive()
    assert "spinning_step did not return within 1 s" in results[0].message


@pytest.mark.trial("extra")
def test_a_harness_alarm_keeps_its_deadline_across_a_check():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30)
        assert grading.run_check("00.1", correct_step).passed
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < remaining <= 30
        assert signal.getsignal(signal.SIGALRM) is not None and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.trial("extra")
@pytest.mark.parametrize("limit", [0, -1, float("inf"), float("nan"), "5", True])
def test_a_nonsense_time_limit_is_a_labkit_error(limit):
    with pytest.raises(LabkitError, match="time_limit_s must be a positive number"):
        grading.run_check("00.1", correct_step, time_limit_s=limit)


@pytest.mark.trial("G8f")
@pytest.mark.parametrize("leave", [lambda: sys.exit("student called exit()"), lambda: exit(3)])
def test_sys_exit_in_an_answer_is_a_not_yet_line(leave, monkeypatch, capsys):
    def exiting_step(model, optimizer, x, y):
        leave()

    monkeypatch.setattr(grading, "_SESSION", {})
    grading.check("00.1", exiting_step)
    out = capsys.readouterr().out
    assert out.startswith("✗ Exercise 00.1 not yet: exiting_step called exit() (SystemExit")
    assert "Hint: return the result instead of calling sys.exit() or exit()." in out


@pytest.mark.trial("extra")
def test_ctrl_c_stops_the_check_says_so_and_records_nothing(monkeypatch, capsys):
    def interrupted_step(model, optimizer, x, y):
        torch.set_default_dtype(torch.float64)
        raise KeyboardInterrupt

    monkeypatch.setattr(grading, "_SESSION", {})
    with pytest.raises(KeyboardInterrupt):
        grading.check("00.1", interrupted_step)
    assert "Exercise 00.1: check interrupted, no verdict recorded" in capsys.readouterr().out
    assert grading._SESSION == {}
    assert torch.get_default_dtype() == torch.float32


# ---- grading.check: global state is given back -----------------------------------------------------


def polluting(action):
    """A correct answer to 00.1 that also runs ``action`` (some change to global state)."""

    def polluting_step(model, optimizer, x, y):
        action()
        return correct_step(model, optimizer, x, y)

    return polluting_step


@pytest.mark.trial("G8a")
def test_the_default_dtype_is_restored():
    result = grading.run_check("00.1", polluting(lambda: torch.set_default_dtype(torch.float64)))
    assert torch.get_default_dtype() == torch.float32
    assert torch.zeros(1).dtype == torch.float32
    assert result.passed, result.message


@pytest.mark.trial("G8e")
def test_warning_filters_threads_and_deterministic_mode_are_restored():
    filters, threads = list(warnings.filters), torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()

    def pollute():
        warnings.filterwarnings("error")
        torch.set_num_threads(1 if threads != 1 else 2)
        torch.use_deterministic_algorithms(not deterministic)

    assert grading.run_check("00.1", polluting(pollute)).passed
    assert warnings.filters == filters
    assert torch.get_num_threads() == threads
    assert torch.are_deterministic_algorithms_enabled() == deterministic
    with pytest.warns(UserWarning, match="still only warns"):
        warnings.warn("an ordinary warning still only warns", UserWarning, stacklevel=1)


@pytest.mark.trial("extra")
def test_random_states_matmul_precision_anomaly_cwd_env_and_streams_are_restored(tmp_path):
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    cwd, stdout, precision = os.getcwd(), sys.stdout, torch.get_float32_matmul_precision()

    def pollute():
        random.seed(1), np.random.seed(1), torch.manual_seed(1)
        torch.set_float32_matmul_precision("medium" if precision != "medium" else "high")
        torch.autograd.set_detect_anomaly(True)
        os.chdir(tmp_path)
        os.environ["LABKIT_ANSWER_WAS_HERE"] = "1"
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the check must give the real stream back)

    assert grading.run_check("00.1", polluting(pollute)).passed
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert torch.get_float32_matmul_precision() == precision
    assert not torch.is_anomaly_enabled()
    assert os.getcwd() == cwd
    assert "LABKIT_ANSWER_WAS_HERE" not in os.environ
    assert sys.stdout is stdout


# ---- grading.check: comparisons an answer cannot patch ---------------------------------------------


@pytest.mark.trial("G8b")
def test_a_monkeypatched_allclose_neither_passes_nor_stays():
    real_allclose = torch.allclose

    def cheat(x, eps):
        torch.allclose = lambda *args, **kwargs: True
        return x * 2.0

    result = grading.run_check("03.1", cheat)
    assert not result.passed
    assert "differs from F.layer_norm" in result.message
    assert torch.allclose is real_allclose
    assert grading.run_check("03.1", layer_norm_rows).passed


@pytest.mark.trial("extra")
def test_patched_builtins_and_tensor_methods_are_put_back():
    real_abs, real_sub = abs, torch.Tensor.__sub__

    def cheat(model, optimizer, x, y):
        import builtins

        builtins.abs = lambda value: 0.0
        torch.Tensor.__sub__ = lambda self, other: torch.zeros_like(self)
        torch.Tensor.__eq__ = lambda self, other: True
        return 12345.0

    result = grading.run_check("00.1", cheat)
    assert not result.passed
    assert "step 1 returned 1.234e+04" in result.message
    assert abs is real_abs and torch.Tensor.__sub__ is real_sub
    assert "__eq__" not in vars(torch.Tensor)


@pytest.mark.trial("G9b")
def test_a_float_subclass_with_a_lying_subtraction_does_not_pass():
    class AlwaysClose(float):
        __sub__ = lambda self, other: 0.0  # noqa: E731
        __eq__ = lambda self, other: True  # noqa: E731
        __hash__ = float.__hash__

    def lying_step(model, optimizer, x, y):
        correct_step(model, optimizer, x, y)
        return AlwaysClose(12345.0)

    result = grading.run_check("00.1", lying_step)
    assert not result.passed
    assert "step 1 returned 1.234e+04, but F.mse_loss(model(x), y)" in result.message


@pytest.mark.trial("extra")
def test_a_tensor_subclass_that_overrides_torch_functions_does_not_pass():
    class Agreeable(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func in (torch.allclose, torch.equal):
                return True
            return super().__torch_function__(func, types, args, kwargs or {})

    def lying_norm(x, eps):
        return (x * 2.0).as_subclass(Agreeable)

    result = grading.run_check("03.1", lying_norm)
    assert not result.passed
    assert "returned a tensor subclass, Agreeable, that changes how torch operations behave" in result.message


@pytest.mark.trial("extra")
def test_a_parameter_is_still_an_acceptable_tensor_to_return():
    weight = nn.Parameter(torch.ones(2))
    assert _check_sandbox._plain([weight, (1, weight)])[0] is weight
    assert type(_check_sandbox._plain(np.float64(1.5))) is float


# ---- the student edition never destroys a learner's work -------------------------------------------


BUG = "# planted bug for exercise 00.1\ndef f(x):\n    return x\n"
SOLUTION = (
    '# exercise 00.1\ndef f(x):\n    """Doc."""\n'
    "    ### BEGIN SOLUTION\n    y = x + 1\n    return y\n    ### END SOLUTION\n"
)


def solution_folder(folder):
    folder.mkdir()
    cells = [
        nbformat.v4.new_markdown_cell("# Title"),
        nbformat.v4.new_code_cell("import torch"),
        nbformat.v4.new_code_cell(BUG),
        nbformat.v4.new_code_cell(SOLUTION, metadata={"nbgrader": student.nbgrader_metadata("00.1")}),
        nbformat.v4.new_code_cell('grading.check("00.1", f)', metadata={"nbgrader": student.check_metadata("00.1")}),
    ]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), folder / "00_x.ipynb")
    return folder


@pytest.mark.trial("S3")
def test_regenerating_refuses_to_drop_notes_and_edits_outside_exercises(tmp_path):
    source, destination = solution_folder(tmp_path / "notebooks"), tmp_path / "student"
    (written,) = student.write_student_edition(source, destination)
    edition = nbformat.read(written, 4)
    edition.cells.insert(2, nbformat.v4.new_markdown_cell("My notes: zero_grad before backward"))
    edition.cells[1].source = "import torch  # I tried float64 here"
    nbformat.write(edition, written)
    with pytest.raises(LabkitError) as refused:
        student.write_student_edition(source, destination)
    message = str(refused.value)
    assert "cells you added or edited" in message
    assert "My notes: zero_grad before backward" in message and "I tried float64" in message
    assert "--force" in message
    assert nbformat.read(written, 4).cells[2].source == "My notes: zero_grad before backward"
    student.write_student_edition(source, destination, force=True)
    assert "My notes" not in written.read_text()


@pytest.mark.trial("extra")
def test_regenerating_refuses_to_drop_a_run_with_its_grades(tmp_path):
    source, destination = solution_folder(tmp_path / "notebooks"), tmp_path / "student"
    (written,) = student.write_student_edition(source, destination)
    edition = nbformat.read(written, 4)
    result = grading.Result("00.1", "00_x", False, "✗ Exercise 00.1 not yet")
    data = {grading.GRADE_MIMETYPE: asdict(result), "text/plain": result.message}
    edition.cells[4].outputs = [nbformat.v4.new_output("display_data", data=data)]
    nbformat.write(edition, written)
    with pytest.raises(LabkitError, match=r"the outputs of cells 5 \(your run, with its grades\)"):
        student.write_student_edition(source, destination)


@pytest.mark.trial("extra")
def test_a_damaged_existing_student_notebook_is_named_not_overwritten(tmp_path):
    source, destination = solution_folder(tmp_path / "notebooks"), tmp_path / "student"
    destination.mkdir()
    (destination / "00_x.ipynb").write_text("{half a notebook")
    with pytest.raises(LabkitError, match=r"cannot read .*00_x\.ipynb"):
        student.write_student_edition(source, destination)
    assert (destination / "00_x.ipynb").read_text() == "{half a notebook"


# ---- progress and claims over malformed stored records ---------------------------------------------


def notebook_with_output(path, mime, payload):
    cell = {"cell_type": "code", "source": "", "metadata": {}, "execution_count": 1,
            "outputs": [{"output_type": "display_data", "metadata": {}, "data": {mime: payload}}]}
    path.write_text(json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


@pytest.mark.trial("PR4")
def test_a_grade_payload_without_passed_is_a_labkit_error_naming_the_file(tmp_path, capsys):
    path = notebook_with_output(tmp_path / "00_start_here.ipynb", grading.GRADE_MIMETYPE,
                                {"exercise": "00.1", "notebook": "00_start_here", "message": "✓"})
    with pytest.raises(LabkitError, match=r"00_start_here\.ipynb cell 1: the stored record has no 'passed' field"):
        exercise_progress.course_progress(tmp_path)
    assert labkit_main(["progress", str(tmp_path), "--stored"]) == 2
    assert str(path) in capsys.readouterr().err


@pytest.mark.trial("PR5")
def test_a_grade_payload_that_is_a_string_is_a_labkit_error(tmp_path):
    notebook_with_output(tmp_path / "00_start_here.ipynb", grading.GRADE_MIMETYPE, "passed")
    with pytest.raises(LabkitError, match=r"00_start_here\.ipynb cell 1: a stored record must be a JSON object, got str"):
        exercise_progress.course_progress(tmp_path)


@pytest.mark.trial("extra")
def test_a_grade_whose_passed_is_a_string_is_a_labkit_error(tmp_path):
    notebook_with_output(tmp_path / "00_start_here.ipynb", grading.GRADE_MIMETYPE,
                         {"exercise": "00.1", "passed": "false", "message": "✗"})
    with pytest.raises(LabkitError, match="'passed' is a str, not a bool"):
        exercise_progress.course_progress(tmp_path)


@pytest.mark.trial("PR6-7")
@pytest.mark.parametrize("content", [{"cells": "not a list"}, [1, 2, 3], {"cells": ["a cell as text"]},
                                     {"cells": [{"outputs": "text"}]}])
def test_a_notebook_of_the_wrong_shape_is_a_labkit_error_for_progress_and_claims(tmp_path, capsys, content):
    path = tmp_path / "00_start_here.ipynb"
    path.write_text(json.dumps(content))
    with pytest.raises(LabkitError, match=r"00_start_here\.ipynb"):
        exercise_progress.course_progress(tmp_path)
    with pytest.raises(LabkitError, match=r"00_start_here\.ipynb"):
        claims_report.collect([path])
    assert labkit_main(["claims", str(path)]) == 2
    assert str(path) in capsys.readouterr().err


@pytest.mark.trial("extra")
@pytest.mark.parametrize(("payload", "problem"), [
    ({"id": "Z1", "verdict": "holds", "evidence": 3, "claim": "c"}, "'evidence' is a int, not a str"),
    ({"id": "Z1", "verdict": "holds", "evidence": "max 0.0"}, "no 'claim' field"),
    (["Z1", "holds"], "must be a JSON object, got list"),
])
def test_a_malformed_claim_payload_is_a_labkit_error_naming_the_file(tmp_path, payload, problem):
    path = notebook_with_output(tmp_path / "01_fixture.ipynb", records.CLAIM_MIME, payload)
    with pytest.raises(LabkitError, match=rf"01_fixture\.ipynb cell 1: .*{problem}"):
        claims_report.collect([path])


@pytest.mark.trial("extra")
def test_an_answer_spinning_in_a_checks_worker_threads_is_stopped_there_too():
    def spinning_average(model, all_reduce_sum, world_size):
        while True:
            pass

    before = threading.active_count()
    result = grading.run_check("15.1", spinning_average, time_limit_s=SHORT_LIMIT_S)
    assert not result.passed
    assert "spinning_average did not return within 1 s" in result.message
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == before
