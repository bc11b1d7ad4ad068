"""Every exercise, six ways: the solution passes its check, the student stub fails it as "not
attempted yet", the planted bug fails it for the reason registered as `planted=`, another correct
answer written differently passes, an answer that dodges the lesson fails with the diagnosis
tests/exercise_variants.py gives it, and each likely wrong answer in tests/exercise_mistakes.py
fails with the diagnosis that names its own mistake. A check that passes on its planted bug or its dodge, or rejects
one only because the check or the cell crashed, fails here; so does a check that passes trivial
answers, and a hint that does not grow more explicit from a first failed try to a later one.

Exercises are discovered in notebooks/NN_*.ipynb.
Each cell runs alone in a fresh copy of `grading.EXERCISE_NAMESPACE`, as docs/AUTHORING.md promises.
"""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
from exercise_mistakes import MISTAKES
from exercise_variants import VARIANTS

from labkit import exercises, grading, student
from labkit.errors import LabkitError

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
# The lead asked for each check to stay under a second, so a notebook's exercise cells stay snappy.
CHECK_SECONDS = 1.0  # of CPU time, all threads together


def notebook_paths(folder: Path) -> list[Path]:
    return sorted(folder.glob(student.NOTEBOOK_GLOB))


def exercises_in(path: Path) -> dict[str, student.ExerciseCells]:
    return student.find_exercises(nbformat.read(path, as_version=4), path.name)


def exercise_cases() -> list:
    cases = []
    for path in notebook_paths(NOTEBOOKS):
        label = path.relative_to(ROOT).with_suffix("").as_posix()
        cases += [pytest.param(cells, id=f"{label}:{eid}") for eid, cells in exercises_in(path).items()]
    return cases


CASES = exercise_cases()


def define(source: str, function: str):
    """Run one exercise cell on its own and return the function it defines."""
    namespace = dict(grading.EXERCISE_NAMESPACE)
    exec(compile(source, "<exercise cell>", "exec"), namespace)
    return namespace[function]


def test_the_fixture_notebook_provides_exercises():
    # Guards the parametrisation below: an empty CASES list would make every three-way test vacuous.
    assert {case.values[0].exercise for case in CASES} >= {"00.1", "00.2"}


@pytest.mark.parametrize("cells", CASES)
def test_solution_passes_its_check_quickly_and_deterministically(cells):
    answer = define(cells.solution, cells.function)
    first = grading.run_check(cells.exercise, answer)
    # CPU time of the second run: the first may pay one-off imports (torch.optim takes ~1 s on first
    # use), and wall time on a shared machine measures the neighbours, not the check.
    started = time.process_time()
    second = grading.run_check(cells.exercise, answer)
    elapsed = time.process_time() - started
    assert first.passed, first.message
    assert first.message.startswith(f"✓ Exercise {cells.exercise} passed: ")
    assert second == first
    assert elapsed < CHECK_SECONDS


@pytest.mark.parametrize("cells", CASES)
def test_student_stub_fails_with_the_not_attempted_message(cells):
    stubbed = student.stub_solution(cells.solution, cells.exercise)
    result = grading.run_check(cells.exercise, define(stubbed, cells.function))
    assert not result.passed
    assert result.message.startswith(f"✗ Exercise {cells.exercise} not yet: {cells.function} is not attempted yet")
    assert f"Hint: in the cell marked '# exercise {cells.exercise}', replace the lines '# YOUR CODE HERE'" in result.message
    # The hint names the stub's own lines, as student.py writes them.
    assert all(line.split("(")[0] in result.message for line in student.STUB)
    assert "\n" not in result.message and "Traceback" not in result.message


def problem_of(message: str) -> str:
    """The diagnosis part of a failed check's line, without the hint."""
    return message.split(". Hint: ", 1)[0]


def grading_crash(function: str, problem: str) -> str | None:
    """What crashed, if the check rejected the answer because of a crash rather than a diagnosis.

    grading says "<function> raised ..." when the cell raised (a name missing from
    EXERCISE_NAMESPACE, say) and "checking what <function> returned failed ..." when the check
    itself did. Where raising is the bug's symptom, the check catches it and names it in its own
    words (03.1: "backward through your output raised RuntimeError"), which neither phrase matches.
    """
    for crash in (f"{function} raised ", f"checking what {function} returned failed"):
        if crash in problem:
            return crash
    return None


