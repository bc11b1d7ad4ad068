"""Checks for the exercises of 04_autograd_modes: a gradient through a random draw, and per-sequence
results from a padded batch.

04.1 carries case N2 (`sample()` records no graph) to a variational autoencoder's latent sample
(the planted bug draws with `torch.normal`, whose gradient with respect to the mean and the
standard deviation is zero, silently). 04.2 carries case N4 (padding runs through a recurrent net)
to the mean output of a *bidirectional* GRU (the planted bug masks the padding out of the mean,
which is right for one direction, but the backward direction starts in the padding).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from labkit.exercises import NotYet, call_and_differentiate, exercise

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "04_autograd_modes"
LATENT_ROWS, LATENT_DIMS = 8, 3
# Rows drawn to measure the sample's spread: the standard error of a std estimate is std / sqrt(2n), 1 %.
SPREAD_ROWS, SPREAD_TOLERANCE = 5000, 0.05


@exercise(
    "04.1",
    notebook=NOTEBOOK,
    title="a latent sample that the encoder can learn from",
    hint=(
        "backpropagate through your sample: what gradient reaches mu and log_var, and is it zero?",
        "torch.normal draws like sample(): the draw records no dependence on its parameters, so build z from "
        "mu and the standard deviation with noise drawn on its own",
        (
            "reparameterise: z = mu + torch.exp(0.5 * log_var) * torch.randn_like(mu) (or "
            "torch.distributions.Normal(mu, torch.exp(0.5 * log_var)).rsample()); exp(log_var) is the variance"
        ),
    ),
    planted="the gradient that reaches mu is zero",
    answer_apart=True,
)
def check_sample_latent(sample_latent: Callable) -> str:
    """The draw must have the right spread, and the exact reparameterised gradients for mu and log_var."""
    generator = torch.Generator().manual_seed(0)
    mu = torch.randn(LATENT_ROWS, LATENT_DIMS, generator=generator, dtype=torch.float64).requires_grad_()
    log_var = torch.randn(LATENT_ROWS, LATENT_DIMS, generator=generator, dtype=torch.float64).requires_grad_()
    upstream = torch.randn(LATENT_ROWS, LATENT_DIMS, generator=generator, dtype=torch.float64)
    _require_spread(sample_latent)
    differentiated = call_and_differentiate(sample_latent, (mu, log_var), wrt=(0, 1), upstream=upstream)
    z = _shaped_like_mu(differentiated.result, mu)
    if not z.requires_grad:
        raise NotYet("z does not require grad, so no gradient can reach the encoder",
                     hint="do not detach z or draw it under torch.no_grad()")
    grad_mu, grad_log_var = differentiated.gradients()
    if grad_mu is None or grad_mu.abs().max() == 0:
        raise NotYet("the gradient that reaches mu is zero (or None): the draw does not depend on mu in autograd's "
                     "eyes, so the encoder cannot learn")
    if not torch.allclose(grad_mu, upstream, rtol=1e-9, atol=1e-12):
        raise NotYet("the gradient that reaches mu is not dL/dz: z must move one for one with mu")
    # z = mu + std * noise with std = exp(log_var / 2): dz/dlog_var = std * noise / 2 = (z - mu) / 2.
    expected_log_var = upstream * (z - mu).detach() / 2
    if grad_log_var is None or grad_log_var.abs().max() == 0:
        raise NotYet("log_var gets no gradient: z moves with mu, but not with the standard deviation")
    if not torch.allclose(grad_log_var, expected_log_var, rtol=1e-9, atol=1e-12):
        raise NotYet("the gradient that reaches log_var is not that of mu + exp(log_var / 2) * noise")
    return "z has the spread exp(log_var / 2), and mu and log_var both receive the exact reparameterised gradient"


def _latent(sample_latent: Callable, mu: torch.Tensor, log_var: torch.Tensor) -> torch.Tensor:
    return _shaped_like_mu(sample_latent(mu, log_var), mu)


def _shaped_like_mu(z, mu: torch.Tensor) -> torch.Tensor:
    if not isinstance(z, torch.Tensor) or z.shape != mu.shape:
        raise NotYet(f"it returned {_describe(z)}, but a z shaped like mu {tuple(mu.shape)} was expected")
    return z


def _require_spread(sample_latent: Callable) -> None:
    """Mean 1 and standard deviation 2 (log_var = log 4) over many rows, within a few standard errors."""
    mu = torch.ones(SPREAD_ROWS, 1, dtype=torch.float64)
    log_var = torch.full((SPREAD_ROWS, 1), math.log(4.0), dtype=torch.float64)
    z = _latent(sample_latent, mu, log_var).detach()
    spread, centre = z.std().item(), z.mean().item()
    if abs(spread - 2.0) > 2.0 * SPREAD_TOLERANCE:
        raise NotYet(
            f"for log_var = log(4) your samples have standard deviation {spread:.2f}, but exp(log_var / 2) = 2"
            + (": exp(log_var) is the variance, not the standard deviation" if abs(spread - 4.0) < 0.4 else "")
        )
    if abs(centre - 1.0) > 0.1:
        raise NotYet(f"for mu = 1 your samples have mean {centre:.2f}")


@exercise(
    "04.2",
    notebook=NOTEBOOK,
    title="the mean output of each padded sequence, through a bidirectional GRU",
    hint=(
        "run one short sequence alone and compare: which half of the output (forward or backward direction) "
        "differs from the batched run?",
        "a bidirectional GRU reads each sequence from both ends; for a padded sequence the backward direction "
        "starts at the end of the padding, so masking the outputs afterwards is too late",
        (
            "pack the batch, nn.utils.rnn.pack_padded_sequence(padded, lengths, batch_first=True, "
            "enforce_sorted=False), run the GRU, unpack with nn.utils.rnn.pad_packed_sequence(..., batch_first=True), "
            "then sum over time and divide by each sequence's own length"
        ),
    ),
    planted="the backward direction started in the padding",
    answer_apart=True,
)
def check_mean_output(mean_output: Callable) -> str:
    """Against each sequence run alone, with unsorted lengths, and no gradient may enter the padding."""
    torch.manual_seed(0)
    gru = nn.GRU(3, 4, batch_first=True, bidirectional=True).double()
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([2, 5, 1, 4])
    sequences = [torch.randn(int(n), 3, generator=generator, dtype=torch.float64) for n in lengths]
    padded = pad_sequence(sequences, batch_first=True).requires_grad_()
    expected = torch.stack([gru(s[None])[0][0].mean(0) for s in sequences]).detach()
    differentiated = call_and_differentiate(mean_output, (gru, padded, lengths), wrt=(1,))
    got = differentiated.result
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        raise NotYet(f"it returned {_describe(got)}, but (N, 2 * hidden) = {tuple(expected.shape)} was expected")
    if not torch.allclose(got, expected, rtol=1e-9, atol=1e-12):
        raise NotYet(_which_part_differs(got.detach(), expected, gru, padded.detach(), lengths))
    if not got.requires_grad:
        raise NotYet("the result does not require grad, so training could not use it",
                     hint="do not detach the result or compute it under torch.no_grad()")
    (grad,) = differentiated.gradients()
    if grad is None:
        raise NotYet("no gradient reaches the padded input: the result is cut off from it in the graph")
    padding = torch.arange(padded.shape[1])[None] >= lengths[:, None]
    if grad[padding].abs().max() > 0:
        raise NotYet("gradient reaches the padding positions, so they still influence the result")
    return f"all {len(lengths)} mean outputs match each sequence run alone, in both directions, with unsorted lengths"


def _which_part_differs(got: torch.Tensor, expected: torch.Tensor, gru: nn.GRU, padded: torch.Tensor,
                        lengths: torch.Tensor) -> str:
    hidden = gru.hidden_size
    wrong = [i for i in range(len(lengths)) if not torch.allclose(got[i], expected[i], rtol=1e-9, atol=1e-12)]
    which = f"the mean outputs of the sequences with lengths {[int(lengths[i]) for i in wrong]}"
    forward_right = torch.allclose(got[:, :hidden], expected[:, :hidden], rtol=1e-9, atol=1e-12)
    if forward_right:
        return (f"{which} differ from what each gives alone in the backward direction only: the backward direction "
                f"started in the padding (it reads each sequence from position {padded.shape[1] - 1} down)")
    over_padded_length = expected * lengths[:, None].double() / padded.shape[1]
    if torch.allclose(got, over_padded_length, rtol=1e-9, atol=1e-12):
        return f"{which} are divided by the padded length {padded.shape[1]}, not by each sequence's own length"
    alone = [gru(padded[i, : int(n)][None])[0][0] for i, n in enumerate(lengths)]
    final_states = torch.stack([torch.cat([out[-1, :hidden], out[0, hidden:]]) for out in alone])
    if torch.allclose(got, final_states, rtol=1e-9, atol=1e-12):
        return f"{which} are each direction's final hidden state, not the mean of the outputs over the real steps"
    with_padding = gru(padded)[0].sum(1) / lengths[:, None].double()
    if torch.allclose(got, with_padding, rtol=1e-9, atol=1e-12):
        return (f"{which} include the outputs at the padding positions: the GRU ran over the padding, and those "
                "steps were summed in too")
    return f"{which} differ from what each sequence gives when run alone"


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
