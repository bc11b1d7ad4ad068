"""labkit.tracers: gradient statistics, hooks' lifetime, alerts, compare_grads, the graph walker."""

import math
import tracemalloc

import matplotlib.figure
import pytest
import torch
from torch import nn

import labkit
from labkit import tracers
from labkit.errors import LabkitError
from labkit.tracers import (
    EXPLODE_MIN_BASELINE,
    HISTORY_KEYS,
    NUMERIC_GRAD_STATS,
    GradTracer,
    _full_statistics,
    _reductions,
    autograd_graph,
    compare_grads,
    plot_grad_flow,
    plot_grad_histograms,
    plot_grad_stat,
)
from labkit.tracers.graph import _saved_tensor_failure

# d(loss)/d(weight) is exactly GRAD_OF_WEIGHT for loss = (weight * GRAD_OF_WEIGHT).sum().
GRAD_OF_WEIGHT = [3.0, -4.0, 0.0, 0.0, 2.0]


class Weighted(nn.Module):
    """One parameter whose gradient the test chooses: forward returns (weight * coefficients).sum()."""

    def __init__(self, size: int = 5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, coefficients: torch.Tensor) -> torch.Tensor:
        return (self.weight * coefficients).sum()


def small_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def train_steps(model, optimizer, steps, inputs=None):
    inputs = torch.randn(16, 4) if inputs is None else inputs
    for _ in range(steps):
        optimizer.zero_grad()
        model(inputs).pow(2).mean().backward()
        optimizer.step()


