"""Reproducible runs: seeding, device choice, notebook parameters, and running notebooks.

Every notebook starts with `dev = repro.setup(seed=seed, device=device)`. Engineers rerun one
reproduction with their own settings through `python -m labkit repro` (validated parameters,
papermill, a timeout, results under `runs/`). `make workbook` and `make notebooks` use the same
machinery. Taught in `00_start_here`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from labkit.errors import LabkitError

DEVICE_CHOICES = ("auto", "cpu", "cuda")
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
KEPT_CELL_METADATA = ("tags", "nbgrader")


def pick_device(device: str = "auto") -> torch.device:
    """`"auto"` picks CUDA when present, else the CPU; `"cuda"` without CUDA is a clear error."""
    if device not in DEVICE_CHOICES:
        raise LabkitError(f"device={device!r} is not one of {', '.join(DEVICE_CHOICES)}")
    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise LabkitError(
            "device='cuda' was asked for, but this machine has no CUDA device "
            "(torch.cuda.is_available() is False); use device='auto' or device='cpu'"
        )
    if device == "auto":
        return torch.device("cuda" if has_cuda else "cpu")
    return torch.device(device)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (every device) from one integer."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise LabkitError(f"seed must be a non-negative int, got {seed!r}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup(seed: int = 0, device: str = "auto", deterministic: bool = True) -> torch.device:
    """Seed everything, choose the device and ask torch for deterministic kernels.

    Returns the `torch.device` the notebook should use. Deterministic mode lets an op with no
    deterministic kernel (CUDA only) run anyway, without a warning, so a notebook's stored outputs
    stay the same on CPU and GPU.
    """
    dev = pick_device(device)
    seed_everything(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        # Only CUDA has ops without a deterministic kernel; their warnings would make a GPU run's
        # stored outputs differ from the CPU's, so they are silenced (the op still runs).
        warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation.*")
    # Inductor advises TF32 when it compiles a float32 matmul on an Ampere-or-newer GPU; the
    # notebooks keep IEEE float32 on purpose (TF32 would change the numbers they compare).
    warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores for float32 matrix multiplication")
    return dev


@contextlib.contextmanager
def fastest_kernels() -> Iterator[None]:
    """Torch's defaults for a timing: deterministic mode off, so cuDNN and cuBLAS may pick any
    kernel (with ``cudnn.benchmark``, the fastest they find). `setup` turns deterministic mode on
    for the stored outputs; a speed claim is measured as users run. Restores the mode on exit.
    Taught in ``13_memory`` (case K3)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


# ---- the parameters cell -------------------------------------------------------------------

def parameters_cell(nb: dict, where: str = "notebook") -> dict:
    """The cell tagged `parameters`; a clear error when there is none or more than one."""
    tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(tagged) != 1:
        raise LabkitError(f"{where} must have exactly one cell tagged 'parameters', found {len(tagged)}")
    return tagged[0]


def notebook_parameters(path: str | Path) -> dict[str, object]:
    """Name -> default value of a notebook's parameters cell (literal assignments only)."""
    path = Path(path)
    nb = _read_json(path)
    source = "".join(parameters_cell(nb, str(path))["source"])
    params = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            raise LabkitError(f"{path}: the parameters cell may hold only `name = literal` lines, found {ast.unparse(node)!r}")
        try:
            params[node.targets[0].id] = ast.literal_eval(node.value)
        except ValueError as error:
            raise LabkitError(f"{path}: parameter {node.targets[0].id} is not a literal: {error}") from error
    return params


def validate_parameters(path: str | Path, given: dict[str, object]) -> dict[str, object]:
    """Check `given` against the notebook's parameters cell: known names, matching types."""
    defaults = notebook_parameters(path)
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        allowed = ", ".join(f"{k} (default {v!r})" for k, v in defaults.items())
        raise LabkitError(f"{Path(path).name} has no parameter {', '.join(unknown)}; allowed: {allowed}")
    return {name: _coerce(name, value, defaults[name]) for name, value in given.items()}


