"""labkit.memory and labkit.probes under bad input: the review's failing trials (M*, P*), replayed.

Each test asserts the correct behaviour: a clear LabkitError (and nothing else printed before it),
or the right number. Models are tiny; the "huge" ones live on the meta device and allocate nothing.
"""

import logging
import math
import time

import pytest
import torch
from torch import nn

from labkit import memory, probes
from labkit._torch_compat import profiler_enabled
from labkit.errors import LabkitError
from labkit.memory import workspace
from labkit.probes import _timing
from labkit.readings import Reading


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


X = torch.randn(3, 4)
FAKE_TENSOR_LOG = logging.getLogger("torch._subclasses.fake_tensor")


class NoFormula(nn.Module):
    """A leaf module no analytic formula covers (the review's M10 model)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 64))

    def forward(self, x):
        return torch.exp(x @ self.w).tanh().sum(1)


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def unchanged(model: nn.Module, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(weights(model), before))


# -- M2: a shape error on fake tensors: one clear error, no logged torch traceback first ------------


@pytest.mark.trial("M2b")
def test_a_shape_error_in_the_step_estimate_prints_no_torch_traceback(capfd, caplog):
    shape_error = r"Sequential failed in its forward pass on inputs \(Tensor\[3×5"
    with caplog.at_level(logging.DEBUG), pytest.raises(LabkitError, match=shape_error):
        memory.estimate_step_peak(mlp(), torch.randn(3, 5))
    assert "Traceback" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not FAKE_TENSOR_LOG.filters, "the fake-tensor log filter outlived the call"


@pytest.mark.trial("M2c")
def test_a_shape_error_in_the_analytic_count_prints_no_torch_traceback(capfd, caplog):
    with caplog.at_level(logging.DEBUG), pytest.raises(LabkitError, match="Sequential failed in its forward pass"):
        memory.analytic_activation_bytes(mlp(), torch.randn(3, 5))
    assert "Traceback" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not FAKE_TENSOR_LOG.filters


# -- M4: the fake forward refuses what the real forward refuses --------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
@pytest.mark.trial("M4b")
def test_the_step_estimate_refuses_an_input_dtype_the_linear_cannot_take(dtype):
    x = torch.ones(3, 4, dtype=dtype)
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        nn.Linear(4, 2)(x)  # the real forward
    with pytest.raises(LabkitError, match="Linear failed in its forward pass.*one dtype"):
        memory.estimate_step_peak(nn.Linear(4, 2), x)


@pytest.mark.trial("M4c")
def test_the_analytic_count_refuses_an_int64_input_to_a_linear():
    with pytest.raises(LabkitError, match=r"Tensor\[3×4 int64, cpu\].*one dtype"):
        memory.analytic_activation_bytes(nn.Linear(4, 2), torch.ones(3, 4, dtype=torch.long))


# -- M7: under torch.inference_mode() the counts are what they are outside it ------------------------


@pytest.mark.trial("M7e")
def test_saved_bytes_under_inference_mode_counts_what_autograd_saves():
    model = mlp()
    outside = memory.saved_bytes(model, X)
    assert outside == 96
    with torch.inference_mode():
        assert memory.saved_bytes(model, X) == outside
        assert torch.is_inference_mode_enabled()  # the caller's mode is left as it was


@pytest.mark.trial("M7i")
def test_analytic_count_under_inference_mode_is_the_count_outside():
    model = mlp()
    with torch.inference_mode():
        inside = memory.analytic_activation_bytes(model, X)
    assert inside == memory.analytic_activation_bytes(model, X) == 96


@pytest.mark.trial("M7k")
def test_live_bytes_after_forward_under_inference_mode_sees_the_saved_activations():
    model = mlp()
    with torch.inference_mode():
        inside = memory.live_bytes_after_forward(model, X)
    saved = memory.saved_tensors(model, X)
    assert int(inside) == saved.total + saved.output_only_bytes == 96 + 12


@pytest.mark.trial("M7h")
def test_step_estimate_under_inference_mode_is_the_estimate_outside():
    model = mlp()
    with torch.inference_mode():
        inside = memory.estimate_step_peak(model, X)
    assert int(inside) == int(memory.estimate_step_peak(model, X))


@pytest.mark.trial("M7j")
def test_measured_step_under_inference_mode_runs_and_leaves_the_model_as_it_was():
    model = mlp()
    before = weights(model)
    with torch.inference_mode():
        inside = memory.measure_step_peak(model, X)
    outside = memory.measure_step_peak(model, X)
    assert int(inside["parameters"]) == int(outside["parameters"]) == (4 * 8 + 8 + 8 + 1) * 4
    assert int(inside["optimizer state"]) == int(outside["optimizer state"]) > 0
    assert int(inside["rise during step 2"]) > 0
    assert unchanged(model, before)


@pytest.mark.trial("extra")
def test_an_input_made_under_inference_mode_is_refused_with_the_way_out():
    with torch.inference_mode():
        x = torch.randn(3, 4)
    for measure in (memory.saved_bytes, memory.analytic_activation_bytes, memory.estimate_step_peak,
                    memory.measure_step_peak, memory.live_bytes_after_forward):
        with pytest.raises(LabkitError, match="created under torch.inference_mode.*outside inference mode"):
            measure(mlp(), x)


@pytest.mark.trial("extra")
def test_a_model_built_under_inference_mode_is_refused():
    with torch.inference_mode():
        model = mlp()
    with pytest.raises(LabkitError, match=r"Sequential\.0\.weight was created under torch.inference_mode"):
        memory.estimate_step_peak(model, X)


# -- M9: an optimizer factory that does not build an optimizer on the parameters it is given --------


@pytest.mark.trial("M9b")
def test_a_factory_returning_a_string_is_refused():
    with pytest.raises(LabkitError, match="factory returned str, not a torch.optim.Optimizer"):
        memory.estimate_step_peak(mlp(), X, optimizer=lambda params: "sgd")


@pytest.mark.trial("M9d")
def test_a_factory_returning_none_is_refused():
    with pytest.raises(LabkitError, match="factory returned NoneType"):
        memory.measure_step_peak(mlp(), X, optimizer=lambda params: None)


@pytest.mark.trial("extra")
def test_a_factory_building_on_another_models_parameters_is_refused_and_that_model_untouched():
    other = mlp()
    before = weights(other)
    for measure in (memory.measure_step_peak, memory.estimate_step_peak):
        with pytest.raises(LabkitError, match="parameter\\(s\\) it was not given"):
            measure(mlp(), X, optimizer=lambda params: torch.optim.SGD(other.parameters(), lr=1.0))
    assert unchanged(other, before)


@pytest.mark.trial("extra")
def test_an_optimizer_instance_is_refused_with_a_short_message_naming_the_fix():
    model = mlp()
    with pytest.raises(LabkitError, match="SGD instance.*lambda params: torch.optim.SGD") as error:
        memory.estimate_step_peak(model, X, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert "\n" not in str(error.value)


# -- M10: a layer no module formula covers is explained op by op, and an op no formula covers is named -----


class SquareFunction(torch.autograd.Function):
    """A custom op: its backward needs x, which it saves itself (no formula can know that)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class CustomOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 64)

    def forward(self, x):
        return SquareFunction.apply(self.fc(x)).tanh()