def hooks_left(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    grad_hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    forward_hooks = sum(len(m._forward_hooks) for m in model.modules())
    step_hooks = len(optimizer._optimizer_step_pre_hooks) + len(optimizer._optimizer_step_post_hooks)
    return grad_hooks + forward_hooks + step_hooks


# ------------------------------------------------------------------ the package


# Every public name of the single-module labkit.tracers that preceded the package.
PUBLIC_NAMES = {
    "ACTIVATION_KEYS", "ALERT_KINDS", "HISTORY_KEYS", "NUMERIC_GRAD_STATS", "SATURATED_DERIVATIVE",
    "Alert", "AutogradGraph", "GradComparison", "GradDiff", "GradTracer", "GraphNode", "SavedTensor",
    "autograd_graph", "compare_grads", "plot_grad_flow", "plot_grad_histograms", "plot_grad_stat",
}  # fmt: skip


def test_the_package_re_exports_every_public_name_of_its_modules():
    # each declared once: the instruments as labkit.NAME, what they return and their settings as labkit.tracers.NAME
    assert PUBLIC_NAMES <= set(tracers.__all__) | set(labkit.__all__)
    assert not set(tracers.__all__) & set(labkit.__all__)
    for module in (tracers.grad_tracer, tracers.plots, tracers.compare, tracers.graph):
        assert module.__doc__, module.__name__
        for name in module.__all__:
            assert getattr(tracers, name) is getattr(module, name), name
    for name in ("GradTracer", "autograd_graph", "compare_grads", "plot_grad_flow", "plot_grad_stat"):
        assert getattr(labkit, name) is getattr(tracers, name)


def test_numeric_grad_stats_are_numeric_fields_of_a_history_record():
    assert set(NUMERIC_GRAD_STATS) <= set(HISTORY_KEYS)
    model = Weighted(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradTracer(model, optimizer, full_every=1, update_ratio=True) as tracer:
        model(torch.tensor([1.0, 2.0])).backward()
        optimizer.step()
    (record,) = tracer.history()
    assert all(isinstance(record[stat], (int, float)) for stat in NUMERIC_GRAD_STATS)
    assert not any(isinstance(record[stat], bool) for stat in NUMERIC_GRAD_STATS)


def test_the_tracer_docstring_states_the_sizes_the_code_uses():
    doc = " ".join(GradTracer.__doc__.split())
    assert f"Gradients of at most {_full_statistics._BATCHED_NUMEL:,} values" in doc
    assert f"reduced {_reductions._CHUNK:,} values at a time" in doc
    assert f"default `HISTOGRAM_SAMPLE` = {tracers.grad_tracer.HISTOGRAM_SAMPLE:,}" in doc


# ------------------------------------------------------------------ statistics


@pytest.mark.parametrize("chunk", [2**16, 2], ids=["one chunk", "chunks of 2"])
def test_full_step_statistics_equal_hand_computed_values(monkeypatch, chunk):
    # a large gradient's statistics are reduced chunk by chunk and combined: the same numbers
    monkeypatch.setattr(_reductions, "_CHUNK", chunk)
    model = Weighted()
    with GradTracer(model, full_every=1, histogram_bins=4) as tracer:
        model(torch.tensor(GRAD_OF_WEIGHT)).backward()
        tracer.step()
    (record,) = tracer.history()
    # sum of squares 9 + 16 + 4 = 29; sum 1; |g| sums to 9; two of five are exactly 0;
    # sample variance (29 - 1 * 1 / 5) / 4 = 7.2.
    assert record["norm"] == pytest.approx(math.sqrt(29))
    assert record["mean"] == pytest.approx(1 / 5)
    assert record["std"] == pytest.approx(math.sqrt(7.2))
    assert record["max_abs"] == 4.0
    assert record["mean_abs"] == pytest.approx(9 / 5)
    assert record["zero_frac"] == pytest.approx(2 / 5)
    assert record["nonfinite"] == 0
    assert (record["missing"], record["frozen"], record["accumulations"]) == (False, False, 1)
    # 4 bins over [-4, 3] have edges -4, -2.25, -0.5, 1.25, 3: {-4}, {}, {0, 0}, {2, 3}.
    assert (record["hist_lo"], record["hist_hi"]) == (-4.0, 3.0)
    assert record["hist_counts"] == [1, 0, 2, 2]


def sampled_histogram(seed: int, coefficients: torch.Tensor, sample: int = 500) -> dict:
    model = Weighted(coefficients.numel())
    with GradTracer(model, full_every=1, histogram_bins=8, histogram_sample=sample, histogram_seed=seed) as tracer:
        model(coefficients).backward()
        tracer.step()
    (record,) = tracer.history()
    return record


def test_a_sampled_histogram_is_deterministic_for_a_seed_and_says_it_is_sampled():
    coefficients = torch.randn(5000, generator=torch.Generator().manual_seed(0)) ** 3
    first, again, other = (sampled_histogram(seed, coefficients) for seed in (1, 1, 2))
    assert first["hist_counts"] == again["hist_counts"]
    assert first["hist_counts"] != other["hist_counts"]  # another seed draws other positions
    assert (first["hist_sample"], first["numel"]) == (500, 5000)
    assert sum(first["hist_counts"]) == 500
    # the range and every other statistic stay exact over all 5000 values
    assert (first["hist_lo"], first["hist_hi"]) == (coefficients.min().item(), coefficients.max().item())
    assert first["max_abs"] == coefficients.abs().max().item()
    assert first["mean_abs"] == pytest.approx(coefficients.abs().mean().item())
    exact = sampled_histogram(1, coefficients, sample=5000)
    assert exact["hist_sample"] == 5000
    assert exact["hist_counts"] == torch.histc(coefficients, 8).long().tolist()
    # a sample this size follows the exact shape: each bin within 5 points of its exact share
    for sampled_count, exact_count in zip(first["hist_counts"], exact["hist_counts"]):
        assert abs(sampled_count / 500 - exact_count / 5000) < 0.05
    figure = plot_grad_histograms([first])
    assert "sampled: 500 of 5,000 values" in figure.axes[0].get_title()


def edge_values(low: float, high: float, bins: int) -> torch.Tensor:
    """float32 values on histc's bin edges over [low, high] and one float step either side of each."""
    edges = torch.linspace(low, high, bins + 1)
    beside = [torch.nextafter(edges, torch.tensor(direction)) for direction in (math.inf, -math.inf)]
    return torch.cat([edges, *beside]).clamp(edges[0], edges[-1])


@pytest.mark.parametrize("batched", [False, True], ids=["per tensor", "batched"])
def test_histogram_counts_values_on_bin_edges_as_torch_histc_does(batched):
    # In float64 arithmetic several of these values land in the neighbouring bin (checked when
    # written: [5, 4, 0, 4, 3, 5] against histc's [4, 2, 3, 3, 4, 5]); in the values' own dtype,
    # histc's, they do not.
    values = edge_values(-1.488769769668579, 2.3046653270721436, 6)
    model = Shapes() if batched else Weighted(values.numel())
    with GradTracer(model, full_every=1, histogram_bins=6) as tracer:
        assert (tracer._batched is not None) == batched
        if batched:
            coefficients = {name: torch.zeros(shape) for name, shape in Shapes.SHAPES.items()}
            coefficients["long"][: values.numel()] = values
            coefficients["long"][values.numel():] = values[0]  # the range's low end: bin 0
        model(coefficients if batched else values).backward()
        tracer.step()
    record = next(r for r in tracer.history() if r["param"] in ("weight", "long"))
    gradient = coefficients["long"] if batched else values
    assert record["hist_sample"] == gradient.numel()
    assert record["hist_counts"] == torch.histc(gradient, 6).long().tolist()


@pytest.mark.parametrize("batched", [False, True], ids=["per tensor", "batched"])
def test_a_finite_gradient_too_large_to_square_gets_its_histogram_without_overflow(batched):
    # |g| of 1e37 overflows the float32 sum of squares and, times 32 bins, (g - low) * bins too:
    # the histogram must still put each value in its bin (float64 arithmetic, as histc's there).
    values = torch.tensor([-1e37, -3e36, 0.0, 2e36, 1e37])
    model = Shapes() if batched else Weighted(values.numel())
    coefficients = {name: torch.ones(shape) for name, shape in Shapes.SHAPES.items()}
    coefficients["vector"] = values
    with GradTracer(model, full_every=1) as tracer:
        model(coefficients if batched else values).backward()
        tracer.step()
    record = next(r for r in tracer.history() if r["param"] in ("weight", "vector"))
    assert (record["nonfinite"], record["norm"]) == (0, math.inf)
    assert record["hist_counts"] == torch.histc(values.double(), 32).long().tolist()


def test_a_sampled_gradient_with_nonfinite_values_is_counted_exactly():
    coefficients = torch.linspace(-1, 1, 3000)
    coefficients[::100] = math.nan
    coefficients[1] = math.inf
    record = sampled_histogram(0, coefficients)
    assert record["nonfinite"] == 31
    finite = coefficients[torch.isfinite(coefficients)]
    assert (record["hist_lo"], record["hist_hi"]) == (finite.min().item(), finite.max().item())
    assert 0 < sum(record["hist_counts"]) < 500  # the sampled non-finite values are left out


def test_cheap_steps_leave_the_expensive_statistics_out():
    model = Weighted()
    with GradTracer(model, full_every=2) as tracer:
        for _ in range(2):
            model(torch.tensor(GRAD_OF_WEIGHT)).backward()
            tracer.step()
    full, cheap = tracer.history()
    assert full["zero_frac"] == pytest.approx(2 / 5)
    expensive = ("max_abs", "mean_abs", "zero_frac", "hist_counts", "hist_lo", "hist_hi")
    assert [cheap[key] for key in expensive] == [None] * len(expensive)
    # weight.grad accumulated over both steps (never zeroed): the second step sees 2x.
    assert cheap["norm"] == pytest.approx(2 * math.sqrt(29))
    assert cheap["mean"] == pytest.approx(2 / 5)
    assert cheap["std"] == pytest.approx(2 * math.sqrt(7.2))


def test_history_records_carry_the_public_keys():
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradTracer(model, optimizer) as tracer:
        train_steps(model, optimizer, 2)
    records = tracer.history()
    assert {"step", "param", "norm", "std", "zero_frac", "nonfinite", "missing"} <= set(records[0])
    assert [(r["step"], r["param"]) for r in records[:5]] == [
        (0, "0.weight"), (0, "0.bias"), (0, "2.weight"), (0, "2.bias"), (1, "0.weight"),
    ]  # fmt: skip
    frame = tracer.frame()
    assert list(frame.columns) == list(HISTORY_KEYS)
    assert len(frame) == 8


@pytest.mark.parametrize("full_every", [0, 1])
def test_nonfinite_values_are_counted_and_alerted(full_every):
    model = Weighted(4)
    with GradTracer(model, full_every=full_every) as tracer:
        model(torch.tensor([math.inf, math.nan, 1.0, 2.0])).backward()
        tracer.step()
    (record,) = tracer.history()
    assert record["nonfinite"] == 2
    (alert,) = tracer.alerts()
    assert (alert.kind, alert.step, alert.name, alert.value) == ("nonfinite", 0, "weight", 2.0)
    assert "2 non-finite" in str(alert) and "of 4" in str(alert)


def test_half_precision_gradients_are_reduced_without_overflow():
    model = Weighted(4).half()
    with GradTracer(model, full_every=0) as tracer:
        # 300^2 * 4 = 360000 overflows float16 (max 65504); the tracer must not.
        model(torch.full((4,), 300.0, dtype=torch.float16)).backward()
        tracer.step()
    (record,) = tracer.history()
    assert record["norm"] == pytest.approx(600.0)
    assert record["nonfinite"] == 0


# ------------------------------------------------------------------ step boundary


def test_four_micro_batches_give_one_record_per_parameter_per_step():
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    micro_batches = torch.randn(4, 8, 4)
    with GradTracer(model, optimizer) as tracer:
        for _ in range(3):
            optimizer.zero_grad()
            for inputs in micro_batches:
                (model(inputs).pow(2).mean() / 4).backward()
            optimizer.step()
    records = tracer.history()
    assert len(records) == 3 * 4
    assert {r["accumulations"] for r in records} == {4}
    # The record is the accumulated gradient the optimizer stepped on, not one micro-batch's.
    last_weight = [r for r in records if r["param"] == "2.weight"][-1]
    assert last_weight["norm"] == pytest.approx(model[2].weight.grad.norm().item(), rel=1e-5)


def test_a_step_grad_scaler_skips_is_its_own_record_with_an_alert():
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    with GradTracer(model, optimizer, activations=True) as tracer:
        for step in range(3):
            optimizer.zero_grad()
            loss = model(torch.randn(8, 4)).pow(2).mean()
            if step == 1:
                loss = loss * math.inf  # inf gradients: the scaler skips optimizer.step()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    assert tracer.steps == 3
    assert [a.step for a in tracer.alerts("skipped_step")] == [1]
    assert {a.step for a in tracer.alerts("nonfinite")} == {1}
    # each step keeps its own backward and forward, not two merged
    assert {r["step"]: r["accumulations"] for r in tracer.history()} == {0: 1, 1: 1, 2: 1}
    assert {r["step"]: r["calls"] for r in tracer.activation_history()} == {0: 1, 1: 1, 2: 1}


def test_zeroing_between_micro_batches_without_a_step_is_a_skipped_step():
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradTracer(model, optimizer) as tracer:
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
    assert tracer.steps == 2 and [a.step for a in tracer.alerts("skipped_step")] == [0]


def test_micro_batches_and_zeroing_in_place_are_not_skipped_steps():
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradTracer(model, optimizer) as tracer:
        for _ in range(3):
            optimizer.zero_grad(set_to_none=False)
            for _ in range(2):
                model(torch.randn(8, 4)).sum().backward()
            optimizer.step()
    assert tracer.steps == 3 and not tracer.alerts("skipped_step")


def record_host_reads(monkeypatch) -> list[str]:
    """Patch every Tensor method that copies values to the host to log its name when called."""
    reads = []

    def logging(name, original):
        def logged(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)

        return logged

    for name in ("tolist", "item", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, logging(name, getattr(torch.Tensor, name)))
    return reads


def test_each_step_reads_the_device_once(monkeypatch):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    host_reads = record_host_reads(monkeypatch)
    with GradTracer(model, optimizer, full_every=2, activations=True, update_ratio=True):
        train_steps(model, optimizer, 3)
    assert host_reads == ["tolist"] * 3


def test_step_without_optimizer_is_called_by_hand_and_doubled_steps_are_refused():
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradTracer(model) as tracer:
        train_steps(model, optimizer, 3)
        assert tracer.steps == 0
        tracer.step()
        assert tracer.steps == 1
    with GradTracer(model, optimizer) as tracer, pytest.raises(LabkitError, match="twice"):
        tracer.step()


# ------------------------------------------------------------------ missing gradients


def test_frozen_and_detached_parameters_are_reported_missing():
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(3, 3), "detached": nn.Linear(3, 3), "frozen": nn.Linear(3, 3)})
    model["frozen"].requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.randn(5, 3)
    with GradTracer(model, optimizer) as tracer:
        optimizer.zero_grad()
        hidden = model["detached"](inputs).detach()
        (model["used"](hidden) + model["frozen"](inputs)).sum().backward()
        optimizer.step()
    by_name = {r["param"]: r for r in tracer.history()}
    assert not by_name["used.weight"]["missing"]
    assert by_name["detached.weight"]["missing"] and not by_name["detached.weight"]["frozen"]
    assert by_name["frozen.weight"]["missing"] and by_name["frozen.weight"]["frozen"]
    assert by_name["detached.weight"]["norm"] is None
    # A frozen parameter is a decision; a detached one is a bug, and only it raises an alert.
    assert {a.name for a in tracer.alerts("missing")} == {"detached.weight", "detached.bias"}
    assert "step 0" in str(tracer.alerts("missing")[0])


