"""What does leaving a GradTracer on cost? (issues #3, #20 and #36's measured acceptance)

One run per model, interleaved: copies of the same model train on the CPU (the ~4.8 M-parameter
MLP at batch 128; with ``--models`` also a small CNN and a small transformer encoder, other shapes of
work per parameter),
round after round, each round running every variant for a few steps in a rotating order, so that
drift on a shared machine hits all variants alike. Reported per variant: the median step time; the
ratio to plain training, as the median over rounds of (the variant's median step in that round /
plain's median step in that round), which cancels slow drift, by wall clock and by process CPU
time; and the ratio of mean wall-clock step times, which also counts the rare slow steps a median
hides. CPU time does not grow while other processes hold the cores, so on a busy machine (load
average above the core count, printed in the header) its ratio is the steadier one; with more than
one thread it also counts the time threads spin waiting for each other (and TensorBoard's writer
thread, which runs beside the training thread).

Variants: no tracing; ``GradTracer`` with defaults; full statistics every step (histograms and
sparsity, activation statistics, update:data ratios); the same without activation statistics (the
gradient-side work); full statistics with exact histograms (``histogram_sample=None``: every value
of every gradient binned, where the default bins a fixed sample of a large gradient); TensorBoard's
recipe (every step, for every parameter, ``add_histogram`` of the gradient and of the weight and
``add_scalar`` of the gradient's norm, written by ``torch.utils.tensorboard.SummaryWriter`` into a
temporary folder removed afterwards; needs the ``bench`` extra, and is skipped with the reason
printed where tensorboard is not importable); and, for information, the naive monitor of seed
article S2 section 3.1, which copies every gradient to NumPy each step and reduces it there
(it computes fewer statistics than full mode, so it is not a target). With ``--floor``, also full
mode's tensor passes alone (`TensorPassesOnly`: the same reductions, copy and differences in plain
hooks, without GradTracer's binning, staging and records), for information: the floor of full
statistics every step with these torch ops, and so how much of full mode's cost is bookkeeping.
Targets: the default at most 1.03x plain (issue #3); full statistics at most 1.30x plain, and
full statistics' overhead (ratio - 1) at most half of TensorBoard's recipe's (issue #36).

What exact histograms cost a value: per round, the exact-histogram variant's median step minus full
mode's, over the values the default leaves out of its histograms (those beyond the
``HISTOGRAM_SAMPLE`` positions of each larger gradient); beside it, ``torch.histc`` alone (32 bins)
on a tensor the size of the model's largest gradient, timed once per round.

    .venv/bin/python benchmarks/tracer_overhead.py                 # torch's default thread count
    .venv/bin/python benchmarks/tracer_overhead.py --threads 1 --optimizer sgd
    .venv/bin/python benchmarks/tracer_overhead.py --threads 1 --models mlp cnn transformer
    .venv/bin/python benchmarks/tracer_overhead.py --threads 1 --models cnn --breakdown   # option by option
    .venv/bin/python benchmarks/tracer_overhead.py --threads 1 --rounds 15 --floor       # beside the floor
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from labkit import GradTracer
from labkit.probes import fingerprint, format_fingerprint
from labkit.tracers import HISTOGRAM_SAMPLE

LAYER_WIDTHS = (784, 2048, 1024, 1024, 10)
BATCH = 128
TARGET_DEFAULT_RATIO = 1.03
TARGET_FULL_RATIO = 1.30
TARGET_NAIVE_OVERHEAD_MULTIPLE = 8.0
# full mode's overhead over plain, as a fraction of TensorBoard's recipe's (issue #36)
TARGET_FULL_OVER_TENSORBOARD = 0.5
DEFAULT, FULL, FULL_NO_ACTIVATIONS = (
    "GradTracer default", "GradTracer full, every step", "GradTracer full without activations, every step"
)
FULL_EXACT = "GradTracer full, exact histograms (histogram_sample=None)"
TENSORBOARD = "TensorBoard recipe (gradient + weight histograms, gradient norms)"
NAIVE = "naive NumPy monitor (information)"
FLOOR = "full mode's tensor passes alone, no bookkeeping (information: the floor)"
# The traced variants: label -> GradTracer options
TRACED = {
    DEFAULT: {},
    FULL: {"full_every": 1, "activations": True, "update_ratio": True},
    FULL_NO_ACTIVATIONS: {"full_every": 1, "update_ratio": True},
    FULL_EXACT: {"full_every": 1, "activations": True, "update_ratio": True, "histogram_sample": None},
}
# The full-mode variants held to issue #36's targets (the exact-histogram one is reported, not held)
HELD_TO_FULL_TARGETS = (FULL, FULL_NO_ACTIVATIONS)
# --breakdown: one option (or pair) at a time, to see which part of full mode costs what
BREAKDOWN = {
    DEFAULT: {},
    "full_every=1": {"full_every": 1},
    "full_every=1, update_ratio": {"full_every": 1, "update_ratio": True},
    "full_every=1, activations": {"full_every": 1, "activations": True},
    "activations only": {"activations": True},
    "update_ratio only": {"update_ratio": True},
}
HISTC_BINS = 32  # GradTracer's default histogram_bins
# GradTracer reduces a CPU gradient this many values at a time (labkit/tracers/_reductions.py, _CHUNK)
TRACER_CHUNK = 2**17


@dataclass
class Variant:
    label: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    after_backward: Callable[[nn.Module], None] = lambda model: None
    step_times: list[float] = field(default_factory=list)
    round_medians: dict[str, list[float]] = field(default_factory=lambda: {"wall": [], "cpu": []})


@dataclass
class Run:
    """One model's measurements: the variants (plain first), why TensorBoard's recipe was not
    measured (None when it was), and torch.histc's seconds per round on the largest gradient's size."""

    variants: list[Variant]
    tensorboard_skipped: str | None = None
    histc_seconds: dict[str, list[float]] = field(default_factory=lambda: {"wall": [], "cpu": []})
    histc_values: int = 0


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


def tensorboard_writer(log_dir: str) -> tuple[object | None, str | None]:
    """A SummaryWriter into ``log_dir``, or (None, why not) where tensorboard is not importable."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:  # torch raises ImportError when the tensorboard package is missing
        return None, (
            f"tensorboard is not importable ({error}); install the bench extra: "
            ".venv/bin/pip install --constraint constraints.txt -e '.[bench]'"
        )
    return SummaryWriter(log_dir=log_dir), None


