"""Predict before you run: compare the guess a learner wrote down with what the notebook measured.

Every notebook asks once for a guess before a key measurement (first in 00_start_here): a cell
holds `guess = None`, the learner replaces None with a number (or True/False), and the line after
the measurement says how the guess compares. A None guess is not an error, so papermill and nbval
runs, which never edit the cell, print "no guess written".
"""

from numbers import Real

from labkit.errors import LabkitError

__all__ = ["compare_guess"]

CLOSE = 1.25  # within this factor of the measurement a numeric guess counts as close
SAME_ORDER = 3.0  # within this factor, the right order of magnitude


def compare_guess(guess, measured, *, what: str, digits: int = 3) -> str:
    """One sentence comparing `guess` with `measured` (used in 00_start_here).

    `measured` is a number or a bool; `guess` is None (no guess written), or of the same kind.
    Numbers are shown to `digits` significant digits, so the sentence is the same on every machine
    that measures the same rounded value.
    """
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
    return f"Your guess for {what}: {_show(guess, digits)}; measured: {_show(measured, digits)}: {_judge(guess, measured)}."


def _show(value, digits):
    return str(value) if isinstance(value, bool) else f"{value:.{digits}g}"


def _judge(guess, measured):
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