def test_stale_zero_gradients_do_not_hide_a_missing_gradient():
    model = nn.ModuleDict({"used": nn.Linear(2, 1), "unused": nn.Linear(2, 1)})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)  # what zero_grad(set_to_none=False) leaves behind
    with GradTracer(model, optimizer) as tracer:
        model["used"](torch.ones(1, 2)).sum().backward()
        optimizer.step()
    missing = {r["param"] for r in tracer.history() if r["missing"]}
    assert missing == {"unused.weight", "unused.bias"}


# ------------------------------------------------------------------ hooks' lifetime


def test_every_hook_is_removed_on_exit():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradTracer(model, optimizer, activations=True, update_ratio=True) as tracer:
        assert hooks_left(model, optimizer) > 0
        train_steps(model, optimizer, 2)
    assert hooks_left(model, optimizer) == 0
    train_steps(model, optimizer, 2)
    assert tracer.steps == 2


def test_every_hook_is_removed_when_the_traced_code_raises():
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(ZeroDivisionError):
        with GradTracer(model, optimizer, activations=True, update_ratio=True):
            train_steps(model, optimizer, 1)
            1 / 0
    assert hooks_left(model, optimizer) == 0
    with GradTracer(model, optimizer) as second:  # the model is free for a new tracer
        train_steps(model, optimizer, 1)
    assert second.steps == 1


