"""Predict before you run: compare the guess a learner wrote down with what the notebook measured.

Every notebook asks once for a guess before a key measurement (first in 00_start_here): a cell
holds `guess = None`, the learner replaces None with a number (or True/False), and the lines after
the measurement say how the guess compares and why the measurement came out as it did. A None
guess is not an error, so papermill and nbval runs, which never edit the cell, print "no guess
written" and the reason.

A prediction declares three things besides the measurement:
- `why`: the one line printed after every comparison, the reason behind the measurement;
- `answer_words`: the words that would state the answer, which the notebook's opening must not
  contain (tests/test_predict.py reads them from every notebook);
- `bounds`, for a bounded quantity (a share, an accuracy, a cosine): a guess and a measurement
  between the same limits are compared in absolute points, because "1.4x larger" means nothing
  for a share.
"""

from numbers import Real

from labkit.errors import LabkitError

__all__ = ["compare_guess"]

CLOSE = 1.25  # within this factor of the measurement a numeric guess counts as close
SAME_ORDER = 3.0  # within this factor, the right order of magnitude
CLOSE_POINTS = 0.05  # for a bounded quantity: within this share of its range a guess counts as close
NEAR_POINTS = 0.15  # within this share of its range, in the right region
# words that name a bounded quantity: such a prediction must declare its bounds
BOUNDED_WORDS = ("share", "accuracy", "fraction", "percent", "cosine", "probability")


def compare_guess(guess, measured, *, what: str, why: str, answer_words: tuple[str, ...],
                  bounds: tuple[float, float] | None = None, digits: int = 3) -> str:
    """Two lines comparing `guess` with `measured`, the second "Why: " and the declared reason.

    `measured` is a number or a bool; `guess` is None (no guess written), or of the same kind.
    Numbers are shown to `digits` significant digits, so the lines are the same on every machine
    that measures the same rounded value. With `bounds=(low, high)` numbers are judged by their
    difference in points of that range; without, by the factor between them.
    """
    _check_declaration(what, why, answer_words, bounds, measured)
    return f"{_compare(guess, measured, what, bounds, digits)}\nWhy: {why.strip()}"


def _check_declaration(what, why, answer_words, bounds, measured):
    if not isinstance(why, str) or not why.strip():
        raise LabkitError(f"the prediction of {what} has no reason: pass why='one line on why the measurement "
                          "comes out as it does', printed after the comparison")
    if isinstance(answer_words, str) or not answer_words or not all(isinstance(w, str) and w for w in answer_words):
        raise LabkitError(f"the prediction of {what} declares no answer_words: pass a tuple of the words that "
                          "would state its answer, such as ('adds up',), which the opening must not contain")
    if bounds is None and not isinstance(measured, bool) and any(w in what.lower() for w in BOUNDED_WORDS):
        raise LabkitError(f"{what} is a bounded quantity: pass bounds=(low, high), such as (0, 1) for a share, "
                          "so that a guess is judged in absolute points, not as a ratio")
    if bounds is not None and not (isinstance(measured, Real) and bounds[0] <= measured <= bounds[1]):
        raise LabkitError(f"the measurement of {what}, {measured!r}, is outside its bounds {bounds}")


def _compare(guess, measured, what, bounds, digits):
    if guess is None:
        return f"No guess written for {what}. Measured: {_show(measured, digits)}."
    if isinstance(measured, bool):
        if not isinstance(guess, bool):
            raise LabkitError(f"the guess for {what} must be True or False (or None), got {guess!r}: "
                              "write True or False into `guess`")
        outcome = "right" if guess == measured else "not this time"
        return f"Your guess for {what}: {guess}; measured: {measured}: {outcome}."
    if isinstance(guess, bool) or not isinstance(guess, Real):
        raise LabkitError(f"the guess for {what} must be a number (or None), got {guess!r}: "
                          "write a number such as 0.5 or 1e-3 into `guess`")
    if bounds is None:
        judged = _judge_factor(guess, measured)
    elif bounds[0] <= guess <= bounds[1]:
        judged = _judge_points(guess, measured, bounds, digits)
    else:
        percent = " (write 0.72 for 72 %)" if tuple(bounds) == (0, 1) else ""
        raise LabkitError(f"the guess for {what} must lie between {bounds[0]:g} and {bounds[1]:g}, "
                          f"got {guess!r}{percent}")
    return f"Your guess for {what}: {_show(guess, digits)}; measured: {_show(measured, digits)}: {judged}."


def _show(value, digits):
    return str(value) if isinstance(value, bool) else f"{value:.{digits}g}"


def _judge_points(guess, measured, bounds, digits):
    """A bounded quantity: the difference in absolute terms, as percentage points for a share."""
    if guess == measured:
        return "exactly right"
    difference, span = abs(measured - guess), bounds[1] - bounds[0]
    shown = f"{100 * difference:.1f} percentage points" if tuple(bounds) == (0, 1) else f"{difference:.{digits}g}"
    direction = "higher" if measured > guess else "lower"
    verdict = "close" if difference <= CLOSE_POINTS * span else "near" if difference <= NEAR_POINTS * span else "off"
    return f"{verdict}; the measurement is {shown} {direction} than your guess"


def _judge_factor(guess, measured):
    if guess == measured:
        return "exactly right"
    if guess == 0 or measured == 0 or (guess > 0) != (measured > 0):
        return "off: compare the signs and whether either is zero"
    factor = max(guess / measured, measured / guess)
    if factor <= CLOSE:
        return "close"
    direction = "larger" if measured > guess else "smaller"
    verdict = "the right order of magnitude" if factor <= SAME_ORDER else "off"
    return f"{verdict}; the measurement is {factor:.2g}x {direction} than your guess"
