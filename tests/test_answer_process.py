"""How a call crosses to the answer's own process and back (`labkit._answer_process`), without the fork: the
judge's arguments are pickled as the judge sends them, the answer runs on the copy, and the reply is read back
as data, exactly as the two processes do. The forked process itself is exercised through `grading.grade_cell`
(tests/test_exercises.py, tests/reliability/test_report_forgery.py, test_grading_isolation.py)."""

from __future__ import annotations

import io
import os
import pickle
import subprocess

import pytest
import torch
from torch import nn

from labkit import _answer_process as crossing
from labkit import _resident
from labkit.exercises import Differentiated, NotYet, call_and_differentiate, run_beside_measuring_memory


def across(answer, *args, backward=None):
    """Call ``answer`` on a copy of ``args`` as the answer process would, and give the judge its reply (with
    ``backward`` = (wrt, upstream, watch): the result and the gradients, as `AnswerProcess.call_and_differentiate`)."""
    backward = None if backward is None else ("differentiate", *backward)
    arguments = crossing._stateful((args, {}))
    request = pickle.dumps((args, {}, [crossing._state(item, arguments) for item in arguments],
                            crossing._random_streams(), torch.is_grad_enabled(), backward))
    reply = crossing._answer_call(answer, pickle.loads(request))  # noqa: S301 (made just above)
    buffer = io.BytesIO()
    torch.save(reply, buffer)
    kind, result, states, streams, gradients = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert kind == "returned"
    crossing._apply_states(arguments, states)
    result = crossing._decode(result, arguments)
    if backward is None:
        return result
    grads, error, called, built_graph = gradients
    return Differentiated(result, None if grads is None else tuple(grads),
                          None if error is None else crossing._stand_in_error(*error), frozenset(called), built_graph)


def test_changes_to_the_arguments_come_back_into_the_judges_own_objects():
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = [torch.ones(2)]
    weight = model[0].weight

    def answer(model, optimizer, grads):
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
        model.eval()
        model[1].momentum = None
        grads.append(torch.full((2,), 7.0))
        grads[0].mul_(3)
        return model[0].weight, float(model[0].weight.grad.sum())

    returned, grad_sum = across(answer, model, optimizer, grads)
    assert returned is weight  # an argument comes back as itself, not a copy
    assert weight.grad is not None and float(weight.grad.sum()) == grad_sum
    assert not model.training and not model[1].training and model[1].momentum is None  # plain settings too
    assert int(model[1].num_batches_tracked) == 1  # a buffer the forward changed
    assert "momentum_buffer" in optimizer.state[weight]
    assert [g.tolist() for g in grads] == [[3.0, 3.0], [7.0, 7.0]]


def scaled_sum(x, w):
    return (x * w).sum(1)


def normalised_in_place(x, w):
    centred = x - x.mean()
    return centred.div_(centred.square().mean().sqrt()) * w  # div_ overwrites what square() saved