def test_ten_thousand_steps_do_not_grow_memory():
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(16, 4)
    tracemalloc.start()
    try:
        with GradTracer(model, optimizer, max_steps=100, full_every=50) as tracer:
            train_steps(model, optimizer, 2_000, inputs)
            after_2k = tracemalloc.get_traced_memory()[0]
            train_steps(model, optimizer, 8_000, inputs)
            after_10k = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert tracer.steps == 10_000
    assert len(tracer.history()) == 100 * 4
    assert tracer.history()[0]["step"] == 9_900
    # A leak of one small object per step would add >= 8000 * 56 bytes here.
    assert after_10k - after_2k < 64 * 1024


# ------------------------------------------------------------------ clear errors


def test_a_model_without_parameters_is_refused():
    with pytest.raises(LabkitError, match="no parameters"):
        GradTracer(nn.ReLU())


def test_two_tracers_on_one_model_are_refused():
    model = small_mlp()
    with GradTracer(model):
        with pytest.raises(LabkitError, match="already has a GradTracer"):
            with GradTracer(model):
                pass
        with pytest.raises(LabkitError, match="already has a GradTracer"):
            GradTracer(model[0]).__enter__()  # a submodule shares the parameters


def test_reading_before_any_backward_is_refused():
    model = small_mlp()
    with GradTracer(model) as tracer:
        with pytest.raises(LabkitError, match="no gradient statistics yet"):
            tracer.history()
        model(torch.randn(2, 4)).sum().backward()
        with pytest.raises(LabkitError, match=r"tracer\.step\(\)"):
            tracer.alerts()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"update_ratio": True}, "needs the optimizer"),
        ({"full_every": -1}, "full_every"),
        ({"max_steps": 0}, "max_steps"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(LabkitError, match=message):
        GradTracer(small_mlp(), **options)


# ------------------------------------------------------------------ alerts


def test_a_gradient_ten_times_its_baseline_raises_an_exploding_alert():
    model = Weighted(2)
    with GradTracer(model, full_every=0) as tracer:
        for scale in [1.0] * 6 + [50.0]:
            model.weight.grad = None
            model(torch.tensor([scale, 0.0])).backward()
            tracer.step()
    (alert,) = tracer.alerts()
    assert (alert.kind, alert.step, alert.name, alert.value) == ("exploding", 6, "weight", 50.0)
    assert alert.limit == pytest.approx(10.0)
    assert "50x its rolling median 1" in str(alert)


@pytest.mark.parametrize("calm_steps", [EXPLODE_MIN_BASELINE - 1, EXPLODE_MIN_BASELINE])
def test_an_exploding_alert_waits_for_its_minimum_baseline(calm_steps):
    model = Weighted(2)
    with GradTracer(model, baseline_steps=20) as tracer:
        for scale in [1.0] * calm_steps + [50.0]:
            model.weight.grad = None
            model(torch.tensor([scale, 0.0])).backward()
            tracer.step()
    alerts = tracer.alerts("exploding")
    assert [a.step for a in alerts] == ([] if calm_steps < EXPLODE_MIN_BASELINE else [calm_steps])


def test_a_layer_far_below_the_largest_gradient_raises_a_vanishing_alert():
    model = nn.ModuleDict({"deep": Weighted(2), "top": Weighted(2)})
    with GradTracer(model, vanish_ratio=1e-3) as tracer:
        (model["deep"](torch.tensor([1e-5, 0.0])) + model["top"](torch.tensor([1.0, 1.0]))).backward()
        tracer.step()
    (alert,) = tracer.alerts()
    assert (alert.kind, alert.name) == ("vanishing", "deep.weight")
    assert alert.value == pytest.approx(1e-5 / math.sqrt(2))


def test_relu_units_that_never_fire_raise_a_dead_units_alert():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.copy_(torch.tensor([-1.0, -1.0, -1.0, 1.0]))
    with GradTracer(model, activations=True) as tracer:
        model(torch.randn(8, 3)).sum().backward()
        tracer.step()
    relu = [r for r in tracer.activation_history() if r["kind"] == "ReLU"][0]
    assert relu["dead"] == 0.75
    (alert,) = tracer.alerts("dead_units")
    assert (alert.name, alert.step, alert.value) == ("1", 0, 0.75)


def test_dead_units_of_a_sequence_output_are_counted_along_the_features():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.copy_(torch.tensor([-1.0, -1.0, -1.0, 1.0]))
    x = torch.randn(8, 10, 3)  # (batch, time, features): dim 1 is time, whose 10 steps all fire
    dead = {}
    for unit_dim in (1, -1):
        with GradTracer(model, activations=True, unit_dim=unit_dim) as tracer:
            model(x).sum().backward()
            tracer.step()
        dead[unit_dim] = [r for r in tracer.activation_history() if r["kind"] == "ReLU"][0]["dead"]
    assert dead == {1: 0.0, -1: 0.75}


def test_a_unit_dim_that_is_the_batch_or_out_of_range_is_refused():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    with pytest.raises(LabkitError, match="unit_dim=0 is the batch"):
        GradTracer(model, activations=True, unit_dim=0)
    with GradTracer(model, activations=True, unit_dim=2) as tracer:
        with pytest.raises(LabkitError, match=r"unit_dim=2 does not exist in the \(8, 4\) output of ReLU '1'"):
            model(torch.randn(8, 3))
    assert tracer.steps == 0


def test_alerts_are_kept_only_for_the_steps_the_history_keeps():
    model = nn.ModuleDict({"used": Weighted(2), "unused": Weighted(2)})
    with GradTracer(model, max_steps=3) as tracer:
        for _ in range(10):
            model["used"](torch.ones(2)).backward()
            tracer.step()
    assert [a.step for a in tracer.alerts("missing")] == [7, 8, 9]


# ------------------------------------------------------------------ activations and updates


def test_activation_statistics_match_the_outputs():
    model = nn.Sequential(nn.Linear(2, 4), nn.Tanh())
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, 0.0], [3.0, 0.0], [-3.0, 0.0], [0.1, 0.0]]))
        model[0].bias.zero_()
    inputs = torch.tensor([[1.0, 5.0], [1.0, -5.0]])
    with GradTracer(model, activations=True) as tracer:
        outputs = model(inputs)
        outputs.sum().backward()
        with torch.no_grad():
            model(inputs * 100)  # evaluation under no_grad must not count
        tracer.step()
    tanh = [r for r in tracer.activation_history() if r["module"] == "1"][0]
    # tanh(+-3) = +-0.995 have derivative 0.0099 < 2 % of 1; tanh(1), tanh(0.1) do not.
    assert tanh["saturated"] == 0.5
    assert tanh["calls"] == 1
    assert tanh["mean"] == pytest.approx(outputs.mean().item())
    assert tanh["std"] == pytest.approx(outputs.std().item())


