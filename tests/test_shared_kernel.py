"""The notebook tests' shared kernel (tests/shared_kernel.py) gives each run what a fresh kernel gives it.

A notebook run right after one that leaves everything the reset restores changed (names, input history,
labkit's grading session, grad mode, default dtype, deterministic algorithms, matmul precision, threads,
warning filters, an open figure, matplotlib settings, the working folder) sees none of it, in the same
kernel; and 00_start_here run there after it gives exactly the records of the committed notebook's run,
which a fresh kernel made and nbval proves fresh in the same `make test`. A kernel that dies fails its
run and the next run gets a fresh kernel. However deep a run's folder, DataLoader workers under its
TMPDIR hand their batches over."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from notebook_runs import run_on_cpu, stored_run
from shared_kernel import SESSION_KERNEL, SharedKernel

from labkit.runner.paths import MULTIPROCESSING_SOCKET_TAIL, run_scratch
from labkit.runner.run import SCRATCH_FOLDER

START = Path(__file__).resolve().parents[1] / "notebooks" / "00_start_here.ipynb"

LEAVES_EVERYTHING_CHANGED = (
    "import os, warnings, torch, matplotlib, matplotlib.pyplot as plt\n"
    "from labkit import grading\n"
    "grading._SESSION['00.1'] = 'left by the run before'\n"
    "leftover = 1\n"
    "torch.set_grad_enabled(False)\n"
    "torch.set_default_dtype(torch.float64)\n"
    "torch.use_deterministic_algorithms(True)\n"
    "torch.set_float32_matmul_precision('medium')\n"
    "torch.set_num_threads(torch.get_num_threads() + 1)\n"
    "warnings.simplefilter('error')\n"
    "plt.figure()\n"
    "matplotlib.rcParams['lines.linewidth'] = 9\n"
    "os.chdir('/')"
)
SEES_A_FRESH_KERNEL = (
    "import os, sys, warnings, torch, matplotlib, matplotlib.pyplot as plt\n"
    "assert 'leftover' not in globals() and len(In) == 4, (sorted(globals()), In)\n"
    "assert 'labkit.grading' not in sys.modules, 'labkit.grading is still imported'\n"
    "assert torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32, 'grad mode or dtype'\n"
    "assert not torch.are_deterministic_algorithms_enabled(), 'deterministic algorithms'\n"
    "assert torch.get_float32_matmul_precision() == 'highest', torch.get_float32_matmul_precision()\n"
    "threads = sys.modules['_labkit_test_baseline'].threads  # the count the kernel started with\n"
    "assert torch.get_num_threads() == threads, ('threads', torch.get_num_threads(), threads)\n"
    "assert ('error', None, Warning, None, 0) not in warnings.filters, 'warning filters'\n"
    "assert plt.get_fignums() == [], plt.get_fignums()\n"
    "assert matplotlib.rcParams['lines.linewidth'] != 9, 'rcParams'\n"
    "assert os.getcwd() == folder, (os.getcwd(), folder)\n"
    "from labkit import grading\n"
    "assert grading._SESSION == {}"
)


def test_a_run_sees_nothing_the_run_before_left_and_00_then_gives_the_fresh_kernels_records(make_notebook, tmp_path):
    polluter = make_notebook("leaves_everything_changed", 'device = "cpu"', LEAVES_EVERYTHING_CHANGED)
    assert run_on_cpu(polluter, tmp_path / "before", {}).status == "ok"
    kernels = SESSION_KERNEL.starts
    checker = make_notebook("sees_a_fresh_kernel", 'device = "cpu"\nfolder = ""', SEES_A_FRESH_KERNEL)
    folder = tmp_path / "after"
    checked = run_on_cpu(checker, folder, {"folder": str(folder.resolve())})
    assert checked.status == "ok", checked.error
    assert run_on_cpu(polluter, tmp_path / "before_00", {}, reuse=False).status == "ok"
    fresh = stored_run(START)
    shared = run_on_cpu(START, tmp_path / "00", {})  # the defaults, on the CPU as the stored run was made
    assert shared.status == "ok", shared.error
    assert SESSION_KERNEL.starts == kernels, "the runs did not share the kernel"
    compared = [claim for claim in shared.claims if claim["id"] not in fresh.claims.not_compared]
    assert compared == list(fresh.claims) and compared
    assert {name: shared.metrics[name] for name in fresh.metrics} == dict(fresh.metrics) and fresh.metrics


def test_a_kernel_that_dies_fails_its_run_and_the_next_run_gets_a_fresh_kernel(make_notebook, tmp_path):
    dies = make_notebook("dies", 'device = "cpu"', "import os\nos._exit(1)")
    result = run_on_cpu(dies, tmp_path / "dies", {})
    assert result.status == "failed" and "the shared kernel failed: DeadKernelError" in result.error, result.error
    kernels = SESSION_KERNEL.starts
    after = run_on_cpu(make_notebook("after", 'device = "cpu"', "print('ran')"), tmp_path / "after", {})
    assert after.status == "ok", after.error
    assert SESSION_KERNEL.starts == kernels + 1
    assert Path(result.output).exists(), "the dead run's notebook is kept"


def test_parameters_are_checked_before_a_kernel_starts(tmp_path):
    from labkit.parameters import ParameterError

    kernel = SharedKernel()
    with pytest.raises(ParameterError, match="parameter steps expects an int"):
        kernel.run(START, tmp_path / "refused", {"steps": "ten", "device": "cpu"}, timeout=60)
    assert kernel.starts == 0 and not (tmp_path / "refused").exists()


# Two workers hand over a batch each, through a multiprocessing socket under TMPDIR, and say where their temp
# folder really lies; in a Python of its own, since multiprocessing keeps the first temp folder a process makes.
TWO_WORKERS_TWO_BATCHES = (
    "import os, tempfile, torch\n"
    "from torch.utils.data import DataLoader, TensorDataset\n"
    "loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4, num_workers=2, timeout=10)\n"
    "print(len(list(loader)), 'batches in', os.path.realpath(tempfile.gettempdir()))\n"
)
LINUX_SOCKET_PATH_MAX_BYTES = 107


def test_dataloader_workers_hand_over_their_batches_in_the_scratch_folder_of_a_deep_run_folder(tmp_path):
    # deeper than 14_data_loading's run folder under pytest-xdist, whose .tmp left no room for the socket (the
    # bind failed in the workers' feeder threads, every batch was dropped: "DataLoader timed out")
    out_dir = tmp_path / ("run-" + "x" * 60)
    out_dir.mkdir()
    folder = out_dir / SCRATCH_FOLDER
    assert len(os.fsencode(f"{folder}{MULTIPROCESSING_SOCKET_TAIL}")) > LINUX_SOCKET_PATH_MAX_BYTES
    with run_scratch(folder) as scratch:
        loaded = subprocess.run([sys.executable, "-c", TWO_WORKERS_TWO_BATCHES], capture_output=True, text=True,
                                env=dict(os.environ, TMPDIR=str(scratch)), timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout == f"2 batches in {folder.resolve()}\n"  # the files lie in the run folder all the same
    assert not folder.exists() and not scratch.exists() and not scratch.is_symlink()
