"""Lab 14: an augmented stream loaded by two DataLoader workers; four defects of what the workers draw and hand over.

Taught in 14_data_loading (case I3, exercises 14.1 and 14.2). The model (a 12-32-4 tanh classifier)
and the data (256 rows labelled by a random linear rule, streamed by an `IterableDataset` that draws
rows at random and adds Gaussian noise, with a `torch.Generator` it owns) appear nowhere in the
notebook. The loader runs real worker processes: `WORKERS` forked per epoch, as `num_workers` does;
a worker that hangs fails the run after `WAIT_S`, and the workers of an epoch stop when its loop
ends, whatever ended it.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from labkit.labs._common import (
    audited_sgd,
    curve_text,
    interrupts_deferred,
    number,
    one_step_effect,
    relative_gap,
    seeded,
)
from labkit.labs._lab import Cause, Lab, Run, Variant

__all__: list[str] = []

# What the isolated grader (labkit.labs._isolated) lets this lab do: fork its DataLoader workers and stop them.
PROCESS_EVENTS = ("os.fork", "os.kill")

FEATURES, HIDDEN, CLASSES, ROWS, HELD_OUT = 12, 32, 4, 256, 1024
NOISE, BATCH, WORKERS, EPOCHS, SAMPLES, LR = 0.3, 16, 2, 2, 256, 0.5
WAIT_S = 20  # a worker that hands over no batch for this long fails the run (DataLoader's timeout)
# A repaired run's held-out loss may differ from the twin's by LOSS_TOLERANCE (relative): a repair that draws
# its numbers in another order trains on other samples of the same stream, up to 20% off over seeds 0-5; the
# defects that leave the stream's counts and copies alone are 1.5x or more off. The stream's own checks (samples
# per epoch, exact copies, each label and input its row's) are held to the twin's.
LOSS_TOLERANCE = 0.35
# Noise moves an input nearer another row now and then: a repair's share may be this much below the twin's.
INPUT_MATCH_SLACK = 0.05

STAGES = {
    "seed_worker": "seed_worker(dataset, worker_seed) -> None: called once in each worker process as it starts "
                   "(worker_init_fn), with that worker's copy of the dataset and get_worker_info().seed: seeds the "
                   "generator the dataset draws with (dataset.generator, a torch.Generator)",
    "worker_share": "worker_share(samples, worker_id, num_workers) -> int: how many of an epoch's samples worker "
                    "worker_id of num_workers draws, so that together the workers draw samples",
    "draw_sample": f"draw_sample(x, y, generator) -> (index, input, label): one training sample: a row index drawn "
                   f"at random with generator, that row's input plus Gaussian noise of standard deviation {NOISE} "
                   "(drawn with generator), and that row's label",
    "collate": "collate(samples) -> (indices, inputs, labels): a batch of samples as three tensors, row k of each "
               "from the same sample (rows may be reordered, e.g. sorted, if they stay together)",
}


def seed_worker(dataset, worker_seed):
    dataset.generator.manual_seed(worker_seed)


def worker_share(samples, worker_id, num_workers):
    return samples // num_workers + (worker_id < samples % num_workers)


def draw_sample(x, y, generator):
    index = int(torch.randint(len(x), (), generator=generator))
    return index, x[index] + NOISE * torch.randn(x.shape[1], generator=generator), y[index]


def collate(samples):
    indices, inputs, labels = zip(*samples)
    return torch.tensor(indices), torch.stack(inputs), torch.stack(labels)


def _seed_worker_global(dataset, worker_seed):
    torch.manual_seed(worker_seed)


def _worker_share_whole(samples, worker_id, num_workers):
    return samples


def _draw_sample_label_redrawn(x, y, generator):
    index = int(torch.randint(len(x), (), generator=generator))
    noisy = x[index] + NOISE * torch.randn(x.shape[1], generator=generator)
    return index, noisy, y[int(torch.randint(len(y), (), generator=generator))]


def _collate_sorting_inputs(samples):
    indices, inputs, labels = zip(*samples)
    inputs = torch.stack(inputs)
    return torch.tensor(indices), inputs[inputs.norm(dim=1).argsort()], torch.stack(labels)


class SampledRows(IterableDataset):
    """Each worker's copy draws its share of an epoch's samples with the generator it owns."""

    def __init__(self, x, y, stages, seed: int) -> None:
        self.x, self.y, self.stages = x, y, stages
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self):
        info = get_worker_info()
        worker_id, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for _ in range(self.stages["worker_share"](SAMPLES, worker_id, workers)):
            yield self.stages["draw_sample"](self.x, self.y, self.generator)


def _start_worker(seed_stage, worker_id) -> None:
    info = get_worker_info()
    seed_stage(info.dataset, info.seed)


def _collate_in_worker(collate_stage, samples):
    """The collate stage's batch, with the worker that made it and the torch threads it ran on.

    The batch crosses to the training process as NumPy arrays (pickled bytes), not as tensors in shared
    memory: those pass file descriptors over a socket, which the isolated grader does not allow.
    """
    info = get_worker_info()
    batch = tuple(torch.as_tensor(part).detach().numpy() for part in collate_stage(samples))
    return batch, -1 if info is None else info.id, torch.get_num_threads()


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))


def dataset(seed: int) -> tuple[torch.Tensor, ...]:
    data = torch.Generator().manual_seed(seed)
    rule = torch.randn(FEATURES, CLASSES, generator=data)
    x = torch.randn(ROWS + HELD_OUT, FEATURES, generator=data)
    y = (x @ rule).argmax(1)
    return x[:ROWS], y[:ROWS], x[ROWS:], y[ROWS:], rule


def train(stages, seed: int) -> Run:
    x, y, x_test, y_test, rule = dataset(seed)
    model = seeded(_model, seed)
    optimizer, audit = audited_sgd(list(model.parameters()), LR)
    loader = DataLoader(SampledRows(x, y, stages, seed + 1), batch_size=BATCH, num_workers=WORKERS,
                        collate_fn=partial(_collate_in_worker, stages["collate"]),
                        worker_init_fn=partial(_start_worker, stages["seed_worker"]),
                        generator=torch.Generator().manual_seed(seed + 2), timeout=WAIT_S,
                        # forked, as on Linux by default: a learner's stage defined in a notebook cell could not
                        # be imported by a spawned worker (macOS's and Windows's default)
                        multiprocessing_context="fork")
    losses, epochs, threads = [], [], set()
    for _ in range(EPOCHS):
        with interrupts_deferred():  # it forks the workers and hands them their first indices
            batches = iter(loader)
        epoch = []
        try:
            while (batch := _next_batch(batches)) is not None:
                arrays, worker, worker_threads = batch
                indices, inputs, labels = (torch.from_numpy(array) for array in arrays)
                threads.add(worker_threads)
                epoch.append((indices, inputs, labels, worker))
                loss = F.cross_entropy(model(inputs), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        finally:
            with interrupts_deferred():
                del batches  # the last reference: this epoch's workers stop now, also when the loop raised
        epochs.append(epoch)
    with torch.no_grad():
        logits = model(x_test)
        held_out_loss = F.cross_entropy(logits, y_test).item()
        accuracy = (logits.argmax(1) == y_test).float().mean().item()
        train_accuracy = (model(x).argmax(1) == y).float().mean().item()
    trace = {**_stream_health(epochs, x, y), "threads": sorted(threads), "one_step": one_step_effect(seeded(_model, seed), lambda m: F.cross_entropy(m(x), y), LR),
             "rule_accuracy": _rule_accuracy(x, y, rule, seed)}
    batches = [batch for epoch in epochs for batch in epoch]
    return Run({"held_out_loss": held_out_loss, "accuracy": accuracy, "train_accuracy": train_accuracy}, trace,
               {"model": model, "optimizer": optimizer, "losses": losses, "batches": batches,
                "x": x, "y": y, "x_test": x_test, "y_test": y_test},
               audit.problems(len(losses)))  # a step per batch the workers hand over: their count is the stream's


def _next_batch(batches):
    """The next batch the workers hand over, or None after the last: the training step between two stays
    where Ctrl-C lands (`interrupts_deferred`)."""
    with interrupts_deferred():
        return next(batches, None)


def _stream_health(epochs: list[list], x, y) -> dict:
    """What the workers handed over, per epoch: how many samples, how many duplicated, and whether each stayed paired."""
    counts, batch_counts, duplicated, label_match, input_match = [], [], [], [], []
    for epoch in epochs:
        indices = torch.cat([batch[0] for batch in epoch]) if epoch else torch.zeros(0, dtype=torch.long)
        inputs = torch.cat([batch[1] for batch in epoch]) if epoch else torch.zeros(0, FEATURES)
        labels = torch.cat([batch[2] for batch in epoch]) if epoch else torch.zeros(0, dtype=torch.long)
        counts.append(len(indices))
        batch_counts.append(len(epoch))
        if not len(indices):
            continue
        _, inverse, repeats = torch.unique(inputs, dim=0, return_inverse=True, return_counts=True)
        duplicated.append((repeats[inverse] > 1).float().mean().item())
        label_match.append((labels == y[indices]).float().mean().item())
        input_match.append((torch.cdist(inputs, x).argmin(1) == indices).float().mean().item())
    worst = {"duplicated": max(duplicated, default=0.0), "label_match": min(label_match, default=0.0),
             "input_match": min(input_match, default=0.0)}
    return {"counts": counts, "batch_counts": batch_counts, **worst, "repeated": _repeated(epochs)}


def _repeated(epochs: list[list]) -> float:
    """The share of the last epoch's inputs that the first epoch loaded too (exactly)."""
    if len(epochs) < 2 or not epochs[0] or not epochs[-1]:
        return 0.0
    first = {tuple(row.tolist()) for batch in epochs[0] for row in batch[1]}
    last = [tuple(row.tolist()) for batch in epochs[-1] for row in batch[1]]
    return sum(row in first for row in last) / len(last)