def tensorboard_recipe(writer) -> Callable[[nn.Module], None]:
    """TensorBoard's usual recipe, as the performance review measured it: every step, for every
    parameter, a histogram of its gradient and of its weight, and the gradient's L2 norm as a
    scalar. SummaryWriter hands the records to its writer thread, which appends them to an event
    file."""
    state = {"step": 0}

    def log(model: nn.Module) -> None:
        step = state["step"]
        for name, param in model.named_parameters():
            writer.add_histogram(f"grad/{name}", param.grad, step)
            writer.add_histogram(f"weight/{name}", param, step)
            writer.add_scalar(f"grad_norm/{name}", param.grad.norm().item(), step)
        state["step"] += 1

    return log


class TensorPassesOnly:
    """Full mode's tensor work and nothing else (``--floor``): what full statistics every step cost
    with these torch ops before any of GradTracer's bookkeeping, so the floor that no rearrangement
    of that bookkeeping goes below (issue #36). Per gradient, in its post-accumulate-grad hook, the
    passes GradTracer makes chunk by chunk (the signs into a buffer kept in cache, g . g, sum g, min,
    max, sign(g) . g, sign(g) . sign(g)) and the gather of the histogram's sample; per leaf module
    output, its sum and sum of squares (and a ReLU's per-unit sums and which units fired); around the
    optimizer step, the update:data ratio's copy of the parameters and its norms, then the difference
    in place and its norms. Left out: binning the samples, batching small gradients, staging per
    backward, the step's one read-back, its records and alerts."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.params = list(model.parameters())
        self.handles: list = []
        self.results: list[torch.Tensor] = []  # kept until the step ends, as GradTracer keeps its sums

    def __enter__(self) -> TensorPassesOnly:
        self.copies = [param.detach().clone() for param in self.params]
        self.signs = torch.empty(TRACER_CHUNK)
        generator = torch.Generator().manual_seed(0)
        self.positions = {
            id(param): torch.randint(param.numel(), (HISTOGRAM_SAMPLE,), generator=generator).sort().values
            for param in self.params if param.numel() > HISTOGRAM_SAMPLE
        }  # fmt: skip
        self.handles += [param.register_post_accumulate_grad_hook(self.gradient) for param in self.params]
        self.handles += [
            module.register_forward_hook(self.activation)
            for module in self.model.modules() if next(module.children(), None) is None
        ]  # fmt: skip
        self.handles += [self.optimizer.register_step_pre_hook(self.before_update),
                         self.optimizer.register_step_post_hook(self.after_update)]  # fmt: skip
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self.handles:
            handle.remove()

    def gradient(self, param: torch.Tensor) -> None:
        flat = param.grad.reshape(-1)
        for values in flat.split(TRACER_CHUNK):
            signs = self.signs[: values.numel()]
            torch.sign(values, out=signs)
            self.results += (torch.dot(values, values), values.sum(), values.amin(), values.amax(),
                             torch.dot(signs, values), torch.dot(signs, signs))  # fmt: skip
        positions = self.positions.get(id(param))
        self.results.append(flat.clone() if positions is None else flat.index_select(0, positions))

    def activation(self, module: nn.Module, inputs: object, output: torch.Tensor) -> None:
        if not torch.is_grad_enabled():
            return
        values = output.detach()
        flat = values.reshape(-1)
        if isinstance(module, nn.ReLU) and values.dim() > 1:
            unit_sums = values.sum(dim=[dim for dim in range(values.dim()) if dim != 1])
            self.results += (unit_sums.sum(), torch.dot(flat, flat), unit_sums.gt(0))
        else:
            self.results += (flat.sum(), torch.dot(flat, flat))

    def before_update(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        with torch.no_grad():
            for copy_, param in zip(self.copies, self.params):
                copy_.copy_(param)
        self.results += [torch.linalg.vector_norm(copy_) for copy_ in self.copies]

    def after_update(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        with torch.no_grad():
            for copy_, param in zip(self.copies, self.params):
                copy_.sub_(param)
        self.results += [torch.linalg.vector_norm(copy_) for copy_ in self.copies]
        self.results.clear()  # where GradTracer reads the step's numbers back


def train_step(variant: Variant, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    """One optimizer step; returns its (wall-clock, CPU) seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    variant.optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(variant.model(inputs), targets).backward()
    variant.after_backward(variant.model)
    variant.optimizer.step()
    return time.perf_counter() - wall, time.process_time() - cpu


