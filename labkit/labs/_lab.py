"""What a debugging lab is: its stages, its causes (decoys included), its variants and its training run.

A lab's training is a short loop in labkit that calls a few named *stages* (small functions with a
public contract, such as ``begin_step(optimizer)``). The defect-free twin runs the correct stage of
each; a variant swaps one stage for a defective one. The learner sees the run, never the stages'
code, and repairs by writing the stage they diagnosed; the check reruns the loop with that stage.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

__all__: list[str] = []


@dataclass
class Run:
    """One training run of a lab: the numbers it is judged by, what the probes read, and its objects."""

    metrics: dict[str, float]
    trace: dict[str, list]
    objects: dict[str, object]
    integrity: list[str] = field(default_factory=list)  # ways the run dodged training (see labkit.labs._audit)


@dataclass(frozen=True)
class Cause:
    """A cause a learner may diagnose, with the measurement that shows whether a run has it.

    ``measure(defective, twin)`` returns one sentence a learner could have measured on their run;
    shown when the learner names this cause but the run has another, it is what contradicts them.
    """

    name: str
    measure: Callable[[Run, Run], str]


@dataclass(frozen=True)
class Variant:
    """One defect of a lab: its ID, the cause it has, the symptom's short name and the defective stages."""

    id: str
    cause: str
    symptom: str
    defect: Mapping[str, Callable]


@dataclass(frozen=True)
class Lab:
    """A debugging lab: a training loop with named stages, its causes and its variants.

    ``train(stages, seed)`` runs the loop with the given stage functions; ``recovery(repaired, twin)``
    returns whether the repaired run matches the twin within the lab's tolerance and a sentence with
    the measurement (what still differs, when it does not); ``show(run)`` prints what a practitioner
    would see; ``steps`` is how many optimizer steps the loop takes.
    """

    id: str
    notebook: str
    title: str
    section: str
    stages: Mapping[str, str]
    correct: Mapping[str, Callable]
    causes: tuple[Cause, ...]
    variants: tuple[Variant, ...]
    train: Callable[[Mapping[str, Callable], int], Run]
    recovery: Callable[[Run, Run], tuple[bool, str]]
    show: Callable[[Run], None]
    hints: tuple[str, ...]

    def variant(self, variant_id: str) -> Variant:
        for variant in self.variants:
            if variant.id == variant_id:
                return variant
        raise KeyError(variant_id)

    def cause(self, name: str) -> Cause:
        for cause in self.causes:
            if cause.name == name:
                return cause
        raise KeyError(name)

    def run(self, stages: Mapping[str, Callable], seed: int) -> Run:
        """``train`` on one CPU thread: the models are tiny, so more threads only wait on each other,
        and on a shared machine they multiply a check's time; torch's setting is restored after."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self.train(stages, seed)
        finally:
            torch.set_num_threads(threads)

    def stages_of(self, variant: Variant) -> dict[str, Callable]:
        """The stage functions of ``variant``'s run: the twin's, with the defective ones swapped in."""
        return {**self.correct, **variant.defect}
