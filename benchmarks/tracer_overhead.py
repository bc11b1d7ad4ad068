"""What does leaving a GradTracer on cost? (issues #3 and #20's measured acceptance)

One run per model, interleaved: four copies of the same model train on the CPU (the ~4.8 M-parameter
MLP at batch 128; with ``--models`` also a small CNN and a small transformer encoder, other shapes of
work per parameter),
round after round, each round running every variant for a few steps in a rotating order, so that
drift on a shared machine hits all variants alike. Reported per variant: the median step time; the
ratio to plain training, as the median over rounds of (the variant's median step in that round /
plain's median step in that round), which cancels slow drift, by wall clock and by process CPU
time; and the ratio of mean wall-clock step times, which also counts the rare slow steps a median
hides. CPU time does not grow while other processes hold the cores, so on a busy machine (load
average above the core count, printed in the header) its ratio is the steadier one; with more than
one thread it also counts the time threads spin waiting for each other.

Variants: no tracing; ``GradTracer`` with defaults; full statistics every step (histograms and
sparsity, activation statistics, update:data ratios); the same without activation statistics (the
gradient-side work, which is what the naive monitor does too); and the naive monitor of seed
article S2 section 3.1, which copies every gradient to NumPy each step and reduces it there.
Targets: the default at most 1.03x plain (issue #3); full statistics at most 1.30x plain and below
the naive monitor (issue #20).

    .venv/bin/python benchmarks/tracer_overhead.py                 # torch's default thread count
    .venv/bin/python benchmarks/tracer_overhead.py --threads 1 --optimizer sgd
    .venv/bin/python benchmarks/tracer_overhead.py --threads 1 --models mlp cnn transformer
    .venv/bin/python benchmarks/tracer_overhead.py --threads 1 --models cnn --breakdown   # option by option
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from labkit import GradTracer
from labkit.probes import fingerprint, format_fingerprint

LAYER_WIDTHS = (784, 2048, 1024, 1024, 10)
BATCH = 128
TARGET_DEFAULT_RATIO = 1.03
TARGET_FULL_RATIO = 1.30
TARGET_NAIVE_OVERHEAD_MULTIPLE = 8.0
DEFAULT, FULL, NAIVE = "GradTracer default", "GradTracer full, every step", "naive NumPy monitor"
# The traced variants: label -> GradTracer options
TRACED = {
    DEFAULT: {},
    FULL: {"full_every": 1, "activations": True, "update_ratio": True},
    "GradTracer full without activations, every step": {"full_every": 1, "update_ratio": True},
}
# --breakdown: one option (or pair) at a time, to see which part of full mode costs what
BREAKDOWN = {
    DEFAULT: {},
    "full_every=1": {"full_every": 1},
    "full_every=1, update_ratio": {"full_every": 1, "update_ratio": True},
    "full_every=1, activations": {"full_every": 1, "activations": True},
    "activations only": {"activations": True},
    "update_ratio only": {"update_ratio": True},
}


@dataclass
class Variant:
    label: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    after_backward: Callable[[nn.Module], None] = lambda model: None
    step_times: list[float] = field(default_factory=list)
    round_medians: dict[str, list[float]] = field(default_factory=lambda: {"wall": [], "cpu": []})


def build_mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(LAYER_WIDTHS, LAYER_WIDTHS[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def build_cnn() -> nn.Module:
    """Convolutions: few parameters (~0.1 M), much compute per parameter."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(128, 10),
    )  # fmt: skip


class SmallTransformer(nn.Module):
    """Two encoder layers, d_model 128: many small parameter tensors (27), so per-tensor work shows."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


# name: (build, description, input shape); every model ends in 10 logits
MODELS: dict[str, tuple[Callable[[], nn.Module], str, tuple[int, ...]]] = {
    "mlp": (build_mlp, f"MLP {'-'.join(map(str, LAYER_WIDTHS))}", (BATCH, LAYER_WIDTHS[0])),
    "cnn": (build_cnn, "CNN 3 convolutions (32-64-128 channels) + linear head, 32x32 images", (32, 3, 32, 32)),
    "transformer": (SmallTransformer, "transformer encoder, 2 layers, d_model 128, 4 heads, 64 tokens",
                    (16, 64, 128)),
}


def make_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-4)
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def naive_numpy_monitor(records: list[dict]) -> Callable[[nn.Module], None]:
    """S2 section 3.1: after each backward, copy every gradient to NumPy and reduce it there."""

    def monitor(model: nn.Module) -> None:
        for name, param in model.named_parameters():
            # On a CPU tensor .numpy() would share memory; the article's monitor copies (on a GPU
            # that copy is the device-to-host transfer), so the copy stays.
            grad = param.grad.detach().cpu().numpy().copy()
            records.append({
                "param": name, "norm": float(np.linalg.norm(grad)), "mean": float(grad.mean()),
                "std": float(grad.std()), "max_abs": float(np.abs(grad).max()),
                "zero_frac": float((grad == 0).mean()),
                "nonfinite": int((~np.isfinite(grad)).sum()),
            })  # fmt: skip

    return monitor


def train_step(variant: Variant, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    """One optimizer step; returns its (wall-clock, CPU) seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    variant.optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(variant.model(inputs), targets).backward()
    variant.after_backward(variant.model)
    variant.optimizer.step()
    return time.perf_counter() - wall, time.process_time() - cpu


