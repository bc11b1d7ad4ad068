"""Run one notebook with papermill in a child process group, with a wall-clock limit and a clear cause.

A hung or killed kernel ends the run within its timeout instead of hanging; the partly executed
notebook is kept, and the failure names the cell it stopped in.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labkit.claims import CLAIM_MIME, METRIC_MIME
from labkit.errors import LabkitError
from labkit.messages import first_line
from labkit.notebooks import KERNELSPEC, read_notebook_json, select_notebooks, stamp_notebook, stored_records
from labkit.probes import fingerprint
from labkit.runner import _papermill_child
from labkit.runner.parameters import validate_parameters

__all__ = ["PAPERMILL_CELL_TAGS", "RunResult", "resolve_notebook", "run_notebook"]

PAPERMILL_CELL_TAGS = {"injected-parameters", "papermill-error-cell-tag"}
"""Tags of the cells papermill adds to an executed notebook."""
CELL_POINTER_CHARS = 60  # how much of a cell's first line a failure message quotes


@dataclass
class RunResult:
    """What one notebook run produced: status, time, where, and what it recorded."""

    notebook: str
    status: str
    seconds: float
    output: str
    parameters: dict = field(default_factory=dict)
    error: str = ""
    claims: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)


def run_notebook(path: str | Path, out_dir: str | Path, parameters: dict | None = None,
                 timeout: float = 900, cell_timeout: float = 600, threads: str | None = None) -> RunResult:
    """Execute one notebook with papermill into `out_dir` (its working folder too).

    Papermill runs in a child process group with a wall-clock limit, so a hung or killed kernel
    ends the run within `timeout` instead of hanging; the partly executed notebook is kept.
    """
    path, out_dir = Path(path).resolve(), Path(out_dir).resolve()
    params = validate_parameters(path, parameters or {})
    out_dir.mkdir(parents=True, exist_ok=True)
    output = out_dir / path.name
    started = time.perf_counter()
    error = _papermill(path, output, out_dir, params, timeout, cell_timeout, threads)
    seconds = time.perf_counter() - started
    result = RunResult(path.stem, "failed" if error else "ok", round(seconds, 1), str(output), params, error)
    if output.exists():
        claims = stored_records(output, CLAIM_MIME)
        result.claims = [{k: r.get(k) for k in ("id", "verdict", "evidence")} for r in claims]
        result.metrics = {m["name"]: m["value"] for m in stored_records(output, METRIC_MIME)}
        _stamp_fingerprint(output, out_dir / f"{path.stem}.fingerprint.json")
    (out_dir / f"{path.stem}.result.json").write_text(json.dumps(asdict(result), indent=2))
    return result


def _stamp_fingerprint(output: Path, fingerprint_file: Path) -> None:
    """The machine that ran the notebook, in its metadata and beside it."""
    machine = fingerprint()
    stamp_notebook(output, machine)
    fingerprint_file.write_text(json.dumps(machine, indent=2, default=str))


def _papermill(path: Path, output: Path, cwd: Path, params: dict, timeout: float, cell_timeout: float,
               threads: str | None) -> str:
    # -P: the child's folder is not put on sys.path, so its sibling modules cannot shadow a package
    command = [sys.executable, "-P", str(Path(_papermill_child.__file__)), str(path), str(output), str(cwd),
               KERNELSPEC["name"], str(int(cell_timeout)), json.dumps(params)]
    log = cwd / f"{path.stem}.log"
    with log.open("w") as log_file:
        env = dict(os.environ, OMP_NUM_THREADS=threads) if threads else None
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return f"{path.name}: timed out after {timeout:.0f} s{_last_cell(output)}; partial output kept in {output}"
    if process.returncode == 0:
        return ""
    return f"{path.name}: {_failure_cause(output, log, process.returncode)}"


def _last_cell(output: Path) -> str:
    if not output.exists():
        return ""
    cells = _source_cells(output)
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
    """A notebook given on the command line: a path to an .ipynb file, or a stem under notebooks/."""
    path = Path(name)
    if path.suffix == ".ipynb":
        if not path.exists():
            raise LabkitError(f"no notebook at {path}")
        return path
    return select_notebooks([name])[0]