def _coerce(name: str, value: object, default: object) -> object:
    expected = type(default)
    if default is None or isinstance(value, expected) and not (isinstance(value, bool) and expected is int):
        return value
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    raise LabkitError(
        f"parameter {name} expects {expected.__name__} (default {default!r}), got {type(value).__name__} {value!r}"
    )


def parse_value(text: str) -> object:
    """A command-line value as a Python literal when it is one (`8`, `0.1`, `True`), else a string."""
    lowered = {"true": True, "false": False, "none": None}
    if text.lower() in lowered:
        return lowered[text.lower()]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


# ---- running notebooks ---------------------------------------------------------------------

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
    from labkit.claims import METRIC_MIME, stored_records

    path, out_dir = Path(path).resolve(), Path(out_dir).resolve()
    params = validate_parameters(path, parameters or {})
    out_dir.mkdir(parents=True, exist_ok=True)
    output = out_dir / path.name
    started = time.perf_counter()
    error = _papermill(path, output, out_dir, params, timeout, cell_timeout, threads)
    seconds = time.perf_counter() - started
    result = RunResult(path.stem, "failed" if error else "ok", round(seconds, 1), str(output), params, error)
    if output.exists():
        result.claims = _safe_records(output)
        result.metrics = {m["name"]: m["value"] for m in stored_records(output, METRIC_MIME)}
        _stamp_fingerprint(output, out_dir / f"{path.stem}.fingerprint.json")
    (out_dir / f"{path.stem}.result.json").write_text(json.dumps(asdict(result), indent=2))
    return result


def _stamp_fingerprint(output: Path, fingerprint_file: Path) -> None:
    """The machine that ran the notebook, in its metadata and beside it."""
    from labkit.probes import fingerprint, stamp_notebook

    machine = fingerprint()
    stamp_notebook(output, machine)
    fingerprint_file.write_text(json.dumps(machine, indent=2, default=str))


def _safe_records(output: Path) -> list[dict]:
    from labkit.claims import stored_records

    return [{k: r.get(k) for k in ("id", "verdict", "evidence")} for r in stored_records(output)]


def _papermill(path: Path, output: Path, cwd: Path, params: dict, timeout: float, cell_timeout: float,
               threads: str | None) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(params, handle)
    command = [sys.executable, "-m", "papermill", str(path), str(output), "-f", handle.name,
               "-k", KERNELSPEC["name"], "--cwd", str(cwd), "--execution-timeout", str(int(cell_timeout)),
               "--no-progress-bar"]
    log = cwd / f"{path.stem}.log"
    try:
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
    finally:
        os.unlink(handle.name)
    if process.returncode == 0:
        return ""
    return f"{path.name}: {_failure_cause(output, log)}"


def _last_cell(output: Path) -> str:
    if not output.exists():
        return ""
    cells = _source_cells(output)
    # papermill stamps start_time when a cell starts; later cells stay pending after a kill or a dead kernel
    started = [i for i, c in enumerate(cells) if c.get("metadata", {}).get("papermill", {}).get("start_time")]
    if not started:
        return ""
    first_line = "".join(cells[started[-1]]["source"]).strip().splitlines()[0][:60]
    return f" in cell {started[-1]} ({first_line!r})"


PAPERMILL_CELL_TAGS = {"injected-parameters", "papermill-error-cell-tag"}


def _source_cells(output: Path) -> list[dict]:
    """The executed cells that came from the source notebook (papermill adds its own)."""
    cells = _read_json(output)["cells"]
    return [c for c in cells if not PAPERMILL_CELL_TAGS & set(c.get("metadata", {}).get("tags", []))]


