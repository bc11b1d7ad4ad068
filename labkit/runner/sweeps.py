"""Sweeps: one notebook run at every point of a parameter grid, tabulated and plotted."""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from labkit.errors import LabkitError
from labkit.runner.paths import folder_name, inside, new_folder, require_empty_folder, safe_name
from labkit.runner.rerun_parameters import parse_value, validate_parameters
from labkit.runner.run import RunResult, check_timeout, run_notebook

__all__ = ["MAX_POINTS", "check_point_count", "grid_points", "parse_sweep", "plot_sweep", "sweep", "sweep_table",
           "write_sweep"]

RUN_CODE_COLUMNS = ("labkit_version", "git_commit")  # the last columns of a sweep's rows: which code ran each point
MAX_POINTS = 100
"""The most points a sweep runs unless asked for more (`max_points`, `repro --max-points`): a grid typed
with one value too many can otherwise mean days of runs and thousands of folders."""


def parse_sweep(specs: list[str]) -> dict[str, list]:
    """`["batch_size=2,8,32", "seed=0,1,2"]` -> {"batch_size": [2, 8, 32], "seed": [0, 1, 2]}."""
    grid = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        if not sep or not name or not values:
            raise LabkitError(f"--sweep takes NAME=V1,V2,...; got {spec!r}")
        if name in grid:
            raise LabkitError(f"--sweep {name} is given twice ({name}={','.join(map(str, grid[name]))} and {spec}): "
                              f"give one --sweep {name}=V1,V2,... with every value")
        grid[name] = [parse_value(v) for v in values.split(",")]
    return grid


def check_point_count(grid: dict[str, list], max_points: int = MAX_POINTS) -> int:
    """The number of points of `grid`; a LabkitError, before anything is made, when it is over `max_points`."""
    if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 1:
        raise LabkitError(f"max_points must be a whole number >= 1, got {max_points!r}")
    count = math.prod(len(values) for values in grid.values())
    if count > max_points:
        sizes = " x ".join(f"{len(values)} {name}" for name, values in grid.items())
        raise LabkitError(f"this sweep has {count} points ({sizes}), more than the {max_points} a sweep runs "
                          f"unless asked: sweep fewer values, or allow it deliberately with --max-points {count} "
                          "(max_points= from Python)")
    return count


def grid_points(grid: dict[str, list]) -> list[dict]:
    """Every combination of the swept values, first name varying slowest."""
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def sweep(notebook: str | Path, grid: dict[str, list], out_dir: str | Path, fixed: dict | None = None,
          timeout: float = 900, workers: int | None = None, max_points: int = MAX_POINTS) -> list[RunResult]:
    """Run the notebook at every grid point (in parallel where cores allow), one folder per point.

    `out_dir` must be new or empty; a grid of more than `max_points` points is refused first. Each point's folder is named by its values (made safe by
    `paths.folder_name`, unique even for repeated values). Ctrl-C or SIGTERM stops every running
    point within seconds, records each, and raises KeyboardInterrupt naming what was kept.
    """
    fixed = fixed or {}
    both = sorted(set(fixed) & set(grid))
    if both:
        raise LabkitError(f"{', '.join(both)} is both fixed (-p) and swept (--sweep): keep one of them")
    timeout = check_timeout(timeout)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise LabkitError(f"workers must be a whole number >= 1, got {workers!r}")
    check_point_count(grid, max_points)
    points = [dict(fixed, **point) for point in grid_points(grid)]
    for point in points:
        validate_parameters(notebook, point)
    out_dir = require_empty_folder(out_dir, "sweep folder")
    folders = [new_folder(out_dir, folder_name({k: point[k] for k in grid})) for point in points]
    cores = os.cpu_count() or 1
    workers = max(1, min(len(points), workers or cores // 2 or 1))
    threads = str(max(1, cores // workers))
    stop = threading.Event()
    pool = ThreadPoolExecutor(workers)
    futures = [pool.submit(run_notebook, notebook, folder, point, timeout=timeout, threads=threads, stop=stop)
               for folder, point in zip(folders, points)]
    try:
        return [future.result() for future in futures]
    except BaseException as failure:
        stop.set()  # each running point stops its own process tree within POLL_SECONDS
        pool.shutdown(wait=True, cancel_futures=True)
        if not isinstance(failure, KeyboardInterrupt):
            raise
        stopped = [f.result().error for f in futures if not f.cancelled() and f.exception() is None]
        raise KeyboardInterrupt("; ".join([str(failure) or "interrupted", *filter(None, stopped)])) from failure
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def sweep_table(results: list[RunResult], swept: list[str]) -> list[dict]:
    """One row per run: the swept parameters, status, seconds, every recorded metric, then the code that ran it.

    The code is `RUN_CODE_COLUMNS`, labkit's version and git commit, so rows of sweeps made by different code
    stay apart when their tables are joined.
    """
    return [dict({k: r.parameters.get(k) for k in swept}, status=r.status, seconds=r.seconds, **r.metrics,
                 **{column: getattr(r, column) for column in RUN_CODE_COLUMNS})
            for r in results]


def write_sweep(table: list[dict], out_dir: Path) -> list[Path]:
    """sweep.csv, sweep.json and one plot per metric against the first swept parameter."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(k for row in table for k in row))
    with inside(out_dir, out_dir / "sweep.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        writer.writerows(table)
    inside(out_dir, out_dir / "sweep.json").write_text(json.dumps(table, indent=2))
    written = [out_dir / "sweep.csv", out_dir / "sweep.json"]
    x = columns[0]
    metrics = [c for c in columns[columns.index("seconds") + 1:] if _numeric(table, c)]
    for metric_name in metrics:
        figure = plot_sweep(table, x, metric_name)
        plot = inside(out_dir, out_dir / f"sweep_{safe_name(metric_name)}.png")
        figure.savefig(plot, dpi=100, bbox_inches="tight")
        written.append(out_dir / plot.name)
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
