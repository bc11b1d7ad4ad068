"""CPU time of grading an answer in a process of its own: a fresh zygote per answer against one zygote.

A fresh zygote per answer is what every answer cost before the zygote (a new Python that imports
torch, labkit and dynamo, then grades); one zygote forks a process per answer from those imports.
Both grade the same answers of 00.1 (right and wrong alternately), interleaved round by round in
one run; CPU is user + system of the zygotes and their children, counted when they are reaped.

    .venv/bin/python benchmarks/grading_process.py [--rounds 5] [--answers 4]
"""

from __future__ import annotations

import argparse
import os
import statistics

from labkit import grading
from labkit._grader_process import _discard_zygote

RIGHT = ("# exercise 00.1\ndef one_training_step(model, optimizer, x, y):\n    optimizer.zero_grad()\n"
         "    loss = F.mse_loss(model(x), y)\n    loss.backward()\n    optimizer.step()\n    return loss.item()\n")
WRONG = RIGHT.replace("    optimizer.zero_grad()\n", "")


def children_cpu() -> float:
    times = os.times()
    return times.children_user + times.children_system


def grade_all(answers: int, fresh_zygote_each: bool) -> float:
    """CPU seconds a check of ``answers`` answers cost, the zygotes reaped at the end."""
    before = children_cpu()
    for index in range(answers):
        if fresh_zygote_each:
            _discard_zygote()
        result = grading.grade_cell("00.1", RIGHT if index % 2 == 0 else WRONG, "one_training_step")
        assert result.passed == (index % 2 == 0), result.message
    _discard_zygote()
    return (children_cpu() - before) / answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--answers", type=int, default=4, help="answers graded per round and way")
    args = parser.parse_args()
    fresh, shared = [], []
    for _ in range(args.rounds):
        fresh.append(grade_all(args.answers, fresh_zygote_each=True))
        shared.append(grade_all(args.answers, fresh_zygote_each=False))
    ratios = [f / s for f, s in zip(fresh, shared, strict=True)]
    print(f"CPU s per answer, median of {args.rounds} rounds of {args.answers} answers:")
    print(f"  a fresh process per answer: {statistics.median(fresh):.2f}")
    print(f"  one zygote (its start shared by {args.answers} answers): {statistics.median(shared):.2f}")
    print(f"  ratio fresh / zygote: {statistics.median(ratios):.1f}x (rounds: {', '.join(f'{r:.1f}' for r in ratios)})")


if __name__ == "__main__":
    main()
