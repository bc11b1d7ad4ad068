"""The workshop hub's configuration without starting a hub: what workshop/jupyterhub_config.py sets (loopback,
each learner's server as their own account and never as root, a password per learner with a lockout, the
modes that keep the hub's secrets and the course's sources root's), the learners' nbgrader settings, the
collect that files a submission as its owner's, and labkit.course.workshop's copy of the release, which never
overwrites a learner's file. tests/test_workshop.py runs the hub itself, with two learners' accounts."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from traitlets.config import PyFileConfigLoader

from labkit.course import layout, workshop
from labkit.errors import LabkitError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def passable(monkeypatch):
    """A folder that other accounts may pass through, as the hub requires of the room and the course (pytest's
    tmp_path lies in folders that are root's alone); removed after the test. This Python may lie in one too
    (pyenv under /root): the configuration only names it, so it names a reachable file instead."""
    folder = Path(tempfile.mkdtemp(prefix="gradientlab-hub-config-"))
    folder.chmod(0o711)
    monkeypatch.setattr(sys, "executable", "/usr/bin/env")
    yield folder
    shutil.rmtree(folder)


@pytest.fixture
def course(passable) -> Path:
    """A course folder as `make course` writes it (its real config template), with a release of two files."""
    root = passable / "course"
    (root / "release" / "ps1").mkdir(parents=True)
    (root / "release" / "ps1" / "00_start_here.ipynb").write_text('{"released": 1}')
    (root / "release" / "ps1" / "data" / "x.txt").parent.mkdir()
    (root / "release" / "ps1" / "data" / "x.txt").write_text("data")
    (root / "nbgrader_config.py").write_text(layout.CONFIG.format(
        course_id=layout.COURSE_ID, kernel=layout.KERNEL_NAME, slowest=1, timeout=2, collect=layout.OWNERS_COLLECT))
    return root


def test_the_exchange_is_the_one_the_course_config_names(course):
    before = os.environ.get("JUPYTER_PATH")
    assert workshop.exchange_of(course) == (course.resolve() / "exchange", layout.COURSE_ID)
    assert os.environ.get("JUPYTER_PATH") == before, "reading the course config changed the hub's JUPYTER_PATH"


def test_a_folder_that_is_not_a_course_is_refused(tmp_path):
    with pytest.raises(LabkitError, match=r"not a course laid out by `make course`.*run make course"):
        workshop.exchange_of(tmp_path)


def test_a_course_config_without_an_exchange_is_refused(course):
    (course / "nbgrader_config.py").write_text('c = get_config()\nc.CourseDirectory.course_id = "x"\n')
    with pytest.raises(LabkitError, match=r"sets no c\.Exchange\.root"):
        workshop.exchange_of(course)


def test_the_release_is_copied_and_a_learner_s_file_is_never_overwritten(course, tmp_path):
    home = tmp_path / "learners" / "ada"
    copied = workshop.copy_release(course / "release", home)
    assert sorted(path.relative_to(home).as_posix() for path in copied) == ["ps1/00_start_here.ipynb", "ps1/data/x.txt"]
    (home / "ps1" / "00_start_here.ipynb").write_text('{"answered": 1}')
    (home / "ps1" / "data" / "x.txt").unlink()
    again = workshop.copy_release(course / "release", home)
    assert [path.relative_to(home).as_posix() for path in again] == ["ps1/data/x.txt"]
    assert (home / "ps1" / "00_start_here.ipynb").read_text() == '{"answered": 1}'


def test_an_empty_release_is_refused(tmp_path):
    (tmp_path / "release").mkdir()
    with pytest.raises(LabkitError, match="holds no released assignment: run make course"):
        workshop.copy_release(tmp_path / "release", tmp_path / "home")


SOLUTION = "### BEGIN SOLUTION\noptimizer.zero_grad()\n### END SOLUTION\n"


def checkout_copy(folder: Path) -> Path:
    """A checkout as the hub runs from, with git's modes (folders 755, files 644): the labkit the learners'
    servers import and their config beside the solution notebooks, py twins, tests and git history."""
    root = folder / "checkout"
    files = {"labkit/__init__.py": "", "pyproject.toml": "[project]\n", "workshop/learner/nbgrader_config.py": "",
             ".venv/bin/python": "", "README.md": "# Gradient Lab\n", "notebooks/00_start_here.ipynb": SOLUTION,
             "notebooks/py/00_start_here.py": SOLUTION, "tests/exercise_variants.py": SOLUTION,
             ".git/objects/pack/pack-1.pack": SOLUTION}
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


def hub_config(monkeypatch, tmp_path, course, **extra):
    # the hub closes the checkout it runs from to other accounts: here a copy, never this checkout
    if not (tmp_path / "checkout").exists():
        checkout_copy(tmp_path)
    monkeypatch.setattr(workshop, "LABKIT_PARENT", tmp_path / "checkout")
    proxy = tmp_path / "configurable-http-proxy"
    proxy.write_text("")
    for name, value in {"GRADIENTLAB_COURSE": str(course), "GRADIENTLAB_ROOM": str(tmp_path / "room"),
                        "GRADIENTLAB_PROXY": str(proxy), **extra}.items():
        monkeypatch.setenv(name, value)
    return PyFileConfigLoader("jupyterhub_config.py", path=str(ROOT / "workshop")).load_config()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the workshop hub runs as root (CI runs these as root)")


@needs_root
def test_the_shipped_hub_runs_each_learner_as_their_own_account_with_their_own_password(monkeypatch, passable, course):
    config = hub_config(monkeypatch, passable, course, GRADIENTLAB_HUB_PORT="8123",
                        GRADIENTLAB_LEARNERS_GROUP="no-such-group-here")
    assert config.JupyterHub.bind_url == "http://127.0.0.1:8123"
    assert config.JupyterHub.hub_bind_url.startswith("http://127.0.0.1:")
    assert config.ConfigurableHTTPProxy.api_url.startswith("http://127.0.0.1:")
    assert config.Spawner.ip == "127.0.0.1"
    assert config.JupyterHub.spawner_class == "jupyterhub.spawner.LocalProcessSpawner"
    assert "--allow-root" not in [*config.Spawner.cmd, *config.Spawner.get("args", [])]
    assert config.Spawner.cmd == ["/usr/bin/env", "-m", "labkit.course.workshop", str(course / "release")]
    assert config.JupyterHub.authenticator_class == "native"
    assert (config.NativeAuthenticator.enable_signup, config.NativeAuthenticator.allowed_failed_logins) == (False, 5)
    assert config.Authenticator.allowed_users == set() and "allow_all" not in config.Authenticator
    assert config.Authenticator.allow_existing_users is False
    assert "dummy" not in (ROOT / "workshop" / "jupyterhub_config.py").read_text().lower()
    env = config.Spawner.environment
    assert (env["GRADIENTLAB_EXCHANGE"], env["JUPYTER_CONFIG_PATH"]) == (str(course / "exchange"),
                                                                         str(ROOT / "workshop" / "learner"))


@needs_root
def test_the_hub_s_secrets_and_the_course_s_sources_are_root_s_alone(monkeypatch, passable, course):
    (course / "source" / "ps1").mkdir(parents=True)
    (course / "source" / "ps1" / "00_start_here.ipynb").write_text("{}")
    room = passable / "room"
    room.mkdir()
    (room / "jupyterhub_cookie_secret").write_text("secret")
    (room / "jupyterhub_cookie_secret").chmod(0o644)  # as an earlier hub or an instructor may have left it
    hub_config(monkeypatch, passable, course)
    assert {path.name: mode(path) for path in room.iterdir()} == {
        "learners": 0o711, "jupyterhub.sqlite": 0o600, "jupyterhub_cookie_secret": 0o600}
    assert mode(room) == 0o711
    assert mode(course) == 0o711
    private = {path.name: mode(path) for path in course.iterdir() if path.name not in ("exchange", "release")}
    assert private == {"nbgrader_config.py": 0o600, "gradebook.db": 0o600, "source": 0o700, "submitted": 0o700,
                       "autograded": 0o700, "feedback": 0o700}
    assert mode(course / "release") & 0o005 == 0o005, "learners copy their release from here"


def unused_uid() -> int:
    """A uid no account has: what a file's mode lets other accounts do is all a learner's account may do."""
    return next(uid for uid in range(54321, 60000) if not _has_account(uid))


def _has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def as_learner(uid: int, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), user=uid, group=uid, extra_groups=[], capture_output=True, text=True,
                          timeout=60, cwd="/")


@needs_root
def test_a_learner_imports_the_checkout_s_labkit_but_cannot_read_its_solutions(monkeypatch, passable, course):
    # PG8, WS9: a learner's kernel found the checkout from labkit.__file__ and read the solution notebooks in it
    checkout = checkout_copy(passable)
    monkeypatch.setattr(sys, "executable", str(checkout / ".venv" / "bin" / "python"))
    hub_config(monkeypatch, passable, course)
    learner = unused_uid()
    solutions = ["notebooks/00_start_here.ipynb", "notebooks/py/00_start_here.py", "tests/exercise_variants.py",
                 ".git/objects/pack/pack-1.pack", "README.md"]
    read = {relative: as_learner(learner, "cat", str(checkout / relative)).stdout for relative in solutions}
    assert read == dict.fromkeys(solutions, ""), f"a learner read {[name for name, text in read.items() if text]}"
    needed = ["labkit/__init__.py", "pyproject.toml", "workshop/learner/nbgrader_config.py", ".venv/bin/python"]
    assert all(as_learner(learner, "cat", str(checkout / relative)).returncode == 0 for relative in needed)
    imported = as_learner(learner, "/usr/bin/python3", "-c", f"import sys; sys.path[:0] = [{str(checkout)!r}]; "
                          "import labkit; print(labkit.__file__)")
    assert imported.stdout.strip() == str(checkout / "labkit" / "__init__.py"), imported.stderr
    assert mode(checkout / "notebooks") == 0o700 and mode(checkout / "README.md") == 0o600  # the owner's still


def test_only_a_checkout_of_the_workbook_is_closed(tmp_path):
    (tmp_path / "labkit").mkdir()  # labkit installed in site-packages: the folder beside it is not ours
    with pytest.raises(LabkitError, match="is not a checkout of the workbook"):
        workshop.lock_checkout(tmp_path, keep=[])


@needs_root
def test_a_room_learners_cannot_reach_is_refused(monkeypatch, passable, course):
    closed = passable / "closed"
    closed.mkdir(mode=0o700)
    with pytest.raises(SystemExit, match=r"learners' servers cannot reach .*closed is closed to other accounts"):
        hub_config(monkeypatch, closed, course)


def test_a_hub_not_run_as_root_is_refused_with_the_reason(monkeypatch, tmp_path, course):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="runs as root, so that it can start each learner's server as the learner's"):
        hub_config(monkeypatch, tmp_path, course)


@needs_root
def test_a_missing_course_or_proxy_or_a_wrong_port_is_a_clear_error(monkeypatch, passable, course):
    with pytest.raises(SystemExit, match="not a course laid out by `make course`"):
        hub_config(monkeypatch, passable, passable / "nowhere")
    monkeypatch.setenv("GRADIENTLAB_COURSE", str(course))
    monkeypatch.setenv("GRADIENTLAB_PROXY", str(passable / "missing-proxy"))
    with pytest.raises(SystemExit, match="run `make workshop-proxy`"):
        PyFileConfigLoader("jupyterhub_config.py", path=str(ROOT / "workshop")).load_config()
    with pytest.raises(SystemExit, match=r"GRADIENTLAB_HUB_PORT='80a' is not a port number: give one from 1 to 65535"):
        hub_config(monkeypatch, passable, course, GRADIENTLAB_HUB_PORT="80a")


def test_learners_submit_as_their_own_account_whatever_jupyterhub_user_says(monkeypatch):
    monkeypatch.setenv("GRADIENTLAB_EXCHANGE", "/srv/exchange")
    monkeypatch.setenv("GRADIENTLAB_COURSE_ID", "gradientlab")
    monkeypatch.setenv("JUPYTERHUB_USER", "bo")
    config = PyFileConfigLoader("nbgrader_config.py", path=str(workshop.LEARNER_CONFIG)).load_config()
    assert config.Exchange.root == "/srv/exchange"
    assert config.CourseDirectory.course_id == "gradientlab"
    assert "student_id" not in config.CourseDirectory, "nbgrader would file the work under JUPYTERHUB_USER's name"


def test_a_course_config_that_collects_by_claimed_name_is_refused(course):
    config = course / "nbgrader_config.py"
    config.write_text(config.read_text().replace("c.ExchangeFactory.collect", "# c.ExchangeFactory.collect"))
    with pytest.raises(LabkitError, match=r"does not collect submissions as their owners'.*c\.ExchangeFactory\.collect"):
        workshop.exchange_of(course)


@needs_root
def test_collect_files_a_submission_under_the_account_that_wrote_it(tmp_path):
    from nbgrader.coursedir import CourseDirectory

    from labkit.course.exchange import OwnersCollect

    inbound = tmp_path / "inbound"
    inbound.mkdir()
    forged, own = inbound / "bo+ps1+2026-12-05 20:00:00.000000 UTC+abc", inbound / "ada+ps1+2026-12-05 20:00:00.000000 UTC+d"
    for folder in (forged, own):
        folder.mkdir()
    os.chown(forged, pwd.getpwnam("nobody").pw_uid, -1)  # another account wrote it, claiming bo's name
    collect = OwnersCollect(coursedir=CourseDirectory())
    collect.inbound_path = str(inbound)
    assert collect._path_to_record(str(forged))["username"] == "nobody"
    assert collect._path_to_record(str(own))["username"] == "ada", "the instructor's own folders keep their name"


@needs_root
def test_a_learner_name_must_be_an_account_name_and_an_account_outside_the_room_is_never_taken(tmp_path):
    with pytest.raises(LabkitError, match="learner name 'Ada Lovelace': use 1-32 lower-case letters"):
        workshop.add_learner(tmp_path / "room", "Ada Lovelace", "root")
    with pytest.raises(LabkitError, match="a Unix account 'nobody' exists and is not a learner of this room"):
        workshop.add_learner(tmp_path / "room", "nobody", "root")
    with pytest.raises(LabkitError, match="password is 5 characters long: use 8 or more"):
        workshop.set_password(tmp_path / "room", "nobody", "short")


def test_adding_a_learner_needs_root(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(LabkitError, match=r"adding the learner 'ada' \(a Unix account\) needs root: run it with sudo"):
        workshop.add_learner(tmp_path / "room", "ada")


def test_a_learner_s_server_never_starts_as_root(monkeypatch, course):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(LabkitError, match="a learner's server never runs as root"):
        workshop.serve(course / "release", [])


def test_a_hub_started_outside_a_checkout_names_the_missing_learner_config(monkeypatch, tmp_path, course):
    monkeypatch.setattr(workshop, "LEARNER_CONFIG", tmp_path / "site-packages" / "workshop" / "learner")
    with pytest.raises(LabkitError, match=r"learner/nbgrader_config\.py is missing: the workshop hub runs from a checkout"):
        workshop.learner_environment(course)


@needs_root
def test_the_learners_command_names_a_wrong_learner_name(tmp_path):
    from labkit.course import cli

    with pytest.raises(LabkitError, match="learner name 'Ada': use 1-32 lower-case letters"):
        cli.main(["learners", "Ada", "--room", str(tmp_path / "room"), "--group", "root"])
