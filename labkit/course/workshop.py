"""What the workshop's JupyterHub (workshop/jupyterhub_config.py) does for each learner of a room.

Each learner is a Unix account of their own (`add_learner`: the hub's learners group, a home folder under
``ROOM/learners/`` that only they can open, a password kept hashed by the hub's authenticator), and the hub,
run as root, starts each server as its learner. The server's first step, `serve`, runs as the learner:
`copy_release` copies every assignment of the course's nbgrader release (``COURSE/release/ASSIGNMENT/``,
labkit's student edition but for the stub line) into their home, at ``ASSIGNMENT/``, where nbgrader's
fetch would put it; a file the learner already has is never written again, so a restart keeps their work.
The server runs in the project's environment with `learner_environment`, whose nbgrader settings point at
the course's exchange folder, read by `exchange_of` from the course's own ``nbgrader_config.py``: the
instructor's nbgrader and the learners' agree on one folder by construction. `lock_room`, `lock_course` and
`lock_checkout` leave the learners only what is theirs: the hub's secrets, the course's sources and gradebook,
and the checkout's solution notebooks, tests and git history are their owners' alone; the release, the
exchange and the labkit the servers import stay open.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import secrets
import shutil
import stat
import subprocess
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
# The learners of a room: the members of this Unix group (GRADIENTLAB_LEARNERS_GROUP), added by `add_learner`.
LEARNERS_GROUP = "gradientlab"
# A learner's name is a Unix account name and a folder name.
LEARNER_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
MIN_PASSWORD_LENGTH = 8
# The hub's database (JupyterHub's state and the authenticator's password hashes), root's alone.
HUB_DATABASE = "jupyterhub.sqlite"
# What nbgrader writes into a course after the release; made before the hub starts so that they are root's alone.
INSTRUCTOR_ONLY = ("submitted", "autograded", "feedback")
# What the learners' servers use of the checkout: the labkit they import, its version (pyproject.toml) and the
# learners' nbgrader config (workshop/learner). The rest (notebooks/ and their py twins hold the solutions,
# tests/ answers, .git every version of both) is closed to them.
CHECKOUT_FOR_LEARNERS = ("labkit", "pyproject.toml", "workshop")


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
    from labkit.course.layout import OWNERS_COLLECT

    if str(config.get("ExchangeFactory", {}).get("collect")) != OWNERS_COLLECT:
        raise LabkitError(f"{config_file} does not collect submissions as their owners': on the hub a learner could "
                          f"submit under another's name; add the line c.ExchangeFactory.collect = \"{OWNERS_COLLECT}\"")
    return Path(exchange), str(course_id)


def copy_release(release: Path, home: Path) -> list[Path]:
    """Copy each file of ``release``'s assignment folders into ``home`` that ``home`` does not hold yet;
    return what was copied. A learner's file is never overwritten, even one created a moment ago: each copy
    opens its target with exclusive creation. On the hub this runs as the learner (`serve`), so a link the
    learner planted in their folder can only lead to what they may write anyway."""
    release, home = Path(release), Path(home)
    assignments = sorted(path for path in release.iterdir() if path.is_dir()) if release.is_dir() else []
    if not assignments:
        raise LabkitError(f"{release} holds no released assignment: run make course before starting the hub")
    copied = []
    for assignment in assignments:
        for source in sorted(path for path in assignment.rglob("*") if path.is_file()):
            target = home / assignment.name / source.relative_to(assignment)
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                with source.open("rb") as reader, target.open("xb") as writer:
                    shutil.copyfileobj(reader, writer)
            except FileExistsError:
                continue
            copied.append(target)
    return copied


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


def learners_of(group: str = LEARNERS_GROUP) -> set[str]:
    """The names the hub admits: the members of the Unix group ``group`` (none while it does not exist)."""
    try:
        return set(grp.getgrnam(group).gr_mem)
    except KeyError:
        return set()


def add_learner(room: Path, name: str, group: str = LEARNERS_GROUP, password: str | None = None) -> str:
    """Make ``name`` a learner of the room: a Unix account in ``group`` whose home, ``ROOM/learners/NAME``,
    only they can open, and a password for the hub (``password``, else a new random one); return the password.
    An account of that name that is not already a learner of the room is refused, never taken over."""
    _need_root(f"adding the learner {name!r} (a Unix account)")
    if not LEARNER_NAME.fullmatch(name):
        raise LabkitError(f"learner name {name!r}: use 1-32 lower-case letters, digits, - or _, starting with a letter")
    folder = lock_room(room) / "learners"
    try:
        grp.getgrnam(group)
    except KeyError:
        _run(["groupadd", group])
    try:
        pwd.getpwnam(name)
    except KeyError:
        _run(["useradd", "--create-home", "--home-dir", str(folder / name), "--shell", "/bin/bash",
              "--user-group", "--groups", group, name])
        # A room of the earlier shared-account hub left the learner's folder root's: it is theirs now.
        _run(["chown", "-R", f"{name}:{name}", str(folder / name)])
    else:
        if name not in learners_of(group):
            raise LabkitError(f"a Unix account {name!r} exists and is not a learner of this room (group {group}): "
                              "pick another name for the learner")
    os.chmod(pwd.getpwnam(name).pw_dir, 0o700)
    password = password or secrets.token_urlsafe(9)
    set_password(room, name, password)
    return password


def set_password(room: Path, name: str, password: str) -> None:
    """Set ``name``'s hub password: the hub's authenticator (NativeAuthenticator) keeps its bcrypt hash in the
    room's database. The hub reads it at its next start; a learner changes their own at /hub/change-password."""
    from jupyterhub.orm import new_session_factory
    from nativeauthenticator import NativeAuthenticator

    _need_root(f"setting {name}'s password (the hub's database is root's alone)")
    if len(password) < MIN_PASSWORD_LENGTH:
        raise LabkitError(f"{name}'s password is {len(password)} characters long: use {MIN_PASSWORD_LENGTH} or more")
    session = new_session_factory(f"sqlite:///{lock_room(room) / HUB_DATABASE}")()
    try:
        authenticator = NativeAuthenticator(_deprecated_db_session=session, open_signup=True,
                                            minimum_password_length=MIN_PASSWORD_LENGTH)
        if authenticator.user_exists(name):
            authenticator.change_password(name, password)
        elif authenticator.create_user(name, password) is None:
            raise LabkitError(f"the hub's authenticator refused the learner name {name!r}")
    finally:
        session.close()


