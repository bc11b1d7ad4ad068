"""The runner's faults and bad input (trials R*, D1, W3 of the reliability review), replayed with real
processes and real signals: nothing a run started survives it, no run overwrites another or a
committed file, and an ambiguous or contradictory command line is an error listing the choices.

Kernel starts are the cost here, so the scratch notebooks are shared and papermill runs are few:
two module fixtures run the concurrent repros (one of them the escaping sweep) and the two workbook runs
once, for several tests, and a run that provokes a fault asserts everything that fault should show (a timeout,
a kernel killed in a cell) instead of provoking it again elsewhere (tests/test_repro.py used to).
"""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

from labkit import LabkitError
from labkit.__main__ import INTERRUPTED_EXIT, main
from labkit.distributed import SCRATCH_PREFIX, run_ranks
from labkit.runner import processes, run_notebook
from labkit.runner.paths import MULTIPROCESSING_SOCKET_TAIL, SCRATCH_LINK_PREFIX, SOCKET_PATH_MAX_BYTES, folder_name
from labkit.runner.processes import stop_tree

ROOT = Path(__file__).resolve().parents[2]
TAG_VARIABLE = "RELIABILITY_TEST_TAG"  # every process a test starts inherits it, so survivors can be found
STOP_BOUND_S = 15  # a stopped run and everything it started must be gone within this
# The fixtures' concurrent runs share two loaded cores: a test that starts them may take this long.
FIXTURE_RUN_S = 120
FIXTURE_TEST_TIMEOUT_S = 150
# The test that first asks for the two workbook runs waits for both, one with a kernel start tried twice.
WORKBOOK_TEST_TIMEOUT_S = 240

PARAMETERS = 'mode = "ok"\nlabel = "x"\nvalue = 1.0\nsteps = 3'
# "child": starts a grandchild of the kernel and waits; "sleep": only waits; "die": the kernel SIGKILLs itself, as the
# kernel killed for memory is; "ok": records where temporary files would go and returns. "started" appears in the run
# folder once the cell runs.
BODY = """
import json, os, signal, subprocess, sys, tempfile, time
if mode == "child":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    open("started", "w").write(str(child.pid))
    time.sleep(300)
elif mode == "sleep":
    open("started", "w").write("")
    time.sleep(300)
elif mode == "die":
    os.kill(os.getpid(), signal.SIGKILL)
real = os.path.realpath  # a run folder too deep for a Unix socket under it is reached through a short link
json.dump({"tmp": real(tempfile.gettempdir()), "inductor": real(os.environ.get("TORCHINDUCTOR_CACHE_DIR")),
           "runtime": real(os.environ.get("JUPYTER_RUNTIME_DIR")), "value": value, "label": label},
          open("where.json", "w"))
"""
# How a failure message quotes the scratch notebook's code cell (its first line; the parameters are cell 0).
BODY_POINTER = "'import json, os, signal, subprocess, sys, tempfile, time'"