@pytest.mark.trial("M10")
def test_a_module_without_formula_is_not_counted_as_zero():
    assert memory.saved_bytes(NoFormula(), X) == 3 * 64 * 4 * 2  # exp's and tanh's outputs
    counted = memory.analytic_activation_bytes(NoFormula(), X)
    assert counted == counted.formula_bytes == 3 * 64 * 4 * 2 and counted.unexplained == ()
    table = memory.activation_table(NoFormula(), X)
    assert [line.layer for line in table.lines] == ["NoFormula (ops)"]
    assert "exp 3×64 float32" in table.lines[0].saves and "tanh 3×64 float32" in table.lines[0].saves


@pytest.mark.trial("M10")
def test_an_op_no_formula_covers_is_itemised_with_its_exact_bytes_and_named():
    exact = memory.saved_bytes(CustomOp(), X)
    counted = memory.analytic_activation_bytes(CustomOp(), X)
    assert counted == exact == 2 * 3 * 64 * 4  # the custom op's saved input, tanh's output
    assert (counted.formula_bytes, counted.unexplained_bytes) == (3 * 64 * 4, 3 * 64 * 4)
    assert counted.unexplained == ("(model) (SquareFunctionBackward)",)
    table = memory.activation_table(CustomOp(), X)
    assert "unexplained (exact bytes, no formula): (model) (SquareFunctionBackward)" in str(table)
    report = memory.analytic_memory(CustomOp(), X).report()
    assert any("formula-backed 768 B of 1,536 B" in note for note in report.notes)
    assert "768 B unexplained, saved by (model) (SquareFunctionBackward)" in report["activations"].source


