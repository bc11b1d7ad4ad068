# JupyterHub for a room of Gradient Lab learners on one machine: `sudo make workshop` (docs/COURSE.md,
# Workshop on a JupyterHub), laid out as The Littlest JupyterHub does it. Each learner is a Unix account of
# their own (`make workshop-learners`), logs in with their own password, and their server runs under that
# account (the hub runs as root and starts it with LocalProcessSpawner, never as root): their home folder is
# theirs alone, the hub's secrets and the course's sources and gradebook are root's, the labkit of this checkout
# is read-only to them and the rest of it (the solution notebooks, tests, git history) closed. Each server
# starts in the learner's copy of the course's nbgrader release (the student edition), in this checkout's Python
# with labkit, and submits through the exchange folder that the course's nbgrader_config.py names; the
# instructor releases, collects and autogrades from the course folder.
# Settings come from the environment (defaults in brackets):
#   GRADIENTLAB_COURSE           the course folder of `make course` [course/ beside workshop/]
#   GRADIENTLAB_ROOM             the hub's state and the learners' homes [workshop/room/]
#   GRADIENTLAB_LEARNERS_GROUP   the Unix group whose members are the room's learners [gradientlab]
#   GRADIENTLAB_HUB_PORT / GRADIENTLAB_HUB_API_PORT / GRADIENTLAB_PROXY_API_PORT   [8000 / 8081 / 8001]
#   GRADIENTLAB_PROXY            configurable-http-proxy [workshop/proxy/node_modules/.bin/, make workshop-proxy]
# Everything listens on 127.0.0.1 only. An administrator taking this to a larger hub swaps the
# authenticator (PAM, OAuth, LTI) and the spawner (a container spawner), and keeps the rest.
import os
import pwd
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's labkit, also when it is not installed
from labkit.course import workshop  # noqa: E402
from labkit.errors import LabkitError  # noqa: E402

c = get_config()  # noqa: F821 (JupyterHub defines it)
if os.geteuid() != 0:
    sys.exit("the workshop hub runs as root, so that it can start each learner's server as the learner's own "
             "account (and never as its own): start it with sudo make workshop (docs/COURSE.md)")
COURSE = Path(os.environ.get("GRADIENTLAB_COURSE", HERE.parent / "course")).resolve()
ROOM = Path(os.environ.get("GRADIENTLAB_ROOM", HERE / "room")).resolve()
GROUP = os.environ.get("GRADIENTLAB_LEARNERS_GROUP", workshop.LEARNERS_GROUP)
# Before anything starts: the course must exist, and its config must name an exchange (clear error otherwise).
try:
    ENVIRONMENT = workshop.learner_environment(COURSE)
except LabkitError as error:
    sys.exit(str(error))
workshop.lock_room(ROOM)
workshop.lock_course(COURSE)
workshop.lock_checkout(workshop.LABKIT_PARENT, keep=[COURSE, ROOM, Path(sys.executable)])
for needed in (ROOM / "learners", COURSE / "release", Path(sys.executable), workshop.LEARNER_CONFIG):
    if (closed := workshop.unreachable_by_learners(needed)) is not None:
        sys.exit(f"learners' servers cannot reach {needed}: {closed} is closed to other accounts "
                 f"(chmod o+x {closed}, or keep the room, course and checkout in folders others may pass)")


# ---- network: loopback only ------------------------------------------------------------------------
def port(variable: str, default: int) -> int:
    value = os.environ.get(variable, str(default))
    if not value.isdigit() or not 0 < int(value) < 65536:
        sys.exit(f"{variable}={value!r} is not a port number: give one from 1 to 65535")
    return int(value)


c.JupyterHub.bind_url = f"http://127.0.0.1:{port('GRADIENTLAB_HUB_PORT', 8000)}"
c.JupyterHub.hub_bind_url = f"http://127.0.0.1:{port('GRADIENTLAB_HUB_API_PORT', 8081)}"
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{port('GRADIENTLAB_PROXY_API_PORT', 8001)}"
c.Spawner.ip = "127.0.0.1"
# configurable-http-proxy from npm, installed into workshop/proxy/ from its lock (make workshop-proxy).
PROXY = Path(os.environ.get("GRADIENTLAB_PROXY", HERE / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy"))
if not PROXY.exists():
    sys.exit(f"{PROXY} is missing: run `make workshop-proxy` (npm ci --prefix workshop/proxy) first, "
             "or set GRADIENTLAB_PROXY to a configurable-http-proxy")
c.ConfigurableHTTPProxy.command = [str(PROXY)]

# ---- the hub's own state, kept with the room ---------------------------------------------------------
c.JupyterHub.db_url = f"sqlite:///{ROOM / workshop.HUB_DATABASE}"
c.JupyterHub.cookie_secret_file = str(ROOM / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(ROOM / "jupyterhub.pid")
# Ctrl-C (SIGINT) or SIGTERM stops every learner's server and the proxy with the hub.
c.JupyterHub.cleanup_servers = True
c.JupyterHub.cleanup_proxy = True

# ---- who logs in: each learner with their own password --------------------------------------------
# NativeAuthenticator keeps a bcrypt hash per learner in the hub's database (root's alone); the instructor
# sets them (`make workshop-learners`, `make workshop-password`), a learner may change theirs at
# /hub/change-password. No sign-up: the learners are the members of the room's Unix group, and nobody else,
# root included, is admitted. After 5 wrong passwords a name is refused for a minute.
c.JupyterHub.authenticator_class = "native"
c.NativeAuthenticator.enable_signup = False
c.NativeAuthenticator.open_signup = False
c.NativeAuthenticator.minimum_password_length = workshop.MIN_PASSWORD_LENGTH
c.NativeAuthenticator.check_common_password = True
c.NativeAuthenticator.allowed_failed_logins = 5
c.NativeAuthenticator.seconds_before_next_try = 60
c.Authenticator.allowed_users = workshop.learners_of(GROUP)
c.Authenticator.allow_existing_users = False  # an account taken out of the group is out of the room
c.Authenticator.admin_users = set()
# A learner's name becomes a folder name: lower-case letters, digits, - and _ only.
c.Authenticator.username_pattern = rf"^{workshop.LEARNER_NAME.pattern}$"
if not c.Authenticator.allowed_users:
    print(f"Gradient Lab workshop: no learner yet (group {GROUP}): add them with sudo make workshop-learners "
          'LEARNERS="ada bo"', file=sys.stderr)

# ---- each learner's server, as the learner ----------------------------------------------------------
# LocalProcessSpawner switches to the learner's account before it starts the server, in their home folder
# (ROOM/learners/NAME, 0700). Its command copies the course's release into that home, as the learner, then
# becomes the single-user server of this Python: its python3 kernel is the project's environment.
c.JupyterHub.spawner_class = "jupyterhub.spawner.LocalProcessSpawner"
c.Spawner.cmd = [sys.executable, "-m", "labkit.course.workshop", str(COURSE / "release")]
c.Spawner.environment = ENVIRONMENT
c.Spawner.default_url = "/lab"
c.Spawner.start_timeout = 180  # a busy 2-core machine starts a server in 5-30 s
c.Spawner.http_timeout = 120


def refuse_non_learners(spawner):
    """A server for root, or any account that is not a learner of the room, is never started."""
    if spawner.user.name not in workshop.learners_of(GROUP) or pwd.getpwnam(spawner.user.name).pw_uid == 0:
        raise RuntimeError(f"{spawner.user.name} is not a learner of this room (group {GROUP})")


c.Spawner.pre_spawn_hook = refuse_non_learners
