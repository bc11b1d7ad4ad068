"""The tracers under bad input and faults: the reliability review's T, C and A trials, replayed.

Each test asserts the correct behaviour: a clear LabkitError naming what was wrong, or the right
answer (no false alerts, no phantom steps, no leaked hooks or ids).
"""

import gc
import math
import weakref

import pytest
import torch
from torch import nn

from labkit.errors import LabkitError
from labkit.tracers import GradTracer, _hooks, autograd_graph, compare_grads


class _FailOnce(torch.autograd.Function):
    """Passes its input through; its backward raises the first time (a backward that fails midway,
    after the layers behind it already got their gradients)."""

    failures_left = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if _FailOnce.failures_left:
            _FailOnce.failures_left -= 1
            raise RuntimeError("backward failed midway")
        return grad


class _FailingMiddle(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(3, 4)
        self.second = nn.Linear(4, 1)

    def forward(self, x):
        return self.second(_FailOnce.apply(self.first(x)))


def _failing_backward_then_retry(model, x, zero_grad):
    """One backward that raises after `second` got its gradient, then a clean retry."""
    _FailOnce.failures_left = 1
    with pytest.raises(RuntimeError, match="failed midway"):
        model(x).sum().backward()
    zero_grad()
    model(x).sum().backward()


def _hook_counts(model):
    grad = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    forward = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return grad, forward


@pytest.mark.trial("T5")
def test_a_backward_that_raises_midway_does_not_count_without_an_optimizer():
    torch.manual_seed(0)
    model, x = _FailingMiddle(), torch.randn(5, 3)

    def set_grads_to_none():
        for param in model.parameters():
            param.grad = None

    with GradTracer(model) as tracer:
        _failing_backward_then_retry(model, x, set_grads_to_none)
        tracer.step()
    rows = tracer.history()
    assert tracer.steps == 1
    assert {row["param"]: row["accumulations"] for row in rows} == dict.fromkeys(
        ["first.weight", "first.bias", "second.weight", "second.bias"], 1
    )
    # The recorded norm is the retried backward's gradient, the one in .grad.
    second = next(row for row in rows if row["param"] == "second.weight")
    assert second["norm"] == pytest.approx(model.second.weight.grad.norm().item())
    assert tracer.alerts() == []


@pytest.mark.trial("T5opt")
def test_a_backward_that_raises_midway_leaves_no_phantom_step_with_an_optimizer():
    torch.manual_seed(0)
    model, x = _FailingMiddle(), torch.randn(5, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradTracer(model, optimizer) as tracer:
        _failing_backward_then_retry(model, x, optimizer.zero_grad)
        optimizer.step()
    assert tracer.steps == 1
    assert [row["missing"] for row in tracer.history()] == [False] * 4
    assert [row["accumulations"] for row in tracer.history()] == [1] * 4
    assert tracer.alerts() == []


def _two_traced_steps(model, tracer, x, between):
    model(x).sum().backward()
    tracer.step()
    between()
    for param in model.parameters():
        param.grad = None
    model(x.to(next(model.parameters()).dtype)).sum().backward()
    tracer.step()


@pytest.mark.trial("T18")
def test_parameters_replaced_by_load_state_dict_assign_are_traced():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), torch.randn(5, 3)

    def load_copies():
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)

    with GradTracer(model) as tracer:
        old = list(model.parameters())
        _two_traced_steps(model, tracer, x, load_copies)
        assert all(new is not was for new, was in zip(model.parameters(), old))
    last = tracer.history()[-4:]
    assert [row["missing"] for row in last] == [False] * 4
    assert last[0]["norm"] == pytest.approx(model[0].weight.grad.norm().item())
    assert tracer.alerts("missing") == []
    # The old parameters' ids were released with the hooks; the new ones too, on exit.
    assert not {id(p) for p in [*old, *model.parameters()]} & _hooks._TRACED_PARAMS
    assert _hook_counts(model) == (0, 0)


@pytest.mark.trial("T8c")
def test_a_dtype_change_that_swaps_tensors_keeps_tracing():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), torch.randn(5, 3)
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with GradTracer(model) as tracer:
            _two_traced_steps(model, tracer, x, model.double)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    last = tracer.history()[-4:]
    assert [row["missing"] for row in last] == [False] * 4
    assert [row["accumulations"] for row in last] == [1] * 4
    assert last[2]["norm"] == pytest.approx(model[2].weight.grad.norm().item())
    assert tracer.alerts() == []
    assert _hook_counts(model) == (0, 0)


@pytest.mark.trial("T19")
def test_moving_the_traced_model_to_meta_is_a_clear_error():
    model, x = nn.Linear(3, 1), torch.randn(4, 3)
    with GradTracer(model) as tracer:
        model(x).sum().backward()
        tracer.step()
        model.to("meta")
        with pytest.raises(LabkitError, match="meta device"):
            model(x.to("meta")).sum().backward()
    assert [row["missing"] for row in tracer.history()] == [False, False]
    assert _hook_counts(model) == (0, 0)


