"""The README tells a newcomer the truth in one screen: its commands exist, the maintainer's command is on
its first screen, it lists every notebook, and it, the pages under docs/, the glossary and the results index
link only to what exists."""

import re
import subprocess
from pathlib import Path

import pytest

from labkit import notebooks

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS, ROOT / "notebooks" / "GLOSSARY.md", ROOT / "benchmarks" / "results" / "README.md"]
# What a newcomer sees without scrolling: a terminal or a rendered page's first screen.
FIRST_SCREEN_LINES = 40
FIRST_SCREEN_BYTES = 3 * 1024
MOST_BYTES = 10_000  # issue #36: under 10 KB


def first_screen(text):
    return "\n".join(text.splitlines()[:FIRST_SCREEN_LINES])[:FIRST_SCREEN_BYTES]


def makefile_targets():
    return set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), flags=re.M))


def test_the_two_commands_are_there():
    top = first_screen(README)
    assert "`make test`" in top, "name `make test` (what CI runs) in the README's first screen"
    assert "`make workbook`" in top and "(docs/MAINTAINERS.md)" in top
    assert re.search(r"`make test`[^\n]*about \d+ minutes", top), "say how long `make test` takes"
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_first_screen_check_can_fail():
    assert "`make test`" not in first_screen("# Title\n" + "filler\n" * FIRST_SCREEN_LINES + "`make test`\n")


def test_the_readme_stays_short():
    size = len(README.encode())
    assert size < MOST_BYTES, f"README.md is {size} bytes: move details to a page under docs/"


def test_every_notebook_is_linked_in_the_table():
    for notebook in notebooks.workbook_notebooks(ROOT / "notebooks"):
        assert f"(notebooks/{notebook.name})" in README, f"{notebook.name} is missing from the README's table"


@pytest.mark.parametrize("page", PAGES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_make_target_a_page_names_exists(page):
    named = set(re.findall(r"\bmake ([a-z][a-z-]*)", page.read_text()))
    assert named <= makefile_targets(), f"{page.name} names missing targets: {named - makefile_targets()}"


def test_make_help_lists_every_documented_target():
    listed = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for target in ["setup", "lab", "workbook", "test", "test-gpu", "student", "bench", "clean"]:
        assert f"make {target} " in listed


# ---- relative links -------------------------------------------------------------------------------

CODE = re.compile(r"^(```|~~~).*?^\1[^\n]*$|`[^`\n]*`", re.M | re.S)
LINK = re.compile(r"!?\[(?:[^\]\n]|\][^(])*\]\(([^)\s]+)\)")


def github_anchor(heading):
    """The id GitHub gives a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page):
    return {github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", CODE.sub("", page.read_text()), flags=re.M)}


def broken_links(page):
    """Relative links of a markdown page (code spans and fences left out) whose file or heading is missing."""
    broken = []
    for target in LINK.findall(CODE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(target)
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_relative_link_finds_its_file_and_heading(page):
    assert broken_links(page) == [], f"{page.name} links to what does not exist"


def test_the_link_check_catches_a_missing_file_and_heading(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n[ok](#a-page) [gone](missing.md) [no heading](#nowhere) [web](https://x.org)\n"
                    "`[code](missing.md)`\n")
    assert broken_links(page) == ["missing.md", "#nowhere"]
