"""Grade an answer cell in a process of its own, so nothing the learner's code does can reach the verdict.

Same-process Python cannot be protected: a cell can patch the checker, torch or the time limit, exit,
or hang. So the verdict that counts is computed in a fresh ``python -m labkit._grader_child`` that
receives the answer cell's *source*, in its own session (the whole group is killed at the end, so
no process it started outlives it), in a scratch folder that is deleted afterwards, with its CPU
time, memory and file sizes capped (`labkit._grader_child`), and under a wall-clock bound here.
The result comes back as one JSON line with a nonce this process chose; an exit, a crash, a hang
or a missing line is a verdict about that answer alone.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__: list[str] = []

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
    environment = {"PATH": os.environ.get("PATH", ""), "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
                   "PYTHONPATH": str(labkit_root), "PYTHONDONTWRITEBYTECODE": "1"}
    child = subprocess.Popen([sys.executable, "-m", "labkit._grader_child"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=scratch, env=environment,
                             start_new_session=True)
    try:
        child.stdin.write(f"{json.dumps(payload)}\n{nonce}\n".encode())
        child.stdin.close()
        report, late = _collect(child.stdout, wall_limit_s)
        if late == "startup":
            return Outcome(failure=f"the grading process did not start within {STARTUP_ALLOWANCE_S} s "
                           "(is the machine overloaded?); check again")
        if late == "answer":
            return Outcome(failure=f"it did not finish within {wall_limit_s:g} s of waiting (the grader stopped it)",
                           hint="look for a loop that never ends or a call that waits forever")
        child.wait()
        return _read_report(report, child.returncode, nonce, Path(scratch) / "stderr.txt")
    finally:
        _end_group(child)
        shutil.rmtree(scratch, ignore_errors=True)


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


def _end_group(child: subprocess.Popen) -> None:
    """Kill the child's whole session, what the learner's code started in it included, and reap the child."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is already empty: the child ended and left nothing behind
    child.wait()


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
    crash = _last_line(stderr)
    return Outcome(failure=f"it ended the grading process (exit code {returncode}){crash}",
                   hint="return the result instead of ending the process (os._exit, sys.exit)")


def _last_line(stderr: Path) -> str:
    try:
        lines = stderr.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return f": {lines[-1][:160]}" if lines else ""
