"""Prose that quotes the stored run's numbers quotes them right.

A few markdown cells say what a measurement printed ("in the stored run ..."), because the point
of the paragraph is the number: 05's seed-by-seed gain of eval mode, 09's gradient growth along
depth (08's order of the early signals is stated without its steps, which the table prints). Each test reads the stored notebook, takes the numbers
from the output of the cell that printed them, and checks that the paragraph quotes those numbers;
a re-run that moves them fails here until the prose is brought in line.
"""

import re
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.lock_only  # repo text (prose against the stored outputs): the same on every stack

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def cells(name):
    return nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4).cells


def output_of(name, marker):
    """The printed text of the one code cell whose source contains `marker`."""
    found = [c for c in cells(name) if c.cell_type == "code" and marker in c.source]
    assert len(found) == 1, f"{name}: expected one code cell containing {marker!r}, found {len(found)}"
    return "".join(o.get("text", "") for o in found[0].outputs if o.output_type == "stream")


def paragraph(name, start):
    found = [c.source for c in cells(name) if c.cell_type == "markdown" and start in c.source]
    assert len(found) == 1, f"{name}: expected one markdown cell containing {start!r}"
    return " ".join(found[0].split())


def test_05_prose_quotes_the_gain_of_eval_mode_seed_by_seed():
    printed = output_of("05_batchnorm_finetuning", "gain_per_seed = ")
    train = re.search(r"backbone in train mode: seed \d+ accuracy ([\d.]+)%.*max ([\d.]+)%\)", printed)
    evaluation = re.search(r"backbone in eval mode: seed \d+ accuracy ([\d.]+)%.*\(min ([\d.]+)%", printed)
    gains = re.search(r"seed by seed: ([^;]+); mean \+([\d.]+)%", printed)
    assert train and evaluation and gains, printed
    per_seed = [g.strip().lstrip("+").rstrip("%") for g in gains.group(1).split(",")]
    text = paragraph("05_batchnorm_finetuning", "Read the mean, not seed 0 alone.")
    assert f"{train.group(1)}% in train mode against {evaluation.group(1)}% in eval mode" in text
    assert f"by {', '.join(per_seed[:-1])} and {per_seed[-1]} points, {gains.group(2)} points on average" in text
    assert f"worst seed ({evaluation.group(2)}%)" in text and f"best ({train.group(2)}%)" in text
    assert min(float(g) for g in per_seed) == float(per_seed[0]), "the prose says seed 0 gains least"


def test_08_prose_leaves_the_steps_to_the_table_and_says_what_it_shows():
    # the steps move with the parameters and the device, so the paragraph names none; what it says of
    # them must hold in the stored run, which nbval proves fresh
    printed = output_of("08_gradient_health", "first_step_over(run_ratio, TOO_FAST)")
    steps = {name: int(step) for step, name in re.findall(r"step +(\d+): ([^,\n]+)", printed)}
    ratio = next(s for n, s in steps.items() if n.startswith("update:data over"))
    plateau = next(s for n, s in steps.items() if n.startswith("update:data past"))
    loss, exploding = steps["loss alarm"], steps["tracer's 'exploding' alert"]
    text = paragraph("08_gradient_health", "**What fires first, and by how much.**")
    assert not re.search(r"\bstep \d+|\d+ steps", text), "the table gives the steps, not the prose"
    assert "both can show that growth long before the loss does" in text and max(ratio, plateau) < loss
    assert "after the loss alarm at the defaults" in text and exploding > loss


@pytest.mark.parametrize(("design", "said"), [("post-activation", "300x"), ("pre-activation", "100x")])
def test_09_prose_quotes_the_gradient_growth_along_depth(design, said):
    printed = output_of("09_residual_design", "first block {norms[0] / norms[-1]:.0f}x")
    growth = re.search(rf"{design}: first block (\d+)x the top's gradient norm, ([\d.]+)x per block", printed)
    assert growth, printed
    text = paragraph("09_residual_design", "Nor is it weaker: it is *stronger*.")
    assert abs(int(growth.group(1)) - int(said[:-1])) <= 0.1 * int(said[:-1]), (design, growth.group(1), said)
    assert f"{said} ({design})" in text
    assert f"about {float(growth.group(2)):.2f}x per block {design}" in text or \
        f"{float(growth.group(2)):.2f}x {design}" in text
