"""Sweeps on a Dask cluster: each grid point runs on a `distributed` worker and its files come back here.

``python -m labkit repro NB --sweep ... --cluster local:N`` starts a LocalCluster of N worker
processes (one point at a time each, loopback only, no dashboard, TLS with credentials made for it
alone, so no other local process can connect and run code on its workers); ``--cluster tcp://HOST:PORT`` or
``--cluster path/to/scheduler.json`` submits to a scheduler that is already running, such as one
that dask-jobqueue started on Slurm or dask-kubernetes on Kubernetes (docs/RERUN.md, "Sweeps at scale").

On the worker a point is `labkit.runner.run.run_notebook` in a scratch folder of its own under the
worker's local directory: papermill in a child process, the parameters validated, the worker's
machine fingerprinted. The worker sends back every file of that run folder and removes the scratch
folder; here they are written under the point's folder, where `labkit.runner.sweep` puts
them, so the table and the plots come from `sweep_table` and `write_sweep` as for a local sweep.

Faults: a notebook that raises is a failed point naming its cell, and the others go on; a worker
that dies mid-point gets the point run once more on another worker, and a point whose second try
dies too is failed (the point counts its own starts; dask's ``retries=1`` covers a task that
raised); Ctrl-C or SIGTERM asks the
running points to stop (a distributed Event they watch), cancels the rest, and closes a cluster
started here (its workers ignore the terminal's Ctrl-C, which is the sweep's to handle); a scheduler
that cannot be reached and answer within ``connect_timeout`` seconds, or a scheduler file that does
not appear or holds no address, is a LabkitError; a scheduler lost mid-sweep fails the points it
held and the sweep returns what finished. `distributed` is imported only when a cluster is asked for
(the ``cluster`` extra).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import math
import multiprocessing
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labkit.errors import LabkitError
from labkit.runner.paths import folder_name, inside, new_folder, require_empty_folder
from labkit.runner.rerun_parameters import validate_parameters
from labkit.runner.run import RunResult, check_timeout, run_notebook
from labkit.runner.sweeps import MAX_POINTS, check_point_count, grid_points

__all__ = ["CONNECT_TIMEOUT", "LOCAL_SCRATCH", "ClusterSpec", "SweepInterrupted", "cluster_sweep", "dask_setup",
           "parse_cluster"]

CONNECT_TIMEOUT = 10.0
"""Seconds to reach a scheduler (and for it to have a worker) before giving up with a clear error."""
LOCAL_SCRATCH = ".dask"
"""The local directory of a cluster started here, inside the sweep folder; removed when the sweep ends."""
INSTALL_HINT = "pip install -e '.[cluster]' in the repository"
MAX_TRIES = 2  # a point whose worker died is run once more, then failed
WORKER_LOOK_SECONDS = 2.0  # how often the client re-reads the cluster's workers (how many points fit at once)
POLL_SECONDS = 0.25  # how often the client looks at its futures and the workers' start events
STOP_WAIT_SECONDS = 15.0  # after Ctrl-C, how long running points get to stop and send back what they have
WATCH_SECONDS = 0.5  # how often a running point asks the scheduler whether the sweep asked it to stop
WATCH_JOIN_SECONDS = 10.0  # how long a finished point waits for its watcher's last question to be answered
# A point's tries are its starts on a worker, counted by the point itself (`_run_point`): the
# scheduler's own count (allowed-failures) charges a worker's death to every point assigned to it,
# even one queued behind the point it was running, so on a cluster started here it is set high
# enough never to decide first; a running scheduler keeps its own setting (3 by default).
# The scheduler and each worker always serve HTTP (the scheduler on 8787 unless told otherwise): here only
# the health check, on a free loopback port, and no dashboard.
LOCAL_CLUSTER_CONFIG = {"distributed.scheduler.allowed-failures": 4 * MAX_TRIES,
                        "distributed.scheduler.http.routes": ["distributed.http.health"],
                        "distributed.worker.http.routes": ["distributed.http.health"]}
ADDRESS_SCHEMES = ("tcp://", "tls://", "ucx://", "inproc://", "ws://", "wss://")
SCHEDULER_FILE_POLL_SECONDS = 0.1  # how often a missing scheduler file is looked for, until connect_timeout


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a cluster sweep: ``results`` holds every point, in grid order, as it ended
    (finished, "interrupted" while running, or "interrupted" before it started), so its table can be written."""

    def __init__(self, message: str, results: list[RunResult]):
        super().__init__(message)
        self.results = results


