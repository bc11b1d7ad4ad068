"""Grade an answer cell in a process of its own, so nothing the learner's code does can reach the verdict.

Same-process Python cannot be protected: a cell can patch the checker, torch or the time limit, exit,
or hang. So the verdict that counts is computed in a grading process that ran nothing before: a child
forked for this answer alone from this process's zygote (`labkit._grader_zygote`, a clean Python that
imported torch and labkit once and never runs an answer), running `labkit._grader_child`. It receives
the answer cell's *source*, in its own session (the whole group is killed at the end, so no process it
started outlives it), in a scratch folder that is deleted afterwards, with its CPU time, memory and
file sizes capped, and under a wall-clock bound here. The result comes back as one JSON line with a
nonce this process chose; an exit, a crash, a hang or a missing line is a verdict about that answer alone.
The nonce authenticates only a process the answer never ran in: a lab's answer, and an exercise's
registered ``answer_apart`` (all of them), run in a further process that holds neither the nonce nor the
result pipe (`labkit._answer_process`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from labkit._grader_zygote import FORK

__all__: list[str] = []

# The judge's exit code when the answer's own process wrote into their channel (`labkit._answer_process`).
GARBLED_REPLY_EXIT_CODE = 86
# Starting Python and importing torch and labkit takes a few seconds, more on a loaded machine; the
# answer's own wall-clock bound starts when the child says it is ready (`READY`).
STARTUP_ALLOWANCE_S = 120
READY = b"ready"
# Most of a result line is the verdict's message; anything longer is not the child's honest report.
MAX_REPORT_BYTES = 1 << 20


class Outcome:
    """What came back: ``verdict`` (passed, message, recipe_shown) or, failing that, ``failure`` in words."""

    def __init__(self, verdict: dict | None = None, failure: str = "", hint: str = "") -> None:
        self.verdict, self.failure, self.hint = verdict, failure, hint


def grade_in_child(request: dict, wall_limit_s: float) -> Outcome:
    """Run the child on ``request`` (exercise, source, function, where, try_number, follow_up, time_limit_s)."""
    labkit_root = Path(__file__).resolve().parents[1]
    scratch = tempfile.mkdtemp(prefix="labkit-grade-")
    nonce = secrets.token_hex(16)
    payload = {**request, "scratch": scratch, "forbidden": _forbidden_folders(labkit_root)}
    to_child, from_child = os.pipe(), os.pipe()
    pid = None
    try:
        pid = _fork_child(stdin=to_child[0], stdout=from_child[1])
        for fd in (to_child[0], from_child[1]):
            os.close(fd)
        with os.fdopen(to_child[1], "wb") as request_pipe:
            request_pipe.write(f"{json.dumps(payload)}\n{nonce}\n".encode())
        with os.fdopen(from_child[0], "rb") as results:
            report, late = _collect(results, wall_limit_s)
        _end_group(pid)
        returncode, pid = _zygote().exit_status(), None
        if late == "startup":
            return Outcome(failure=f"the grading process did not start within {STARTUP_ALLOWANCE_S} s "
                           "(is the machine overloaded?); check again")
        if late == "answer":
            return Outcome(failure=f"it did not finish within {wall_limit_s:g} s of waiting (the grader stopped it)",
                           hint="look for a loop that never ends or a call that waits forever")
        return _read_report(report, returncode, nonce, Path(scratch) / "stderr.txt")
    finally:
        if pid is not None:  # stopped on the way (Ctrl-C, an error): the zygote's next message may be this child's
            _end_group(pid)
            _discard_zygote()
        for fd in (*to_child, *from_child):
            with contextlib.suppress(OSError):  # most were closed on the way here
                os.close(fd)
        shutil.rmtree(scratch, ignore_errors=True)


def _fork_child(stdin: int, stdout: int) -> int:
    """A new grading process from this process's zygote; a zygote that ended meanwhile (idle) is started again."""
    try:
        return _zygote().fork(stdin, stdout)
    except (_ZygoteGone, OSError):
        _discard_zygote()
        return _zygote().fork(stdin, stdout)


