"""What does a sweep on a Dask LocalCluster cost over the local runner? (issue 21's measured acceptance)

One 8-point sweep of a workbook notebook, run by the command line both ways, back to back in
alternating order: ``python -m labkit repro NB --sweep ... --workers 2`` (the local runner: a thread
pool of papermill children) and ``... --cluster local:2`` (a LocalCluster of 2 worker processes
started and closed by the command). Each time is the whole command's wall clock, so the cluster's
start, its workers' imports and its close are counted. The ratio is cluster / local per pair, and
the median over pairs; the load average before and after each run is printed with it, because on a
shared machine it decides the times more than either runner does. Target: at most 1.10x.

Both sweeps must give the same table (apart from the seconds column): the benchmark checks it, so
a cluster that skipped work could not look fast.

    .venv/bin/python benchmarks/sweep_cluster.py                       # one pair, 00_start_here, 8 seeds
    .venv/bin/python benchmarks/sweep_cluster.py --pairs 2 --out benchmarks/results/sweep_cluster.md
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from labkit.probes import fingerprint, format_fingerprint

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 1.10
DEFAULT_SWEEP = ["--sweep", "seed=0,1,2,3,4,5,6,7"]


def run_sweep(notebook: str, sweep: list[str], out: Path, how: list[str]) -> tuple[float, list[dict], tuple, tuple]:
    """(seconds, the sweep.csv rows without seconds, load before, load after) of one command."""
    command = [sys.executable, "-m", "labkit", "repro", notebook, *sweep, "--out", str(out), *how]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    load_before = os.getloadavg()
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    load_after = os.getloadavg()
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    with (out / "sweep.csv").open(newline="") as handle:
        rows = [{k: v for k, v in row.items() if k != "seconds"} for row in csv.DictReader(handle)]
    return seconds, rows, load_before, load_after


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notebook", default="00_start_here")
    parser.add_argument("--sweep", action="append", help="a --sweep of the command (default: 8 seeds)")
    parser.add_argument("--pairs", type=int, default=1, help="local/cluster pairs, alternating which goes first")
    parser.add_argument("--out", help="also write the result as Markdown to this file")
    args = parser.parse_args(argv)
    sweep = [part for spec in args.sweep for part in ("--sweep", spec)] if args.sweep else DEFAULT_SWEEP
    ways = {"local runner (--workers 2)": ["--workers", "2"], "--cluster local:2": ["--cluster", "local:2"]}
    rows = []
    ratios = []
    with tempfile.TemporaryDirectory(prefix="labkit-bench-") as scratch:
        for pair in range(args.pairs):
            order = list(ways) if pair % 2 == 0 else list(reversed(ways))
            times, tables = {}, {}
            for label in order:
                out = Path(scratch) / f"{pair}-{'cluster' if 'cluster' in label else 'local'}"
                seconds, table, before, after = run_sweep(args.notebook, sweep, out, ways[label])
                times[label], tables[label] = seconds, table
                rows.append([pair + 1, label, f"{seconds:.1f}", " ".join(f"{x:.1f}" for x in before),
                             " ".join(f"{x:.1f}" for x in after)])
                print(f"pair {pair + 1}: {label}: {seconds:.1f} s (load {before[0]:.1f} -> {after[0]:.1f})", flush=True)
            local, cluster = (tables[label] for label in ways)
            if local != cluster:
                raise SystemExit(f"the two sweeps disagree:\nlocal   {local}\ncluster {cluster}")
            ratios.append(times["--cluster local:2"] / times["local runner (--workers 2)"])
    ratio = statistics.median(ratios)
    verdict = "meets" if ratio <= TARGET_RATIO else "misses"
    lines = [
        "# Sweeps on a Dask LocalCluster against the local runner (issue 21)", "",
        f"Recorded {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC with `python benchmarks/sweep_cluster.py "
        f"--pairs {args.pairs}`: `python -m labkit repro {args.notebook} {' '.join(sweep)}`, 8 points, "
        "run by the local runner (`--workers 2`) and by `--cluster local:2`, each the whole command's wall clock "
        "(the cluster's start, its workers' imports and its close included), alternating which goes first. "
        "Both gave the same sweep.csv rows apart from the seconds column (checked).", "",
        "| pair | how | seconds | load average before (1, 5, 15 min) | after |", "| --- | --- | --- | --- | --- |",
        *[f"| {' | '.join(map(str, row))} |" for row in rows], "",
        f"**Ratio cluster / local: {', '.join(f'{r:.3f}' for r in ratios)} (median {ratio:.3f}x); target <= "
        f"{TARGET_RATIO:.2f}x: {verdict} it.** The machine has {os.cpu_count()} cores; a load average above that "
        "means other work shared them, so the ratio, measured back to back, is the result, not the times.", "",
        "Machine:", "", "```", format_fingerprint(fingerprint()), "```", "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