def lock_room(room: Path) -> Path:
    """Make the room's folder root's: the learners may pass through it to their homes (``learners/``) and see
    nothing else; the hub's database, cookie secret and pid file are root's alone. Returns the room."""
    room = Path(room).resolve()
    (room / "learners").mkdir(parents=True, exist_ok=True)
    database = room / HUB_DATABASE
    database.touch(mode=0o600)  # before SQLite makes it readable by all
    for entry in room.iterdir():
        if entry.name != "learners":
            _private(entry)
    for folder in (room, room / "learners"):
        os.chmod(folder, 0o711)
    return room


def lock_course(course: Path) -> None:
    """Make the course root's: learners pass through it to the exchange and the release (their copy of each
    assignment) but can read nothing else of it: not the sources (the solutions), the gradebook, the
    submissions or the grades. nbgrader's later folders are made now, so that they are born private."""
    course = Path(course).resolve()
    for name in INSTRUCTOR_ONLY:
        (course / name).mkdir(mode=0o700, exist_ok=True)
    (course / "gradebook.db").touch(mode=0o600)
    for entry in course.iterdir():
        if entry.name not in ("exchange", "release"):
            _private(entry)
    os.chmod(course, 0o711)


def lock_checkout(checkout: Path, keep: list[Path]) -> list[Path]:
    """Close the checkout the hub runs from to other accounts but for `CHECKOUT_FOR_LEARNERS` and the folders
    of ``keep`` that lie in it (the course, the room, the Python of the servers): a learner's kernel imports
    labkit from here and could otherwise read the workbook's solutions beside it (PG8, WS9). Only the mode
    changes (git records none but the executable bit), so the owner's checkout works as before. Returns
    what was closed."""
    checkout = Path(checkout).resolve()
    if not (checkout / "labkit").is_dir() or not (checkout / "workshop").is_dir():
        raise LabkitError(f"{checkout} is not a checkout of the workbook (no labkit/ and workshop/ in it): the "
                          "workshop hub runs from a checkout (docs/COURSE.md, Workshop on a JupyterHub)")
    needed = set(CHECKOUT_FOR_LEARNERS)
    for path in keep:
        inside = Path(os.path.abspath(path))
        if inside.is_relative_to(checkout) and inside != checkout:
            needed.add(inside.relative_to(checkout).parts[0])
    closed = sorted(entry for entry in checkout.iterdir() if entry.name not in needed)
    for entry in closed:
        _private(entry)
    return closed


def unreachable_by_learners(path: Path) -> Path | None:
    """The first folder on the way to ``path`` that accounts other than its owner cannot pass, or None."""
    for folder in reversed([Path(path).resolve(), *Path(path).resolve().parents]):
        if folder.is_dir() and not folder.stat().st_mode & stat.S_IXOTH:
            return folder
    return None


def serve(release: Path, server_args: list[str]) -> None:
    """A learner's server, as the hub starts it under the learner's own account: copy the course's release
    into their home, then become JupyterHub's single-user server (the same process, which the hub stops)."""
    if os.geteuid() == 0:
        raise LabkitError("a learner's server never runs as root: the workshop hub starts it as the learner's account")
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    copied = copy_release(release, home)
    print(f"{len(copied)} file(s) of the release copied into {home}", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "jupyterhub.singleuser", *server_args])


def _private(path: Path) -> None:
    mode = path.lstat().st_mode
    if not stat.S_ISLNK(mode):
        os.chmod(path, stat.S_IMODE(mode) & 0o700)


def _need_root(what: str) -> None:
    if os.geteuid() != 0:
        raise LabkitError(f"{what} needs root: run it with sudo (docs/COURSE.md, Workshop on a JupyterHub)")


def _run(command: list[str]) -> None:
    if shutil.which(command[0]) is None:
        raise LabkitError(f"{command[0]} is not on PATH: the hub's learners are Unix accounts, made with useradd and "
                          "groupadd (Debian and Ubuntu: apt-get install passwd)")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise LabkitError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")


if __name__ == "__main__":  # the learner's server command (workshop/jupyterhub_config.py's Spawner.cmd)
    serve(Path(sys.argv[1]), sys.argv[2:])