@pytest.mark.parametrize("cells", CASES)
def test_planted_bug_fails_its_check_with_its_registered_diagnosis(cells):
    answer = define(cells.planted_bug, cells.function)
    result = grading.run_check(cells.exercise, answer)
    planted = exercises.registry()[cells.exercise].planted
    problem = problem_of(result.message)
    assert not result.passed, f"the check for {cells.exercise} passes on its planted bug: {result.message}"
    assert result.message.startswith(f"✗ Exercise {cells.exercise} not yet: ")
    assert planted in problem, f"expected the diagnosis to say {planted!r}: {result.message}"
    assert "not attempted" not in problem
    assert grading_crash(cells.function, problem) is None, result.message
    assert grading.run_check(cells.exercise, answer) == result


def test_every_exercise_has_an_alternative_answer_and_a_dodge():
    assert set(VARIANTS) == {case.values[0].exercise for case in CASES}


@pytest.mark.parametrize("cells", CASES)
def test_another_correct_answer_written_differently_passes(cells):
    result = grading.run_check(cells.exercise, define(VARIANTS[cells.exercise].alternative, cells.function))
    assert result.passed, result.message


@pytest.mark.parametrize("cells", CASES)
def test_an_answer_that_dodges_the_lesson_fails_with_its_diagnosis(cells):
    variant = VARIANTS[cells.exercise]
    result = grading.run_check(cells.exercise, define(variant.dodge, cells.function))
    problem = problem_of(result.message)
    assert not result.passed, f"the check for {cells.exercise} passes an answer that dodges the lesson"
    assert variant.dodge_says in problem, f"expected the diagnosis to say {variant.dodge_says!r}: {result.message}"
    assert grading_crash(cells.function, problem) is None, result.message


# Catalogued per exercise, besides the planted bug, the stub and the dodge.
LIKELY_WRONG_ANSWERS = 3


def test_every_exercise_has_at_least_three_likely_wrong_answers_with_their_diagnoses():
    exercise_ids = {case.values[0].exercise for case in CASES}
    assert set(MISTAKES) == exercise_ids
    too_few = {eid: len(MISTAKES[eid]) for eid in exercise_ids if len(MISTAKES[eid]) < LIKELY_WRONG_ANSWERS}
    assert not too_few, f"likely wrong answers catalogued, fewer than {LIKELY_WRONG_ANSWERS}: {too_few}"


MISTAKE_CASES = [
    pytest.param(cells, entry, id=f"{cells.exercise}:{entry.label}")
    for case in CASES
    for cells in case.values[:1]
    for entry in MISTAKES.get(cells.exercise, [])
]


@pytest.mark.parametrize(("cells", "entry"), MISTAKE_CASES)
def test_a_likely_wrong_answer_gets_the_diagnosis_of_its_own_mistake(cells, entry):
    result = grading.run_check(cells.exercise, define(entry.answer, cells.function))
    problem = problem_of(result.message)
    assert not result.passed, f"the check for {cells.exercise} passes a wrong answer ({entry.label})"
    assert entry.says in problem, f"expected the diagnosis to say {entry.says!r}: {result.message}"
    assert grading_crash(cells.function, problem) is None, result.message


APART_CASES = [pytest.param(case.values[0], id=case.id) for case in CASES
               if exercises.registry()[case.values[0].exercise].answer_apart]


@pytest.mark.parametrize("cells", APART_CASES)
def test_an_answer_graded_apart_gets_the_verdict_it_gets_beside_its_check(cells):
    # answer_apart=True: the grading process calls the answer in a process of its own (labkit._answer_process),
    # so the solution, the planted bug, the variants and every catalogued mistake must come back as data that
    # gives the very verdict they get in one process (the same diagnosis, word for word)
    variant = VARIANTS[cells.exercise]
    cells_to_grade = {"solution": cells.solution, "planted bug": cells.planted_bug,
                      "alternative": variant.alternative, "dodge": variant.dodge}
    cells_to_grade |= {entry.label: entry.answer for entry in MISTAKES.get(cells.exercise, [])}
    for label, source in cells_to_grade.items():
        apart = grading.grade_cell(cells.exercise, source, cells.function)
        beside = grading.run_check(cells.exercise, define(source, cells.function))
        assert (apart.passed, apart.message) == (beside.passed, beside.message), label


def hint_of(message: str) -> str:
    return message.split(". Hint: ", 1)[1]


