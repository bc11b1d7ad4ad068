"""`python -m labkit COMMAND ...`: the workbook's command line.

Each command lives in the module that owns its idea; this file only dispatches.
"""

from __future__ import annotations

import importlib
import re
import sys
from importlib import metadata

from labkit._version import DISTRIBUTION, describe
from labkit.errors import LabkitError
from labkit.runner._papermill_child import skip_unused_slow_imports
from labkit.runner.processes import termination_as_interrupt

INTERRUPTED_EXIT = 130  # the shell's code for a command ended by Ctrl-C (128 + SIGINT)

# name: (module, function, the extras of pyproject.toml it needs, help)
COMMANDS = {
    "claims": ("labkit.claims_report", "main", (), "print every claim verdict stored in the notebooks (--json for JSON)"),
    "execute": ("labkit.runner", "execute_main", ("runner", "lab"), "sync, execute and normalise notebooks in place (make notebooks)"),
    "normalise": ("labkit.runner.normalise_command", "normalise_main", ("runner", "lab"), "normalise .ipynb files in place (exit 1 if any changed)"),
    "workbook": ("labkit.runner", "workbook_main", ("runner",), "run every notebook under runs/<name>/ and write the summary"),
    "repro": ("labkit.runner.repro_command", "repro_main", ("runner",), "rerun one notebook with validated parameters"),
    "student": ("labkit.student", "main", ("runner",), "write the student edition (solutions removed)"),
    "progress": ("labkit.course.exercise_progress", "main", ("runner",), "re-check a learner's answers: which exercises pass"),
    "labs": ("labkit.labs._listing", "main", (), "list the debugging labs: causes and variants (--json for JSON, --time to time the checks)"),
    "course": ("labkit.course.cli", "main", ("course",), "mark check cells as nbgrader tests, lay out an nbgrader course"),
}
# A line of the installed metadata's Requires-Dist: `papermill>=2.7; extra == "runner"`.
EXTRA_REQUIREMENT = re.compile(r"""^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*).*;.*\bextra\s*==\s*['"](?P<extra>[^'"]+)['"]""")


def usage() -> str:
    lines = ["usage: python -m labkit COMMAND [ARGS...]", "       python -m labkit --version", "", "commands:"]
    lines += [f"  {name:<10} {help_text}" for name, (_, _, _, help_text) in COMMANDS.items()]
    return "\n".join(lines)


def missing_extras(extras: tuple[str, ...]) -> dict[str, list[str]]:
    """For each of `extras` with a package not installed, those packages, read from the installed project's
    metadata (pyproject.toml's extras); {} where labkit is not installed but imported from a checkout."""
    try:
        requirements = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return {}
    missing: dict[str, list[str]] = {}
    for line in requirements:
        match = EXTRA_REQUIREMENT.match(line)
        if match is None or match["extra"] not in extras or match["name"] == DISTRIBUTION:
            continue
        try:
            metadata.version(match["name"])
        except metadata.PackageNotFoundError:
            missing.setdefault(match["extra"], []).append(match["name"])
    return missing


def extras_message(command: str, missing: dict[str, list[str]]) -> str:
    names = ",".join(missing)
    packages = ", ".join(package for packages in missing.values() for package in packages)
    return (f"labkit {command} needs the `{names}` extra{'s' if len(missing) > 1 else ''}, not installed here (missing: {packages}): in the "
            f"repository, `pip install -e '.[{names}]'` or `make setup` (docs/INSTALL.md); nothing was run or written")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        if argv[1:]:
            print(f"labkit: --version takes no arguments, got {' '.join(argv[1:])!r}\n\n{usage()}", file=sys.stderr)
            return 2
        print(describe())  # the version and the git commit: no command module, no torch
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"labkit: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, function_name, extras, _ = COMMANDS[name]
    missing = missing_extras(extras)
    if missing:  # before the command imports what is missing or starts a run it cannot finish
        print(extras_message(name, missing), file=sys.stderr)
        return 2
    skip_unused_slow_imports()  # before a command imports nbformat: seconds of import no command uses
    command = getattr(importlib.import_module(module_name), function_name)
    try:
        with termination_as_interrupt():  # `kill PID` cleans up exactly as Ctrl-C does
            return int(command(rest) or 0)
    except LabkitError as error:
        print(f"labkit {name}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:  # whatever the command started is stopped by now
        print(f"labkit {name}: interrupted" + (f": {interrupt}" if str(interrupt) else ""), file=sys.stderr)
        return INTERRUPTED_EXIT


if __name__ == "__main__":
    sys.exit(main())
