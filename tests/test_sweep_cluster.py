"""Sweeps on a Dask cluster (issue 21): a real LocalCluster of worker processes, against the local runner.

The notebooks are small ones made here (a parameters cell and a metric), so each point costs a kernel
start and little more; the cluster tests are marked slow. A worker is killed for real (SIGKILL of its
process, found as the parent of the papermill child that started the point's kernel).
"""

import contextlib
import csv
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from labkit import LabkitError, runner
from labkit.runner import cluster
from labkit.runner.paths import folder_name

pytest.importorskip("distributed", reason="the cluster extra is not installed: pip install -e '.[cluster]'")

PARAMS = "seed = 0\nsteps = 1"
RAISES = "if steps == 3 and seed == 5:\n    raise ValueError('steps=3 with seed=5 is the planted failure')"
METRIC = "from labkit import claims\nclaims.metric('score', steps * 10 + seed)"
# Each point is a kernel: one that passes and one that fails is the fewest that show a failed point leaving
# the others to finish. seed is swept at one value so that the table and the folder names still have
# two swept columns to get right, at no extra kernel.
GRID = {"steps": [1, 3], "seed": [5]}
ROOT = Path(__file__).resolve().parents[1]


def rows_without_timing(out: Path) -> list[dict]:
    with (out / "sweep.csv").open(newline="") as handle:
        return [{k: v for k, v in row.items() if k != "seconds"} for row in csv.DictReader(handle)]


def test_cluster_specs_parse_and_bad_ones_say_what_to_give():
    assert cluster.parse_cluster("local:3") == cluster.ClusterSpec("local", workers=3)
    assert cluster.parse_cluster("tcp://10.0.0.5:8786").address == "tcp://10.0.0.5:8786"
    assert cluster.parse_cluster("scheduler.json").kind == "scheduler-file"
    for bad in ["local", "local:0", "local:two", "http://host:8786", ""]:
        with pytest.raises(LabkitError, match="local:N"):
            cluster.parse_cluster(bad)


def test_without_distributed_the_error_names_the_extra(monkeypatch, make_notebook, tmp_path):
    nb = make_notebook("p", PARAMS, METRIC)
    monkeypatch.setitem(sys.modules, "distributed", None)  # import distributed now raises ImportError
    with pytest.raises(LabkitError, match=re.escape(cluster.INSTALL_HINT)):
        cluster.cluster_sweep(nb, {"steps": [1, 2]}, tmp_path / "sweep", cluster="local:1")
    assert not (tmp_path / "sweep").exists()


def test_an_unreachable_scheduler_is_a_clear_error_within_the_timeout(make_notebook, tmp_path):
    nb = make_notebook("p", PARAMS, METRIC)
    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(LabkitError, match=rf"could not reach the scheduler at tcp://127.0.0.1:{port} within 2 s"):
        cluster.cluster_sweep(nb, {"steps": [1, 2]}, tmp_path / "sweep", cluster=f"tcp://127.0.0.1:{port}",
                              connect_timeout=2)
    assert time.monotonic() - started < 2 + 10  # the timeout, plus the import of distributed on a busy machine
    assert not (tmp_path / "sweep").exists()


