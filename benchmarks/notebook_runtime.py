"""Per notebook: cells, figures, and how long Run All takes here, with the machine's load beside it.

For each notebook (all by default, or the stems or number prefixes given), this counts the stored
notebook's cells, code cells and figures (PNG outputs), then runs it with ``python -m labkit
workbook NB --out <temporary folder>`` (papermill, the stored notebook untouched) and records the
wall time, the CPU time of that process and its children (the kernel), and the 1-minute load
average before and after. It compares the wall time with the "Run All takes about N s" that the
notebook's opening states. Wall times depend on what else the machine runs; the CPU time much less,
but it also counts threads, so on 2 cores it can exceed the wall time. Read the ratios, not the
absolute numbers, when the load is above the number of cores.

Run: ``.venv/bin/python benchmarks/notebook_runtime.py [NB ...]``. Prints a markdown table;
``benchmarks/results/notebook_runtime.md`` holds a recorded one and what it means.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

from labkit import notebooks

ROOT = Path(__file__).resolve().parents[1]
STATED = re.compile(r"Run All takes about\s+(?:#\s*)?(\d+)\s*s")


def stored_counts(path: Path) -> dict:
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    figures = sum(1 for c in code for o in c.get("outputs", []) if "image/png" in o.get("data", {}))
    stated = STATED.search(" ".join(nb.cells[0].source.split())) if nb.cells else None
    return {"cells": len(nb.cells), "code_cells": len(code), "figures": figures,
            "stated_s": int(stated.group(1)) if stated else None}


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_one(path: Path, out: Path, timeout: int) -> dict:
    load_before = os.getloadavg()[0]
    cpu_before, start = children_cpu(), time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "labkit", "workbook", path.stem, "--out", str(out),
                             "--timeout", str(timeout)], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    summary = out / "summary.json"
    status = "error"
    if result.returncode == 0 and summary.is_file():
        status = "ok"
    return {"wall_s": wall, "cpu_s": children_cpu() - cpu_before, "load_before": load_before,
            "load_after": os.getloadavg()[0], "status": status,
            "error": "" if status == "ok" else (result.stderr.strip().splitlines() or ["no output"])[-1]}


def table(rows: list[dict]) -> str:
    header = ["notebook", "cells", "code cells", "figures", "stated s", "wall s", "wall / stated", "CPU s",
              "load 1-min before/after", "status"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        stated = r["stated_s"] if r["stated_s"] is not None else "-"
        if "wall_s" not in r:  # counted, not run
            lines.append(f"| {r['notebook']} | {r['cells']} | {r['code_cells']} | {r['figures']} | {stated} | "
                         "- | - | - | - | not run |")
            continue
        ratio = f"{r['wall_s'] / r['stated_s']:.1f}" if r["stated_s"] else "-"
        lines.append(f"| {r['notebook']} | {r['cells']} | {r['code_cells']} | {r['figures']} | {stated} | "
                     f"{r['wall_s']:.0f} | {ratio} | {r['cpu_s']:.0f} | "
                     f"{r['load_before']:.1f}/{r['load_after']:.1f} | {r['status']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebook stems or number prefixes (default: all)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per notebook (default 900)")
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    parser.add_argument("--count-only", action="store_true", help="count cells and figures, run nothing")
    args = parser.parse_args(argv)
    paths = notebooks.select_notebooks(args.names, ROOT / "notebooks")
    print(f"{len(paths)} notebooks on {os.cpu_count()} logical CPUs; 1-minute load average at the start "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for path in paths:
            row = {"notebook": path.stem, **stored_counts(path)}
            if args.count_only:
                rows.append(row)
                continue
            row.update(run_one(path, Path(scratch) / path.stem, args.timeout))
            rows.append(row)
            print(f"{path.stem}: {row['status']}, {row['wall_s']:.0f} s wall, {row['cpu_s']:.0f} s CPU, "
                  f"load {row['load_before']:.1f}->{row['load_after']:.1f} {row['error']}", flush=True)
    print()
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r.get("status", "ok") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
