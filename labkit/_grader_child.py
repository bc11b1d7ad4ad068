"""The grading process's side of `labkit._grader_process`: run one answer cell, check it, report as data.

An exercise's cell, or a lab's answer cell (`labkit.labs._isolated` readies the lab and judges it).

Forked from the zygote (`labkit._grader_zygote`), which imported everything a check needs, with a JSON
request on stdin. Before any learner code runs it caps its own CPU time, memory and file sizes
(resource.setrlimit), moves into its scratch folder, points stdout and stderr away from the result
channel, and installs an audit hook (`_audit_hook`) that learner code cannot remove: no subprocess,
fork, signal to another process, ctypes, garbage-collector introspection, raised limit, file written outside the scratch folder, notebook or /proc/<pid> read. The namespaces checks rely on are
snapshotted before the cell runs, so a cell that patches torch or labkit is undone before its
check (`_Namespaces`). The verdict goes back as one JSON line carrying the parent's nonce, which
waits unread in the stdin pipe until the check is over; the process then ends at once (os._exit),
so a learner's thread cannot keep it alive.

For a lab, and for an exercise registered ``answer_apart=True`` (every exercise of the workbook), this
process is the judge only: before any learner code runs it forks the answer's own process
(`labkit._answer_process`; a lab's side is `labkit.labs._isolated.serve`), which closes the request pipe
(the nonce) and the result pipe, is confined as above, and serves the judge's questions as data; no line
of the learner's runs here. An exercise without ``answer_apart`` would run its answer here beside its
check, and that is not protected: an answer written against this protocol could read the nonce from fd 0
and write a forged report, or patch what writes the report (`json.dumps`): NF1 and NF2 in
tests/reliability/test_report_forgery.py.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import re
import resource
import sys
import time
from pathlib import Path

import labkit.grading as grading
from labkit import _answer_process
from labkit._check_sandbox import _Namespaces
from labkit.exercises import registry
from labkit.labs import _isolated
from labkit.messages import describe_error

__all__: list[str] = []

# Address space the answer and its check may map beyond what the imports mapped (torch's alone maps
# 1.5 GiB here, several with CUDA libraries); a check needs a few MiB.
MEMORY_BUDGET_BYTES = 2 * 2**30
FILE_SIZE_LIMIT_BYTES = 64 * 2**20
# CPU seconds beyond the check's own limit (and the imports before it) before the kernel stops the
# process (SIGXCPU, then SIGKILL): the check's own time limit stops an answer first, with a clearer message.
CPU_GRACE_S = 2

_REFUSED_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                   "os.forkpty", "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit",
                   "resource.prlimit", "ctypes.", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
                   "sys._current_frames", "sys.settrace", "sys.setprofile", "os.chdir",
                   "socket.connect", "socket.bind")
# /proc/<pid>/: another process's or this one's memory, file descriptors and environment.
_PROCESS_FILES = re.compile(r"/proc/\d+(/|$)")
_WRITE_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.chmod",
                 "os.chown", "os.truncate", "os.utime", "shutil.rmtree")


def main() -> None:
    request = json.loads(_read_line(0))
    results = os.fdopen(os.dup(1), "w")
    _quiet_standard_streams(request["scratch"])
    os.chdir(request["scratch"])
    os.environ.update(HOME=request["scratch"], TMPDIR=request["scratch"])
    if "lab" in request:  # the learner's run and the reference runs are trained before any learner code
        prepared = _isolated.prepare(request)
        namespaces = _Namespaces("labkit.labs._check", *prepared.modules, objects=prepared.objects)
    else:
        namespaces = _Namespaces(registry()[request["exercise"]].check.__module__)
    # the cell and the check each have the time limit; the imports so far are not the answer's
    _limit_resources(2 * request["time_limit_s"] + time.process_time())
    results.write("ready\n")
    results.flush()
    # a lab whose training runs in worker processes (DataLoader workers, gloo ranks) may fork and stop its own
    allowed = _isolated.process_events(request["lab"]) if "lab" in request else ()
    confine = functools.partial(_confine, request, allowed)
    if "lab" in request:  # no learner code runs here: the answer process runs the cell and the repaired training
        serve = functools.partial(_isolated.serve, prepared=prepared, namespaces=namespaces)
        verdict = _verdict(_isolated.judge(request, prepared, _answer_process.start(request, confine, serve)))
    elif registry()[request["exercise"]].answer_apart:
        verdict = _grade_apart(request, _answer_process.start(request, confine))  # no learner code runs here
    else:
        confine()
        verdict = _grade(request, namespaces)
    # The nonce waited in the pipe, out of reach of the answer's Python objects and frames.
    results.write(json.dumps({"nonce": _read_line(0), **verdict}) + "\n")
    results.flush()
    os._exit(0)


def _grade(request: dict, namespaces: _Namespaces) -> dict:
    """The answer cell run here, beside its check."""
    namespace = dict(grading.EXERCISE_NAMESPACE)
    try:
        ran = _answer_process.run_cell(request, namespace)
    finally:
        namespaces.restore()
    return _judged(request, ran, namespace.get(request["function"]))


def _judged(request: dict, ran: tuple[str, str], answer) -> dict:
    """The verdict on an answer cell that ran as ``ran`` says (`_answer_process.run_cell`), whose function,
    ``answer``, the check then calls, in this process or across to the answer's."""
    spec, function = grading._lookup(request["exercise"]), request["function"]
    status, detail = ran
    if status == "timed_out":
        return _verdict(grading._not_yet(spec, f"the exercise cell did not finish within {detail}"))
    if status == "raised":
        return _verdict(grading._not_yet(spec, f"the exercise cell raised {detail}"))
    if status == "undefined":
        return _verdict(grading._not_yet(spec, f"the exercise cell does not define {function} any more",
                                         hint=f"keep the line 'def {function}(' of the student edition"))
    try:
        return _verdict(grading.run_check(spec.id, answer, time_limit_s=request["time_limit_s"],
                                          try_number=request["try_number"], follow_up=request["follow_up"]))
    except KeyboardInterrupt as error:  # raised by the answer: no Ctrl-C reaches this process's own session
        return _verdict(grading._not_yet(spec, f"{function} raised {describe_error(error, grading.MAX_ERROR_CHARS)}"))


