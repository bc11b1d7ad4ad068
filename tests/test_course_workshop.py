"""The workshop hub's configuration without starting a hub: what workshop/jupyterhub_config.py sets (loopback,
the spawner, the shared-password authenticator and never a dummy one), the learners' nbgrader settings, and
labkit.course.workshop's copy of the release, which never overwrites a learner's file.
tests/test_workshop.py runs the hub itself."""

from __future__ import annotations

import getpass
import os
import pwd
from pathlib import Path
from types import SimpleNamespace

import pytest
from traitlets.config import PyFileConfigLoader

from labkit.course import layout, workshop
from labkit.errors import LabkitError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def course(tmp_path) -> Path:
    """A course folder as `make course` writes it (its real config template), with a release of two files."""
    root = tmp_path / "course"
    (root / "release" / "ps1").mkdir(parents=True)
    (root / "release" / "ps1" / "00_start_here.ipynb").write_text('{"released": 1}')
    (root / "release" / "ps1" / "data" / "x.txt").parent.mkdir()
    (root / "release" / "ps1" / "data" / "x.txt").write_text("data")
    (root / "nbgrader_config.py").write_text(layout.CONFIG.format(
        course_id=layout.COURSE_ID, kernel=layout.KERNEL_NAME, slowest=1, timeout=2))
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


def test_copies_can_be_handed_to_the_learner_s_account(course, tmp_path):
    me = getpass.getuser()
    copied = workshop.copy_release(course / "release", tmp_path / "home", owner=me)
    assert {path.stat().st_uid for path in copied} == {pwd.getpwnam(me).pw_uid}


def test_an_empty_release_is_refused(tmp_path):
    (tmp_path / "release").mkdir()
    with pytest.raises(LabkitError, match="holds no released assignment: run make course"):
        workshop.copy_release(tmp_path / "release", tmp_path / "home")


def test_the_learner_s_folder_is_the_spawner_s_home_or_the_account_s(tmp_path):
    assert workshop.learner_home(SimpleNamespace(home_dir=str(tmp_path), user=SimpleNamespace(name="x"))) == tmp_path
    me = getpass.getuser()
    assert workshop.learner_home(SimpleNamespace(user=SimpleNamespace(name=me))) == Path(pwd.getpwnam(me).pw_dir)
    with pytest.raises(LabkitError, match="has no Unix account"):
        workshop.learner_home(SimpleNamespace(user=SimpleNamespace(name="no-such-learner-here")))


def hub_config(monkeypatch, tmp_path, course, **extra):
    proxy = tmp_path / "configurable-http-proxy"
    proxy.write_text("")
    for name, value in {"GRADIENTLAB_COURSE": str(course), "GRADIENTLAB_ROOM": str(tmp_path / "room"),
                        "GRADIENTLAB_PROXY": str(proxy), "GRADIENTLAB_ROOM_PASSWORD": "", **extra}.items():
        monkeypatch.setenv(name, value)
    return PyFileConfigLoader("jupyterhub_config.py", path=str(ROOT / "workshop")).load_config()


def test_the_shipped_hub_listens_on_loopback_with_a_room_password_and_no_dummy_login(monkeypatch, tmp_path, course):
    config = hub_config(monkeypatch, tmp_path, course, GRADIENTLAB_HUB_PORT="8123")
    assert config.JupyterHub.bind_url == "http://127.0.0.1:8123"
    assert config.JupyterHub.hub_bind_url.startswith("http://127.0.0.1:")
    assert config.ConfigurableHTTPProxy.api_url.startswith("http://127.0.0.1:")
    assert config.Spawner.ip == "127.0.0.1"
    assert config.JupyterHub.authenticator_class == "shared-password"
    assert "dummy" not in (ROOT / "workshop" / "jupyterhub_config.py").read_text().lower()
    password = (tmp_path / "room" / "password").read_text().strip()
    assert len(password) >= 8 and config.SharedPasswordAuthenticator.user_password == password
    assert (tmp_path / "room" / "password").stat().st_mode & 0o077 == 0, "the room password is readable by others"
    assert config.JupyterHub.spawner_class == "jupyterhub.spawner.SimpleLocalProcessSpawner"
    assert config.SimpleLocalProcessSpawner.home_dir_template == str(tmp_path / "room" / "learners" / "{username}")
    env = config.Spawner.environment
    assert (env["GRADIENTLAB_EXCHANGE"], env["JUPYTER_CONFIG_PATH"]) == (str(course / "exchange"),
                                                                         str(ROOT / "workshop" / "learner"))
    assert config.Authenticator.allow_all is True


def test_named_learners_only_and_a_missing_course_or_proxy_is_a_clear_error(monkeypatch, tmp_path, course):
    config = hub_config(monkeypatch, tmp_path, course, GRADIENTLAB_LEARNERS="ada bo", GRADIENTLAB_ROOM_PASSWORD="p" * 8)
    assert config.Authenticator.allowed_users == {"ada", "bo"}
    assert config.SharedPasswordAuthenticator.user_password == "p" * 8
    with pytest.raises(LabkitError, match="not a course laid out by `make course`"):
        hub_config(monkeypatch, tmp_path, tmp_path / "nowhere")
    monkeypatch.setenv("GRADIENTLAB_COURSE", str(course))
    monkeypatch.setenv("GRADIENTLAB_PROXY", str(tmp_path / "missing-proxy"))
    with pytest.raises(SystemExit, match="run `make workshop-proxy`"):
        PyFileConfigLoader("jupyterhub_config.py", path=str(ROOT / "workshop")).load_config()


def test_learners_submit_under_their_hub_name_to_the_course_exchange(monkeypatch):
    monkeypatch.setenv("GRADIENTLAB_EXCHANGE", "/srv/exchange")
    monkeypatch.setenv("GRADIENTLAB_COURSE_ID", "gradientlab")
    monkeypatch.setenv("JUPYTERHUB_USER", "ada")
    config = PyFileConfigLoader("nbgrader_config.py", path=str(workshop.LEARNER_CONFIG)).load_config()
    assert config.Exchange.root == "/srv/exchange"
    assert (config.CourseDirectory.course_id, config.CourseDirectory.student_id) == ("gradientlab", "ada")


def test_a_hub_started_outside_a_checkout_names_the_missing_learner_config(monkeypatch, tmp_path, course):
    monkeypatch.setattr(workshop, "LEARNER_CONFIG", tmp_path / "site-packages" / "workshop" / "learner")
    with pytest.raises(LabkitError, match=r"learner/nbgrader_config\.py is missing: the workshop hub runs from a checkout"):
        workshop.learner_environment(course)