def write_scratch_notebook(path: Path) -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    parameters = nbformat.v4.new_code_cell(PARAMETERS)
    parameters.metadata["tags"] = ["parameters"]
    nb.cells = [parameters, nbformat.v4.new_code_cell(BODY)]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A tiny workbook: notebooks/00_x, 00_x2, 01_y, 10_a, 11_b (all the scratch notebook)."""
    root = tmp_path_factory.mktemp("project")
    for stem in ("00_x", "00_x2", "01_y", "10_a", "11_b"):
        write_scratch_notebook(root / "notebooks" / f"{stem}.ipynb")
    return root


def tagged_env(tag: str) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), **{TAG_VARIABLE: tag})


def processes_tagged(tag: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(TAG_VARIABLE) == tag and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def survivors_after(tag: str, seconds: float = STOP_BOUND_S) -> list[str]:
    """The tagged processes still alive after `seconds` (killed then, so a failing test leaves none)."""
    deadline = time.monotonic() + seconds
    while (alive := processes_tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    described = []
    for process in alive:
        try:
            described.append(" ".join(process.cmdline()))
            process.kill()
        except psutil.NoSuchProcess:
            continue
    return described


def wait_for(path: Path, seconds: float = 45) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {seconds} s"
        time.sleep(0.1)


def start_repro(args: list[str], cwd: Path, tag: str) -> subprocess.Popen:
    # Started with SIGINT ignored, as a shell script's background job is: Ctrl-C must stop it all the same.
    return subprocess.Popen([sys.executable, "-m", "labkit", "repro", *args], cwd=cwd, env=tagged_env(tag),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))


def cli(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


# ---- Ctrl-C, SIGTERM and timeouts stop the whole tree ------------------------------------------

@pytest.mark.parametrize("signum", [
    pytest.param(signal.SIGINT, marks=pytest.mark.trial("R10"), id="SIGINT"),
    pytest.param(signal.SIGTERM, marks=pytest.mark.trial("R10b"), id="SIGTERM"),
])
def test_a_signal_to_repro_stops_papermill_the_kernel_and_its_child_and_keeps_the_notebook(tmp_path, signum):
    tag = uuid.uuid4().hex
    notebook = write_scratch_notebook(tmp_path / "99_scratch.ipynb")
    out = tmp_path / "run"
    repro = start_repro([str(notebook), "-p", "mode", "child", "--out", str(out)], tmp_path, tag)
    try:
        wait_for(out / "started")
        grandchild = int((out / "started").read_text())
        repro.send_signal(signum)
        _, stderr = repro.communicate(timeout=STOP_BOUND_S)
    finally:
        leftovers = survivors_after(tag)
    assert leftovers == [], f"still running after {signum.name}: {leftovers}"
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
    assert repro.returncode == INTERRUPTED_EXIT, stderr
    assert "Traceback" not in stderr
    assert "interrupted" in stderr and f"partial output kept in {out.resolve() / '99_scratch.ipynb'}" in stderr
    assert json.loads((out / "99_scratch.ipynb").read_text())["cells"], "the partial notebook is kept"
    assert json.loads((out / "99_scratch.result.json").read_text())["status"] == "interrupted"
    assert not (out / ".tmp").exists(), "the run's scratch folder is removed"


@pytest.mark.trial("R7b")
@pytest.mark.timeout(120)
def test_a_hung_run_is_stopped_at_its_timeout_with_the_kernels_own_children(tmp_path, monkeypatch):
    # The one timeout run with a kernel: it also proves what tests/test_repro.py's hung notebook did, that the
    # run ends soon after the timeout and the message names and quotes the cell it hung in.
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_VARIABLE, tag)
    notebook = write_scratch_notebook(tmp_path / "99_scratch.ipynb")
    started = time.monotonic()
    result = run_notebook(notebook, tmp_path / "run", {"mode": "child"}, timeout=30)
    took = time.monotonic() - started
    assert (tmp_path / "run" / "started").exists(), "the cell that starts a child ran before the timeout"
    assert result.status == "failed" and f"timed out after 30 s in cell 1 ({BODY_POINTER})" in result.error, result.error
    assert took < 30 + 25, f"the run ended {took:.0f} s after it started, not soon after its 30-s timeout"
    assert survivors_after(tag, seconds=5) == []


# A kernel launcher that appends a line to STARTS at every start and exits, as a kernel whose port was
# taken exits, for the first FAILS starts; later starts are a real kernel.
FLAKY_KERNEL = """
import runpy, sys
starts, fails = sys.argv[1], int(sys.argv[2])
with open(starts, "a") as file:
    file.write("start\\n")
if sum(1 for _ in open(starts)) <= fails:
    sys.exit("zmq.error.ZMQError: Address already in use (the test's simulated port race)")