def within(seconds: float, call):
    """What `call()` raised or returned, from a daemon thread; an assertion error if it is still running after
    `seconds` (the old code hung there: the thread is left behind rather than the test)."""
    outcome = {}

    def run():
        try:
            outcome["returned"] = call()
        except BaseException as error:  # noqa: BLE001 - the test looks at it
            outcome["raised"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    return outcome


@pytest.mark.parametrize("problem", ["silent port", "missing file", "not json"])
def test_connect_timeout_bounds_a_silent_scheduler_and_a_missing_or_broken_scheduler_file(problem, make_notebook,
                                                                                           tmp_path):
    # DK1, DK2: a port that accepts and never answers held the Client forever; DK4: a missing scheduler
    # file was waited for forever; DK5: a broken one ended in distributed's AssertionError
    nb = make_notebook("p", PARAMS, METRIC)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        where = {"silent port": f"tcp://127.0.0.1:{silent.getsockname()[1]}",
                 "missing file": str(tmp_path / "nofile.json"), "not json": str(tmp_path / "bad.json")}[problem]
        (tmp_path / "bad.json").write_text("{not json")
        outcome = within(60, lambda: cluster.cluster_sweep(nb, {"steps": [1, 2]}, tmp_path / "sweep", cluster=where,
                                                           connect_timeout=2))
    message = {"silent port": "within 2 s .*accepted the connection but never answered",
               "missing file": "no scheduler file .*nofile.json after 2 s: start the scheduler",
               "not json": "bad.json is not a scheduler file"}[problem]
    assert isinstance(outcome.get("raised"), LabkitError), outcome
    assert re.search(message, str(outcome["raised"])), outcome["raised"]
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_a_local_cluster_refuses_a_client_without_its_credentials_and_serves_no_dashboard(tmp_path):
    # DK14: any local process could connect to the sweep's scheduler and run code on its workers
    import distributed

    spec = cluster.parse_cluster("local:1")
    with cluster._local_settings(spec, distributed, tmp_path / ".dask"):
        client, local = cluster._connect(distributed, spec, 60, tmp_path)
        try:
            address = local.scheduler_address
            assert address.startswith("tls://127.0.0.1:")
            assert len(client.run(os.getpid)) == 1  # the sweep's own client, with the credentials, is served
            for intruder in ({"address": address.replace("tls://", "tcp://")},  # no TLS at all
                             {"address": address, "security": distributed.Security.temporary()}):  # another CA
                with pytest.raises(Exception) as refused:
                    distributed.Client(**intruder, timeout=5).run(os.getpid)
                assert not isinstance(refused.value, AssertionError)
            http = f"http://127.0.0.1:{local.scheduler.http_server.port}"
            assert urllib.request.urlopen(f"{http}/health", timeout=10).read() == b"ok"
            for page in ("/status", "/info/main/workers.html", "/json/identity.json", "/metrics"):
                with pytest.raises(urllib.error.HTTPError, match="404"):  # no dashboard, no info on the workers
                    urllib.request.urlopen(http + page, timeout=10)
            listening = {c.laddr.port for process in [psutil.Process(), *psutil.Process().children(recursive=True)]
                         for c in process.net_connections("inet") if c.status == psutil.CONN_LISTEN}
            assert 8787 not in listening
        finally:
            cluster._close(client, local)


def test_the_command_line_refuses_cluster_without_a_sweep_and_with_workers(make_notebook):
    nb = make_notebook("p", PARAMS, METRIC)
    with pytest.raises(LabkitError, match="add --sweep"):
        runner.repro_main([str(nb), "--cluster", "local:2"])
    with pytest.raises(LabkitError, match="drop --workers"):
        runner.repro_main([str(nb), "--sweep", "steps=1,2", "--cluster", "local:2", "--workers", "2"])


@pytest.mark.slow
def test_a_local_cluster_sweep_fails_one_point_and_matches_the_local_runner(make_notebook, tmp_path):
    # Through the command line, as a user runs it, so that the workers' output is seen too: a sweep that
    # ends prints no error or traceback (the stop watcher's race, issue #40) and leaves no dask-scratch-space
    # in the system's temp folder (a folder of the test's own, here, that nothing else writes into).
    nb = make_notebook("p", PARAMS, RAISES, METRIC)
    temp = tmp_path / "temp"
    temp.mkdir()
    command = [sys.executable, "-m", "labkit", "repro", str(nb), "--sweep", "steps=1,3", "--sweep", "seed=5",
               "--cluster", "local:2", "--timeout", "300", "--out", str(tmp_path / "dask")]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(temp))
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    output = finished.stdout + finished.stderr
    assert finished.returncode == 1, output  # one point failed
    assert not [word for word in ("ERROR", "Traceback", "Stream is closed", "cannot watch") if word in output], output
    # nothing at all: Dask's dask-scratch-space and its locks, the workers' folders, papermill's files
    assert not list(temp.iterdir()), f"written outside the sweep folder: {sorted(map(str, temp.rglob('*')))}"
    results = [runner.RunResult(**json.loads((tmp_path / "dask" / folder_name(point) / "p.result.json").read_text()))
               for point in runner.grid_points(GRID)]
    assert [r.status for r in results] == ["ok", "failed"]
    assert "cell 1 ('if steps == 3 and seed == 5:') raised ValueError: steps=3 with seed=5" in results[1].error
    assert [r.metrics.get("score") for r in results] == [15, None]

    local = runner.sweep(nb, GRID, tmp_path / "local", timeout=300, workers=2)
    # The runner's own message for a raising cell, from its local run: the notebook, the cell's index and
    # first line, the exception (tests/test_repro.py ran a notebook of its own for it)
    assert local[1].status == "failed"
    assert local[1].error == ("p.ipynb: cell 1 ('if steps == 3 and seed == 5:') raised ValueError: "
                              "steps=3 with seed=5 is the planted failure"), local[1].error
    runner.write_sweep(runner.sweep_table(local, list(GRID)), tmp_path / "local")
    assert rows_without_timing(tmp_path / "dask") == rows_without_timing(tmp_path / "local")  # labkit and commit too
    assert len(rows_without_timing(tmp_path / "dask")) == 2
    for on_cluster, here in zip(results, local):  # the same files in each point's folder, and no worker path
        folder, local_folder = Path(on_cluster.output).parent, Path(here.output).parent
        assert folder.parent == tmp_path / "dask" and folder.name == local_folder.name
        assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in local_folder.iterdir())
        assert "labkit-point-" not in (folder / "p.ipynb").read_text()
        assert (folder / "p.fingerprint.json").exists()
    assert not (tmp_path / "dask" / cluster.LOCAL_SCRATCH).exists(), "the cluster's scratch folder is removed"
    lines = [line for line in finished.stdout.splitlines() if line.startswith("points: ")]
    assert lines[-1] == "points: 1 done, 0 running, 1 failed, 0 waiting (of 2)"
    assert any(" running" in line and not line.startswith("points: 0 done, 0 running") for line in lines), lines


