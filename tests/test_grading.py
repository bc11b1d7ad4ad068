"""labkit.grading: friendly verdicts whatever the answer does, the score, the display payload and
`python -m labkit progress` over a folder of executed notebooks."""

from __future__ import annotations

import json
import linecache
from dataclasses import asdict

import IPython
import IPython.display
import nbformat
import numpy as np
import pytest
import torch

from labkit import exercises, grading
from labkit.__main__ import main as labkit_main
from labkit.course import exercise_progress
from labkit.errors import LabkitError


def correct_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


def per_call_grads(w, inputs):
    return [torch.autograd.grad(torch.tanh(w * x).sum(), w)[0] for x in inputs]


def step_without_zero_grad(model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


def unattempted_step(model, optimizer, x, y):
    raise NotImplementedError("Exercise 00.1: replace this line with your answer")


@pytest.fixture
def fresh_session(monkeypatch):
    """A kernel session with no checks run yet."""
    monkeypatch.setattr(grading, "_SESSION", {})
    monkeypatch.setattr(grading, "_FAILED_TRIES", {})
    monkeypatch.setattr(grading, "_RECIPE_SHOWN", set())


def hint_in(message: str) -> str:
    return message.split(". Hint: ", 1)[1]


def test_hints_go_from_a_nudge_to_the_recipe_which_waits_for_the_fourth_failed_try(fresh_session, capsys):
    steps = exercises.registry()["00.1"].hint
    assert len(steps) >= 2
    shown = []
    for _ in range(grading.RECIPE_TRY + 1):
        grading.check("00.1", step_without_zero_grad)
        shown.append(hint_in(capsys.readouterr().out.strip()))
    expected = [grading.hint_for(steps, attempt)[0] for attempt in range(1, grading.RECIPE_TRY + 2)]
    assert [hint.startswith(step) for hint, step in zip(shown, expected)] == [True] * len(shown)
    assert not any(hint.startswith(steps[-1]) for hint in shown[:grading.RECIPE_TRY - 1])
    assert shown[grading.RECIPE_TRY - 1].startswith(steps[-1])
    assert_promises_kept(shown)


def assert_promises_kept(shown: list[str]) -> None:
    """A hint that says the next one says more is followed by a different one, and only then."""
    promise = grading._MORE_HINTS.strip()
    plain = [hint.removesuffix(promise).strip() for hint in shown]
    for hint, step, following in zip(shown, plain, plain[1:]):
        assert hint.endswith(promise) == (following != step), hint


def raising_step(model, optimizer, x, y):
    raise ValueError("shapes do not match")


def test_an_answer_that_raises_gets_escalating_hints_with_kept_promises(fresh_session, capsys):
    steps = exercises.registry()["00.1"].hint
    shown = []
    for _ in range(3):
        grading.check("00.1", raising_step)
        line = capsys.readouterr().out.strip()
        assert "raising_step raised ValueError: shapes do not match" in line
        shown.append(hint_in(line))
    assert shown[0].startswith(steps[0])
    assert len({hint.removesuffix(grading._MORE_HINTS.strip()).strip() for hint in shown}) >= 2, "never escalated"
    assert_promises_kept(shown)


def test_a_pass_after_the_recipe_is_recorded_and_a_first_try_pass_stores_the_old_record(fresh_session, capsys):
    payloads = []
    for _ in range(grading.RECIPE_TRY):
        result = grading._remember(grading.run_check("00.1", step_without_zero_grad,
                                                     try_number=grading._FAILED_TRIES.get("00.1", 0) + 1))
    assert result.recipe_shown
    passed = grading._remember(grading.run_check("00.1", correct_step))
    assert passed.after_recipe
    first_try = grading._remember(grading.run_check("00.2", per_call_grads))
    assert not first_try.after_recipe
    payloads = [record_of(passed), record_of(first_try)]
    assert payloads[0]["after_recipe"] is True
    assert set(payloads[1]) == {"exercise", "notebook", "passed", "message"}


def record_of(result: grading.Result) -> dict:
    captured = {}
    original = grading.show_record
    grading.show_record = lambda text, mime, record: captured.update(record)
    try:
        grading._show(result)
    finally:
        grading.show_record = original
    return captured


def test_a_stub_or_a_pass_does_not_use_up_a_hint(fresh_session, capsys):
    grading.check("00.1", unattempted_step)
    grading.check("00.1", correct_step)
    grading.check("00.1", step_without_zero_grad)
    first_failure = capsys.readouterr().out.strip().splitlines()[-1]
    assert hint_in(first_failure).startswith(exercises.registry()["00.1"].hint[0])


def test_run_check_refuses_a_try_number_below_one():
    with pytest.raises(LabkitError, match="try_number must be a whole number from 1"):
        grading.run_check("00.1", correct_step, try_number=0)


def test_hint_for_holds_the_recipe_back_until_the_fourth_try_and_promises_only_a_change():
    assert grading.hint_for("only one", 5) == ("only one", "")
    two = ("nudge", "recipe")
    assert [grading.hint_for(two, attempt) for attempt in (1, 2, 3, 4, 5)] == [
        ("nudge", ""), ("nudge", ""), ("nudge", grading._MORE_HINTS), ("recipe", ""), ("recipe", "")]
    three = ("look", "closer", "recipe")
    assert [grading.hint_for(three, attempt)[0] for attempt in (1, 2, 3, 4)] == ["look", "closer", "closer", "recipe"]


def test_a_hint_that_is_not_a_sentence_or_a_tuple_of_them_is_refused():
    with pytest.raises(LabkitError, match="needs hint= as a sentence or a non-empty tuple"):
        exercises.exercise("00.9", notebook="00_start_here", title="t", hint=(), planted="p")


def test_unknown_exercise_is_a_labkit_error_listing_the_known_ones():
    with pytest.raises(LabkitError, match=r"no exercise '99\.9'.*00\.1, 00\.2"):
        grading.run_check("99.9", correct_step)


def test_known_exercises_lists_registered_ids_in_order():
    assert grading.known_exercises()[:2] == ["00.1", "00.2"]


def test_passing_something_that_is_not_a_function_gets_a_hint():
    result = grading.run_check("00.1", 3.0)
    assert not result.passed
    assert "needs your function itself, but it got a float" in result.message
    assert 'Hint: pass the name without parentheses, as in grading.check("00.1", my_function).' in result.message


def test_an_answer_that_raises_gets_one_line_naming_the_error():
    def crashing_step(model, optimizer, x, y):
        raise ValueError("shapes do not match\n" + "detail " * 100)

    message = grading.run_check("00.1", crashing_step).message
    assert message.startswith("✗ Exercise 00.1 not yet: crashing_step raised ValueError: shapes do not match. Hint: ")
    assert "\n" not in message and "detail" not in message


def test_a_very_long_error_line_is_cut():
    def verbose_step(model, optimizer, x, y):
        raise RuntimeError("x" * 1000)

    message = grading.run_check("00.1", verbose_step).message
    assert "x" * (grading.MAX_ERROR_CHARS - 1) + "…" in message
    assert "x" * grading.MAX_ERROR_CHARS not in message


def test_a_result_the_check_cannot_inspect_is_reported_not_raised():
    class UnmeasurableList(list):
        def __len__(self):
            raise RuntimeError("no length")

    def odd_grads(w, inputs):
        return UnmeasurableList()

    message = grading.run_check("00.2", odd_grads).message
    assert "checking what odd_grads returned failed with RuntimeError: no length" in message


def test_a_wrong_return_type_names_what_to_return():
    def tensor_step(model, optimizer, x, y):
        return torch.tensor(correct_step(model, optimizer, x, y))

    message = grading.run_check("00.1", tensor_step).message
    assert "step 1 returned a Tensor, not the loss as a Python float" in message
    assert "Hint: return loss.item()" in message


def test_a_step_that_never_updates_is_told_to_call_step():
    def no_update(model, optimizer, x, y):
        return torch.nn.functional.mse_loss(model(x), y).item()

    assert "the parameters did not change after step 1" in grading.run_check("00.1", no_update).message


def test_a_wrong_update_gets_the_generic_difference():
    def double_step(model, optimizer, x, y):
        loss = correct_step(model, optimizer, x, y)
        optimizer.step()
        return loss

    message = grading.run_check("00.1", double_step).message
    assert "after step 1 the parameters differ by" in message


def test_checks_leave_the_notebooks_random_state_and_grad_mode_alone():
    torch.manual_seed(123)
    np.random.seed(123)
    expected_torch, expected_numpy = torch.rand(3), np.random.rand(3)
    torch.manual_seed(123)
    np.random.seed(123)
    with torch.no_grad():
        # The check enables grad itself, so a learner inside no_grad still gets a fair verdict.
        assert grading.run_check("00.1", correct_step).passed
        assert not torch.is_grad_enabled()
    assert torch.equal(torch.rand(3), expected_torch)
    assert np.array_equal(np.random.rand(3), expected_numpy)


def test_check_prints_outside_ipython_and_score_counts_latest_results(fresh_session, capsys):
    grading.check("00.1", correct_step)
    grading.check("00.2", per_call_grads)
    grading.check("00.2", lambda w, inputs: None)  # the latest verdict is the one that counts
    grading.score()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("✓ Exercise 00.1 passed: ")
    assert lines[1].startswith("✓ Exercise 00.2 passed: ")
    assert lines[2].startswith("✗ Exercise 00.2 not yet: expected a list of 3 gradients")
    assert lines[3] == "Score for this notebook: 1/2 exercises passed (not yet: 00.2)"


def test_score_counts_unchecked_exercises_as_not_passed(fresh_session, capsys):
    grading.check("00.2", per_call_grads)
    grading.score()
    assert capsys.readouterr().out.splitlines()[-1] == "Score for this notebook: 1/2 exercises passed (not yet: 00.1)"


def test_score_before_any_check_says_what_to_do(fresh_session, capsys):
    grading.score()
    assert "no exercise checked yet" in capsys.readouterr().out


def test_check_in_a_kernel_displays_the_grade_payload_and_text(fresh_session, monkeypatch):
    shown = []
    monkeypatch.setattr(IPython, "get_ipython", lambda: object())
    monkeypatch.setattr(IPython.display, "display", lambda data, raw: shown.append((data, raw)))
    grading.check("00.1", correct_step)
    (data, raw), = shown
    assert raw is True
    payload = data[grading.GRADE_MIMETYPE]
    assert payload == {"exercise": "00.1", "notebook": "00_start_here", "passed": True, "message": data["text/plain"]}


# ---- progress ------------------------------------------------------------------------------------


def graded_notebook(*results: grading.Result) -> nbformat.NotebookNode:
    """An executed notebook whose check cells displayed these results, as a kernel stores them."""
    cells = []
    for result in results:
        cell = nbformat.v4.new_code_cell(f'grading.check("{result.exercise}", answer)')
        data = {grading.GRADE_MIMETYPE: asdict(result), "text/plain": result.message}
        cell.outputs = [nbformat.v4.new_output("display_data", data=data)]
        cells.append(cell)
    return nbformat.v4.new_notebook(cells=cells)


def verdict(exercise: str, passed: bool, notebook: str = "00_start_here") -> grading.Result:
    return grading.Result(exercise, notebook, passed, f"{'✓' if passed else '✗'} Exercise {exercise}")


def test_progress_classifies_passed_not_yet_and_not_run(tmp_path):
    nbformat.write(graded_notebook(verdict("00.1", False)), tmp_path / "00_start_here.ipynb")
    # A copy saved by the learner passes 00.1: a pass anywhere counts.
    nbformat.write(graded_notebook(verdict("00.1", True)), tmp_path / "00_start_here-Copy1.ipynb")
    rows = {row.exercise: row for row in exercise_progress.course_progress(tmp_path)}
    assert rows["00.1"].status == exercise_progress.PASSED
    assert rows["00.2"].status == exercise_progress.NOT_RUN
    assert rows["00.2"].title == "one gradient per call"


def test_progress_reads_the_latest_output_and_keeps_unknown_exercises(tmp_path):
    nbformat.write(graded_notebook(verdict("00.2", True), verdict("00.2", False)), tmp_path / "00_start_here.ipynb")
    nbformat.write(graded_notebook(verdict("42.1", True, "42_future")), tmp_path / "42_future.ipynb")
    rows = {row.exercise: row for row in exercise_progress.course_progress(tmp_path)}
    assert rows["00.2"].status == exercise_progress.NOT_YET
    assert rows["00.2"].message == "✗ Exercise 00.2"
    assert (rows["42.1"].notebook, rows["42.1"].status) == ("42_future", exercise_progress.PASSED)
    assert list(rows)[-1] == "42.1"


def test_progress_lists_a_notebooks_lab_after_its_exercises_by_its_title(tmp_path):
    nbformat.write(graded_notebook(verdict("02.lab", True, "02_gradients_accumulate")), tmp_path / "02_gradients_accumulate.ipynb")
    nbformat.write(graded_notebook(verdict("03.1", False, "03_inplace_ops")), tmp_path / "03_inplace_ops.ipynb")
    rows = {row.exercise: row for row in exercise_progress.course_progress(tmp_path)}
    assert (rows["02.lab"].status, rows["02.lab"].notebook) == (exercise_progress.PASSED, "02_gradients_accumulate")
    assert rows["02.lab"].title.startswith("Lab: ") and "not in this labkit" not in rows["02.lab"].title
    assert "05.lab" not in rows and "05.1" not in rows  # PG30: the folder holds no 05
    order = list(rows)
    assert order.index("02.2") < order.index("02.lab") < order.index("03.1")


def test_progress_table_has_a_total_line(tmp_path):
    nbformat.write(graded_notebook(verdict("00.1", True)), tmp_path / "00_start_here.ipynb")
    table = exercise_progress.progress_table(exercise_progress.course_progress(tmp_path))
    lines = table.splitlines()
    assert lines[0].split() == ["notebook", "exercise", "status", "title"]
    assert lines[1].split()[:3] == ["00_start_here", "00.1", "passed"]
    assert lines[-1].startswith("Total: 1/")
    assert lines[-1].endswith(f"exercises passed (0 not yet, {len(lines) - 3} not run)")


def test_progress_cli_prints_json(tmp_path, capsys):
    nbformat.write(graded_notebook(verdict("00.1", True), verdict("00.2", False)), tmp_path / "00_start_here.ipynb")
    assert labkit_main(["progress", str(tmp_path), "--stored", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    statuses = {row["exercise"]: row["status"] for row in report["exercises"]}
    assert statuses["00.1"] == "passed" and statuses["00.2"] == "not yet"
    assert report["total"]["passed"] == 1 and report["total"]["not_yet"] == 1
    assert report["total"]["exercises"] == len(report["exercises"])


def test_progress_cli_prints_the_table(tmp_path, capsys):
    nbformat.write(graded_notebook(verdict("00.1", True)), tmp_path / "00_start_here.ipynb")
    assert labkit_main(["progress", str(tmp_path), "--stored"]) == 0
    assert "Total: 1/" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("setup", "problem"),
    [
        (lambda folder: None, "no folder"),
        (lambda folder: folder.mkdir(), "no notebooks in"),
        (lambda folder: (folder.mkdir(), (folder / "00_x.ipynb").write_text("{not json")), "cannot read"),
    ],
    ids=["missing folder", "empty folder", "broken notebook"],
)
def test_progress_fails_clearly_on_a_bad_folder(tmp_path, capsys, setup, problem):
    folder = tmp_path / "student"
    setup(folder)
    with pytest.raises(LabkitError, match=problem):
        exercise_progress.course_progress(folder)
    assert labkit_main(["progress", str(folder)]) == 2
    assert problem in capsys.readouterr().err


def test_ctrl_c_while_the_grading_process_runs_says_so_and_propagates(fresh_session, monkeypatch, capsys):
    cell = "# exercise 00.1\ndef one_training_step(model, optimizer, x, y):\n    return 0.0\n"
    cell_file = "/tmp/ipykernel_4242/7654321.py"  # how IPython names a cell's code, which linecache holds
    monkeypatch.setitem(linecache.cache, cell_file, (len(cell), None, cell.splitlines(True), cell_file))
    namespace: dict = {}
    exec(compile(cell, cell_file, "exec"), namespace)  # noqa: S102 (the cell, as the kernel runs it)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(grading, "grade_cell", interrupted)
    with pytest.raises(KeyboardInterrupt):
        grading.check("00.1", namespace["one_training_step"])
    assert "check interrupted, no verdict recorded" in capsys.readouterr().out
    assert grading._SESSION == {}


def test_a_check_that_changes_torchs_thread_count_restores_it_itself():
    # 16.1's check runs single-threaded; a caller outside grading's sandbox keeps its own count
    threads = torch.get_num_threads()
    with pytest.raises(exercises.NotYet):
        exercises.registry()["16.1"].check(lambda blocks, x, per_segment: x)
    assert torch.get_num_threads() == threads


STUB_CELL = ('# exercise 00.1\ndef one_training_step(model, optimizer, x, y):\n'
             '    """One SGD step on F.mse_loss(model(x), y); returns the loss before the step as a float."""\n'
             '    # YOUR CODE HERE\n    raise NotImplementedError("Exercise 00.1: replace this line with your answer")\n')


def test_an_untouched_stub_gets_the_verdict_its_own_process_gives_without_starting_one(monkeypatch):
    from labkit import _stub_answer
    monkeypatch.setattr(_stub_answer, "is_untouched_stub", lambda source, function: False)
    monkeypatch.setattr(grading, "is_untouched_stub", _stub_answer.is_untouched_stub)
    graded_in_a_process = grading.grade_cell("00.1", STUB_CELL, "one_training_step")
    monkeypatch.undo()

    def no_process(request, wall_limit_s):
        raise AssertionError("a grading process was started for an untouched stub")

    monkeypatch.setattr(grading, "grade_in_child", no_process)
    told_at_once = grading.grade_cell("00.1", STUB_CELL, "one_training_step")
    assert not told_at_once.passed and "is not attempted yet" in told_at_once.message
    assert asdict(told_at_once) == asdict(graded_in_a_process)


@pytest.mark.parametrize("changed", [
    STUB_CELL.replace("    # YOUR CODE HERE\n", "    return 1.0\n"),  # an answer above the stub's raise
    STUB_CELL.replace("def one_", "@staticmethod\ndef one_"),  # a decorator can replace the function
    STUB_CELL + "one_training_step = lambda *args: 1.0\n",  # the name bound again
    "from builtins import ValueError as NotImplementedError\n" + STUB_CELL,
    STUB_CELL.replace("(model, optimizer, x, y)", "(model, optimizer, x, NotImplementedError)"),
    STUB_CELL.replace("(model, optimizer, x, y)", "(model, optimizer, x, y=print('side effect'))"),
    STUB_CELL + "def NotImplementedError():\n    return ValueError()\n",
    STUB_CELL.replace('raise NotImplementedError("Exercise', 'raise NotImplementedError(str("Exercise') + ")",
    "def one_training_step(model optimizer):\n",  # not Python: its process says so
])
def test_a_cell_that_could_do_anything_but_raise_not_implemented_is_graded_in_its_own_process(changed):
    from labkit._stub_answer import is_untouched_stub
    assert not is_untouched_stub(changed, "one_training_step")
    assert is_untouched_stub(STUB_CELL, "one_training_step")
