"""The runner's commands: `python -m labkit repro|workbook|execute|normalise ...` (see labkit.__main__)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from labkit.errors import LabkitError
from labkit.notebooks import normalise_file, select_notebooks
from labkit.runner.cluster import CONNECT_TIMEOUT, ClusterSpec, cluster_sweep, parse_cluster
from labkit.runner.execute import execute_in_place
from labkit.runner.parameters import parse_value, validate_parameters
from labkit.runner.paths import inside, new_folder, new_run_folder, safe_name
from labkit.runner.run import check_timeout, resolve_notebook, run_notebook
from labkit.runner.summary import SUMMARY_FILES, md_table, write_summary
from labkit.runner.sweep import grid_points, parse_sweep, sweep, sweep_table, write_sweep

__all__ = ["execute_main", "normalise_main", "repro_main", "workbook_main"]


def execute_main(argv: list[str]) -> int:
    """`python -m labkit execute [NAMES] [--prefer py|ipynb]`: refresh stored outputs."""
    parser = argparse.ArgumentParser(prog="python -m labkit execute", description=execute_main.__doc__)
    parser.add_argument("names", nargs="*", help="notebook stems or number prefixes (default: all)")
    parser.add_argument("--prefer", choices=("py", "ipynb"), help="which side holds the edits when they disagree")
    args = parser.parse_args(argv)
    for notebook in select_notebooks(args.names, with_scripts=True):
        seconds = execute_in_place(notebook, args.prefer)
        print(f"{notebook.name}: executed in {seconds:.1f} s, outputs stored, pair synced")
    return 0


def normalise_main(argv: list[str]) -> int:
    """`python -m labkit normalise NOTEBOOK...`: strip run-to-run metadata in place, without executing.

    Exits 1 when it changed a file (the pre-commit convention: the commit is retried with the
    normalised files), 0 when every file was already normalised.
    """
    parser = argparse.ArgumentParser(prog="python -m labkit normalise", description=normalise_main.__doc__)
    parser.add_argument("notebooks", nargs="+", help=".ipynb files to normalise in place")
    args = parser.parse_args(argv)
    changed = [path for path in args.notebooks if normalise_file(path)]
    for path in changed:
        print(f"{path}: normalised")
    return 1 if changed else 0


def workbook_main(argv: list[str]) -> int:
    """`python -m labkit workbook [NAMES] [--out runs/workbook]`: run the workbook into a new folder, write a summary.

    Each run gets its own folder ``OUT/<time>-<suffix>/`` (one subfolder per notebook), so a rerun
    never overwrites the last one; ``OUT/summary.{md,html,json}`` are copies of the latest run's
    summary and ``OUT/LATEST`` names its folder.
    """
    parser = argparse.ArgumentParser(prog="python -m labkit workbook", description=workbook_main.__doc__)
    parser.add_argument("names", nargs="*", help="notebook stems or number prefixes (default: all)")
    parser.add_argument("--out", default="runs/workbook", help="folder of workbook runs (default: runs/workbook)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per notebook")
    args = parser.parse_args(argv)
    timeout = check_timeout(args.timeout, "--timeout")
    notebooks = select_notebooks(args.names)
    root = Path(args.out)
    if root.exists() and not root.is_dir():
        raise LabkitError(f"--out {root} is a file, not a folder: pass a folder for the workbook runs")
    run_folder = new_run_folder(root)
    results = []
    try:
        for notebook in notebooks:
            result = run_notebook(notebook, new_folder(run_folder, notebook.stem), timeout=timeout)
            print(f"{result.notebook}: {result.status} in {result.seconds:.1f} s {result.error}".rstrip(), flush=True)
            results.append(result)
    except KeyboardInterrupt as interrupt:
        write_summary(results, run_folder)
        raise KeyboardInterrupt(f"{interrupt}; the summary of the {len(results)} finished notebook(s) is in "
                                f"{run_folder / 'summary.md'}") from interrupt
    write_summary(results, run_folder)
    _point_latest(root, run_folder)
    print(f"summary: {run_folder / 'summary.md'} and {run_folder / 'summary.html'} "
          f"(copied to {root / 'summary.md'} and .html)")
    return 0 if all(r.status == "ok" for r in results) else 1


def _point_latest(root: Path, run_folder: Path) -> None:
    """Copy the run's summary files to `root` (each replaced atomically) and name the run in `root/LATEST`."""
    for name in SUMMARY_FILES:
        partial = inside(root, root / f".{name}.partial")
        shutil.copyfile(run_folder / name, partial)
        os.replace(partial, inside(root, root / name))
    partial = inside(root, root / ".LATEST.partial")
    partial.write_text(run_folder.name + "\n")
    os.replace(partial, inside(root, root / "LATEST"))


