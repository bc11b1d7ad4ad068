"""The workshop's JupyterHub (workshop/jupyterhub_config.py), run for real: a room of two learners on loopback.

The hub starts from the shipped configuration with only the authenticator swapped for JupyterHub's dummy one
(any password) and its ports, course and room folders set through the environment. Both learners go through
the hub's REST API and then their own hub-spawned server, as JupyterLab does in a browser:
- the hub starts each server, whose pre-spawn hook copied the course's release into the learner's folder;
- a kernel session is opened on ``ps1/00_start_here.ipynb`` through the server's sessions API, every code cell
  is sent as an execute request on the kernel's websocket, and the outputs are saved back through the
  contents API; ada first types the solutions into the exercise cells, bo leaves the release untouched;
- each learner submits through nbgrader's assignment list (the Assignments tab's Submit, on their server).
The instructor then runs `nbgrader collect` and `autograde` in the course folder and reads the gradebook:
ada 2 of 2 points, bo 0 of 2. ada answered 00.1 at an earlier session (her notebook is in her folder before the
hub starts), so her 00.1 point also shows that the pre-spawn copy did not overwrite her work. The hub is stopped with SIGINT, as Ctrl-C in `make workshop` does, and no process it started
may be left. configurable-http-proxy comes from npm (`npm ci --prefix workshop/proxy`): without npm the
module skips, saying so.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import psutil
import pytest

from labkit import student
from labkit.course import layout

pytest.importorskip("jupyterhub", reason="JupyterHub is in the workshop extra: pip install -e '.[workshop]'")
pytest.importorskip("nbgrader", reason="nbgrader is in the course extra: pip install -e '.[course]'")
requests = pytest.importorskip("requests")
from nbgrader.api import Gradebook  # noqa: E402 (after the skips)
from tornado.httpclient import HTTPRequest  # noqa: E402
from tornado.websocket import websocket_connect  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "00_start_here.ipynb"
ASSIGNMENT = "ps1"
LEARNERS = ("ada", "bo")
PROXY = ROOT / "workshop" / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy"
# The bound: the first test also runs both fixtures (course, hub, two servers, two runs of 00, the autograde of
# two notebooks), about 2.5 minutes of CPU; a 2-core machine shared with a dozen other jobs took 8 minutes.
# pytest-timeout's signal lets the fixtures' finalizers stop the hub and everything under it.
CELL_TIMEOUT_S = 240
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

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
        """SIGINT to the hub (Ctrl-C); return what was still running 60 s later, then kill that."""
        if self.stopped is not None:
            return self.stopped
        if self.hub.poll() is None:
            self.remember_processes()
            self.hub.send_signal(signal.SIGINT)
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


PROBE = "import json, os, sys, labkit; print(json.dumps({'cwd': os.getcwd(), 'python': sys.executable, " \
        "'user': os.environ.get('JUPYTERHUB_USER'), 'labkit': labkit.__file__}))"


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
    probe = asyncio.run(execute(ws_url, room.tokens[learner], nb, PROBE))
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


def start_hub(course: Path, folder: Path, learners, args: list[str], env: dict[str, str], started: float) -> Room:
    """The shipped configuration in a process group of its own, on free loopback ports (``args``: overrides)."""
    port = free_port()
    env = {**os.environ, "GRADIENTLAB_COURSE": str(course), "GRADIENTLAB_ROOM": str(folder),
           "GRADIENTLAB_LEARNERS": " ".join(learners), "GRADIENTLAB_HUB_PORT": str(port),
           "GRADIENTLAB_HUB_API_PORT": str(free_port()), "GRADIENTLAB_PROXY_API_PORT": str(free_port()), **env}
    folder.mkdir(parents=True, exist_ok=True)
    log = folder.parent / f"{folder.name}-hub.log"
    with log.open("w") as sink:
        hub = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(ROOT / "workshop" / "jupyterhub_config.py"),
                                *args], cwd=folder.parent, env=env, stdout=sink, stderr=subprocess.STDOUT,
                               start_new_session=True)
    return Room(f"http://127.0.0.1:{port}", course, folder, hub, log, started)


@pytest.fixture(scope="module")
def room(tmp_path_factory):
    """A course with ps1 = 00 released to the exchange, and the workshop hub running for ada and bo."""
    started = time.monotonic()
    install_proxy()
    base = tmp_path_factory.mktemp("workshop")
    course = base / "course"
    layout.create_course([NOTEBOOK], course, ASSIGNMENT)
    nbgrader(course, "release_assignment", ASSIGNMENT)
    # ada worked on 00.1 at an earlier session of the room: the hub must start her server on that file.
    earlier = nbformat.read(course / "release" / ASSIGNMENT / NOTEBOOK.name, 4)
    answer_with_solutions(earlier, ("00.1",))
    earlier_work = base / "room" / "learners" / "ada" / ASSIGNMENT / NOTEBOOK.name
    earlier_work.parent.mkdir(parents=True)
    nbformat.write(earlier, earlier_work)
    room = start_hub(course, base / "room", LEARNERS, ["--JupyterHub.authenticator_class=dummy"], {}, started)
    room.earlier_work = earlier_work
    room.phase("proxy install, course laid out and released")
    try:
        wait_for(lambda: _answers(room.url + "/hub/api/"), "the hub to answer", room)
        room.phase("hub started")
        for learner in LEARNERS:
            reply = room.api("POST", f"/hub/api/users/{learner}/tokens",
                             json={"auth": {"username": learner, "password": "any"}, "note": "test_workshop"})
            assert reply.status_code == 201, reply.text
            room.tokens[learner] = reply.json()["token"]
        yield room
    finally:
        room.stop()


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=5).status_code == 200
    except requests.ConnectionError:
        return False


@pytest.fixture(scope="module")
def worked(room):
    """Both learners work in their servers and submit; the instructor collects and autogrades."""
    # As in a room, both at once: two servers starting, then two learners running 00 side by side.
    with ThreadPoolExecutor(len(LEARNERS)) as pool:
        servers = dict(zip(LEARNERS, pool.map(lambda learner: start_server(room, learner), LEARNERS)))
        room.remember_processes()
        room.phase("two servers started")
        answers = {"ada": ("00.2",), "bo": ()}
        results = dict(zip(LEARNERS, pool.map(lambda learner: work_on_00(room, learner, servers[learner],
                                                                          answers[learner]), LEARNERS)))
    room.phase("ada and bo ran 00 in their servers")
    for learner in LEARNERS:
        submit(room, learner, servers[learner])
    nbgrader(room.course, "collect", ASSIGNMENT)
    room.phase("both submitted, instructor collected")
    nbgrader(room.course, "autograde", ASSIGNMENT)
    room.phase("instructor autograded")
    with Gradebook(f"sqlite:///{room.course / 'gradebook.db'}", layout.COURSE_ID) as gradebook:
        results["scores"] = {learner: {nb.name: (nb.score, nb.max_score)
                                       for nb in gradebook.find_submission(ASSIGNMENT, learner).notebooks}
                             for learner in LEARNERS}
    return results


def test_each_learner_runs_00_in_their_own_copy_in_the_project_environment(room, worked):
    for learner in LEARNERS:
        probe = worked[learner]["probe"]
        assert probe["user"] == learner
        assert Path(probe["cwd"]) == room.room / "learners" / learner / ASSIGNMENT
        assert probe["python"] == sys.executable
        assert Path(probe["labkit"]).resolve().parents[1] == ROOT
        errors = [output for cell in worked[learner]["notebook"].cells for output in cell.get("outputs", [])
                  if output.output_type == "error"]
        assert not errors, f"{learner}'s run of 00 raised: {errors[0].get('ename')}: {errors[0].get('evalue')}"
        ran = [cell for cell in worked[learner]["notebook"].cells if cell.cell_type == "code"]
        assert all(cell.execution_count for cell in ran), f"{learner}: not every code cell ran"


def test_the_copy_was_the_release_and_a_learner_s_earlier_work_was_kept(room, worked):
    released = nbformat.read(room.course / "release" / ASSIGNMENT / NOTEBOOK.name, 4)
    bo = nbformat.read(room.room / "learners" / "bo" / ASSIGNMENT / NOTEBOOK.name, 4)
    assert [cell.source for cell in bo.cells] == [cell.source for cell in released.cells]
    ada = nbformat.read(room.earlier_work, 4)
    solutions = student.find_exercises(nbformat.read(NOTEBOOK, 4), NOTEBOOK.name)
    answers = {student.exercise_id_of(cell): cell.source for cell in ada.cells if student.exercise_id_of(cell)}
    for exercise in ("00.1", "00.2"):  # 00.1 from her earlier session (the hook kept it), 00.2 typed today
        assert solutions[exercise].solution.split(student.BEGIN_SOLUTION)[1].split(student.END_SOLUTION)[0].strip() \
            in answers[exercise], f"ada's answer to {exercise} is not in her notebook"


def test_the_instructor_collects_and_autogrades_both_learners(worked):
    print(f"points per learner: {worked['scores']}")
    assert worked["scores"] == {"ada": {"00_start_here": (2.0, 2.0)}, "bo": {"00_start_here": (0.0, 2.0)}}


def test_ctrl_c_stops_the_hub_and_everything_it_started(room, worked):
    assert len(room.processes) >= 3, f"expected the proxy and two servers under the hub, saw {room.processes}"
    assert room.stop() == [], f"still running after SIGINT: {room.stopped}\n{room.log_tail()}"
    assert room.hub.returncode is not None
    room.phase("hub stopped with SIGINT")
    cpu = os.times()
    print(f"workshop test wall time: {time.monotonic() - room.started:.1f} s at load {os.getloadavg()[0]:.1f}, "
          f"CPU {cpu.user + cpu.system + cpu.children_user + cpu.children_system:.0f} s (pytest and what it waited "
          f"for); phases (s): {room.phases}")


def test_the_shipped_login_admits_the_room_password_and_the_listed_names_only(room, tmp_path):
    """The configuration as shipped, authenticator included (shared-password): no dummy login."""
    hub = start_hub(room.course, tmp_path / "room", ("ada",), [], {"GRADIENTLAB_ROOM_PASSWORD": "correct horse"},
                    time.monotonic())
    try:
        wait_for(lambda: _answers(hub.url + "/hub/api/"), "the shipped hub to answer", hub)

        def login(name: str, password: str) -> int:
            return hub.api("POST", f"/hub/api/users/{name}/tokens",
                           json={"auth": {"username": name, "password": password}}).status_code
        assert (login("ada", "correct horse"), login("ada", "wrong horse"), login("eve", "correct horse")) == \
            (201, 403, 403)
        assert "DummyAuthenticator" not in hub.log.read_text()
    finally:
        assert hub.stop() == [], f"still running after SIGINT: {hub.stopped}"
