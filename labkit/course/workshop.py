"""What the workshop's JupyterHub (workshop/jupyterhub_config.py) does for each learner of a room.

The hub runs a course laid out by `make course`. Before a learner's server starts, `copy_release` copies
every assignment of the course's nbgrader release (``COURSE/release/ASSIGNMENT/``, labkit's student
edition but for the stub line) into the learner's folder, at ``ASSIGNMENT/``, where nbgrader's fetch would
put it; a file the learner already has is never written again, so a restart keeps their work. The
learner's server then runs in the project's environment with `learner_environment`, whose nbgrader
settings point at the course's exchange folder, read by `exchange_of` from the course's own
``nbgrader_config.py``: the instructor's nbgrader and the learners' agree on one folder by construction.
"""

from __future__ import annotations

import os
import pwd
import shutil
import sys
from pathlib import Path

from traitlets.config import PyFileConfigLoader

from labkit.errors import LabkitError

__all__: list[str] = []

# The folder that holds this labkit (a checkout's root, or site-packages): the learners' servers import it.
LABKIT_PARENT = Path(__file__).resolve().parents[2]
# The folder on the learners' JUPYTER_CONFIG_PATH: its nbgrader_config.py reads the variables below. It is
# the checkout's, beside the hub's own configuration: the workshop hub runs from a checkout.
LEARNER_CONFIG = LABKIT_PARENT / "workshop" / "learner"
EXCHANGE_VARIABLE = "GRADIENTLAB_EXCHANGE"
COURSE_ID_VARIABLE = "GRADIENTLAB_COURSE_ID"


def exchange_of(course: Path) -> tuple[Path, str]:
    """The exchange folder and course ID that ``course``'s nbgrader_config.py sets (what the instructor's
    `nbgrader release_assignment` and `collect` use)."""
    course = Path(course).resolve()
    config_file = course / "nbgrader_config.py"
    if not (course / "release").is_dir() or not config_file.is_file():
        raise LabkitError(f"{course} is not a course laid out by `make course` (no release/ or nbgrader_config.py): "
                          "run make course NB=\"00 02 05\" ASSIGNMENT=ps1 first, or set GRADIENTLAB_COURSE")
    saved = dict(os.environ)
    try:  # the course's config sets JUPYTER_PATH for the instructor's nbgrader; the hub keeps its own
        config = PyFileConfigLoader(config_file.name, path=str(course)).load_config()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    exchange = config.get("Exchange", {}).get("root")
    course_id = config.get("CourseDirectory", {}).get("course_id")
    if not exchange or not course_id:
        raise LabkitError(f"{config_file} sets no c.Exchange.root or no c.CourseDirectory.course_id; the hub gives "
                          "learners the same exchange as the instructor, so set both there")
    return Path(exchange), str(course_id)


def learner_home(spawner) -> Path:
    """The learner's folder: the spawner's ``home_dir`` (SimpleLocalProcessSpawner), else the home of the
    Unix account of that name (LocalProcessSpawner, where each learner has an account)."""
    home = getattr(spawner, "home_dir", None)
    if home:
        return Path(home)
    try:
        return Path(pwd.getpwnam(spawner.user.name).pw_dir)
    except KeyError as error:
        raise LabkitError(f"learner {spawner.user.name} has no Unix account, which {type(spawner).__name__} "
                          "needs; create it, or use SimpleLocalProcessSpawner") from error


def copy_release(release: Path, home: Path, owner: str | None = None) -> list[Path]:
    """Copy each file of ``release``'s assignment folders into ``home`` that ``home`` does not hold yet;
    return what was copied. A learner's file is never overwritten, even one created a moment ago: each copy
    opens its target with exclusive creation. ``owner``: the Unix account to hand the copies to (when the
    hub runs as root for a LocalProcessSpawner); None keeps the hub's own account."""
    release, home = Path(release), Path(home)
    assignments = sorted(path for path in release.iterdir() if path.is_dir()) if release.is_dir() else []
    if not assignments:
        raise LabkitError(f"{release} holds no released assignment: run make course before starting the hub")
    account = pwd.getpwnam(owner) if owner else None
    copied = []
    for assignment in assignments:
        for source in sorted(path for path in assignment.rglob("*") if path.is_file()):
            target = home / assignment.name / source.relative_to(assignment)
            if target.exists():
                continue
            missing, folder = [], target.parent
            while not folder.exists():
                missing.append(folder)
                folder = folder.parent
            for folder in reversed(missing):
                folder.mkdir(exist_ok=True)
                _hand_over(folder, account)
            try:
                with source.open("rb") as reader, target.open("xb") as writer:
                    shutil.copyfileobj(reader, writer)
            except FileExistsError:
                continue
            _hand_over(target, account)
            copied.append(target)
    return copied


def _hand_over(path: Path, account) -> None:
    if account is not None:
        os.chown(path, account.pw_uid, account.pw_gid)


def learner_environment(course: Path) -> dict[str, str]:
    """The variables of each learner's server: this checkout's labkit on this Python (the project's
    environment), the learners' nbgrader config folder, and the course's exchange and course ID."""
    exchange, course_id = exchange_of(course)
    if not (LEARNER_CONFIG / "nbgrader_config.py").is_file():
        raise LabkitError(f"{LEARNER_CONFIG / 'nbgrader_config.py'} is missing: the workshop hub runs from a checkout of "
                          "the workbook (its workshop/ folder), not from an installed labkit; clone the repository "
                          "and start the hub from the checkout (docs/COURSE.md, Workshop on a JupyterHub)")
    scripts = str(Path(sys.executable).parent)
    return {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(LABKIT_PARENT), os.environ.get("PYTHONPATH")])),
        "PATH": os.pathsep.join([scripts, os.environ.get("PATH", os.defpath)]),
        "JUPYTER_CONFIG_PATH": str(LEARNER_CONFIG),
        EXCHANGE_VARIABLE: str(exchange),
        COURSE_ID_VARIABLE: course_id,
    }