@pytest.mark.parametrize("answer", [scaled_sum, normalised_in_place])
def test_a_backward_pass_across_gives_what_it_gives_in_one_process(answer):
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w, upstream = torch.randn(4, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    upstream = upstream if answer is scaled_sum else torch.randn(3, 4, dtype=torch.float64)
    here = call_and_differentiate(answer, (x, w), wrt=(0,), upstream=upstream, watch=True)
    there = across(answer, x, w, backward=((0,), upstream, True))
    ran = {"mul", "sum"} if answer is scaled_sum else {"mean", "div_", "sqrt"}
    assert here.called == there.called and ran <= here.called, here.called
    assert here.built_graph and there.built_graph
    assert torch.equal(there.result, here.result.detach()) and there.result.requires_grad
    if here.error is None:
        assert torch.equal(there.grads[0], here.grads[0])
        return
    with pytest.raises(RuntimeError) as in_one:
        here.gradients()
    with pytest.raises(RuntimeError) as apart:  # a stand-in of autograd's own error type, with its message
        there.gradients()
    assert "modified by an inplace operation" in str(in_one.value)
    assert (type(apart.value).__name__, str(apart.value)) == (type(in_one.value).__name__, str(in_one.value))


def test_no_graph_gives_no_gradients_and_an_unused_input_a_none_either_way():
    x, unused = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    assert call_and_differentiate(lambda x: x.detach() * 2, (x,), wrt=(0,)).gradients() is None
    assert across(lambda x: x.detach() * 2, x, backward=((0,), None, False)).gradients() is None
    for differentiated in (call_and_differentiate(lambda x, u: x * 2, (x, unused), wrt=(0, 1)),
                           across(lambda x, u: x * 2, x, unused, backward=((0, 1), None, False))):
        grad_x, grad_unused = differentiated.gradients()
        assert torch.equal(grad_x, torch.full((2,), 2.0)) and grad_unused is None


def test_an_optimizer_brings_its_parameters_grads_and_a_scaler_its_scale():
    # 10.2's fixture: the judge sets .grad and scales; the answer gets only the scaler and the optimizer
    param = torch.zeros(3, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    param.grad = scaler.scale(torch.ones(3))

    def step_and_update(scaler, optimizer):
        scaler.step(optimizer)  # unscales the .grad it finds through the optimizer
        scaler.update(2.0)

    across(step_and_update, scaler, optimizer)
    assert torch.equal(param.detach(), torch.full((3,), -0.1)) and scaler.get_scale() == 2.0


def test_the_answer_runs_in_the_grad_mode_the_check_called_it_in():
    def graph_built(x):
        return x.requires_grad_() * 2

    for grad_mode in (True, False):
        with torch.set_grad_enabled(grad_mode):
            assert across(graph_built, torch.ones(2)).requires_grad is grad_mode


def reply_to(answer, args, after):
    """The answer process's raw reply to a call of ``answer`` on ``args`` with ``after`` (None, or ("beside", f))."""
    arguments = crossing._stateful((args, {}))
    request = pickle.dumps((args, {}, [crossing._state(item, arguments) for item in arguments],
                            crossing._random_streams(), torch.is_grad_enabled(), after))
    return crossing._answer_call(answer, pickle.loads(request))  # noqa: S301 (made just above)


def forwards_counted(answer, model):
    handle, notes = answer(model)
    model(torch.ones(1, 2))
    handle.remove()
    model(torch.ones(1, 2))
    return len(notes)


def refused(answer, model):
    answer(model)
    raise NotYet("the check's own diagnosis")


def test_a_checks_driver_runs_where_the_answer_ran_and_only_its_not_yet_is_a_verdict():
    def registers_a_hook(model):
        notes = []
        return model.register_forward_hook(lambda *_: notes.append(1)), notes

    def raises_not_yet(model):
        raise NotYet("an answer's own")

    model = nn.Linear(2, 1)
    kind, result, *_ = reply_to(registers_a_hook, (model,), ("beside", forwards_counted))
    assert (kind, crossing._decode(result, [])) == ("returned", 1)  # the hook and its handle stayed there
    assert reply_to(registers_a_hook, (model,), ("beside", refused))[:2] == ("not_yet", "the check's own diagnosis")
    assert reply_to(raises_not_yet, (model,), ("beside", refused))[:3] == ("raised", "Exception", "NotYet")


def test_an_object_that_is_not_data_comes_back_as_a_stand_in_of_its_type():
    result = across(lambda x: (os.getpid, x.new_zeros(1)), torch.ones(1))
    assert type(result[0]).__name__ == "builtin_function_or_method"
    assert torch.equal(result[1], torch.zeros(1))


def test_a_reply_that_names_a_class_is_refused_by_the_judge():
    class Payload:
        def __reduce__(self):
            return (os.system, ("true",))

    with pytest.raises(pickle.UnpicklingError):
        torch.load(io.BytesIO(pickle.dumps(("returned", Payload(), [], None), protocol=2)), weights_only=True)


def holds(answer, elements):
    """A driver: the answer's tensor of ``elements`` float64s, alive until the driver returns."""
    kept = answer(elements)
    return kept.numel()


@pytest.mark.skipif(not _resident.counted_here(), reason="the kernel keeps no peak this process can reset (no /proc)")
def test_memory_measured_beside_the_answer_is_what_its_process_held_and_none_where_the_kernel_keeps_no_count(
        monkeypatch):
    def allocate(elements):
        return torch.ones(elements, dtype=torch.float64)

    held, peak = run_beside_measuring_memory(allocate, holds, 8 * 2**20)  # 64 MiB
    # not to the byte: what the process freed meanwhile (garbage of earlier tests) is counted against it
    assert held == 8 * 2**20 and peak >= 56 * 2**20
    assert run_beside_measuring_memory(allocate, holds, 1)[1] < 8 * 2**20
    monkeypatch.setattr(_resident, "counted_here", lambda: False)
    assert run_beside_measuring_memory(allocate, holds, 8 * 2**20) == (8 * 2**20, None)


@pytest.mark.skipif(not _resident.counted_here(), reason="the kernel keeps no peak this process can reset (no /proc)")
def test_a_process_whose_memory_cannot_be_counted_fails_its_check_with_that_reason():
    ended = subprocess.Popen(["true"])
    ended.wait()  # reaped: /proc has no such process any more
    with pytest.raises(NotYet, match=f"could not count the memory of the process your function ran in \\(process "
                                     f"{ended.pid}"), _resident.PeakResident(ended.pid):
        pass


@pytest.mark.skipif(not _resident.counted_here(), reason="the kernel keeps no peak this process can reset (no /proc)")
def test_a_stretch_that_raises_stops_its_sampler_and_says_no_growth():
    with pytest.raises(ValueError, match="the answer's"), _resident.PeakResident(os.getpid()) as peak:
        raise ValueError("the answer's")
    assert peak.growth is None and not peak._sampler.is_alive()