def _failure_cause(output: Path, log: Path) -> str:
    if output.exists():
        for index, cell in enumerate(_source_cells(output)):
            for out in cell.get("outputs", []):
                if out.get("output_type") == "error":
                    first_line = "".join(cell["source"]).strip().splitlines()[0][:60]
                    return f"cell {index} ({first_line!r}) raised {out['ename']}: {out['evalue']}"
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    if any("DeadKernel" in line or "Kernel died" in line for line in tail):
        return f"the kernel died{_last_cell(output)} (killed for memory, or crashed); see {log}"
    return "papermill failed: " + " | ".join(tail)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise LabkitError(f"cannot read notebook {path}: {error}") from error


# ---- executing the committed notebooks in place (make notebooks) ---------------------------

def paired_script(notebook: Path) -> Path:
    """The jupytext percent-format twin of `notebooks/NN_name.ipynb`: `notebooks/py/NN_name.py`."""
    return notebook.parent / "py" / f"{notebook.stem}.py"


def _cell_signature(nb) -> list[tuple]:
    return [(c.cell_type, c.source.strip(), tuple(c.metadata.get("tags", []))) for c in nb.cells]


def pair_differences(notebook: Path) -> list[str]:
    """How the notebook and its paired script disagree (empty when they match)."""
    import jupytext
    import nbformat

    script = paired_script(notebook)
    if not script.exists():
        return [f"{script} is missing"]
    stored = _cell_signature(nbformat.read(notebook, as_version=4))
    scripted = _cell_signature(jupytext.read(script))
    if len(stored) != len(scripted):
        return [f"{notebook.name} has {len(stored)} cells, {script.name} has {len(scripted)}"]
    return [f"cell {i} differs" for i, (a, b) in enumerate(zip(stored, scripted)) if a != b]


def normalise(nb) -> None:
    """Strip what changes from run to run (timings, kernel versions, random cell ids)."""
    nb.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": {"name": "python"}}
    nb.nbformat, nb.nbformat_minor = 4, 5
    for index, cell in enumerate(nb.cells):
        cell.id = f"cell-{index:03d}"
        cell.metadata = {k: v for k, v in cell.metadata.items() if k in KEPT_CELL_METADATA}
        if "outputs" in cell:
            cell.outputs = _merged_streams(cell.outputs)
        for output in cell.get("outputs", []):
            output.get("metadata", {}).pop("execution", None)


def _merged_streams(outputs: list) -> list:
    """Join adjacent stream outputs of the same name: how the kernel split them varies run to run."""
    merged = []
    for output in outputs:
        previous = merged[-1] if merged else None
        if (output.get("output_type") == "stream" and previous is not None
                and previous.get("output_type") == "stream" and previous.get("name") == output.get("name")):
            previous["text"] = "".join(previous["text"]) + "".join(output["text"])
        else:
            merged.append(output)
    return merged


def execute_in_place(notebook: Path, prefer: str | None = None, cell_timeout: int = 600) -> float:
    """Sync a notebook with its script, execute it with default parameters, normalise, save both.

    When the two disagree, `prefer` ("py" or "ipynb") says which holds the edits; without it this
    refuses rather than overwrite someone's work. Returns the seconds the execution took.
    """
    import jupytext
    import nbformat
    from nbclient import NotebookClient

    notebook = Path(notebook)
    script = paired_script(notebook)
    nb = _pick_source(notebook, script, prefer)
    normalise(nb)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="labkit-exec-") as scratch:
        client = NotebookClient(nb, timeout=cell_timeout, kernel_name=KERNELSPEC["name"],
                                record_timing=False, resources={"metadata": {"path": scratch}})
        client.execute()
    seconds = time.perf_counter() - started
    normalise(nb)
    nbformat.write(nb, notebook)
    script.parent.mkdir(exist_ok=True)
    _write_script(nb, script, jupytext)
    return seconds


