"""The workbook's notebook files, tooling side: finding them, normalising them, their jupytext pairs.

The one glob for the workbook's notebooks, `normalise` (what changes from run to run is stripped
before a notebook is committed), the jupytext pairing with ``notebooks/py/NN_name.py`` and its
cell-metadata filter (read from the checkout's ``jupytext.toml``, declared nowhere else, so this
tooling runs in a checkout), and `stamp_notebook`. The records a running notebook stores in its
outputs, and reading them back, are `labkit.records`: a kernel imports that, never this module.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import uuid
from pathlib import Path

from labkit.errors import LabkitError
from labkit.records import read_notebook_json

__all__ = [
    "KERNELSPEC",
    "NOTEBOOK_GLOB",
    "WIDGET_VIEW_MIME",
    "copy_without_outputs",
    "jupytext_filters",
    "kept_cell_metadata",
    "normalise",
    "normalise_file",
    "pair_differences",
    "paired_script",
    "read_paired",
    "select_notebooks",
    "stamp_notebook",
    "workbook_notebooks",
    "write_script",
]

NOTEBOOK_GLOB = "[0-9][0-9]_*.ipynb"
"""The workbook's notebooks: ``NN_name.ipynb``, in course order when sorted."""
SCRIPT_FOLDER = "py"
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
JUPYTEXT_CONFIG_NAME = "jupytext.toml"
"""The workbook's jupytext configuration, at the checkout's root: the pairing and the metadata kept in both files."""
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"
# Fixed, so a widget's stored model id depends only on where the widget sits in the notebook.
_WIDGET_NAMESPACE = uuid.UUID("6f1d0c3e-8a52-4d1b-9a57-3b0c1f6e2d41")


# ---- finding and reading ---------------------------------------------------------------------

def workbook_notebooks(folder: str | Path = "notebooks") -> list[Path]:
    """The workbook's notebooks in course order (`NN_name.ipynb`)."""
    found = sorted(Path(folder).glob(NOTEBOOK_GLOB))
    if not found:
        raise LabkitError(f"no notebooks named NN_name.ipynb in {folder}")
    return found


def select_notebooks(names: list[str], folder: str | Path = "notebooks", with_scripts: bool = False) -> list[Path]:
    """The notebooks whose stem is or starts with one of `names` (all when empty).

    `with_scripts` also counts a script in `py/` whose notebook does not exist yet.
    """
    folder = Path(folder)
    scripts = ({folder / f"{p.stem}.ipynb" for p in (folder / SCRIPT_FOLDER).glob(Path(NOTEBOOK_GLOB).stem + ".py")}
               if with_scripts else set())
    every = sorted(set(folder.glob(NOTEBOOK_GLOB)) | scripts)
    if not every:
        raise LabkitError(f"no notebooks named NN_name.ipynb in {folder}")
    if not names:
        return every
    chosen = [nb for nb in every if any(nb.stem == n or nb.stem.startswith(n) for n in names)]
    if not chosen:
        raise LabkitError(f"no notebook matches {' '.join(names)}; have {', '.join(nb.stem for nb in every)}")
    return chosen


# ---- what changes from run to run ------------------------------------------------------------

def normalise(nb) -> None:
    """Strip what changes from run to run (timings, kernel versions, random cell and widget ids).

    Works in place on an nbformat notebook.
    """
    nb.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": {"name": "python"}}
    nb.nbformat, nb.nbformat_minor = 4, 5
    kept = kept_cell_metadata()
    widgets = 0
    for index, cell in enumerate(nb.cells):
        cell.id = f"cell-{index:03d}"
        cell.metadata = {k: v for k, v in cell.metadata.items() if k in kept}
        if "outputs" in cell:
            cell.outputs = _merged_streams(cell.outputs)
        for output in cell.get("outputs", []):
            output.get("metadata", {}).pop("execution", None)
            view = output.get("data", {}).get(WIDGET_VIEW_MIME)
            if isinstance(view, dict) and "model_id" in view:
                view["model_id"] = uuid.uuid5(_WIDGET_NAMESPACE, f"widget-{widgets}").hex
                widgets += 1


