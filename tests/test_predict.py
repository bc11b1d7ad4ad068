"""labkit.predict: the sentence that compares a learner's guess with the measurement."""

import pytest

from labkit.errors import LabkitError
from labkit.predict import compare_guess


def test_no_guess_names_the_measurement():
    assert compare_guess(None, 0.123456, what="the ratio") == "No guess written for the ratio. Measured: 0.123."


@pytest.mark.parametrize(("guess", "measured", "phrase"), [
    (2.0, 2.0, "exactly right"),
    (1.0, 1.1, "close"),
    (1.0, 2.5, "the right order of magnitude; the measurement is 2.5x larger"),
    (100.0, 1.0, "off; the measurement is 1e+02x smaller"),
    (-1.0, 1.0, "compare the signs"),
])
def test_numeric_guesses_are_judged_by_their_factor(guess, measured, phrase):
    assert phrase in compare_guess(guess, measured, what="x")


def test_bool_guesses_are_right_or_not():
    assert compare_guess(True, True, what="b").endswith("right.")
    assert compare_guess(False, True, what="b").endswith("not this time.")


@pytest.mark.parametrize(("guess", "measured"), [("0.5", 0.5), (1, True), (True, 0.5)])
def test_a_guess_of_the_wrong_kind_is_a_clear_error(guess, measured):
    with pytest.raises(LabkitError, match="guess for x must be"):
        compare_guess(guess, measured, what="x")
