"""The workshop's JupyterHub (workshop/jupyterhub_config.py), run for real: a room of two learners on loopback.

The test makes the room as an instructor does (`labkit.course.workshop.add_learner`: a Unix account, a home
only its learner can open and a hub password each, in a group of the test's own) and removes the accounts at
the end, whatever happened. The hub starts from the shipped configuration, authenticator included, with its
ports, course, room and group set through the environment; it runs as root, as `sudo make workshop` and CI
do, from a copy of the checkout (labkit, workshop/ and a solution notebook), which it closes to the learners as it
would the instructor's; the checkout the tests run from keeps its modes. Both learners log in with their own password through the hub's REST API and then use their own
hub-spawned server, as JupyterLab does in a browser:
- the hub starts each server under the learner's account, which first copies the course's release into the
  learner's home;
- a kernel session is opened on ``ps1/00_start_here.ipynb`` through the server's sessions API, every code cell
  is sent as an execute request on the kernel's websocket, and the outputs are saved back through the
  contents API; ada first types the solutions into the exercise cells, bo leaves the release untouched;
- each learner submits through nbgrader's assignment list (the Assignments tab's Submit, on their server).
- each learner's kernel tries to read the other's home, the course's sources and gradebook, the checkout's
  solution notebooks (found from labkit.__file__, PG8) and the hub's secrets, and to write into labkit: every
  try is denied;
- then ada, from her own account, submits her answers under bo's name twice (JUPYTERHUB_USER=bo, and
  nbgrader's --student=bo).
The instructor then runs `nbgrader collect` and `autograde` in the course folder and reads the gradebook:
ada 2 of 2 points, bo 0 of 2 (his own submission, not ada's forgeries). ada answered 00.1 at an earlier session (her notebook is in her folder before the
hub starts), so her 00.1 point also shows that the copy did not overwrite her work. Wrong passwords, unknown
names, root and an account outside the room are refused, and five wrong passwords lock a name out. The hub is
stopped with SIGINT, as Ctrl-C in `make workshop` does, and no process it started may be left. configurable-http-proxy comes from npm (`npm ci --prefix workshop/proxy`): without npm the
module skips, saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import psutil
import pytest

from labkit import student
from labkit.course import layout, workshop

pytest.importorskip("jupyterhub", reason="JupyterHub is in the workshop extra: pip install -e '.[workshop]'")
pytest.importorskip("nbgrader", reason="nbgrader is in the course extra: pip install -e '.[course]'")
requests = pytest.importorskip("requests")
from jupyterhub.spawner import set_user_setuid  # noqa: E402 (after the skips)
from nbgrader.api import Gradebook  # noqa: E402
from tornado.httpclient import HTTPRequest  # noqa: E402
from tornado.websocket import websocket_connect  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The hub runs from a copy of the checkout (`copy_checkout`), never from this one: it closes the checkout it runs
# from to other accounts (workshop.lock_checkout). Run from this one, it put the modes back at the end only to what
# it found, so once something had closed this checkout (a reliability trial loading the hub's configuration did),
# every later run's learners could not start this venv's Python (a 500 from the hub's API).
CHECKOUT_COPY = "checkout"
NOTEBOOK = ROOT / "notebooks" / "00_start_here.ipynb"
ASSIGNMENT = "ps1"
# Names of this run only (a Unix account each, removed at the end): ada answers, bo leaves the release as is.
ROOM_ID = secrets.token_hex(3)
ADA, BO = f"ada{ROOM_ID}", f"bo{ROOM_ID}"
LEARNERS = (ADA, BO)
GROUP = f"glab{ROOM_ID}"
PASSWORDS = {ADA: "ada's own passphrase", BO: "bo's own passphrase"}
PROXY = ROOT / "workshop" / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy"
# The bound: the first test also runs both fixtures (course, hub, two servers, two runs of 00, the autograde of
# two notebooks), about 2.5 minutes of CPU; a 2-core machine shared with a dozen other jobs took 8 minutes.
# pytest-timeout's signal lets the fixtures' finalizers stop the hub and everything under it.
CELL_TIMEOUT_S = 240
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

if os.geteuid() != 0:
    pytest.skip("the workshop hub runs as root (it starts each learner's server as the learner's account): "
                "run this test as root, as CI does", allow_module_level=True)
if shutil.which("npm") is None:
    pytest.skip("npm is not on PATH: the workshop's configurable-http-proxy is an npm package "
                "(install Node.js and npm, then make workshop-proxy)", allow_module_level=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def install_proxy() -> None:
    """What `make workshop-proxy` runs: the locked configurable-http-proxy into workshop/proxy/."""
    if PROXY.exists():
        return
    done = subprocess.run(["npm", "ci", "--prefix", str(ROOT / "workshop" / "proxy"), "--no-audit", "--no-fund"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and PROXY.exists(), f"npm ci failed:\n{done.stderr[-2000:]}"


def nbgrader(course: Path, *args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, capture_output=True, text=True,
                          timeout=480, env=layout.environment_with_tools())
    assert done.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{done.stderr[-3000:]}"


@dataclass
class Room:
    url: str
    course: Path
    room: Path
    hub: subprocess.Popen
    log: Path
    started: float
    earlier_work: Path | None = None
    tokens: dict[str, str] = field(default_factory=dict)
    processes: dict[int, psutil.Process] = field(default_factory=dict)
    stopped: list[str] | None = None
    phases: dict[str, float] = field(default_factory=dict)
    mark: float = 0.0

    def phase(self, name: str) -> None:
        """Record the wall time since the previous phase under ``name``."""
        now = time.monotonic()
        self.phases[name] = round(now - (self.mark or self.started), 1)
        self.mark = now

    def api(self, method: str, path: str, user: str | None = None, **kwargs) -> requests.Response:
        """A request to the hub (``path`` from /hub/...) or to a server (``path`` a full URL)."""
        headers = {"Authorization": f"token {self.tokens[user]}"} if user else {}
        url = path if path.startswith("http") else self.url + path
        return requests.request(method, url, headers=headers, timeout=60, **kwargs)

    def remember_processes(self) -> None:
        """Every process below the hub now: its proxy, the learners' servers and their kernels."""
        for child in psutil.Process(self.hub.pid).children(recursive=True):
            self.processes.setdefault(child.pid, child)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> list[str]:
        """SIGINT to the hub's process group, as Ctrl-C in `make workshop`'s terminal sends it (the proxy, in that
        group, gets it too: WS15); return what was still running 60 s later, then kill that."""
        if self.stopped is not None:
            return self.stopped
        if self.hub.poll() is None:
            self.remember_processes()
            os.killpg(self.hub.pid, signal.SIGINT)
            try:
                self.hub.wait(60)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 20
        alive = [p for p in self.processes.values() if running(p)]
        while alive and time.monotonic() < deadline:
            time.sleep(0.5)
            alive = [p for p in alive if running(p)]
        self.stopped = [f"pid {p.pid} {' '.join(p.cmdline()[:3])}" for p in alive]
        if self.hub.poll() is None:
            self.stopped.append(f"the hub, pid {self.hub.pid}")
            os.killpg(self.hub.pid, signal.SIGKILL)
            self.hub.wait(10)
        for process in alive:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                continue
        return self.stopped