def _pick_source(notebook: Path, script: Path, prefer: str | None):
    import jupytext
    import nbformat

    have_nb, have_py = notebook.exists(), script.exists()
    if not have_nb and not have_py:
        raise LabkitError(f"neither {notebook} nor {script} exists")
    if have_nb and have_py and pair_differences(notebook) and prefer is None:
        raise LabkitError(
            f"{notebook.name} and {script} disagree; rerun with PREFER=py (the script holds your edits) "
            "or PREFER=ipynb (the notebook does)"
        )
    if have_py and (prefer == "py" or not have_nb):
        return jupytext.read(script)
    return nbformat.read(notebook, as_version=4)


def _write_script(nb, script: Path, jupytext) -> None:
    bare = nbformat_copy_without_outputs(nb)
    bare.metadata["jupytext"] = {"notebook_metadata_filter": "-all", "cell_metadata_filter": "tags,nbgrader,-all"}
    jupytext.write(bare, script, fmt="py:percent")


def nbformat_copy_without_outputs(nb):
    import copy

    bare = copy.deepcopy(nb)
    for cell in bare.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return bare


def workbook_notebooks(folder: str | Path = "notebooks") -> list[Path]:
    """The workbook's notebooks in course order (`NN_name.ipynb`)."""
    found = sorted(Path(folder).glob("[0-9][0-9]_*.ipynb"))
    if not found:
        raise LabkitError(f"no notebooks named NN_name.ipynb in {folder}")
    return found


def _select(names: list[str], folder: str = "notebooks", with_scripts: bool = False) -> list[Path]:
    """The notebooks whose stem is or starts with one of `names` (all when empty).

    `with_scripts` also counts a script in `py/` whose notebook does not exist yet.
    """
    scripts = {Path(folder) / f"{p.stem}.ipynb" for p in Path(folder).glob("py/[0-9][0-9]_*.py")} if with_scripts else set()
    every = sorted(set(Path(folder).glob("[0-9][0-9]_*.ipynb")) | scripts)
    if not every:
        raise LabkitError(f"no notebooks named NN_name.ipynb in {folder}")
    if not names:
        return every
    chosen = [nb for nb in every if any(nb.stem == n or nb.stem.startswith(n) for n in names)]
    if not chosen:
        raise LabkitError(f"no notebook matches {' '.join(names)}; have {', '.join(nb.stem for nb in every)}")
    return chosen


def execute_main(argv: list[str]) -> int:
    """`python -m labkit execute [NAMES] [--prefer py|ipynb]`: refresh stored outputs."""
    parser = argparse.ArgumentParser(prog="python -m labkit execute", description=execute_main.__doc__)
    parser.add_argument("names", nargs="*", help="notebook stems or number prefixes (default: all)")
    parser.add_argument("--prefer", choices=("py", "ipynb"), help="which side holds the edits when they disagree")
    args = parser.parse_args(argv)
    for notebook in _select(args.names, with_scripts=True):
        seconds = execute_in_place(notebook, args.prefer)
        print(f"{notebook.name}: executed in {seconds:.1f} s, outputs stored, pair synced")
    return 0


# ---- the workbook run and its summary ------------------------------------------------------

def workbook_main(argv: list[str]) -> int:
    """`python -m labkit workbook [NAMES] [--out runs/workbook]`: run the workbook, write a summary."""
    parser = argparse.ArgumentParser(prog="python -m labkit workbook", description=workbook_main.__doc__)
    parser.add_argument("names", nargs="*", help="notebook stems or number prefixes (default: all)")
    parser.add_argument("--out", default="runs/workbook", help="output folder (default: runs/workbook)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per notebook")
    args = parser.parse_args(argv)
    out = Path(args.out)
    results = []
    for notebook in _select(args.names):
        result = run_notebook(notebook, out, timeout=args.timeout)
        print(f"{result.notebook}: {result.status} in {result.seconds:.1f} s {result.error}".rstrip(), flush=True)
        results.append(result)
    write_summary(results, out)
    print(f"summary: {out / 'summary.md'} and {out / 'summary.html'}")
    return 0 if all(r.status == "ok" for r in results) else 1


