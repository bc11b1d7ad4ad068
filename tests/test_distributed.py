"""labkit.distributed.run_ranks: results in rank order, and every failure reported, bounded and cleaned up."""

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
import torch.distributed as dist

from labkit import LabkitError
from labkit.distributed import RankFailure, _failure_report, run_ranks

ROOT = Path(__file__).resolve().parents[1]


def sum_of_ranks(rank, world_size):
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank, world_size, total.item()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_rank_joins_one_group_and_results_come_back_in_rank_order(world_size):
    results = run_ranks(sum_of_ranks, world_size, timeout=30)
    expected_sum = sum(range(world_size))
    assert results == [(rank, world_size, expected_sum) for rank in range(world_size)]
    assert multiprocessing.active_children() == []


def report_pid_then_keep_reducing(rank, world_size, folder):
    Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()))
    tensor = torch.ones(4)
    for _ in range(3000):  # about 30 s: far longer than the test waits
        dist.all_reduce(tensor)
        time.sleep(0.01)
    return "finished"


def wait_for_file(path, seconds=20.0):
    deadline = time.monotonic() + seconds
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return int(path.read_text())


def test_a_rank_killed_mid_run_is_reported_within_the_timeout_and_nothing_is_left(tmp_path):
    timeout = 20.0
    with ThreadPoolExecutor(max_workers=1) as pool:
        started = time.monotonic()
        running = pool.submit(run_ranks, report_pid_then_keep_reducing, 2, args=(str(tmp_path),), timeout=timeout)
        victim = wait_for_file(tmp_path / "rank1.pid")
        survivor = wait_for_file(tmp_path / "rank0.pid")
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(RankFailure) as failure:
            running.result(timeout=timeout)
        elapsed = time.monotonic() - started
    assert elapsed < timeout
    assert str(failure.value).startswith("rank 1 died: was killed by signal SIGKILL")
    assert set(failure.value.failures) == {0, 1}
    assert not psutil.pid_exists(victim) and not psutil.pid_exists(survivor)
    assert multiprocessing.active_children() == []


def one_rank_hangs(rank, world_size):
    if rank == 1:
        time.sleep(60)
    return rank


def test_a_rank_that_never_finishes_is_reported_when_the_timeout_expires():
    started = time.monotonic()
    with pytest.raises(RankFailure, match=r"^rank 1 did not finish within 2 s") as failure:
        run_ranks(one_rank_hangs, 2, timeout=2)
    assert time.monotonic() - started < 2 + 5  # the limit, plus stopping the processes
    assert set(failure.value.failures) == {1}
    assert multiprocessing.active_children() == []


def rank_zero_raises(rank, world_size):
    if rank == 0:
        raise ValueError("boom")
    tensor = torch.ones(1)
    dist.all_reduce(tensor)  # waits for rank 0, which never comes
    return "unreachable"


def test_an_exception_in_a_rank_is_reported_with_its_rank_and_message():
    with pytest.raises(RankFailure, match=r"^rank 0 raised ValueError: boom") as failure:
        run_ranks(rank_zero_raises, 2, timeout=20)
    assert 1 in failure.value.failures  # it was left waiting, and was stopped
    assert multiprocessing.active_children() == []


def returns_a_lambda(rank, world_size):
    return lambda: rank


def test_a_result_that_cannot_travel_back_is_a_failure_of_that_rank():
    with pytest.raises(RankFailure, match=r"^rank 0 raised ") as failure:
        run_ranks(returns_a_lambda, 2, timeout=20)
    # pickle's wording is Python's own ("Can't pickle local object" up to 3.12, "Can't get local
    # object" in 3.13); every version names the object that could not travel.
    assert "returns_a_lambda.<locals>.<lambda>" in str(failure.value)


def prints_and_lists_listening_sockets(rank, world_size):
    print("this line belongs in the rank's log")
    tensor = torch.ones(1)
    dist.all_reduce(tensor)  # the gloo connections are open now
    connections = psutil.Process().net_connections(kind="inet")
    return sorted({c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN})


def test_ranks_listen_on_loopback_only_and_print_nothing_to_the_caller(capfd):
    addresses = run_ranks(prints_and_lists_listening_sockets, 2, timeout=30)
    # Each rank listens for its gloo peers (so the list is not empty), and only on 127.0.0.1.
    assert addresses == [["127.0.0.1"], ["127.0.0.1"]]
    captured = capfd.readouterr()
    assert "belongs in the rank's log" not in captured.out + captured.err


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"fn": "not a function"}, "needs a function"),
        ({"world_size": 0}, "world_size must be"),
        ({"world_size": 2.0}, "world_size must be"),
        ({"timeout": 0}, "timeout must be"),
        ({"args": [1]}, "args must be a tuple"),
    ],
)
def test_bad_requests_are_refused_before_any_process_starts(kwargs, problem):
    request = {"fn": sum_of_ranks, "world_size": 2, "timeout": 5, **kwargs}
    fn = request.pop("fn")
    with pytest.raises(LabkitError, match=problem):
        run_ranks(fn, **request)


