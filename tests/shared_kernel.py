"""One Jupyter kernel for a test session's notebook runs, reset between runs.

A papermill run of a workbook notebook pays a kernel start, `import torch` and torch's first optimizer
(`torch._dynamo`) before its first cell does anything: about 5 CPU s, about 12 s on a slow host, and the
notebook tests made 25 such runs. `SharedKernel.run` runs each of them with papermill (its own
parameter injection, nbclient's execution) in one kernel that stays up, so those imports are paid once.

Between runs the kernel is reset to what a fresh kernel gives a notebook (`RESET`): an empty namespace,
input history and execution count (IPython's `reset` of a new session; `repro.check_parameters` reads
the history), labkit imported afresh (its kernel-side state, the grading session and the exercise
registry, lives in its modules), the warning filters the kernel started with, no open figure,
matplotlib's and torch's global settings at their defaults (grad mode, default dtype, deterministic
algorithms, matmul precision, threads, torch.compile's caches), and the run's own folder as working
folder and its scratch folder as TMPDIR, as `labkit.runner` gives its child (`labkit.runner.paths.run_scratch`:
reached through a short link where the run folder is too deep for a Unix socket under it). torch and the other third-party modules stay
imported: that is what is saved. tests/test_shared_kernel.py proves that a run after another run in
this kernel sees none of what that run changed, and that 00_start_here run there gives exactly the
records of a fresh kernel's run (the committed notebook's, which nbval proves fresh).

A run that fails without a kernel fault keeps the kernel; a cell that times out or a kernel that dies
ends it, and the next run starts a fresh one. labkit's runner, with its own child process, timeouts and
fault handling, is tested on its own (tests/reliability/test_runner.py, tests/test_repro.py); here it
would add a process and a kernel per run and nothing the notebook tests assert.
"""

from __future__ import annotations

import atexit
import json
import time
from dataclasses import asdict
from pathlib import Path

from labkit import runner
from labkit.notebooks import KERNELSPEC
from labkit.records import CLAIM_MIME, METRIC_MIME, stored_records
from labkit.runner.paths import inside, require_empty_folder, run_scratch
from labkit.runner.rerun_parameters import validate_parameters
from labkit.runner.run import SCRATCH_FOLDER

KERNEL_READY_S = 120
RESET_S = 120

# Run once in a new kernel: what `RESET` restores later, kept in a module, which IPython's reset leaves alone.
# The notebook's inline backend is loaded first, as a fresh kernel loads it at its first figure (and
# labkit.figures at its first described figure): its settings are part of what a notebook sees.
BASELINE = """\
import sys, types, warnings
import matplotlib, torch
if matplotlib.get_backend(auto_select=False) in ("inline", "module://matplotlib_inline.backend_inline"):
    import matplotlib_inline.backend_inline
sys.modules["_labkit_test_baseline"] = types.SimpleNamespace(
    warning_filters=list(warnings.filters), threads=torch.get_num_threads(),
    matplotlib_rc={key: value for key, value in matplotlib.rcParams.items() if key != "backend"})
"""

# Run before each notebook, with the run's folder formatted in.
RESET = """\
get_ipython().reset(new_session=True)
import os, sys, tempfile, warnings
_baseline = sys.modules["_labkit_test_baseline"]
for _name in [name for name, module in sys.modules.items() if name == "labkit" or name.startswith("labkit.")]:
    del sys.modules[_name]
warnings.resetwarnings()  # also forgets which warnings were shown once
warnings.filters[:] = _baseline.warning_filters
if "matplotlib.pyplot" in sys.modules:
    sys.modules["matplotlib.pyplot"].close("all")
import matplotlib, torch
matplotlib.rcParams.update(_baseline.matplotlib_rc)
torch.set_grad_enabled(True)
torch.set_default_dtype(torch.float32)
torch.use_deterministic_algorithms(False)
torch.set_float32_matmul_precision("highest")
torch.set_num_threads(_baseline.threads)
torch.backends.cudnn.deterministic = False
torch.backends.cudnn.benchmark = False
torch.autograd.set_detect_anomaly(False)
torch.compiler.reset()
os.chdir({folder!r})
os.environ.update(TMPDIR={scratch!r}, TEMP={scratch!r}, TMP={scratch!r}, TORCHINDUCTOR_CACHE_DIR={inductor!r})
tempfile.tempdir = None
get_ipython().reset(new_session=True)
"""