def time_histc(values: torch.Tensor) -> tuple[float, float]:
    """(Wall-clock, CPU) seconds of one torch.histc over ``values`` (the exact histogram's binning alone)."""
    wall, cpu = time.perf_counter(), time.process_time()
    torch.histc(values, HISTC_BINS)
    return time.perf_counter() - wall, time.process_time() - cpu


def run(
    model_name: str, rounds: int, steps_per_round: int, warmup_rounds: int, optimizer: str,
    traced: dict[str, dict] = TRACED, with_tensorboard: bool = True, with_floor: bool = False,
) -> Run:
    torch.manual_seed(0)
    build, _, shape = MODELS[model_name]
    reference = build()
    inputs, targets = torch.randn(shape), torch.randint(0, 10, (shape[0],))
    naive_records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="tracer_overhead_tb_") as log_dir:
        writer, skipped = tensorboard_writer(log_dir) if with_tensorboard else (None, "left out by --no-tensorboard")
        if skipped and with_tensorboard:
            print(f"TensorBoard recipe skipped: {skipped}", flush=True)
        optional_variants = ([FLOOR] if with_floor else []) + ([TENSORBOARD] if writer is not None else [])
        labels = ["plain", *traced, *optional_variants, NAIVE]
        variants = []
        for label in labels:
            model = copy.deepcopy(reference)
            variants.append(Variant(label, model, make_optimizer(model, optimizer)))
        by_label = {variant.label: variant for variant in variants}
        by_label[NAIVE].after_backward = naive_numpy_monitor(naive_records)
        if writer is not None:
            by_label[TENSORBOARD].after_backward = tensorboard_recipe(writer)
        largest = max(p.numel() for p in reference.parameters())
        histc_input = torch.randn(largest)
        result = Run(variants, skipped, histc_values=largest)
        try:
            with ExitStack() as stack:
                for label in traced:
                    stack.enter_context(GradTracer(by_label[label].model, by_label[label].optimizer, **traced[label]))
                if with_floor:
                    stack.enter_context(TensorPassesOnly(by_label[FLOOR].model, by_label[FLOOR].optimizer))
                for round_index in range(warmup_rounds + rounds):
                    shift = round_index % len(variants)
                    for variant in variants[shift:] + variants[:shift]:
                        times = [train_step(variant, inputs, targets) for _ in range(steps_per_round)]
                        if round_index >= warmup_rounds:
                            variant.step_times += [wall for wall, _ in times]
                            variant.round_medians["wall"].append(statistics.median(w for w, _ in times))
                            variant.round_medians["cpu"].append(statistics.median(c for _, c in times))
                    histc_wall, histc_cpu = time_histc(histc_input)
                    if round_index >= warmup_rounds:
                        result.histc_seconds["wall"].append(histc_wall)
                        result.histc_seconds["cpu"].append(histc_cpu)
        finally:
            if writer is not None:
                writer.close()  # flushes and stops the writer thread before the folder goes
    return result