# Torch's own Python-defined accelerator (the privateuse1 backend of its tests) makes this CPU machine a GPU
# machine to autograd: once the caller has run backward, a forked child cannot, as on a CUDA machine.
FAKE_ACCELERATOR = """
import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
_setup_privateuseone_for_python_backend("fakegpu")
torch.ones(2, requires_grad=True).sum().backward()  # starts autograd's device threads
"""

ACCELERATOR_SCRIPT = FAKE_ACCELERATOR + """
import os, random
import torch.distributed as dist
from labkit.distributed import _forks_from_a_server, run_ranks

def backward_in_a_fork():
    pid = os.fork()
    if pid == 0:
        try:
            torch.ones(2, requires_grad=True).sum().backward()
        except RuntimeError:
            os._exit(3)
        os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

SCALE = 3.0  # a global of the caller's __main__, as a notebook's

def backward_and_average(rank, world_size):
    w = torch.full((2,), float(rank + 1), requires_grad=True)
    (SCALE * w).sum().backward()
    dist.all_reduce(w.grad)
    return w.grad.tolist(), torch.rand(1).item(), random.random(), torch.get_default_dtype()

torch.set_default_dtype(torch.float64)
torch.manual_seed(7); random.seed(7)
expected = (torch.rand(1).item(), random.random())
torch.manual_seed(7); random.seed(7)
results = run_ranks(backward_and_average, 2, timeout=60)
print(_forks_from_a_server(), backward_in_a_fork(), results == [([6.0, 6.0], *expected, torch.float64)] * 2)
"""


def test_after_a_backward_on_an_accelerator_machine_ranks_still_run_backward_with_the_caller_s_state():
    # The GPU runner's first run of 15 failed here: every rank raised "Unable to handle autograd's
    # threading in combination with fork-based multiprocessing".
    done = subprocess.run([sys.executable, "-c", ACCELERATOR_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    server, forked_child_exit, as_if_forked = done.stdout.split()
    assert forked_child_exit == "3", "a forked child's backward no longer fails: the server is not needed"
    assert (server, as_if_forked) == ("True", "True")


# A kernel killed outright (SIGKILL) runs no clean-up code; its ranks must still go.
ORPHANING_SCRIPT = """
import os, sys, time
from pathlib import Path
from labkit.distributed import run_ranks

def sleep_forever(rank, world_size, folder):
    Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(60)

run_ranks(sleep_forever, 2, args=(sys.argv[1],), timeout=60)
"""


def gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("machine", ["cpu", "accelerator"])
def test_ranks_die_with_a_parent_that_is_killed_outright(tmp_path, machine):
    # TMPDIR keeps the killed parent's scratch folder, which no clean-up code removes, in tmp_path.
    script = (FAKE_ACCELERATOR if machine == "accelerator" else "") + ORPHANING_SCRIPT
    parent = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT,
                              env=dict(os.environ, TMPDIR=str(tmp_path)))
    try:
        pids = [wait_for_file(tmp_path / f"rank{rank}.pid", seconds=60) for rank in range(2)]
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(gone(pid) for pid in pids)


def test_the_report_is_formatted_once_from_each_rank_s_structured_outcome():
    ranks = [SimpleNamespace(rank=0, outcome=("raised", "ValueError", "x: y (its log ends: z)")),
             SimpleNamespace(rank=1, outcome=("died", "was killed by signal SIGKILL", " (its log ends: a: b)")),
             SimpleNamespace(rank=2, outcome=None)]
    report = _failure_report(ranks, timeout=5, timed_out=False)
    assert str(report) == ("rank 1 died: was killed by signal SIGKILL before returning a result (its log ends: a: b); "
                           "then rank 0 raised ValueError, rank 2 was still running when it was stopped. "
                           "All 3 rank processes have been stopped.")
    assert report.failures[0] == "raised ValueError: x: y (its log ends: z)"


# ---- The loopback interface gloo is pinned to: found by name on each OS (lo on Linux, lo0 on macOS) ----

@pytest.fixture
def distributed():
    from labkit import distributed

    return distributed


@pytest.mark.parametrize(
    ("interfaces", "expected"),
    [
        ([(1, "lo"), (2, "eth0")], "lo"),  # Linux
        ([(1, "lo0"), (2, "gif0"), (3, "en0")], "lo0"),  # macOS
    ],
)
def test_the_loopback_interface_is_the_one_this_os_has(monkeypatch, distributed, interfaces, expected):
    monkeypatch.setattr(distributed.socket, "if_nameindex", lambda: interfaces)
    assert distributed.loopback_interface() == expected


def test_a_machine_without_a_loopback_interface_is_refused_before_any_process_starts(monkeypatch, distributed):
    monkeypatch.setattr(distributed.socket, "if_nameindex", lambda: [(2, "eth0")])
    monkeypatch.setattr(distributed, "_start", lambda *args: pytest.fail("ranks started without a loopback"))
    with pytest.raises(LabkitError, match=r"no loopback network interface \(lo or lo0\).*'eth0'"):
        run_ranks(sum_of_ranks, 2, timeout=5)


def test_the_ranks_use_the_detected_interface(distributed):
    # The name the OS has is the one gloo is told to use: a rank reports its GLOO_SOCKET_IFNAME.
    assert run_ranks(lambda rank, world_size: os.environ["GLOO_SOCKET_IFNAME"], 2, timeout=30) == [
        distributed.loopback_interface()] * 2
