"""Checks for the exercises of 04_autograd_modes: a gradient through a sampled action, and the final
state of each sequence in a padded batch.

04.1 asks for an actor loss whose gradient reaches the actor (the planted bug draws the action with
`Normal.sample()`, which records no graph: case N2). 04.2 asks for each sequence's own final LSTM
state (the planted bug runs the padded batch unpacked, so `h_n` is the state after the padding:
case N4).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from labkit.exercises import NotYet, exercise

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "04_autograd_modes"
STATES = 16
FEATURES = 4


class _Actor(nn.Module):
    """A Gaussian policy head: (loc, log_scale), each (N, 1)."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.body = nn.Linear(FEATURES, 2).double()
        with torch.no_grad():
            for parameter in self.body.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * 0.3)

    def forward(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loc, log_scale = self.body(states).chunk(2, dim=1)
        return loc, log_scale


class _LinearCritic(nn.Module):
    """Q(s, a) = a * (s · c): linear in the action, so d(mean Q)/d loc does not depend on the noise."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.c = nn.Parameter(torch.randn(FEATURES, 1, generator=generator, dtype=torch.float64))

    def forward(self, states: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return actions * (states @ self.c)


@exercise(
    "04.1",
    notebook=NOTEBOOK,
    title="an actor loss that reaches the actor",
    hint=(
        "draw the action with rsample(), the reparameterised loc + scale * noise; sample() runs under "
        "no_grad, so nothing after it leads back to the actor (claim N2)"
    ),
    planted="the actor's parameters hold no gradient",
)
def check_actor_loss(actor_loss: Callable) -> str:
    """The loc head's gradient must equal its exact value; the scale head must get a gradient too."""
    generator = torch.Generator().manual_seed(0)
    actor, critic = _Actor(generator), _LinearCritic(generator)
    states = torch.randn(STATES, FEATURES, generator=generator, dtype=torch.float64)
    loss = actor_loss(actor, critic, states)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise NotYet(f"it returned {_describe(loss)}, not a one-element loss tensor")
    if not loss.requires_grad:
        raise NotYet("the loss does not require grad, so backward cannot reach anything",
                     hint="do not detach the loss or compute it under torch.no_grad()")
    loss.backward()
    weight_grad = actor.body.weight.grad
    if weight_grad is None:
        raise NotYet("after loss.backward() the actor's parameters hold no gradient (.grad is None)")
    # -mean(a * q) with a = loc + scale * noise: d/d(loc weights) = -mean(q * s) whatever the noise.
    q = (states @ critic.c).detach()
    expected_loc_grad = -(q * states).mean(0)
    if not torch.allclose(weight_grad[0], expected_loc_grad, rtol=1e-9, atol=1e-12):
        raise NotYet("the gradient that reaches the loc head is not that of -critic(states, actions).mean()",
                     hint="return -critic(states, actions).mean(), with actions drawn from Normal(loc, log_scale.exp())")
    if weight_grad[1].abs().max() == 0:
        raise NotYet("the log_scale head gets no gradient: the action does not depend on the scale",
                     hint="draw the action from Normal(loc, log_scale.exp()) with rsample()")
    return "the actor's loc and scale heads both receive the gradient of the critic's score"


@exercise(
    "04.2",
    notebook=NOTEBOOK,
    title="the final state of each padded sequence",
    hint=(
        "pack the batch first: nn.utils.rnn.pack_padded_sequence(padded, lengths, batch_first=True, "
        "enforce_sorted=False); the LSTM then stops each sequence at its own length, and h_n[-1] is its last state"
    ),
    planted="the padding steps ran through the LSTM",
)
def check_last_hidden_state(last_hidden_state: Callable) -> str:
    """Against each sequence run alone, with unsorted lengths, and no gradient may enter the padding."""
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 4, batch_first=True).double()
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([2, 5, 1, 4])
    sequences = [torch.randn(int(n), 3, generator=generator, dtype=torch.float64) for n in lengths]
    padded = pad_sequence(sequences, batch_first=True).requires_grad_()
    expected = torch.stack([lstm(s[None])[1][0][-1, 0] for s in sequences]).detach()
    got = last_hidden_state(lstm, padded, lengths)
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        raise NotYet(f"it returned {_describe(got)}, but (N, hidden) = {tuple(expected.shape)} was expected")
    if not torch.allclose(got, expected, rtol=1e-9, atol=1e-12):
        wrong = [i for i in range(len(lengths)) if not torch.allclose(got[i], expected[i], rtol=1e-9, atol=1e-12)]
        raise NotYet(
            f"the states of the sequences with lengths {[int(lengths[i]) for i in wrong]} (padded to "
            f"{int(lengths.max())}) differ from what each reaches alone: the padding steps ran through the LSTM"
        )
    if not got.requires_grad:
        raise NotYet("the result does not require grad, so training could not use it",
                     hint="do not detach the state or compute it under torch.no_grad()")
    (grad,) = torch.autograd.grad(got.sum(), padded)
    padding = torch.arange(padded.shape[1])[None] >= lengths[:, None]
    if grad[padding].abs().max() > 0:
        raise NotYet("gradient reaches the padding positions, so they still influence the result")
    return f"all {len(lengths)} final states match each sequence run alone, with unsorted lengths"


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
