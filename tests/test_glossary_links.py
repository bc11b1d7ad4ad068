"""Each glossary word links to its entry where a notebook first uses it, and every such link finds its entry.

A glossary word is "used" when one of its forms below occurs in a notebook's markdown prose as a
whole word, in any case, alone or with a plural ending ("hooks" is a use of *hook*). Prose here
means a markdown cell without its headings, fenced code, images, links to anything other than the
glossary, bare URLs and HTML, and without the opening's **Words** paragraph, which is the
notebook's index of glossary words rather than prose. A word inside an inline code span counts
(`torch.no_grad()` uses *no_grad*): its link then wraps the whole span. The first of all uses and
glossary links of a word, in cell order, must be a link to that word's entry.
"""

import re
from pathlib import Path

import nbformat
import pytest

from labkit import notebooks

pytestmark = pytest.mark.lock_only  # repo text (glossary links in the notebooks' markdown): the same on every stack

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "notebooks" / "GLOSSARY.md"
NOTEBOOKS = notebooks.workbook_notebooks(ROOT / "notebooks")

# The forms in which the notebooks write each glossary word (regular expressions, matched as
# whole words, case-insensitively, with an optional plural ending). A heading that joins two
# words ("train and eval mode") is used by either of them.
FORMS = {
    "activation checkpointing": [r"activation checkpointing"],
    "all-reduce": [r"all-reduce", r"all_reduce", r"allreduce"],
    "autocast": [r"autocast"],
    "autograd graph": [r"autograd graph", r"computation graph", r"computational graph"],
    "batch statistics": [r"batch statistics"],
    "dead unit": [r"dead unit", r"dead ReLU"],
    "fake tensor": [r"fake tensor"],
    "float64 reference": [r"float64 reference"],
    "global batch": [r"global batch"],
    "gloo": [r"gloo"],
    "grad_fn": [r"grad_fn"],
    "gradient accumulation": [r"gradient accumulation"],
    "gradient clipping": [r"gradient clipping"],
    "gradient noise": [r"gradient noise"],
    "hook": [r"hook"],
    "identity path": [r"identity path"],
    "in-place operation": [r"in-place operation", r"in-place op"],
    "leaf tensor": [r"leaf tensor", r"leaf"],
    "loss reduction": [r"loss reduction"],
    "loss scale": [r"loss scale", r"loss scaling"],
    "micro-batch": [r"micro-batch"],
    "no_grad and inference_mode": [r"no_grad", r"inference_mode", r"inference mode"],
    "packed sequence": [r"packed sequence"],
    "parameter group": [r"parameter group", r"param group"],
    "peak memory": [r"peak memory"],
    "pre-activation and post-activation": [r"pre-activation", r"post-activation"],
    "random generator state": [r"random generator state", r"generator state", r"RNG state"],
    "rank and world size": [r"rank", r"world size", r"world_size"],
    "reparameterisation": [r"reparameteri[sz]ation"],
    "running statistics": [r"running statistics", r"running stats"],
    "saved tensor": [r"saved tensor"],
    "subgradient": [r"subgradient"],
    "subnormal": [r"subnormal"],
    "train and eval mode": [r"train and eval mode", r"train mode", r"training mode", r"eval mode",
                            r"evaluation mode"],
    "underflow": [r"underflow"],
    "update to data ratio": [r"update[ -]to[ -]data ratio", r"update:data ratio", r"update:data"],
    "vanishing and exploding gradients": [r"vanishing (?:and|or) exploding gradient", r"vanishing gradient",
                                          r"exploding gradient"],
    "verdict": [r"verdict"],
    "version counter": [r"version counter"],
    "weight decay": [r"weight decay"],
    "worker": [r"worker"],
}

CODE_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
IMAGE = re.compile(r"!\[[^\]]*\]\([^)]*\)")
LINK = re.compile(r"\[((?:`[^`\n]*`|[^\]`])+)\]\(([^)\s]+)\)")
URL_OR_HTML = re.compile(r"https?://\S+|<[^>\n]+>")
CODE_SPAN = re.compile(r"`[^`\n]+`")


def glossary_headings():
    return re.findall(r"^### (.+)$", GLOSSARY.read_text(), flags=re.M)


def anchor(heading):
    """The id JupyterLab and GitHub both give a lowercase heading without punctuation."""
    return heading.replace(" ", "-")


ANCHORS = {anchor(h): h for h in glossary_headings()}


def form_pattern(heading):
    forms = "|".join(FORMS[heading])
    return re.compile(rf"(?<![\w-])(?:{forms})(?:e?s)?(?![\w-])", re.I)


