"""The case catalogue and the verdicts the notebooks record against it.

The source articles make claims; several are wrong. A notebook states a claim by its ID, measures,
and records what the data supports with `check(ID, verdict=..., measured={label: value})`. The record is printed
for the reader and stored in the notebook's outputs under a JSON mimetype (`labkit.records`), so
`python -m labkit claims` (labkit/claims_report.py) can list every verdict from the stored
notebooks without executing them.
Used in every notebook.
"""

from __future__ import annotations

import difflib
import html
import json
import re
import textwrap
from dataclasses import asdict, dataclass, field
from functools import cache
from importlib import resources

from labkit import _evidence
from labkit.errors import LabkitError
from labkit.records import CLAIM_MIME, METRIC_MIME, show_record

__all__ = ["case", "check", "metric", "table"]

VERDICTS = ("holds", "does-not-hold", "partly", "needs-gpu", "untestable")
MEASURED_VERDICTS = ("holds", "does-not-hold", "partly")


@dataclass(frozen=True)
class Case:
    """One entry of the catalogue: a claim from the articles, in the workbook's own words."""

    id: str
    family: str
    source: str
    claim: str
    gpu_only: bool
    question: str


@dataclass(frozen=True)
class Verdict:
    """What a notebook concluded about one case, with the numbers behind it.

    `evidence` is the sentence rendered from `measured` (label -> value), `note` and `rule`."""

    id: str
    verdict: str
    evidence: str
    claim: str
    notebook: str = ""
    device_dependent: bool = False
    measured: dict = field(default_factory=dict)
    note: str = ""
    rule: str = ""


@cache
def _catalogue_data() -> dict:
    text = resources.files("labkit").joinpath("data/cases.json").read_text(encoding="utf-8")
    return json.loads(text)


@cache
def catalogue() -> dict[str, Case]:
    """Every case ID with its claim, in catalogue order."""
    fields = Case.__dataclass_fields__
    return {entry["id"]: Case(**{k: entry[k] for k in fields}) for entry in _catalogue_data()["cases"]}


def families() -> dict[str, dict]:
    """Family letter -> {"title", "notebooks"}."""
    return dict(_catalogue_data()["families"])


def case(case_id: str) -> Case:
    """The catalogue entry for `case_id`; a clear error naming close IDs when it is unknown."""
    known = catalogue()
    if case_id in known:
        return known[case_id]
    near = difflib.get_close_matches(str(case_id), known, n=3)
    hint = f" Did you mean {', '.join(near)}?" if near else ""
    raise LabkitError(
        f"unknown case ID {case_id!r}: it is not in labkit/data/cases.json.{hint} "
        "Use an ID from the catalogue (python -m labkit claims --catalogue lists them)."
    )


def validate(case_id: str, verdict: str, evidence: str, measured: dict | None = None) -> None:
    """Raise LabkitError unless the ID is catalogued, the verdict known and the evidence adequate: a
    measured verdict rests on measured values (``measured``, a yes/no among them) or on numbers in its text."""
    case(case_id)
    if verdict not in VERDICTS:
        raise LabkitError(f"unknown verdict {verdict!r} for {case_id}: use one of {', '.join(VERDICTS)}")
    if not evidence or not evidence.strip():
        raise LabkitError(f"{case_id}: a verdict needs evidence; say what was measured (or why it cannot be)")
    if verdict in MEASURED_VERDICTS and not measured and not re.search(r"\d", evidence):
        raise LabkitError(
            f"{case_id}: a '{verdict}' verdict must carry the measured numbers in its evidence; got {evidence!r}"
        )


_session: list[Verdict] = []


