"""labkit.explorers: the default view is drawn, a moved control redraws it in place, bad specs are refused.

The in-process tests run the explorer under a real IPython shell whose display publisher records
every output (what a kernel would send); the last test runs one in a real kernel through nbclient,
which applies display updates to the stored outputs as JupyterLab does on screen.
"""

import sys

import matplotlib
import matplotlib.pyplot as plt
import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output
from kernel_facts import EXPLORER, EXPLORER_MOVE
from traitlets.config import Config

from labkit import LabkitError, explorers

matplotlib.use("Agg")

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


@pytest.fixture
def shell():
    """An IPython shell for display(); it replaces sys.modules['__main__'], which is put back after.
    No figure is open at the start: the tests count the figures a view leaves open, and other test
    files sharing this process (pytest-xdist) may have left theirs."""
    plt.close("all")
    main, displayhook = sys.modules["__main__"], sys.displayhook
    config = Config()
    config.HistoryManager.enabled = False
    yield InteractiveShell.instance(config=config)
    InteractiveShell.clear_instance()
    sys.modules["__main__"], sys.displayhook = main, displayhook


def line_view(calls):
    """A view that prints and plots `slope * x` and records each call."""
    def view(slope, points=3, style="solid"):
        calls.append({"slope": slope, "points": points, "style": style})
        figure, axis = plt.subplots()
        axis.plot(range(points), [slope * x for x in range(points)], linestyle=style)
        print(f"last value {slope * (points - 1):.2f}")
        return figure
    return view


def shown(view, **controls):
    """Build and show an explorer; returns it and the outputs it published so far (a live list)."""
    explorer = explorers.Explorer(view, controls)
    with capture_output() as captured:
        explorer.show()
    return explorer, captured


def test_show_publishes_controls_then_the_default_view(shell):
    calls = []
    explorer, captured = shown(line_view(calls), slope=explorers.slider(0.5, 0.1, 1.0, 0.1),
                               points=explorers.slider(3, 2, 10))
    controls, text, figure = captured.outputs
    assert calls == [{"slope": 0.5, "points": 3, "style": "solid"}]
    assert WIDGET_MIME in controls.data
    assert controls.data["text/plain"] == ("explorer controls: slope 0.1 to 1 in steps of 0.1; points 2 to 10 in "
                                           "steps of 1 (run this cell in JupyterLab to move them)")
    assert text.data == {"text/plain": "slope=0.5 · points=3 (the defaults; move the controls above to redraw)\n"
                                       "last value 1.00"}
    assert figure.data["text/plain"] == "Figure with 1 panel."
    assert figure.data["text/html"].endswith('alt="Figure with 1 panel." title="Figure with 1 panel."/>')
    assert figure.data["image/png"].startswith("iVBOR")  # base64 of the PNG signature
    assert text.transient["display_id"] != figure.transient["display_id"]
    assert not any(o.update for o in captured.outputs)
    assert plt.get_fignums() == [], "the rendered figure was closed, so the inline backend cannot draw it twice"


def test_moving_a_control_redraws_the_view_in_place(shell):
    calls = []
    explorer, captured = shown(line_view(calls), slope=explorers.slider(0.5, 0.1, 1.0, 0.1),
                               style=explorers.choice("solid", ["solid", "dashed"]))
    _, text, figure = captured.outputs
    with capture_output() as moved:
        # What the browser sends for 0.1 + 6 * 0.1: the view gets the value on the slider's grid.
        explorer.controls["slope"].value = 0.7000000000000001
        explorer.controls["style"].value = "dashed"
    assert calls[1:] == [{"slope": 0.7, "points": 3, "style": "solid"}, {"slope": 0.7, "points": 3, "style": "dashed"}]
    assert [o.update for o in moved.outputs] == [True] * 4
    assert [o.transient["display_id"] for o in moved.outputs] == [text.transient["display_id"],
                                                                   figure.transient["display_id"]] * 2
    assert moved.outputs[-2].data == {"text/plain": "slope=0.7 · style='dashed'\nlast value 1.40"}
    assert moved.outputs[-1].data["image/png"] != figure.data["image/png"]
    assert explorer.values == {"slope": 0.7, "style": "dashed"}


def test_a_view_that_raises_on_a_moved_control_shows_its_traceback_in_place(shell):
    def view(n):
        if n > 3:
            raise ValueError(f"n={n} is broken on purpose")
        print(f"n squared is {n * n}")

    explorer, captured = shown(view, n=explorers.slider(2, 1, 5))
    assert len(captured.outputs) == 2, "a view that draws no figure gets no figure output"
    with capture_output() as moved:
        explorer.controls["n"].value = 4
        explorer.controls["n"].value = 3
    broken, healed = moved.outputs
    text = broken.data[explorers.STDERR_MIME]
    assert broken.metadata == {explorers.ERROR_METADATA_KEY: "ValueError: n=4 is broken on purpose"}
    assert text.startswith("n=4: the view raised ValueError: n=4 is broken on purpose\nTraceback")
    assert "in view" in text and "labkit/explorers.py" not in text, "the traceback starts at the learner's view"
    assert healed.metadata == {} and healed.data == {"text/plain": "n=3\nn squared is 9"}


