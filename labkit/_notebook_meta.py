"""One metadata block per notebook, `notebooks/meta/NN_name.toml`, and the files generated from it.

    python -m labkit._notebook_meta           # print what the generated parts would be
    python -m labkit._notebook_meta --write   # rewrite them
    python -m labkit._notebook_meta --check   # exit 1 when one is stale

A block holds what the project needs to know about a notebook and cannot read from the notebook
itself (docs/AUTHORING.md, "Adding a notebook", describes each field):

- `gpu_sections`: what the notebook's CUDA-only cells measure, in a few words ("" when it has none);
- `needs_gpu_on_cpu`: the cases whose CPU verdict is exactly `needs-gpu` (tests/notebook_runs.py);
- `[typed_numbers_allowed]`: per case, the numbers its evidence may type in, and why
  (tests/test_claim_evidence.py);
- `[[troubleshooting]]`: symptoms a reader may come with, and the cases that explain them.

What the notebook says itself is read from it, never copied into the block: its title, reading and
exercise minutes and Run All time (the opening cell), its cases (the verdicts stored in its outputs),
its exercises and checks, and how much CUDA-only code its py twin holds.

Generated from the blocks and the notebooks: the README's notebook table and troubleshooting index
(between `<!-- generated: NAME ... -->` and `<!-- end: NAME -->`), and `.ci/gpu-notebooks.txt`, the
GPU runner's default list (the notebooks with GPU sections, most CUDA code first). Generated from
pyproject.toml: the first line of every notebook's first code cell, `install_line()`, in the py twins
(the pre-commit hook's jupytext sync carries it into the .ipynb).
tests/test_notebook_meta.py fails when a block is invalid or a generated file is stale.

The blocks are TOML, read with the standard library's tomllib, so any Python 3.11 reads them (the
GPU image included) without PyYAML. This module reads the checkout, not an installed package.
"""

from __future__ import annotations

import argparse
import ast
import functools
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from labkit.errors import LabkitError

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
TWINS = NOTEBOOKS / "py"
META = NOTEBOOKS / "meta"
README = ROOT / "README.md"
GPU_NOTEBOOKS = ROOT / ".ci" / "gpu-notebooks.txt"
REGENERATE = "python -m labkit._notebook_meta --write"

# field -> (TOML type, required)
FIELDS: dict[str, tuple[type, bool]] = {
    "gpu_sections": (str, True),
    "needs_gpu_on_cpu": (list, True),
    "typed_numbers_allowed": (dict, False),
    "troubleshooting": (list, False),
}
CASE_ID = re.compile(r"([A-Z])(\d+)([a-z]*)")


@dataclass(frozen=True)
class TypedNumbers:
    """Numbers a case's evidence may type in literally (not measurements), and why."""

    numbers: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Symptom:
    """One troubleshooting entry: what a reader sees, and the cases of this notebook that explain it."""

    symptom: str
    cases: tuple[str, ...]


@dataclass(frozen=True)
class NotebookMeta:
    stem: str
    gpu_sections: str
    needs_gpu_on_cpu: tuple[str, ...]
    typed_numbers_allowed: dict[str, TypedNumbers]
    troubleshooting: tuple[Symptom, ...]

    @property
    def notebook(self) -> Path:
        return NOTEBOOKS / f"{self.stem}.ipynb"

    @property
    def twin(self) -> Path:
        return NOTEBOOKS / "py" / f"{self.stem}.py"


# ---- reading the blocks -----------------------------------------------------------------------


