"""`python -m labkit normalise NOTEBOOK...`: the pre-commit hook that strips run-to-run metadata.

It runs on every commit that stages a notebook, so it imports only the notebook-file tooling
(`labkit.notebooks`, nbformat): no torch, no papermill.
"""

from __future__ import annotations

import argparse

from labkit.notebooks import normalise_file

__all__ = ["normalise_main"]


def normalise_main(argv: list[str]) -> int:
    """`python -m labkit normalise NOTEBOOK...`: strip run-to-run metadata in place, without executing.

    Exits 1 when it changed a file (the pre-commit convention: the commit is retried with the
    normalised files), 0 when every file was already normalised.
    """
    parser = argparse.ArgumentParser(prog="python -m labkit normalise", description=normalise_main.__doc__)
    parser.add_argument("notebooks", nargs="+", help=".ipynb files to normalise in place")
    args = parser.parse_args(argv)
    changed = [path for path in args.notebooks if normalise_file(path)]
    for path in changed:
        print(f"{path}: normalised")
    return 1 if changed else 0