def running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for(condition, what: str, room: Room, limit_s: float = 120):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if room.hub.poll() is not None:
            pytest.fail(f"the hub exited ({room.hub.returncode}) while waiting for {what}:\n{room.log_tail()}")
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"{what} did not happen within {limit_s} s:\n{room.log_tail()}")


def start_server(room: Room, learner: str) -> str:
    """Start the learner's server through the hub's REST API; return its URL once ready."""
    reply = room.api("POST", f"/hub/api/users/{learner}/server", learner)
    assert reply.status_code in (201, 202), reply.text

    def ready():
        model = room.api("GET", f"/hub/api/users/{learner}", learner).json()
        server = model.get("servers", {}).get("")
        return server and server.get("ready") and server["url"]
    return room.url + wait_for(ready, f"{learner}'s server to start", room)


async def execute(ws_url: str, token: str, nb: nbformat.NotebookNode, probe: str) -> str:
    """Run ``nb``'s code cells on the kernel behind ``ws_url`` (the Jupyter messaging protocol over the
    server's websocket, as JupyterLab's Run All does, stopping at the first error), store the outputs in
    ``nb``, then run ``probe`` and return what it printed."""
    connection = await websocket_connect(HTTPRequest(ws_url, headers={"Authorization": f"token {token}"}),
                                         max_message_size=64 * 2**20)
    session = uuid.uuid4().hex

    async def run(code: str) -> tuple[list, dict]:
        msg_id = uuid.uuid4().hex
        await connection.write_message(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "session": session, "username": "test",
                       "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True},
        }))
        outputs, reply, idle = [], None, False
        deadline = time.monotonic() + CELL_TIMEOUT_S
        while reply is None or not idle:
            raw = await asyncio.wait_for(connection.read_message(), deadline - time.monotonic())
            assert raw is not None, "the kernel's websocket closed"
            message = json.loads(raw)
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = message["header"]["msg_type"]
            if kind == "execute_reply":
                reply = message["content"]
            elif kind == "status":
                idle = message["content"]["execution_state"] == "idle"
            elif kind == "clear_output":
                outputs = []
            elif kind in ("stream", "display_data", "execute_result", "error"):
                outputs.append(nbformat.v4.output_from_msg(message))
        return outputs, reply

    try:
        for cell in nb.cells:
            if cell.cell_type != "code":
                continue
            cell.outputs, reply = await run(cell.source)
            cell.execution_count = reply.get("execution_count")
            if reply["status"] != "ok":
                break
        outputs, _ = await run(probe)
        return "".join(output.get("text", "") for output in outputs if output.output_type == "stream")
    finally:
        connection.close()


