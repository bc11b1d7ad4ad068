"""How far can labkit.memory's numbers be trusted? Eleven architectures, three comparisons.

For each model, on this machine's CPU:

1. exact saved bytes (``saved_tensors``) + outputs nothing saved, vs the allocator's live bytes
   after one forward (``live_bytes_after_forward``, from profiler events); target: identical;
2. analytic activation bytes (``analytic_activation_bytes``: module and op formulas, plus the bytes
   no formula explains, itemised by the op that saved them) vs the exact count; target: within
   ±5 %, with how much of it is formula-backed and which ops are unexplained;
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
import torch.nn.functional as F
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


class FunctionalAttention(nn.Module):
    """Attention written by hand: F.scaled_dot_product_attention between Linear layers, with the
    views and permutes that split heads, and a functional residual x + gelu(out(norm(x)))."""

    def __init__(self, width: int = 128, heads: int = 4):
        super().__init__()
        self.heads, self.norm = heads, nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, length, width)
        return x + F.gelu(self.out(attended))


class GRUHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru, self.head = nn.GRU(32, 64, batch_first=True), nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.gru(x)[0][:, -1])


class SquareFunction(torch.autograd.Function):
    """A custom op that saves its own input: no formula can know what a custom backward needs."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class CustomOps(nn.Module):
    """A custom module's own forward, exp(x @ w).tanh(), then a custom autograd.Function."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(256, 256) / 16)
        self.fc = nn.Linear(256, 10)

    def forward(self, x):
        return self.fc(SquareFunction.apply(torch.exp(x @ self.w).tanh()))


class ViewsBetweenLayers(nn.Module):
    """Convolution features reshaped, permuted and flattened between layers (non-contiguous inputs)."""

    def __init__(self):
        super().__init__()
        self.conv, self.mix, self.head = nn.Conv2d(3, 16, 3, padding=1), nn.Linear(16, 32), nn.Linear(32 * 64, 10)

    def forward(self, x):
        features = F.relu(self.conv(x))  # (B, 16, 8, 8)
        tokens = features.flatten(2).permute(0, 2, 1)  # (B, 64, 16), not contiguous
        return self.head(torch.tanh(self.mix(tokens)).reshape(x.shape[0], -1))


CASES = {
    "MLP (Linear, ReLU, Dropout, GELU)": (MLP, (64, 256)),
    "CNN with BatchNorm": (ConvBatchNorm, (8, 3, 32, 32)),
    "residual block": (ResidualBlock, (8, 32, 16, 16)),
    "transformer block, fused SDPA": (lambda: TransformerBlock(fused=True), (8, 64, 128)),
    "transformer block, explicit softmax": (lambda: TransformerBlock(fused=False), (8, 64, 128)),
    "LSTM": (LSTMClassifier, (16, 20, 32)),
    "depthwise-separable conv net": (DepthwiseSeparable, (8, 3, 32, 32)),
    "functional attention (F.sdpa, views, residual)": (FunctionalAttention, (8, 64, 128)),
    "GRU head": (GRUHead, (16, 20, 32)),
    "custom ops (exp/tanh + autograd.Function)": (CustomOps, (64, 256)),
    "views between layers": (ViewsBetweenLayers, (8, 3, 8, 8)),
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
        "formula-backed": f"{analytic.formula_bytes:,}",
        "unexplained (op that saved it)": (f"{analytic.unexplained_bytes:,} B: {', '.join(analytic.unexplained)}"
                                           if analytic.unexplained else "0"),
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