KILLABLE = (
    "import os, time\nfrom pathlib import Path\n"
    "attempt = len(list(Path(ready).glob(f'{hold}-*'))) + 1\n"
    "Path(ready, f'{hold}-{attempt}-{os.getpid()}').write_text('')\n"
    "if attempt <= hold:\n    time.sleep(120)  # the test kills this point's worker now"
)


def worker_of_kernel(pid: int) -> psutil.Process:
    """The Dask worker process running a point: the parent of the papermill child that started the kernel."""
    process = psutil.Process(pid)
    while process is not None:
        if any("_papermill_child" in part for part in process.cmdline()):
            return process.parent()
        process = process.parent()
    raise AssertionError(f"kernel {pid} is not below a papermill child")


@pytest.mark.slow
def test_a_killed_worker_costs_its_point_one_retry_then_the_point_fails(make_notebook, tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    nb = make_notebook("k", f"ready = {str(ready)!r}\nhold = 0", KILLABLE)
    killed, kernels, done = [], [], threading.Event()

    def killer():  # kill the worker of every attempt that waits: hold=1 once, hold=2 on both tries
        seen = set()
        while not done.is_set():
            for marker in ready.iterdir():
                if marker.name in seen:
                    continue
                seen.add(marker.name)
                hold, attempt, pid = map(int, marker.name.split("-"))
                if attempt <= hold:
                    worker = worker_of_kernel(pid)
                    kernels.append(pid)
                    killed.append(worker.pid)
                    os.kill(worker.pid, signal.SIGKILL)
            time.sleep(0.1)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    lines = []
    try:
        results = cluster.cluster_sweep(nb, {"hold": [1, 2]}, tmp_path / "sweep", timeout=300, cluster="local:2",
                                        progress=lines.append)
    finally:
        done.set()
        thread.join()
    assert len(killed) == 3 and len(set(killed)) == 3, killed
    assert results[0].status == "ok", results[0].error
    assert results[1].status == "failed" and "the worker running it died 2 times" in results[1].error, results[1].error
    assert any(line.startswith("hold=1: started again on") for line in lines), lines
    assert any(line.startswith("hold=1: ok") and "after 2 tries" in line for line in lines), lines
    assert (tmp_path / "sweep" / "hold=2" / "k.result.json").exists()
    deadline = time.monotonic() + 10  # the killed points' kernels follow their papermill child
    while time.monotonic() < deadline and any(map(running, kernels)):
        time.sleep(0.2)
    assert not [pid for pid in kernels if running(pid)], "a killed point's kernel outlived its worker"


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_ctrl_c_stops_the_running_point_and_closes_the_cluster_it_started(make_notebook, tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    nb = make_notebook("k", f"ready = {str(ready)!r}\nhold = 0", KILLABLE)
    out = tmp_path / "sweep"
    command = [sys.executable, "-m", "labkit", "repro", str(nb), "--sweep", "hold=1,2", "--cluster", "local:1",
               "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # a session of its own, so that the SIGINT below reaches the whole group, as Ctrl-C in a terminal does
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not list(ready.iterdir()):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.2)
        kernel = int(next(ready.iterdir()).name.split("-")[2])
        started = psutil.Process(process.pid).children(recursive=True)
        interrupted = time.monotonic()
        os.killpg(process.pid, signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, (stdout, stderr)
    assert time.monotonic() - interrupted < 60
    assert "labkit repro: interrupted" in stderr and "never started" in stderr, stderr
    # DK7: the workers got the terminal's SIGINT too, died printing Dask's tracebacks and lost the running point
    assert "Traceback" not in stdout + stderr and "ERROR" not in stdout + stderr, stderr
    assert "1 stopped while running, with what they had made (hold=1)" in stderr, stderr
    assert (out / "hold=1" / "k.ipynb").exists(), "the stopped point's partial notebook was not kept"
    with (out / "sweep.csv").open(newline="") as handle:
        assert [(row["hold"], row["status"]) for row in csv.DictReader(handle)] == [("1", "interrupted"),
                                                                                   ("2", "interrupted")]
    time.sleep(2)  # the kernel polls for its parent once a second
    assert not running(kernel), "the running point's kernel outlived Ctrl-C"
    assert not [p.pid for p in started if running(p.pid)], "a worker, nanny or papermill process outlived Ctrl-C"
    statuses = {p.parent.name: json.loads(p.read_text())["status"] for p in out.glob("*/k.result.json")}
    assert statuses == {"hold=1": "interrupted", "hold=2": "interrupted"}, statuses
    assert not (out / cluster.LOCAL_SCRATCH).exists()


@pytest.mark.slow
def test_a_scheduler_killed_mid_sweep_fails_its_points_and_the_table_is_written(make_notebook, tmp_path):
    # DK9: a scheduler SIGKILLed mid-sweep ended in a raw KeyError: 'workers' and no sweep.csv
    ready = tmp_path / "ready"
    ready.mkdir()
    nb = make_notebook("k", f"ready = {str(ready)!r}\nhold = 0", KILLABLE)
    scheduler_file = tmp_path / "scheduler.json"
    dask = [str(Path(sys.executable).with_name("dask"))]
    # Dask's scratch space in the test's own temp folder: the killed scheduler cannot remove its own, which was
    # left in the system's temp folder (/tmp/dask-scratch-space/scheduler-*) after every run of this test
    temp = tmp_path / "temp"
    temp.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(temp))
    scheduler = subprocess.Popen([*dask, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                                  "--scheduler-file", str(scheduler_file)], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
    worker = subprocess.Popen([*dask, "worker", "--nthreads", "1", "--no-dashboard", "--scheduler-file",
                               str(scheduler_file)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = tmp_path / "sweep"
    # After the kill the sweep waits --connect-timeout for distributed to reconnect; 10 s instead of 30 keeps the
    # test short, and waiting for the scheduler's file first leaves those 10 s to the connection, not to its start.
    command = [sys.executable, "-m", "labkit", "repro", str(nb), "--sweep", "hold=1,2", "--cluster",
               str(scheduler_file), "--connect-timeout", "10", "--out", str(out)]
    sweep = None
    try:
        deadline = time.monotonic() + 240
        while not scheduler_file.exists():
            assert scheduler.poll() is None and time.monotonic() < deadline, "the scheduler did not start"
            time.sleep(0.2)
        sweep = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not list(ready.iterdir()):
            assert sweep.poll() is None and time.monotonic() < deadline, sweep.communicate()
            time.sleep(0.2)
        scheduler.kill()
        stdout, stderr = sweep.communicate(timeout=300)
    finally:
        leftovers = psutil.Process(worker.pid).children(recursive=True) if worker.poll() is None else []
        for process in [*leftovers, scheduler, worker, *([sweep] if sweep else [])]:  # the point's kernel sleeps on
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                process.kill()
    assert sweep.returncode == 1, (stdout, stderr)
    assert "Traceback" not in stderr and "KeyError" not in stderr, stderr
    assert "the scheduler named in" in stdout and "was lost" in stdout, stdout
    with (out / "sweep.csv").open(newline="") as handle:
        assert [(row["hold"], row["status"]) for row in csv.DictReader(handle)] == [("1", "failed"), ("2", "failed")]
