"""Stopping what a run started: a whole process tree, on any platform, and termination requests as Ctrl-C.

Papermill starts the kernel in a session of its own and the kernel may start processes of its own
(a `sleep`, DataLoader workers, ranks), so killing papermill's process group misses them. `stop_tree`
instead walks the tree with psutil, freezes it so nothing new is started while it is being
stopped, and kills every process in it: the same on Linux, macOS and Windows (no ``os.killpg``, no
``signal.SIGKILL``, which Windows lacks). `termination_as_interrupt` turns SIGINT and SIGTERM (and SIGHUP,
SIGBREAK where they exist) into `KeyboardInterrupt`, so ``kill PID`` cleans up exactly as Ctrl-C does, and
Ctrl-C still does when the process started with SIGINT ignored (a shell script's background job), where
Python would not install its own handler.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import psutil

__all__ = ["RUN_TAG_VARIABLE", "stop_tree", "termination_as_interrupt"]

RUN_TAG_VARIABLE = "LABKIT_RUN_TAG"
"""Environment variable naming the run a process belongs to: it finds processes that left the tree."""

KILL_WAIT_SECONDS = 5.0  # how long to wait for killed processes to be gone
POLL_SECONDS = 0.05
# Signals that ask a process to end; only those this platform has are handled.
TERMINATION_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGBREAK")
                            if hasattr(signal, name))


def stop_tree(pid: int, tag: str | None = None) -> list[int]:
    """Kill process `pid` and every process below it; return the pids that outlived the kill (normally none).

    With `tag`, also every process whose environment has ``RUN_TAG_VARIABLE=tag`` (where the platform
    lets psutil read environments): a child whose parent already exited is no longer below `pid`.
    The tree is frozen first (each process suspended, then its children looked up again), so a
    process cannot start a child between the walk and the kill.
    """
    pending = _tagged(tag) if tag else []
    with contextlib.suppress(psutil.NoSuchProcess):
        pending.append(psutil.Process(pid))
    frozen: dict[int, psutil.Process] = {}
    while pending:
        process = pending.pop()
        if process.pid in frozen:
            continue
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            process.suspend()
            frozen[process.pid] = process
            pending.extend(process.children())
    for process in frozen.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    return _outliving(list(frozen.values()), KILL_WAIT_SECONDS)


def _outliving(killed: list[psutil.Process], seconds: float) -> list[int]:
    """The pids of `killed` still running after up to `seconds`; a zombie counts as gone (it runs nothing).

    psutil's `wait_procs` would wait the whole time for a zombie that no init process reaps (as in
    some containers).
    """
    deadline = time.monotonic() + seconds
    while True:
        running = []
        for process in killed:
            with contextlib.suppress(psutil.NoSuchProcess):
                if process.status() != psutil.STATUS_ZOMBIE:
                    running.append(process.pid)
        if not running or time.monotonic() >= deadline:
            return sorted(running)
        time.sleep(POLL_SECONDS)


def _tagged(tag: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():  # a run started from inside another run inherits its tag
            continue
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            if process.environ().get(RUN_TAG_VARIABLE) == tag:
                found.append(process)
    return found


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


@contextlib.contextmanager
def termination_as_interrupt():
    """Within the block, a termination signal raises KeyboardInterrupt, as Ctrl-C does (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _raise_interrupt) for signum in TERMINATION_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