@dataclass(frozen=True)
class ClusterSpec:
    """Where the points run: ``kind`` is "local" (``workers`` processes), "address" or "scheduler-file"."""

    kind: str
    workers: int = 0
    address: str = ""

    def describe(self) -> str:
        if self.kind == "local":
            return f"a LocalCluster of {self.workers} worker process{'es' if self.workers != 1 else ''}"
        if self.kind == "scheduler-file":
            return f"the scheduler named in {self.address}"
        return f"the scheduler at {self.address}"


def parse_cluster(text: str) -> ClusterSpec:
    """``local:N``, a scheduler address (``tcp://HOST:PORT``) or the path of a scheduler file, checked."""
    text = str(text).strip()
    if text.startswith("local"):
        _, sep, count = text.partition(":")
        if not sep or not count.isdigit() or int(count) < 1:
            raise LabkitError(f"--cluster {text!r}: a local cluster is local:N with N worker processes, "
                              "1 or more (e.g. local:2)")
        return ClusterSpec("local", workers=int(count))
    if text.startswith(ADDRESS_SCHEMES):
        return ClusterSpec("address", address=text)
    if "://" in text:
        raise LabkitError(f"--cluster {text!r}: unknown scheme; give local:N, a scheduler address such as "
                          "tcp://HOST:8786, or the path of a scheduler file")
    if not text or Path(text).is_dir():
        raise LabkitError(f"--cluster {text!r}: give local:N, a scheduler address such as tcp://HOST:8786, "
                          "or the path of a scheduler file (the JSON `dask scheduler --scheduler-file` writes)")
    return ClusterSpec("scheduler-file", address=text)


def cluster_sweep(notebook: str | Path, grid: dict[str, list], out_dir: str | Path, fixed: dict | None = None,
                  timeout: float = 900, cluster: str | ClusterSpec = "local:2",
                  connect_timeout: float = CONNECT_TIMEOUT,
                  progress: Callable[[str], None] | None = print, max_points: int = MAX_POINTS) -> list[RunResult]:
    """`sweep.sweep` on a Dask cluster: the notebook at every grid point, one folder per point, in grid order.

    `out_dir` must be new or empty (a grid of more than `max_points` points is refused first); its point folders are named as a local sweep names them and get
    the same files. `progress` receives plain lines (points done, running, failed, waiting; one line
    per finished point); None prints nothing. Ctrl-C or SIGTERM stops every point within seconds,
    keeps what finished, and raises KeyboardInterrupt naming it.
    """
    fixed = fixed or {}
    both = sorted(set(fixed) & set(grid))
    if both:
        raise LabkitError(f"{', '.join(both)} is both fixed (-p) and swept (--sweep): keep one of them")
    timeout = check_timeout(timeout)
    connect_timeout = check_timeout(connect_timeout, "connect_timeout")
    spec = cluster if isinstance(cluster, ClusterSpec) else parse_cluster(cluster)
    notebook = Path(notebook).resolve()
    check_point_count(grid, max_points)
    points = [dict(fixed, **point) for point in grid_points(grid)]
    for point in points:
        validate_parameters(notebook, point)
    distributed = _import_distributed()
    existed = Path(out_dir).exists()
    out_dir = require_empty_folder(out_dir, "sweep folder")
    say = progress or (lambda line: None)
    with _local_settings(spec, distributed, out_dir / LOCAL_SCRATCH):
        try:
            client, local = _connect(distributed, spec, connect_timeout, out_dir)
        except BaseException:
            shutil.rmtree(out_dir / LOCAL_SCRATCH, ignore_errors=True)
            if not existed:
                out_dir.rmdir()  # nothing was run: leave no empty sweep folder behind
            raise
        try:
            folders = [new_folder(out_dir, folder_name({k: point[k] for k in grid})) for point in points]
            return _run_points(distributed, client, spec, notebook, points, folders, timeout, say)
        finally:
            _close(client, local)
            if local is not None:
                shutil.rmtree(out_dir / LOCAL_SCRATCH, ignore_errors=True)