def _rule_accuracy(x, y, rule, seed: int) -> float:
    """How often the labelling rule gives a noisy copy of a training row that row's label."""
    noisy = x + NOISE * torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 3))
    return ((noisy @ rule).argmax(1) == y).float().mean().item()


def show(run: Run) -> None:
    losses = run.objects["losses"]
    print(f"training loss by step ({EPOCHS} epochs of batches of {BATCH} from {WORKERS} DataLoader workers, SGD lr "
          f"{LR}): {curve_text(losses)}")
    print("loss of the last 8 steps: " + "  ".join(number(value) for value in losses[-8:]))
    print(f"batches per epoch: {run.trace['batch_counts']}")
    print(f"accuracy: {run.metrics['train_accuracy']:.1%} on the {ROWS} training rows (no noise), "
          f"{run.metrics['accuracy']:.1%} on {HELD_OUT} held-out rows; held-out loss "
          f"{number(run.metrics['held_out_loss'])}")


def recovery(repaired: Run, twin: Run) -> tuple[bool, str]:
    mine, theirs = repaired.trace, twin.trace
    said = (f"held-out loss {number(repaired.metrics['held_out_loss'])}, the defect-free run's "
            f"{number(twin.metrics['held_out_loss'])}; per epoch {mine['counts']} samples ({theirs['counts']}), "
            f"{mine['duplicated']:.0%} of them exact copies of another ({theirs['duplicated']:.0%}), "
            f"{mine['label_match']:.0%} with their own row's label and {mine['input_match']:.0%} with their own "
            f"row's input ({theirs['label_match']:.0%} and {theirs['input_match']:.0%})")
    recovered = (mine["counts"] == theirs["counts"] and mine["duplicated"] <= theirs["duplicated"]
                 and mine["label_match"] >= theirs["label_match"] and mine["input_match"] >= theirs["input_match"] - INPUT_MATCH_SLACK
                 and relative_gap(repaired.metrics["held_out_loss"], twin.metrics["held_out_loss"]) <= LOSS_TOLERANCE)
    return recovered, said


