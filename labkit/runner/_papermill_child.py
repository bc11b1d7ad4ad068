"""The child process of `labkit.runner.run.run_notebook`: papermill on one notebook, exit status by outcome.

Run as a script, ``python -P _papermill_child.py INPUT OUTPUT CWD KERNEL CELL_TIMEOUT PARAMETERS_JSON``,
so the child imports papermill and not labkit (as ``python -m papermill`` did). It does what
papermill's command line does, and exits with `DEAD_KERNEL_EXIT` when nbclient raises
`DeadKernelError`, so the parent learns that the kernel died from the exception's type rather
than from the wording of a log line. On Linux it also dies with its parent (`die_with_parent`), so a
SIGKILL of `python -m labkit repro`, which no handler can see, does not leave papermill and its kernel
running to the cell timeout.

A kernel that dies or stalls before the first cell starts is replaced once by a fresh kernel
(`KERNEL_START_TRIES`): jupyter_client picks the kernel's ports, closes them and hands them to the kernel
to bind, so another process on the machine may take one in between (a known race of Jupyter kernels,
the likely cause of the "Kernel died before replying to kernel_info" seen once in six runs of the
tests in two processes; its log was not kept, so the cause is not proven). Nothing of the notebook ran, so starting again loses nothing; once a cell has started, a
dead kernel is the notebook's failure and is never retried.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

DEAD_KERNEL_EXIT = 3
# Optional packages a dependency imports when they are installed, which this process never uses and
# which cost seconds to import. jsonschema (imported by nbformat) imports rfc3987_syntax, which Jupyter's
# jsonschema[format-nongpl] installs and which builds an Earley parser for IRIs at import: about 3.5 s of
# CPU per run. Its one use is jsonschema's "iri" format checker, and nbformat validates notebooks with
# fastjsonschema and no format checker, as papermill and nbclient do.
UNUSED_SLOW_IMPORTS = ("rfc3987_syntax",)
KERNEL_START_TRIES = 2
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
ORPHANED_EXIT = 4


def die_with_parent() -> None:
    """On Linux, have the kernel send this process SIGTERM when its parent dies, however it dies.
    papermill then ends at once, and its Jupyter kernel, which polls for its own parent
    (`JPY_PARENT_PID`), follows within a second. Elsewhere nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import os
    import signal

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        logging.warning("could not ask to die with the parent process: %s", os.strerror(ctypes.get_errno()))
    if os.getppid() != parent:  # the parent died before the request took effect
        sys.exit(ORPHANED_EXIT)


def skip_unused_slow_imports() -> None:
    """Make an import of each of `UNUSED_SLOW_IMPORTS` fail at once with the ImportError the importing
    package expects for an optional package that is absent (unless this process imported it already)."""
    for name in UNUSED_SLOW_IMPORTS:
        sys.modules.setdefault(name, None)


def main(argv: list[str]) -> int:
    die_with_parent()  # first: papermill's import takes seconds, in which the parent may die
    skip_unused_slow_imports()
    from nbclient.exceptions import DeadKernelError

    source, output, cwd, kernel, cell_timeout, parameters = argv
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # what papermill's own command line logs
    try:
        execute_with_a_fresh_kernel_if_it_did_not_start(
            dict(input_path=source, output_path=output, cwd=cwd, kernel_name=kernel,
                 execution_timeout=int(cell_timeout), parameters=json.loads(parameters), progress_bar=False))
    except DeadKernelError:
        logging.exception("the kernel died")
        return DEAD_KERNEL_EXIT
    return 0


def execute_with_a_fresh_kernel_if_it_did_not_start(papermill_arguments: dict) -> None:
    """papermill.execute_notebook, tried again (up to `KERNEL_START_TRIES` in all) while no cell has started."""
    import papermill

    for attempt in range(1, KERNEL_START_TRIES):
        try:
            papermill.execute_notebook(**papermill_arguments)
            return
        except (RuntimeError, TimeoutError):  # "Kernel died before replying to kernel_info", a start timeout
            if any_cell_started(papermill_arguments["output_path"]):
                raise
            logging.exception("the kernel did not start (try %d of %d); no cell had run, so starting a fresh one",
                              attempt, KERNEL_START_TRIES)
    papermill.execute_notebook(**papermill_arguments)


def any_cell_started(output: str) -> bool:
    """Whether papermill stamped a start time on any cell of `output` (it writes the notebook at every end)."""
    try:
        cells = json.loads(Path(output).read_text())["cells"]
    except (OSError, ValueError, KeyError):  # not written, or cut short: nothing shows a cell ran
        return False
    return any(cell.get("metadata", {}).get("papermill", {}).get("start_time") for cell in cells)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