def _scheduler_file_address(path: Path, connect_timeout: float) -> str:
    """The scheduler address a scheduler file holds, waiting up to `connect_timeout` s for the file to appear."""
    deadline = time.monotonic() + connect_timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise LabkitError(f"no scheduler file {path} after {connect_timeout:g} s: start the scheduler with "
                              f"`dask scheduler --scheduler-file {path}` first, check the path, or allow longer with "
                              "--connect-timeout")
        time.sleep(SCHEDULER_FILE_POLL_SECONDS)
    try:
        address = json.loads(path.read_text(encoding="utf-8"))["address"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        raise LabkitError(f"{path} is not a scheduler file ({type(error).__name__}: {error}): give the JSON that "
                          "`dask scheduler --scheduler-file PATH` writes, or the scheduler's address") from None
    if not isinstance(address, str) or not address.startswith(ADDRESS_SCHEMES):
        raise LabkitError(f"{path} names no scheduler address (its 'address' is {address!r}): give the JSON that "
                          "`dask scheduler --scheduler-file PATH` writes, or the scheduler's address")
    return address


def _handshake(distributed, address: str, seconds: float) -> None:
    """Connect to `address` and exchange distributed's handshake within `seconds`, or raise TimeoutError/OSError.

    distributed bounds the TCP connect by its timeout but waits for the handshake's answer without one,
    so a port that accepts and never answers would hold the Client forever. Run in a thread of its own:
    the caller may be inside a running event loop (a notebook)."""
    async def exchange() -> None:
        comm = await distributed.comm.connect(address, timeout=seconds,
                                              **distributed.Security().get_connection_args("client"))
        await comm.close()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, asyncio.wait_for(exchange(), seconds)).result()


def _import_distributed():
    try:
        import distributed
    except ImportError as error:
        raise LabkitError(f"--cluster needs Dask's distributed package, which is not installed here ({error}): "
                          f"{INSTALL_HINT}") from error
    return distributed


def _connect(distributed, spec: ClusterSpec, connect_timeout: float, out_dir: Path):
    """(client, the LocalCluster started here or None); a LabkitError when the scheduler cannot be reached."""
    if spec.kind == "local":
        # TLS with a key and certificate made for this cluster alone (kept in memory): a client or worker
        # without them is refused, so another local process cannot run code on the sweep's workers
        security = distributed.Security.temporary()
        local = distributed.LocalCluster(
            n_workers=spec.workers, threads_per_worker=1, processes=True, host="127.0.0.1", protocol="tls://",
            security=security, scheduler_port=0, dashboard_address=None, memory_limit=0,
            # the scheduler's HTTP server runs without a dashboard too: on a free port, not 8787, where a
            # second sweep or a notebook's cluster would get "Port 8787 is already in use"
            scheduler_kwargs={"dashboard": False, "dashboard_address": "127.0.0.1:0"},
            local_directory=str(out_dir / LOCAL_SCRATCH), silence_logs=logging.ERROR)
        try:
            return distributed.Client(local, security=security, timeout=connect_timeout), local
        except BaseException:
            local.close()
            raise
    started = time.monotonic()
    try:
        address = spec.address
        if spec.kind == "scheduler-file":
            address = _scheduler_file_address(Path(spec.address), connect_timeout)
        _handshake(distributed, address, max(connect_timeout - (time.monotonic() - started), 0.1))
        client = distributed.Client(address, timeout=connect_timeout)
    except (OSError, TimeoutError) as error:
        seconds = time.monotonic() - started
        raise LabkitError(f"could not reach {spec.describe()} within {connect_timeout:g} s (gave up after "
                          f"{seconds:.1f} s: {str(error) or 'it accepted the connection but never answered'}); start it first (docs/RERUN.md, Sweeps at scale), check the "
                          "address, or allow longer with --connect-timeout") from error
    try:
        client.wait_for_workers(1, timeout=connect_timeout)
    except TimeoutError as error:
        client.close()
        raise LabkitError(f"{spec.describe()} has no worker after {connect_timeout:g} s: start workers "
                          "(`dask worker ADDRESS`, or scale the jobqueue or Kubernetes cluster) or allow longer "
                          "with --connect-timeout") from error
    return client, None


@contextlib.contextmanager
def _local_settings(spec: ClusterSpec, distributed, scratch: Path):
    """Dask's settings for a cluster started here, for all its life (a worker the nanny restarts reads them too).

    `LOCAL_CLUSTER_CONFIG`; `scratch` as Dask's temporary directory, so the scheduler's (and every
    other) dask-scratch-space lies in the sweep folder, not in the system's temp folder; and where the
    platform has forkserver, workers forked from one process that imported the runner.

    Spawned workers each start a fresh interpreter and import `distributed`, then labkit's runner
    (torch among it) before their first point; forked from a server that imported both once, they
    start with them loaded. The server imports only modules, runs nothing, and starts no threads.
    """
    import dask

    if spec.kind != "local":
        yield
        return
    config = {**LOCAL_CLUSTER_CONFIG, "temporary-directory": str(scratch), "distributed.worker.preload": [__name__]}
    if "forkserver" not in multiprocessing.get_all_start_methods():
        with dask.config.set(config):
            yield
        return
    with dask.config.set({**config, "distributed.worker.multiprocessing-method": "forkserver"}):
        context = distributed.utils.get_mp_context()  # distributed sets its own preload list once, here
        context.set_forkserver_preload(["distributed", __name__])
        yield


