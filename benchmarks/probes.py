"""Print what this machine achieves against its ceilings: copy bandwidth and matmul throughput.

Each probe of `labkit.probes` runs ``--runs`` times; the table shows every run, the median, the
run-to-run spread ((max - min) / median), the ceiling with its provenance and achieved / ceiling.
On an H200 it also checks issue 5's targets (copy ≥ 85 % of 4.8 TB/s, bf16 ≥ 75 % of 989.5
TFLOP/s, spread ≤ 2 %). ``--compare EARLIER.json`` sets this run beside an earlier one (the CPU
target is ±10 % between two runs).

    python benchmarks/probes.py [--device auto|cpu|cuda] [--runs 3] [--json OUT.json]
                                [--markdown OUT.md] [--compare EARLIER.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from labkit import (
    Reading,  # noqa: E402
    probes,  # noqa: E402
)

PROBES = ("copy",) + probes.MATMUL_PRECISIONS
# Issue 5's acceptance targets, in % of the datasheet ceiling, keyed by labkit's datasheet model.
TARGETS = {"NVIDIA H200 SXM": {"copy": 85.0, "bf16": 75.0}}
GPU_SPREAD_TARGET = 2.0  # % run-to-run, issue 5
CPU_REPEAT_TARGET = 10.0  # % between two runs of this script on a CPU, issue 5
GPU_UNITS = ("TB/s", "TFLOP/s")  # labkit.probes reports GPU rates in these, CPU rates in GB/s, GFLOP/s


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each probe (default 3)")
    parser.add_argument("--size-mib", type=float, help="copy buffer size in MiB (default: several times the cache)")
    parser.add_argument("--n", type=int, help="matrix size (default: 8192 on a GPU, 1024 on a CPU, 256 for CPU fp16)")
    parser.add_argument("--min-run-time", type=float, default=0.5, help="seconds of timing per run (default 0.5)")
    parser.add_argument("--json", type=Path, help="write the results and the fingerprint here")
    parser.add_argument("--markdown", type=Path, help="write the fingerprint and table here as markdown")
    parser.add_argument("--compare", type=Path, help="an earlier --json file to set this run beside")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args


def run_probe(name: str, args: argparse.Namespace) -> Reading:
    timing = {"device": args.device, "min_run_time": args.min_run_time}
    if name == "copy":
        return probes.copy_bandwidth(size_mib=args.size_mib, **timing)
    return probes.matmul_throughput(name, n=args.n, **timing)


def measure(name: str, args: argparse.Namespace) -> dict:
    readings = [run_probe(name, args) for _ in range(args.runs)]
    ceiling = probes.ceiling(name, args.device)
    row = {"probe": name, "unit": readings[0].unit, "ceiling": _as_dict(ceiling)}
    if not readings[0].available:
        return {**row, "reason": readings[0].reason}
    values = [reading.value for reading in readings]
    median = statistics.median(values)
    fraction = probes.fraction_of_ceiling(Reading(median, readings[0].unit, "measured"), ceiling)
    return {
        **row,
        "values": values,
        "median": median,
        # One run has no run-to-run spread: None, never a silent 0 %.
        "spread_pct": 100 * (max(values) - min(values)) / median if len(values) > 1 else None,
        "fraction_pct": fraction.value,
        "source": readings[-1].source,
    }


def check_targets(rows: list[dict], fingerprint: dict) -> list[str]:
    """One line per issue-5 target that applies to this run, saying met or missed."""
    gpu = fingerprint["gpu"]
    sheet = probes.datasheet_for(gpu["name"]) if gpu else None
    targets = TARGETS.get(sheet.model, {}) if sheet else {}
    lines = []
    for row in rows:
        if row["unit"] not in GPU_UNITS:
            continue  # measured on the CPU: the GPU targets do not apply
        if row["probe"] in targets:
            target = targets[row["probe"]]
            lines.append(_verdict(f"{row['probe']} ≥ {target:.0f} % of ceiling", row.get("fraction_pct"),
                                  target, above=True))
        if row.get("spread_pct") is not None:
            lines.append(_verdict(f"{row['probe']} run-to-run spread ≤ {GPU_SPREAD_TARGET:.0f} %",
                                  row["spread_pct"], GPU_SPREAD_TARGET, above=False))
    return lines


def compare(rows: list[dict], earlier_path: Path) -> list[str]:
    """Per probe: the change of the median from an earlier run of this script."""
    earlier = {row["probe"]: row for row in json.loads(earlier_path.read_text())["rows"]}
    lines = []
    for row in rows:
        before = earlier.get(row["probe"], {})
        if "median" in row and "median" in before and row["unit"] == before["unit"]:
            change = 100 * (row["median"] - before["median"]) / before["median"]
            lines.append(_verdict(f"{row['probe']} change from {earlier_path.name}", abs(change),
                                  CPU_REPEAT_TARGET, above=False, shown=f"{change:+.1f} %"))
    return lines


def machine_load(fingerprint: dict) -> str:
    """The 1-minute load average against the usable cores: other work on a CPU skews its timings."""
    load, cores = os.getloadavg()[0], fingerprint["cpu"]["usable_cores"]
    busy = " (other processes compete for the cores: CPU numbers are noisy)" if load > 0.5 * cores else ""
    return f"load average {load:.2f} on {cores} usable cores before the probes{busy}"


def _verdict(label: str, value: float | None, target: float, *, above: bool, shown: str = "") -> str:
    if value is None:
        return f"{label}: not measured"
    met = value >= target if above else value <= target
    return f"{label}: {shown or f'{value:.1f} %'} — {'met' if met else 'MISSED'}"


def table(rows: list[dict]) -> str:
    """A markdown table of the rows; each reason for an unavailable value is listed once below it."""
    reasons: dict[str, list[str]] = {}
    lines = ["| probe | runs | median | run-to-run spread | ceiling | achieved / ceiling |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        ceiling = _describe(row["ceiling"], reasons, f"{row['probe']} ceiling")
        if "reason" in row:
            reasons.setdefault(row["reason"], []).append(row["probe"])
            lines.append(f"| {row['probe']} | unavailable | | | {ceiling} | |")
            continue
        runs = ", ".join(f"{value:.4g}" for value in row["values"])
        fraction = "—" if row["fraction_pct"] is None else f"{row['fraction_pct']:.1f} %"
        spread = "— (one run)" if row["spread_pct"] is None else f"{row['spread_pct']:.1f} %"
        lines.append(f"| {row['probe']} | {runs} | {row['median']:.4g} {row['unit']} | "
                     f"{spread} | {ceiling} | {fraction} |")
    notes = [f"- unavailable ({', '.join(names)}): {reason}" for reason, names in reasons.items()]
    return "\n".join(lines + ([""] + notes if notes else []))


def _as_dict(reading: Reading) -> dict:
    return {"value": reading.value, "unit": reading.unit, "provenance": reading.provenance,
            "reason": reading.reason, "source": reading.source}


def _describe(reading: dict, reasons: dict[str, list[str]], name: str) -> str:
    if reading["value"] is None:
        reasons.setdefault(reading["reason"], []).append(name)
        return "unavailable"
    return f"{reading['value']:.4g} {reading['unit']} ({reading['provenance']})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fingerprint = probes.fingerprint()
    load = machine_load(fingerprint)
    rows = [measure(name, args) for name in PROBES]
    notes = [load, *check_targets(rows, fingerprint), *(compare(rows, args.compare) if args.compare else [])]
    report = "\n\n".join(part for part in (
        "```\n" + probes.format_fingerprint(fingerprint) + "\n```",
        table(rows),
        "\n".join(f"- {note}" for note in notes),
    ) if part)
    print(report)
    if args.json:
        args.json.write_text(json.dumps(
            {"fingerprint": fingerprint, "machine_load": load, "runs": args.runs, "rows": rows}, indent=1
        ))
    if args.markdown:
        args.markdown.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
