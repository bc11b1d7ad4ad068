"""The utilisation sampler: how busy the device was while a with-block ran."""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch

from labkit.devices import resolve_device
from labkit.errors import LabkitError
from labkit.fingerprint import _usable_cores
from labkit.probes._common import _MEASURED_KINDS, _cuda_missing
from labkit.readings import Reading

__all__ = ["UtilisationSampler"]


class UtilisationSampler:
    """Sample device utilisation in the background while a with-block runs.

    On a GPU it reads NVML through `torch.cuda.utilization`: the percentage of time in which at
    least one kernel was running, which is not how many SMs were busy. On a CPU it reads this
    process's CPU time with psutil, as a percentage of the usable cores. Used in `12_batch_size`::

        with UtilisationSampler() as sampler:
            train_a_few_steps()
        print(sampler.mean())

    One sampler can be used for several with-blocks, one after another: each block starts afresh,
    and ``mean()`` covers the last one.
    """

    def __init__(self, device=None, *, interval_s: float = 0.1):
        if not interval_s > 0:
            raise LabkitError(f"interval_s must be a positive number of seconds, not {interval_s!r}")
        self._interval_s = interval_s
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._inside = False
        self._finished = False
        dev = resolve_device(device, kinds=_MEASURED_KINDS, must_exist=False)
        self._reader, self._unreadable = _utilisation_reader(dev)
        self._reason = self._unreadable

    @property
    def samples(self) -> tuple[float, ...]:
        return tuple(self._samples)

    def __enter__(self) -> UtilisationSampler:
        if self._inside:
            raise LabkitError("this UtilisationSampler is already sampling a with-block: use one sampler per "
                              "block at a time (a second UtilisationSampler for a nested block)")
        # a fresh block: nothing kept from the last one (its stop signal included)
        self._inside, self._finished = True, False
        self._samples, self._stop, self._reason = [], threading.Event(), self._unreadable
        # The first reading is dropped: psutil's first cpu_percent only sets its baseline.
        if self._reader is not None and self._sample():
            self._samples.clear()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._sample()  # covers the stretch since the last tick
        self._inside, self._finished = False, True

    def mean(self) -> Reading:
        """Mean utilisation over the with-block, in percent."""
        if not self._finished:
            raise LabkitError(
                "read the sampler after its with-block: `with UtilisationSampler() as s: ...` then s.mean()"
            )
        if not self._samples:
            return Reading.unavailable("%", self._reason or "the with-block ended before a sample was taken")
        return Reading(statistics.fmean(self._samples), "%", "measured",
                       source=f"{self._reader.source}, mean of {len(self._samples)} samples "
                              f"every {self._interval_s} s")

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def _sample(self) -> bool:
        try:
            self._samples.append(self._reader.read())
        except self._reader.errors as err:
            # NVML failing mid-run: keep what was sampled, stop, and say why.
            self._reason = f"utilisation sampling failed: {type(err).__name__}: {err}"
            self._stop.set()
            return False
        return True


@dataclass(frozen=True)
class _Reader:
    read: Callable[[], float]
    errors: tuple[type[BaseException], ...]
    source: str


def _utilisation_reader(dev: torch.device) -> tuple[_Reader | None, str]:
    """How to read utilisation on this device, or (None, the reason it cannot be read)."""
    if dev.type == "cpu":
        process, cores = psutil.Process(), _usable_cores()
        return _Reader(lambda: process.cpu_percent(interval=None) / cores, (psutil.Error,),
                       f"psutil process CPU time as % of {cores} usable cores"), ""
    if reason := _cuda_missing(dev):
        return None, reason
    try:
        import pynvml
    except ImportError:
        return None, "needs NVML: nvidia-ml-py (pynvml) is not installed"
    # torch.cuda.utilization raises RuntimeError when the driver or the device is not visible to NVML.
    return _Reader(lambda: float(torch.cuda.utilization(dev)), (RuntimeError, pynvml.NVMLError),
                   "NVML via torch.cuda.utilization (time with a kernel running)"), ""