# What a learner's kernel tries beyond the lesson: read what is not theirs, write into the labkit that grades.
PROBE = """
import json, os, pathlib, sys, labkit


def attempt(action):
    try:
        action()
    except PermissionError:
        return "denied"
    return "done"


def read(path):
    return os.listdir(path) if os.path.isdir(path) else pathlib.Path(path).read_bytes()


def plant(folder):
    planted = pathlib.Path(folder) / "planted_by_a_learner.py"
    planted.touch(exist_ok=False)
    planted.unlink()


reads = {{name: attempt(lambda path=path: read(path)) for name, path in {targets!r}.items()}}
writes = {{"labkit/__init__.py": attempt(lambda: open(labkit.__file__, "r+b").close()),
           "labkit/": attempt(lambda: plant(pathlib.Path(labkit.__file__).parent))}}
print(json.dumps({{"cwd": os.getcwd(), "python": sys.executable, "user": os.environ.get("JUPYTERHUB_USER"),
                  "uid": os.getuid(), "labkit": labkit.__file__, "reads": reads, "writes": writes}}))
"""


def probe_for(room: Room, learner: str) -> str:
    """The probe of ``learner``'s kernel: the other learner's home, the course's solutions and gradebook, the
    hub's secrets."""
    other = next(name for name in LEARNERS if name != learner)
    targets = {"the other learner's home": room.room / "learners" / other,
               "the course's sources": room.course / "source" / ASSIGNMENT / NOTEBOOK.name,
               "the checkout's solutions": hub_checkout(room) / "notebooks" / NOTEBOOK.name,  # PG8: beside labkit
               "the gradebook": room.course / "gradebook.db",
               "the hub's cookie secret": room.room / "jupyterhub_cookie_secret",
               "the hub's database": room.room / workshop.HUB_DATABASE}
    return PROBE.format(targets={name: str(path) for name, path in targets.items()})


