"""Small real data that ships with the packages: no downloads at run time.

`digits()` is scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes), split with a
fixed seed. `digits_tasks()` splits the classes into a pretraining task and a fine-tuning task, for
the frozen-backbone cases of `05_batchnorm_finetuning`. `regression()` and `spirals()` are generated.
"""

from __future__ import annotations

import gzip
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from labkit.errors import LabkitError

__all__ = ["Split", "digits", "digits_tasks", "regression"]


@dataclass(frozen=True)
class Split:
    """Train and test tensors: `x` float32 (N, 64) or (N, 1, 8, 8) scaled to [0, 1], `y` int64 labels."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    def to(self, device: torch.device | str) -> Split:
        return Split(*(t.to(device) for t in (self.x_train, self.y_train, self.x_test, self.y_test)))

    @property
    def classes(self) -> int:
        return int(torch.cat([self.y_train, self.y_test]).unique().numel())


def _load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    data = _digits_table()
    return torch.tensor(data[:, :-1], dtype=torch.float32) / 16.0, torch.tensor(data[:, -1], dtype=torch.int64)


# scikit-learn's own copy of the digits: 1797 rows of 64 pixel counts (0-16) and the label.
_DIGITS_CSV = ("datasets", "data", "digits.csv.gz")
_DIGITS_SHAPE = (1797, 65)


def _digits_table() -> np.ndarray:
    """The digits table as ``sklearn.datasets.load_digits`` reads it, without importing scikit-learn.

    Importing scikit-learn costs about 3 s of CPU in every kernel that loads the digits (15 of the 16
    notebooks), for a 60 KB CSV that ships inside it: the file is read where scikit-learn installed
    it, the way load_digits reads it (gzip, then np.loadtxt). Where it is not there, or not that
    table, load_digits itself answers (tests/test_datasets.py checks both are the same array)."""
    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations)), *_DIGITS_CSV)
        if path.is_file():
            with gzip.open(path, "rt", encoding="utf-8") as csv:
                table = np.loadtxt(csv, delimiter=",")
            if table.shape == _DIGITS_SHAPE:
                return table
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return np.column_stack([bunch.data, bunch.target])


def digits(test_fraction: float = 0.25, seed: int = 0, images: bool = False,
           classes: tuple[int, ...] | None = None) -> Split:
    """scikit-learn's digits as a seeded train/test split (used from `01_computation_graph` on).

    `images=True` gives (N, 1, 8, 8) for conv nets; `classes` keeps only those digits and relabels
    them 0..k-1 in the order given.
    """
    if not 0 < test_fraction < 1:
        raise LabkitError(f"test_fraction must be between 0 and 1, got {test_fraction}")
    x, y = _load_digits()
    if classes is not None:
        x, y = _keep_classes(x, y, classes)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(round(len(y) * (1 - test_fraction)))
    train, test = order[:cut], order[cut:]
    if images:
        x = x.view(-1, 1, 8, 8)
    return Split(x[train], y[train], x[test], y[test])


def _keep_classes(x: torch.Tensor, y: torch.Tensor, classes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    unknown = [c for c in classes if c not in range(10)]
    if unknown or len(set(classes)) != len(classes) or not classes:
        raise LabkitError(f"classes must be distinct digits 0-9, got {classes}")
    mask = torch.isin(y, torch.tensor(classes))
    relabel = torch.full((10,), -1, dtype=torch.int64)
    relabel[list(classes)] = torch.arange(len(classes))
    return x[mask], relabel[y[mask]]


def digits_tasks(seed: int = 0, images: bool = False) -> tuple[Split, Split]:
    """Pretraining on digits 0-4 and fine-tuning on 5-9 (a shifted task for a frozen backbone)."""
    return (digits(seed=seed, images=images, classes=(0, 1, 2, 3, 4)),
            digits(seed=seed, images=images, classes=(5, 6, 7, 8, 9)))


def regression(samples: int = 256, features: int = 8, noise: float = 0.1, seed: int = 0,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear-regression problem y = x w + noise with a seeded true w."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=generator, dtype=dtype)
    true_w = torch.randn(features, 1, generator=generator, dtype=dtype)
    return x, x @ true_w + noise * torch.randn(samples, 1, generator=generator, dtype=dtype)


def spirals(samples: int = 512, arms: int = 3, noise: float = 0.2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D, `arms`-class spiral: not linearly separable, so depth and activations matter."""
    if arms < 2:
        raise LabkitError(f"a spiral needs at least 2 arms, got {arms}")
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(samples) % arms
    radius = torch.linspace(0.05, 1.0, samples)
    angle = labels * (2 * torch.pi / arms) + radius * 4 + noise * torch.randn(samples, generator=generator)
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    return points, labels
