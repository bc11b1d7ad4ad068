"""Run a function on several CPU processes joined into one torch.distributed group, safely.

`run_ranks(fn, world_size=2)` forks `world_size` processes, joins them into a gloo process group and
calls `fn(rank, world_size, *args)` in each; it returns what each rank returned, in rank order.
It is built so that a notebook cell can never hang on it and never leaves anything behind:

- every wait is bounded by `timeout` (the collectives too: the process group gets the same limit);
- a rank that raises, dies (killed, out of memory, a crash) or runs past the limit is reported in a
  `RankFailure` naming the rank, and the other ranks are stopped at once instead of waiting for it;
- the processes are killed and the rendezvous files removed in a `finally`, whatever happened; when
  the calling process is killed outright (SIGKILL: no `finally` runs), the ranks die with it (Linux's
  parent-death signal), and its rendezvous folder, named after its pid, is removed by the next
  `run_ranks` on the machine. Under ``python -m labkit repro`` the temporary folder lies inside the
  run folder, which the runner removes in any case.

Nothing listens beyond this machine: the ranks meet through a `FileStore` in a temporary folder (a
`TCPStore` server would listen on every network interface, not only 127.0.0.1), and gloo's own
connections use the loopback interface. Each rank runs torch on one thread, and writes whatever it
prints to a log that a failure report quotes from, so nothing from a rank reaches the notebook's outputs.

A rank function defined in a notebook cell works as it is. On a machine without an accelerator the
ranks are forked from the caller. Where torch sees an accelerator (a GPU, MPS), a forked child cannot
run backward once the caller has run one (autograd's device threads do not survive a fork: PyTorch's
"Autograd and Fork" note), so the ranks are forked from a clean server process instead
(multiprocessing's forkserver) and ``fn`` and ``args`` travel by value (cloudpickle), with the
caller's random states and default dtype, which a forked rank would have inherited.

Used in `15_distributed`.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path

import cloudpickle
import numpy as np
import psutil
import torch
import torch.distributed as dist

from labkit.errors import LabkitError
from labkit.messages import first_line

__all__ = ["RankFailure", "run_ranks"]

BACKEND = "gloo"
# gloo is pinned to the loopback interface so that nothing listens beyond this machine; Linux names it
# lo, macOS and the BSDs lo0.
LOOPBACK_INTERFACES = ("lo", "lo0")
# After the first failure, how long to wait for the other ranks' news before stopping them: it lets
# the report say which rank died first rather than only which one noticed.
SETTLE_SECONDS = 1.0
# A rank still alive this long after SIGTERM gets SIGKILL.
TERMINATE_GRACE_SECONDS = 1.0
LOG_TAIL_LINES = 5
ERROR_LINE_CHARS = 200  # how much of a rank's exception message its report quotes
MAX_WORLD_SIZE = 8
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
SCRATCH_PREFIX = "labkit-ranks-"  # then the pid of the process that called run_ranks


class RankFailure(LabkitError):
    """One or more ranks raised, died or ran past the time limit (see `run_ranks`).

    ``failures`` maps each failed rank to a one-line description; the message names the rank that
    failed first and says what happened to it.
    """

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


@dataclass
class _Rank:
    """The parent's view of one rank: its process, the pipe it reports on, its log."""

    rank: int
    process: multiprocessing.process.BaseProcess
    reader: Connection
    log: Path
    # ("ok", value), ("raised", error type, first line of its message) or ("died", how, log tail)
    outcome: tuple | None = None


def run_ranks(fn: Callable, world_size: int = 2, *, args: tuple = (), timeout: float = 60.0) -> list:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; return their results.

    The process group is initialised before ``fn`` runs and destroyed after it returns, so ``fn``
    can use `torch.distributed` collectives and `DistributedDataParallel` directly. What ``fn``
    returns must pickle (tensors, numbers, dicts of them). Raises `RankFailure`, naming the rank,
    when a rank raises, dies, or when the ranks do not all finish within ``timeout`` seconds; the
    other ranks are then stopped, so the call never outlasts ``timeout`` by more than a few seconds.
    Used in `15_distributed`.
    """
    _check_request(fn, world_size, args, timeout)
    _remove_orphaned_scratch()
    scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
    ranks: list[_Rank] = []  # filled as processes start, so that `finally` stops even a partial start
    try:
        _start(ranks, fn, world_size, args, timeout, scratch)
        _collect(ranks, deadline=time.monotonic() + timeout, timeout=timeout)
        return [rank.outcome[1] for rank in ranks]
    finally:
        _stop(ranks)
        shutil.rmtree(scratch, ignore_errors=True)


def _remove_orphaned_scratch() -> None:
    """Remove the rendezvous folders of `run_ranks` calls whose process no longer exists (it was SIGKILLed)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        owner = folder.name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not psutil.pid_exists(int(owner)):
            shutil.rmtree(folder, ignore_errors=True)  # another user's folder is theirs to remove


