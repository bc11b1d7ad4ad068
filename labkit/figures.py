"""Figures with alternative text: every matplotlib figure a notebook shows carries a description.

JupyterLab and nbconvert draw a figure's ``image/png`` as an ``<img>`` without ``alt``, so a screen
reader, a broken image or a text-only view gets nothing. Once `labkit.repro.setup` has run (every
notebook calls it), a figure is also shown as HTML (``<img alt=...>``, which both JupyterLab and
nbconvert prefer to the bare PNG) and its plain-text view is the same description instead of
``<Figure size 640x480 with 1 Axes>``. `describe(figure, alt)` sets the description; without one it
is read off the figure: each panel's title, axis labels and legend. Used in ``15_distributed``.
"""

from __future__ import annotations

import base64
import html
import io
import weakref

from labkit.errors import LabkitError

__all__ = ["alt_text", "describe"]

_descriptions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def describe(figure, alt: str):
    """Give ``figure`` the alternative text ``alt`` (what it shows and what to read off it); returns the figure."""
    from matplotlib.figure import Figure

    if not isinstance(figure, Figure):
        raise LabkitError(f"describe() takes a matplotlib Figure, got {type(figure).__name__}; "
                          "pass the figure from plt.subplots()")
    if not isinstance(alt, str) or not alt.strip():
        raise LabkitError("describe() needs a non-empty alt text: say what the figure shows in a sentence")
    _descriptions[figure] = alt.strip()
    return figure


def alt_text(figure) -> str:
    """The figure's description: the one `describe` gave it, else one read off its panels."""
    if figure in _descriptions:
        return _descriptions[figure]
    shown = [axes for axes in figure.get_axes() if axes.get_visible() and axes.axison]
    panels = [text for text in map(_panel_text, shown) if text]
    title = figure.get_suptitle()
    head = f"Figure: {title}" if title else f"Figure with {len(shown)} panel{'s' if len(shown) != 1 else ''}"
    return head + (": " + "; ".join(panels) if panels else "") + "."


def _panel_text(axes) -> str:
    parts = []
    if axes.get_title():
        parts.append(repr(axes.get_title()))
    ylabel, xlabel = axes.get_ylabel(), axes.get_xlabel()
    if ylabel or xlabel:
        scale = " (log scale)" if axes.get_yscale() == "log" else ""
        parts.append(f"{ylabel or 'value'}{scale}" + (f" against {xlabel}" if xlabel else ""))
    legend = axes.get_legend()
    if legend is not None:
        labels = [text.get_text() for text in legend.get_texts()]
        parts.append("lines: " + ", ".join(labels))
    return ", ".join(parts)


def figure_html(figure, png: bytes | None = None) -> str:
    """The figure as an ``<img>`` holding its PNG, with `alt_text` as ``alt`` and as a hover title."""
    if png is None:
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", bbox_inches="tight")
        png = buffer.getvalue()
    return img_tag(png, alt_text(figure))


def img_tag(png: bytes, alt: str) -> str:
    """An ``<img>`` that holds ``png`` inline, with ``alt`` as its alternative text and hover title."""
    data = base64.b64encode(png).decode("ascii")
    alt = html.escape(alt, quote=True)
    return f'<img src="data:image/png;base64,{data}" alt="{alt}" title="{alt}"/>'


INLINE_BACKEND = "module://matplotlib_inline.backend_inline"


def _load_inline_backend() -> None:
    """Load the notebook's inline backend now, if it is the one configured: when it loads (lazily,
    at the first figure) it clears every display formatter registered for Figure, ours included."""
    import matplotlib

    if matplotlib.get_backend(auto_select=False) in ("inline", INLINE_BACKEND):
        import matplotlib_inline.backend_inline  # noqa: F401  (importing it configures the shell)


def install(shell=None) -> bool:
    """Show every matplotlib figure with its alt text in this IPython session; False outside IPython."""
    try:
        from IPython import get_ipython
        from matplotlib.figure import Figure
    except ImportError:  # labkit works without IPython: then nothing is displayed
        return False
    shell = shell or get_ipython()
    if shell is None:
        return False
    _load_inline_backend()
    formatters = shell.display_formatter.formatters
    formatters["text/html"].for_type(Figure, figure_html)
    formatters["text/plain"].for_type(Figure, lambda figure, printer, cycle: printer.text(alt_text(figure)))
    return True
