"""`python -m labkit claims`: the claim verdicts stored in the notebooks, and the catalogue's coverage.

Reads each notebook's stored outputs (`labkit.records`) without executing it, and checks every
verdict against the catalogue (`labkit.claims`). Tooling: a notebook's kernel never imports it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from labkit.claims import catalogue, validate
from labkit.errors import LabkitError
from labkit.notebooks import NOTEBOOK_GLOB
from labkit.records import CLAIM_MIME, stored_records

__all__: list[str] = []

# What `collect` reads from each stored claim payload.
CLAIM_FIELDS = {"id": str, "verdict": str, "evidence": str, "claim": str}


def collect(paths: list[str | Path]) -> list[dict]:
    """Every claim verdict stored in the given notebooks (or folders of notebooks), validated."""
    records = []
    for notebook in _notebooks(paths):
        for record in stored_records(notebook, CLAIM_MIME, CLAIM_FIELDS):
            try:
                validate(record["id"], record["verdict"], record["evidence"], record.get("measured"))
            except LabkitError as error:
                raise LabkitError(f"{notebook}: {error}") from error
            records.append({k: record[k] for k in ("id", "notebook", "verdict", "evidence", "claim")}
                           | {"measured": record.get("measured", {})})
    return records


def _notebooks(paths: list[str | Path]) -> list[Path]:
    found = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found += sorted(path.glob(NOTEBOOK_GLOB))
        elif path.suffix == ".ipynb" and path.exists():
            found.append(path)
        else:
            raise LabkitError(f"{path} is neither a notebook nor a folder of notebooks")
    return found


def coverage(records: list[dict]) -> dict[str, list[str]]:
    """Which catalogue IDs have a recorded verdict and which do not."""
    seen = {r["id"] for r in records}
    ids = list(catalogue())
    return {"recorded": [i for i in ids if i in seen], "missing": [i for i in ids if i not in seen]}


def main(argv: list[str]) -> int:
    """`python -m labkit claims [PATHS] [--json] [--catalogue] [--missing]`."""
    parser = argparse.ArgumentParser(prog="python -m labkit claims", description=main.__doc__)
    parser.add_argument("paths", nargs="*", default=["notebooks"], help="notebooks or folders (default: notebooks)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of {id, notebook, verdict, evidence, measured}")
    parser.add_argument("--catalogue", action="store_true", help="list the case catalogue instead")
    parser.add_argument("--missing", action="store_true", help="also list catalogue IDs with no verdict yet")
    args = parser.parse_args(argv)
    if args.catalogue:
        return _print_catalogue(args.json)
    records = collect(args.paths)
    if args.json:
        fields = ("id", "notebook", "verdict", "evidence", "measured")
        print(json.dumps([{k: r[k] for k in fields} for r in records], indent=2))
        return 0
    for r in records:
        print(f"{r['id']:<5} {r['notebook']:<28} {r['verdict']:<14} {r['evidence']}")
    cover = coverage(records)
    print(f"\n{len(cover['recorded'])} of {len(catalogue())} catalogue IDs have a recorded verdict.")
    if args.missing:
        print("missing: " + " ".join(cover["missing"]))
    return 0


def _print_catalogue(as_json: bool) -> int:
    cases = [asdict(c) for c in catalogue().values()]
    if as_json:
        print(json.dumps(cases, indent=2))
    else:
        for c in cases:
            gpu = " [GPU]" if c["gpu_only"] else ""
            print(f"{c['id']:<5}{gpu} {c['claim']}")
    return 0