sys.argv = ["ipykernel_launcher", *sys.argv[3:]]
runpy.run_module("ipykernel_launcher", run_name="__main__")
"""


def install_flaky_kernel(folder: Path, fails: int, monkeypatch) -> Path:
    """The project's kernel name, found first on JUPYTER_PATH, as FLAKY_KERNEL; returns its STARTS file."""
    from labkit.notebooks import KERNELSPEC

    spec = folder / "kernels" / KERNELSPEC["name"]
    spec.mkdir(parents=True)
    (folder / "flaky_kernel.py").write_text(FLAKY_KERNEL)
    starts = folder / "starts"
    argv = [sys.executable, str(folder / "flaky_kernel.py"), str(starts), str(fails), "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({**KERNELSPEC, "argv": argv}))
    monkeypatch.setenv("JUPYTER_PATH", str(folder))
    return starts


# A start that fails and is tried again, then succeeds, is proved by the first of the two workbook runs (the
# `two_workbook_runs` fixture): it is a successful run of the scratch notebook like any other.
@pytest.mark.parametrize("fails, mode, starts, said", [
    (2, "ok", 2, "Kernel died before replying to kernel_info"),
    # The one run whose kernel dies in a cell: it also proves what tests/test_repro.py's killed kernel did, that
    # the run ends well before its timeout and the message names and quotes the cell.
    (0, "die", 1, f"the kernel died in cell 1 ({BODY_POINTER})"),
], ids=["only-once", "a-kernel-killed-in-a-cell-is-not-restarted"])
@pytest.mark.timeout(150)
def test_a_kernel_is_replaced_once_if_it_dies_before_the_first_cell_and_never_after(tmp_path, monkeypatch, fails,
                                                                                     mode, starts, said):
    started = install_flaky_kernel(tmp_path / "jupyter", fails, monkeypatch)
    notebook = write_scratch_notebook(tmp_path / "99_scratch.ipynb")
    began = time.monotonic()
    result = run_notebook(notebook, tmp_path / "run", {"mode": mode}, timeout=120)
    took = time.monotonic() - began
    log = (tmp_path / "run" / f"{notebook.stem}.log").read_text()
    assert result.status == "failed", result.error
    assert len(started.read_text().splitlines()) == starts
    assert said in (result.error if mode == "die" else result.error + log), result.error
    if mode == "die":
        assert took < 100, f"a dead kernel ended the run after {took:.0f} s, near its 120-s timeout"


@pytest.mark.trial("R10s")
def test_ctrl_c_during_a_sweep_stops_every_running_point_at_once(tmp_path):
    tag = uuid.uuid4().hex
    notebook = write_scratch_notebook(tmp_path / "99_scratch.ipynb")
    out = tmp_path / "sweep"
    repro = start_repro([str(notebook), "-p", "mode", "sleep", "--sweep", "steps=1,2", "--workers", "2",
                         "--out", str(out)], tmp_path, tag)
    try:
        for point in ("steps=1", "steps=2"):
            wait_for(out / point / "started")
        interrupted = time.monotonic()
        repro.send_signal(signal.SIGINT)
        _, stderr = repro.communicate(timeout=STOP_BOUND_S)
        took = time.monotonic() - interrupted
    finally:
        leftovers = survivors_after(tag)
    assert leftovers == []
    assert took < 10, f"the sweep took {took:.1f} s to stop"
    assert repro.returncode == INTERRUPTED_EXIT and "Traceback" not in stderr, stderr
    for point in ("steps=1", "steps=2"):
        assert json.loads((out / point / "99_scratch.result.json").read_text())["status"] == "interrupted"
        assert f"partial output kept in {(out / point).resolve() / '99_scratch.ipynb'}" in stderr


@pytest.mark.trial("extra")
def test_the_tree_is_stopped_on_a_platform_without_killpg_or_sigkill(monkeypatch):
    # What Windows lacks; the terminator must walk and kill the tree with psutil alone. (signal.SIGKILL
    # itself stays: psutil's own POSIX kill uses it, where Windows psutil calls TerminateProcess.)
    import ast
    import inspect

    used = {node.attr for node in ast.walk(ast.parse(inspect.getsource(processes))) if isinstance(node, ast.Attribute)}
    assert not used & {"killpg", "getpgid", "SIGKILL", "setsid"}
    monkeypatch.delattr(os, "killpg")
    monkeypatch.delattr(os, "getpgid")
    tag = uuid.uuid4().hex
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\nprint('up', flush=True)\n"
         "time.sleep(300)"], env=tagged_env(tag), stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert parent.stdout.readline().strip() == "up"
    assert len(processes_tagged(tag)) == 2
    assert stop_tree(parent.pid) == []
    parent.wait(timeout=5)
    parent.stdout.close()
    assert survivors_after(tag, seconds=5) == []