# -- M12, M22: peak_bytes_during's arguments ---------------------------------------------------------


@pytest.mark.trial("M12")
def test_peak_bytes_during_a_non_callable_is_refused_before_any_profiler_starts():
    with pytest.raises(LabkitError, match="needs a function to call, not int"):
        memory.peak_bytes_during(42)
    assert not profiler_enabled()


@pytest.mark.trial("M22")
def test_an_unknown_device_is_a_clear_error_everywhere():
    with pytest.raises(LabkitError, match="unknown device 'tpu'"):
        memory.peak_bytes_during(lambda: None, device="tpu")
    with pytest.raises(LabkitError, match="unknown device 'tpu'"):
        memory.estimate_step_peak(mlp(), X, device="tpu")
    with pytest.raises(LabkitError, match="unknown device 'tpu'"):
        memory.activation_table(mlp(), X, device="tpu")


# -- M13b: the loss must be one number that depends on the model -------------------------------------


@pytest.mark.trial("M13b")
def test_a_loss_that_is_not_a_scalar_is_refused_and_the_model_left_as_it_was():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    before = weights(model)
    for measure in (memory.measure_step_peak, memory.estimate_step_peak):
        with pytest.raises(LabkitError, match=r"shape \(3, 2\), and backward needs one number"):
            measure(model, X, loss_fn=lambda out: out)
    assert unchanged(model, before)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.trial("extra")
def test_a_loss_that_is_a_python_float_is_refused():
    with pytest.raises(LabkitError, match="loss_fn returned float, not a tensor"):
        memory.measure_step_peak(mlp(), X, loss_fn=lambda out: 1.0)


@pytest.mark.trial("extra")
def test_a_loss_that_does_not_depend_on_the_model_is_refused():
    with pytest.raises(LabkitError, match="does not depend on any trainable parameter"):
        memory.estimate_step_peak(mlp(), X, loss_fn=lambda out: torch.ones(()))


# -- M17: lazy modules that have not run ------------------------------------------------------------


@pytest.mark.trial("M17")
def test_an_uninitialised_lazy_module_is_refused_and_left_uninitialised():
    model = nn.LazyLinear(3)
    for measure in (memory.saved_bytes, memory.analytic_activation_bytes, memory.estimate_step_peak,
                    memory.measure_step_peak, memory.live_bytes_after_forward):
        with pytest.raises(LabkitError, match="LazyLinear.weight is an uninitialised lazy parameter.*call the model"):
            measure(model, X)
    with pytest.raises(LabkitError, match="uninitialised lazy parameter"):
        memory.training_state(model)
    assert isinstance(model.weight, nn.parameter.UninitializedParameter)


# -- M23: measuring kernel workspace is bounded by the memory the machine has ------------------------


