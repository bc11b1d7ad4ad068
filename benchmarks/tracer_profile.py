"""Where does a GradTracer's time go? torch.profiler over a few training steps (issue #20)

Trains one of `tracer_overhead.py`'s models on the CPU for ``--warmup`` steps, then profiles
``--steps`` more, once without a tracer and once with the GradTracer options given, and prints
each op's self CPU time per step in both runs, largest difference first: the ops the tracer adds
and the model's own ops it slows down. Times are per step, from one run each: read the
differences, not the absolute figures, and repeat a run before trusting a small one.

    .venv/bin/python benchmarks/tracer_profile.py --model mlp --full-every 1 --update-ratio
    .venv/bin/python benchmarks/tracer_profile.py --model cnn --activations
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from tracer_overhead import MODELS, make_optimizer

from labkit import GradTracer


def self_times_per_step(model_name: str, options: dict | None, warmup: int, steps: int) -> dict[str, float]:
    """Self CPU milliseconds per step by op name; ``options=None`` trains without a tracer."""
    torch.manual_seed(0)
    build, _, shape = MODELS[model_name]
    model = build()
    optimizer = make_optimizer(model, "adam")
    inputs, targets = torch.randn(shape), torch.randint(0, 10, (shape[0],))

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()

    tracer = contextlib.nullcontext() if options is None else GradTracer(model, optimizer, **options)
    with tracer:
        for _ in range(warmup):
            train_step()
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            for _ in range(steps):
                train_step()
    return {event.key: event.self_cpu_time_total / 1e3 / steps for event in profiler.key_averages()}


def report(plain: dict[str, float], traced: dict[str, float], rows: int) -> str:
    names = sorted(set(plain) | set(traced), key=lambda n: traced.get(n, 0) - plain.get(n, 0), reverse=True)
    lines = ["| op | plain (ms/step) | traced (ms/step) | difference |", "| --- | ---: | ---: | ---: |"]
    for name in names[:rows]:
        before, after = plain.get(name, 0.0), traced.get(name, 0.0)
        lines.append(f"| {name} | {before:.2f} | {after:.2f} | {after - before:+.2f} |")
    lines.append(f"| all ops | {sum(plain.values()):.2f} | {sum(traced.values()):.2f} | "
                 f"{sum(traced.values()) - sum(plain.values()):+.2f} |")  # fmt: skip
    return "\n".join(lines)


def count(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``minimum``, or an error that says so."""

    def parse(text: str) -> int:
        if not text.strip().lstrip("-").isdigit() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {minimum}")
        return int(text)

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(MODELS), default="mlp")
    parser.add_argument("--full-every", type=count(0), default=0)
    parser.add_argument("--activations", action="store_true")
    parser.add_argument("--update-ratio", action="store_true")
    parser.add_argument("--warmup", type=count(0), default=5)
    parser.add_argument("--steps", type=count(1), default=10)
    parser.add_argument("--rows", type=count(1), default=15)
    parser.add_argument("--threads", type=count(1), default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    options = {"full_every": args.full_every, "activations": args.activations, "update_ratio": args.update_ratio}
    plain = self_times_per_step(args.model, None, args.warmup, args.steps)
    traced = self_times_per_step(args.model, options, args.warmup, args.steps)
    print(f"{args.model}, GradTracer({', '.join(f'{k}={v}' for k, v in options.items())}), "
          f"{args.steps} profiled steps after {args.warmup}, {args.threads} thread(s)\n")  # fmt: skip
    print(report(plain, traced, args.rows))


if __name__ == "__main__":
    main()