@pytest.mark.trial("extra")
def test_replacing_parameters_that_the_optimizer_does_not_hold_is_a_clear_error():
    model, x = nn.Linear(3, 1), torch.randn(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradTracer(model, optimizer):
        model(x).sum().backward()
        optimizer.step()
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        with pytest.raises(LabkitError, match="still updates the old ones"):
            model(x)


@pytest.mark.trial("extra")
def test_parameters_replaced_after_the_forward_pass_are_a_clear_error_at_the_step():
    model, x = nn.Linear(3, 1), torch.randn(4, 3)
    with GradTracer(model) as tracer:
        loss = model(x).sum()
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        loss.backward()
        with pytest.raises(LabkitError, match="step 0: the model's parameters were replaced"):
            tracer.step()
        model(x).sum().backward()
        tracer.step()
    assert [row["missing"] for row in tracer.history()] == [False, False]


@pytest.mark.trial("T14")
def test_an_optimizer_of_another_model_is_refused_and_one_of_some_parameters_is_accepted():
    model, other = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)), nn.Linear(3, 1)
    with pytest.raises(LabkitError, match="updates none of the parameters of Sequential"):
        GradTracer(model, torch.optim.SGD(other.parameters(), lr=0.1))
    # Owning some is accepted (an optimizer of the trainable part only): each of its steps is a step.
    model[0].requires_grad_(False)
    head_only = torch.optim.SGD(model[1].parameters(), lr=0.1)
    with GradTracer(model, head_only) as tracer:
        for _ in range(3):
            head_only.zero_grad()
            model(torch.randn(5, 3)).sum().backward()
            head_only.step()
    assert tracer.steps == 3
    assert tracer.alerts() == []


@pytest.mark.trial("T17c")
@pytest.mark.parametrize(
    "options, message",
    [
        ({"explode_factor": -1}, "explode_factor must be a number > 1"),
        ({"explode_factor": float("inf")}, "explode_factor must be a number > 1"),
        ({"vanish_ratio": float("nan")}, r"vanish_ratio must be a number in \[0, 1\)"),
        ({"vanish_ratio": -0.1}, r"vanish_ratio must be a number in \[0, 1\)"),
    ],
)
def test_nonsense_alert_thresholds_are_refused_at_construction(options, message):
    with pytest.raises(LabkitError, match=message):
        GradTracer(nn.Linear(3, 1), **options)


@pytest.mark.trial("T17d")
def test_a_dead_above_that_is_not_a_share_is_refused_at_construction():
    for bad in ("x", 0, 1.5, None):
        with pytest.raises(LabkitError, match=r"dead_above must be a share in \(0, 1\]"):
            GradTracer(nn.Sequential(nn.Linear(3, 4), nn.ReLU()), activations=True, dead_above=bad)


@pytest.mark.trial("T17e")
def test_histogram_bins_true_is_not_an_integer():
    with pytest.raises(LabkitError, match="histogram_bins must be an integer >= 1, got True"):
        GradTracer(nn.Linear(3, 1), histogram_bins=True)


@pytest.mark.trial("T10c")
def test_a_tracer_entered_and_never_exited_frees_the_model_and_its_ids():
    before = set(_hooks._TRACED_PARAMS)
    model = nn.Linear(3, 1)
    ids = {id(p) for p in model.parameters()}
    model_ref = weakref.ref(model)
    GradTracer(model).__enter__()
    del model
    gc.collect()
    assert model_ref() is None
    assert not ids & _hooks._TRACED_PARAMS
    assert _hooks._TRACED_PARAMS == before


@pytest.mark.trial("extra")
def test_a_kept_tracer_never_exited_still_traces_and_frees_everything_once_dropped():
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = GradTracer(model, optimizer, activations=True).__enter__()
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    assert tracer.steps == 1
    tracer_ref = weakref.ref(tracer)
    del tracer
    gc.collect()
    assert tracer_ref() is None
    assert _hook_counts(model) == (0, 0)
    assert not optimizer._optimizer_step_post_hooks
    with GradTracer(model) as again:  # the parameters are free for a new tracer
        model(torch.randn(2, 3)).sum().backward()
        again.step()


@pytest.mark.trial("C5")
def test_meta_device_gradients_are_a_clear_error():
    grad = torch.empty(3, device="meta")
    with pytest.raises(LabkitError, match="'w' is a meta-device gradient in a"):
        compare_grads({"w": grad}, {"w": torch.zeros(3)})


@pytest.mark.trial("C6")
def test_complex_gradients_keep_their_imaginary_part():
    report = compare_grads(
        {"w": torch.tensor([1 + 1j, 2])}, {"w": torch.tensor([1 - 5j, 2 + 3j])}
    )
    (row,) = report.rows
    assert not row.exact and not row.close
    assert row.max_abs_diff == pytest.approx(6.0)
    same = compare_grads({"w": torch.tensor([1 + 1j])}, {"w": torch.tensor([1 + 1j])})
    assert same.all_exact


