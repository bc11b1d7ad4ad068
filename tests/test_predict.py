"""labkit.predict: the lines that compare a learner's guess with the measurement, and every notebook's prediction.

The notebook tests read the py twins and the stored outputs only: no kernel starts.
"""

import ast
import re
from pathlib import Path

import nbformat
import pytest

from labkit import notebooks
from labkit.errors import LabkitError
from labkit.predict import compare_guess

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = notebooks.workbook_notebooks(ROOT / "notebooks")
DECLARED = dict(why="the reason", answer_words=("the answer",))


def test_no_guess_names_the_measurement_and_the_reason():
    assert compare_guess(None, 0.123456, what="the ratio", **DECLARED) == (
        "No guess written for the ratio. Measured: 0.123.\nWhy: the reason")


@pytest.mark.parametrize(("guess", "measured", "phrase"), [
    (2.0, 2.0, "exactly right"),
    (1.0, 1.1, "close"),
    (1.0, 2.5, "the right order of magnitude; the measurement is 2.5x larger"),
    (100.0, 1.0, "off; the measurement is 1e+02x smaller"),
    (-1.0, 1.0, "compare the signs"),
])
def test_unbounded_guesses_are_judged_by_their_factor(guess, measured, phrase):
    assert phrase in compare_guess(guess, measured, what="x", **DECLARED)


@pytest.mark.parametrize(("guess", "measured", "bounds", "phrase"), [
    (0.5, 0.719, (0, 1), "off; the measurement is 21.9 percentage points higher than your guess"),
    (0.7, 0.719, (0, 1), "close; the measurement is 1.9 percentage points higher"),
    (0.8, 0.719, (0, 1), "near; the measurement is 8.1 percentage points lower"),
    (0.01, 0.002, (0, 1), "close; the measurement is 0.8 percentage points lower"),
    (0.5, 0.997, (-1, 1), "off; the measurement is 0.497 higher"),
])
def test_bounded_guesses_are_judged_in_absolute_points_never_as_a_ratio(guess, measured, bounds, phrase):
    # the ratio judge would call 0.01 against 0.002 "off; 5x smaller" and 0.5 against 0.719 "1.4x larger"
    line = compare_guess(guess, measured, what="the share", bounds=bounds, **DECLARED)
    assert phrase in line
    assert not re.search(r"\dx (larger|smaller)", line)


def test_a_bounded_quantity_must_declare_its_bounds():
    with pytest.raises(LabkitError, match="bounded quantity: pass bounds="):
        compare_guess(0.5, 0.7, what="the test accuracy", **DECLARED)
    with pytest.raises(LabkitError, match=r"between 0 and 1, got 72 \(write 0.72"):
        compare_guess(72, 0.7, what="the test accuracy", bounds=(0, 1), **DECLARED)


@pytest.mark.parametrize("declared", [dict(why="", answer_words=("a",)), dict(why="  ", answer_words=("a",)),
                                      dict(why="r", answer_words=()), dict(why="r", answer_words="a")])
def test_a_prediction_without_a_reason_or_answer_words_is_refused(declared):
    with pytest.raises(LabkitError, match="no reason|no answer_words"):
        compare_guess(None, 1.0, what="x", **declared)


def test_every_comparison_ends_with_its_reason():
    for guess, measured in ((True, False), (None, True), (3.0, 1.0)):
        assert compare_guess(guess, measured, what="x", **DECLARED).splitlines()[-1] == "Why: the reason"


def test_bool_guesses_are_right_or_not():
    assert compare_guess(True, True, what="b", **DECLARED).splitlines()[0].endswith("right.")
    assert compare_guess(False, True, what="b", **DECLARED).splitlines()[0].endswith("not this time.")


@pytest.mark.parametrize(("guess", "measured"), [("0.5", 0.5), (1, True), (True, 0.5)])
def test_a_guess_of_the_wrong_kind_is_a_clear_error(guess, measured):
    with pytest.raises(LabkitError, match="guess for x must be"):
        compare_guess(guess, measured, what="x", **DECLARED)


def prediction_call(twin: Path) -> ast.Call:
    calls = [node for node in ast.walk(ast.parse(twin.read_text())) if isinstance(node, ast.Call)
             and getattr(node.func, "id", None) == "compare_guess"]
    assert len(calls) == 1, f"{twin.name}: one compare_guess call"
    return calls[0]


def you_will_learn(nb) -> str:
    opening = nb.cells[0].source
    block = opening.split("**You will learn**", 1)[1]
    return block.split("**Prerequisites", 1)[0]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_the_opening_does_not_state_the_answer_to_the_prediction(path):
    keywords = {k.arg: k.value for k in prediction_call(path.parent / "py" / f"{path.stem}.py").keywords}
    assert {"why", "answer_words"} <= set(keywords), "the prediction declares why= and answer_words="
    answer_words = ast.literal_eval(keywords["answer_words"])
    learn = " ".join(you_will_learn(nbformat.read(path, as_version=4)).lower().replace("#", " ").split())
    stated = [w for w in answer_words if w.lower() in learn]
    assert not stated, f"{path.name}: 'You will learn' states the prediction's answer: {stated}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_every_stored_prediction_prints_its_reason(path):
    cell = next(c for c in nbformat.read(path, as_version=4).cells
                if c.cell_type == "code" and "compare_guess(guess," in c.source)
    printed = "".join(o.get("text", "") for o in cell.outputs).splitlines()
    assert len(printed) == 2 and printed[1].startswith("Why: ") and len(printed[1]) > 20, printed
