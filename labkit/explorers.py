"""Explorers: move a control, and the measurement is redrawn in place.

`explore(view, **controls)` calls `view(**values)` once with each control's default and shows what
it printed and the matplotlib Figure it returned, with ipywidgets controls above. Moving a control
in JupyterLab calls the view again and replaces that view in place (through display ids, so there is
never a second copy of the view). Run headless (papermill, nbval, `python -m labkit execute`), the
same call stores the default view as ordinary outputs: text that nbval compares, a PNG it skips,
and a one-line text fallback for the controls. A view that raises on a moved control shows its
traceback in place of the view, marked in the output's metadata under `ERROR_METADATA_KEY` so
the browser test can tell it from a warning on stderr.

    from labkit import explorers

    def view(lr, steps):
        figure, axis = plt.subplots()
        ...
        print(f"final loss {loss:.3g}")
        return figure  # return it; do not call plt.show()

    explorers.explore(view, lr=explorers.slider(0.05, 0.005, 0.2, 0.005, label="learning rate"),
                      steps=explorers.slider(30, 10, 120, 10))

Used in 00_start_here (learning rate and steps against the loss with and without `zero_grad`),
04_autograd_modes (extra padding and packing against an LSTM's final hidden state) and
12_batch_size (batch size against gradient noise).
"""

from __future__ import annotations

import base64
import contextlib
import inspect
import io
import math
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal

from labkit.errors import LabkitError
from labkit.figures import alt_text, img_tag

__all__ = ["choice", "explore", "slider"]

ERROR_METADATA_KEY = "labkit_explorer_error"
STDERR_MIME = "application/vnd.jupyter.stderr"
SEPARATOR = " · "


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _decimals(value: float) -> int:
    """Digits after the point in the shortest repr of `value` (0.005 -> 3, 10 -> 0)."""
    exponent = Decimal(repr(value)).normalize().as_tuple().exponent
    return max(0, -int(exponent))


@dataclass(frozen=True)
class Slider:
    """A numeric control from `slider()`: an IntSlider when every number is an int, else a FloatSlider."""

    default: float
    low: float
    high: float
    step: float
    label: str | None = None

    @property
    def decimals(self) -> int:
        return max(_decimals(v) for v in (self.low, self.step, self.default))

    @property
    def integer(self) -> bool:
        return all(isinstance(v, int) for v in (self.default, self.low, self.high, self.step))

    def widget(self, name: str):
        import ipywidgets

        common = dict(value=self.default, min=self.low, max=self.high, step=self.step,
                      description=self.label or name, continuous_update=False,
                      style={"description_width": "initial"})
        if self.integer:
            return ipywidgets.IntSlider(**common)
        return ipywidgets.FloatSlider(readout_format=f".{self.decimals}f", **common)

    def value_of(self, raw: float) -> float:
        """The slider's value on the grid: the browser computes low + k * step in floating point."""
        return int(raw) if self.integer else round(float(raw), self.decimals)

    def describe(self, name: str) -> str:
        return f"{self.label or name} {self.low:g} to {self.high:g} in steps of {self.step:g}"


@dataclass(frozen=True)
class Choice:
    """A control from `choice()`: one of a few values, in a dropdown."""

    default: object
    options: tuple
    label: str | None = None

    def widget(self, name: str):
        import ipywidgets

        return ipywidgets.Dropdown(options=[(str(o), o) for o in self.options], value=self.default,
                                   description=self.label or name, style={"description_width": "initial"})

    def value_of(self, raw: object) -> object:
        return raw

    def describe(self, name: str) -> str:
        return f"{self.label or name} one of {', '.join(map(str, self.options))}"


