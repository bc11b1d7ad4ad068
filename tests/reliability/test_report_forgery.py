"""The forgery gap of the grading process (issue #42 (b)), kept in sight until it is closed.

The verdict of an answer is computed in a process of its own (`labkit._grader_process`), but in the same
process as the answer: the answer's code can write the verdict line itself. Its nonce waits in the request
pipe (fd 0), which the answer can read, and the line is encoded with `json.dumps`, which the answer can
replace. Both forgeries below pass an answer that is wrong. They fail (xfail, strict) until the checks call
the answer across a process boundary (benchmarks/results/reliability_trials.md, "The nonce"); a fix makes
them pass, and strict xfail then reports it, so the marks must go with the fix. One grading process each, no
kernel.
"""

from __future__ import annotations

import pytest

from labkit import grading

pytestmark = pytest.mark.timeout(600, method="thread")

# Reads the nonce the parent left in the request pipe, writes a passing verdict line to every open pipe, exits.
THROUGH_THE_PIPES = """# exercise 00.1
import os, json
def one_training_step(model, optimizer, x, y):
    nonce = b''
    while not nonce.endswith(b'\\n'):
        nonce += os.read(0, 1)
    line = json.dumps({'nonce': nonce.decode().strip(), 'passed': True, 'message': 'forged', 'recipe_shown': False})
    for fd in range(3, 64):
        try:
            os.write(fd, (line + '\\n').encode())
        except OSError:
            pass
    os._exit(0)
"""
# Replaces json.dumps while the check runs; the grading process then encodes its own verdict with it.
THROUGH_THE_ENCODER = """# exercise 00.1
import json
def one_training_step(model, optimizer, x, y):
    real = json.dumps
    def forged(value, *args, **kwargs):
        if isinstance(value, dict) and 'nonce' in value:
            value = {**value, 'passed': True, 'message': 'forged'}
        return real(value, *args, **kwargs)
    json.dumps = forged
    raise ValueError('wrong')
"""


@pytest.mark.trial("extra")
@pytest.mark.xfail(strict=True, reason="issue #42 (b): the answer shares the grading process with its check")
@pytest.mark.parametrize("answer", [THROUGH_THE_PIPES, THROUGH_THE_ENCODER], ids=["pipes", "encoder"])
def test_an_answer_cannot_write_its_own_verdict(answer):
    result = grading.grade_cell("00.1", answer, "one_training_step")
    assert not result.passed, result.message