def read(path: Path) -> NotebookMeta:
    """One block, its fields checked for name and type; a `LabkitError` names the file and the field."""
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as error:
        raise LabkitError(f"{where} is not valid TOML: {error}") from None
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise LabkitError(f"{where}: unknown field(s) {unknown}; the fields are {sorted(FIELDS)}")
    for name, (kind, required) in FIELDS.items():
        if required and name not in data:
            raise LabkitError(f"{where}: missing field {name!r} (write it empty if there is nothing to say)")
        if name in data and not isinstance(data[name], kind):
            raise LabkitError(f"{where}: {name} must be a TOML {kind.__name__}, got {data[name]!r}")
    typed = {}
    for case_id, entry in data.get("typed_numbers_allowed", {}).items():
        if not (isinstance(entry, dict) and set(entry) == {"numbers", "reason"}
                and isinstance(entry["numbers"], str) and isinstance(entry["reason"], str) and entry["reason"].strip()):
            raise LabkitError(f'{where}: typed_numbers_allowed.{case_id} must be {{ numbers = "...", reason = "..." }} '
                              "with a reason")
        typed[case_id] = TypedNumbers(tuple(entry["numbers"].split()), entry["reason"])
    symptoms = []
    for entry in data.get("troubleshooting", []):
        if not (isinstance(entry, dict) and set(entry) == {"symptom", "cases"} and isinstance(entry["symptom"], str)
                and entry["symptom"].strip() and isinstance(entry["cases"], list)):
            raise LabkitError(f'{where}: each [[troubleshooting]] has symptom = "..." and cases = [...], got {entry!r}')
        symptoms.append(Symptom(entry["symptom"], tuple(entry["cases"])))
    return NotebookMeta(path.stem, data["gpu_sections"], tuple(data["needs_gpu_on_cpu"]), typed, tuple(symptoms))


@functools.cache
def all_meta() -> dict[str, NotebookMeta]:
    """Every block in notebooks/meta/, by notebook stem, in course order."""
    return {path.stem: read(path) for path in sorted(META.glob("*.toml"))}


def needs_a_gpu_on_cpu() -> frozenset[str]:
    """The cases whose verdict on a CPU is exactly `needs-gpu`, over every notebook."""
    return frozenset(case_id for meta in all_meta().values() for case_id in meta.needs_gpu_on_cpu)


def typed_numbers_allowed() -> dict[str, str]:
    """Case -> the numbers its evidence may type in, space-separated, over every notebook."""
    return {case_id: " ".join(entry.numbers) for meta in all_meta().values()
            for case_id, entry in meta.typed_numbers_allowed.items()}


# ---- what the notebook says itself ------------------------------------------------------------


@dataclass(frozen=True)
class Opening:
    """The opening cell's heading and **Time:** line."""

    number: str
    title: str
    reading_minutes: int
    exercise_minutes: int
    run_all_seconds: int


OPENING_TIME = re.compile(r"\*\*Time:\*\* about (\d+) min to read and run, plus about (\d+) min for .*?"
                          r"Run All takes about (\d+) s on 2 CPU cores")