def test_relu_statistics_of_a_convolution_match_its_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU())
    with torch.no_grad():
        model[0].bias.copy_(torch.tensor([0.0, -100.0, 0.5, -100.0]))  # channels 1 and 3 never fire
    with GradTracer(model, activations=True) as tracer:
        outputs = model(torch.randn(3, 2, 6, 6))
        outputs.sum().backward()
        tracer.step()
    relu = [r for r in tracer.activation_history() if r["kind"] == "ReLU"][0]
    assert relu["dead"] == 0.5
    assert relu["mean"] == pytest.approx(outputs.mean().item())
    assert relu["std"] == pytest.approx(outputs.std().item())


# ------------------------------------------------------------------ torch.compile (the review's AP8, AP9)


def traced_eager_and_fullgraph_compiled(train) -> tuple[GradTracer, GradTracer]:
    """``train(optimizer, forward)`` under a tracer with activations, once eagerly and once through
    ``torch.compile(model, fullgraph=True)`` made inside the tracer (AP9), from the same weights."""
    tracers = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1), nn.Sigmoid())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with GradTracer(model, optimizer, activations=True, full_every=2, update_ratio=True) as tracer:
            forward = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
            train(optimizer, forward)
        assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0
        tracers.append(tracer)
    return tracers[0], tracers[1]