def sampled_out_values(model: nn.Module) -> int:
    """The gradient values the default histograms leave out and ``histogram_sample=None`` bins:
    of each gradient larger than HISTOGRAM_SAMPLE, all but the sample's positions."""
    return sum(p.numel() - HISTOGRAM_SAMPLE for p in model.parameters() if p.numel() > HISTOGRAM_SAMPLE)


def report(
    result: Run, model_name: str, optimizer: str, rounds: int, steps_per_round: int, verdicts: bool = True,
) -> str:
    variants = result.variants
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
    tensors = sum(1 for _ in variants[0].model.parameters())
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    _, description, shape = MODELS[model_name]
    lines = [
        f"{description} ({parameters / 1e6:.2f} M parameters in {tensors} tensors), batch {shape[0]}, "
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
    if result.tensorboard_skipped:
        lines.append(f"TensorBoard recipe not measured: {result.tensorboard_skipped}")
    tensorboard = {clock: median_ratio.get((TENSORBOARD, clock)) for clock in ("wall", "cpu")}
    for clock in ("wall", "cpu"):
        lines.append(verdict(median_ratio[DEFAULT, clock], median_ratio[NAIVE, clock], clock))
        lines += [
            full_verdict(label, median_ratio[label, clock], tensorboard[clock], median_ratio[NAIVE, clock], clock)
            for label in HELD_TO_FULL_TARGETS
            if (label, clock) in median_ratio
        ]
        if (FLOOR, clock) in median_ratio:
            lines.append(floor_line(median_ratio[FLOOR, clock], median_ratio[FULL, clock], clock))
    lines += histogram_cost(result, model_name)
    return "\n".join(lines)


def full_verdict(label: str, ratio: float, tensorboard_ratio: float | None, naive_ratio: float, clock: str) -> str:
    within = ratio <= TARGET_FULL_RATIO
    line = f"{clock}: {label} {ratio:.3f}x plain (target <= {TARGET_FULL_RATIO}): {'met' if within else 'NOT met'}; "
    if tensorboard_ratio is None:
        line += "overhead against TensorBoard's recipe: not measured; "
    elif tensorboard_ratio <= 1.0:
        line += (f"TensorBoard's recipe {tensorboard_ratio:.3f}x shows no overhead in this run, so the "
                 "fraction is undefined: NOT met; ")
    else:
        fraction = max(ratio - 1.0, 0.0) / (tensorboard_ratio - 1.0)
        line += (
            f"overhead {ratio - 1.0:+.1%} = {fraction:.2f} of TensorBoard's recipe's {tensorboard_ratio - 1.0:+.1%} "
            f"(target <= {TARGET_FULL_OVER_TENSORBOARD}): {'met' if fraction <= TARGET_FULL_OVER_TENSORBOARD else 'NOT met'}; "
        )
    return line + f"naive monitor {naive_ratio:.3f}x (information, fewer statistics: not a target)"


def floor_line(floor_ratio: float, full_ratio: float, clock: str) -> str:
    return (
        f"{clock}: full mode's tensor passes alone {floor_ratio:.3f}x plain (information: the floor of full "
        f"statistics every step with these ops); {FULL} {full_ratio:.3f}x, so its bookkeeping costs "
        f"{full_ratio - floor_ratio:+.3f} of a plain step"
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


def histogram_cost(result: Run, model_name: str) -> list[str]:
    """What exact histograms cost a value, by wall clock and by CPU time: the exact variant's median
    step less full mode's, per round, over the values the default leaves out of its histograms; and
    torch.histc alone."""
    by_label = {v.label: v for v in result.variants}
    lines = []
    if FULL_EXACT in by_label and FULL in by_label:
        extra = sampled_out_values(by_label[FULL].model)
        for clock in ("wall", "cpu"):
            if not extra:
                lines.append(f"{clock}: exact histograms, {model_name}: no gradient exceeds {HISTOGRAM_SAMPLE:,} "
                             "values, so the sampled default already bins every value")
                break
            differences = [
                exact - full
                for exact, full in zip(by_label[FULL_EXACT].round_medians[clock], by_label[FULL].round_medians[clock])
            ]
            difference = statistics.median(differences)
            lines.append(
                f"{clock}: exact histograms (histogram_sample=None) against the sampled default, {model_name}: "
                f"{difference * 1e3:+.1f} ms a step (median over rounds of the difference; rounds "
                f"{min(differences) * 1e3:+.1f} to {max(differences) * 1e3:+.1f}) for {extra:,} more values "
                f"binned: {difference / extra * 1e9:.1f} ns a value"
            )
    for clock in ("wall", "cpu"):
        if result.histc_seconds[clock]:
            seconds = statistics.median(result.histc_seconds[clock])
            lines.append(
                f"{clock}: torch.histc alone ({HISTC_BINS} bins, float32, {result.histc_values:,} values, the "
                f"largest gradient's size; median of {len(result.histc_seconds[clock])} rounds): "
                f"{seconds * 1e3:.2f} ms, {seconds / result.histc_values * 1e9:.1f} ns a value"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps-per-round", type=int, default=5)
    parser.add_argument("--warmup-rounds", type=int, default=2)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=["mlp"])
    parser.add_argument("--breakdown", action="store_true",
                        help="time full mode's options one at a time (no target verdicts)")
    parser.add_argument("--floor", action="store_true",
                        help="also time full mode's tensor passes alone, without GradTracer's bookkeeping (information)")
    parser.add_argument("--no-tensorboard", action="store_true",
                        help="leave TensorBoard's recipe out (the full-mode target against it is then not checked)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(format_fingerprint(fingerprint()))
    for model_name in args.models:
        traced = BREAKDOWN if args.breakdown else TRACED
        result = run(model_name, args.rounds, args.steps_per_round, args.warmup_rounds, args.optimizer, traced,
                     with_tensorboard=not (args.breakdown or args.no_tensorboard),
                     with_floor=args.floor and not args.breakdown)
        print()
        table = report(result, model_name, args.optimizer, args.rounds, args.steps_per_round, not args.breakdown)
        print(table, flush=True)


if __name__ == "__main__":
    main()