@pytest.mark.trial("C9")
@pytest.mark.parametrize("tolerances", [{"rtol": -1}, {"atol": -1}, {"rtol": float("nan")}, {"atol": "0"}])
def test_negative_or_non_numeric_tolerances_are_refused(tolerances):
    grads = {"w": torch.ones(2)}
    with pytest.raises(LabkitError, match=r"(rtol|atol) must be a finite number >= 0"):
        compare_grads(grads, grads, **tolerances)


@pytest.mark.trial("C12")
def test_sparse_gradients_are_compared_by_value():
    torch.manual_seed(0)
    a, b = nn.Embedding(5, 2, sparse=True), nn.Embedding(5, 2, sparse=True)
    b.load_state_dict(a.state_dict())
    index = torch.tensor([1, 3, 3])
    a(index).sum().backward()
    b(index).sum().backward()
    assert a.weight.grad.is_sparse
    assert compare_grads(a, b).all_exact
    b.weight.grad = b.weight.grad * 2
    (row,) = compare_grads(a, b).rows
    assert not row.close and row.max_abs_diff == pytest.approx(2.0)


@pytest.mark.trial("A5")
def test_graph_params_of_bare_numbers_is_a_clear_error():
    model = nn.Linear(3, 1)
    loss = model(torch.randn(2, 3)).sum()
    with pytest.raises(LabkitError, match="params must hold \\(name, tensor\\) pairs, found a int"):
        autograd_graph(loss, params=[1, 2, 3])


@pytest.mark.trial("A6")
def test_graph_params_of_a_string_is_a_clear_error():
    model = nn.Linear(3, 1)
    loss = model(torch.randn(2, 3)).sum()
    with pytest.raises(LabkitError, match="params cannot be a str"):
        autograd_graph(loss, params="weight")
    with pytest.raises(LabkitError, match="params cannot be a Parameter"):
        autograd_graph(loss, params=model.weight)


@pytest.mark.trial("extra")
def test_graph_params_with_names_that_are_not_strings_is_a_clear_error():
    model = nn.Linear(3, 1)
    loss = model(torch.randn(2, 3)).sum()
    with pytest.raises(LabkitError, match="found int -> Parameter"):
        autograd_graph(loss, params={0: model.weight})
    graph = autograd_graph(loss, params=model.named_parameters())  # a generator of pairs is fine
    assert graph.unreachable_params == ()


@pytest.mark.trial("extra")
@pytest.mark.parametrize(
    "options, message",
    [
        ({"full_every": True}, "full_every must be an integer >= 0, got True"),
        ({"max_steps": False}, "max_steps must be an integer >= 1, got False"),
        ({"baseline_steps": 2.0}, "baseline_steps must be an integer >= 1, got 2.0"),
        ({"unit_dim": "1"}, "unit_dim must be an integer"),
        ({"activations": "yes"}, "activations must be True or False, got 'yes'"),
        ({"explode_factor": True}, r"explode_factor must be a number > 1 \(.*\), got True"),
    ],
)
def test_options_of_the_wrong_type_are_refused(options, message):
    with pytest.raises(LabkitError, match=message):
        GradTracer(nn.Linear(3, 1), **options)


@pytest.mark.trial("extra")
def test_a_refused_tracer_leaves_no_hooks_and_no_ids():
    model = nn.Linear(3, 1)
    with pytest.raises(LabkitError):
        GradTracer(model, torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=0.1))
    assert _hook_counts(model) == (0, 0)
    assert not {id(p) for p in model.parameters()} & _hooks._TRACED_PARAMS


@pytest.mark.trial("extra")
def test_a_failing_backward_between_micro_batches_counts_only_the_finished_ones():
    torch.manual_seed(0)
    model, x = _FailingMiddle(), torch.randn(5, 3)
    with GradTracer(model) as tracer:
        model(x).sum().backward()
        _FailOnce.failures_left = 1
        with pytest.raises(RuntimeError, match="failed midway"):
            model(x).sum().backward()  # adds to second.* .grad, then raises
        model(x).sum().backward()
        tracer.step()
    counts = {row["param"]: row["accumulations"] for row in tracer.history()}
    assert counts == {"first.weight": 2, "first.bias": 2, "second.weight": 2, "second.bias": 2}
    assert all(math.isfinite(row["norm"]) for row in tracer.history())


@pytest.mark.trial("extra")
def test_complex_against_real_gradients_compare_the_imaginary_part_with_zero():
    (row,) = compare_grads({"w": torch.tensor([1 + 2j])}, {"w": torch.tensor([1.0])}).rows
    assert not row.exact and row.max_abs_diff == pytest.approx(2.0)
