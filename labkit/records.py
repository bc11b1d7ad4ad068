"""The records a running notebook stores in its outputs, and reading them back from the file.

A claim verdict, a metric or a grade is displayed under its own JSON mimetype with a plain-text
view (`show_record`), so the stored notebook keeps it; `stored_records` reads them back from the
``.ipynb`` file as plain JSON, without executing the notebook or importing nbformat. Kernel-side
modules (`labkit.claims`, `labkit.grading`) import this module; it imports only the standard
library, so a kernel never loads the notebook-file tooling (`labkit.notebooks`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from labkit.errors import LabkitError

__all__: list[str] = []

CLAIM_MIME = "application/vnd.labkit.claim+json"
"""The mimetype of a claim verdict stored by `labkit.claims.check`."""
METRIC_MIME = "application/vnd.labkit.metric+json"
"""The mimetype of a named result stored by `labkit.claims.metric`."""


def read_notebook_json(path: str | Path) -> dict:
    """A notebook file as plain JSON (no nbformat, no validation); a clear error when it cannot be read."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise LabkitError(f"cannot read notebook {path}: {error}") from error


def show_record(text: str, mime: str, payload: dict, html: str | None = None) -> None:
    """Display ``payload`` under ``mime`` with ``text`` as its plain-text view (and ``html``, when
    given, as the view a notebook renders); print ``text`` outside IPython.

    The stored output is what `stored_records` reads back later. Where ``LABKIT_RECORDS_LOG`` names a
    file, the record is also appended to it as one JSON line: a run that keeps no notebook (nbval in
    `.ci/gpu-runner`) still keeps what it measured.
    """
    _append_to_records_log(mime, payload)
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # labkit works without IPython installed: then there is no notebook to store into
        print(text)
        return
    if get_ipython() is None:
        print(text)
        return
    bundle = {"text/plain": text, mime: payload}
    if html is not None:
        bundle["text/html"] = html
    display(bundle, raw=True)


def _append_to_records_log(mime: str, payload: dict) -> None:
    log = os.environ.get("LABKIT_RECORDS_LOG")
    if not log:
        return
    line = json.dumps({"mime": mime, **payload}, default=str)
    try:
        with open(log, "a", encoding="utf-8") as file:
            file.write(line + "\n")
    except OSError as error:
        raise LabkitError(f"cannot append to LABKIT_RECORDS_LOG={log}: {error}; "
                          "point it at a writable file or unset it") from error


def stored_records(notebook: str | Path, mime: str, fields: dict[str, type] | None = None) -> list[dict]:
    """The records of one mimetype stored in a notebook's outputs, without executing it.

    Each record gets a ``notebook`` key: the notebook's stem. A notebook that is not shaped like
    one, or a record that is not a JSON object holding ``fields`` (name -> type), is a LabkitError
    naming the file and the cell.
    """
    path = Path(notebook)
    content = read_notebook_json(path)
    cells = content.get("cells", []) if isinstance(content, dict) else None
    if not isinstance(cells, list):
        raise LabkitError(f"{path} is not a notebook: it holds no list of cells; restore it from a copy or re-run it")
    found = []
    for index, cell in enumerate(cells, start=1):
        outputs = cell.get("outputs", []) if isinstance(cell, dict) else None
        if not isinstance(outputs, list) or not all(isinstance(output, dict) for output in outputs):
            raise LabkitError(f"{path} cell {index} is malformed (a cell is an object with a list of outputs)")
        for output in outputs:
            data = output.get("data", {})
            payload = data.get(mime) if isinstance(data, dict) else None
            if payload is not None:
                found.append(dict(_checked_record(payload, fields or {}, f"{path} cell {index}"), notebook=path.stem))
    return found


def _checked_record(payload: object, fields: dict[str, type], where: str) -> dict:
    if not isinstance(payload, dict):
        raise LabkitError(f"{where}: a stored record must be a JSON object, got {type(payload).__name__}")
    for name, kind in fields.items():
        if name not in payload:
            raise LabkitError(f"{where}: the stored record has no {name!r} field; re-run the cell that wrote it")
        if not isinstance(payload[name], kind) or (kind is not bool and isinstance(payload[name], bool)):
            raise LabkitError(
                f"{where}: the stored record's {name!r} is a {type(payload[name]).__name__}, "
                f"not a {kind.__name__}; re-run the cell that wrote it"
            )
    return payload
