"""Lab 11: a compiled training run that parts from eager or recompiles at every step; three things dynamo keeps.

Taught in 11_compile_drift ("Compiling costs seconds, so this notebook compiles twice" and case H1).
The model (a 12-32-4 tanh classifier of sensor readings whose logits are divided by an annealed
temperature) and its data appear nowhere in the notebook. Rows with a missing reading are dropped, so
batches vary in size; at `BREAK_STEP` a sensor breaks and the loop asks the model to ignore it.

As the notebook does for what only needs to know what `torch.compile` captures, the run compiles with
a backend that records each graph dynamo hands it and runs it as it is (no code generation), so a
check takes a second or two. Each run starts from `torch.compiler.reset()`: dynamo's caches and
recompile counts belong to a function's code, which every run's model shares. Recovery is what the
notebook measures: the compiled run's losses and weights agree with the defect-free compiled run's to
float32 rounding, every step runs a compiled graph, and it compiles no more graphs than that run.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from labkit._torch_compat import DYNAMO_RECOMPILE_LOGGER, LOG_RECOMPILES_CALL
from labkit.labs._common import audited_sgd, curve_text, number, seeded
from labkit.labs._lab import Cause, Lab, Run, Variant

__all__: list[str] = []

FEATURES, WIDTH, CLASSES = 12, 32, 4
EXAMPLES, STEPS, BATCH, LR = 1024, 30, 64, 0.3
BREAK_STEP, SENSOR, STUCK_AT, MISSING = 12, 3, 6.0, 0.15
# A repaired run may compile EXTRA_GRAPHS more graphs than the twin (a reset after registering a hook
# retraces twice); its losses and weights may differ from the twin's by AGREEMENT (relative: float32
# rounding of a graph traced another way; each defect differs by 0.05 or more, or recompiles to the limit).
EXTRA_GRAPHS, AGREEMENT = 2, 1e-4

STAGES = {
    "compile_model": "compile_model(model, backend) -> callable: once, before training: model compiled with "
                     "torch.compile and the lab's backend (batches have varying numbers of rows)",
    "drop_sensor": "drop_sensor(model, sensor) -> None: once, at the step the sensor breaks: from then on the "
                   "model's forward reads input column sensor as 0",
    "set_step": "set_step(model, step) -> None: before each step: sets model.step, which the forward's "
                "temperature schedule reads, to the step's number",
}


def compile_model(model, backend):
    return torch.compile(model, backend=backend)


def drop_sensor(model, sensor):
    model.keep[sensor] = 0.0


def set_step(model, step):
    model.step.fill_(step)


def _compile_static(model, backend):
    return torch.compile(model, backend=backend, dynamic=False)


def _drop_sensor_by_hook(model, sensor):
    def zero_sensor(module, args):
        inputs = args[0].clone()
        inputs[:, sensor] = 0.0
        return (inputs,)

    model.hidden.register_forward_pre_hook(zero_sensor)


def _set_step_number(model, step):
    model.step = step


class SensorNet(nn.Module):
    """Logits of four classes from twelve sensors; the logit temperature anneals from 2 to 1 over the run."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.head = nn.Linear(FEATURES, WIDTH), nn.Linear(WIDTH, CLASSES)
        self.register_buffer("keep", torch.ones(FEATURES))  # 0 for a sensor the model ignores
        self.step = torch.zeros(())

    def forward(self, x):
        temperature = 1.5 + 0.5 * torch.cos(torch.as_tensor(math.pi * self.step / STEPS))
        return self.head(torch.tanh(self.hidden(x * self.keep))) / temperature


class RecordingBackend:
    """A torch.compile backend that records each graph dynamo hands it and runs it as it is."""

    def __init__(self) -> None:
        self.graphs: list[dict] = []
        self.calls = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs.append({"ops": sum(node.op.startswith("call_") for node in graph_module.graph.nodes),
                            "dynamic": any(isinstance(value, torch.SymInt) for value in example_inputs)})

        def run(*args):
            self.calls += 1
            return graph_module.forward(*args)

        return run


