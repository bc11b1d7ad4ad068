"""How long does each debugging lab's check take? The budget is 15 s per check on 2 CPU cores.

A check from a fresh process's first call: the variant's defective run and its defect-free twin (then
cached), and the run with the learner's repair; the correct repair of each variant, at seed 0.

Run: ``.venv/bin/python benchmarks/lab_check_times.py``. Prints one line per variant and the slowest.
"""

from __future__ import annotations

import time

import torch

from labkit.labs._check import check_lab, reference_runs
from labkit.labs._registry import lab_ids, lab_of

BUDGET_S = 15.0


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    slowest = 0.0
    for lab_id in lab_ids():
        lab = lab_of(lab_id)
        for variant in lab.variants:
            reference_runs.cache_clear()
            repair = {stage: lab.correct[stage] for stage in variant.defect}
            started = time.perf_counter()
            result = check_lab(lab_id, variant.id, variant.cause, repair, seed=0)
            elapsed = time.perf_counter() - started
            slowest = max(slowest, elapsed)
            print(f"lab {lab_id} variant {variant.id}: {elapsed:5.2f} s, passed={result.passed}")
    print(f"slowest check: {slowest:.2f} s (budget {BUDGET_S} s)")


if __name__ == "__main__":
    main()
