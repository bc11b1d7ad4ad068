"""The check of a lab: is the diagnosis the run's cause, and does the repaired run recover the twin?

`check_lab` is a plain function of (lab, variant, diagnosis, repair, seed, try number), so a grading
runner in another process can call it; it prints nothing and returns a `labkit.grading.Result`. The
repair is the learner's code, or a `Repair` that trains it elsewhere (in the answer's own process,
`labkit.labs._isolated`) and brings the run back as data. It judges in this order, and stops at the
first failure:
1. the diagnosis is one of the lab's causes and is the variant's cause (else: the measurement on the
   learner's own run that contradicts it);
2. the repair is code for one of the lab's stages (a function named after the stage, a dict of them,
   or source text defining them);
3. the loop reruns with the repaired stages, trains (`StepAudit`: every step taken, at the lab's
   learning rate, no weights written in) and recovers the defect-free twin's measurement within the
   lab's tolerance (else: what still differs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from labkit.grading import Result, hint_for
from labkit.labs._lab import Lab, Run
from labkit.labs._registry import lab_of
from labkit.messages import describe_error

__all__: list[str] = []

# The names a repair given as source text may use besides what it defines (as exercise cells).
REPAIR_NAMESPACE = {"torch": torch, "nn": nn, "F": F, "math": math}
MAX_ERROR_CHARS = 160


def grade_id(lab_id: str) -> str:
    """The ID a lab's verdict is recorded under, next to its notebook's exercises (``02.lab``)."""
    return f"{lab_id}.lab"


@lru_cache(maxsize=64)
def reference_runs(lab_id: str, variant_id: str, seed: int) -> tuple[Run, Run]:
    """The variant's defective run and its defect-free twin at ``seed`` (cached: both are deterministic)."""
    lab = lab_of(lab_id)
    return lab.run(lab.stages_of(lab.variant(variant_id)), seed), lab.run(dict(lab.correct), seed)


@dataclass(frozen=True)
class Repair:
    """A learner's repair as the check judges it: the stages it replaces (or why it gives none, ``problem``)
    and ``train()``, the variant's run with those stages, which raises what that run raised."""

    stages: tuple[str, ...]
    problem: str | None
    train: Callable[[], Run]


def local_repair(lab: Lab, variant_id: str, seed: int, repair: object) -> Repair:
    """``repair`` (functions, a dict of them, or source text) trained in this process."""
    stages, problem = repaired_stages(lab, repair)
    return Repair(tuple(stages), problem, lambda: lab.run({**lab.stages_of(lab.variant(variant_id)), **stages}, seed))


def check_lab(lab_id: str, variant_id: str, diagnosis: str, repair: object, *, seed: int,
              try_number: int = 1, follow_up: bool = True) -> Result:
    """The verdict on a learner's diagnosis and repair of ``variant_id`` of lab ``lab_id`` at ``seed``.

    ``repair`` is the learner's (trained here) or a `Repair`. ``follow_up=False`` (a regrade, which has no
    next try) leaves out the promise that the next hint says more.
    """
    lab = lab_of(lab_id)
    variant = lab.variant(variant_id)
    defective, twin = reference_runs(lab_id, variant_id, seed)

    def not_yet(problem: str) -> Result:
        shown, more = hint_for(lab.hints, try_number)
        return Result(grade_id(lab.id), lab.notebook, False,
                      f"✗ Lab {lab.id} not yet: {problem}. Hint: {shown.rstrip('.')}.{more if follow_up else ''}")

    names = [cause.name for cause in lab.causes]
    if diagnosis not in names:
        return not_yet(f"the diagnosis {diagnosis!r} is not one of this lab's causes; choose one of: "
                       + "; ".join(repr(name) for name in names))
    if diagnosis != variant.cause:
        measured = lab.cause(diagnosis).measure(defective, twin)
        return not_yet(f"the diagnosis {diagnosis!r} does not fit your run: {measured}")
    if not isinstance(repair, Repair):
        repair = local_repair(lab, variant.id, seed, repair)
    if repair.problem:
        return not_yet(repair.problem)
    stages = repair.stages
    try:
        repaired = repair.train()
    except KeyboardInterrupt:
        raise
    except Exception as error:
        return not_yet(f"the run with your repair raised {describe_error(error, MAX_ERROR_CHARS)}")
    if repaired.integrity:
        return not_yet("the run with your repair did not train: " + "; ".join(repaired.integrity))
    recovered, measured = lab.recovery(repaired, twin)
    if not recovered:
        return not_yet(f"the run with your repair of {', '.join(stages)} does not recover: {measured}")
    return Result(grade_id(lab.id), lab.notebook, True,
                  f"✓ Lab {lab.id} passed: the cause is {diagnosis!r}, and with your {', '.join(stages)} "
                  f"the run recovers the defect-free one ({measured}).")


def repaired_stages(lab: Lab, repair: object) -> tuple[dict[str, Callable], str | None]:
    """The stage functions a repair gives, or a sentence saying why it gives none."""
    contracts = "; ".join(f"{name}: {contract}" for name, contract in lab.stages.items())
    if isinstance(repair, str):
        namespace = dict(REPAIR_NAMESPACE)
        try:
            exec(compile(repair, f"lab {lab.id} repair", "exec"), namespace)  # noqa: S102 (the learner's repair)
        except Exception as error:
            return {}, f"your repair's code raised {describe_error(error, MAX_ERROR_CHARS)}"
        repair = {name: value for name, value in namespace.items() if name in lab.stages}
    elif callable(repair):
        repair = {getattr(repair, "__name__", ""): repair}
    if not isinstance(repair, Mapping) or not repair:
        return {}, (f"the repair must be a function named after the stage it replaces (or a dict of them); "
                    f"the stages are {contracts}")
    unknown = [str(name) for name in repair if name not in lab.stages]
    if unknown:
        return {}, f"{', '.join(unknown)} is not one of this lab's stages; the stages are {contracts}"
    if not all(callable(function) for function in repair.values()):
        return {}, "each stage of the repair must be a function (pass it without calling it)"
    return dict(repair), None
