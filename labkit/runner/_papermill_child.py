"""The child process of `labkit.runner.run.run_notebook`: papermill on one notebook, exit status by outcome.

Run as a script, ``python -P _papermill_child.py INPUT OUTPUT CWD KERNEL CELL_TIMEOUT PARAMETERS_JSON``,
so the child imports papermill and not labkit (as ``python -m papermill`` did). It does what
papermill's command line does, and exits with `DEAD_KERNEL_EXIT` when nbclient raises
`DeadKernelError`, so the parent learns that the kernel died from the exception's type rather
than from the wording of a log line.
"""

from __future__ import annotations

import json
import logging
import sys

DEAD_KERNEL_EXIT = 3


def main(argv: list[str]) -> int:
    import papermill
    from nbclient.exceptions import DeadKernelError

    source, output, cwd, kernel, cell_timeout, parameters = argv
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # what papermill's own command line logs
    try:
        papermill.execute_notebook(source, output, parameters=json.loads(parameters), kernel_name=kernel,
                                   cwd=cwd, execution_timeout=int(cell_timeout), progress_bar=False)
    except DeadKernelError:
        logging.exception("the kernel died")
        return DEAD_KERNEL_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