def answer_with_solutions(nb: nbformat.NotebookNode, exercises: tuple[str, ...]) -> None:
    """Type these exercises' solutions into their cells, as a learner would (without nbgrader's markers)."""
    solutions = student.find_exercises(nbformat.read(NOTEBOOK, 4), NOTEBOOK.name)
    for cell in nb.cells:
        exercise = student.exercise_id_of(cell)
        if exercise in exercises:
            cell.source = "\n".join(line for line in solutions[exercise].solution.split("\n")
                                    if line.strip() not in (student.BEGIN_SOLUTION, student.END_SOLUTION))


def work_on_00(room: Room, learner: str, server: str, answer: tuple[str, ...]) -> dict:
    """Open ps1/00_start_here.ipynb in the learner's server, answer ``answer``, run it, save it; return the probe."""
    path = f"{ASSIGNMENT}/{NOTEBOOK.name}"
    reply = room.api("GET", f"{server}api/contents/{path}", learner)
    assert reply.status_code == 200, reply.text
    nb = nbformat.from_dict(reply.json()["content"])
    answer_with_solutions(nb, answer)
    session = room.api("POST", f"{server}api/sessions", learner, json={
        "path": path, "name": NOTEBOOK.name, "type": "notebook", "kernel": {"name": "python3"}})
    assert session.status_code == 201, session.text
    kernel, session_id = session.json()["kernel"]["id"], session.json()["id"]
    ws_url = server.replace("http://", "ws://") + f"api/kernels/{kernel}/channels?session_id={uuid.uuid4().hex}"
    probe = asyncio.run(execute(ws_url, room.tokens[learner], nb, probe_for(room, learner)))
    saved = room.api("PUT", f"{server}api/contents/{path}", learner,
                     json={"type": "notebook", "format": "json", "content": nb})
    assert saved.status_code == 200, saved.text
    assert room.api("DELETE", f"{server}api/sessions/{session_id}", learner).status_code == 204
    return {"probe": json.loads(probe.strip().splitlines()[-1]), "notebook": nb}


def submit(room: Room, learner: str, server: str) -> None:
    """The Assignments tab's Submit: nbgrader's assignment-list extension on the learner's server."""
    reply = room.api("POST", f"{server}assignments/submit", learner,
                     json={"course_id": layout.COURSE_ID, "assignment_id": ASSIGNMENT})
    assert reply.status_code == 200, reply.text
    assert not (isinstance(reply.json(), dict) and reply.json().get("success") is False), reply.json().get("value")


def submit_as_someone_else(room: Room, learner: str, victim: str, *claim: str) -> None:
    """From ``learner``'s own terminal (their account, their server's environment): `nbgrader submit` of their
    work with JUPYTERHUB_USER set to ``victim`` and ``claim`` added to the command line."""
    account = pwd.getpwnam(learner)
    env = {**workshop.learner_environment(room.course), "HOME": account.pw_dir, "USER": learner,
           "JUPYTERHUB_USER": victim}
    done = subprocess.run([sys.executable, "-m", "nbgrader", "submit", ASSIGNMENT, *claim], cwd=account.pw_dir,
                          env=env, preexec_fn=set_user_setuid(learner), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{learner}'s nbgrader submit {' '.join(claim)} failed:\n{done.stderr[-2000:]}"


def start_hub(course: Path, folder: Path, args: list[str], env: dict[str, str], started: float) -> Room:
    """The shipped configuration in a process group of its own, on free loopback ports (``args``: overrides)."""
    port = free_port()
    copy = folder.parent / CHECKOUT_COPY
    env = {**os.environ, "GRADIENTLAB_COURSE": str(course), "GRADIENTLAB_ROOM": str(folder), "GRADIENTLAB_PROXY": str(PROXY),
           "GRADIENTLAB_LEARNERS_GROUP": GROUP, "GRADIENTLAB_HUB_PORT": str(port),
           "GRADIENTLAB_HUB_API_PORT": str(free_port()), "GRADIENTLAB_PROXY_API_PORT": str(free_port()), **env}
    log = folder.parent / f"{folder.name}-hub.log"
    with log.open("w") as sink:
        hub = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(copy / "workshop" / "jupyterhub_config.py"),
                                *args], cwd=folder.parent, env=env, stdout=sink, stderr=subprocess.STDOUT,
                               start_new_session=True)
    return Room(f"http://127.0.0.1:{port}", course, folder, hub, log, started)


