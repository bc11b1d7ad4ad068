"""`make site`: the course website, from the notebooks' stored outputs (nothing executes).

Lays out the Sphinx sources under site/_build/source (copies: the notebooks, each with the ways to run it and
its explorers made static, the glossary, and pages generated from the notebooks' metadata and stored claims),
then builds site/_build/html with warnings as errors. Nothing is written outside site/_build.

    python site/build.py [--out DIR] [--keep-going]
"""

from __future__ import annotations

import argparse
import copy
import html
import shutil
import sys
import tomllib
from pathlib import Path

import nbformat

from labkit import _notebook_meta
from labkit.claims import catalogue
from labkit.claims_report import collect
from labkit.notebooks import NOTEBOOK_GLOB

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "site"
DEFAULT_OUT = SITE / "_build"
REPOSITORY = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
WIDGET = "application/vnd.jupyter.widget-view+json"
# the GitHub path of the repository, for Binder's and Colab's addresses
GITHUB_PATH = REPOSITORY.removeprefix("https://github.com/")


def ways_to_run(name: str) -> str:
    """The markdown cell placed under each notebook's title: where a learner can run it."""
    return (
        "```{admonition} Run this notebook\n:class: tip\n"
        f"- **On your machine** (the student edition, without solutions): `make student`, then `make lab-student`, "
        f"and open `student/{name}` ([install](https://github.com/{GITHUB_PATH}#install)).\n"
        f"- **Binder**: [open {name} in JupyterLab](https://mybinder.org/v2/gh/{GITHUB_PATH}/HEAD?labpath=notebooks/{name})"
        " (the lock with torch's CPU build; a few minutes to start).\n"
        f"- **Colab**: [open {name}](https://colab.research.google.com/github/{GITHUB_PATH}/blob/main/notebooks/{name});"
        " its first cell installs labkit.\n"
        "- **A workshop hub**: your instructor's JupyterHub has the course release "
        f"([docs/COURSE.md](https://github.com/{GITHUB_PATH}/blob/main/docs/COURSE.md)).\n"
        "```")


def static_explorer(output: dict) -> dict:
    """An explorer's widget output as a sentence: a static page has no kernel to move its controls."""
    said = "".join(output["data"].get("text/plain", "")).strip("[]'\" ")  # 'explorer controls: ... (run this cell ...)'
    controls = said.split(" (run this cell")[0].removeprefix("explorer controls: ")
    sentence = (f"An interactive explorer stands here, with controls for {controls}. This static page shows its "
                "default view in the figure below: run the notebook (see above) to move the controls.")
    return nbformat.v4.new_output("display_data", data={"text/html": f'<p class="explorer-static">{html.escape(sentence)}</p>',
                                                        "text/plain": sentence})


def site_notebook(path: Path) -> nbformat.NotebookNode:
    notebook = copy.deepcopy(nbformat.read(path, as_version=4))
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = [static_explorer(o) if WIDGET in o.get("data", {}) else o for o in cell.outputs]
    notebook.cells.insert(1, nbformat.v4.new_markdown_cell(ways_to_run(path.name)))
    return notebook


def landing_page(notebooks: list[Path]) -> str:
    toctree = "\n".join(f"notebooks/{path.stem}" for path in notebooks)
    return f"""# Gradient Lab

A workbook of PyTorch training failures, reproduced and measured: vanishing gradients, BatchNorm in the
wrong mode, in-place operations, a forgotten `zero_grad`, mixed-precision scalers, `torch.compile` drift,
memory, DataLoader workers and DDP. Each notebook takes a family of claims from two articles on debugging
gradients, reproduces each one on a small seeded model, measures what really happens, records a
**verdict** ([the case catalogue](cases.md) lists them all), proves the fix, and ends with exercises that
grade themselves.

**Who it is for**: engineers who can read a PyTorch training loop (tensors, `nn.Module`, `loss.backward()`,
`optimizer.step()`) and want to know why one fails; instructors who run it as a course (a student edition
without solutions, nbgrader, a workshop hub). Every notebook runs on two CPU cores in under a minute;
GPU sections run on CUDA and say `needs-gpu` elsewhere.

## The learner's path

1. Start with [00 · Start here](notebooks/00_start_here.ipynb): it shows how every notebook reads, on one tiny
   claim, and its two exercises show how grading works.
2. Go on in order, or pick a notebook by the symptom you have in the [troubleshooting index](troubleshooting.md).
3. Each page says how to run it: on your machine with the student edition, on Binder, on Colab or on a
   workshop hub. The pages here show the stored outputs; the exercises need a running notebook.
4. Words the notebooks use are explained in the [glossary](notebooks/GLOSSARY.md).

{_notebook_meta.notebook_table()}

```{{toctree}}
:maxdepth: 1
:caption: The notebooks
:hidden:

{toctree}
```

```{{toctree}}
:maxdepth: 1
:caption: Reference
:hidden:

notebooks/GLOSSARY
troubleshooting
cases
```
"""


