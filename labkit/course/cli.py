"""`python -m labkit course mark|create ...`: the course commands (`make course`)."""

from __future__ import annotations

import argparse

from labkit.course import marks
from labkit.notebooks import select_notebooks

__all__: list[str] = []


def main(argv: list[str]) -> int:
    """`python -m labkit course COMMAND`: mark the check cells, or lay out an nbgrader course."""
    parser = argparse.ArgumentParser(prog="python -m labkit course", description=main.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    mark = commands.add_parser("mark", help="write the nbgrader test metadata of every check cell (idempotent)")
    mark.add_argument("names", nargs="*", help="notebook stems or number prefixes (default: all)")
    args = parser.parse_args(argv)
    return _mark(args.names)


def _mark(names: list[str]) -> int:
    changed = marks.mark_notebooks(select_notebooks(names))
    for path, exercises in changed.items():
        print(f"{path.name}: check cells of {', '.join(exercises)} marked as nbgrader tests (and its py twin)")
    if not changed:
        print("every check cell already carries its nbgrader test metadata")
    return 0
