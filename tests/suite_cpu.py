"""What the unit tests cost in CPU seconds, per test and per file: a pytest plugin.

Wall time on a shared machine measures the neighbours; CPU time (user + system) does not, or far less.
Each test is charged its own process's CPU time plus that of the processes it started and waited
for (kernels, papermill children, subprocesses: `os.times()` counts a child once it is reaped).
Set-up and tear-down are included, so a session-scoped fixture is charged to the first test using it.

    PYTHONPATH=$PWD python -m pytest -p tests.suite_cpu tests/test_repro.py  # writes suite_cpu.json
    python tests/suite_cpu.py suite_cpu.json [more.json ...]  # the top costs

`SUITE_CPU_JSON` names the output file (default ./suite_cpu.json). The report is in
benchmarks/results/suite_cost.md.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

__all__ = ["pytest_runtest_protocol", "pytest_sessionfinish", "summary"]

_COSTS: dict[str, dict[str, float]] = {}
_STARTED = [time.perf_counter(), os.times()]


def _cpu(times: os.times_result) -> tuple[float, float]:
    return times.user + times.system, times.children_user + times.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wall, (own, children) = time.perf_counter(), _cpu(os.times())
    yield
    after_own, after_children = _cpu(os.times())
    _COSTS[item.nodeid] = {"own_cpu_s": after_own - own, "children_cpu_s": after_children - children,
                           "wall_s": time.perf_counter() - wall}
    _write()  # after every test, so an interrupted run still leaves its costs so far


def pytest_sessionfinish(session, exitstatus):
    _write()


def _write() -> None:
    wall, times = _STARTED
    own, children = _cpu(os.times())
    start_own, start_children = _cpu(times)
    path = Path(os.environ.get("SUITE_CPU_JSON", "suite_cpu.json"))
    path.write_text(json.dumps({"session": {"own_cpu_s": own - start_own, "children_cpu_s": children - start_children,
                                            "wall_s": time.perf_counter() - wall},
                                "tests": _COSTS}, indent=1))


def summary(paths: list[Path], top: int = 40) -> str:
    """Markdown: CPU seconds per file and the `top` dearest tests, from the plugin's JSON files."""
    tests: dict[str, dict[str, float]] = {}
    sessions = []
    for path in paths:
        data = json.loads(path.read_text())
        tests.update(data["tests"])
        sessions.append(data["session"])
    cpu = {node: cost["own_cpu_s"] + cost["children_cpu_s"] for node, cost in tests.items()}
    per_file: dict[str, list[float]] = defaultdict(list)
    for node, seconds in cpu.items():
        per_file[node.split("::")[0]].append(seconds)
    lines = [f"sessions: {sum(s['own_cpu_s'] + s['children_cpu_s'] for s in sessions):.1f} CPU s in all "
             f"(tests: {sum(cpu.values()):.1f}; the rest is start-up and collection), "
             f"{sum(s['wall_s'] for s in sessions):.0f} s wall", "",
             "| file | tests | CPU s | of which children |", "|---|---:|---:|---:|"]
    for file, costs in sorted(per_file.items(), key=lambda kv: -sum(kv[1])):
        kids = sum(tests[n]["children_cpu_s"] for n in tests if n.split("::")[0] == file)
        lines.append(f"| {file} | {len(costs)} | {sum(costs):.1f} | {kids:.1f} |")
    lines += ["", "| test | CPU s | children |", "|---|---:|---:|"]
    for node, seconds in sorted(cpu.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {node} | {seconds:.1f} | {tests[node]['children_cpu_s']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python tests/suite_cpu.py suite_cpu.json [more.json ...]")
    print(summary([Path(arg) for arg in sys.argv[1:]]))