# ---- two runs never share a folder; temp files stay inside the run; values as folder names never escape;
# ---- duplicates never collide --------------------------------------------------------------------

# A value aiming at the committed notebooks (R9b) and one aiming at a new folder outside runs/ (R9b2).
ESCAPES = "../../../../../notebooks,../../../../../escape_sweep"
# The second value swept twice: the duplicate of R9e, on a value that must be made safe as well, so three runs
# prove what four did with a plain `x,x`.
TWICE = ESCAPES.split(",")[1]
SWEPT = f"{ESCAPES},{TWICE}"
RUN_FILES = {"00_x.ipynb", "00_x.log", "00_x.result.json", "00_x.fingerprint.json", "where.json"}


@pytest.fixture(scope="module")
def run_and_sweep_started_together(project):
    """`repro 00_x -p value 2.0` and `repro 00_x --sweep label=<two escaping paths>,<the second again>
    --workers 3`, started together in the project, each with the default output folder (four runs).

    Both commands draw their folder from runs/00_x/ at the same moment (R11) as two single runs would, and
    every run of the four is a successful run of the scratch notebook whose folder the temp-file test reads
    (R23); the sweep's values try to escape runs/ (R9b, R9b2) and one repeats (R9e)."""
    committed = (project / "notebooks" / "00_x.ipynb").read_bytes()
    before = {p for p in project.parent.rglob("*")}
    tag = uuid.uuid4().hex
    commands = [["00_x", "-p", "value", "2.0"], ["00_x", "--sweep", f"label={SWEPT}", "--workers", "3"]]
    started = [start_repro(command, project, tag) for command in commands]
    outputs = [process.communicate(timeout=FIXTURE_RUN_S) for process in started]
    assert survivors_after(tag, seconds=5) == []
    created = {p for p in project.parent.rglob("*")} - before
    (run_code, run_out, run_err), (sweep_code, sweep_out, sweep_err) = [
        (process.returncode, stdout, stderr) for process, (stdout, stderr) in zip(started, outputs)]
    assert run_code == 0, run_err
    assert sweep_code == 0, sweep_err
    run_folder = Path(run_out.strip().rsplit(" -> ", 1)[1]).parent
    # the sweep's last line: "wrote FOLDER/sweep.csv, FOLDER/sweep.json, ..."
    sweep_folder = Path(sweep_out.strip().splitlines()[-1].removeprefix("wrote ").split(", ")[0]).parent
    return {"run": run_folder, "sweep": sweep_folder, "committed": committed, "created": created}


def sweep_points(sweep_folder: Path) -> list[Path]:
    return sorted(p for p in sweep_folder.iterdir() if p.is_dir())


@pytest.mark.trial("R11")
@pytest.mark.timeout(FIXTURE_TEST_TIMEOUT_S)
def test_two_runs_started_together_get_two_complete_folders(project, run_and_sweep_started_together):
    run, sweep = run_and_sweep_started_together["run"], run_and_sweep_started_together["sweep"]
    assert run != sweep
    assert run.parent == sweep.parent == (project / "runs" / "00_x").resolve()
    assert RUN_FILES <= {p.name for p in run.iterdir()}
    assert json.loads((run / "00_x.result.json").read_text())["parameters"] == {"value": 2.0}
    assert (sweep / "sweep.json").exists() and not (sweep / "00_x.ipynb").exists()
    assert len(sweep_points(sweep)) == 3
    labels = []
    for point in sweep_points(sweep):
        assert RUN_FILES <= {p.name for p in point.iterdir()}
        labels.append(json.loads((point / "00_x.result.json").read_text())["parameters"]["label"])
    assert sorted(labels) == sorted(SWEPT.split(","))