class _DropRecompileLimitWarning(logging.Filter):
    """The run shows the limit as a symptom in its own words; dynamo's line names the guard that failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "recompile_limit" not in record.getMessage()


@contextlib.contextmanager
def _fresh_dynamo():
    warning_filter, logger = _DropRecompileLimitWarning(), logging.getLogger(DYNAMO_RECOMPILE_LOGGER)
    torch.compiler.reset()
    logger.addFilter(warning_filter)
    try:
        yield
    finally:
        logger.removeFilter(warning_filter)
        torch.compiler.reset()


def dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sensor readings, their classes (a random 12-16-4 tanh teacher), and which rows have every reading."""
    data = torch.Generator().manual_seed(seed)
    x = torch.randn(EXAMPLES, FEATURES, generator=data)
    y = (torch.tanh(x @ torch.randn(FEATURES, 16, generator=data)) @ torch.randn(16, CLASSES, generator=data)).argmax(1)
    complete = torch.rand(EXAMPLES, generator=data) > MISSING
    return x, y, complete


def _loop(stages, seed: int, compile_model) -> dict:
    x, y, complete = dataset(seed)
    model = seeded(SensorNet, seed)
    backend = RecordingBackend()
    forward = compile_model(model, backend)
    params = list(model.parameters())
    optimizer, audit = audited_sgd(params, LR)
    order = torch.Generator().manual_seed(seed + 1)
    losses, graphs, compiled_steps, calls_per_step, step_types = [], [], 0, 0, set()
    for step in range(STEPS):
        if step == BREAK_STEP:
            stages["drop_sensor"](model, SENSOR)
        stages["set_step"](model, step)
        step_types.add(type(model.step).__name__)
        rows = torch.randperm(EXAMPLES, generator=order)[:BATCH]
        rows = rows[complete[rows]]
        inputs = x[rows].clone()
        if step >= BREAK_STEP:
            inputs[:, SENSOR] = STUCK_AT
        calls = backend.calls
        loss = F.cross_entropy(forward(inputs), y[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        graphs.append(len(backend.graphs))
        compiled_steps += backend.calls > calls
        calls_per_step = max(calls_per_step, backend.calls - calls)
    return {"model": model, "optimizer": optimizer, "losses": losses, "graphs": graphs, "backend": backend,
            "compiled_steps": compiled_steps, "calls_per_step": calls_per_step, "step_types": sorted(step_types),
            "problems": audit.problems(STEPS)}


def _eager(model, backend):
    return model


def train(stages, seed: int) -> Run:
    with _fresh_dynamo():
        compiled = _loop(stages, seed, stages["compile_model"])
    eager = _loop(stages, seed, _eager)
    gaps = [abs(c - e) for c, e in zip(compiled["losses"], eager["losses"])]
    recorded = compiled["backend"].graphs
    weights = torch.cat([p.detach().flatten() for p in compiled["model"].parameters()])
    trace = {"graphs": compiled["graphs"], "compiled_steps": compiled["compiled_steps"],
             "gap_before": max(gaps[:BREAK_STEP]), "gap_after": max(gaps[BREAK_STEP:]),
             "dynamic": sum(graph["dynamic"] for graph in recorded), "first_graphs": compiled["graphs"][0],
             "calls_per_step": compiled["calls_per_step"], "step_types": compiled["step_types"],
             "eager_losses": eager["losses"]}
    return Run({"graphs": len(recorded), "eager_steps": STEPS - compiled["compiled_steps"]}, trace,
               {"model": compiled["model"], "optimizer": compiled["optimizer"], "losses": compiled["losses"],
                "eager_losses": eager["losses"], "weights": weights}, compiled["problems"])


def show(run: Run) -> None:
    print(f"compiled training loss by step ({STEPS} SGD steps of up to {BATCH} rows; sensor {SENSOR} breaks at step "
          f"{BREAK_STEP + 1}): {curve_text(run.objects['losses'])}")
    print(f"the same training eagerly (no torch.compile):       {curve_text(run.trace['eager_losses'])}")
    print(f"graphs dynamo compiled, counted after each step: {curve_text(run.trace['graphs'])}")
    eager_steps = run.metrics["eager_steps"]
    print(f"steps that ran a compiled graph: {STEPS - eager_steps} of {STEPS}"
          + (f" (dynamo stopped recompiling: {eager_steps} steps ran eagerly)" if eager_steps else ""))


def _weight_gap(repaired: Run, twin: Run) -> float:
    mine, theirs = repaired.objects["weights"], twin.objects["weights"]
    return ((mine - theirs).abs().max() / theirs.abs().max()).item()


def recovery(repaired: Run, twin: Run) -> tuple[bool, str]:
    mine, theirs = repaired.metrics, twin.metrics
    loss_gap = max(abs(a - b) / b for a, b in zip(repaired.objects["losses"], twin.objects["losses"]))
    weight_gap = _weight_gap(repaired, twin)
    said = (f"{mine['graphs']} graphs compiled and {mine['eager_steps']} steps run eagerly, the defect-free run's "
            f"{theirs['graphs']} and {theirs['eager_steps']}; the losses differ from the defect-free run's by up to "
            f"{number(loss_gap)} and the weights by {number(weight_gap)} (relative)")
    recovered = (mine["graphs"] <= theirs["graphs"] + EXTRA_GRAPHS and mine["eager_steps"] == 0
                 and loss_gap <= AGREEMENT and weight_gap <= AGREEMENT)
    return recovered, said


CAUSES = (
    Cause("a hook registered after compiling is not run by the compiled model",
          lambda d, t: "after the sensor broke, the compiled and eager runs' losses differ by at most "
                       f"{number(d.trace['gap_after'])} at any step: the compiled model runs what the eager one runs"),
    Cause("a Python number the forward reads changes every step, and dynamo recompiles for each value",
          lambda d, t: f"model.step is a {' or '.join(d.trace['step_types'])} at every step: a tensor is an input of "
                       "the graph, read afresh at each call, not a constant dynamo guards on"),
    Cause("the batch size changes and the model was compiled for static shapes",
          lambda d, t: f"{d.trace['dynamic']} of the {d.metrics['graphs']} graphs dynamo compiled take the batch size as "
                       "a symbol (dynamic shapes): a batch of a new size does not recompile them"),
    Cause("compiled gradients drift from eager beyond float32 rounding",
          lambda d, t: f"before the sensor broke, the compiled and eager runs' losses differ by at most "
                       f"{number(d.trace['gap_before'])} at any step"),
    Cause("a graph break splits the forward into pieces",
          lambda d, t: f"the first step compiled {d.trace['first_graphs']} graph, and no step ran more than "
                       f"{d.trace['calls_per_step']} compiled graph: each graph is the whole forward"),
)

LAB = Lab(
    id="11",
    notebook="11_compile_drift",
    title="a compiled training run that parts from eager or keeps recompiling",
    section="Case H1: does compilation bend the gradients?",
    stages=STAGES,
    correct={"compile_model": compile_model, "drop_sensor": drop_sensor, "set_step": set_step},
    causes=CAUSES,
    variants=(
        Variant("11.a", CAUSES[0].name, "compiled loss parts from eager when the sensor breaks",
                {"drop_sensor": _drop_sensor_by_hook}),
        Variant("11.b", CAUSES[1].name, "dynamo recompiles until it gives up", {"set_step": _set_step_number}),
        Variant("11.c", CAUSES[2].name, "dynamo recompiles until it gives up",
                {"compile_model": _compile_static}),
    ),
    train=train,
    recovery=recovery,
    show=show,
    hints=(
        "compare the compiled run with the eager one step by step, count what dynamo compiles and why "
        f"({LOG_RECOMPILES_CALL}, then lab.rerun()), and look at what the model holds "
        "(its hooks, model.step, model.keep)",
        "the cause whose measurement is off names the stage to repair; a repaired stage keeps its contract "
        "(lab.stages) and leaves the others as they are",
        "reread the notebook's section 'Compiling costs seconds, so this notebook compiles twice' and case H1 "
        "(compiled against eager, step by step), then measure your run the same way",
    ),
)
