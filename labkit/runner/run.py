"""Run one notebook with papermill in a child process, with a wall-clock limit and a clear cause.

A hung or killed kernel ends the run within its timeout instead of hanging; Ctrl-C or SIGTERM
stops papermill, its kernel and the kernel's own processes (`processes.stop_tree`); the partly
executed notebook is kept, and the failure names the cell it stopped in. Everything the run writes
lies under its folder (`paths.inside`), which must be new or empty; its temporary files (the
kernel's connection file, torch's inductor cache, compiler scratch, `run_ranks` folders) go to a
scratch folder inside it (`paths.run_scratch`, reached through a short link where the folder is too deep
for a Unix socket under it), removed when the run ends.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labkit._version import git_commit, labkit_version
from labkit.errors import LabkitError
from labkit.messages import first_line
from labkit.notebooks import KERNELSPEC, select_notebooks, stamp_notebook
from labkit.probes import fingerprint
from labkit.records import CLAIM_MIME, METRIC_MIME, read_notebook_json, stored_records
from labkit.runner import _papermill_child
from labkit.runner.paths import inside, require_empty_folder, run_scratch
from labkit.runner.processes import RUN_TAG_VARIABLE, stop_tree
from labkit.runner.rerun_parameters import validate_parameters

__all__ = ["PAPERMILL_CELL_TAGS", "SCRATCH_FOLDER", "RunResult", "check_timeout", "resolve_notebook", "run_notebook"]

PAPERMILL_CELL_TAGS = {"injected-parameters", "papermill-error-cell-tag"}
"""Tags of the cells papermill adds to an executed notebook."""
SCRATCH_FOLDER = ".tmp"
"""The run's temporary folder inside its run folder (TMPDIR and caches of the run), removed when it ends."""
CELL_POINTER_CHARS = 60  # how much of a cell's first line a failure message quotes
POLL_SECONDS = 0.2  # how often a waiting run checks whether a sweep asked it to stop


@dataclass
class RunResult:
    """What one notebook run produced: status ("ok", "failed" or "interrupted"), time, where, what it recorded.

    `labkit_version` and `git_commit` name the code that ran it (the commit is None outside a git checkout).
    """

    notebook: str
    status: str
    seconds: float
    output: str
    parameters: dict = field(default_factory=dict)
    error: str = ""
    claims: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    labkit_version: str = field(default_factory=labkit_version)
    git_commit: str | None = field(default_factory=git_commit)


def check_timeout(seconds: object, name: str = "timeout") -> float:
    """`seconds` as a float when it is a positive, finite number; a LabkitError otherwise."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise LabkitError(f"{name} must be a positive number of seconds, got {seconds!r}")
    return float(seconds)


def run_notebook(path: str | Path, out_dir: str | Path, parameters: dict | None = None,
                 timeout: float = 900, cell_timeout: float = 600, threads: str | None = None,
                 stop: threading.Event | None = None) -> RunResult:
    """Execute one notebook with papermill into `out_dir` (its working folder too; new or empty).

    Papermill runs in a child process with a wall-clock limit, so a hung or killed kernel ends the
    run within `timeout` instead of hanging; the partly executed notebook is kept. When `stop` is
    set (a sweep being interrupted) the run is stopped and its status is "interrupted"; Ctrl-C or
    SIGTERM in the calling thread stops it too, records it, and raises KeyboardInterrupt with the
    message.
    """
    timeout, cell_timeout = check_timeout(timeout), check_timeout(cell_timeout, "cell_timeout")
    path = Path(path).resolve()
    params = validate_parameters(path, parameters or {})
    out_dir = require_empty_folder(out_dir, "run folder")
    output = inside(out_dir, out_dir / path.name)
    started = time.perf_counter()
    interrupt = None
    try:
        status, error = _papermill(path, output, out_dir, params, timeout, cell_timeout, threads, stop)
    except KeyboardInterrupt as caught:
        interrupt = caught
        status, error = "interrupted", _interrupted(path, output, str(caught) or "Ctrl-C")
    seconds = time.perf_counter() - started
    result = RunResult(path.stem, status, round(seconds, 1), str(output), params, error)
    if output.exists() and _read_records(result, output):
        _stamp_fingerprint(output, inside(out_dir, out_dir / f"{path.stem}.fingerprint.json"))
    inside(out_dir, out_dir / f"{path.stem}.result.json").write_text(json.dumps(asdict(result), indent=2))
    if interrupt is not None:
        raise KeyboardInterrupt(error) from interrupt
    return result


def _read_records(result: RunResult, output: Path) -> bool:
    """The claims and metrics the run stored; False (and said in the error) when the notebook does not parse."""
    try:
        claims = stored_records(output, CLAIM_MIME)
        metrics = stored_records(output, METRIC_MIME)
    except LabkitError as error:  # a notebook cut short mid-write by a kill
        result.error = f"{result.error}; the notebook could not be read back: {error}".lstrip("; ")
        return False
    result.claims = [{k: r.get(k) for k in ("id", "verdict", "evidence")} | {"measured": r.get("measured", {})}
                     for r in claims]
    result.metrics = {m["name"]: m["value"] for m in metrics}
    return True


def _stamp_fingerprint(output: Path, fingerprint_file: Path) -> None:
    """The machine that ran the notebook, in its metadata and beside it."""
    machine = fingerprint()
    stamp_notebook(output, machine)
    fingerprint_file.write_text(json.dumps(machine, indent=2, default=str))


def _papermill(path: Path, output: Path, cwd: Path, params: dict, timeout: float, cell_timeout: float,
               threads: str | None, stop: threading.Event | None) -> tuple[str, str]:
    """Run papermill; ("ok", "") or (status, message). Whatever happens, nothing it started outlives it."""
    # -P: the child's folder is not put on sys.path, so its sibling modules cannot shadow a package
    command = [sys.executable, "-P", str(Path(_papermill_child.__file__)), str(path), str(output), str(cwd),
               KERNELSPEC["name"], str(int(cell_timeout)), json.dumps(params)]
    log = inside(cwd, cwd / f"{path.stem}.log")
    tag = secrets.token_hex(8)
    with run_scratch(inside(cwd, cwd / SCRATCH_FOLDER)) as scratch:
        env = _run_environment(scratch, threads, tag)
        with log.open("w") as log_file:
            # A session of its own: a Ctrl-C in the terminal reaches only this process, which then
            # stops the whole tree itself (and records the run) instead of papermill dying half-way.
            process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
            try:
                ended = _wait(process, timeout, stop)
            finally:  # also on KeyboardInterrupt; after a normal end it catches the kernel's orphans
                _stop_despite_interrupts(process, tag)
    if ended == "timeout":
        return "failed", f"{path.name}: timed out after {timeout:g} s{_last_cell(output)}; {_kept(output)}"
    if ended == "stopped":
        return "interrupted", _interrupted(path, output, "the sweep was interrupted")
    if process.returncode == 0:
        return "ok", ""
    return "failed", f"{path.name}: {_failure_cause(output, log, process.returncode)}"


def _stop_despite_interrupts(process: subprocess.Popen, tag: str) -> None:
    """Stop the run's processes; a second Ctrl-C while doing so cannot leave some of them running."""
    again = None
    while True:
        try:
            stop_tree(process.pid, tag)
            process.wait()
            break
        except KeyboardInterrupt as interrupt:
            again = interrupt
    if again is not None:
        raise again


