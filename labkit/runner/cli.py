"""The runner's commands: `python -m labkit repro|workbook|execute|normalise ...` (see labkit.__main__)."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

from labkit.notebooks import normalise_file, select_notebooks
from labkit.runner.execute import execute_in_place
from labkit.runner.parameters import parse_value, validate_parameters
from labkit.runner.run import resolve_notebook, run_notebook
from labkit.runner.summary import md_table, write_summary
from labkit.runner.sweep import parse_sweep, sweep, sweep_table, write_sweep

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
    """`python -m labkit workbook [NAMES] [--out runs/workbook]`: run the workbook, write a summary."""
    parser = argparse.ArgumentParser(prog="python -m labkit workbook", description=workbook_main.__doc__)
    parser.add_argument("names", nargs="*", help="notebook stems or number prefixes (default: all)")
    parser.add_argument("--out", default="runs/workbook", help="output folder (default: runs/workbook)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per notebook")
    args = parser.parse_args(argv)
    out = Path(args.out)
    results = []
    for notebook in select_notebooks(args.names):
        result = run_notebook(notebook, out, timeout=args.timeout)
        print(f"{result.notebook}: {result.status} in {result.seconds:.1f} s {result.error}".rstrip(), flush=True)
        results.append(result)
    write_summary(results, out)
    print(f"summary: {out / 'summary.md'} and {out / 'summary.html'}")
    return 0 if all(r.status == "ok" for r in results) else 1


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
    notebook = resolve_notebook(args.notebook)
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
    print(md_table(list(table[0]), [list(row.values()) for row in table]))
    for result in results:
        if result.error:
            print(result.error, file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0 if all(r.status == "ok" for r in results) else 1