def slider(default: float, low: float, high: float, step: float | None = None, label: str | None = None) -> Slider:
    """A slider from `low` to `high` in steps of `step` (1 for ints, else required), starting at `default`."""
    numbers = {"default": default, "low": low, "high": high} | ({} if step is None else {"step": step})
    for name, value in numbers.items():
        if not _is_number(value) or not math.isfinite(value):
            raise LabkitError(f"slider {name} must be a finite int or float, got {value!r}")
    if step is None:
        if not all(isinstance(v, int) for v in numbers.values()):
            raise LabkitError(f"slider({default!r}, {low!r}, {high!r}) with float values needs step=, e.g. step=0.01")
        step = numbers["step"] = 1
    if not low < high:
        raise LabkitError(f"slider needs low < high, got low={low!r}, high={high!r}")
    if step <= 0 or step > high - low:
        raise LabkitError(f"slider step must be above 0 and at most high - low ({high - low:g}), got {step!r}")
    if not low <= default <= high:
        raise LabkitError(f"slider default {default!r} is outside [{low!r}, {high!r}]")
    for name in ("default", "high"):
        steps_from_low = (numbers[name] - low) / step
        if abs(steps_from_low - round(steps_from_low)) > 1e-9:
            raise LabkitError(f"slider {name} {numbers[name]!r} is not on the grid {low!r} + k * {step!r}; "
                              f"pick a {name} the slider can reach")
    return Slider(default, low, high, step, label)


def choice(default: object, options: Sequence, label: str | None = None) -> Choice:
    """A dropdown of `options` (shown with `str`), starting at `default`."""
    if isinstance(options, (str, bytes)) or not isinstance(options, Sequence):
        raise LabkitError(f"choice options must be a list or tuple of values, got {options!r}")
    options = tuple(options)
    if len(options) < 2:
        raise LabkitError(f"choice needs at least two options to choose from, got {list(options)!r}")
    if len({str(o) for o in options}) != len(options):
        raise LabkitError(f"choice options must read differently, got {list(map(str, options))}")
    if default not in options:
        raise LabkitError(f"choice default {default!r} is not one of the options {list(options)!r}")
    return Choice(default, options, label)


@dataclass
class Rendering:
    """One drawn state of a view: the values, what it printed, and its figure as PNG (or None)."""

    values: dict
    text: str
    png: bytes | None = None
    figure_text: str = ""

    @property
    def label(self) -> str:
        return _label(self.values)


class Explorer:
    """A view and its controls. `explore()` builds and shows one; tests drive one directly.

    `controls` maps each keyword argument of `view` to a `slider()` or `choice()`; every argument of
    the view without a default needs one.
    """

    def __init__(self, view: Callable, controls: Mapping[str, Slider | Choice]):
        if not callable(view):
            raise LabkitError(f"explore's view must be a function taking the controls as keywords, got {view!r}")
        if not controls:
            raise LabkitError("explore needs at least one control, e.g. lr=explorers.slider(0.05, 0.01, 0.2, 0.01)")
        for name, spec in controls.items():
            if not isinstance(spec, (Slider, Choice)):
                raise LabkitError(f"control {name}={spec!r} is not a control: use explorers.slider(default, low, "
                                  "high, step) or explorers.choice(default, options)")
        _check_view_accepts(view, controls)
        self.view = view
        self.specs = dict(controls)
        self.controls = {name: spec.widget(name) for name, spec in self.specs.items()}
        self.defaults = {name: spec.default for name, spec in self.specs.items()}
        self._text_handle = None
        self._figure_handle = None

    @property
    def values(self) -> dict:
        """The controls' current values, as the view receives them."""
        return {name: self.specs[name].value_of(widget.value) for name, widget in self.controls.items()}

    def render(self, values: Mapping) -> Rendering:
        """Call the view with `values`; capture what it prints and the Figure it returns."""
        import matplotlib.pyplot as plt
        from matplotlib.figure import Figure

        open_before = set(plt.get_fignums())
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                figure = self.view(**values)
            if figure is not None and not isinstance(figure, Figure):
                raise LabkitError(f"the view returned {type(figure).__name__}; return a matplotlib Figure, or "
                                  "None when it only prints")
            png = figure_text = None
            if figure is not None:
                buffer = io.BytesIO()
                figure.savefig(buffer, format="png", bbox_inches="tight")
                png, figure_text = buffer.getvalue(), alt_text(figure)
        finally:
            # A figure left open would be drawn again by the inline backend after the next cell runs.
            for number in set(plt.get_fignums()) - open_before:
                plt.close(number)
        return Rendering(dict(values), printed.getvalue(), png, figure_text or "")

    def show(self) -> None:
        """Display the controls, then the default view; moving a control redraws the view in place."""
        import ipywidgets
        from IPython.display import display

        # The default view is drawn first: a view that fails fails the cell, before any widget exists.
        rendering = self.render(self.defaults)
        box = ipywidgets.VBox(list(self.controls.values()))
        # The widget's own display bundle, with a text fallback that says what the controls are: a
        # notebook opened before it runs, and nbval, see this text instead of the widget.
        bundle = box._repr_mimebundle_()
        bundle["text/plain"] = "explorer controls: " + "; ".join(
            spec.describe(name) for name, spec in self.specs.items()) + " (run this cell in JupyterLab to move them)"
        display(bundle, raw=True)
        self._text_handle = display(_text_bundle(rendering, default=True), raw=True, display_id=True)
        if rendering.png is not None:
            self._figure_handle = display(_figure_bundle(rendering), raw=True, display_id=True)
        for widget in self.controls.values():
            widget.observe(self._redraw, names="value")

    def _redraw(self, change=None) -> None:
        values = self.values
        try:
            rendering = self.render(values)
            if rendering.png is not None and self._figure_handle is None:
                raise LabkitError("the view returned a Figure for these values but none for the defaults; "
                                  "return a Figure for every value, or for none")
        except Exception as error:
            # A callback's exception would otherwise go only to the kernel's log: show it where the view was.
            self._show_error(values, error)
            return
        # Empty metadata replaces an error mark a failed redraw may have left.
        self._text_handle.update(_text_bundle(rendering, default=False), raw=True, metadata={})
        if self._figure_handle is not None:
            bundle = _figure_bundle(rendering) if rendering.png is not None else {
                "text/plain": f"(the view drew no figure for {rendering.label})"}
            self._figure_handle.update(bundle, raw=True)

    def _show_error(self, values: Mapping, error: Exception) -> None:
        label = _label(values)
        summary = f"{type(error).__name__}: {error}"
        text = f"{label}: the view raised {summary}\n" + "".join(
            traceback.format_exception(type(error), error, _frames_outside_labkit(error.__traceback__)))
        self._text_handle.update({STDERR_MIME: text, "text/plain": text}, raw=True,
                                 metadata={ERROR_METADATA_KEY: summary})
        if self._figure_handle is not None:
            self._figure_handle.update({"text/plain": "(no figure: the view raised an error)"}, raw=True)