@pytest.mark.trial("R23")
@pytest.mark.timeout(FIXTURE_TEST_TIMEOUT_S)
def test_temporary_files_and_the_inductor_cache_live_in_the_run_folder_and_are_removed(run_and_sweep_started_together):
    folders = [run_and_sweep_started_together["run"], *sweep_points(run_and_sweep_started_together["sweep"])]
    assert len(folders) == 4
    for folder in folders:
        where = json.loads((folder / "where.json").read_text())
        for key in ("tmp", "inductor", "runtime"):
            assert Path(where[key]).is_relative_to(folder.resolve()), (key, where[key])
        assert not (folder / ".tmp").exists()
    # the sweep's escaping labels make its points' folders too deep for a socket under them: the link was used
    assert any(len(os.fsencode(f"{folder}/.tmp{MULTIPROCESSING_SOCKET_TAIL}")) > SOCKET_PATH_MAX_BYTES
               for folder in folders)
    links = [Path(os.readlink(link)) for link in Path(tempfile.gettempdir()).glob(f"{SCRATCH_LINK_PREFIX}*")]
    assert not [link for link in links if any(link.is_relative_to(folder.resolve()) for folder in folders)]


@pytest.mark.trial("R16")
def test_a_timeout_must_be_positive_and_its_message_is_true(tmp_path, capsys):
    notebook = write_scratch_notebook(tmp_path / "99_scratch.ipynb")
    for timeout in ("0", "-5"):
        code, text = cli(["repro", str(notebook), "--timeout", timeout, "--out", str(tmp_path / "never")], capsys)
        assert code == 2 and f"--timeout must be a positive number of seconds, got {float(timeout)!r}" in text
    assert not (tmp_path / "never").exists()
    result = run_notebook(notebook, tmp_path / "run", {"mode": "sleep"}, timeout=1)  # never ends by itself
    assert result.status == "failed" and "timed out after 1 s" in result.error
    kept = tmp_path / "run" / "99_scratch.ipynb"
    if kept.exists():
        assert f"partial output kept in {kept.resolve()}" in result.error
    else:
        assert "no notebook was written" in result.error and "partial output kept" not in result.error


@pytest.mark.trial("D1")
@pytest.mark.timeout(90)
def test_the_ranks_folder_of_a_killed_parent_is_removed_by_the_next_run_ranks(tmp_path, monkeypatch):
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    tag = uuid.uuid4().hex
    script = ("import time\nfrom labkit.distributed import run_ranks\n"
              "def wait(rank, world_size):\n    print('ranks up', flush=True)\n    time.sleep(60)\n"
              "run_ranks(wait, 1, timeout=60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT,
                              env=dict(tagged_env(tag), TMPDIR=str(scratch_root)))
    try:
        deadline = time.monotonic() + 60
        while not (left := list(scratch_root.glob(f"{SCRATCH_PREFIX}{parent.pid}-*"))):
            assert time.monotonic() < deadline and parent.poll() is None, "run_ranks never made its folder"
            time.sleep(0.1)
        wait_for(left[0] / "rank0.log")
    finally:
        parent.kill()  # SIGKILL: no finally of run_ranks runs
        parent.wait()
    assert survivors_after(tag) == [], "the rank dies with its parent"
    assert left[0].exists()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch_root))
    assert run_ranks(lambda rank, world_size: rank, 1, timeout=30) == [0]
    assert list(scratch_root.iterdir()) == []


# ---- folder names from values -------------------------------------------------------------------

@pytest.mark.trial("R9b")
@pytest.mark.trial("R9b2")
@pytest.mark.timeout(FIXTURE_TEST_TIMEOUT_S)
def test_a_sweep_value_cannot_escape_runs_or_overwrite_a_committed_notebook(project, run_and_sweep_started_together):
    committed, created = run_and_sweep_started_together["committed"], run_and_sweep_started_together["created"]
    assert (project / "notebooks" / "00_x.ipynb").read_bytes() == committed
    runs = project / "runs" / "00_x"
    outside = sorted(str(p) for p in created if not p.is_relative_to(runs) and p != runs and p != runs.parent)
    assert outside == [], f"written outside runs/00_x/: {outside}"
    sweep_folder = next(p for p in runs.iterdir() if (p / "sweep.json").exists())
    labels = {}
    for folder in sweep_folder.iterdir():
        if folder.is_dir():
            labels[folder.name] = json.loads((folder / "where.json").read_text())["label"]
    assert sorted(labels.values()) == sorted(SWEPT.split(","))
    assert all(".." not in name and "/" not in name for name in labels)