def _merged_streams(outputs: list) -> list:
    """Join adjacent stream outputs of the same name: how the kernel split them varies run to run.

    nbclient's ``coalesce_streams`` is not used: it also joins a name's streams across a figure or
    a table between them and reorders stderr after stdout, which would move stored outputs of 02
    and 13.
    """
    merged = []
    for output in outputs:
        previous = merged[-1] if merged else None
        if (output.get("output_type") == "stream" and previous is not None
                and previous.get("output_type") == "stream" and previous.get("name") == output.get("name")):
            previous["text"] = "".join(previous["text"]) + "".join(output["text"])
        else:
            merged.append(output)
    return merged


def normalise_file(path: str | Path) -> bool:
    """Normalise one .ipynb file in place without executing it; True when the file changed."""
    import nbformat

    path = Path(path)
    try:
        before = path.read_text(encoding="utf-8")
        nb = nbformat.reads(before, as_version=4)
    except (OSError, ValueError) as error:  # nbformat raises ValueError subclasses for JSON it cannot read
        raise LabkitError(f"cannot read notebook {path}: {error}") from error
    normalise(nb)
    after = nbformat.writes(nb)
    after = after if after.endswith("\n") else after + "\n"
    if after == before:
        return False
    path.write_text(after, encoding="utf-8")
    return True


# ---- the jupytext pair -----------------------------------------------------------------------

def jupytext_config_file() -> Path:
    """The workbook's ``jupytext.toml``: in the current folder or the nearest folder above it, as jupytext
    finds it. It is the checkout's, not labkit's: an installed labkit ships no notebooks to pair."""
    here = Path.cwd()
    for folder in (here, *here.parents):
        if (folder / JUPYTEXT_CONFIG_NAME).is_file():
            return folder / JUPYTEXT_CONFIG_NAME
    raise LabkitError(
        f"no {JUPYTEXT_CONFIG_NAME} in {here} or any folder above it: labkit's notebook tooling (normalise, "
        "execute, the jupytext pair) reads the workbook's pairing and kept cell metadata there, so it runs in a "
        "checkout of the workbook; run it from the checkout (git clone the repository, then cd into it)"
    )


@functools.cache
def _read_jupytext_config(path: Path) -> dict:
    import tomllib  # only the tooling needs it, not `import labkit`

    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise LabkitError(f"cannot read the workbook's jupytext configuration {path}: {error}; "
                          "restore it from the repository (git checkout jupytext.toml)") from error


def jupytext_filters() -> dict[str, str]:
    """The notebook and cell metadata filters of ``jupytext.toml``, as jupytext's notebook metadata."""
    config = _read_jupytext_config(jupytext_config_file())
    return {key: config[key] for key in ("notebook_metadata_filter", "cell_metadata_filter")}


def kept_cell_metadata() -> tuple[str, ...]:
    """The cell metadata keys the pair keeps (``tags``, ``nbgrader``): jupytext.toml's cell filter."""
    entries = jupytext_filters()["cell_metadata_filter"].split(",")
    return tuple(entry for entry in entries if entry and not entry.startswith("-"))


def paired_script(notebook: Path) -> Path:
    """The jupytext percent-format twin of `notebooks/NN_name.ipynb`: `notebooks/py/NN_name.py`."""
    return Path(notebook).parent / SCRIPT_FOLDER / f"{Path(notebook).stem}.py"


def _cell_signature(nb) -> list[tuple]:
    return [(c.cell_type, c.source.strip(), tuple(c.metadata.get("tags", []))) for c in nb.cells]


def pair_differences(notebook: Path) -> list[str]:
    """How the notebook and its paired script disagree (empty when they match)."""
    import jupytext
    import nbformat

    script = paired_script(notebook)
    if not script.exists():
        return [f"{script} is missing"]
    stored = _cell_signature(nbformat.read(notebook, as_version=4))
    scripted = _cell_signature(jupytext.read(script))
    if len(stored) != len(scripted):
        return [f"{notebook.name} has {len(stored)} cells, {script.name} has {len(scripted)}"]
    return [f"cell {i} differs" for i, (a, b) in enumerate(zip(stored, scripted)) if a != b]


