"""`python -m labkit repro NOTEBOOK ...`: rerun one notebook, or a sweep of it, with validated parameters.

The runs go under ``runs/`` (papermill in a child process, a timeout per run); a sweep runs its
grid locally or on a Dask cluster and writes a table. `labkit.repro` is the other half, inside the
notebook: seeding, the device and deterministic kernels.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from labkit.errors import LabkitError
from labkit.runner.cluster import CONNECT_TIMEOUT, ClusterSpec, SweepInterrupted, cluster_sweep, parse_cluster
from labkit.runner.paths import new_run_folder, safe_name
from labkit.runner.rerun_parameters import parse_value, validate_parameters
from labkit.runner.run import check_timeout, resolve_notebook, run_notebook
from labkit.runner.summary import md_table
from labkit.runner.sweeps import (
    MAX_POINTS,
    RUN_CODE_COLUMNS,
    check_point_count,
    grid_points,
    parse_sweep,
    sweep,
    sweep_table,
    write_sweep,
)

__all__ = ["repro_main"]


def repro_main(argv: list[str]) -> int:
    """`python -m labkit repro NOTEBOOK [-p NAME VALUE ...] [--sweep NAME=V1,V2 ...]`: validated reruns under runs/."""
    parser = argparse.ArgumentParser(prog="python -m labkit repro", description=repro_main.__doc__)
    parser.add_argument("notebook", help="a notebook path or stem, e.g. 00_start_here")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    parser.add_argument("--sweep", action="append", default=[], metavar="NAME=V1,V2,...",
                        help="run the grid of every --sweep (e.g. --sweep batch_size=2,8,32 --sweep seed=0,1,2)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for each run")
    parser.add_argument("--workers", type=int, help="parallel runs in a sweep (default: half the cores)")
    parser.add_argument("--max-points", type=int, default=MAX_POINTS,
                        help=f"the most points a sweep may have (default {MAX_POINTS}); raise it to run a larger grid")
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
    check_point_count(grid, args.max_points)
    for point in grid_points(grid):  # every point, before any folder is made
        validate_parameters(notebook, dict(params, **point))
    out = Path(args.out) if args.out else new_run_folder(Path("runs") / safe_name(notebook.stem))
    if args.sweep:
        return _report_sweep(notebook, grid, params, out, timeout, args.workers, cluster, connect_timeout,
                             args.max_points)
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
                  cluster: ClusterSpec | None = None, connect_timeout: float = CONNECT_TIMEOUT,
                  max_points: int = MAX_POINTS) -> int:
    if cluster is None:
        results = sweep(notebook, grid, out, fixed, timeout=timeout, workers=workers, max_points=max_points)
    else:
        try:
            results = cluster_sweep(notebook, grid, out, fixed, timeout=timeout, cluster=cluster,
                                    connect_timeout=connect_timeout, progress=lambda line: print(line, flush=True),
                                    max_points=max_points)
        except SweepInterrupted as interrupt:  # the table of what finished, then the interrupt as usual
            _write_table(interrupt.results, grid, out)
            raise
    _write_table(results, grid, out)
    return 0 if all(r.status == "ok" for r in results) else 1


def _write_table(results: list, grid: dict, out: Path) -> None:
    table = sweep_table(results, list(grid))
    written = write_sweep(table, out)
    shown = [column for column in table[0] if column not in RUN_CODE_COLUMNS]  # the files keep them, per point
    print(md_table(shown, [[row.get(column) for column in shown] for row in table]))
    for version, commit in dict.fromkeys((r.labkit_version, r.git_commit) for r in results):
        print(f"run by labkit {version}" + (f" at git commit {commit}" if commit else " (no git commit known)"))
    for result in results:
        if result.error:
            print(result.error, file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in written))