def _blank(text, start, end):
    return text[:start] + re.sub(r"[^\n]", " ", text[start:end]) + text[end:]


def prose(source):
    """(masked text, glossary links) of one markdown cell.

    The masked text keeps every character's position; what is not prose is blanked. Glossary links
    are (start, end, anchor) and are blanked too.
    """
    text = source
    for pattern in (CODE_FENCE, IMAGE):
        for m in pattern.finditer(source):
            text = _blank(text, *m.span())
    for m in re.finditer(r"^#.*$", source, flags=re.M):  # headings
        text = _blank(text, *m.span())
    words = re.search(r"^\*\*Words\*\*.*?(?=\n\s*\n|\Z)", source, flags=re.M | re.S)
    if words:
        text = _blank(text, *words.span())
    links = []
    for m in LINK.finditer(text):
        path, _, fragment = m.group(2).partition("#")
        if path == "GLOSSARY.md" and fragment:
            links.append((m.start(), m.end(), fragment))
        text = _blank(text, *m.span())
    for m in URL_OR_HTML.finditer(text):
        text = _blank(text, *m.span())
    return text, links


def uses(source, heading):
    """(start, end) of each use of a glossary word in one cell's prose; a use inside a code span spans the span."""
    text, _ = prose(source)
    spans = [m.span() for m in CODE_SPAN.finditer(text)]
    found = []
    for m in form_pattern(heading).finditer(text):
        inside = next((s for s in spans if s[0] <= m.start() and m.end() <= s[1]), None)
        found.append(inside or m.span())
    return found


def first_unlinked_uses(nb):
    """{heading: (cell index, text)} for each glossary word whose first use in `nb` is not a link to its entry."""
    markdown = [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "markdown"]
    missing = {}
    for heading in FORMS:
        events = []
        for i, source in markdown:
            _, links = prose(source)
            events += [(i, start, "link") for start, _, frag in links if frag == anchor(heading)]
            events += [(i, start, source[start:end]) for start, end in uses(source, heading)]
        if events:
            i, _, what = min(events)
            if what != "link":
                missing[heading] = (i, " ".join(what.split()))
    return missing


@pytest.fixture(params=NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def nb_path(request):
    return request.param


def test_every_glossary_heading_has_its_forms_and_back():
    assert sorted(FORMS) == sorted(ANCHORS.values()), "FORMS lists exactly the glossary's headings"


def test_every_link_to_the_glossary_finds_its_entry(nb_path):
    nb = nbformat.read(nb_path, as_version=4)
    targets = [m.group(2) for c in nb.cells if c.cell_type == "markdown" for m in LINK.finditer(c.source)]
    inside = [m.group(2) for m in LINK.finditer(GLOSSARY.read_text())]
    broken = [t for t in targets if t.startswith("GLOSSARY.md#") and t.partition("#")[2] not in ANCHORS]
    broken += [t for t in inside if t.startswith("#") and t[1:] not in ANCHORS]
    assert not broken, f"links to no glossary entry: {broken}; the anchors are {sorted(ANCHORS)}"


def test_each_glossary_word_is_linked_where_the_notebook_first_uses_it(nb_path):
    missing = first_unlinked_uses(nbformat.read(nb_path, as_version=4))
    assert not missing, "link the first use of these words to GLOSSARY.md#<entry>: " + "; ".join(
        f"{h!r} in cell {i} ({text!r})" for h, (i, text) in missing.items())


def _notebook(*sources):
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(s) for s in sources])


def test_the_check_finds_an_unlinked_first_use_and_accepts_a_linked_one():
    unlinked = _notebook("# 99 · Title with a hook\n\nThe **Words**: none.",
                         "Training uses `register_hook`, then hooks.", "A [hook](GLOSSARY.md#hook).")
    assert first_unlinked_uses(unlinked) == {"hook": (1, "hooks")}
    linked = _notebook("A [hook](GLOSSARY.md#hook) first.", "Then Hooks again, and a verdict in `verdict=x`.")
    assert first_unlinked_uses(linked) == {"verdict": (1, "verdict")}
    words_only = _notebook("**Words** this uses: [hook](GLOSSARY.md#hook).\n\nThe hook fires.")
    assert first_unlinked_uses(words_only) == {"hook": (0, "hook")}, "the Words index is not the first use"
    other_link = _notebook("[docs on hooks](https://pytorch.org/docs) and `x.grad_fn`.")
    assert first_unlinked_uses(other_link) == {"grad_fn": (0, "`x.grad_fn`")}
    not_a_use = _notebook("A non-leaf tensor, `a_hook`, pre-activations.\n\n```\nhook\n```")
    assert set(first_unlinked_uses(not_a_use)) == {"pre-activation and post-activation"}
