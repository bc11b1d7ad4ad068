# JupyterHub for a room of Gradient Lab learners on one machine: `make workshop` (docs/COURSE.md,
# Workshop on a JupyterHub). Every learner's server starts in their own copy of the course's nbgrader release (the
# student edition), in this checkout's Python with labkit, and submits through the exchange folder that
# the course's nbgrader_config.py names; the instructor releases, collects and autogrades from the course
# folder. Settings come from the environment (defaults in brackets):
#   GRADIENTLAB_COURSE           the course folder of `make course` [course/ beside workshop/]
#   GRADIENTLAB_ROOM             the hub's state and the learners' folders [workshop/room/]
#   GRADIENTLAB_ROOM_PASSWORD    the room's shared password, 8+ characters [made once, kept in ROOM/password]
#   GRADIENTLAB_LEARNERS         the learners' names, space-separated [anyone with the password]
#   GRADIENTLAB_HUB_PORT / GRADIENTLAB_HUB_API_PORT / GRADIENTLAB_PROXY_API_PORT   [8000 / 8081 / 8001]
#   GRADIENTLAB_PROXY            configurable-http-proxy [workshop/proxy/node_modules/.bin/, make workshop-proxy]
# Everything listens on 127.0.0.1 only. An administrator taking this to a larger hub swaps the
# authenticator (PAM, OAuth, LTI) and the spawner (LocalProcessSpawner with one Unix account per learner,
# run as root; or a container spawner), and keeps the rest.
import os
import secrets
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's labkit, also when it is not installed
from labkit.course import workshop  # noqa: E402

c = get_config()  # noqa: F821 (JupyterHub defines it)
COURSE = Path(os.environ.get("GRADIENTLAB_COURSE", HERE.parent / "course")).resolve()
ROOM = Path(os.environ.get("GRADIENTLAB_ROOM", HERE / "room")).resolve()
LEARNERS = ROOM / "learners"
LEARNERS.mkdir(parents=True, exist_ok=True)
# Before anything starts: the course must exist, and its config must name an exchange (clear error otherwise).
ENVIRONMENT = workshop.learner_environment(COURSE)

# ---- network: loopback only ------------------------------------------------------------------------
c.JupyterHub.bind_url = f"http://127.0.0.1:{int(os.environ.get('GRADIENTLAB_HUB_PORT', 8000))}"
c.JupyterHub.hub_bind_url = f"http://127.0.0.1:{int(os.environ.get('GRADIENTLAB_HUB_API_PORT', 8081))}"
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{int(os.environ.get('GRADIENTLAB_PROXY_API_PORT', 8001))}"
c.Spawner.ip = "127.0.0.1"
# configurable-http-proxy from npm, installed into workshop/proxy/ from its lock (make workshop-proxy).
PROXY = Path(os.environ.get("GRADIENTLAB_PROXY", HERE / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy"))
if not PROXY.exists():
    sys.exit(f"{PROXY} is missing: run `make workshop-proxy` (npm ci --prefix workshop/proxy) first, "
             "or set GRADIENTLAB_PROXY to a configurable-http-proxy")
c.ConfigurableHTTPProxy.command = [str(PROXY)]

# ---- the hub's own state, kept with the room ---------------------------------------------------------
c.JupyterHub.db_url = f"sqlite:///{ROOM / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(ROOM / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(ROOM / "jupyterhub.pid")
# Ctrl-C (SIGINT) or SIGTERM stops every learner's server and the proxy with the hub.
c.JupyterHub.cleanup_servers = True
c.JupyterHub.cleanup_proxy = True

# ---- who logs in: a shared room password --------------------------------------------------------------
c.JupyterHub.authenticator_class = "shared-password"
password_file = ROOM / "password"
password = os.environ.get("GRADIENTLAB_ROOM_PASSWORD")
if not password:
    if not password_file.exists():
        password_file.touch(mode=0o600)
        password_file.write_text(secrets.token_urlsafe(9) + "\n")
    password = password_file.read_text().strip()
    print(f"Gradient Lab workshop: learners log in with the room password kept in {password_file}", file=sys.stderr)
c.SharedPasswordAuthenticator.user_password = password
learners = os.environ.get("GRADIENTLAB_LEARNERS", "").split()
if learners:
    c.Authenticator.allowed_users = set(learners)
else:
    c.Authenticator.allow_all = True
# A learner's name becomes a folder name: lower-case letters, digits, - and _ only.
c.Authenticator.username_pattern = r"^[a-z][a-z0-9_-]{0,31}$"

# ---- each learner's server -----------------------------------------------------------------------
# SimpleLocalProcessSpawner: every server runs as the account that runs the hub, in LEARNERS/<name>.
# It needs no root and no Unix account per learner, so an instructor can run the room from their own
# account; it gives no isolation between learners (each can read the others' folders), which a room
# on one machine under one account cannot have anyway. LocalProcessSpawner needs the hub to run as root
# and one Unix account per learner: that is the administrator's swap (workshop.learner_home and
# copy_release handle both).
c.JupyterHub.spawner_class = "jupyterhub.spawner.SimpleLocalProcessSpawner"
c.SimpleLocalProcessSpawner.home_dir_template = str(LEARNERS / "{username}")
# The single-user server of this Python: its python3 kernel is the project's environment.
c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
if os.geteuid() == 0:
    # The servers run as the hub's account; Jupyter refuses root unless told (a root hub in a container).
    c.Spawner.args = ["--allow-root"]
c.Spawner.environment = ENVIRONMENT
c.Spawner.default_url = "/lab"
c.Spawner.start_timeout = 180  # a busy 2-core machine starts a server in 5-30 s
c.Spawner.http_timeout = 120


def copy_student_edition(spawner):
    """Give the learner the course's release, never touching a file they already have."""
    home = workshop.learner_home(spawner)
    owner = spawner.user.name if os.geteuid() == 0 and not hasattr(spawner, "home_dir") else None
    copied = workshop.copy_release(COURSE / "release", home, owner)
    spawner.log.info("%s: %d file(s) of the release copied into %s", spawner.user.name, len(copied), home)


c.Spawner.pre_spawn_hook = copy_student_edition
