"""How a call crosses to the answer's own process and back (`labkit._answer_process`), without the fork: the
judge's arguments are pickled as the judge sends them, the answer runs on the copy, and the reply is read back
as data, exactly as the two processes do. The forked process itself is exercised through `grading.grade_cell`
(tests/test_exercises.py, tests/reliability/test_report_forgery.py, test_grading_isolation.py)."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch
from torch import nn

from labkit import _answer_process as crossing


def across(answer, *args):
    """Call ``answer`` on a copy of ``args`` as the answer process would, and give the judge its reply."""
    arguments = crossing._stateful((args, {}))
    request = pickle.dumps((args, {}, [crossing._state(item, arguments) for item in arguments],
                            crossing._random_streams()))
    reply = crossing._answer_call(answer, pickle.loads(request))  # noqa: S301 (made just above)
    buffer = io.BytesIO()
    torch.save(reply, buffer)
    kind, result, states, streams = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert kind == "returned"
    crossing._apply_states(arguments, states)
    return crossing._decode(result, arguments)


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
