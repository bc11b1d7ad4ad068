"""`python -m labkit labs [--json] [--time]`: every lab, its causes and its variants, for instructors and tests.

``--time`` checks each variant once, as a learner's first check in a fresh kernel would run (the
defective run and its twin, then the run with the repair: here the twin's own stage), and prints how
long each took against the budget of `CHECK_BUDGET_S` per check (on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import time

from labkit.labs import catalogue
from labkit.labs._check import check_lab, reference_runs
from labkit.labs._registry import lab_ids, lab_of

__all__: list[str] = []

CHECK_BUDGET_S = 15.0


def time_checks() -> float:
    """Print each variant's check time from a cold cache; return the slowest."""
    slowest = 0.0
    for lab_id in lab_ids():
        lab = lab_of(lab_id)
        for variant in lab.variants:
            reference_runs.cache_clear()
            repair = {stage: lab.correct[stage] for stage in variant.defect}
            started = time.perf_counter()
            result = check_lab(lab_id, variant.id, variant.cause, repair, seed=0)
            elapsed = time.perf_counter() - started
            slowest = max(slowest, elapsed)
            print(f"lab {lab_id} variant {variant.id}: check {elapsed:5.2f} s, passed: {result.passed}")
    print(f"slowest check: {slowest:.2f} s (budget {CHECK_BUDGET_S:.0f} s on 2 CPU cores)")
    return slowest


def main(argv: list[str]) -> int:
    """List every debugging lab: its notebook, the causes a learner chooses from, and its variants."""
    parser = argparse.ArgumentParser(prog="python -m labkit labs", description=main.__doc__)
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument("--time", action="store_true", help="time each variant's check (the correct repair)")
    args = parser.parse_args(argv)
    if args.time:
        return 0 if time_checks() <= CHECK_BUDGET_S else 1
    labs = catalogue()
    if args.json:
        print(json.dumps(labs, indent=2))
        return 0
    for lab in labs:
        print(f"{lab['id']}  {lab['notebook']}: {lab['title']}")
        for variant in lab["variants"]:
            print(f"    {variant['id']}: {variant['cause']} (shows: {variant['symptom']})")
        decoys = [cause for cause in lab["causes"] if cause not in {v["cause"] for v in lab["variants"]}]
        print(f"    decoys: {'; '.join(decoys)}")
    return 0