def _check_request(fn: Callable, world_size: int, args: tuple, timeout: float) -> None:
    if not callable(fn):
        raise LabkitError(f"run_ranks needs a function fn(rank, world_size, ...), not {type(fn).__name__}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise LabkitError(f"world_size must be a whole number from 1 to {MAX_WORLD_SIZE}, got {world_size!r}")
    if not isinstance(args, tuple):
        raise LabkitError(f"args must be a tuple of extra arguments for fn, got {type(args).__name__}")
    if not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
        raise LabkitError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if "fork" not in multiprocessing.get_all_start_methods():
        raise LabkitError("run_ranks forks its ranks, and this platform cannot fork; run it on Linux or macOS")
    loopback_interface()


def loopback_interface() -> str:
    """The name of this machine's loopback network interface (lo on Linux, lo0 on macOS), for gloo."""
    present = [name for _, name in socket.if_nameindex()]
    for name in LOOPBACK_INTERFACES:
        if name in present:
            return name
    raise LabkitError(
        f"no loopback network interface ({' or '.join(LOOPBACK_INTERFACES)}) among this machine's interfaces "
        f"{present}: gloo is pinned to the loopback interface so that nothing listens beyond this machine"
    )


def _forks_from_a_server() -> bool:
    """Whether `run_ranks` starts its ranks from a forkserver (an accelerator is present) rather than by fork."""
    return torch.accelerator.is_available()


def _start(ranks: list[_Rank], fn: Callable, world_size: int, args: tuple, timeout: float, scratch: Path) -> None:
    if _forks_from_a_server():
        context = multiprocessing.get_context("forkserver")
        # The server imports torch once, not the caller's __main__ (a kernel's launcher).
        context.set_forkserver_preload([__name__])
        multiprocessing.forkserver.ensure_running()
        parent_pid = multiprocessing.forkserver._forkserver._forkserver_pid
        call = _by_value(fn, args)
    else:
        context, parent_pid, call = multiprocessing.get_context("fork"), os.getpid(), (fn, args, None)
    store_path = scratch / "store"
    for rank in range(world_size):
        reader, writer = context.Pipe(duplex=False)
        log = scratch / f"rank{rank}.log"
        process = context.Process(
            target=_rank_main,
            args=(call, rank, world_size, str(store_path), timeout, writer, str(log), parent_pid),
            name=f"labkit-rank{rank}",
            daemon=True,  # multiprocessing stops daemonic children when this process exits
        )
        ranks.append(_Rank(rank, process, reader, log))
        process.start()
        # The parent keeps only the reading end, so a dead rank's pipe reads as closed.
        writer.close()


def _by_value(fn: Callable, args: tuple) -> bytes:
    """``fn``, ``args`` and the caller's state a forked rank would inherit, pickled by value for the server's ranks."""
    inherited = {"torch_rng": torch.get_rng_state(), "default_dtype": torch.get_default_dtype(),
                 "random": random.getstate(), "numpy": np.random.get_state()}
    try:
        return cloudpickle.dumps((fn, args, inherited))
    except Exception as error:  # cloudpickle raises whatever the object's own reduction raises
        raise LabkitError(
            f"run_ranks sends fn and args by value to its rank processes on a machine with an accelerator, and "
            f"they do not pickle: {type(error).__name__}: {first_line(str(error), ERROR_LINE_CHARS)}. Pass only "
            "tensors, numbers, modules and functions (create open files, locks or generators inside fn)"
        ) from error


def _received(call: tuple | bytes) -> tuple[Callable, tuple]:
    """The rank's ``fn`` and ``args``; a call sent by value also restores the caller's inherited state."""
    fn, args, inherited = cloudpickle.loads(call) if isinstance(call, bytes) else call
    if inherited is not None:
        torch.set_rng_state(inherited["torch_rng"])
        torch.set_default_dtype(inherited["default_dtype"])
        random.setstate(inherited["random"])
        np.random.set_state(inherited["numpy"])
    return fn, args


def _rank_main(call: tuple | bytes, rank: int, world_size: int, store_path: str, timeout: float,
               writer: Connection, log_path: str, parent_pid: int) -> None:
    """The body of one rank: join the group, run fn, send back ("ok", value) or ("raised", ...)."""
    _let_the_server_go()
    _die_with_parent(parent_pid)
    _write_output_to(log_path)
    os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
    # Two ranks sharing a couple of cores run faster single-threaded, and a forked OpenMP pool is unsafe.
    torch.set_num_threads(1)
    reported = False
    try:
        fn, args = _received(call)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(BACKEND, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        try:
            dist.barrier()  # every rank has finished connecting before any starts work
            _report(writer, ("ok", fn(rank, world_size, *args)))
            reported = True
            # Stay connected until every rank is done with fn: gloo reports a peer that left early
            # as "closed by peer", even after a collective that both sides completed.
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except Exception as error:  # reported to the parent, which raises RankFailure naming this rank
        traceback.print_exc()
        if not reported:
            _report(writer, ("raised", type(error).__name__, first_line(str(error), ERROR_LINE_CHARS)))
    writer.close()


def _report(writer: Connection, message: tuple) -> None:
    """Send one outcome to the parent; raises (before sending anything) when it does not pickle."""
    payload = pickle.dumps(message)
    sys.stdout.flush()
    sys.stderr.flush()
    writer.send_bytes(payload)


def _die_with_parent(parent_pid: int) -> None:
    """Have Linux kill this rank if the process that started it dies (a kernel killed outright, say).

    That process is the caller, or the forkserver, which exits when the caller dies. Elsewhere the
    process group's own timeout still ends an orphaned rank.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the request above took effect
        os._exit(1)


def _let_the_server_go() -> None:
    """Close the write end of the forkserver's "alive" pipe that a child of the server inherits: held
    by a rank, it keeps the server running while the rank runs, so neither would end with the caller."""
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def _write_output_to(log_path: str) -> None:
    """Send this process's prints, warnings and C++ logs to its own log file, not the notebook."""
    log = open(log_path, "w", buffering=1)  # stays open for the rank's whole life, closed when it exits
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log


def _collect(ranks: list[_Rank], deadline: float, timeout: float) -> None:
    """Wait for every rank's outcome until ``deadline``; raise RankFailure on any failure."""
    first_failure = None
    while _pending(ranks):
        now = time.monotonic()
        limit = deadline if first_failure is None else min(deadline, first_failure + SETTLE_SECONDS)
        if now >= limit:
            break
        ready = wait(_waitables(ranks), timeout=limit - now)
        for rank in _pending(ranks):
            if rank.reader in ready or rank.process.sentinel in ready:
                _read_outcome(rank)
        if first_failure is None and any(r.outcome and r.outcome[0] != "ok" for r in ranks):
            first_failure = time.monotonic()
    failed = [r for r in ranks if r.outcome is None or r.outcome[0] != "ok"]
    if failed:
        raise _failure_report(ranks, timeout, timed_out=first_failure is None)


def _pending(ranks: list[_Rank]) -> list[_Rank]:
    return [rank for rank in ranks if rank.outcome is None]


def _waitables(ranks: list[_Rank]) -> list:
    return [w for rank in _pending(ranks) for w in (rank.reader, rank.process.sentinel)]


def _read_outcome(rank: _Rank) -> None:
    """Take a rank's report from its pipe; a closed pipe without one means the rank died."""
    if rank.reader.poll(0):
        try:
            rank.outcome = pickle.loads(rank.reader.recv_bytes())
            return
        except (EOFError, OSError):
            pass  # the pipe closed without a report: the rank died, described below
    if not rank.process.is_alive():
        rank.process.join(TERMINATE_GRACE_SECONDS)
        rank.outcome = ("died", _death(rank), _log_tail(rank.log))


def _death(rank: _Rank) -> str:
    code = rank.process.exitcode
    if code is not None and code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _log_tail(log: Path) -> str:
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return f" (its log ends: {' | '.join(lines[-LOG_TAIL_LINES:])})" if lines else ""


def _failure_report(ranks: list[_Rank], timeout: float, timed_out: bool) -> RankFailure:
    """One message naming the rank to look at first: a dead rank, then a raising one, then a slow one."""
    failures, briefly = {}, {}
    for rank in ranks:
        if rank.outcome is None or rank.outcome[0] != "ok":
            failures[rank.rank], briefly[rank.rank] = _describe(rank.outcome, timeout, timed_out)
    order = {"died": 0, "raised": 1, None: 2}
    culprit = min(failures, key=lambda r: (order[ranks[r].outcome[0] if ranks[r].outcome else None], r))
    others = [r for r in failures if r != culprit]
    message = f"rank {culprit} {failures[culprit]}"
    if others:
        message += "; then " + ", ".join(f"rank {r} {briefly[r]}" for r in others)
    message += f". All {len(ranks)} rank processes have been stopped."
    return RankFailure(message, failures)


def _describe(outcome: tuple | None, timeout: float, timed_out: bool) -> tuple[str, str]:
    """A failed rank's description in full, and in brief for the ranks after the first (its report has the detail)."""
    if outcome is None:
        text = f"did not finish within {timeout:g} s" if timed_out else "was still running when it was stopped"
        return text, text
    if outcome[0] == "raised":
        _, error_type, line = outcome
        return f"raised {error_type}: {line}" if line else f"raised {error_type}", f"raised {error_type}"
    _, how, log_tail = outcome
    return f"died: {how} before returning a result{log_tail}", "died"


def _stop(ranks: list[_Rank]) -> None:
    """Terminate, then kill, every rank still running; close the pipes. Safe to call twice."""
    for rank in ranks:
        if rank.process.is_alive():
            rank.process.terminate()
    for rank in ranks:
        rank.process.join(TERMINATE_GRACE_SECONDS)
        if rank.process.is_alive():
            rank.process.kill()
            rank.process.join(TERMINATE_GRACE_SECONDS)
        rank.reader.close()