def test_a_view_that_fails_for_the_defaults_fails_the_cell_before_any_widget_is_shown(shell):
    def view(n):
        raise ValueError("fails for every value")

    explorer = explorers.Explorer(view, {"n": explorers.slider(2, 1, 5)})
    with capture_output() as captured, pytest.raises(ValueError, match="fails for every value"):
        explorer.show()
    assert captured.outputs == []


def test_a_view_must_return_a_figure_or_none(shell):
    explorer = explorers.Explorer(lambda n: "a string", {"n": explorers.slider(2, 1, 5)})
    with pytest.raises(LabkitError, match="the view returned str; return a matplotlib Figure"):
        explorer.render({"n": 2})


def test_figures_the_view_opens_but_does_not_return_are_closed(shell):
    def view(n):
        plt.figure()
        print(n)

    explorers.Explorer(view, {"n": explorers.slider(2, 1, 5)}).render({"n": 2})
    assert plt.get_fignums() == []


def test_a_figure_for_some_values_only_is_reported_in_place(shell):
    def view(n):
        return plt.figure() if n > 2 else None

    explorer, _ = shown(view, n=explorers.slider(2, 1, 5))
    with capture_output() as moved:
        explorer.controls["n"].value = 3
    (error,) = moved.outputs
    assert "but none for the defaults" in error.metadata[explorers.ERROR_METADATA_KEY]


def test_sliders_are_int_or_float_as_their_numbers_are():
    integer = explorers.slider(3, 1, 9).widget("n")
    fraction = explorers.slider(0.05, 0.005, 0.2, 0.005).widget("lr")
    assert type(integer).__name__ == "IntSlider" and type(fraction).__name__ == "FloatSlider"
    assert fraction.readout_format == ".3f", "the readout shows every digit of the step"
    assert not integer.continuous_update, "the view redraws on release, not on every pixel of a drag"


@pytest.mark.parametrize("make, message", [
    (lambda: explorers.slider(0.5, 0.0, 1.0), "needs step="),
    (lambda: explorers.slider(5, 1, 1), "needs low < high"),
    (lambda: explorers.slider(5, 1, 9, 0), "step must be above 0"),
    (lambda: explorers.slider(5, 1, 9, 20), "step must be above 0 and at most high - low"),
    (lambda: explorers.slider(10, 1, 9), r"default 10 is outside \[1, 9\]"),
    (lambda: explorers.slider(0.25, 0.0, 1.0, 0.2), "default 0.25 is not on the grid"),
    (lambda: explorers.slider(0.2, 0.0, 1.1, 0.2), "high 1.1 is not on the grid"),
    (lambda: explorers.slider(True, 0, 1), "default must be a finite int or float, got True"),
    (lambda: explorers.slider(1.0, 0.0, float("inf"), 0.5), "high must be a finite"),
    (lambda: explorers.choice("a", "abc"), "must be a list or tuple"),
    (lambda: explorers.choice("a", ["a"]), "at least two options"),
    (lambda: explorers.choice(1, [1, "1"]), "must read differently"),
    (lambda: explorers.choice("c", ["a", "b"]), "default 'c' is not one of the options"),
])
def test_bad_control_specs_are_refused_with_the_reason(make, message):
    with pytest.raises(LabkitError, match=message):
        make()


def view_of(lr, steps=10):
    return None


@pytest.mark.parametrize("view, controls, message", [
    ("not callable", {"lr": explorers.slider(1, 0, 2)}, "view must be a function"),
    (view_of, {}, "at least one control"),
    (view_of, {"lr": 0.05}, r"control lr=0.05 is not a control: use explorers.slider"),
    (view_of, {"lr": explorers.slider(1, 0, 2), "momentum": explorers.slider(1, 0, 2)},
     "the view takes no parameter momentum"),
    (view_of, {"steps": explorers.slider(1, 0, 2)}, "no control for the view's parameter lr"),
])
def test_controls_must_match_the_view(view, controls, message):
    with pytest.raises(LabkitError, match=message):
        explorers.Explorer(view, controls)


def test_in_a_kernel_the_stored_view_follows_a_moved_control(kernel_facts):
    """A real kernel (the session's kernel-facts notebook, run by papermill on nbclient): explore() in one
    cell, a control moved from the next; nbclient applies the update to the first cell's stored outputs."""
    outputs = kernel_facts.cell(EXPLORER).outputs
    assert [o.output_type for o in outputs] == ["display_data"] * 3
    assert WIDGET_MIME in outputs[0].data
    assert outputs[1].data["text/plain"] == "width=5 · kind='bars'\nbars with 5 bars"
    assert "image/png" in outputs[2].data
    assert kernel_facts.cell(EXPLORER_MOVE).outputs == [], "the redraw went to the explorer's outputs, not to the cell that moved it"
