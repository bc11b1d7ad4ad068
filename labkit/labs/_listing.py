"""`python -m labkit labs [--json]`: every lab, its causes and its variants, for instructors and tests."""

from __future__ import annotations

import argparse
import json

from labkit.labs import catalogue

__all__: list[str] = []


def main(argv: list[str]) -> int:
    """List every debugging lab: its notebook, the causes a learner chooses from, and its variants."""
    parser = argparse.ArgumentParser(prog="python -m labkit labs", description=main.__doc__)
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    args = parser.parse_args(argv)
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
