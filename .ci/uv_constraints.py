"""pyproject.toml's [tool.uv] constraint-dependencies, generated from constraints.txt (the course's lock).

uv sync and uv run read no constraints file, only this list: with it they install the versions
`make setup` installs. `--write` rewrites the list from constraints.txt; `--check` (the git hook,
tests/test_pins.py) fails, saying to run --write, when the two differ.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIST = re.compile(r"^constraint-dependencies = \[\n.*?^\]\n", flags=re.M | re.S)


def pins(root: Path = ROOT) -> list[str]:
    """constraints.txt's `name==version` lines, in its order."""
    lines = (root / "constraints.txt").read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def expected_list(root: Path = ROOT) -> str:
    return "constraint-dependencies = [\n" + "".join(f'    "{pin}",\n' for pin in pins(root)) + "]\n"


def rewritten(text: str, root: Path = ROOT) -> str:
    """pyproject.toml's text with its constraint-dependencies list replaced by constraints.txt's pins."""
    if len(LIST.findall(text)) != 1:
        raise SystemExit("pyproject.toml has no single [tool.uv] constraint-dependencies list to rewrite: restore it "
                         "(see docs/INSTALL.md, uv) and rerun .ci/uv_constraints.py --write")
    return LIST.sub(lambda _: expected_list(root), text)


def main(argv: list[str]) -> int:
    if argv not in (["--write"], ["--check"]):
        print("usage: .ci/uv_constraints.py --write | --check", file=sys.stderr)
        return 2
    path = ROOT / "pyproject.toml"
    text = path.read_text(encoding="utf-8")
    new = rewritten(text)
    if argv == ["--write"]:
        path.write_text(new, encoding="utf-8")
        return 0
    if new != text:
        print("pyproject.toml's [tool.uv] constraint-dependencies differ from constraints.txt, so uv sync would not "
              "install the lock: run .ci/hook-python .ci/uv_constraints.py --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