def repro_main(argv: list[str]) -> int:
    """`python -m labkit repro NOTEBOOK [-p NAME VALUE ...] [--sweep NAME=V1,V2 ...]`: validated reruns under runs/."""
    parser = argparse.ArgumentParser(prog="python -m labkit repro", description=repro_main.__doc__)
    parser.add_argument("notebook", help="a notebook path or stem, e.g. 00_start_here")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    parser.add_argument("--sweep", action="append", default=[], metavar="NAME=V1,V2,...",
                        help="run the grid of every --sweep (e.g. --sweep batch_size=2,8,32 --sweep seed=0,1,2)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for each run")
    parser.add_argument("--workers", type=int, help="parallel runs in a sweep (default: half the cores)")
    parser.add_argument("--out", help="a new or empty output folder (default: runs/NOTEBOOK/TIME-SUFFIX)")
    parser.add_argument("--cluster", metavar="local:N|tcp://HOST:PORT|SCHEDULER_FILE",
                        help="run the sweep's points on Dask: a LocalCluster of N worker processes, a running "
                             "scheduler, or the scheduler file it wrote (needs labkit[cluster]; docs/RERUN.md, Sweeps at scale)")
    parser.add_argument("--connect-timeout", type=float, default=CONNECT_TIMEOUT,
                        help=f"seconds to reach the --cluster scheduler and find a worker (default {CONNECT_TIMEOUT:g})")
    args = parser.parse_args(argv)
    timeout = check_timeout(args.timeout, "--timeout")
    if args.workers is not None and args.workers < 1:
        raise LabkitError(f"--workers must be 1 or more, got {args.workers}")
    cluster = parse_cluster(args.cluster) if args.cluster is not None else None
    connect_timeout = check_timeout(args.connect_timeout, "--connect-timeout")
    if cluster is not None and not args.sweep:
        raise LabkitError("--cluster runs the points of a sweep: add --sweep NAME=V1,V2,... (one run needs no cluster)")
    if cluster is not None and args.workers is not None:
        raise LabkitError("--workers sizes the local runner; with --cluster the cluster's workers run the points "
                          "(local:N starts N): drop --workers")
    notebook = resolve_notebook(args.notebook)
    given = _given_once(args.parameter)
    grid = parse_sweep(args.sweep)
    both = sorted(set(given) & set(grid))
    if both:
        raise LabkitError(f"{', '.join(both)} is given with -p and with --sweep: drop the -p, or sweep one value")
    params = validate_parameters(notebook, given)
    for point in grid_points(grid):  # every point, before any folder is made
        validate_parameters(notebook, dict(params, **point))
    out = Path(args.out) if args.out else new_run_folder(Path("runs") / safe_name(notebook.stem))
    if args.sweep:
        return _report_sweep(notebook, grid, params, out, timeout, args.workers, cluster, connect_timeout)
    result = run_notebook(notebook, out, params, timeout=timeout)
    print(f"{result.notebook}: {result.status} in {result.seconds:.1f} s -> {result.output}")
    if result.error:
        print(result.error, file=sys.stderr)
    return 0 if result.status == "ok" else 1


def _given_once(pairs: list[list[str]]) -> dict[str, object]:
    """-p NAME VALUE pairs as a dict; a name given twice is an error naming both values."""
    given: dict[str, str] = {}
    for name, value in pairs:
        if name in given:
            raise LabkitError(f"-p {name} is given twice ({given[name]!r} and {value!r}): give it once")
        given[name] = value
    return {name: parse_value(value) for name, value in given.items()}


def _report_sweep(notebook: Path, grid: dict, fixed: dict, out: Path, timeout: float, workers: int | None,
                  cluster: ClusterSpec | None = None, connect_timeout: float = CONNECT_TIMEOUT) -> int:
    if cluster is None:
        results = sweep(notebook, grid, out, fixed, timeout=timeout, workers=workers)
    else:
        results = cluster_sweep(notebook, grid, out, fixed, timeout=timeout, cluster=cluster,
                                connect_timeout=connect_timeout, progress=lambda line: print(line, flush=True))
    table = sweep_table(results, list(grid))
    written = write_sweep(table, out)
    print(md_table(list(table[0]), [list(row.values()) for row in table]))
    for result in results:
        if result.error:
            print(result.error, file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0 if all(r.status == "ok" for r in results) else 1