@pytest.mark.trial("R9e")
@pytest.mark.timeout(FIXTURE_TEST_TIMEOUT_S)
def test_duplicate_sweep_values_get_two_complete_folders(run_and_sweep_started_together, project):
    sweep_folder = next(p for p in (project / "runs" / "00_x").iterdir() if (p / "sweep.json").exists())
    name = folder_name({"label": TWICE})
    twins = sorted(p.name for p in sweep_folder.iterdir() if p.name.startswith(name))
    assert twins == [name, f"{name}~2"]
    for twin in twins:
        assert json.loads((sweep_folder / twin / "00_x.result.json").read_text())["status"] == "ok"
        assert json.loads((sweep_folder / twin / "where.json").read_text())["label"] == TWICE
    assert len(json.loads((sweep_folder / "sweep.json").read_text())) == 3


@pytest.mark.trial("extra")
def test_folder_names_from_values_are_unique_and_readable():
    assert folder_name({"steps": 2, "lr": 0.1}) == "steps=2,lr=0.1"
    tricky = ["a/b", "a_b", "a\\b", "..", "x" * 200, "a b", "\x00"]
    names = [folder_name({"label": value}) for value in tricky]
    assert len(set(names)) == len(names)
    assert all("/" not in n and "\\" not in n and ".." not in n and "\x00" not in n and len(n) < 80 for n in names)
    assert names[0].startswith("label=a_b~")


@pytest.fixture(scope="module")
def two_workbook_runs(project, tmp_path_factory):
    """`workbook 01_y --out runs/wb`, twice, in the project, with a kernel whose first start fails (as when
    its port is taken): the first run's start is tried again; the second run's kernel starts at once.
    Returns the runs folder, each run's (exit code, output) and the kernel launcher's starts file."""
    outputs = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(project)
        starts = install_flaky_kernel(tmp_path_factory.mktemp("jupyter"), 1, monkeypatch)
        out = project / "runs" / "wb"
        for _ in range(2):
            with contextlib.redirect_stdout(io.StringIO()) as stdout, contextlib.redirect_stderr(io.StringIO()) as stderr:
                code = main(["workbook", "01_y", "--out", str(out)])
            outputs.append((code, stdout.getvalue() + stderr.getvalue()))
    return out, outputs, starts


@pytest.mark.trial("extra")
@pytest.mark.timeout(WORKBOOK_TEST_TIMEOUT_S)
def test_a_kernel_that_dies_before_the_first_cell_is_replaced_and_the_run_succeeds(two_workbook_runs):
    out, outputs, starts = two_workbook_runs
    (first_code, first_text), _ = outputs
    assert first_code == 0, first_text
    # the first run's own folder, from what it printed (two runs started in one second sort by a random suffix)
    first = Path(first_text.split("summary: ", 1)[1].split()[0]).parent / "01_y"
    assert json.loads((first / "01_y.result.json").read_text())["status"] == "ok"
    assert "the kernel did not start (try 1 of 2)" in (first / "01_y.log").read_text()
    assert json.loads((first / "where.json").read_text())["value"] == 1.0, "the fresh kernel ran the cells"
    # two starts for the first run (the failed one and its replacement), one for the second
    assert len(starts.read_text().splitlines()) == 3


@pytest.mark.trial("extra")
@pytest.mark.timeout(WORKBOOK_TEST_TIMEOUT_S)
def test_a_second_workbook_run_keeps_the_first_and_points_at_the_latest(two_workbook_runs):
    out, outputs, _ = two_workbook_runs
    for code, text in outputs:
        assert code == 0, text
    runs = [p for p in out.iterdir() if p.is_dir()]
    assert len(runs) == 2
    for run in runs:
        assert (run / "summary.md").exists() and (run / "01_y" / "01_y.ipynb").exists()
    latest = out / (out / "LATEST").read_text().strip()
    assert f"summary: {latest / 'summary.md'}" in outputs[1][1], "LATEST names the second run"
    assert (out / "summary.md").read_text() == (latest / "summary.md").read_text()


# ---- the command line refuses what is ambiguous or contradictory --------------------------------