def check(case_id: str, verdict: str, measured: dict | None = None, *, note: str = "", rule: str = "",
          claim: str | None = None, device_dependent: bool | None = None) -> None:
    """Record the verdict the measurement supports for one case, and show it.

    `measured` maps a label to what this run measured (a number, a bool, a string, or a list or dict
    of those): ``{"max |diff|": diff, "steps clipped": share}``. labkit formats the numbers and renders
    the sentence, the HTML table and the claims table's line from them, so all three agree; the
    stored record keeps the values as JSON. `rule` says what decides the verdict (the threshold), and
    `note` what is not a measurement: the article's own figure, the reason for `needs-gpu` or
    `untestable`. A `holds`, `does-not-hold` or `partly` verdict needs measured numbers.
    `claim` defaults to the catalogue's wording. `device_dependent` marks a verdict that differs
    between a CPU and a GPU run (by default: a GPU-only case, or a `needs-gpu` verdict); its cell
    carries the tag `nbval-ignore-output`, and `table()` names it without its verdict so the table
    reads the same on both. `recorded()` returns what was recorded.
    """
    values = _evidence.as_json(case_id, measured) if measured is not None else {}
    if verdict in MEASURED_VERDICTS and not values:
        raise LabkitError(f"{case_id}: a '{verdict}' verdict rests on what was measured: pass the numbers as "
                          "measured={label: value, ...} (note= is for what is not a measurement)")
    evidence = _evidence.sentence(values, note, rule)
    validate(case_id, verdict, evidence, values)
    if device_dependent is None:
        device_dependent = case(case_id).gpu_only or verdict == "needs-gpu"
    record = Verdict(case_id, verdict, evidence, claim or case(case_id).claim, device_dependent=device_dependent,
                     measured=values, note=note.strip(), rule=rule.strip())
    _session[:] = [v for v in _session if v.id != case_id] + [record]
    payload = {k: v for k, v in asdict(record).items() if k != "device_dependent"}
    show_record(_verdict_text(record), CLAIM_MIME, payload, html=_verdict_html(record))


def metric(name: str, value: float | int | str | bool) -> None:
    """Record one named result for papermill runs and sweeps (see `labkit.runner`)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", name):
        raise LabkitError(f"metric name {name!r} must be an identifier such as 'eval_acc'")
    if isinstance(value, float) and value != value:
        raise LabkitError(f"metric {name!r} is NaN: record a finite value or a string saying why")
    show_record(f"metric {name} = {value}", METRIC_MIME, {"name": name, "value": value})


def recorded() -> list[Verdict]:
    """The verdicts recorded in this kernel session, in the order they were first checked."""
    return list(_session)


def reset() -> None:
    """Forget this session's verdicts (tests use it; a notebook's kernel starts empty)."""
    _session.clear()


def table(verdicts: list[Verdict] | None = None, width: int = 100) -> None:
    """Show the *Claims checked* table, one line per case: ID, verdict, takeaway (every notebook ends
    with it). In a notebook it is an HTML table whose rows open to the full claim and evidence; the
    plain-text view (and a terminal) gets the same lines as text."""
    rows = recorded() if verdicts is None else verdicts
    _show_rich(format_table(rows, width), _table_html(rows))


def format_table(verdicts: list[Verdict] | None = None, width: int = 100) -> str:
    """The *Claims checked* table as text, one line per case, for this session's verdicts or the ones given."""
    rows = recorded() if verdicts is None else verdicts
    if not rows:
        return "No claims checked yet."
    stable = [v for v in rows if not v.device_dependent]
    lines = [_table_line(v, width) for v in stable]
    note = _device_note(rows)
    return "\n".join(lines + ([note] if note else []))


# How each verdict reads at a glance, in the table and in a verdict cell.
VERDICT_MARKS = {"holds": "✓", "does-not-hold": "✗", "partly": "◐", "needs-gpu": "…", "untestable": "?"}
# A bare Python boolean in evidence ("allclose: True", "(False)") reads as a word; code keeps its
# spelling: an argument (`set_to_none=True`), an assignment ("head._compiled = False"), a default
# ("default False"), or anything in backticks.
_BARE_BOOLEAN = re.compile(r"(?<![=\w`])(?<!= )(?<!default )(True|False)(?![\w`=])")
_TAKEAWAY_END = re.compile(r"[;:.](?=\s)|, but ")


