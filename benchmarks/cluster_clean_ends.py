"""Do cluster sweeps end cleanly? (issue 40, "Clean ends": ten `--cluster local:2` sweeps in a row)

Each sweep is the command line a user runs, a 2-point sweep of a small notebook on a LocalCluster of
2 workers, with a TMPDIR of its own that starts empty. Counted per sweep: lines of its output naming
an ERROR, a Traceback or the stop watcher's "Stream is closed" / "cannot watch", anything left in its
TMPDIR afterwards (Dask's dask-scratch-space belongs in the sweep folder), and whether the sweep folder
kept Dask's `.dask/` (the cluster's scratch, removed at the end). Not a test: it takes about a minute a sweep.

    .venv/bin/python benchmarks/cluster_clean_ends.py                   # ten sweeps
    .venv/bin/python benchmarks/cluster_clean_ends.py --runs 3 --out benchmarks/results/cluster_clean_ends.md
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("ERROR", "Traceback", "Stream is closed", "cannot watch")


def small_notebook(path: Path) -> Path:
    parameters = nbformat.v4.new_code_cell("seed = 0\nsteps = 1")
    parameters.metadata["tags"] = ["parameters"]
    notebook = nbformat.v4.new_notebook(cells=[parameters, nbformat.v4.new_code_cell(
        "from labkit import claims\nclaims.metric('score', steps * 10 + seed)")])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, str(path))
    return path


def one_sweep(notebook: Path, folder: Path) -> dict:
    temp, out = folder / "temp", folder / "sweep"
    temp.mkdir()
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "labkit", "repro", str(notebook), "--sweep", "steps=1,2",
                           "--cluster", "local:2", "--out", str(out)], capture_output=True, text=True, cwd=folder,
                          env=dict(os.environ, TMPDIR=str(temp), PYTHONPATH=str(ROOT)))
    return {"rc": done.returncode, "seconds": time.monotonic() - started,
            "errors": [line for line in (done.stdout + done.stderr).splitlines() if any(w in line for w in WORDS)],
            "left": sorted(str(path.relative_to(temp)) for path in temp.rglob("*")),
            "dask_kept": (out / ".dask").exists()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    args = parser.parse_args()
    lines = [f"# Cluster sweeps' ends ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, load {os.getloadavg()[0]:.1f})",
             "", "| sweep | exit | seconds | error lines | left in TMPDIR | .dask kept |", "| --- | --- | --- | --- | --- | --- |"]
    totals = {"errors": 0, "left": 0}
    with tempfile.TemporaryDirectory(prefix="clean-ends-") as scratch:
        notebook = small_notebook(Path(scratch) / "p.ipynb")
        for run in range(args.runs):
            folder = Path(scratch) / f"run{run}"
            folder.mkdir()
            result = one_sweep(notebook, folder)
            totals["errors"] += len(result["errors"])
            totals["left"] += len(result["left"])
            lines.append(f"| {run + 1} | {result['rc']} | {result['seconds']:.0f} | {len(result['errors'])} | "
                         f"{len(result['left'])} {' '.join(result['left'][:4])} | {result['dask_kept']} |")
            print(lines[-1], *result["errors"][:6], sep="\n    ", flush=True)
    lines += ["", f"{args.runs} sweeps: {totals['errors']} error lines, {totals['left']} files or folders left outside "
              "the sweep folders."]
    print(lines[-1])
    if args.out:
        args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
