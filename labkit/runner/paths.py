"""Where a run may write: fresh run folders, folder names made from parameter values, the proof a path is inside.

Every file a run writes goes through `inside`, which resolves the path and refuses it unless it
lies under the run's own folder; folder names built from parameter values go through
`folder_name`, so a value such as ``../../notebooks`` is text in a name, never a path; and each run
gets a folder of its own from `new_folder`, created atomically, so two runs started at once (or two
sweep points with equal values) never share one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from labkit.errors import LabkitError

__all__ = ["folder_name", "inside", "new_folder", "new_run_folder", "require_empty_folder", "run_scratch", "safe_name"]

STAMP_FORMAT = "%Y%m%dT%H%M%S"
SUFFIX_BYTES = 2  # 4 hex characters after the stamp: runs started in one second still get their own folder
MAX_VALUE_CHARS = 40  # a longer value is cut, and the cut is told apart by a hash of the whole value
HASH_CHARS = 6
# Characters kept as they are in a folder name; anything else (a separator, `..`'s dots next to
# each other, spaces, quotes, control characters) becomes `_`.
_UNSAFE = re.compile(r"[^A-Za-z0-9_.+-]|\.{2,}")
# A Unix socket's path holds at most 107 bytes on Linux and 103 on macOS. multiprocessing binds one under
# TMPDIR for every batch a DataLoader worker hands over; past the limit the bind fails in the worker's
# feeder thread, the batch is dropped and the loader waits out its timeout.
SOCKET_PATH_MAX_BYTES = 103
MULTIPROCESSING_SOCKET_TAIL = "/pymp-XXXXXXXX/listener-XXXXXXXX"
SCRATCH_LINK_PREFIX = "labkit-run-"


def folder_name(values: dict) -> str:
    """A readable folder name for one set of parameter values, e.g. ``steps=2,lr=0.1``.

    A value that is not plain text (a separator, ``..``, a space, over `MAX_VALUE_CHARS`) is made safe
    and gets a short hash of the original, so two different values never share a name.
    """
    return ",".join(f"{safe_name(str(name))}={safe_name(str(value))}" for name, value in values.items())


def safe_name(text: str) -> str:
    """`text` as one safe path component: unchanged when plain, else cleaned and told apart by a short hash."""
    cleaned = _UNSAFE.sub("_", text)[:MAX_VALUE_CHARS]
    if cleaned == text:
        return text
    return f"{cleaned}~{hashlib.sha1(text.encode()).hexdigest()[:HASH_CHARS]}"


def new_folder(parent: str | Path, name: str) -> Path:
    """Create ``parent/name`` (or ``name~2``, ``name~3``... when taken) and return it; never an existing folder.

    `mkdir` with ``exist_ok=False`` is atomic, so concurrent callers asking for one name get distinct folders.
    """
    parent = Path(parent)
    if "/" in name or "\\" in name or name in ("", ".", ".."):
        raise LabkitError(f"{name!r} is not a plain folder name")
    parent.mkdir(parents=True, exist_ok=True)
    attempt, candidate = 1, name
    while True:
        folder = inside(parent, parent / candidate)
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            attempt += 1
            candidate = f"{name}~{attempt}"


def new_run_folder(parent: str | Path) -> Path:
    """A fresh folder under `parent` named by the UTC time and a random suffix, e.g. ``20261201T180748-3fa2``.

    Created with ``mkdir(exist_ok=False)``: two runs started in the same second get two folders.
    """
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    while True:
        stamp = datetime.now(timezone.utc).strftime(STAMP_FORMAT)
        folder = inside(parent, parent / f"{stamp}-{secrets.token_hex(SUFFIX_BYTES)}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:  # the same stamp and suffix drawn twice: draw again
            continue


def inside(root: str | Path, path: str | Path) -> Path:
    """`path` resolved, after proving it lies under `root` (links followed); a LabkitError otherwise."""
    root_resolved = Path(root).resolve()
    resolved = Path(path).resolve()
    if resolved != root_resolved and not resolved.is_relative_to(root_resolved):
        raise LabkitError(f"refusing to write {path}: it resolves to {resolved}, outside the run folder {root_resolved}")
    return resolved


def require_empty_folder(folder: str | Path, what: str = "output folder") -> Path:
    """Create `folder`, or accept it when it exists and is empty; refuse a file or a folder holding anything.

    A run never writes into a folder that holds something already, so it cannot overwrite another
    run's results or a committed file.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise LabkitError(f"{what} {folder} is a file, not a folder: pass a new folder name")
    if folder.is_dir() and any(folder.iterdir()):
        raise LabkitError(
            f"{what} {folder} already holds files; runs never write over anything: pass a new or empty folder"
        )
    folder.mkdir(parents=True, exist_ok=True)
    return folder.resolve()


@contextlib.contextmanager
def run_scratch(folder: Path) -> Iterator[Path]:
    """The run's temporary folder, ``folder`` (new, inside its run folder), as the path to give as TMPDIR;
    removed when the run ends.

    Where ``folder`` is too deep for the Unix sockets multiprocessing binds under TMPDIR, the path given is a
    link of the system's temp folder (``labkit-run-...``) to it: the files still lie in the run folder, and
    the link goes with them.
    """
    folder.mkdir()
    link = None
    try:
        if _socket_fits(folder):
            yield folder
            return
        link = Path(tempfile.gettempdir()) / f"{SCRATCH_LINK_PREFIX}{secrets.token_hex(4)}"
        link.symlink_to(folder, target_is_directory=True)
        yield link
    finally:
        if link is not None:
            link.unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)


def _socket_fits(folder: Path) -> bool:
    return len(os.fsencode(f"{folder}{MULTIPROCESSING_SOCKET_TAIL}")) <= SOCKET_PATH_MAX_BYTES