def read_paired(notebook: Path, prefer: str | None = None):
    """The side of the pair that holds the edits, as an nbformat notebook.

    When the notebook and its script disagree, `prefer` ("py" or "ipynb") says which holds the
    edits; without it this refuses rather than overwrite someone's work.
    """
    import jupytext
    import nbformat

    notebook = Path(notebook)
    script = paired_script(notebook)
    have_nb, have_py = notebook.exists(), script.exists()
    if not have_nb and not have_py:
        raise LabkitError(f"neither {notebook} nor {script} exists")
    if have_nb and have_py and pair_differences(notebook) and prefer is None:
        raise LabkitError(
            f"{notebook.name} and {script} disagree; rerun with PREFER=py (the script holds your edits) "
            "or PREFER=ipynb (the notebook does)"
        )
    if have_py and (prefer == "py" or not have_nb):
        return jupytext.read(script)
    return nbformat.read(notebook, as_version=4)


def write_script(nb, script: Path) -> None:
    """Write the percent-format twin of ``nb`` (no outputs) with jupytext.toml's metadata filters."""
    import jupytext

    bare = copy_without_outputs(nb)
    bare.metadata["jupytext"] = jupytext_filters()
    Path(script).parent.mkdir(exist_ok=True)
    jupytext.write(bare, script, fmt="py:percent")


def copy_without_outputs(nb):
    """A deep copy of ``nb`` with every code cell's outputs and execution count cleared."""
    bare = copy.deepcopy(nb)
    for cell in bare.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return bare


# ---- the machine that ran it ------------------------------------------------------------------

def stamp_notebook(notebook, fp: dict | None = None):
    """Store a fingerprint in a notebook's ``metadata["labkit"]["fingerprint"]``.

    ``notebook`` is the path of an .ipynb file (read, stamped and written back) or a notebook
    object (stamped in place). ``fp`` defaults to this machine's `labkit.probes.fingerprint()`.
    Returns the stamped notebook. The repro runner calls this on every executed notebook.
    """
    if fp is None:
        from labkit.probes import fingerprint  # tooling uses the instrument, never the other way round

        fp = fingerprint()
    stamp = _json_copy(fp)
    if isinstance(notebook, (str, Path)):
        return _stamp_file(Path(notebook), stamp)
    if isinstance(notebook, dict) and isinstance(notebook.get("metadata"), dict):
        return _put_stamp(notebook, stamp)
    raise LabkitError(
        f"stamp_notebook needs a notebook path or a notebook object with metadata, not "
        f"{type(notebook).__name__}: pass the .ipynb path or nbformat.read(path, as_version=4)"
    )


def _json_copy(fp: dict) -> dict:
    # A round trip both proves the stamp is plain JSON and keeps later edits of `fp` out of the notebook.
    try:
        return json.loads(json.dumps(fp))
    except TypeError as err:
        raise LabkitError(f"the fingerprint must be plain JSON ({err}): pass fingerprint()'s dict") from err


def _stamp_file(path: Path, stamp: dict) -> dict:
    """Stamp the file as raw JSON (nbformat's own layout), replaced atomically: a kill mid-write cannot cut it."""
    if not path.is_file():
        raise LabkitError(f"no notebook at {path}: pass the path of an existing .ipynb file")
    notebook = read_notebook_json(path)
    if not isinstance(notebook, dict) or not isinstance(notebook.get("metadata"), dict):
        raise LabkitError(f"{path} is not a notebook (no metadata object): pass an .ipynb file")
    _put_stamp(notebook, stamp)
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
    partial.write_text(json.dumps(notebook, sort_keys=True, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(partial, path)
    return notebook


def _put_stamp(notebook, stamp: dict):
    notebook["metadata"].setdefault("labkit", {})["fingerprint"] = stamp
    return notebook
