"""Progress for long loops that reads the same in JupyterLab, papermill and a CI log.

A bar that redraws itself is noise in a stored notebook and breaks nbval; `track` prints a few
plain, deterministic lines instead (no timings, so stored outputs stay stable). Used by every
notebook with a training loop; used in `00_start_here`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

from labkit.errors import LabkitError

__all__ = ["track"]

T = TypeVar("T")


def track(items: Iterable[T], label: str = "progress", total: int | None = None, updates: int = 4,
          stream: TextIO | None = None) -> Iterator[T]:
    """Yield from `items`, printing `label: k/total` about `updates` times and once at the end."""
    total = len(items) if total is None and hasattr(items, "__len__") else total
    if total is None or total < 0:
        raise LabkitError(f"track({label!r}) needs total= for an iterable without len()")
    if updates < 1:
        raise LabkitError(f"updates must be at least 1, got {updates}")
    every = max(1, -(-total // updates))
    out = stream or sys.stdout
    done = 0
    for done, item in enumerate(items, start=1):
        yield item
        if done % every == 0 and done != total:
            print(f"{label}: {done}/{total}", file=out, flush=True)
    print(f"{label}: {done}/{total} done", file=out, flush=True)