def dask_setup(worker) -> None:
    """Run by each worker of a cluster started here (its preload): the terminal's Ctrl-C reaches the whole
    process group, but stopping the running points is the sweep's job (it asks them through an Event and
    keeps what they made); a worker killed by it would lose its point and print Dask's tracebacks."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _close(client, local) -> None:
    client.close()
    if local is not None:
        local.close()


@dataclass
class _Point:
    index: int
    values: dict
    folder: Path
    future: object = None
    workers: list = field(default_factory=list)  # the worker of each start, in order


def _run_points(distributed, client, spec: ClusterSpec, notebook: Path, points: list[dict], folders: list[Path],
                timeout: float, say: Callable[[str], None]) -> list[RunResult]:
    """Keep as many points in flight as the cluster has worker threads; collect each as it finishes.

    Points wait here, not on the scheduler, so a worker that dies holds only the point it was
    running, and only that point counts the death against its one retry. A scheduler lost for good
    (distributed gave up reconnecting) fails every point not finished yet; the finished ones stay.
    """
    token = secrets.token_hex(6)
    topic, stop_name = f"labkit-sweep-{token}", f"labkit-stop-{token}"
    starts: list[dict] = []
    client.subscribe_topic(topic, lambda event: starts.append(event[1]))  # runs in the client's event loop
    source = notebook.read_bytes()
    waiting = [_Point(index, point, folder) for index, (point, folder) in enumerate(zip(points, folders))]
    in_flight: dict[int, _Point] = {}
    results: dict[int, RunResult] = {}
    say(f"sweep of {len(points)} point(s) of {notebook.name} on {spec.describe()}")
    last, threads, looked = "", {}, -math.inf
    try:
        while waiting or in_flight:
            if client.status in ("closing", "closed"):
                _scheduler_lost(spec, notebook, waiting, in_flight, results, say)
                break
            if client.status != "running":  # reconnecting: distributed gives it up to connect_timeout s
                time.sleep(POLL_SECONDS)
                continue
            if time.monotonic() - looked > WORKER_LOOK_SECONDS:  # the cluster may grow or shrink meanwhile
                threads, looked = _threads_by_host(client), time.monotonic()
            while waiting and len(in_flight) < max(1, sum(threads.values())):
                point = waiting.pop(0)
                # retries=1: a point whose task itself raised (not its notebook: that is a result) runs once more
                point.future = client.submit(_run_point, point.index, notebook.name, source, point.values, timeout,
                                             threads, topic, stop_name, key=f"labkit-point-{point.index}-{token}",
                                             pure=False, retries=1)
                in_flight[point.index] = point
            _note_starts(starts, in_flight, say)
            for index in [i for i, p in in_flight.items() if p.future.done()]:
                results[index] = _collect(in_flight.pop(index), notebook, say)
            line = _progress_line(results, in_flight, len(waiting), len(points))
            if line != last:
                say(line)
                last = line
            if waiting or in_flight:
                time.sleep(POLL_SECONDS)
    except KeyboardInterrupt as interrupt:
        finished = len(results)
        for point in waiting:
            results[point.index] = _failed_point(point, notebook, "not started: the sweep was interrupted first",
                                                 "interrupted")
        running = [folder_name(p.values) for p in in_flight.values()]
        _stop(distributed, client, stop_name, in_flight, results, notebook, say)
        raise SweepInterrupted(f"{interrupt or 'interrupted'}; {finished} finished point(s) kept under "
                               f"{folders[0].parent}; {len(running)} stopped while running, with what they had made "
                               f"({', '.join(running) or 'none'}); {len(waiting)} never started",
                               [results[i] for i in range(len(points))]) from interrupt
    return [results[i] for i in range(len(points))]


def _scheduler_lost(spec: ClusterSpec, notebook: Path, waiting: list, in_flight: dict, results: dict,
                    say: Callable[[str], None]) -> None:
    """Every point not finished yet failed, naming the lost scheduler; the finished ones are kept as they are."""
    lost = f"{spec.describe()} was lost (distributed could not reconnect to it)"
    for point in in_flight.values():
        results[point.index] = _failed_point(point, notebook, f"{lost} before this point's result came back")
    for point in waiting:
        results[point.index] = _failed_point(point, notebook, f"not started: {lost} first")
    say(f"{lost}: {len(in_flight) + len(waiting)} point(s) failed with it, {len(results) - len(in_flight) - len(waiting)}"
        " finished point(s) kept")
    in_flight.clear()
    waiting.clear()


def _threads_by_host(client) -> dict[str, int]:
    """Host -> worker threads on it: each point's OMP_NUM_THREADS is the worker's usable cores over that number."""
    totals: dict[str, int] = {}
    for worker in client.scheduler_info(n_workers=-1).get("workers", {}).values():  # {} once the scheduler is gone
        totals[worker["host"]] = totals.get(worker["host"], 0) + worker["nthreads"]
    return totals


def _note_starts(starts: list[dict], in_flight: dict, say: Callable[[str], None]) -> None:
    """Record which worker started each point, and say when a point starts again after its worker died."""
    while starts:
        event = starts.pop(0)
        point = in_flight.get(event["point"])
        if point is None:
            continue
        point.workers.append(event["worker"])
        if len(point.workers) > 1:
            say(f"{folder_name(point.values)}: started again on {event['worker']} (try {len(point.workers)}; "
                f"the worker running it before, {point.workers[-2]}, died)")


def _progress_line(results: dict, in_flight: dict, not_submitted: int, total: int) -> str:
    done = sum(r.status == "ok" for r in results.values())
    failed = len(results) - done
    running = sum(1 for p in in_flight.values() if p.workers)
    return (f"points: {done} done, {running} running, {failed} failed, "
            f"{not_submitted + len(in_flight) - running} waiting (of {total})")


def _collect(point: _Point, notebook: Path, say: Callable[[str], None]) -> RunResult:
    """The finished future's result written into the point's folder; a task that erred is a failed point."""
    future = point.future
    if future.status == "finished" and "refused" in future.result():
        result = _refused(point, notebook, future.result())
    elif future.status == "finished":
        result = _write_point(point.folder, future.result(), notebook)
    else:
        error = future.exception() if future.status == "error" else None
        result = _failed_point(point, notebook, _task_failure(future.status, error, point))
    future.release()  # the worker may drop the files now
    retried = f" after {len(point.workers)} tries" if len(point.workers) > 1 else ""
    where = f" on {point.workers[-1]}" if point.workers else ""
    say(f"{folder_name(point.values)}: {result.status} in {result.seconds:.1f} s{where}{retried}"
        + (f": {result.error}" if result.error else ""))
    return result


def _task_failure(status: str, error: BaseException | None, point: _Point) -> str:
    name = type(error).__name__ if error is not None else status
    if name == "KilledWorker":
        return (f"the workers it was given to died ({error}); the scheduler gave up on it "
                "(its distributed.scheduler.allowed-failures)")
    if error is None:
        return f"the scheduler {status} the point before it finished (its connection was lost, or it was cancelled)"
    return (f"the point could not run on its worker ({name}: {error}); a worker needs the project and its "
            f"lock installed: {INSTALL_HINT} (docs/RERUN.md, Sweeps at scale)")


def _refused(point: _Point, notebook: Path, payload: dict) -> RunResult:
    workers = ", ".join(payload["workers"])
    return _failed_point(point, notebook, f"the worker running it died {len(payload['workers'])} times (on "
                         f"{workers}): it was run once more after the first death, then given up")


def _failed_point(point: _Point, notebook: Path, error: str, status: str = "failed") -> RunResult:
    result = RunResult(notebook.stem, status, 0.0, str(point.folder / notebook.name),
                       validate_parameters(notebook, point.values), error)
    inside(point.folder, point.folder / f"{notebook.stem}.result.json").write_text(json.dumps(asdict(result), indent=2))
    return result


def _write_point(folder: Path, payload: dict, notebook: Path) -> RunResult:
    """The worker's files under `folder`, with the worker's paths in them replaced by this side's."""
    renames = {payload["folder"]: str(folder), payload["source"]: str(notebook)}
    for relative, data in payload["files"].items():
        target = inside(folder, folder / relative)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(_renamed(data, target.suffix, renames))
    result = RunResult(**payload["result"])
    result.output = str(folder / Path(result.output).name)
    for old, new in renames.items():
        result.error = result.error.replace(old, new)
    inside(folder, folder / f"{notebook.stem}.result.json").write_text(json.dumps(asdict(result), indent=2))
    return result