@pytest.fixture(scope="module")
def accounts():
    """A folder other accounts may pass through (pytest's own are root's alone), and the room's learners, a
    Unix account and a password each; the accounts, their group and the folder go at the end, whatever happened."""
    base = Path(tempfile.mkdtemp(prefix="gradientlab-workshop-"))
    copy_checkout(base / CHECKOUT_COPY)
    # This Python may live in root's home (pyenv), its venv in this checkout: the learners' servers run it, so its
    # folders let them pass for the test (o+x: pass, not list), and get their modes back after it.
    venv = Path(sys.executable).parent
    closed = {folder: stat.S_IMODE(folder.stat().st_mode) for path in (base, Path(sys.executable).resolve(), venv)
              for folder in [path, *path.parents] if folder.is_dir() and not folder.stat().st_mode & stat.S_IXOTH}
    try:
        for folder, mode in closed.items():
            folder.chmod(mode | 0o001)
        for learner in LEARNERS:
            workshop.add_learner(base / "room", learner, GROUP, PASSWORDS[learner])
        yield base
    finally:
        for learner in LEARNERS:
            subprocess.run(["userdel", learner], capture_output=True)
        subprocess.run(["groupdel", GROUP], capture_output=True)
        for folder, mode in closed.items():
            folder.chmod(mode)
        shutil.rmtree(base)
    assert not {learner for learner in LEARNERS if _account_exists(learner)}, "a learner's account was left behind"
    assert checkout_modes() == CHECKOUT_MODES, "the hub changed the modes of the checkout the tests run from"


def checkout_modes() -> dict[Path, int]:
    return {entry: stat.S_IMODE(entry.lstat().st_mode) for entry in ROOT.iterdir() if not entry.is_symlink()}


CHECKOUT_MODES = checkout_modes()


def copy_checkout(copy: Path) -> None:
    """What the hub needs of a checkout (labkit, workshop, pyproject.toml) and the solution notebook it must close,
    copied to ``copy``: the hub closes the checkout it runs from, and the learners import labkit from there."""
    copy.mkdir()
    untracked = shutil.ignore_patterns("__pycache__", "node_modules", "room")
    for folder in ("labkit", "workshop"):
        shutil.copytree(ROOT / folder, copy / folder, ignore=untracked)
    shutil.copy2(ROOT / "pyproject.toml", copy / "pyproject.toml")
    (copy / "notebooks").mkdir()
    shutil.copy2(NOTEBOOK, copy / "notebooks" / NOTEBOOK.name)


def hub_checkout(room: Room) -> Path:
    """The copy of the checkout the hub runs from (`copy_checkout`), beside its room."""
    return room.room.parent / CHECKOUT_COPY


def _account_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