def assert_same_records(eager: GradTracer, compiled: GradTracer) -> None:
    for read in (GradTracer.history, GradTracer.activation_history):
        expected, got = read(eager), read(compiled)
        assert len(got) == len(expected) > 0
        for want, row in zip(expected, got):
            assert row.keys() == want.keys()
            for key, value in want.items():
                if not isinstance(value, float):
                    assert row[key] == value, (key, want, row)
                elif math.isnan(value):  # the std of a one-value gradient
                    assert math.isnan(row[key]), (key, want, row)
                else:
                    assert row[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (key, want, row)


def test_a_fullgraph_compiled_model_records_what_the_eager_one_records():
    # Nine micro-batches a step: more than dynamo's recompile limit (8), so a hook that made the
    # graph recompile at every micro-batch fails here; two batch sizes make the shapes dynamic.
    def train(optimizer, forward):
        generator = torch.Generator().manual_seed(1)
        for _ in range(2):
            optimizer.zero_grad()
            for micro_batch in range(9):
                forward(torch.randn(4 + micro_batch % 2, 4, generator=generator)).sum().backward()
            with torch.no_grad():
                forward(torch.randn(4, 4, generator=generator))  # evaluation does not count
            optimizer.step()

    eager, compiled = traced_eager_and_fullgraph_compiled(train)
    assert {r["calls"] for r in compiled.activation_history()} == {9}
    assert_same_records(eager, compiled)


def test_a_step_skipped_under_a_fullgraph_compiled_model_keeps_its_own_forward_passes():
    def train(optimizer, forward):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
        generator = torch.Generator().manual_seed(1)
        for step in range(3):
            optimizer.zero_grad()
            for _ in range(2):
                loss = forward(torch.randn(8, 4, generator=generator)).pow(2).mean()
                scaler.scale(loss * math.inf if step == 1 else loss).backward()
            scaler.step(optimizer)  # skipped at step 1: inf gradients
            scaler.update()

    eager, compiled = traced_eager_and_fullgraph_compiled(train)
    assert [a.step for a in compiled.alerts("skipped_step")] == [1]
    assert {r["step"]: r["calls"] for r in compiled.activation_history()} == {0: 2, 1: 2, 2: 2}
    assert_same_records(eager, compiled)


def test_parameters_replaced_under_a_fullgraph_compiled_model_lose_one_step_and_are_followed():
    model = small_mlp()
    with GradTracer(model, activations=True) as tracer:
        forward = torch.compile(model, fullgraph=True, backend="aot_eager")
        forward(torch.randn(4, 4)).sum().backward()
        tracer.step()
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        forward(torch.randn(4, 4)).sum().backward()
        with pytest.raises(LabkitError, match="compiled by torch.compile"):
            tracer.step()  # the compiled pre-hook cannot check the parameters before the forward pass
        forward(torch.randn(4, 4)).sum().backward()
        tracer.step()
    last = [r for r in tracer.history() if r["step"] == 1]
    assert [r["norm"] for r in last] == pytest.approx([p.grad.norm().item() for p in model.parameters()])


def test_update_ratio_is_the_step_size_over_the_weight_size():
    model = Weighted(2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([3.0, 4.0]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradTracer(model, optimizer, update_ratio=True) as tracer:
        model(torch.tensor([1.0, 0.0])).backward()
        optimizer.step()
    (record,) = tracer.history()
    assert record["update_ratio"] == pytest.approx(0.1 * 1.0 / 5.0)


@pytest.mark.parametrize("chunk", [2**16, 4], ids=["one chunk", "chunks of 4"])
def test_a_norm_is_the_same_on_full_and_plain_steps(monkeypatch, chunk):
    monkeypatch.setattr(_reductions, "_CHUNK", chunk)
    model = Weighted(10)
    coefficients = torch.linspace(-1.0, 1.0, 10) * 1e-3 + 0.7
    with GradTracer(model, full_every=2) as tracer:
        for _ in range(2):  # the same gradient twice: a full step, then a plain one
            model.weight.grad = None
            model(coefficients).backward()
            tracer.step()
    full, plain = tracer.history()
    assert full["max_abs"] is not None and plain["max_abs"] is None
    assert (full["norm"], full["mean"], full["std"]) == (plain["norm"], plain["mean"], plain["std"])
    assert full["norm"] == pytest.approx(coefficients.double().norm().item(), rel=1e-7)


def test_a_gradient_is_never_reduced_in_chunks_too_long_for_an_exact_float32_count():
    # the non-zero count is a float32 sum of ones per chunk: exact only up to 2**24
    chunk_length = _reductions._chunk_length
    assert chunk_length(torch.empty(2**25, device="meta")) == 2**24
    assert chunk_length(torch.empty(1000, device="meta")) == 1000
    assert chunk_length(torch.empty(2**20)) == _reductions._CHUNK


def test_update_ratio_of_every_parameter_matches_a_copy_taken_by_hand():
    torch.manual_seed(0)
    model = nn.Linear(3, 4)
    model.weight = nn.Parameter(torch.randn(3, 4).t())  # not contiguous: the copy keeps its strides
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    expected = []
    with GradTracer(model, optimizer, update_ratio=True) as tracer:
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(5, 3)).pow(2).sum().backward()
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.step()
            expected += [((b - p).norm() / b.norm()).item() for b, p in zip(before, model.parameters())]
    assert [r["update_ratio"] for r in tracer.history()] == pytest.approx(expected, rel=1e-5)


def test_update_ratio_follows_parameters_converted_in_place():
    # model.double() keeps the Parameter objects and changes their dtype between two steps
    torch.manual_seed(0)
    model = nn.Linear(3, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    with GradTracer(model, optimizer, update_ratio=True) as tracer:
        for step in range(4):
            if step == 2:
                model.double()
            optimizer.zero_grad()
            model(torch.randn(5, 3, dtype=model.weight.dtype)).pow(2).sum().backward()
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.step()
            expected += [((b - p).norm() / b.norm()).item() for b, p in zip(before, model.parameters())]
    assert [r["update_ratio"] for r in tracer.history()] == pytest.approx(expected, rel=1e-6)


# ------------------------------------------------------------------ plots


def test_plots_return_figures():
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradTracer(model, optimizer, full_every=2) as tracer:
        train_steps(model, optimizer, 3)
    flow = plot_grad_flow(tracer)
    assert isinstance(flow, matplotlib.figure.Figure)
    assert "step 2" in flow.axes[0].get_title()
    assert len(flow.axes[0].patches) == 2 * 4  # max |g| and mean |g| per parameter
    over_steps = plot_grad_stat(tracer.history(), "std", params=["0.weight", "2.weight"])
    assert over_steps.axes[0].get_yscale() == "log"
    assert len(over_steps.axes[0].lines) == 2
    histograms = plot_grad_histograms(tracer, step=0)
    assert sum(ax.get_visible() for ax in histograms.axes) == 4


def test_plots_explain_what_is_missing():
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradTracer(model, optimizer, full_every=0) as tracer:
        train_steps(model, optimizer, 1)
    with pytest.raises(LabkitError, match="full_every"):
        plot_grad_flow(tracer)
    with pytest.raises(LabkitError, match="unknown statistic"):
        plot_grad_stat(tracer, "median")
    with pytest.raises(LabkitError, match="no step recorded 'max_abs'"):
        plot_grad_stat(tracer, "max_abs")


# ------------------------------------------------------------------ compare_grads


def grads_of(model: nn.Module, inputs: torch.Tensor) -> nn.Module:
    model.zero_grad()
    model(inputs).pow(2).sum().backward()
    return model


def test_compare_grads_tells_exact_close_and_different_apart():
    torch.manual_seed(0)
    inputs = torch.randn(6, 4)
    first = grads_of(small_mlp(), inputs)
    same = compare_grads(first, grads_of(small_mlp(), inputs))
    assert same.all_exact and same.all_close
    double = compare_grads(first, grads_of(small_mlp().double(), inputs.double()))
    assert double.all_close and not double.all_exact
    assert all(row.dtype_b == "float64" for row in double.rows)
    shifted = {n: p.grad.clone() for n, p in first.named_parameters()}
    shifted["2.bias"] += 0.5
    report = compare_grads(first, shifted)
    bias = [row for row in report.rows if row.name == "2.bias"][0]
    assert not report.all_close and not bias.close
    assert bias.max_abs_diff == pytest.approx(0.5)
    original = first[2].bias.grad.item()
    assert bias.max_rel_diff == pytest.approx(0.5 / max(abs(original), abs(original + 0.5)))
    assert report.records()[3]["name"] == "2.bias"
    assert str(report).splitlines()[1].split() == ["name", "exact", "approx", "maxdiff", "maxrel"]


def test_a_comparison_prints_as_a_table_and_has_a_one_line_repr():
    from IPython.lib.pretty import pretty

    report = compare_grads({"x": torch.ones(2)}, {"x": torch.ones(2)})
    table = "rtol=1e-05 atol=1e-08\nname  exact  approx  maxdiff    maxrel\nx     yes    yes     0          0"
    assert str(report) == f"{report}" == table
    assert pretty(report) == table  # what a notebook shows for a bare `report`
    assert repr(report).startswith("GradComparison(rows=(GradDiff(name='x', exact=True,")
    assert "\n" not in repr(report) and "\n" not in repr([report])


def test_compare_grads_refuses_mismatched_sides():
    grad = torch.ones(3)
    with pytest.raises(LabkitError, match="only in a: \\['x'\\]"):
        compare_grads({"x": grad, "y": grad}, {"y": grad})
    with pytest.raises(LabkitError, match="shape"):
        compare_grads({"x": grad}, {"x": torch.ones(4)})
    with pytest.raises(LabkitError, match="no gradient"):
        compare_grads(small_mlp(), small_mlp())


# ------------------------------------------------------------------ autograd graph


def test_graph_lists_nodes_saved_tensors_and_the_cut_parameters():
    torch.manual_seed(0)
    model = nn.ModuleDict({"first": nn.Linear(4, 3), "second": nn.Linear(3, 2), "frozen": nn.Linear(4, 2)})
    model["frozen"].requires_grad_(False)
    inputs = torch.randn(5, 4)
    loss = (model["second"](model["first"](inputs).detach().relu()) + model["frozen"](inputs)).sum()
    graph = autograd_graph(loss, model.named_parameters())
    assert graph.nodes[0].name == "SumBackward0"
    assert sorted(graph.leaves) == ["second.bias", "second.weight"]
    assert graph.unreachable_params == ("first.weight", "first.bias")
    assert graph.frozen_params == ("frozen.weight", "frozen.bias")
    addmm = [n for n in graph.nodes if n.name == "AddmmBackward0"][0]
    # second(relu(h)) saves its input: 5 x 3 float32 values = 60 bytes.
    assert [(s.name, s.shape, s.dtype, s.nbytes) for s in addmm.saved] == [("mat1", (5, 3), "float32", 60)]
    assert all(graph.nodes[dst].depth > graph.nodes[src].depth for src, dst in graph.edges)
    dot = graph.to_dot()
    assert dot.startswith("digraph") and dot.count("->") == len(graph.edges)
    assert "first.weight\\n(unreachable)" in dot
    figure = graph.draw()
    assert isinstance(figure, matplotlib.figure.Figure)
    labels = {text.get_text() for text in figure.axes[0].texts}
    assert {"SumBackward0", "second.weight", "first.weight\n(unreachable)", "frozen.bias\n(frozen)"} <= labels


def test_graph_after_backward_says_saved_tensors_were_freed():
    weight = torch.randn(3, requires_grad=True)
    loss = (weight * weight).sum()
    loss.backward()
    graph = autograd_graph(loss, {"weight": weight})
    mul = [n for n in graph.nodes if n.name == "MulBackward0"][0]
    assert mul.freed and mul.saved == ()
    assert graph.edges.count((1, 2)) == 2  # weight enters the product twice


def test_torch_s_saved_tensor_errors_are_classified_by_their_message():
    # _saved_tensor_failure reads torch's message text; these are torch's real errors, so a torch
    # that rewords either message fails here, by name, rather than deep inside autograd_graph.
    weight = torch.randn(3, requires_grad=True)
    loss = (weight * weight).sum()
    loss.backward()
    with pytest.raises(RuntimeError) as freed:
        loss.grad_fn.next_functions[0][0]._saved_self
    assert _saved_tensor_failure(freed.value) == "freed"

    saved = torch.randn(3, requires_grad=True).clone()
    product = (saved * weight).sum()
    with torch.no_grad():
        saved.add_(1.0)
    with pytest.raises(RuntimeError) as modified:
        product.grad_fn.next_functions[0][0]._saved_self
    assert _saved_tensor_failure(modified.value) == "modified in place"

    assert _saved_tensor_failure(RuntimeError("some other failure")) is None


def test_graph_needs_a_tensor_with_a_grad_fn():
    with pytest.raises(LabkitError, match="no grad_fn"):
        autograd_graph(torch.ones(2))


def test_graph_of_a_forward_whose_saved_tensors_were_updated_in_place_is_a_clear_error():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))  # the second layer saves its weight
    loss = model(torch.randn(4, 3)).sum()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)  # what optimizer.step() does between a forward and a later look at its graph
    with pytest.raises(LabkitError, match="modified in place after the forward"):
        autograd_graph(loss, model.named_parameters())


