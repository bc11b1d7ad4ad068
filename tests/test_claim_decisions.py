"""The decision rules of verdicts whose deciding branch never runs on CPU CI (a GPU branch) or whose
outcomes a CPU run reaches only at one setting, called in-process with the numbers a GPU or another
setting would measure. Each rule is a function defined in its notebook; it is read from the py twin and
run alone, so no kernel starts. The papermill tests (tests/test_nbNN_*.py) show the CPU outcomes."""

import ast
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

PY_TWINS = Path(__file__).resolve().parents[1] / "notebooks" / "py"


def notebook_function(notebook: str, name: str):
    """The function `name` as the notebook's py twin defines it, compiled on its own."""
    path = next(PY_TWINS.glob(f"{notebook}_*.py"))
    tree = ast.parse(path.read_text())
    definition = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == name)
    scope: dict = {"math": math}
    exec(compile(ast.Module([definition], type_ignores=[]), str(path), "exec"), scope)
    return scope[name]


@pytest.mark.parametrize(("nodes", "slowdown", "spread", "verdict"), [
    ((127, 43), 1.18, 0.03, "partly"),  # the article's numbers: fewer nodes, 18% slower
    ((127, 43), 1.02, 0.05, "does-not-hold"),  # slower, but inside the timings' spread
    ((127, 43), 0.80, 0.02, "does-not-hold"),  # compiled is faster
    ((127, 43), 1.50, 0.40, "untestable"),  # a timing that spreads by 40% decides nothing
])
def test_a2_a_slowdown_counts_only_beyond_the_timings_spread(nodes, slowdown, spread, verdict):
    assert notebook_function("01", "a2_verdict")(*nodes, slowdown, spread) == verdict


@pytest.mark.parametrize(("checks", "verdict"), [
    ([(3, False), (3, False), (2, False)], "does-not-hold"),  # the CUDA kernel routes every gradient
    ([(3, True), (3, False), (2, False)], "holds"),  # only stride 3 loses gradient, as claimed
    ([(3, True), (2, True)], "partly"),  # gradient lost, but not because of the stride
    ([(2, True)], "partly"),
])
def test_a3_the_deciding_kernel_s_losses_decide(checks, verdict):
    assert notebook_function("01", "a3_verdict")(checks) == verdict


def test_b5_throughput_and_utilisation_alone_do_not_make_the_claim_hold():
    b5_verdict = notebook_function("02", "b5_verdict")
    # the article's table: 8x4 faster and utilisation rising; but one optimizer step per global batch
    # in every split, so no traffic is cut, and no backward near 200-500 ms to test the advice on
    verdict, parts = b5_verdict(optimizer_steps=[1, 1, 1], rates=[1240, 1320, 1280], spreads=[0.01, 0.01, 0.01],
                                usage=[68, 89, 92], micro_ms=[3.1, 0.9, 0.5])
    assert (verdict, parts) == ("partly", {"traffic cut": False, "faster, busier GPU": True})
    # a gain inside the timing spread, or utilisation the sampler could not read, is no gain
    assert b5_verdict([1, 1, 1], [1240, 1250, 1280], [0.02, 0.02, 0.02], [68, 89, 92], [3.1, 0.9, 0.5])[0] == \
        "does-not-hold"
    assert b5_verdict([1, 1, 1], [1240, 1320, 1280], [0.01] * 3, [None, None, None], [3.1, 0.9, 0.5])[0] == \
        "does-not-hold"
    # the advice is graded when some backward falls in the window: here the fastest split's does
    verdict, parts = b5_verdict([1, 1, 1], [40, 52, 48], [0.01] * 3, [68, 89, 92], [800, 250, 120])
    assert parts["200-500 ms backward fastest"] is True and verdict == "partly"
    # stepping after every micro-batch (more steps for 32x1 than for the splits) would cut traffic
    assert b5_verdict([4, 1, 1], [40, 52, 48], [0.01] * 3, [68, 89, 92], [800, 250, 120])[0] == "holds"


@pytest.mark.parametrize(("share", "verdict"), [
    (0.11, "does-not-hold"), (0.72, "partly"), (0.96, "holds"), (1.08, "holds"), (1.4, "partly"), (2.1, "does-not-hold"),
])
def test_k8_right_at_the_limit_means_within_ten_percent_of_it(share, verdict):
    assert notebook_function("13", "k8_verdict")(share) == verdict


@pytest.mark.parametrize(("plain", "checkpointed", "flop_ratio_inside"), [
    ((1.0, 0.05), (1.17, 0.05), True),  # quiet timings around the FLOP ratio
    ((1.0, 0.05), (2.0, 0.05), False),  # quiet timings far from it
    ((1.0, 2.5), (1.3, 0.4), True),  # the plain spread exceeds twice its median: unbounded above
])
def test_k4_a_plain_spread_over_twice_its_median_leaves_the_ratio_unbounded_above(plain, checkpointed,
                                                                                    flop_ratio_inside):
    ratio_range = notebook_function("16", "ratio_range")
    low, high = ratio_range(SimpleNamespace(median_s=checkpointed[0], iqr_s=checkpointed[1]),
                            SimpleNamespace(median_s=plain[0], iqr_s=plain[1]))
    assert low < high and (low <= 1.17 <= high) == flop_ratio_inside
    assert math.isinf(high) == (plain[1] >= 2 * plain[0])


@pytest.mark.parametrize(("loss_step", "parting_step", "warning_step", "verdict", "lead_cap"), [
    (461, 132, 202, "holds", 261),  # lr_cap 0.05: room for a 200-step lead, and a warning that far ahead
    (461, 132, 300, "partly", 261),  # a warning ahead of the loss, by less than 200 steps
    (461, 132, 470, "does-not-hold", 261),  # the first unshared alert comes after the loss alarm
    (461, 132, None, "does-not-hold", 261),
    (461, 389, 438, "untestable", 72),  # lr_cap 0.3: run and twin part 72 steps before the loss alarm
    (None, 132, None, "untestable", None),  # no loss alarm to lead
    (461, None, None, "untestable", None),  # bug=False: the run is its own capped twin
])
def test_l1_the_lead_is_graded_only_where_the_experiment_leaves_room_for_200_steps(
        loss_step, parting_step, warning_step, verdict, lead_cap):
    l1_verdict = notebook_function("08", "l1_verdict")
    assert l1_verdict(loss_step, parting_step, 200, warning_step)[::2] == (verdict, lead_cap)
