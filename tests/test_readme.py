"""The README tells a newcomer the truth: its commands exist and it lists every notebook."""

import re
import subprocess
from pathlib import Path

from labkit import notebooks

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def makefile_targets():
    return set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), flags=re.M))


def test_the_two_commands_are_there():
    assert "make workbook" in README and "make test" in README
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_every_make_target_the_readme_names_exists():
    named = set(re.findall(r"make ([a-z][a-z-]*)", README))
    assert named <= makefile_targets(), f"README names missing targets: {named - makefile_targets()}"


def test_make_help_lists_every_documented_target():
    listed = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for target in ["setup", "lab", "workbook", "test", "test-gpu", "student", "bench", "clean"]:
        assert f"make {target} " in listed


def test_every_notebook_is_linked_in_the_table():
    for notebook in notebooks.workbook_notebooks(ROOT / "notebooks"):
        assert f"(notebooks/{notebook.name})" in README, f"{notebook.name} is missing from the README's table"
