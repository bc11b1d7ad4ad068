"""Every notebook opens and closes like a course, and its links lead somewhere.

The opening says what you will learn, what to know first and how long it takes; the end runs
Summary, Claims checked, Exercises, What comes next, Further reading (then any appendix, then
About this run); links to the glossary find their entry and links to notebooks find the file; one
cell asks for a guess before a key measurement and a later one compares it.
"""

import re
from pathlib import Path

import nbformat
import pytest

from labkit import notebooks

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = notebooks.workbook_notebooks(ROOT / "notebooks")
GLOSSARY = ROOT / "notebooks" / "GLOSSARY.md"
CLOSING = ("Summary", "Claims checked", "Exercises", "What comes next", "Further reading")
LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")


def jupyterlab_anchor(heading):
    # JupyterLab gives a rendered heading the id of its text with spaces replaced by hyphens
    return heading.replace(" ", "-")


def github_anchor(heading):
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def glossary_headings():
    return re.findall(r"^### (.+)$", GLOSSARY.read_text(), flags=re.M)


def markdown(nb):
    return [c.source for c in nb.cells if c.cell_type == "markdown"]


def headings(nb):
    """(index of the cell, heading text) for every level-2 heading."""
    return [(i, line[3:].strip()) for i, c in enumerate(nb.cells) if c.cell_type == "markdown"
            for line in c.source.splitlines() if line.startswith("## ")]


@pytest.fixture(params=NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def nb(request):
    return nbformat.read(request.param, as_version=4)


def test_the_glossary_headings_have_one_anchor_in_jupyterlab_and_on_github():
    entries = glossary_headings()
    assert len(entries) >= 20
    differing = [h for h in entries if jupyterlab_anchor(h) != github_anchor(h)]
    assert not differing, f"write these glossary headings in lowercase without punctuation: {differing}"
    assert entries == sorted(entries), "keep the glossary in alphabetical order"


def test_the_opening_says_what_you_learn_what_to_know_and_how_long(nb):
    opening = nb.cells[0]
    assert opening.cell_type == "markdown" and re.match(r"# \d\d · ", opening.source)
    text = " ".join(opening.source.split())  # the markdown wraps its lines anywhere
    learn = opening.source.split("**You will learn**", 1)
    assert len(learn) == 2, "the first cell lists what you will learn under **You will learn**"
    assert len(re.findall(r"^- ", learn[1].split("\n\n")[0], flags=re.M)) >= 3
    assert "**Prerequisites:**" in text and "You should know:" in text
    time = re.search(r"\*\*Time:\*\* about (\d+) min to read and run.*?Run All takes about (\d+) s on 2 CPU cores", text)
    assert time, "the first cell gives the reading time and the measured running time"


def test_the_closing_blocks_come_in_order_and_the_table_is_printed_in_its_section(nb):
    found = headings(nb)
    names = [h for _, h in found]
    positions = []
    for block in CLOSING:
        matches = [i for i, h in found if h.startswith(block)]
        assert len(matches) == 1, f"one '## {block}' heading expected, found {len(matches)}: {names}"
        positions.append(matches[0])
    assert positions == sorted(positions), f"closing blocks out of order: {names}"
    assert names[-1] == "About this run", "the notebook ends with '## About this run'"
    after_reading = names[names.index("Further reading") + 1:]
    assert all(h.startswith("Appendix") or h == "About this run" for h in after_reading), after_reading
    table = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip() == "claims.table()"]
    assert len(table) == 1 and positions[1] < table[0] < positions[2], "claims.table() runs under '## Claims checked'"


def test_further_reading_links_out(nb):
    section = next(c.source for c in nb.cells if c.cell_type == "markdown" and c.source.startswith("## Further reading"))
    outside = [target for target in LINK.findall(section) if target.startswith("https://")]
    assert len(outside) >= 2, "Further reading links at least two pages: the PyTorch docs and a paper or note"


def test_relative_links_find_their_notebook_and_glossary_entry(nb):
    anchors = {jupyterlab_anchor(h) for h in glossary_headings()}
    targets = [t for text in markdown(nb) for t in LINK.findall(text) if not t.startswith(("http://", "https://"))]
    assert any(t.startswith("GLOSSARY.md#") for t in targets), "link the glossary where a term is first used"
    for target in targets:
        path, _, fragment = target.partition("#")
        assert (ROOT / "notebooks" / path).is_file(), f"link to a missing file: {target}"
        if path == "GLOSSARY.md" and fragment:
            assert fragment in anchors, f"no glossary entry for #{fragment}"


def test_one_cell_asks_for_a_guess_and_a_later_one_compares_it(nb):
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    asks = [i for i, c in code if c.source.startswith("guess = None")]
    assert len(asks) == 1, "one cell `guess = None  # ...` before a key measurement"
    assert "Predict before you run" in nb.cells[asks[0] - 1].source, "the markdown before it asks the question"
    compares = [(i, c) for i, c in code if "compare_guess(guess," in c.source]
    assert len(compares) == 1 and compares[0][0] > asks[0] + 1, "the comparison runs after the measurement"
    stored = "".join(o.get("text", "") for o in compares[0][1].outputs)
    assert stored.startswith("No guess written for "), "the stored run leaves the guess at None"


def test_the_opening_counts_the_collapsed_gpu_only_cells(nb):
    collapsed = [c for c in nb.cells if c.metadata.get("jupyter", {}).get("source_hidden")]
    said = re.search(r"\*\*GPU-only cells:\*\* (\d+) cell", nb.cells[0].source)
    assert (int(said.group(1)) if said else 0) == len(collapsed)
    assert all('dev.type == "cuda"' in c.source for c in collapsed), "only GPU-only cells are collapsed"


def test_the_student_edition_carries_the_glossary_its_links_point_to(tmp_path):
    from labkit import student

    source = tmp_path / "solutions"
    source.mkdir()
    for name in ("00_start_here.ipynb", "GLOSSARY.md"):
        (source / name).write_bytes((ROOT / "notebooks" / name).read_bytes())
    student.write_student_edition(source, tmp_path / "student")
    assert (tmp_path / "student" / "GLOSSARY.md").read_text() == GLOSSARY.read_text()