def _renamed(data: bytes, suffix: str, renames: dict[str, str]) -> bytes:
    """Paths of the worker's folders in a notebook, JSON file or log replaced by where they now are."""
    if suffix not in (".ipynb", ".json", ".log"):
        return data
    for old, new in renames.items():
        if suffix == ".log":
            data = data.replace(old.encode(), new.encode())
        else:  # as the path appears inside a JSON string
            data = data.replace(json.dumps(old)[1:-1].encode(), json.dumps(new)[1:-1].encode())
    return data


def _stop(distributed, client, stop_name: str, pending: dict, results: dict, notebook: Path,
          say: Callable[[str], None]) -> None:
    """Ctrl-C: running points stop their own process trees and send back what they have; the rest is cancelled."""
    distributed.Event(stop_name, client=client).set()
    waiting = [p.future for p in pending.values() if not p.workers]
    client.cancel(waiting)
    deadline = time.monotonic() + STOP_WAIT_SECONDS
    while time.monotonic() < deadline and any(p.workers and not p.future.done() for p in pending.values()):
        time.sleep(POLL_SECONDS)
    for index in [i for i, p in pending.items() if p.future.status == "finished"]:
        results[index] = _collect(pending.pop(index), notebook, say)
    client.cancel([p.future for p in pending.values()])
    for point in pending.values():
        results[point.index] = _failed_point(point, notebook, "cancelled: the sweep was interrupted before this "
                                             "point finished", "interrupted")