def run(
    model_name: str, rounds: int, steps_per_round: int, warmup_rounds: int, optimizer: str,
    traced: dict[str, dict] = TRACED,
) -> list[Variant]:
    torch.manual_seed(0)
    build, _, shape = MODELS[model_name]
    reference = build()
    inputs, targets = torch.randn(shape), torch.randint(0, 10, (shape[0],))
    naive_records: list[dict] = []
    variants = []
    for label in ("plain", *traced, NAIVE):
        model = copy.deepcopy(reference)
        variants.append(Variant(label, model, make_optimizer(model, optimizer)))
    variants[-1].after_backward = naive_numpy_monitor(naive_records)
    with ExitStack() as stack:
        for variant in variants[1:-1]:
            stack.enter_context(GradTracer(variant.model, variant.optimizer, **traced[variant.label]))
        for round_index in range(warmup_rounds + rounds):
            shift = round_index % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                times = [train_step(variant, inputs, targets) for _ in range(steps_per_round)]
                if round_index >= warmup_rounds:
                    variant.step_times += [wall for wall, _ in times]
                    variant.round_medians["wall"].append(statistics.median(w for w, _ in times))
                    variant.round_medians["cpu"].append(statistics.median(c for _, c in times))
    return variants


def report(
    variants: list[Variant], model_name: str, optimizer: str, rounds: int, steps_per_round: int,
    verdicts: bool = True,
) -> str:
    plain = variants[0]
    median_ratio = {
        (v.label, clock): statistics.median(
            a / b for a, b in zip(v.round_medians[clock], plain.round_medians[clock])
        )
        for v in variants
        for clock in ("wall", "cpu")
    }
    mean_ratio = {
        v.label: statistics.fmean(v.step_times) / statistics.fmean(plain.step_times) for v in variants
    }
    parameters = sum(p.numel() for p in variants[0].model.parameters())
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    _, description, shape = MODELS[model_name]
    lines = [
        f"{description} ({parameters / 1e6:.2f} M parameters), batch {shape[0]}, "
        f"{optimizer}; {rounds} rounds x {steps_per_round} steps per variant; load average {load} "
        "(1, 5, 15 min) at the end",
        "",
        "| variant | median step (ms) | median ratio, wall clock | median ratio, CPU time "
        "| mean ratio, wall clock |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for v in variants:
        lines.append(
            f"| {v.label} | {statistics.median(v.step_times) * 1e3:.2f} | "
            f"{median_ratio[v.label, 'wall']:.3f} | {median_ratio[v.label, 'cpu']:.3f} | "
            f"{mean_ratio[v.label]:.3f} |"
        )
    if not verdicts:  # a breakdown's variants are parts of full mode, not the modes the targets name
        return "\n".join(lines)
    lines.append("")
    for clock in ("wall", "cpu"):
        default, naive = (median_ratio[label, clock] for label in (DEFAULT, NAIVE))
        lines.append(verdict(default, naive, clock))
        lines += [full_verdict(label, median_ratio[label, clock], naive, clock) for label in TRACED if label != DEFAULT]
    return "\n".join(lines)


def full_verdict(label: str, ratio: float, naive_ratio: float, clock: str) -> str:
    within = ratio <= TARGET_FULL_RATIO
    return (
        f"{clock}: {label} {ratio:.3f}x plain (target <= {TARGET_FULL_RATIO}): "
        f"{'met' if within else 'NOT met'}; naive monitor {naive_ratio:.3f}x: "
        f"{'cheaper' if ratio < naive_ratio else 'NOT cheaper'}"
    )


def verdict(default_ratio: float, naive_ratio: float, clock: str) -> str:
    default_overhead, naive_overhead = default_ratio - 1.0, naive_ratio - 1.0
    first = (
        f"{clock}: default tracer {default_ratio:.3f}x plain (target <= {TARGET_DEFAULT_RATIO}): "
        f"{'met' if default_ratio <= TARGET_DEFAULT_RATIO else 'NOT met'}; "
    )
    if default_overhead <= 0:
        return first + "the default shows no overhead in this run, so the naive monitor's multiple is undefined"
    multiple = naive_overhead / default_overhead
    return first + (
        f"naive monitor overhead {multiple:.1f}x the default's "
        f"(target >= {TARGET_NAIVE_OVERHEAD_MULTIPLE:g}x): "
        f"{'met' if multiple >= TARGET_NAIVE_OVERHEAD_MULTIPLE else 'NOT met'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps-per-round", type=int, default=5)
    parser.add_argument("--warmup-rounds", type=int, default=2)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=["mlp"])
    parser.add_argument("--breakdown", action="store_true",
                        help="time full mode's options one at a time (no target verdicts)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(format_fingerprint(fingerprint()))
    for model_name in args.models:
        traced = BREAKDOWN if args.breakdown else TRACED
        variants = run(model_name, args.rounds, args.steps_per_round, args.warmup_rounds, args.optimizer, traced)
        print()
        table = report(variants, model_name, args.optimizer, args.rounds, args.steps_per_round, not args.breakdown)
        print(table, flush=True)


if __name__ == "__main__":
    main()
