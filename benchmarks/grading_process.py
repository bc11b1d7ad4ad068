"""CPU time of grading an answer in a process of its own: a fresh zygote per answer against one zygote.

A fresh zygote per answer is what every answer cost before the zygote (a new Python that imports
torch, labkit and dynamo, then grades); one zygote forks a process per answer from those imports.
Each way runs in a Python of its own, through the public `grading.grade_cell`, on the same answers
of 00.1 (right and wrong alternately): "fresh" grades one answer per Python (its zygote ends with
it), "shared" grades them all in one. A Python that imports labkit.grading and grades nothing is
the baseline subtracted from both. CPU is user + system of those Pythons, their zygotes and the
zygotes' children, counted when they are reaped; the ways run interleaved round by round.

    .venv/bin/python benchmarks/grading_process.py [--rounds 3] [--answers 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

RIGHT = ("# exercise 00.1\ndef one_training_step(model, optimizer, x, y):\n    optimizer.zero_grad()\n"
         "    loss = F.mse_loss(model(x), y)\n    loss.backward()\n    optimizer.step()\n    return loss.item()\n")
WRONG = RIGHT.replace("    optimizer.zero_grad()\n", "")
GRADE = """
import sys
from labkit import grading
right, wrong = sys.argv[1], sys.argv[2]
for index in range(int(sys.argv[3])):
    result = grading.grade_cell("00.1", right if index % 2 == 0 else wrong, "one_training_step")
    assert result.passed == (index % 2 == 0), result.message
"""


def children_cpu() -> float:
    times = os.times()
    return times.children_user + times.children_system


def python_grading(answers: int) -> float:
    """CPU seconds of one Python that grades ``answers`` answers, with its zygote and their children."""
    before = children_cpu()
    subprocess.run([sys.executable, "-c", GRADE, RIGHT, WRONG, str(answers)], check=True)
    return children_cpu() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--answers", type=int, default=4, help="answers graded per round and way")
    args = parser.parse_args()
    fresh, shared = [], []
    for _ in range(args.rounds):
        baseline = python_grading(0)
        fresh.append(sum(python_grading(1) - baseline for _ in range(args.answers)) / args.answers)
        shared.append((python_grading(args.answers) - baseline) / args.answers)
    ratios = [f / s for f, s in zip(fresh, shared, strict=True)]
    print(f"CPU s per answer beyond a Python that grades nothing, median of {args.rounds} rounds of {args.answers}:")
    print(f"  a fresh zygote per answer: {statistics.median(fresh):.2f}")
    print(f"  one zygote (its start shared by {args.answers} answers): {statistics.median(shared):.2f}")
    print(f"  ratio fresh / shared: {statistics.median(ratios):.1f}x (rounds: {', '.join(f'{r:.1f}' for r in ratios)})")


if __name__ == "__main__":
    main()