@pytest.mark.trial("M23")
def test_measuring_the_workspace_of_a_huge_meta_model_is_refused_without_allocating():
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 512, 3, padding=1), nn.Conv2d(512, 512, 3, padding=1))
        x = torch.randn(4096, 3, 512, 512)  # convolution_backward alone would take about 4 TiB
    with pytest.raises(LabkitError, match=r"would allocate .* TiB|would allocate .* GiB") as error:
        memory.estimate_step_peak(model, x, device="cpu", kernel_workspace="measure")
    assert "available on cpu" in str(error.value) and "kernel_workspace='ignore'" in str(error.value)


@pytest.mark.trial("extra")
def test_automatic_workspace_measuring_is_skipped_with_a_note_when_memory_is_short(monkeypatch):
    model, x = nn.Conv2d(3, 8, 3), torch.randn(2, 3, 16, 16)
    monkeypatch.setattr(workspace, "_available_bytes", lambda device: 1024)
    report = memory.estimate_step_peak(model, x)
    assert "kernel workspace" not in dict(report.rows)
    assert any("not measured" in note and "available on cpu" in note for note in report.notes)
    with pytest.raises(LabkitError, match="cannot measure on cpu: running convolution"):
        memory.estimate_step_peak(model, x, kernel_workspace="measure")


# -- P4, P5: buffer sizes the machine cannot hold, and wrong types -----------------------------------


@pytest.mark.trial("P4d")
def test_a_copy_buffer_larger_than_memory_is_refused_with_the_largest_that_fits():
    with pytest.raises(LabkitError, match=r"needs two buffers of .* MiB available now: pass size_mib of at most"):
        probes.copy_bandwidth(size_mib=1e8)


@pytest.mark.trial("P4f")
def test_a_copy_size_given_as_text_is_refused():
    with pytest.raises(LabkitError, match="size_mib must be a positive, finite number of MiB, not '8'"):
        probes.copy_bandwidth(size_mib="8")


@pytest.mark.trial("P4g")
def test_an_infinite_copy_size_is_refused():
    with pytest.raises(LabkitError, match="size_mib must be a positive, finite number of MiB, not inf"):
        probes.copy_bandwidth(size_mib=float("inf"))


@pytest.mark.trial("P5c")
def test_a_boolean_matrix_size_is_refused():
    with pytest.raises(LabkitError, match="n must be a positive whole matrix size, not True"):
        probes.matmul_throughput("fp32", n=True)


@pytest.mark.trial("P5d")
def test_matrices_larger_than_memory_are_refused_with_the_largest_n_that_fits():
    with pytest.raises(LabkitError, match=r"n=1000000 needs three .* pass n of at most \d+"):
        probes.matmul_throughput("fp32", n=10**6)


# -- P7c: the timer returns within a stated time, whatever min_run_time says -------------------------


@pytest.mark.parametrize("min_run_time", [float("inf"), float("nan"), -1.0, 0, 61.0, "0.5", True])
@pytest.mark.trial("P7c")
def test_a_min_run_time_the_timer_cannot_finish_within_its_bound_is_refused(min_run_time):
    started = time.perf_counter()
    for probe in (lambda: probes.measure_time(lambda: None, min_run_time=min_run_time),
                  lambda: probes.copy_bandwidth(min_run_time=min_run_time),
                  lambda: probes.matmul_throughput("fp32", min_run_time=min_run_time)):
        with pytest.raises(LabkitError, match="min_run_time must be a positive number of seconds, at most 60"):
            probe()
    assert time.perf_counter() - started < 1.0  # refused before any buffer is made or any call timed


@pytest.mark.parametrize("warmup", [True, 10**9, -1, 1.5])
@pytest.mark.trial("extra")
def test_a_warmup_beyond_its_bound_is_refused(warmup):
    with pytest.raises(LabkitError, match="warmup must be a whole number of calls from 0 to 1000"):
        probes.measure_time(lambda: None, warmup=warmup)


@pytest.mark.trial("extra")
def test_the_longest_min_run_time_allowed_is_accepted_by_the_check():
    # the bound is a bound, not a refusal of long runs: 60 s passes the check (not timed here)
    _timing._check_timing(warmup=0, min_run_time=60)


# -- P9e: one sampler, two with-blocks ---------------------------------------------------------------