@pytest.fixture(scope="module")
def room(accounts):
    """A course with ps1 = 00 released to the exchange, and the workshop hub running for ada and bo."""
    started = time.monotonic()
    install_proxy()
    course = accounts / "course"
    layout.create_course([NOTEBOOK], course, ASSIGNMENT)
    nbgrader(course, "release_assignment", ASSIGNMENT)
    # ada worked on 00.1 at an earlier session of the room: the hub must start her server on that file.
    earlier = nbformat.read(course / "release" / ASSIGNMENT / NOTEBOOK.name, 4)
    answer_with_solutions(earlier, ("00.1",))
    ada = pwd.getpwnam(ADA)
    earlier_work = Path(ada.pw_dir) / ASSIGNMENT / NOTEBOOK.name
    earlier_work.parent.mkdir()
    nbformat.write(earlier, earlier_work)
    for path in (earlier_work.parent, earlier_work):
        os.chown(path, ada.pw_uid, ada.pw_gid)
    room = start_hub(course, accounts / "room", [], {}, started)
    room.earlier_work = earlier_work
    room.phase("proxy install, accounts made, course laid out and released")
    try:
        wait_for(lambda: _answers(room.url + "/hub/api/"), "the hub to answer", room)
        room.phase("hub started")
        for learner in LEARNERS:
            reply = login(room, learner, PASSWORDS[learner])
            assert reply.status_code == 201, reply.text
            room.tokens[learner] = reply.json()["token"]
        yield room
    finally:
        room.stop()


def login(room: Room, name: str, password: str) -> requests.Response:
    """The hub's login with a name and password (a token request, as a script logs in)."""
    return room.api("POST", f"/hub/api/users/{name}/tokens",
                    json={"auth": {"username": name, "password": password}, "note": "test_workshop"})


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=5).status_code == 200
    except requests.ConnectionError:
        return False


@pytest.fixture(scope="module")
def worked(room):
    """Both learners work in their servers and submit, ada submits twice more as bo; the instructor collects
    and autogrades."""
    # As in a room, both at once: two servers starting, then two learners running 00 side by side.
    with ThreadPoolExecutor(len(LEARNERS)) as pool:
        servers = dict(zip(LEARNERS, pool.map(lambda learner: start_server(room, learner), LEARNERS)))
        room.remember_processes()
        results = {"servers": {process.pid: (process.uids().real, process.environ().get("JUPYTERHUB_USER"),
                                             process.cmdline())
                               for process in room.processes.values() if "jupyterhub.singleuser" in process.cmdline()}}
        room.phase("two servers started")
        answers = {ADA: ("00.2",), BO: ()}
        results.update(zip(LEARNERS, pool.map(lambda learner: work_on_00(room, learner, servers[learner],
                                                                         answers[learner]), LEARNERS)))
    room.phase("ada and bo ran 00 in their servers")
    room.remember_processes()  # the kernels too, while they run
    results["listeners"] = listeners(room)
    for learner in LEARNERS:
        submit(room, learner, servers[learner])
    with ThreadPoolExecutor(2) as pool:  # two nbgrader processes: side by side, as two terminals would
        list(pool.map(lambda claim: submit_as_someone_else(room, ADA, BO, *claim), ((), (f"--student={BO}",))))
    results["inbound"] = sorted((path.name.split("+")[0], pwd.getpwuid(path.stat().st_uid).pw_name)
                                for path in (room.course / "exchange" / layout.COURSE_ID / "inbound").iterdir())
    nbgrader(room.course, "collect", ASSIGNMENT)
    room.phase("both submitted, ada twice as bo, instructor collected")
    nbgrader(room.course, "autograde", ASSIGNMENT)
    room.phase("instructor autograded")
    results["room"] = {path.name: (stat.S_IMODE(path.stat().st_mode), path.stat().st_uid)
                       for path in room.room.iterdir() if path.name != "learners"}
    with Gradebook(f"sqlite:///{room.course / 'gradebook.db'}", layout.COURSE_ID) as gradebook:
        results["scores"] = {learner: {nb.name: (nb.score, nb.max_score)
                                       for nb in gradebook.find_submission(ASSIGNMENT, learner).notebooks}
                             for learner in LEARNERS}
    return results


