"""How much more memory a process held during a stretch than before it, as the kernel counts it.

Linux keeps each process's peak resident set (``VmHWM`` in /proc/<pid>/status) and lets the process's owner
reset it to the present (writing 5 to /proc/<pid>/clear_refs), and says at any moment how much anonymous and
shared memory it holds (``RssAnon``, ``RssShmem``: where tensors live). A check reads both for the answer's
process from the judge's side (`labkit._answer_process`): no learner code can change what the kernel counts,
and the answer process's audit hook refuses it /proc/<pid> and ctypes, so it cannot reset its own peak
mid-call either. So a fact such as "the graphs of earlier batches were still alive" is backed by memory the
answer really held, not only by what an instrument noted in the answer's own process, which the answer can reach.

Where the kernel keeps no such count, or does not let this process reset its own (no /proc on macOS; some
sandboxed kernels), the measurement is None and a check judges by its instruments alone.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path

from labkit.exercises import NotYet

__all__: list[str] = []


@functools.cache
def counted_here() -> bool:
    """Whether this process can reset and read its own peak: then failing to for the answer's is the answer's doing."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return "VmHWM:" in Path("/proc/self/status").read_text()
    except OSError:
        return False


class PeakResident:
    """``with PeakResident(pid) as peak:`` around a stretch; after it, ``peak.growth`` is the most bytes the process
    ``pid`` held meanwhile beyond its baseline (None where the kernel keeps no count this process can read).

    Two counts, the larger taken. The kernel's peak of every page the process held (its peak reset to the
    present at the start), above what it held at the start: exact, but blind to memory the process held before
    the stretch and let go of during it, to make room. And its anonymous and shared memory (where tensors live),
    sampled every `SAMPLE_S` from a thread of this process, above what it held at ``held_since`` (for an answer
    process, what it held when it was forked, before any learner code ran), which that room counts against.
    The kernel's peak counts the library code a first call of a torch function pages in (tens of MiB) with the
    memory the stretch allocated; nothing a process does can lower either count.
    """

    def __init__(self, pid: int, held_since: int | None = None) -> None:
        self.pid, self.held_since = pid, held_since
        self.growth: int | None = None

    def __enter__(self) -> PeakResident:
        if not counted_here():
            return self
        self._reset()
        status = self._status()
        self.start, self.most_held = status["VmRSS"], status["held"]
        self.since = status["held"] if self.held_since is None else self.held_since
        self._ended = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="labkit-peak-resident", daemon=True)
        self._sampler.start()
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if not hasattr(self, "_sampler"):
            return
        self._ended.set()
        self._sampler.join()
        if kind is None:  # a stretch that raised is reported by what it raised, not by its memory
            status = self._status()
            most_held = max(self.most_held, status["held"])
            self.growth = max(0, status["VmHWM"] - self.start, most_held - self.since)

    def _sample(self) -> None:
        while not self._ended.wait(SAMPLE_S):
            try:
                self.most_held = max(self.most_held, self._status()["held"])
            except NotYet:
                return  # the process ended: the end of the stretch reads it once more and says so

    def _reset(self) -> None:
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        except OSError as error:
            raise _unmeasured(self.pid, error) from error

    def _status(self) -> dict[str, int]:
        try:
            return _counts(Path(f"/proc/{self.pid}/status").read_text())
        except OSError as error:
            raise _unmeasured(self.pid, error) from error


def measured(call: Callable[[], object], pid: int | None = None,
             held_since: int | None = None) -> tuple[object, int | None]:
    """``call()``'s result, and `PeakResident`'s growth of process ``pid`` (this one by default) while it ran."""
    with PeakResident(os.getpid() if pid is None else pid, held_since) as peak:
        result = call()
    return result, peak.growth


# How often the sampler reads the process's memory: a graph kept alive across batches is alive for many times this.
SAMPLE_S = 0.001


def held_now() -> int | None:
    """The anonymous and shared memory this process holds (an answer process forked now starts with the same)."""
    return _counts(Path("/proc/self/status").read_text())["held"] if counted_here() else None


def _counts(status: str) -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    kib = {name: int(fields[name].split()[0]) for name in ("VmHWM", "VmRSS", "RssAnon", "RssShmem")}
    return {"VmHWM": kib["VmHWM"] * 1024, "VmRSS": kib["VmRSS"] * 1024,
            "held": (kib["RssAnon"] + kib["RssShmem"]) * 1024}  # the kernel says kB


def _unmeasured(pid: int, error: OSError) -> Exception:
    """The process's own doing where this one can count its own (it changed its owner, or ended): its check fails."""
    return NotYet(f"the grader could not count the memory of the process your function ran in (process {pid}: "
                  f"{error.strerror or error}), so it cannot tell what your function kept alive")
