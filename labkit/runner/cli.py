"""The runner's commands `python -m labkit workbook|execute ...` (see labkit.__main__); `repro` is
labkit/runner/repro_command.py, `normalise` labkit/runner/normalise_command.py."""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from labkit.errors import LabkitError
from labkit.notebooks import select_notebooks
from labkit.runner.execute import execute_in_place
from labkit.runner.paths import inside, new_folder, new_run_folder
from labkit.runner.run import check_timeout, run_notebook
from labkit.runner.summary import SUMMARY_FILES, write_summary

__all__ = ["execute_main", "workbook_main"]


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