def listeners(room: Room) -> dict[str, set[str]]:
    """The addresses every process of the hub's tree listens on (hub, proxy, servers, kernels), by process."""
    found: dict[str, set[str]] = {}
    for process in [psutil.Process(room.hub.pid), *room.processes.values()]:
        with contextlib.suppress(psutil.NoSuchProcess):
            for connection in process.net_connections(kind="inet"):
                if connection.status == psutil.CONN_LISTEN:
                    found.setdefault(f"{process.pid} {' '.join(process.cmdline()[:3])}", set()).add(connection.laddr.ip)
    return found


def test_the_hub_its_proxy_the_servers_and_their_kernels_listen_on_loopback_only(worked):
    # WS1 of the reliability review, rerun with a server and a kernel per learner account
    assert len(worked["listeners"]) >= 4, f"expected the hub, the proxy and two servers listening: {worked['listeners']}"
    assert {ip for ips in worked["listeners"].values() for ip in ips} == {"127.0.0.1"}, worked["listeners"]


def test_the_room_s_database_and_cookie_secret_stay_root_s_alone_while_the_hub_runs(worked):
    # WS2: the database (password hashes, tokens) and cookie secret as the running hub left them, journals included
    secrets_ = {name: mode_uid for name, mode_uid in worked["room"].items()
                if name.startswith((workshop.HUB_DATABASE, "jupyterhub_cookie_secret"))}
    assert "jupyterhub_cookie_secret" in secrets_ and workshop.HUB_DATABASE in secrets_, worked["room"]
    assert set(secrets_.values()) == {(0o600, 0)}, secrets_
    # the rest: JupyterHub's pid file (0644, the hub's pid, which /proc shows every account anyway)
    assert set(worked["room"]) - set(secrets_) <= {"jupyterhub.pid"}, worked["room"]


def test_each_learner_runs_00_in_their_own_copy_in_the_project_environment(room, worked):
    for learner in LEARNERS:
        probe = worked[learner]["probe"]
        assert probe["user"] == learner
        assert Path(probe["cwd"]) == room.room / "learners" / learner / ASSIGNMENT
        assert probe["python"] == sys.executable
        assert Path(probe["labkit"]).resolve().parents[1] == hub_checkout(room)
        errors = [output for cell in worked[learner]["notebook"].cells for output in cell.get("outputs", [])
                  if output.output_type == "error"]
        assert not errors, f"{learner}'s run of 00 raised: {errors[0].get('ename')}: {errors[0].get('evalue')}"
        ran = [cell for cell in worked[learner]["notebook"].cells if cell.cell_type == "code"]
        assert all(cell.execution_count for cell in ran), f"{learner}: not every code cell ran"


def test_each_server_and_kernel_runs_as_its_learner_never_root(worked):
    uids = {learner: pwd.getpwnam(learner).pw_uid for learner in LEARNERS}
    servers = sorted(worked["servers"].values())
    assert [(uid, user) for uid, user, _ in servers] == sorted((uid, name) for name, uid in uids.items()), servers
    assert not [command for _, _, command in servers if "--allow-root" in command]
    assert {learner: worked[learner]["probe"]["uid"] for learner in LEARNERS} == uids


def test_a_learner_s_kernel_reads_nothing_that_is_not_theirs_and_cannot_write_labkit(worked):
    for learner in LEARNERS:
        probe = worked[learner]["probe"]
        assert probe["reads"] == dict.fromkeys(probe["reads"], "denied"), f"{learner} could read: {probe['reads']}"
        assert probe["writes"] == dict.fromkeys(probe["writes"], "denied"), f"{learner} could write: {probe['writes']}"
        home = Path(pwd.getpwnam(learner).pw_dir)
        assert (home.stat().st_mode & 0o777, home.stat().st_uid) == (0o700, pwd.getpwnam(learner).pw_uid)


