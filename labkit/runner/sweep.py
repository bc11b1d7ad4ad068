"""Sweeps: one notebook run at every point of a parameter grid, tabulated and plotted."""

from __future__ import annotations

import csv
import itertools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from labkit.errors import LabkitError
from labkit.runner.parameters import parse_value, validate_parameters
from labkit.runner.run import RunResult, run_notebook

__all__ = ["grid_points", "parse_sweep", "plot_sweep", "sweep", "sweep_table", "write_sweep"]


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
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


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

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(run, points))


def sweep_table(results: list[RunResult], swept: list[str]) -> list[dict]:
    """One row per run: the swept parameters, status, seconds, then every recorded metric."""
    return [dict({k: r.parameters.get(k) for k in swept}, status=r.status, seconds=r.seconds, **r.metrics)
            for r in results]


def write_sweep(table: list[dict], out_dir: Path) -> list[Path]:
    """sweep.csv, sweep.json and one plot per metric against the first swept parameter."""
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