@pytest.mark.trial("P9e")
def test_a_sampler_used_for_a_second_block_samples_that_block_afresh():
    sampler = probes.UtilisationSampler("cpu", interval_s=0.01)
    with sampler:
        time.sleep(0.1)
    first = len(sampler.samples)
    with sampler:
        time.sleep(0.3)
    assert first >= 3 and len(sampler.samples) >= 10, (first, len(sampler.samples))
    assert "mean of" in sampler.mean().source and sampler.mean().available


@pytest.mark.trial("extra")
def test_a_sampler_entered_inside_its_own_block_is_refused_and_keeps_sampling():
    sampler = probes.UtilisationSampler("cpu", interval_s=0.01)
    with sampler:
        with pytest.raises(LabkitError, match="already sampling a with-block"):
            sampler.__enter__()
        time.sleep(0.1)
    assert len(sampler.samples) >= 3 and sampler.mean().available


# -- P10e and readings: a ceiling of 0, numbers that are not numbers ----------------------------------


@pytest.mark.trial("P10e")
def test_a_fraction_of_a_zero_ceiling_is_a_clear_error():
    with pytest.raises(LabkitError, match="the ceiling reads 0.0 TB/s, and no fraction of that can be taken"):
        probes.fraction_of_ceiling(Reading(1.0, "TB/s", "measured"), Reading(0.0, "TB/s", "datasheet"))


@pytest.mark.trial("extra")
def test_a_fraction_of_an_infinite_rate_is_a_clear_error():
    with pytest.raises(LabkitError, match="achieved TB/s reading is inf"):
        probes.fraction_of_ceiling(Reading(math.inf, "TB/s", "measured"), Reading(2.0, "TB/s", "datasheet"))


@pytest.mark.parametrize("value", ["8", True, [1]])
@pytest.mark.trial("extra")
def test_a_reading_of_something_that_is_not_a_number_is_refused(value):
    with pytest.raises(LabkitError, match="a reading's value is a number"):
        Reading(value, "B", "measured")


# -- LK: after every refusal above, nothing is left switched on -------------------------------------


@pytest.mark.trial("extra")
def test_refusals_midway_through_a_fake_or_real_step_leave_no_mode_filter_or_profiler_behind():
    linear, model, ints = nn.Linear(4, 2), mlp(), torch.ones(3, 4, dtype=torch.long)
    failing_calls = [
        lambda: memory.estimate_step_peak(linear, ints),  # in the fake forward
        lambda: memory.estimate_step_peak(model, X, loss_fn=lambda out: out),  # after the fake forward
        lambda: memory.measure_step_peak(model, X, loss_fn=lambda out: out),  # after a real forward
        lambda: memory.estimate_step_peak(model, X, optimizer=lambda params: None),  # inside the fake mode
        lambda: memory.analytic_activation_bytes(linear, ints),  # in the analytic trace
    ]
    for inference in (False, True):
        with torch.inference_mode(inference), torch.no_grad():
            for call in failing_calls:
                with pytest.raises(LabkitError) as error:
                    call()
                assert "inference_mode" not in str(error.value)
                assert torch.is_inference_mode_enabled() is inference and not torch.is_grad_enabled()
    fresh = torch.empty(2)
    assert type(fresh) is torch.Tensor and fresh.untyped_storage().device.type == "cpu", "a fake mode was left on"
    assert not FAKE_TENSOR_LOG.filters and not profiler_enabled()


@pytest.mark.trial("extra")
def test_a_frozen_module_without_formula_that_saves_nothing_is_counted_as_the_zero_it_is():
    class FrozenThenTrained(nn.Module):
        def __init__(self):
            super().__init__()
            self.features, self.head = NoFormula().requires_grad_(False), nn.Linear(3, 2)

        def forward(self, x):
            return self.head(self.features(x).unsqueeze(0))

    model = FrozenThenTrained()
    assert memory.activation_table(model, X).uncovered == ()
    assert memory.analytic_activation_bytes(model, X) == memory.saved_bytes(model, X) == 3 * 4