def _label(values: Mapping) -> str:
    """`lr=0.05 · steps=30`: which state a view shows, the first line of its text."""
    return SEPARATOR.join(f"{name}={value!r}" for name, value in values.items())


def _frames_outside_labkit(frames):
    """The traceback from the first frame that is not this module's: the learner's view, not the plumbing."""
    while frames is not None and frames.tb_frame.f_code.co_filename == __file__:
        frames = frames.tb_next
    return frames


def _text_bundle(rendering: Rendering, default: bool) -> dict:
    heading = rendering.label + (" (the defaults; move the controls above to redraw)" if default else "")
    return {"text/plain": f"{heading}\n{rendering.text}".rstrip("\n")}


def _figure_bundle(rendering: Rendering) -> dict:
    """The PNG, and an ``<img>`` of it with the figure's alt text (the view JupyterLab and nbconvert pick)."""
    return {"image/png": base64.b64encode(rendering.png).decode("ascii"), "text/plain": rendering.figure_text,
            "text/html": img_tag(rendering.png, rendering.figure_text)}


def _check_view_accepts(view: Callable, controls: Mapping) -> None:
    """Every control names a parameter of the view, and every parameter without a default has a control."""
    try:
        parameters = inspect.signature(view).parameters
    except (TypeError, ValueError) as error:
        raise LabkitError(f"cannot read the parameters of the view {view!r}: {error}") from error
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    named = [name for name, p in parameters.items()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    unknown = sorted(set(controls) - set(named)) if not takes_any else []
    required = sorted(name for name in named if parameters[name].default is inspect.Parameter.empty
                      and name not in controls)
    if unknown or required:
        problems = ([f"the view takes no parameter {', '.join(unknown)}"] if unknown else []) + (
            [f"no control for the view's parameter {', '.join(required)}"] if required else [])
        raise LabkitError(f"{'; '.join(problems)}; the view's parameters are {', '.join(named) or 'none'}")


def explore(view: Callable, **controls: Slider | Choice) -> None:
    """Show `view` with one control per keyword: `explore(view, lr=slider(0.05, 0.005, 0.2, 0.005))`."""
    Explorer(view, controls).show()