CAUSES = (
    Cause("every worker draws the same random samples",
          lambda d, t: f"in each epoch {d.trace['duplicated']:.0%} of the loaded samples have an input that is an exact "
                       "copy of another sample's"),
    Cause("every worker draws a whole epoch",
          lambda d, t: f"the epochs load {d.trace['counts']} samples in {d.trace['batch_counts']} batches, the "
                       f"{SAMPLES} samples an epoch asks for"),
    Cause("each label is drawn from another row than its input",
          lambda d, t: f"{d.trace['label_match']:.0%} of the loaded samples carry their own row's label "
                       "(labels == y[indices])"),
    Cause("the collate function reorders the inputs without their labels",
          lambda d, t: f"{d.trace['input_match']:.0%} of the batches' inputs lie nearest their own row's input "
                       "(x[indices]), noise and all"),
    Cause("the learning rate is too low",
          lambda d, t: f"one SGD step at the run's rate on all {ROWS} training rows lowers their loss from "
                       f"{number(d.trace['one_step'][0])} to {number(d.trace['one_step'][1])}"),
    Cause("the workers' thread settings change the gradients",
          lambda d, t: f"the workers ran torch on {d.trace['threads']} thread(s) and only load samples: every forward "
                       "and backward pass of the run ran in this process"),
    Cause("the augmentation noise hides the classes",
          lambda d, t: f"at noise {NOISE} the labelling rule still gives {d.trace['rule_accuracy']:.0%} of noisy "
                       "copies of the training rows their row's label"),
)

LAB = Lab(
    id="14",
    notebook="14_data_loading",
    title="an augmented stream loaded by two DataLoader workers",
    section="Case I3: duplicated random augmentations",
    stages=STAGES,
    correct={"seed_worker": seed_worker, "worker_share": worker_share, "draw_sample": draw_sample, "collate": collate},
    causes=CAUSES,
    variants=(
        Variant("14.a", CAUSES[0].name, "the loss drops on every second step", {"seed_worker": _seed_worker_global}),
        Variant("14.b", CAUSES[1].name, "twice the batches per epoch", {"worker_share": _worker_share_whole}),
        Variant("14.c", CAUSES[2].name, "loss stays near chance", {"draw_sample": _draw_sample_label_redrawn}),
        Variant("14.d", CAUSES[3].name, "loss stays near chance", {"collate": _collate_sorting_inputs}),
    ),
    train=train,
    recovery=recovery,
    show=show,
    hints=(
        "look at what the workers hand over: lab.batches holds each step's (indices, inputs, labels, worker); compare "
        "the batches of the two workers, each sample with its row (lab.x, lab.y), and the epochs with each other",
        "the cause whose measurement is off names the stage to repair; a repaired stage keeps its contract "
        "(lab.stages), and runs inside the worker processes",
        "reread the notebook's case I3 and exercises 14.1 and 14.2 (what each worker's copy of a dataset shares with "
        "the others, and how workers split a stream), then measure your run the same way",
    ),
)
