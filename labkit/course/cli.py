"""`python -m labkit course mark|create ...`: the course commands (`make course`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from labkit.course import layout, marks
from labkit.notebooks import select_notebooks

__all__: list[str] = []


def main(argv: list[str]) -> int:
    """`python -m labkit course COMMAND`: mark the check cells, or lay out an nbgrader course."""
    parser = argparse.ArgumentParser(prog="python -m labkit course", description=main.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    mark = commands.add_parser("mark", help="write the nbgrader test metadata of every check cell (idempotent)")
    mark.add_argument("names", nargs="*", help="notebook stems or number prefixes (default: all)")
    create = commands.add_parser("create", help="lay out an nbgrader course folder: source and release of one assignment")
    create.add_argument("names", nargs="*", help="notebook stems or number prefixes (default: all)")
    create.add_argument("--assignment", default=layout.COURSE_ID, help=f"assignment name (default: {layout.COURSE_ID})")
    create.add_argument("--dest", default="course", help="the course folder (default: course)")
    args = parser.parse_args(argv)
    if args.command == "mark":
        return _mark(args.names)
    return _create(args.names, args.assignment, Path(args.dest))


def _create(names: list[str], assignment: str, root: Path) -> int:
    released = layout.create_course(select_notebooks(names), root, assignment)
    print(f"course at {root}/: assignment {assignment} released as {root}/release/{assignment}/ "
          f"({', '.join(path.name for path in released)})")
    print(f"next: cd {root} && nbgrader release_assignment {assignment} (see nbgrader_config.py)")
    return 0


def _mark(names: list[str]) -> int:
    changed = marks.mark_notebooks(select_notebooks(names))
    for path, exercises in changed.items():
        print(f"{path.name}: check cells of {', '.join(exercises)} marked as nbgrader tests (and its py twin)")
    if not changed:
        print("every check cell already carries its nbgrader test metadata")
    return 0
