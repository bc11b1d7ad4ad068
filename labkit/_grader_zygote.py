"""A clean process that imports what grading needs once, then forks one grading process per answer.

Every answer is graded in a process of its own that never ran anything else (`labkit._grader_process`).
Starting Python and importing torch and labkit for each costs seconds of CPU, paid again for every
exercise of every notebook run, autograde and ``labkit progress``. This process (the zygote) makes the
imports once and never runs an answer: for each request it forks a child, which takes the request's two
pipes as its stdin and stdout, leaves this session and every other file descriptor behind, and runs
`labkit._grader_child.main` exactly as a freshly started grading process does. The zygote reports the
child's pid, then its exit status, and ends when its parent closes the socket or after it has been idle
for IDLE_EXIT_S (a learner's kernel does not keep a second copy of torch in memory between checks).
"""

from __future__ import annotations

import os
import select
import socket
import sys
import tempfile

__all__: list[str] = []

IDLE_EXIT_S = 60.0
# The one message byte that carries a request's two pipe ends (the child's stdin and stdout).
FORK = b"f"


def serve(channel: socket.socket) -> None:
    import labkit._grader_child as child  # every import a grading process makes before it reads its request
    from labkit._torch_compat import import_dynamo_before_forking
    from labkit.exercises import registry

    registry()
    import_dynamo_before_forking()  # every check steps an optimizer: import once, not per answer
    while select.select([channel], [], [], IDLE_EXIT_S)[0]:
        message, fds, _, _ = socket.recv_fds(channel, len(FORK), 2)
        if message != FORK or len(fds) != 2:
            break  # the parent closed its end (or sent what no parent sends): nothing more to grade
        pid = os.fork()
        if pid == 0:
            _become_grading_process(channel, fds, child.main)
        for fd in fds:
            os.close(fd)
        channel.sendall(f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        channel.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())


def _become_grading_process(channel: socket.socket, fds: list[int], grade) -> None:
    """In the forked child: the request's pipes as stdin and stdout, a session of its own, no other descriptor."""
    try:
        channel.close()
        os.setsid()
        os.dup2(fds[0], 0)
        os.dup2(fds[1], 1)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        tempfile.tempdir = None  # found again from the TMPDIR the child sets, not the zygote's
        grade()
    finally:
        os._exit(70)  # grade() ends the process itself; reaching here means it raised


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
