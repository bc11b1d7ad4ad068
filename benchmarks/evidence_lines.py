"""Lines of verdict evidence code per notebook (issue #38): the source lines that the evidence
arguments of each `claims.check` call span in the py twins (`evidence=` before the structured
evidence, `measured=`, `note=` and `rule=` after), at the working tree or at a git commit.

    .venv/bin/python benchmarks/evidence_lines.py [--ref COMMIT]
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVIDENCE_ARGUMENTS = {"evidence", "measured", "note", "rule"}


def twins(ref: str | None) -> dict[str, str]:
    if ref is None:
        return {path.name: path.read_text(encoding="utf-8")
                for path in sorted((ROOT / "notebooks" / "py").glob("[0-9][0-9]_*.py"))}
    names = subprocess.run(["git", "ls-tree", "--name-only", ref, "notebooks/py/"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    return {Path(name).name: subprocess.run(["git", "show", f"{ref}:{name}"], cwd=ROOT, check=True,
                                            capture_output=True, text=True).stdout
            for name in names if Path(name).name[:2].isdigit()}


def evidence_lines(source: str) -> tuple[int, int]:
    """(claims.check calls, source lines their evidence arguments span)."""
    calls = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "check"
             and isinstance(node.func.value, ast.Name) and node.func.value.id == "claims"]
    lines = set()
    for call in calls:
        for keyword in call.keywords:
            if keyword.arg in EVIDENCE_ARGUMENTS:
                lines |= set(range(keyword.value.lineno, keyword.value.end_lineno + 1))
    return len(calls), len(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", help="a git commit to count at (default: the working tree)")
    args = parser.parse_args()
    total = 0
    print("| notebook | claims.check calls | evidence lines |\n| --- | ---: | ---: |")
    for name, source in twins(args.ref).items():
        calls, lines = evidence_lines(source)
        total += lines
        print(f"| {name[:-3]} | {calls} | {lines} |")
    print(f"| all | | {total} |")


if __name__ == "__main__":
    main()
