"""How far can labkit.memory's numbers be trusted? Seven architectures, three comparisons.

For each model, on this machine's CPU:

1. exact saved bytes (``saved_tensors``) + outputs nothing saved, vs the allocator's live bytes
   after one forward (``live_bytes_after_forward``, from profiler events); target: identical;
2. analytic activation bytes (``activation_table``) vs the exact count; target: within ±5 %;
3. the allocation-free steady-state step peak (``estimate_step_peak``, fake tensors) vs the
   measured CPU peak of step 2 (``measure_step_peak``); target: within ±1 %. Twice: tensors only
   (``kernel_workspace="ignore"``) and with the convolution and recurrent kernels' private
   workspace, measured one kernel call at a time (``"measure"``, the default for a real model).

Run: ``.venv/bin/python benchmarks/memory_accuracy.py`` (about half a minute on 2 cores). Prints a
markdown table; ``benchmarks/results/memory_accuracy.md`` holds the recorded one and what it means.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from labkit import memory  # noqa: E402


class MLP(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(256, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 512),
                         nn.GELU(), nn.Linear(512, 10))


class ConvBatchNorm(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


class ResidualBlock(nn.Module):
    def __init__(self, channels: int = 32):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1, self.relu1 = nn.BatchNorm2d(channels), nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2, self.relu2 = nn.BatchNorm2d(channels), nn.ReLU()

    def forward(self, x):
        return self.relu2(self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x))))) + x)


class TransformerBlock(nn.Module):
    """Pre-norm block; ``fused=True`` lets MultiheadAttention call fused SDPA, ``False`` asks it for
    the attention weights, which forces the explicit softmax(QKᵀ)V path."""

    def __init__(self, fused: bool, width: int = 128, heads: int = 4):
        super().__init__()
        self.fused = fused
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.fc1, self.act, self.fc2 = nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=not self.fused)[0]
        return x + self.drop(self.fc2(self.act(self.fc1(self.ln2(x)))))


class LSTMClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.head = nn.LSTM(32, 64, batch_first=True), nn.Linear(64, 10)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class DepthwiseSeparable(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(32, 32, 3, padding=1, groups=32), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.Conv2d(32, 64, 1), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


CASES = {
    "MLP (Linear, ReLU, Dropout, GELU)": (MLP, (64, 256)),
    "CNN with BatchNorm": (ConvBatchNorm, (8, 3, 32, 32)),
    "residual block": (ResidualBlock, (8, 32, 16, 16)),
    "transformer block, fused SDPA": (lambda: TransformerBlock(fused=True), (8, 64, 128)),
    "transformer block, explicit softmax": (lambda: TransformerBlock(fused=False), (8, 64, 128)),
    "LSTM": (LSTMClassifier, (16, 20, 32)),
    "depthwise-separable conv net": (DepthwiseSeparable, (8, 3, 32, 32)),
}


def percent(value: int, reference: int) -> str:
    return f"{(value - reference) / reference:+.3%}"


def measure_case(make_model, input_shape) -> dict[str, str]:
    torch.manual_seed(0)
    model, x = make_model(), torch.randn(input_shape)
    exact = memory.saved_tensors(model, x)
    live = int(memory.live_bytes_after_forward(model, x))
    analytic = memory.analytic_activation_bytes(model, x)
    tensors_only = int(memory.estimate_step_peak(model, x, optimizer="adamw", kernel_workspace="ignore"))
    estimated = int(memory.estimate_step_peak(model, x, optimizer="adamw", kernel_workspace="measure"))
    measured = int(memory.measure_step_peak(model, x, optimizer="adamw"))
    return {
        "exact saved": f"{exact.total:,}",
        "live after fwd − outputs": f"{live - exact.output_only_bytes:,}",
        "live − (saved + outputs)": f"{live - exact.total - exact.output_only_bytes:+,} B",
        "analytic": f"{analytic:,}",
        "analytic vs exact": percent(analytic, exact.total),
        "estimated peak, tensors only": f"{tensors_only:,}",
        "estimated peak, + kernel workspace": f"{estimated:,}",
        "measured peak": f"{measured:,}",
        "tensors only vs measured": percent(tensors_only, measured),
        "+ workspace vs measured": percent(estimated, measured),
    }


def main() -> None:
    torch.set_num_threads(2)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, "
          f"oneDNN {'on' if torch.backends.mkldnn.is_available() else 'off'}, load average {load}; "
          "optimizer AdamW; bytes\n")
    started = time.perf_counter()
    rows = {name: measure_case(make, shape) for name, (make, shape) in CASES.items()}
    columns = list(next(iter(rows.values())))
    print("| model | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(row[c] for c in columns) + " |")
    print(f"\n{time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
