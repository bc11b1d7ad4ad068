"""Which variant of a lab a learner gets: drawn from who they are, the same every time.

The draw hashes the lab's ID with the learner's key, so the same learner always gets the same
variant of a lab (and different labs draw independently). The key is, first found:
1. the seed a learner sets in their kernel (``labs.start(..., seed=7)``), which the autograder reruns too;
2. under nbgrader (``NBGRADER_EXECUTION`` set), the student ID nbgrader grades: its autograde runs each
   notebook with the kernel's working folder at ``autograded/<student_id>/<assignment_id>``;
3. ``LABKIT_LEARNER``, or ``JUPYTERHUB_USER`` (a JupyterHub with nbgrader names students by it);
4. the operating-system user name.
The key is hashed with SHA-256, never Python's ``hash`` (salted per process), so a kernel and the
autograder agree.
"""

from __future__ import annotations

import getpass
import hashlib
import os
from pathlib import Path

from labkit.errors import LabkitError

__all__: list[str] = []

NBGRADER_EXECUTION = "NBGRADER_EXECUTION"
LEARNER_VARIABLES = ("LABKIT_LEARNER", "JUPYTERHUB_USER")
AUTOGRADED_FOLDER = "autograded"


def learner_key(seed: int | None = None, learner: str | None = None) -> str:
    """The text a learner's draw hashes: their seed, their nbgrader student ID, or their name."""
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise LabkitError(f"seed must be a whole number, got {seed!r}: pass e.g. seed=7")
        return f"seed:{seed}"
    if learner is not None:
        if not isinstance(learner, str) or not learner.strip():
            raise LabkitError(f"learner must be your name or student ID as text, got {learner!r}")
        return f"learner:{learner.strip()}"
    student = nbgrader_student()
    if student is not None:
        return f"learner:{student}"
    for variable in LEARNER_VARIABLES:
        if os.environ.get(variable, "").strip():
            return f"learner:{os.environ[variable].strip()}"
    return f"learner:{getpass.getuser()}"


def nbgrader_student(cwd: Path | None = None) -> str | None:
    """The student ID nbgrader's autograde runs this kernel for, read from its working folder; else None."""
    if not os.environ.get(NBGRADER_EXECUTION):
        return None
    folder = Path.cwd() if cwd is None else Path(cwd)
    return folder.parent.name if folder.parent.parent.name == AUTOGRADED_FOLDER else None


def draw(lab_id: str, key: str, count: int) -> tuple[int, int]:
    """The variant index (below ``count``) and the run seed a key draws for a lab."""
    digest = hashlib.sha256(f"{lab_id}|{key}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % count, int.from_bytes(digest[4:8], "big") % 10_000
