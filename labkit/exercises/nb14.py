"""Checks for the exercises of 14_data_loading (DataLoader workers: random streams and sharding).

Both checks stand in for the DataLoader's workers without starting processes: a worker is a copy
of the dataset (what `fork` gives it) plus the seed torch hands it, so the checks copy a dataset and
call the learner's function with seeds like torch's, which keeps each check well under a second.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from labkit.exercises import NotYet, exercise

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "14_data_loading"
WORKERS = 3
DRAWS = 6
# Seeds as torch makes them: a 64-bit base seed per epoch, plus the worker id. They exceed 2**32 on
# purpose, as torch's do, because np.random.seed and RandomState refuse such seeds.
EPOCH_BASE_SEEDS = (8_912_345_678_901_234_567, 3_141_592_653_589_793_238)


class _AugmentingDataset:
    """What the learner's function receives: a dataset owning a torch.Generator for its augmentation."""

    def __init__(self) -> None:
        self.images = torch.zeros(4, 2)
        self.generator = torch.Generator().manual_seed(0)

    # Its state as data, so what the answer did to it comes back from an answer's own process (answer_apart).
    def state_dict(self) -> dict:
        seeded = isinstance(self.generator, torch.Generator)
        return {"images": self.images, "generator": type(self.generator).__name__,
                "generator_state": self.generator.get_state() if seeded else None}

    def load_state_dict(self, state: dict) -> None:
        self.images = state["images"]
        if state["generator_state"] is None:  # not a torch.Generator: a stand-in, so the check words its type
            self.generator = type(str(state["generator"]), (), {})()
            return
        if not isinstance(self.generator, torch.Generator):
            self.generator = torch.Generator()
        self.generator.set_state(state["generator_state"])


@exercise(
    "14.1",
    notebook=NOTEBOOK,
    title="a random stream per worker, for a dataset that owns a torch.Generator",
    hint=(
        "print the first number each worker draws from dataset.generator: are they different?",
        "each worker gets a copy of the dataset's generator in the same state; seeding torch's global "
        "generator (which the DataLoader already does per worker) leaves that copy alone",
        (
            "seed the dataset's own generator from the worker's seed: dataset.generator.manual_seed(worker_seed), "
            "or give it a new one, dataset.generator = torch.Generator().manual_seed(worker_seed)"
        ),
    ),
    planted="drew the same numbers from dataset.generator",
    answer_apart=True,
)
def check_seed_dataset_generator(seed_dataset_generator: Callable) -> str:
    """Per-worker copies must draw different numbers, per epoch too, and the same seed must repeat."""
    draws = {}
    for epoch, base_seed in enumerate(EPOCH_BASE_SEEDS):
        for worker in range(WORKERS):
            draws[epoch, worker] = _worker_draws(seed_dataset_generator, base_seed + worker)
    _require_distinct(draws)
    again = _worker_draws(seed_dataset_generator, EPOCH_BASE_SEEDS[0])
    if not torch.equal(again, draws[0, 0]):
        raise NotYet(
            "the same worker seed gave different numbers on a second run, so a run cannot be reproduced",
            hint="derive the generator's state from worker_seed alone, not from the clock or fresh OS entropy",
        )
    return (
        f"{WORKERS} workers over {len(EPOCH_BASE_SEEDS)} epochs drew {WORKERS * len(EPOCH_BASE_SEEDS)} different "
        "streams from their dataset's torch.Generator, and the same seed repeats its stream"
    )


def _worker_draws(seed_dataset_generator: Callable, worker_seed: int) -> torch.Tensor:
    """Fork a worker's copy of the dataset, let the learner seed it, draw from its generator."""
    copied = copy.deepcopy(_AugmentingDataset())
    seed_dataset_generator(copied, worker_seed)
    generator = getattr(copied, "generator", None)
    if not isinstance(generator, torch.Generator):
        raise NotYet(
            f"after your function, dataset.generator is a {type(generator).__name__}, not a torch.Generator",
            hint="keep a torch.Generator there; seed it with its manual_seed method",
        )
    return torch.rand(DRAWS, generator=generator)


def _require_distinct(draws: dict[tuple[int, int], torch.Tensor]) -> None:
    keys = list(draws)
    for i, first in enumerate(keys):
        for second in keys[i + 1:]:
            if torch.equal(draws[first], draws[second]):
                raise NotYet(f"{_label(first)} and {_label(second)} drew the same numbers from dataset.generator")


def _label(key: tuple[int, int]) -> str:
    epoch, worker = key
    return f"worker {worker} in epoch {epoch + 1}"


SHARDING_CASES = ((0, 12, 2), (0, 10, 3), (5, 12, 2), (0, 2, 4), (7, 8, 1), (3, 3, 2))


@exercise(
    "14.2",
    notebook=NOTEBOOK,
    title="each item once, whatever the number of workers",
    hint=(
        "with 2 workers, which items does each worker yield? do they overlap?",
        "torch.utils.data.get_worker_info() tells each worker its id and the number of workers",
        (
            "give each worker a different part of range(start, end), for example every num_workers-th item "
            "starting at start + worker_id"
        ),
    ),
    planted="came more than once",
    answer_apart=True,
)
def check_worker_items(worker_items: Callable) -> str:
    """For several ranges and worker counts, the workers' items must cover the range exactly once."""
    for start, end, workers in SHARDING_CASES:
        yielded = []
        for worker in range(workers):
            yielded += _items(worker_items, start, end, worker, workers)
        _require_each_once(yielded, start, end, workers)
    return f"in {len(SHARDING_CASES)} cases, from 1 to 4 workers, every item came exactly once"


def _items(worker_items: Callable, start: int, end: int, worker: int, workers: int) -> list:
    returned = worker_items(start, end, worker, workers)
    try:
        return list(returned)
    except TypeError:
        raise NotYet(
            f"worker_items({start}, {end}, {worker}, {workers}) returned a {type(returned).__name__}, "
            "not the worker's items (a range or a list)"
        ) from None


def _require_each_once(yielded: list, start: int, end: int, workers: int) -> None:
    expected = list(range(start, end))
    duplicated = sorted({item for item in yielded if yielded.count(item) > 1})
    if duplicated:
        raise NotYet(
            f"with {workers} workers over range({start}, {end}), items {duplicated[:5]} came more than once "
            "(each worker runs __iter__ on its own copy of the dataset)"
        )
    missing = sorted(set(expected) - set(yielded))
    if missing:
        raise NotYet(f"with {workers} workers over range({start}, {end}), no worker yielded items {missing[:5]}")
    strays = sorted(set(yielded) - set(expected))
    if strays:
        raise NotYet(f"with {workers} workers over range({start}, {end}), the workers yielded {strays[:5]}, "
                     "which are outside the range")
