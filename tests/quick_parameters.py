"""The smallest parameters each notebook runs top to bottom with, for tests that check how a notebook runs
(every cell executes, checks fail gracefully) rather than what it measures.

A notebook at its defaults is nbval's job (the stored outputs), and its verdicts at small sizes are the
job of tests/test_nbNN_*.py, whose parameters are chosen to drive a verdict. These are smaller still: a
structural run pays for the kernel and the cells, not for training long enough to decide a claim, so
the student editions (17 executions in `make test`) cost about 270 s on a slow 2-core host against
about 340 s at the defaults: what is left is mostly each kernel's start (torch, dynamo).

Each notebook's sizes are the `[quick_parameters]` table of its metadata block,
notebooks/meta/NN_name.toml; tests/test_notebook_meta.py checks that every notebook has one and that
its names are declared in the notebook's parameters cell, with values of the declared types.
"""

from __future__ import annotations

from labkit import _notebook_meta

QUICK_PARAMETERS: dict[str, dict[str, object]] = _notebook_meta.quick_parameters()