def write_summary(results: list[RunResult], out: Path) -> None:
    """`summary.md`, `summary.html` and `summary.json`: each notebook's status and time, and all claims."""
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    runs = [[r.notebook, r.status, f"{r.seconds:.1f}", r.error or ""] for r in results]
    claims = [[c["id"], r.notebook, c["verdict"], c["evidence"]] for r in results for c in r.claims]
    total = sum(r.seconds for r in results)
    heading = f"Gradient Lab workbook run, {stamp}: {sum(r.status == 'ok' for r in results)}/{len(results)} ok, {total:.0f} s"
    (out / "summary.json").write_text(json.dumps({"heading": heading, "runs": [asdict(r) for r in results]}, indent=2))
    (out / "summary.md").write_text("\n".join([
        f"# {heading}", "", _md_table(["notebook", "status", "seconds", "error"], runs), "",
        "## Claims checked", "", _md_table(["id", "notebook", "verdict", "evidence"], claims), "",
    ]))
    (out / "summary.html").write_text(
        "<!doctype html><meta charset='utf-8'><title>Gradient Lab summary</title>"
        f"<h1>{_html(heading)}</h1>{_html_table(['notebook', 'status', 'seconds', 'error'], runs)}"
        f"<h2>Claims checked</h2>{_html_table(['id', 'notebook', 'verdict', 'evidence'], claims)}"
    )


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"
    return "\n".join([line(header), line(["---"] * len(header))] + [line(r) for r in rows])


