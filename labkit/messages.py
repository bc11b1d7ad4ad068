"""One-line descriptions for labkit's messages: the first line of a text, cut to a stated length.

A failure report quotes an error or a cell's source; only its first line fits in a sentence, and a
long one is cut with "…" so the reader sees that something was left out. Each caller names its
own limit, because a verdict line, a rank report and a cell pointer have room for different lengths.
"""

from __future__ import annotations

import re

__all__ = ["describe_error", "first_line"]


def first_line(text: str, limit: int) -> str:
    """The first non-blank-trimmed line of ``text``, at most ``limit`` characters ("…" marks a cut)."""
    line = (str(text).strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[: limit - 1] + "…"


def describe_error(error: BaseException, limit: int) -> str:
    """``"TypeName: first line of the message"``, or the type name alone when the message is empty.

    An error torch re-raised from a worker process (a DataLoader's) carries the worker's traceback in its
    message: the line said is the worker's own message, and where it was raised."""
    text = str(error)
    wrapped = _RERAISED.match(text)
    if wrapped:
        kind, where = wrapped.groups()
        at = text.rfind(f"\n{kind}: ")
        said = text[at + len(kind) + 3:].strip() if at >= 0 else ""
        text = f"{where}: {said}" if said else where
    line = first_line(text, limit)
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


# How torch words an error a worker process raised (a DataLoader's) when it re-raises it in this one.
_RERAISED = re.compile(r"Caught (\w+) (in .+?)\.\nOriginal Traceback \(most recent call last\):\n")