@pytest.mark.trial("R14")
def test_a_prefix_matching_several_notebooks_is_an_error_listing_them(project, monkeypatch, capsys):
    monkeypatch.chdir(project)
    code, text = cli(["repro", "1", "-p", "nope", "1"], capsys)
    assert code == 2 and "1 matches 2 notebooks: 10_a, 11_b" in text
    code, text = cli(["repro", "0", "-p", "nope", "1"], capsys)
    assert code == 2 and "0 matches 3 notebooks: 00_x, 00_x2, 01_y" in text


@pytest.mark.trial("extra")
def test_an_exact_stem_wins_over_the_notebooks_it_is_a_prefix_of(project, monkeypatch, capsys):
    monkeypatch.chdir(project)
    code, text = cli(["repro", "00_x", "-p", "nope", "1"], capsys)
    assert code == 2 and "00_x.ipynb has no parameter nope" in text


@pytest.mark.parametrize("args, message", [
    pytest.param(["-p", "steps", "1", "-p", "steps", "0"], "-p steps is given twice ('1' and '0')",
                 marks=pytest.mark.trial("R2f"), id="R2f"),
    pytest.param(["--sweep", "steps=0", "--sweep", "steps=1"], "--sweep steps is given twice (steps=0 and steps=1)",
                 marks=pytest.mark.trial("R9c"), id="R9c"),
    pytest.param(["-p", "value", "5.0", "--sweep", "value=1.0,2.0"], "value is given with -p and with --sweep",
                 marks=pytest.mark.trial("R9d"), id="R9d"),
    pytest.param(["-p", "value", "1e999"], "parameter value must be a finite number, got inf",
                 marks=pytest.mark.trial("R20"), id="R20"),
    pytest.param(["--sweep", "value=1.0,-1e999"], "parameter value must be a finite number, got -inf",
                 marks=pytest.mark.trial("extra"), id="sweep-minus-inf"),
    pytest.param(["--timeout", "nan"], "--timeout must be a positive number of seconds, got nan",
                 marks=pytest.mark.trial("extra"), id="timeout-nan"),
    pytest.param(["--sweep", "steps=1,2", "--workers", "0"], "--workers must be 1 or more, got 0",
                 marks=pytest.mark.trial("extra"), id="workers-0"),
])
def test_contradictory_or_impossible_arguments_are_errors_before_any_run(project, monkeypatch, capsys, args, message):
    monkeypatch.chdir(project)
    before = set(project.rglob("*"))
    code, text = cli(["repro", "00_x", *args], capsys)
    assert code == 2 and message in text, text
    assert set(project.rglob("*")) == before, "nothing is written for a command that is refused"


@pytest.mark.trial("R13")
def test_an_existing_file_as_output_folder_is_a_clear_error(project, monkeypatch, capsys):
    monkeypatch.chdir(project)
    (project / "README.md").write_text("keep me")
    code, text = cli(["repro", "00_x", "--out", "README.md"], capsys)
    assert code == 2 and "README.md is a file, not a folder" in text and "Traceback" not in text
    assert (project / "README.md").read_text() == "keep me"


@pytest.mark.trial("extra")
def test_a_folder_holding_files_is_never_written_into(project, monkeypatch, capsys):
    monkeypatch.chdir(project)
    committed = (project / "notebooks" / "00_x.ipynb").read_bytes()
    code, text = cli(["repro", "00_x", "--out", "notebooks"], capsys)
    assert code == 2 and "notebooks already holds files" in text
    assert (project / "notebooks" / "00_x.ipynb").read_bytes() == committed
    with pytest.raises(LabkitError, match="already holds files"):
        run_notebook(project / "notebooks" / "00_x.ipynb", project / "notebooks")


@pytest.mark.trial("W3")
def test_a_workbook_timeout_must_be_positive(project, monkeypatch, capsys):
    monkeypatch.chdir(project)
    for timeout in ("-1", "0"):
        code, text = cli(["workbook", "01_y", "--timeout", timeout, "--out", "runs/never"], capsys)
        assert code == 2 and "--timeout must be a positive number of seconds" in text
    assert not (project / "runs" / "never").exists()