def _html(text: str) -> str:
    import html

    return html.escape(str(text))


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{_html(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_html(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table border='1' cellpadding='4'><tr>{head}</tr>{body}</table>"


# ---- sweeps ---------------------------------------------------------------------------------

def parse_sweep(specs: list[str]) -> dict[str, list]:
    """`["batch_size=2,8,32", "seed=0,1,2"]` -> {"batch_size": [2, 8, 32], "seed": [0, 1, 2]}."""
    grid = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        if not sep or not name or not values:
            raise LabkitError(f"--sweep takes NAME=V1,V2,...; got {spec!r}")
        grid[name] = [parse_value(v) for v in values.split(",")]
    return grid


def grid_points(grid: dict[str, list]) -> list[dict]:
    """Every combination of the swept values, first name varying slowest."""
    points = [{}]
    for name, values in grid.items():
        points = [dict(point, **{name: value}) for point in points for value in values]
    return points


def sweep(notebook: str | Path, grid: dict[str, list], out_dir: str | Path, fixed: dict | None = None,
          timeout: float = 900, workers: int | None = None) -> list[RunResult]:
    """Run the notebook at every grid point (in parallel where cores allow), one folder per point."""
    fixed = fixed or {}
    points = [dict(fixed, **point) for point in grid_points(grid)]
    for point in points:
        validate_parameters(notebook, point)
    cores = os.cpu_count() or 1
    workers = max(1, min(len(points), workers or cores // 2 or 1))
    threads = str(max(1, cores // workers))

    def run(point):
        folder = Path(out_dir) / ",".join(f"{k}={point[k]}" for k in grid)
        return run_notebook(notebook, folder, point, timeout=timeout, threads=threads)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(run, points))


def sweep_table(results: list[RunResult], swept: list[str]) -> list[dict]:
    """One row per run: the swept parameters, status, seconds, then every recorded metric."""
    return [dict({k: r.parameters.get(k) for k in swept}, status=r.status, seconds=r.seconds, **r.metrics)
            for r in results]


def write_sweep(table: list[dict], out_dir: Path) -> list[Path]:
    """sweep.csv, sweep.json and one plot per metric against the first swept parameter."""
    import csv

    out_dir.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(k for row in table for k in row))
    with (out_dir / "sweep.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        writer.writerows(table)
    (out_dir / "sweep.json").write_text(json.dumps(table, indent=2))
    written = [out_dir / "sweep.csv", out_dir / "sweep.json"]
    x = columns[0]
    metrics = [c for c in columns[columns.index("seconds") + 1:] if _numeric(table, c)]
    for metric_name in metrics:
        figure = plot_sweep(table, x, metric_name)
        figure.savefig(out_dir / f"sweep_{metric_name}.png", dpi=100, bbox_inches="tight")
        written.append(out_dir / f"sweep_{metric_name}.png")
    return written


def _numeric(table: list[dict], column: str) -> bool:
    values = [row.get(column) for row in table if row.get(column) is not None]
    return bool(values) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def plot_sweep(table: list[dict], x: str, metric_name: str):
    """Each run as a dot, and the mean over the other swept parameters (e.g. seeds) as a line with its range."""
    import matplotlib.pyplot as plt

    rows = [r for r in table if isinstance(r.get(metric_name), (int, float))]
    xs = sorted({r[x] for r in rows})
    groups = [[r[metric_name] for r in rows if r[x] == value] for value in xs]
    means = [sum(g) / len(g) for g in groups]
    figure, axes = plt.subplots(figsize=(5, 3.5))
    axes.scatter([r[x] for r in rows], [r[metric_name] for r in rows], s=14, alpha=0.6, label="one run")
    axes.plot(xs, means, marker="o", label="mean")
    axes.fill_between(xs, [min(g) for g in groups], [max(g) for g in groups], alpha=0.2, label="range")
    if all(isinstance(v, (int, float)) and v > 0 for v in xs) and max(xs) / min(xs) >= 8:
        axes.set_xscale("log", base=2)
    axes.set(xlabel=x, ylabel=metric_name, title=f"{metric_name} against {x}")
    axes.legend()
    plt.close(figure)
    return figure


def repro_main(argv: list[str]) -> int:
    """`python -m labkit repro NOTEBOOK [-p NAME VALUE ...] [--sweep NAME=V1,V2 ...]`: validated reruns under runs/."""
    parser = argparse.ArgumentParser(prog="python -m labkit repro", description=repro_main.__doc__)
    parser.add_argument("notebook", help="a notebook path or stem, e.g. 00_start_here")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    parser.add_argument("--sweep", action="append", default=[], metavar="NAME=V1,V2,...",
                        help="run the grid of every --sweep (e.g. --sweep batch_size=2,8,32 --sweep seed=0,1,2)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for each run")
    parser.add_argument("--workers", type=int, help="parallel runs in a sweep (default: half the cores)")
    parser.add_argument("--out", help="output folder (default: runs/NOTEBOOK/TIMESTAMP)")
    args = parser.parse_args(argv)
    notebook = _resolve_notebook(args.notebook)
    params = validate_parameters(notebook, {k: parse_value(v) for k, v in args.parameter})
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    out = Path(args.out) if args.out else Path("runs") / notebook.stem / stamp
    if args.sweep:
        return _report_sweep(notebook, parse_sweep(args.sweep), params, out, args)
    result = run_notebook(notebook, out, params, timeout=args.timeout)
    print(f"{result.notebook}: {result.status} in {result.seconds:.1f} s -> {result.output}")
    if result.error:
        print(result.error, file=sys.stderr)
    return 0 if result.status == "ok" else 1


def _report_sweep(notebook: Path, grid: dict, fixed: dict, out: Path, args) -> int:
    results = sweep(notebook, grid, out, fixed, timeout=args.timeout, workers=args.workers)
    table = sweep_table(results, list(grid))
    written = write_sweep(table, out)
    print(_md_table(list(table[0]), [list(row.values()) for row in table]))
    for result in results:
        if result.error:
            print(result.error, file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0 if all(r.status == "ok" for r in results) else 1


def _resolve_notebook(name: str) -> Path:
    path = Path(name)
    if path.suffix == ".ipynb":
        if not path.exists():
            raise LabkitError(f"no notebook at {path}")
        return path
    return _select([name])[0]