def _confine(request: dict, allowed: tuple[str, ...]) -> None:
    """From here on, in this process, what learner code may not do is refused (`_audit_hook`)."""
    sys.addaudithook(_audit_hook(os.path.realpath(request["scratch"]), request["forbidden"], allowed))


def _grade_apart(request: dict, answer: _answer_process.AnswerProcess) -> dict:
    """The check here, the answer in its own process (`labkit._answer_process`), which ends with it."""
    try:
        def call_the_answer(*args, **kwargs):
            return answer.call(*args, **kwargs)

        call_the_answer.__name__ = request["function"]
        call_the_answer.call_and_differentiate = answer.call_and_differentiate
        call_the_answer.run_beside = answer.run_beside
        return _judged(request, answer.cell(), call_the_answer)
    finally:
        answer.end()


def _read_line(fd: int) -> str:
    """One line from ``fd``, read a byte at a time so what follows it stays in the pipe."""
    line = bytearray()
    while (byte := os.read(fd, 1)) not in (b"", b"\n"):
        line += byte
    return line.decode()


def _verdict(result: grading.Result) -> dict:
    return {"passed": result.passed, "message": result.message, "recipe_shown": result.recipe_shown}


def _quiet_standard_streams(scratch: str) -> None:
    """The answer's prints go nowhere; stderr (a crash's traceback) to a file the parent may quote."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(os.open(os.path.join(scratch, "stderr.txt"), os.O_WRONLY | os.O_CREAT, 0o600), 2)
    os.close(null)


def _limit_resources(time_limit_s: float) -> None:
    cpu = int(time_limit_s) + CPU_GRACE_S
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 2))
    try:
        mapped = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    except OSError:
        mapped = None  # no /proc (macOS, which does not enforce RLIMIT_AS either): the CPU limit still holds
    if mapped is not None:
        resource.setrlimit(resource.RLIMIT_AS, (mapped + MEMORY_BUDGET_BYTES, mapped + MEMORY_BUDGET_BYTES))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT_BYTES, FILE_SIZE_LIMIT_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _audit_hook(scratch: str, forbidden: list[str], allowed: tuple[str, ...] = ()):
    def refuse(event: str, args: tuple) -> None:
        if event in allowed and (event != "os.kill" or _own_child(args[0])):
            return  # the forked processes inherit this hook, the limits and the session the grader ends
        if event.startswith(_REFUSED_EVENTS):
            raise PermissionError(f"the grader does not allow {event} in an answer")
        if event == "open" and isinstance(args[0], str | bytes):
            _check_open(os.fsdecode(args[0]), args[1], args[2], scratch, forbidden)
        if event.startswith(_WRITE_EVENTS) and args and isinstance(args[0], str | bytes):
            _check_inside(os.fsdecode(args[0]), scratch, event)

    return refuse


def _own_child(pid) -> bool:
    """Whether ``pid`` is a process this one started with multiprocessing (a worker or rank it may stop)."""
    return pid in {child.pid for child in multiprocessing.active_children()}


def _check_open(path: str, mode: str | None, flags: int, scratch: str, forbidden: list[str]) -> None:
    real = os.path.realpath(path)
    if real.endswith(".ipynb") or _PROCESS_FILES.match(real) or any(real == folder or real.startswith(folder + os.sep) for folder in forbidden):
        raise PermissionError(f"the grader does not let an answer read {path}")
    writes = any(flag in mode for flag in "wax+") if mode else bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    if writes:
        _check_inside(path, scratch, "writing")


def _check_inside(path: str, scratch: str, what: str) -> None:
    real = os.path.realpath(path)
    if real != os.devnull and not real.startswith(scratch + os.sep):
        raise PermissionError(f"the grader does not allow {what} {path} outside its scratch folder")