def troubleshooting_page() -> str:
    return ("# Troubleshooting index\n\nA symptom, and the notebooks (with their cases) that reproduce and fix it. "
            "Generated from `notebooks/meta/`, as the README's copy is.\n\n" + _notebook_meta.troubleshooting_index()
            + "\n\nThe notebooks: " + ", ".join(f"[{path.stem[:2]}](notebooks/{path.name})" for path in _notebooks())
            + ".\n")


def cases_page(notebooks: list[Path]) -> str:
    """Every case the notebooks record, with its claim, verdict and evidence, under its notebook."""
    records = collect([ROOT / "notebooks"])
    known = catalogue()
    unrecorded = [case_id for case_id in known if case_id not in {r["id"] for r in records}]
    lines = ["# The case catalogue", "",
             f"Every claim the notebooks test ({len(records)} cases), the verdict their stored run recorded and "
             "the evidence, generated from the stored outputs (`python -m labkit claims --json`). A verdict is "
             "one of holds, does-not-hold, partly, needs-gpu (measured only on CUDA) and untestable; the "
             "[glossary](notebooks/GLOSSARY.md#verdict) says what each means.", ""]
    if unrecorded:
        lines += [f"Not recorded by any notebook: {', '.join(unrecorded)}.", ""]
    for path in notebooks:
        mine = [r for r in records if r["notebook"] == path.stem]
        if not mine:
            continue
        lines += [f"## {_notebook_meta.opening(path).number} · [{_notebook_meta.opening(path).title}](notebooks/{path.name})", ""]
        for record in mine:
            lines += [f"### {record['id']}: {record['verdict']}", "", f"{record['claim']}", "",
                      f"**Evidence** ({record['verdict']}): {record['evidence']}", ""]
    return "\n".join(lines)


def _notebooks() -> list[Path]:
    return sorted((ROOT / "notebooks").glob(NOTEBOOK_GLOB))


def lay_out(source: Path) -> None:
    """Write the Sphinx sources into `source` (emptied first)."""
    shutil.rmtree(source, ignore_errors=True)
    (source / "notebooks").mkdir(parents=True)
    notebooks = _notebooks()
    for path in notebooks:
        nbformat.write(site_notebook(path), source / "notebooks" / path.name)
    shutil.copy(ROOT / "notebooks" / "GLOSSARY.md", source / "notebooks" / "GLOSSARY.md")
    (source / "index.md").write_text(landing_page(notebooks))
    (source / "troubleshooting.md").write_text(troubleshooting_page())
    (source / "cases.md").write_text(cases_page(notebooks))


def build(out: Path = DEFAULT_OUT, warnings_as_errors: bool = True) -> int:
    """Lay out the sources under `out`/source and build `out`/html; Sphinx's exit status."""
    from sphinx.cmd.build import build_main

    if out.resolve() == ROOT or ROOT in out.resolve().parents and not out.resolve().is_relative_to(SITE / "_build"):
        raise SystemExit(f"site/build.py writes only under site/_build or outside the repository, not {out}")
    lay_out(out / "source")
    options = ["-W", "--keep-going"] if warnings_as_errors else []
    return build_main(["-q", "-b", "html", "-c", str(SITE), *options, str(out / "source"), str(out / "html")])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python site/build.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the build folder (default: site/_build)")
    parser.add_argument("--allow-warnings", action="store_true", help="do not turn Sphinx's warnings into errors")
    arguments = parser.parse_args(argv)
    status = build(arguments.out, warnings_as_errors=not arguments.allow_warnings)
    if status == 0:
        print(f"site built: {arguments.out / 'html' / 'index.html'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
