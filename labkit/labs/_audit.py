"""Proof that a run trained: the optimizer stepped every time, at its learning rate, and nothing else moved the weights.

A repair could make a run's numbers look recovered without training: skip ``optimizer.step()``, set
the learning rate to zero, train some other model, or copy good weights in. `StepAudit` watches the
run's own optimizer through torch's public step hooks and names each such dodge.
"""

from __future__ import annotations

import torch

__all__: list[str] = []


class StepAudit:
    """Watches ``optimizer`` over ``params`` for one run; `problems` names each dodge found.

    The learning rate must stay ``lr``; with ``scheduled`` a schedule may lower it, but never to zero
    or above ``lr`` (a schedule stepped at the wrong time is the lab's to measure, not a dodge).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], lr: float,
                 *, scheduled: bool = False) -> None:
        self.optimizer, self.params, self.lr, self.scheduled = optimizer, list(params), lr, scheduled
        self.steps = 0
        self.moved_outside: int = 0
        self.lr_seen: set[float] = set()
        self.frozen_grad_steps = 0
        self._last = self._snapshot()
        self._handles = [optimizer.register_step_pre_hook(self._before), optimizer.register_step_post_hook(self._after)]

    def _snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]

    def _moved(self) -> bool:
        # equal_nan: a run that diverged to NaN has not moved its weights by keeping them NaN
        return any(not torch.allclose(p.detach(), last, rtol=0, atol=0, equal_nan=True)
                   for p, last in zip(self.params, self._last))

    def _before(self, optimizer, args, kwargs) -> None:
        self.moved_outside += self._moved()
        self.lr_seen |= {group["lr"] for group in optimizer.param_groups}

    def _after(self, optimizer, args, kwargs) -> None:
        self.steps += 1
        self._last = self._snapshot()

    def problems(self, expected_steps: int) -> list[str]:
        """What the run did instead of training; empty when it trained as the lab's loop asks."""
        for handle in self._handles:
            handle.remove()
        self.moved_outside += self._moved()
        found = []
        if self.steps != expected_steps:
            found.append(f"the optimizer stepped {self.steps} times where the loop asks for {expected_steps} steps "
                         "(a step was skipped, repeated, or taken by another optimizer)")
        changed = ({lr for lr in self.lr_seen if not 0 < lr <= self.lr} if self.scheduled
                   else self.lr_seen - {self.lr})
        if changed:
            found.append(f"the learning rate was changed to {sorted(changed)} from the lab's {self.lr}")
        if self.moved_outside:
            found.append(f"the model's weights changed outside optimizer.step() {self.moved_outside} times "
                         "(weights written or copied in, not trained)")
        return found
