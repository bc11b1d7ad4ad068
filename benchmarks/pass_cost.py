"""What does one pass over a gradient cost, in cache and out of it? (issue #20)

GradTracer reduces a large CPU gradient chunk by chunk because a pass over values a core's cache
already holds is cheaper than one that reads them from memory. This times, with
`torch.utils.benchmark`, the ops of a full-statistics step on a tensor small enough to stay in
cache (``--small`` values, repeated on the same tensor) and on one too large to (``--large``), and
prints nanoseconds a value for each and their ratio. One run; the ratio is the number to read.

    .venv/bin/python benchmarks/pass_cost.py
    .venv/bin/python benchmarks/pass_cost.py --threads 1 --small 131072 --large 4194304
"""

from __future__ import annotations

import argparse

import torch
import torch.utils.benchmark as benchmark

# label -> statement over ``values`` and ``out`` (a tensor of the same size to write to)
OPS = {
    "dot(g, g)": "torch.dot(values, values)",
    "sum(g)": "values.sum()",
    "aminmax(g)": "torch.aminmax(values)",
    "sign(g) into a buffer": "torch.sign(values, out=out)",
    "copy into a buffer": "out.copy_(values)",
    "difference into a buffer": "torch.sub(out, values, out=out)",
}


def ns_per_value(statement: str, numel: int, min_run_time: float) -> float:
    torch.manual_seed(0)
    values, out = torch.randn(numel), torch.randn(numel)
    timer = benchmark.Timer(statement, globals={"torch": torch, "values": values, "out": out})
    return timer.blocked_autorange(min_run_time=min_run_time).median / numel * 1e9


def positive(text: str) -> int:
    number = int(text)
    if number < 1:
        raise argparse.ArgumentTypeError(f"needs a count of at least 1, got {number}")
    return number


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=positive, default=2**16, help="values in the in-cache tensor")
    parser.add_argument("--large", type=positive, default=2**22, help="values in the out-of-cache tensor")
    parser.add_argument("--threads", type=positive, default=1)
    parser.add_argument("--min-run-time", type=float, default=0.3, help="seconds per measurement")
    args = parser.parse_args()
    if args.min_run_time <= 0:
        parser.error(f"--min-run-time needs a positive number of seconds, got {args.min_run_time}")
    if args.large <= args.small:
        parser.error(f"--large ({args.large}) must exceed --small ({args.small})")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s); ns a value, median of torch.utils.benchmark\n")
    print(f"| op | {args.small:,} values | {args.large:,} values | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for label, statement in OPS.items():
        small = ns_per_value(statement, args.small, args.min_run_time)
        large = ns_per_value(statement, args.large, args.min_run_time)
        print(f"| {label} | {small:.3f} | {large:.3f} | {large / small:.2f}x |")


if __name__ == "__main__":
    main()