class KernelFault(RuntimeError):
    """The shared kernel could not be started or reset."""


class SharedKernel:
    """A kernel kept between `run` calls; started at the first run, and again after a kernel fault."""

    def __init__(self):
        self._manager = None
        self.starts = 0  # kernels this object started (tests/test_shared_kernel.py reads it)

    def run(self, notebook: Path, out_dir: Path, parameters: dict, timeout: float) -> runner.RunResult:
        """Execute `notebook` with papermill into `out_dir` (new or empty) in the shared kernel; a
        RunResult as `labkit.runner.run_notebook` makes it (status, error naming the cell, claims,
        metrics, the result file beside the notebook)."""
        import papermill
        from nbclient.exceptions import CellTimeoutError, DeadKernelError

        notebook = Path(notebook).resolve()
        parameters = validate_parameters(notebook, parameters)
        out_dir = require_empty_folder(out_dir, "run folder")
        output = inside(out_dir, out_dir / notebook.name)
        started = time.perf_counter()
        status, error = "ok", ""
        with run_scratch(inside(out_dir, out_dir / SCRATCH_FOLDER)) as scratch:
            try:
                self._reset(out_dir, scratch)
                papermill.execute_notebook(str(notebook), str(output), parameters=parameters, km=self._manager,
                                           kernel_name=KERNELSPEC["name"], execution_timeout=int(timeout),
                                           progress_bar=False, log_output=False)
            except papermill.PapermillExecutionError as failure:
                first_line = failure.source.strip().splitlines()[0] if failure.source.strip() else ""
                status, error = "failed", (f"{notebook.name}: cell {failure.cell_index} ({first_line!r}) raised "
                                           f"{failure.ename}: {failure.evalue}")
            except (CellTimeoutError, DeadKernelError, KernelFault, RuntimeError, TimeoutError) as fault:
                self.shutdown()  # the next run gets a fresh kernel
                status, error = "failed", f"{notebook.name}: the shared kernel failed: {type(fault).__name__}: {fault}"
        result = runner.RunResult(notebook.stem, status, round(time.perf_counter() - started, 1), str(output),
                                  parameters, error)
        if output.exists():
            result.claims = [{key: record.get(key) for key in ("id", "verdict", "evidence")}
                             | {"measured": record.get("measured", {})}
                             for record in stored_records(output, CLAIM_MIME)]
            result.metrics = {record["name"]: record["value"] for record in stored_records(output, METRIC_MIME)}
        inside(out_dir, out_dir / f"{notebook.stem}.result.json").write_text(json.dumps(asdict(result), indent=2))
        return result

    def _reset(self, folder: Path, scratch: Path) -> None:
        if self._manager is None or not self._manager.is_alive():
            self._start()
        code = RESET.format(folder=str(folder), scratch=str(scratch), inductor=str(scratch / "inductor"))
        self._execute(code, RESET_S)

    def _start(self) -> None:
        from jupyter_client import KernelManager

        self.shutdown()
        manager = KernelManager(kernel_name=KERNELSPEC["name"])
        # nbclient drives the kernel asynchronously; this module's own requests use a blocking client
        manager.client_class = "jupyter_client.asynchronous.AsyncKernelClient"
        manager.start_kernel()
        self._manager = manager
        self.starts += 1
        self._execute(BASELINE, KERNEL_READY_S)

    def _execute(self, code: str, timeout: float) -> None:
        client = self._manager.blocking_client()
        client.start_channels()
        try:
            client.wait_for_ready(timeout=KERNEL_READY_S)
            errors = []

            def keep_errors(message):
                if message["msg_type"] == "error":
                    errors.append(f"{message['content']['ename']}: {message['content']['evalue']}")

            reply = client.execute_interactive(code, store_history=False, timeout=timeout, output_hook=keep_errors)
            if reply["content"]["status"] != "ok":
                raise KernelFault(f"resetting the shared kernel failed: {errors or reply['content']}")
        finally:
            client.stop_channels()

    def shutdown(self) -> None:
        if self._manager is not None:
            manager, self._manager = self._manager, None
            if manager.has_kernel:
                manager.shutdown_kernel(now=True)


SESSION_KERNEL = SharedKernel()
atexit.register(SESSION_KERNEL.shutdown)