def test_the_hub_closes_the_checkout_it_runs_from_and_leaves_the_tests_checkout_as_it_was(room, worked):
    # While the hub runs: its own checkout is closed to the learners but for what they need (lock_checkout) ...
    closed = {entry.name for entry in hub_checkout(room).iterdir() if not entry.stat().st_mode & 0o077}
    assert closed == {"notebooks"}, closed
    # ... and the checkout the tests run from keeps its modes (the hub ran from it and closed it before)
    assert checkout_modes() == CHECKOUT_MODES, "the hub changed the modes of the checkout the tests run from"


def test_the_copy_was_the_release_and_a_learner_s_earlier_work_was_kept(room, worked):
    released = nbformat.read(room.course / "release" / ASSIGNMENT / NOTEBOOK.name, 4)
    bo = nbformat.read(room.room / "learners" / BO / ASSIGNMENT / NOTEBOOK.name, 4)
    assert [cell.source for cell in bo.cells] == [cell.source for cell in released.cells]
    ada = nbformat.read(room.earlier_work, 4)
    solutions = student.find_exercises(nbformat.read(NOTEBOOK, 4), NOTEBOOK.name)
    answers = {student.exercise_id_of(cell): cell.source for cell in ada.cells if student.exercise_id_of(cell)}
    for exercise in ("00.1", "00.2"):  # 00.1 from her earlier session (the hook kept it), 00.2 typed today
        assert solutions[exercise].solution.split(student.BEGIN_SOLUTION)[1].split(student.END_SOLUTION)[0].strip() \
            in answers[exercise], f"ada's answer to {exercise} is not in her notebook"
    owners = {pwd.getpwuid(path.stat().st_uid).pw_name for path in (room.room / "learners" / BO).rglob("*")}
    assert owners == {BO}, f"bo's copy of the release is owned by {owners}"


def test_a_submission_counts_for_the_learner_who_wrote_it(worked):
    # In the exchange: ada's and bo's own submissions, ada's with JUPYTERHUB_USER=bo filed under her own name
    # (nbgrader takes the account), and ada's --student=bo under bo's name but owned by her, which the
    # instructor's collect then files as hers (bo's score below is his own untouched release's).
    assert worked["inbound"] == sorted([(ADA, ADA), (BO, BO), (ADA, ADA), (BO, ADA)]), worked["inbound"]


def test_the_instructor_collects_and_autogrades_both_learners(worked):
    # 00's two exercises and its lab's check (a locked nbgrader test since #39): ada answered the
    # exercises and left the lab, bo handed in his release untouched
    print(f"points per learner: {worked['scores']}")
    assert worked["scores"] == {ADA: {"00_start_here": (2.0, 3.0)}, BO: {"00_start_here": (0.0, 3.0)}}


def test_only_a_learner_with_their_own_password_logs_in_and_guessing_locks_the_name(room, worked):
    assert login(room, ADA, PASSWORDS[BO]).status_code == 403, "ada's name with bo's password was admitted"
    for name in ("eve", "root", "nobody"):  # no account; root; an account that is not a learner of the room
        assert login(room, name, PASSWORDS[ADA]).status_code == 403, f"{name} was admitted"
    for _ in range(5):
        assert login(room, BO, "not bo's password").status_code == 403
    assert login(room, BO, PASSWORDS[BO]).status_code == 403, "bo's name was not locked after 5 wrong passwords"
    assert room.api("GET", "/hub/login").status_code == 200, "the login page does not render"


def test_ctrl_c_stops_the_hub_and_everything_it_started(room, worked):
    assert len(room.processes) >= 3, f"expected the proxy and two servers under the hub, saw {room.processes}"
    assert room.stop() == [], f"still running after SIGINT: {room.stopped}\n{room.log_tail()}"
    assert room.hub.returncode is not None
    room.phase("hub stopped with SIGINT")
    cpu = os.times()
    print(f"workshop test wall time: {time.monotonic() - room.started:.1f} s at load {os.getloadavg()[0]:.1f}, "
          f"CPU {cpu.user + cpu.system + cpu.children_user + cpu.children_system:.0f} s (pytest and what it waited "
          f"for); phases (s): {room.phases}")