class _Zygote:
    """The parent's end of `labkit._grader_zygote`: started in the same clean environment a grading process
    had, with its own scratch folder as home, cwd and TMPDIR."""

    def __init__(self) -> None:
        labkit_root = Path(__file__).resolve().parents[1]
        self.scratch = tempfile.mkdtemp(prefix="labkit-zygote-")
        self.channel, zygote_end = socket.socketpair()
        # No GPU: checks run on the CPU, and with an accelerator in sight a rank or worker forked after a
        # backward could not run one (labkit.distributed), nor start from a server under the audit hook.
        environment = {"PATH": os.environ.get("PATH", ""), "HOME": self.scratch, "TMPDIR": self.scratch,
                       "LANG": "C.UTF-8", "PYTHONPATH": str(labkit_root), "PYTHONDONTWRITEBYTECODE": "1",
                       "CUDA_VISIBLE_DEVICES": ""}
        with zygote_end:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "labkit._grader_zygote", str(zygote_end.fileno())], pass_fds=[zygote_end.fileno()],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.scratch,
                env=environment, start_new_session=True)
        self.owner = os.getpid()
        self.replies = b""

    def fork(self, stdin: int, stdout: int) -> int:
        socket.send_fds(self.channel, [FORK], [stdin, stdout])
        return self._reply(STARTUP_ALLOWANCE_S)

    def exit_status(self) -> int:
        """The last child's exit code (minus the signal that ended it), once it ended."""
        return self._reply(STARTUP_ALLOWANCE_S)

    def _reply(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.replies:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.channel], [], [], remaining)[0]:
                raise _ZygoteGone("the grading zygote did not answer")
            chunk = self.channel.recv(64)
            if not chunk:
                raise _ZygoteGone("the grading zygote ended")
            self.replies += chunk
        line, self.replies = self.replies.split(b"\n", 1)
        return int(line)

    def close(self) -> None:
        self.channel.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        shutil.rmtree(self.scratch, ignore_errors=True)


class _ZygoteGone(Exception):
    pass


_ZYGOTES: list[_Zygote] = []


def _zygote() -> _Zygote:
    """This process's zygote, started on first use and again after it ended (idle, killed) or after a fork."""
    if _ZYGOTES and (_ZYGOTES[0].owner != os.getpid() or _ZYGOTES[0].process.poll() is not None):
        _discard_zygote()
    if not _ZYGOTES:
        _ZYGOTES.append(_Zygote())
    return _ZYGOTES[0]


def _discard_zygote() -> None:
    while _ZYGOTES:
        zygote = _ZYGOTES.pop()
        if zygote.owner == os.getpid():
            zygote.close()


atexit.register(_discard_zygote)


def _collect(stream, wall_limit_s: float) -> tuple[bytes, str | None]:
    """Everything the child reports until it closes its end, and which bound ran out first, if one did:
    "startup" before its `READY` line, "answer" after it."""
    report, ready = b"", False
    deadline = time.monotonic() + STARTUP_ALLOWANCE_S
    while (remaining := deadline - time.monotonic()) > 0:
        if not select.select([stream], [], [], remaining)[0]:
            continue
        chunk = os.read(stream.fileno(), 1 << 16)
        if not chunk:
            return report, None
        report = (report + chunk)[-MAX_REPORT_BYTES:]
        if not ready and report.split(b"\n", 1)[0] == READY and b"\n" in report:
            ready, report = True, report.split(b"\n", 1)[1]
            deadline = time.monotonic() + wall_limit_s
    return report, "answer" if ready else "startup"


def _forbidden_folders(labkit_root: Path) -> list[str]:
    """The checkout's solution notebooks and their py twins, which an answer must not read."""
    return [os.path.realpath(labkit_root / "notebooks")]


def _end_group(pid: int) -> None:
    """Kill the child's whole session, what the learner's code started in it included (the zygote reaps it)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is already empty: the child ended and left nothing behind


def _read_report(report: bytes, returncode: int, nonce: str, stderr: Path) -> Outcome:
    lines = report.decode(errors="replace").splitlines()
    if returncode == 0 and lines:
        try:
            verdict = json.loads(lines[-1])
        except json.JSONDecodeError:
            verdict = {}
        if isinstance(verdict, dict) and verdict.pop("nonce", None) == nonce:
            return Outcome(verdict)
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return Outcome(failure="it used more CPU time or memory than a check allows (the grader stopped it)",
                       hint="look for a loop that never ends or a very large allocation; each check needs well "
                            "under a second")
    if returncode < 0:
        return Outcome(failure=f"it crashed the grading process ({signal.Signals(-returncode).name})",
                       hint="look for ctypes, a C extension or a recursion without end in your cell")
    if returncode == GARBLED_REPLY_EXIT_CODE:
        return Outcome(failure="it wrote into the grader's channel something that is not an answer (the grader "
                               "stopped it)",
                       hint="return your result from the function; do not write to file descriptors you did not open")
    crash = _last_line(stderr)
    return Outcome(failure=f"it ended the grading process (exit code {returncode}){crash}",
                   hint="return the result instead of ending the process (os._exit, sys.exit)")


def _last_line(stderr: Path) -> str:
    try:
        lines = stderr.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return f": {lines[-1][:160]}" if lines else ""
