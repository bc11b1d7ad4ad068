"""`python -m labkit course mark|create|learners|password ...`: the course commands (`make course`, `make workshop-learners`)."""

from __future__ import annotations

import argparse
import getpass
import os
from pathlib import Path

from labkit.course import layout, marks, workshop
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
    learners = commands.add_parser("learners", help="add learners to the workshop hub's room: an account and a "
                                   "password each (prints the passwords; run as root)")
    learners.add_argument("names", nargs="+", help="the learners' names (lower-case letters, digits, - and _)")
    password = commands.add_parser("password", help="set or reset a learner's hub password (asks for it, or makes "
                                   "one with --new; run as root; the hub reads it at its next start)")
    password.add_argument("name", help="the learner's name")
    password.add_argument("--new", action="store_true", help="make a random password and print it")
    for command in (learners, password):
        command.add_argument("--room", default=os.environ.get("GRADIENTLAB_ROOM", "workshop/room"),
                             help="the hub's room folder (default: $GRADIENTLAB_ROOM or workshop/room)")
        command.add_argument("--group", default=os.environ.get("GRADIENTLAB_LEARNERS_GROUP", workshop.LEARNERS_GROUP),
                             help=f"the Unix group of the room's learners (default: {workshop.LEARNERS_GROUP})")
    args = parser.parse_args(argv)
    if args.command == "mark":
        return _mark(args.names)
    if args.command == "learners":
        for name in args.names:
            print(f"{name}: {workshop.add_learner(Path(args.room), name, args.group)}")
        print("(name: password; hand each learner theirs. Restart the hub for new learners and passwords.)")
        return 0
    if args.command == "password":
        chosen = None if args.new else getpass.getpass(f"{args.name}'s new password: ")
        print(f"{args.name}: {workshop.add_learner(Path(args.room), args.name, args.group, chosen)}")
        return 0
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