# ------------------------------------------------------------------------------------ on the worker


def _run_point(index: int, name: str, source: bytes, point: dict, timeout: float, threads_by_host: dict,
               topic: str, stop_name: str) -> dict:
    """On a worker: one point in a scratch folder of its own, removed after its files are read back."""
    import distributed
    from distributed.comm import get_address_host

    worker, client = distributed.get_worker(), distributed.get_client()
    before = [msg["worker"] for _, msg in client.get_events(topic) if msg["point"] == index]
    if len(before) >= MAX_TRIES:  # each earlier start ended with its worker's death: no more tries
        return {"refused": True, "workers": before}
    worker.log_event(topic, {"point": index, "worker": worker.address, "pid": os.getpid()})
    on_host = threads_by_host.get(get_address_host(worker.address)) or worker.state.nthreads
    threads = str(max(1, _usable_cores() // max(1, on_host)))
    scratch = Path(tempfile.mkdtemp(prefix="labkit-point-", dir=worker.local_directory))
    try:
        notebook = scratch / "source" / name
        notebook.parent.mkdir()
        notebook.write_bytes(source)
        run_dir = scratch / "run"
        stop, finished = threading.Event(), threading.Event()
        # made here, in the task's thread, where the worker's client is found; waited on in the watcher's
        request = distributed.Event(stop_name, client=client)
        watcher = threading.Thread(target=_watch, args=(request, stop, finished),
                                   name=f"labkit-stop-watch-{index}", daemon=True)
        watcher.start()
        try:
            result = run_notebook(notebook, run_dir, point, timeout=timeout, threads=threads, stop=stop)
        finally:
            finished.set()
            # no look at the Event may still be on its way when the task returns: the sweep may close the
            # cluster at once, and a request cut off by that prints "Stream is closed" after a clean sweep
            watcher.join(WATCH_JOIN_SECONDS)
        files = {path.relative_to(run_dir).as_posix(): path.read_bytes()
                 for path in sorted(run_dir.rglob("*")) if path.is_file() and not path.is_symlink()}
        return {"result": asdict(result), "files": files, "folder": str(run_dir.resolve()),
                "source": str(notebook.resolve())}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _usable_cores() -> int:
    """The cores this process may run on (a Slurm or container allocation), not the whole machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _watch(event, stop: threading.Event, finished: threading.Event) -> None:
    """Set `stop` when the client sets the sweep's distributed Event (Ctrl-C), until the point has finished.

    It asks the scheduler every `WATCH_SECONDS` whether the Event is set (a quick request), rather than
    waiting on it: a wait still open on the scheduler when the sweep closes the cluster is cancelled there,
    which distributed logs as an ERROR with a CancelledError traceback.
    """
    while not finished.wait(WATCH_SECONDS):
        try:
            if event.is_set():
                stop.set()
                return
        except Exception as error:  # the scheduler went away: the point still ends by its own timeout
            logging.getLogger(__name__).warning("labkit: cannot watch for a stop request any more: %s", error)
            return