def _cells(notebook: Path) -> list[dict]:
    from labkit.notebooks import read_notebook_json

    return read_notebook_json(notebook)["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def opening(notebook: Path) -> Opening:
    text = _source(_cells(notebook)[0])
    heading = re.match(r"# (\d\d) · (.+)", text)
    time = OPENING_TIME.search(" ".join(text.split()))
    if not (heading and time):
        raise LabkitError(f"{notebook.name}: the first cell must open with '# NN · Title' and give its **Time:** "
                          "line (docs/AUTHORING.md)")
    return Opening(heading.group(1), heading.group(2).strip(), *(int(g) for g in time.groups()))


# The **Time:** line's reading minutes come from the main path (the cells before "## Exercises"): prose at
# 200 words a minute (a careful reader of technical text) and code at 10 lines a minute (lines read to be
# understood, not skimmed: what a learner does before changing a parameter), rounded up to 5 minutes.
PROSE_WORDS_PER_MINUTE = 200
CODE_LINES_PER_MINUTE = 10


def estimated_reading_minutes(notebook: Path) -> int:
    """What the opening's "about N min to read and run" should say: the main path's prose and code read at
    the speeds above, and Run All's time, rounded up to 5 minutes."""
    words = code = 0
    for cell in _cells(notebook):
        text = _source(cell)
        if cell["cell_type"] == "markdown" and text.lstrip().startswith("## Exercises"):
            break
        if cell["cell_type"] == "markdown":
            words += len(re.findall(r"\w+", text))
        elif cell["cell_type"] == "code":
            code += sum(1 for line in text.splitlines() if line.strip() and not line.strip().startswith("#"))
    minutes = words / PROSE_WORDS_PER_MINUTE + code / CODE_LINES_PER_MINUTE + opening(notebook).run_all_seconds / 60
    return 5 * -(-int(minutes + 0.999) // 5)


def case_order(case_id: str) -> tuple:
    """A1 < A1b < A2 < A10: the catalogue's IDs in natural order."""
    match = CASE_ID.fullmatch(case_id)
    return (match.group(1), int(match.group(2)), match.group(3)) if match else (case_id, 0, "")


def recorded_cases(notebook: Path) -> list[str]:
    """The case IDs whose verdicts the notebook stored in its outputs, in natural order."""
    from labkit import claims_report

    return sorted({record["id"] for record in claims_report.collect([notebook])}, key=case_order)


def exercise_count(notebook: Path) -> int:
    """How many exercises the notebook sets (each has its check: tests/test_exercises.py)."""
    import nbformat

    from labkit import student

    return len(student.find_exercises(nbformat.read(notebook, as_version=4), notebook.name))


def _compares_with_cuda(node: ast.AST) -> bool:
    return any(isinstance(sub, ast.Compare) and any(isinstance(c, ast.Constant) and c.value == "cuda"
                                                   for c in [sub.left, *sub.comparators])
               for sub in ast.walk(node))


def cuda_lines(twin: Path) -> int:
    """Lines of the py twin inside a branch on the device being CUDA (`if dev.type == "cuda":` and the
    like, their else branches included): how much of the notebook only a GPU runs."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(twin.read_text(encoding="utf-8"))):
        if isinstance(node, ast.If | ast.IfExp) and _compares_with_cuda(node.test):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return len(lines)


# ---- generating -------------------------------------------------------------------------------


def compress_cases(case_ids: list[str]) -> str:
    """'A1, A1b, A2–A10': three or more consecutive plain IDs of a family become a range."""
    runs: list[list[str]] = []
    for case_id in case_ids:
        letter, number, suffix = case_order(case_id)
        previous = case_order(runs[-1][-1]) if runs else None
        if not suffix and previous == (letter, number - 1, ""):
            runs[-1].append(case_id)
        else:
            runs.append([case_id])
    parts = []
    for run in runs:
        parts += [f"{run[0]}–{run[-1]}"] if len(run) >= 3 else run
    return ", ".join(parts)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def notebook_table() -> str:
    lines = ["| # | notebook | cases | reading + exercises | Run All on 2 CPU cores | GPU sections | exercises |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for meta in all_meta().values():
        said = opening(meta.notebook)
        exercises = exercise_count(meta.notebook)
        lines.append(
            f"| {said.number} | [{_cell(said.title)}](notebooks/{meta.notebook.name}) "
            f"| {compress_cases(recorded_cases(meta.notebook))} "
            f"| {said.reading_minutes} + {said.exercise_minutes} min | {said.run_all_seconds} s "
            f"| {_cell(meta.gpu_sections) or 'none'} | {exercises} |")
    return "\n".join(lines)


def troubleshooting_index() -> str:
    """One row per symptom: the notebooks that name it, in course order, each with its cases."""
    rows: dict[str, list[str]] = {}
    for stem, meta in all_meta().items():
        for entry in meta.troubleshooting:
            where = stem[:2] + (f" ({', '.join(entry.cases)})" if entry.cases else "")
            rows.setdefault(_cell(entry.symptom), []).append(where)
    return "\n".join(["| symptom | notebook |", "| --- | --- |"]
                     + [f"| {symptom} | {', '.join(where)} |" for symptom, where in rows.items()])


def gpu_notebooks() -> list[str]:
    """The notebooks with GPU sections, most CUDA-only code first (the GPU runner's nbval budget is shared,
    and the ones at the end of the list are the first left out)."""
    with_gpu = [meta for meta in all_meta().values() if meta.gpu_sections]
    return [meta.stem for meta in sorted(with_gpu, key=lambda meta: (-cuda_lines(meta.twin), meta.stem))]


def gpu_notebooks_file() -> str:
    return (f"# Generated by `{REGENERATE}` from notebooks/meta/*.toml: the notebooks with GPU sections,\n"
            "# most CUDA-only code first. .ci/gpu-runner runs nbval over them in this order (NOTEBOOKS=... overrides).\n"
            + " ".join(stem[:2] for stem in gpu_notebooks()) + "\n")


def replace_block(text: str, name: str, body: str, where: str = "README.md") -> str:
    """`text` with what lies between its `<!-- generated: NAME ... -->` and `<!-- end: NAME -->` lines
    replaced by `body`."""
    pattern = re.compile(rf"(^<!-- generated: {re.escape(name)}\b[^\n]*-->\n).*?(^<!-- end: {re.escape(name)} -->$)",
                         re.M | re.S)
    if len(pattern.findall(text)) != 1:
        raise LabkitError(f"{where} needs exactly one '<!-- generated: {name} ... -->' ... '<!-- end: {name} -->' pair")
    return pattern.sub(lambda match: match.group(1) + body + "\n" + match.group(2), text)


def install_line() -> str:
    """The first line of every notebook's first code cell: on Colab, where labkit is missing, pip installs the
    workbook from pyproject's repository with the `colab` extra (what the notebooks need beside Colab's own
    packages); then `labkit.start` sets the kernel up (labkit/start.py). Through IPython's system(), not its
    %pip, which prints "you may need to restart" after every install: labkit.start says when a restart is
    needed. Without labkit elsewhere, the import fails on this line and the traceback shows its comment."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    requirement = f"{project['name']}[colab] @ git+{project['urls']['Repository']}"
    return ('import sys, importlib.util as iu; "google.colab" in sys.modules and not iu.find_spec("labkit") and '
            f"get_ipython().system(\"pip install '{requirement}'\"); "
            "import labkit.start  # no labkit here? README, Install")


def with_install_line(twin_text: str) -> str:
    """A py twin's text with install_line() as the first line of its first code cell."""
    head, marker, rest = twin_text.partition("\n# %%\n")
    if not marker:
        raise LabkitError("a notebook's py twin needs a code cell ('# %%' line): notebooks/py/ holds jupytext percent scripts")
    first_line, _, cell_rest = rest.partition("\n")
    return f"{head}{marker}{install_line()}\n{cell_rest}"


def generated() -> dict[Path, str]:
    """Each generated file's path -> its content as the blocks and notebooks make it now."""
    readme = README.read_text(encoding="utf-8")
    readme = replace_block(readme, "notebook-table", notebook_table())
    readme = replace_block(readme, "troubleshooting-index", troubleshooting_index())
    twins = {twin: with_install_line(twin.read_text(encoding="utf-8")) for twin in sorted(TWINS.glob("[0-9][0-9]_*.py"))}
    return {README: readme, GPU_NOTEBOOKS: gpu_notebooks_file(), **twins}


def stale() -> list[Path]:
    return [path for path, text in generated().items()
            if not path.exists() or path.read_text(encoding="utf-8") != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="rewrite the generated files")
    action.add_argument("--check", action="store_true", help="exit 1 when a generated file is stale")
    args = parser.parse_args(argv)
    if args.check:
        old = stale()
        for path in old:
            print(f"{path.relative_to(ROOT)} is stale: run `{REGENERATE}`", file=sys.stderr)
        return 1 if old else 0
    for path, text in generated().items():
        if args.write:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                path.write_text(text, encoding="utf-8")
                print(f"wrote {path.relative_to(ROOT)}")
        else:
            print(f"==> {path.relative_to(ROOT)}\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

