"""labkit.figures: every figure a notebook shows carries alt text, in its HTML and its plain view."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from kernel_facts import FIGURE  # noqa: E402

from labkit import LabkitError, figures  # noqa: E402


@pytest.fixture
def labelled():
    figure, (left, right) = plt.subplots(1, 2)
    left.plot([1, 2], label="one process")
    left.plot([1, 2], label="two ranks")
    left.set(title="loss", xlabel="step", ylabel="training loss", yscale="log")
    left.legend()
    right.bar([0, 1], [3, 4])
    yield figure
    plt.close(figure)


def test_alt_text_is_read_off_the_panels(labelled):
    assert figures.alt_text(labelled) == ("Figure with 2 panels: 'loss', training loss (log scale) against step, "
                                          "lines: one process, two ranks.")


def test_describe_overrides_and_checks_its_input(labelled):
    assert figures.describe(labelled, " Both curves coincide. ") is labelled
    assert figures.alt_text(labelled) == "Both curves coincide."
    with pytest.raises(LabkitError, match="non-empty alt text"):
        figures.describe(labelled, " ")
    with pytest.raises(LabkitError, match="matplotlib Figure"):
        figures.describe("not a figure", "x")


def test_an_installed_shell_shows_a_figure_as_an_img_with_alt(labelled):
    shell = InteractiveShell.instance()
    assert figures.install(shell)
    bundle, _ = shell.display_formatter.format(figures.describe(labelled, 'a "quoted" <b>curve</b>'))
    assert bundle["text/plain"] == 'a "quoted" <b>curve</b>'
    html = bundle["text/html"]
    assert html.startswith('<img src="data:image/png;base64,iVBOR')
    assert 'alt="a &quot;quoted&quot; &lt;b&gt;curve&lt;/b&gt;"' in html


def test_install_outside_ipython_does_nothing():
    InteractiveShell.clear_instance()
    assert figures.install() is False


def test_a_notebook_stores_each_figure_with_its_alt_text(kernel_facts):
    # In a real kernel the inline backend loads at the first figure and clears Figure formatters:
    # setup must still leave every figure shown with its alt text, the first one included. The figure
    # cell of the session's kernel-facts notebook draws the kernel's first figure, after repro.setup.
    stored = kernel_facts.cell(FIGURE).outputs[0]["data"]
    assert "".join(stored["text/plain"]) == "a rising line"
    assert 'alt="a rising line"' in "".join(stored["text/html"]) and "image/png" in stored


def test_an_unlabelled_x_axis_is_not_named():
    figure, axis = plt.subplots()
    axis.bar(["a", "b"], [1, 2])
    axis.set_ylabel("MiB")
    assert figures.alt_text(figure) == "Figure with 1 panel: MiB."
    plt.close(figure)