def _run_environment(scratch: Path, threads: str | None, tag: str) -> dict[str, str]:
    """The child's environment: temporary files and torch's caches inside the run folder, and the run's tag."""
    runtime = scratch / "jupyter"
    runtime.mkdir(parents=True)
    env = dict(os.environ, TMPDIR=str(scratch), TEMP=str(scratch), TMP=str(scratch),
               JUPYTER_RUNTIME_DIR=str(runtime), TORCHINDUCTOR_CACHE_DIR=str(scratch / "inductor"),
               TRITON_CACHE_DIR=str(scratch / "triton"), **{RUN_TAG_VARIABLE: tag})
    if threads:
        env["OMP_NUM_THREADS"] = threads
    return env


def _wait(process: subprocess.Popen, timeout: float, stop: threading.Event | None) -> str:
    """"exited", "timeout" or "stopped" (the sweep's `stop` was set); Ctrl-C raises KeyboardInterrupt."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return "timeout"
        if stop is not None and stop.is_set():
            return "stopped"
        try:
            process.wait(timeout=min(POLL_SECONDS, remaining))
            return "exited"
        except subprocess.TimeoutExpired:
            continue


def _kept(output: Path) -> str:
    if output.exists():
        return f"partial output kept in {output}"
    return f"no notebook was written (it stopped before papermill saved {output.name})"


def _interrupted(path: Path, output: Path, why: str) -> str:
    return (f"{path.name}: interrupted ({why}){_last_cell(output)}; papermill, its kernel and their processes "
            f"were stopped; {_kept(output)}")


def _last_cell(output: Path) -> str:
    if not output.exists():
        return ""
    try:
        cells = _source_cells(output)
    except LabkitError:  # cut short mid-write
        return ""
    # papermill stamps start_time when a cell starts; later cells stay pending after a kill or a dead kernel
    started = [i for i, c in enumerate(cells) if c.get("metadata", {}).get("papermill", {}).get("start_time")]
    if not started:
        return ""
    return f" in cell {started[-1]} ({_cell_pointer(cells[started[-1]])!r})"


def _cell_pointer(cell: dict) -> str:
    return first_line("".join(cell["source"]), CELL_POINTER_CHARS)


def _source_cells(output: Path) -> list[dict]:
    """The executed cells that came from the source notebook (papermill adds its own)."""
    cells = read_notebook_json(output)["cells"]
    return [c for c in cells if not PAPERMILL_CELL_TAGS & set(c.get("metadata", {}).get("tags", []))]


def _failure_cause(output: Path, log: Path, returncode: int) -> str:
    if output.exists():
        for index, cell in enumerate(_source_cells(output)):
            for out in cell.get("outputs", []):
                if out.get("output_type") == "error":
                    return f"cell {index} ({_cell_pointer(cell)!r}) raised {out['ename']}: {out['evalue']}"
    if returncode == _papermill_child.DEAD_KERNEL_EXIT:
        return f"the kernel died{_last_cell(output)} (killed for memory, or crashed); see {log}"
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    return "papermill failed: " + " | ".join(tail)


def resolve_notebook(name: str) -> Path:
    """A notebook given on the command line: a path to an .ipynb file, or a stem (or its unique start) under notebooks/."""
    path = Path(name)
    if path.suffix == ".ipynb":
        if not path.exists():
            raise LabkitError(f"no notebook at {path}")
        return path
    matches = select_notebooks([name])
    exact = [nb for nb in matches if nb.stem == name]
    if exact:
        return exact[0]
    if len(matches) > 1:
        raise LabkitError(f"{name} matches {len(matches)} notebooks: {', '.join(nb.stem for nb in matches)}; "
                          "give enough of the name to pick one")
    return matches[0]
