"""The workbook run's summary: summary.md, summary.html and summary.json, and the tables in them."""

from __future__ import annotations

import html
import json
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from labkit.runner.paths import inside
from labkit.runner.run import RunResult

__all__ = ["SUMMARY_FILES", "html_table", "md_table", "write_summary"]

SUMMARY_FILES = ("summary.json", "summary.md", "summary.html")


def write_summary(results: list[RunResult], out: Path) -> None:
    """`summary.md`, `summary.html` and `summary.json`: each notebook's status and time, and all claims."""
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    runs = [[r.notebook, r.status, f"{r.seconds:.1f}", r.error or ""] for r in results]
    claims = [[c["id"], r.notebook, c["verdict"], c["evidence"]] for r in results for c in r.claims]
    total = sum(r.seconds for r in results)
    heading = f"Gradient Lab workbook run, {stamp}: {sum(r.status == 'ok' for r in results)}/{len(results)} ok, {total:.0f} s"
    out = Path(out)
    inside(out, out / "summary.json").write_text(json.dumps({"heading": heading, "runs": [asdict(r) for r in results]}, indent=2))
    inside(out, out / "summary.md").write_text("\n".join([
        f"# {heading}", "", md_table(["notebook", "status", "seconds", "error"], runs), "",
        "## Claims checked", "", md_table(["id", "notebook", "verdict", "evidence"], claims), "",
    ]))
    inside(out, out / "summary.html").write_text(
        "<!doctype html><meta charset='utf-8'><title>Gradient Lab summary</title>"
        f"<h1>{html.escape(heading)}</h1>{html_table(['notebook', 'status', 'seconds', 'error'], runs)}"
        f"<h2>Claims checked</h2>{html_table(['id', 'notebook', 'verdict', 'evidence'], claims)}"
    )


def md_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table; a ``|`` or a newline in a cell cannot break it."""
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"
    return "\n".join([line(header), line(["---"] * len(header))] + [line(r) for r in rows])


def html_table(header: list[str], rows: list[list]) -> str:
    """An HTML table with every cell escaped."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table border='1' cellpadding='4'><tr>{head}</tr>{body}</table>"