def readable(evidence: str) -> str:
    """The evidence as a sentence: bare True/False become yes/no, a capital first letter, a final stop."""
    text = _BARE_BOOLEAN.sub(lambda match: "yes" if match.group(1) == "True" else "no", evidence.strip())
    text = text[:1].upper() + text[1:]
    return text if text.endswith((".", "!", "?")) else text + "."


def takeaway(v: Verdict, width: int = 80) -> str:
    """The table's one line, cut to ``width`` characters at a word: the first measured value, or the
    note's first clause when nothing was measured."""
    if v.measured:
        clause = _evidence.items(v.measured)[0]  # a label is printed as written: it may be code
    else:
        sentence = readable(v.evidence)
        end = _TAKEAWAY_END.search(sentence)
        clause = sentence[:end.start()] if end else sentence.rstrip(".")
    if len(clause) <= width:
        return clause
    return clause[:width - 1].rsplit(" ", 1)[0].rstrip(",;:(") + "…"


def _verdict_text(v: Verdict, width: int = 100) -> str:
    head = f"{VERDICT_MARKS[v.verdict]} {v.id} {v.verdict}: "
    text = v.evidence + "." if v.measured else readable(v.evidence)
    return textwrap.fill(head + text, width=width, subsequent_indent="  ")


def _verdict_html(v: Verdict) -> str:
    head = f"<strong>{VERDICT_MARKS[v.verdict]} {html.escape(v.id)} {html.escape(v.verdict)}</strong>"
    if not v.measured:
        return f'<div class="labkit-verdict">{head}: {html.escape(readable(v.evidence))}</div>'
    note = f"<p>{html.escape(readable(v.note))}</p>" if v.note else ""
    rule = f"<p><em>Verdict rule: {html.escape(v.rule)}</em></p>" if v.rule else ""
    return f'<div class="labkit-verdict">{head}{_evidence.html_table(v.measured)}{note}{rule}</div>'



def _table_line(v: Verdict, width: int) -> str:
    head = f"{v.id:<5} {VERDICT_MARKS[v.verdict]} {v.verdict.upper():<13} "
    return head + takeaway(v, max(20, width - len(head)))


def _device_note(rows: list[Verdict]) -> str:
    varying = [v.id for v in rows if v.device_dependent]
    if not varying:
        return ""
    return (f"Depends on the device (the verdict is in the case's own cell above, and in "
            f"`python -m labkit claims`): {', '.join(varying)}")


def _show_rich(text: str, html_text: str) -> None:
    """HTML in a notebook with ``text`` as its plain view; ``text`` printed anywhere else."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # labkit works without IPython installed
        print(text)
        return
    if get_ipython() is None:
        print(text)
        return
    display({"text/plain": text, "text/html": html_text}, raw=True)


def _table_html(rows: list[Verdict]) -> str:
    stable = [v for v in rows if not v.device_dependent]
    if not stable:
        return f"<p>{html.escape(_device_note(rows) or 'No claims checked yet.')}</p>"
    cells = "".join(
        f"<tr><td>{html.escape(v.id)}</td><td>{VERDICT_MARKS[v.verdict]}&nbsp;{html.escape(v.verdict)}</td>"
        f"<td><details><summary>{html.escape(takeaway(v))}</summary>"
        f"<p><em>{html.escape(v.claim)}</em></p><p>{html.escape(readable(v.evidence))}</p></details></td></tr>"
        for v in stable)
    note = _device_note(rows)
    return ('<table class="labkit-claims"><thead><tr><th>case</th><th>verdict</th>'
            '<th style="text-align:left">takeaway (open a row for the claim and all the evidence)</th>'
            f"</tr></thead><tbody>{cells}</tbody></table>" + (f"<p>{html.escape(note)}</p>" if note else ""))