@pytest.mark.parametrize("cells", CASES)
def test_hints_grow_more_explicit_from_the_first_failed_try(cells):
    answer = define(cells.planted_bug, cells.function)
    first, later = (grading.run_check(cells.exercise, answer, try_number=n) for n in (1, 10))
    assert problem_of(first.message) == problem_of(later.message)
    assert hint_of(first.message) != hint_of(later.message), "the first failure already gets the last hint"
    # the promise that the next hint says more is made only when the second try's hint is another one
    second = hint_of(grading.run_check(cells.exercise, answer, try_number=2).message)
    promised = "next try" in hint_of(first.message)
    assert promised == (second.split(grading._MORE_HINTS)[0] != hint_of(first.message).split(grading._MORE_HINTS)[0])
    assert "next try" not in hint_of(later.message)


def test_the_crash_detector_recognises_both_crash_messages():
    assert grading_crash("f", "f raised NameError: name 'torch_nn' is not defined") == "f raised "
    assert grading_crash("f", "checking what f returned failed with TypeError: x") == "checking what f returned failed"
    assert grading_crash("f", "backward through your output raised RuntimeError: one of the variables") is None


TRIVIAL_ANSWERS = {
    "returns None": lambda *args, **kwargs: None,
    "returns its first argument": lambda *args, **kwargs: args[0] if args else next(iter(kwargs.values()), None),
}


@pytest.mark.parametrize("trivial", TRIVIAL_ANSWERS)
@pytest.mark.parametrize("cells", CASES)
def test_a_trivial_answer_fails_the_check(cells, trivial):
    result = grading.run_check(cells.exercise, TRIVIAL_ANSWERS[trivial])
    assert not result.passed, f"the check for {cells.exercise} passes an answer that {trivial}: {result.message}"


def registered_notebooks() -> list[str]:
    return sorted({spec.notebook for spec in exercises.registry().values()})


@pytest.mark.parametrize("notebook", registered_notebooks())
def test_each_registered_notebook_exists_and_holds_exactly_its_registered_exercises(notebook):
    path = NOTEBOOKS / f"{notebook}.ipynb"
    assert path.exists(), f"exercises are registered for {notebook}, but notebooks/{notebook}.ipynb does not exist"
    registered = {eid for eid, spec in exercises.registry().items() if spec.notebook == notebook}
    assert set(exercises_in(path)) == registered


@pytest.mark.parametrize("cells", CASES)
def test_every_exercise_in_a_notebook_is_registered(cells):
    assert cells.exercise in exercises.registry()


def test_registry_is_in_course_order_and_names_notebooks():
    ids = list(exercises.registry())
    assert ids == sorted(ids, key=exercises.exercise_order)
    assert exercises.exercise_order("00.2") < exercises.exercise_order("00.10")
    assert exercises.registry()["00.1"].notebook == "00_start_here"


@pytest.mark.parametrize(
    ("exercise_id", "notebook", "problem"),
    [
        ("0.1", "00_start_here", "not of the form NN.K"),
        ("00.1", "00_start_here.ipynb", "not a notebook name"),
        ("01.1", "00_start_here", "starts with its notebook's number"),
    ],
)
def test_exercise_registration_rejects_bad_ids(exercise_id, notebook, problem):
    with pytest.raises(LabkitError, match=problem):
        exercises.exercise(exercise_id, notebook=notebook, title="t", hint="h", planted="p")


def test_an_exercise_without_a_planted_diagnosis_is_refused():
    with pytest.raises(LabkitError, match="needs planted="):
        exercises.exercise("00.9", notebook="00_start_here", title="t", hint="h", planted=" ")


def test_an_id_registered_by_another_module_is_refused(monkeypatch):
    monkeypatch.setattr(exercises, "_REGISTRY", dict(exercises.registry()))
    register = exercises.exercise("00.1", notebook="00_start_here", title="t", hint="h", planted="p")
    with pytest.raises(LabkitError, match="registered twice"):
        register(lambda answer: "never")


def test_a_gradient_from_torch_func_passes_00_2():
    # 00.2 rejects a derivative written by hand (tests/exercise_mistakes.py); torch.func.grad never
    # reaches w's hook, so the check must recognise its double-backward graph as autograd's work.
    answer = define("""
def grad_of_each_call(w, inputs):
    return [torch.func.grad(lambda v: torch.tanh(v * x).sum())(w) for x in inputs]
""", "grad_of_each_call")
    result = grading.run_check("00.2", answer)
    assert result.passed, result.message