class Shapes(nn.Module):
    """Parameters of several shapes (one empty, one larger than the histogram sample), each with the
    gradient the test chooses: forward returns sum(param * coefficients) over the parameters."""

    SHAPES = {"matrix": (3, 4), "vector": (5,), "cube": (2, 3, 3), "single": (1,), "empty": (0,), "long": (300,)}

    def __init__(self) -> None:
        super().__init__()
        for name, shape in self.SHAPES.items():
            self.register_parameter(name, nn.Parameter(torch.ones(shape)))

    def forward(self, coefficients: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((getattr(self, name) * c).sum() for name, c in coefficients.items())


def shapes_coefficients(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    coefficients = {name: torch.randn(shape, generator=generator) for name, shape in Shapes.SHAPES.items()}
    coefficients["matrix"][0] = 0.0  # zeros to count
    coefficients["single"][0] = 0.0  # an all-zero gradient: an empty histogram range
    if step == 1:
        coefficients["vector"][1], coefficients["vector"][3] = math.inf, math.nan
        coefficients["long"][7] = -math.inf
    return coefficients


def traced_shapes(monkeypatch, batched: bool) -> tuple[list[dict], bool]:
    if not batched:
        monkeypatch.setattr(_full_statistics, "_BATCHED_NUMEL", 0)
    model = Shapes()
    with GradTracer(model, full_every=1, histogram_bins=6, histogram_sample=64) as tracer:
        used = tracer._batched is not None
        for step in range(3):
            model.zero_grad()
            model(shapes_coefficients(step)).backward()
            tracer.step()
    monkeypatch.undo()
    return tracer.history(), used


def test_batched_full_statistics_equal_the_per_tensor_ones_and_the_exact_values(monkeypatch):
    batched, used = traced_shapes(monkeypatch, batched=True)
    per_tensor, used_per_tensor = traced_shapes(monkeypatch, batched=False)
    assert (used, used_per_tensor) == (True, False)
    assert "empty" not in {record["param"] for record in batched}  # nothing to trace in it
    for fast, slow in zip(batched, per_tensor, strict=True):
        assert fast.keys() == slow.keys()
        for key in fast:
            if isinstance(slow[key], float) and math.isnan(slow[key]):  # a NaN gradient's max |g|
                assert math.isnan(fast[key]), (fast["step"], fast["param"], key)
            elif key == "mean_abs":
                assert fast[key] == pytest.approx(slow[key], rel=1e-6)
            else:
                assert fast[key] == slow[key], (fast["step"], fast["param"], key)
    for record in batched:
        grad = shapes_coefficients(record["step"])[record["param"]].reshape(-1)
        finite = grad[torch.isfinite(grad)]
        assert record["nonfinite"] == grad.numel() - finite.numel()
        assert record["zero_frac"] == (grad == 0).sum().item() / grad.numel()
        if record["nonfinite"] == 0:
            assert record["max_abs"] == grad.abs().max().item()
            assert record["mean_abs"] == pytest.approx(grad.abs().mean().item(), rel=1e-6)
        low, high = finite.min().item(), finite.max().item()
        if low == high:
            low, high = low - 1, high + 1
        assert (record["hist_lo"], record["hist_hi"]) == (low, high)
        if record["numel"] <= 64:  # below the sample size the histogram is exact
            assert record["hist_counts"] == torch.histc(finite, 6, low, high).long().tolist()
        else:
            assert record["hist_sample"] == 64


class Boom(torch.autograd.Function):
    """Identity forward; its backward raises, after the gradients created later have been hooked."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


def test_a_backward_that_raises_midway_leaves_the_batched_statistics_of_the_last_finished_one():
    model = Shapes()
    with GradTracer(model, full_every=1, histogram_bins=6, histogram_sample=64) as tracer:
        assert tracer._batched is not None
        model(shapes_coefficients(0)).backward()
        leaf = torch.ones(1, requires_grad=True)
        exploding = Boom.apply(leaf)  # created first, so its backward runs after the parameters'
        partial = model({name: 100 * c for name, c in shapes_coefficients(2).items()}) + exploding.sum()
        with pytest.raises(RuntimeError, match="boom"):
            partial.backward()
        assert model.matrix.grad.abs().max() > 100  # the failed backward did reach the parameters
        tracer.step()
    for record in tracer.history():
        grad = shapes_coefficients(0)[record["param"]]
        assert record["accumulations"] == 1
        assert record["max_abs"] == grad.abs().max().item(), record["param"]
