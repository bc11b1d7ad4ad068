"""The one error type labkit raises for bad input, public as `labkit.LabkitError`.

Every message says what was wrong and what to do about it, so a learner reading it in a notebook
knows the next step without opening labkit's source.
"""

__all__: list[str] = []  # LabkitError is declared as labkit.LabkitError


class LabkitError(ValueError):
    """Bad input to a labkit instrument: the message names the problem and the fix."""
