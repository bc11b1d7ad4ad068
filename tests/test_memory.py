"""labkit.memory: exact saved-tensor counts, per-layer formulas, the fake-tensor step peak, and
measurements that say why when they cannot measure."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from labkit import memory
from labkit.errors import LabkitError
from labkit.memory import estimate, workspace
from labkit.readings import UnavailableReading

FLOAT = 4


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


class ScaledLinear(nn.Module):
    """Multiplies by a Python float, which autograd saves as a wrapped 0-d float64 tensor."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x) * 0.5


class FunctionalReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.second(torch.nn.functional.relu(self.first(x)))


class Attention(nn.Module):
    """Wraps MultiheadAttention so its inputs are activations (they need grad), as in a real block."""

    def __init__(self, mode: str, need_weights: bool, dropout: float, batch_first: bool):
        super().__init__()
        self.mode, self.need_weights = mode, need_weights
        self.project = nn.Linear(16, 16)
        self.attn = nn.MultiheadAttention(16, 4, dropout=dropout, batch_first=batch_first)

    def forward(self, x, other):
        x = self.project(x)
        query_key_value = {"self": (x, x, x), "cross": (x, other, other), "separate": (x, other, other + 1)}
        return self.attn(*query_key_value[self.mode], need_weights=self.need_weights)[0]


def small_models():
    """(id, model, inputs): each formula family, small enough for 2 cores."""
    seq_first, batch_first = torch.randn(6, 3, 16), torch.randn(3, 6, 16)
    attention = [
        (f"attention-{mode}-weights{nw}-p{p}-bf{bf}", Attention(mode, nw, p, bf),
         (batch_first, torch.randn(3, 6, 16)) if bf else (seq_first, torch.randn(6, 3, 16)))
        # dropout decides fused vs math SDPA, batch_first whether the projections copy their input
        for mode in ("self", "cross", "separate") for nw in (True, False) for p, bf in ((0.0, True), (0.2, False))
    ]
    lstms = [
        (f"lstm-layers{layers}-bi{bi}-bf{bf}-drop{drop}", nn.LSTM(4, 6, layers, batch_first=bf, bidirectional=bi,
                                                                     dropout=drop),
         (torch.randn(3, 5, 4),))
        for layers, bi, bf, drop in ((1, False, True, 0.0), (2, False, False, 0.5), (2, True, True, 0.0),
                                     (2, True, False, 0.5))
    ]
    return [
        ("mlp-dropout-gelu", nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 16),
                                           nn.GELU(), nn.Linear(16, 2)), (torch.randn(5, 8),)),
        ("cnn-batchnorm-maxpool", nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                                nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2)),
         (torch.randn(2, 3, 10, 10),)),
        ("groupnorm-avgpool-dropout2d", nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.Dropout2d(0.3),
                                                      nn.AvgPool2d(2), nn.AdaptiveAvgPool2d(2),
                                                      nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(8, 3)),
         (torch.randn(2, 3, 10, 10),)),
        ("activations", nn.Sequential(nn.Linear(4, 4), nn.LeakyReLU(), nn.ELU(), nn.ReLU6(), nn.SiLU(), nn.Mish(),
                                      nn.Hardswish(), nn.Softplus(), nn.PReLU(), nn.LogSoftmax(-1), nn.Tanh(),
                                      nn.Sigmoid(), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.Softmax(-1)),
         (torch.randn(2, 4),)),
        ("embedding-layernorm", nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 2)),
         (torch.randint(0, 10, (2, 3)),)),
        ("batchnorm-eval", nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval(), (torch.randn(2, 3, 6, 6),)),
        ("encoder-layer-relu", nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True),
         (torch.randn(2, 5, 16),)),
        ("encoder-layer-gelu-norm-first", nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, activation="gelu",
                                                                     norm_first=True), (torch.randn(5, 2, 16),)),
        *attention,
        *lstms,
    ]


SMALL_MODELS = small_models()


# ---------------------------------------------------------------- exact count


def test_relu_output_saved_by_relu_and_next_linear_is_counted_once():
    # ReLU keeps its output and the next Linear keeps the same tensor as its input: 5×16 floats
    assert memory.saved_bytes(mlp(), torch.randn(5, 8)) == 5 * 16 * FLOAT


def test_each_storage_is_attributed_to_the_module_that_saved_it_first():
    saved = memory.saved_tensors(mlp(), torch.randn(5, 8))
    assert saved.per_module == {"1": 5 * 16 * FLOAT}
    assert saved.output_only_bytes == 5 * 4 * FLOAT


def test_parameters_buffers_and_inputs_are_not_activations():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8).eval())
    # Linear keeps the input (excluded); eval BatchNorm keeps its input, the Linear's output
    assert memory.saved_bytes(model, torch.randn(5, 8)) == 5 * 8 * FLOAT


class ScaledBetweenSubmodules(nn.Module):
    """The Python float is applied in the parent's forward, between two submodules."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.second(self.first(x) * 0.5)


def test_python_scalar_saved_between_submodules_is_found_and_given_to_the_parent():
    saved = memory.saved_tensors(ScaledBetweenSubmodules(), torch.randn(5, 8))
    assert saved.unhooked_bytes == 8
    assert saved.per_module["(model)"] == 8


def test_python_scalar_saved_without_hooks_is_found_on_the_graph():
    saved = memory.saved_tensors(ScaledLinear(), torch.randn(5, 8))
    assert saved.unhooked_bytes == 8
    assert saved.per_module == {"(model)": 8}
    assert saved.recomputed == 0 and memory.saved_tensors(mlp(), torch.randn(5, 8)).recomputed == 0


def test_exact_count_plus_outputs_equals_allocator_live_bytes_after_forward():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(512, 4))
    x = torch.randn(2, 3, 10, 10)
    saved = memory.saved_tensors(model, x)
    live = memory.live_bytes_after_forward(model, x)
    assert live.provenance == "measured"
    assert int(live) == saved.total + saved.output_only_bytes


class CheckpointedBlocks(nn.Module):
    """Two MLP blocks under non-reentrant activation checkpointing."""

    def __init__(self):
        super().__init__()
        self.first = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.second = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x):
        between = checkpoint(self.first, x, use_reentrant=False)
        return checkpoint(self.second, between, use_reentrant=False)


def test_checkpointed_tensors_are_not_counted_and_not_recomputed_by_counting():
    model, x = CheckpointedBlocks(), torch.randn(8, 16)
    forwards = []
    model.first.register_forward_hook(lambda *args: forwards.append(1))
    saved = memory.saved_tensors(model, x)
    assert forwards == [1], "counting must not unpack checkpoint's tensors (that reruns the block)"
    # kept: the second block's input, which checkpoint saves through the hooks; the rest is recomputed
    assert saved.total == 8 * 16 * FLOAT
    assert saved.recomputed > 0 and "torch.utils.checkpoint" in str(saved)
    rng_state_bytes = torch.get_rng_state().numel()
    live = memory.live_bytes_after_forward(model, x)
    assert int(live) == saved.total + saved.output_only_bytes + 2 * rng_state_bytes


def test_counting_leaves_batchnorm_statistics_and_rng_unchanged():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5))
    before, x = model[1].running_mean.clone(), torch.randn(5, 8) + 3
    torch.manual_seed(1)
    expected_next = torch.rand(1)
    torch.manual_seed(1)
    memory.saved_tensors(model, x)
    assert torch.equal(model[1].running_mean, before)
    assert torch.equal(torch.rand(1), expected_next)


def test_a_failing_forward_raises_labkit_error_naming_model_and_inputs():
    with pytest.raises(LabkitError, match=r"Sequential failed in its forward pass on inputs \(Tensor\[5×7"):
        memory.saved_bytes(mlp(), torch.randn(5, 7))


def test_a_failing_forward_on_fake_tensors_raises_the_same_clear_error():
    with pytest.raises(LabkitError, match="failed in its forward pass"):
        memory.activation_table(mlp(), torch.randn(5, 7))
    with pytest.raises(LabkitError, match="failed in its forward pass"):
        memory.estimate_step_peak(mlp(), torch.randn(5, 7))


def test_a_step_estimate_for_a_model_without_trainable_parameters_is_refused():
    with pytest.raises(LabkitError, match="no trainable parameters"):
        memory.estimate_step_peak(nn.ReLU(), torch.randn(2, 8))


def test_something_that_is_not_a_module_is_refused():
    with pytest.raises(LabkitError, match="expected a torch.nn.Module"):
        memory.saved_bytes(lambda x: x, torch.randn(2))


# ---------------------------------------------------------------- meta device


def test_a_model_on_the_meta_device_is_counted_without_memory():
    with torch.device("meta"):
        model, x = mlp(), torch.randn(5, 8)
    assert memory.saved_bytes(model, x) == memory.saved_bytes(mlp(), torch.randn(5, 8))
    assert memory.analytic_activation_bytes(model, x) == 5 * 16 * FLOAT
    # SGD keeps no CPU-side step counters, so the meta and CPU estimates must agree to the byte
    meta_peak = memory.estimate_step_peak(model, x, optimizer="sgd")
    assert int(meta_peak) == int(memory.estimate_step_peak(mlp(), torch.randn(5, 8), optimizer="sgd"))
    measured = memory.measure_step_peak(model, x)
    assert not measured.total.available
    assert "meta tensors have no storage" in measured.total.reason


def test_meta_model_traced_as_cpu_gets_the_cpu_kernels():
    with torch.device("meta"):
        model, x = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), torch.randn(2, 5, 16)
    cpu_model = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
    assert memory.activation_table(model, x, device="cpu").total == memory.saved_bytes(cpu_model, torch.randn(2, 5, 16))


# ---------------------------------------------------------------- analytic formulas


@pytest.mark.parametrize("model, inputs", [case[1:] for case in SMALL_MODELS], ids=[case[0] for case in SMALL_MODELS])
def test_analytic_formula_matches_exact_count_module_by_module(model, inputs):
    exact = memory.saved_tensors(model, *inputs)
    table = memory.activation_table(model, *inputs).against(exact)
    assert [(line.module, line.bytes) for line in table.lines] == [(line.module, line.exact) for line in table.lines]
    assert table.total == exact.total > 0


@pytest.mark.parametrize("shape", [(20, 16, 32, 64), (7, 3, 5, 9), (33, 5, 200, 17), (9, 7, 13, 256)])
def test_onednn_lstm_workspace_formula_matches_the_kernel(shape):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch build has no oneDNN, so its LSTM keeps no oneDNN workspace")
    seq_len, batch, input_size, hidden = shape
    workspaces = []

    def keep_uint8(tensor):
        if tensor.dtype == torch.uint8:
            workspaces.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep_uint8, lambda t: t):
        nn.LSTM(input_size, hidden)(torch.randn(seq_len, batch, input_size))
    assert workspaces == [memory.onednn_lstm_workspace_bytes(seq_len, batch, input_size, hidden)]


def test_autocast_precision_counts_the_casts_autocast_keeps():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3), nn.LayerNorm(2),
                          nn.Flatten(), nn.Linear(16, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(2, 3, 6, 6)
    with torch.autocast("cpu", torch.bfloat16):
        exact = memory.saved_bytes(model, x)
    table = memory.activation_table(model, x, precision="amp_bf16")
    assert table.total == exact
    assert "weight copy cast by autocast" in str(table)


def test_bf16_precision_traces_the_model_as_if_cast_to_bf16():
    model, x = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 2)), torch.randn(4, 8)
    table = memory.activation_table(model, x, precision="bf16")
    assert table.total == memory.saved_bytes(model.to(torch.bfloat16), x.to(torch.bfloat16))


def test_functional_code_in_forward_is_covered_by_op_formulas():
    x = torch.randn(5, 8)
    table = memory.activation_table(FunctionalReLU(), x).against(memory.saved_tensors(FunctionalReLU(), x))
    functional = [line for line in table.lines if line.module == "(model)"]
    assert functional[0].bytes == functional[0].exact == 5 * 8 * FLOAT
    assert functional[0].layer == "FunctionalReLU (ops)" and "relu 5×8 float32" in functional[0].saves
    assert table.unexplained_bytes == 0


RECURRENT_CASES = {
    "GRU, batch_first": (lambda: nn.GRU(32, 64, batch_first=True), (16, 20, 32)),
    "GRU, 2 layers": (lambda: nn.GRU(8, 16, num_layers=2), (5, 3, 8)),
    "RNN tanh, 2 layers": (lambda: nn.RNN(8, 16, num_layers=2), (5, 3, 8)),
    "RNN relu, batch_first": (lambda: nn.RNN(8, 16, nonlinearity="relu", batch_first=True), (3, 5, 8)),
    "LSTM": (lambda: nn.LSTM(8, 16), (5, 3, 8)),
}


@pytest.mark.parametrize("fused", [True, False], ids=["oneDNN-allowed", "unfused"])
@pytest.mark.parametrize("case", list(RECURRENT_CASES))
def test_recurrent_formulas_match_the_exact_count(case, fused):
    make, shape = RECURRENT_CASES[case]
    torch.manual_seed(0)
    model, x = make(), torch.randn(shape)
    with torch.backends.mkldnn.flags(enabled=fused):
        exact = memory.saved_bytes(model, x)
        counted = memory.analytic_activation_bytes(model, x)
    assert counted == counted.formula_bytes == exact


def test_a_gru_given_its_initial_state_is_still_fully_counted():
    x, h0 = torch.randn(5, 3, 8), torch.randn(1, 3, 16)
    counted = memory.analytic_activation_bytes(nn.GRU(8, 16), x, h0)
    assert counted == memory.saved_bytes(nn.GRU(8, 16), x, h0)


def test_table_prints_each_layer_and_the_difference_to_the_exact_count():
    x = torch.randn(5, 8)
    text = str(memory.activation_table(mlp(), x).against(memory.saved_tensors(mlp(), x)))
    assert "ReLU" in text and "already counted above" in text
    assert "analytic - exact = +0 B (+0.00%)" in text


# ---------------------------------------------------------------- training state and precision


def test_training_state_bytes_per_parameter_for_each_precision():
    model = nn.Linear(10, 10)  # 110 parameters in 2 tensors
    fp32 = memory.training_state(model, "adamw", "fp32")
    assert [int(fp32[row]) for row in ("parameters", "gradients", "optimizer state", "step counters")] == [
        440, 440, 880, 8]
    mixed = memory.training_state(model, "adam", "mixed_bf16")
    assert [int(mixed[row]) for row in ("parameters", "gradients", "master weights", "optimizer state")] == [
        220, 220, 440, 880]
    assert int(memory.training_state(model, "sgd_momentum", "bf16")["optimizer state"]) == 220
    assert int(memory.training_state(model, "sgd", "fp32")["optimizer state"]) == 0


def test_frozen_parameters_cost_weights_only():
    model = nn.Linear(10, 10)
    model.bias.requires_grad_(False)
    state = memory.training_state(model, "adamw", "fp32")
    assert int(state["parameters"]) == 440 and int(state["gradients"]) == 400


def test_unknown_precision_and_optimizer_names_list_the_choices():
    with pytest.raises(LabkitError, match="use one of fp32, amp_bf16"):
        memory.training_state(mlp(), "adamw", "fp8")
    with pytest.raises(LabkitError, match="use one of sgd, sgd_momentum, adam, adamw"):
        memory.estimate_step_peak(mlp(), torch.randn(2, 8), optimizer="lion")


def test_analytic_memory_adds_the_activation_table_to_the_training_state():
    x = torch.randn(5, 8)
    result = memory.analytic_memory(mlp(), x, optimizer="sgd", precision="fp32")
    report = result.report()
    assert int(report["activations"]) == memory.analytic_activation_bytes(mlp(), x)
    assert int(result) == sum(int(reading) for _, reading in report.rows)
    assert "sum of the parts" in str(result)


# ---------------------------------------------------------------- step peak


def _parameter_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


class ResidualConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1)
        self.norm = nn.BatchNorm2d(16)

    def forward(self, x):
        return torch.relu(self.norm(self.conv2(torch.relu(self.conv1(x)))) + x)


class LastStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.head = nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


@pytest.mark.parametrize("make_model, shape", [
    (lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 8)), (32, 64)),
    (lambda: nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), (4, 12, 32)),
    (ResidualConv, (4, 16, 12, 12)),
    (LastStep, (6, 10, 8)),
], ids=["mlp", "encoder-layer", "residual-conv", "lstm"])
def test_estimated_step_peak_is_within_one_percent_of_the_measured_cpu_peak(make_model, shape):
    model, x = make_model(), torch.randn(shape)
    estimated, measured = memory.estimate_step_peak(model, x), memory.measure_step_peak(model, x)
    assert estimated.total.provenance == "estimated" and measured.total.provenance == "measured"
    assert int(estimated) == pytest.approx(int(measured), rel=0.01)


def test_estimate_is_the_steady_state_with_adam_state_present():
    model = mlp()
    estimate = memory.estimate_step_peak(model, torch.randn(5, 8), optimizer="adamw")
    assert int(estimate["optimizer state"]) == 2 * _parameter_bytes(model) + 4 * len(list(model.parameters()))
    assert int(memory.estimate_step_peak(model, torch.randn(5, 8), optimizer="sgd")["optimizer state"]) == 0


@pytest.mark.parametrize("make_model, shape", [
    (lambda: nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), (4, 12, 32)),
    (ResidualConv, (4, 16, 12, 12)),
], ids=["encoder-layer", "residual-conv"])
def test_fallback_tracker_agrees_with_mem_tracker(monkeypatch, make_model, shape):
    model, x = make_model(), torch.randn(shape)
    with_mem_tracker = memory.estimate_step_peak(model, x)
    monkeypatch.setattr(estimate, "mem_tracker_class", lambda: None)
    fallback = memory.estimate_step_peak(model, x)
    assert "torch MemTracker" in with_mem_tracker["activations"].source
    assert "labkit storage timeline" in fallback["activations"].source
    assert int(fallback) == int(with_mem_tracker)
    assert int(fallback["optimizer state"]) == int(with_mem_tracker["optimizer state"])
    workspace = [dict(report.rows).get("kernel workspace") for report in (fallback, with_mem_tracker)]
    assert workspace[0] is None if workspace[1] is None else int(workspace[0]) == int(workspace[1])


def test_kernel_workspace_is_the_difference_between_tensors_only_and_the_measured_peak():
    model, x = ResidualConv(), torch.randn(4, 16, 12, 12)
    tensors_only = memory.estimate_step_peak(model, x, kernel_workspace="ignore")
    with_workspace = memory.estimate_step_peak(model, x, kernel_workspace="measure")
    assert "kernel workspace" not in dict(tensors_only.rows)
    assert any("kernel_workspace='ignore'" in note for note in tensors_only.notes)
    assert int(with_workspace["kernel workspace"]) > 0
    assert any("convolution_backward" in note for note in with_workspace.notes)
    assert int(tensors_only) < int(memory.measure_step_peak(model, x)) * 0.99


def test_a_model_without_workspace_kernels_gets_no_workspace_row():
    report = memory.estimate_step_peak(mlp(), torch.randn(5, 8))
    assert "kernel workspace" not in dict(report.rows)
    assert not any("kernel" in note for note in report.notes)


def test_kernel_workspace_choices_are_checked():
    with pytest.raises(LabkitError, match="kernel_workspace='always' is not one of"):
        memory.estimate_step_peak(ResidualConv(), torch.randn(2, 16, 6, 6), kernel_workspace="always")


def test_a_meta_model_is_not_measured_unless_asked_and_then_only_kernel_by_kernel(monkeypatch):
    with torch.device("meta"):
        model, x = nn.Sequential(*(ResidualConv() for _ in range(4))), torch.randn(64, 16, 32, 32)
    automatic = memory.estimate_step_peak(model, x, device="cpu")
    assert "kernel workspace" not in dict(automatic.rows)
    assert any("meta device" in note and "kernel_workspace='measure'" in note for note in automatic.notes)
    inputs_per_call = []
    zero_filled = workspace._zero_filled

    def recording(specs, tree):
        inputs_per_call.append(sum(math.prod(s.shape) * s.dtype.itemsize for s in specs
                                   if isinstance(s, workspace._TensorSpec)))
        return zero_filled(specs, tree)

    monkeypatch.setattr(workspace, "_zero_filled", recording)
    measured = memory.estimate_step_peak(model, x, device="cpu", kernel_workspace="measure")
    activation_bytes = 64 * 16 * 32 * 32 * FLOAT  # 4 MiB: one layer's input
    assert int(measured["kernel workspace"]) > 0
    # convolution_backward's inputs: the layer's input and output gradient (and the weights)
    assert inputs_per_call and max(inputs_per_call) < 2.01 * activation_bytes < int(automatic) / 4
    with pytest.raises(LabkitError, match="kernel_workspace='measure' cannot measure on meta"):
        memory.estimate_step_peak(model, x, kernel_workspace="measure")


def test_estimate_allocates_nothing_even_for_a_large_model():
    with torch.device("meta"):
        model, x = nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048)), torch.randn(1024, 2048)
    rise = memory.peak_bytes_during(lambda: memory.estimate_step_peak(model, x, device="cpu"))
    assert int(memory.estimate_step_peak(model, x, device="cpu")) > 100 * 2**20
    assert int(rise) < 2**20


def test_lstm_estimate_includes_the_onednn_workspace_the_fake_kernel_leaves_out():
    model, x = nn.LSTM(16, 32), torch.randn(12, 4, 16)
    state = 3 * _parameter_bytes(model)  # weights and AdamW's two moments, all alive at backward's start
    assert int(memory.estimate_step_peak(model, x)) > state + memory.saved_bytes(model, x)


# ---------------------------------------------------------------- measurements


def test_peak_bytes_during_sees_a_buffer_that_was_freed_before_returning():
    def allocate_and_free():
        buffer = torch.empty(1_000_000, dtype=torch.uint8)
        del buffer

    reading = memory.peak_bytes_during(allocate_and_free)
    assert reading.provenance == "measured" and int(reading) == 1_000_000


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when there is no CUDA")
def test_measuring_inside_a_running_profiler_is_refused_with_the_reason():
    from torch.profiler import ProfilerActivity, profile

    model, x = ResidualConv(), torch.randn(2, 16, 6, 6)
    with profile(activities=[ProfilerActivity.CPU]):
        inside = memory.peak_bytes_during(lambda: torch.ones(1000))
        automatic = memory.estimate_step_peak(model, x)
        with pytest.raises(LabkitError, match="profiler is already running"):
            memory.estimate_step_peak(model, x, kernel_workspace="measure")
        assert torch.autograd._profiler_enabled(), "the user's profiler must still be running"
    assert not inside.available and "profiler is already running" in inside.reason
    assert any("profiler is already running" in note for note in automatic.notes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_a_cuda_estimate_without_cuda_is_refused_instead_of_aborting():
    with pytest.raises(LabkitError, match="device='cuda' was asked for, but this machine has no CUDA device"):
        memory.estimate_step_peak(mlp(), torch.randn(2, 8), device="cuda")
    with pytest.raises(LabkitError, match="no CUDA device"):
        memory.analytic_memory(mlp(), torch.randn(2, 8), device="cuda")


def test_cuda_peak_without_cuda_is_unavailable_with_the_reason_not_zero():
    reading = memory.peak_bytes_during(lambda: None, "cuda")
    assert not reading.available and "would return 0 here" in reading.reason
    with pytest.raises(UnavailableReading):
        int(reading)


def test_measuring_a_step_leaves_the_model_as_it_was():
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    memory.measure_step_peak(model, torch.randn(5, 8))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------- report


def test_report_total_is_unavailable_when_a_row_is_and_says_why():
    from labkit.readings import Reading

    report = memory.MemoryReport("demo", (("a", Reading(10, "B", "measured")),
                                          ("b", Reading.unavailable("B", "no allocator"))))
    assert not report.total.available and "b: no allocator" in report.total.reason
    with pytest.raises(UnavailableReading):
        int(report)
    assert "unavailable" in str(report)


def test_report_prints_a_table_and_plots_stacked_bars():
    model, x = mlp(), torch.randn(5, 8)
    estimated, measured = memory.estimate_step_peak(model, x), memory.measure_step_peak(model, x)
    text = str(estimated)
    assert all(label in text for label in ("parameters", "optimizer state", "activations", "total"))
    figure = memory.plot_reports(estimated, measured)
    axes = figure.axes[0]
    assert len(axes.get_xticks()) == 2
    stacked = [bar for bar in axes.patches if bar.get_height() > 0]
    nonzero_rows = [r for r in (*estimated.rows, *measured.rows) if int(r[1]) > 0]
    assert len(stacked) == len(nonzero_rows)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_cuda_exact_count_matches_cpu_for_an_mlp():
    x = torch.randn(5, 8)
    assert memory.saved_bytes(mlp().cuda(), x.cuda()) == memory.saved_bytes(mlp(), x)


@pytest.mark.gpu
def test_cuda_peak_is_measured_from_cuda_statistics():
    reading = memory.peak_bytes_during(lambda: torch.empty(2**20, dtype=torch.uint8, device="cuda"), "cuda")
    assert reading.provenance == "measured" and int(reading) == 2**20


@pytest.mark.gpu
def test_cuda_step_peak_estimate_is_close_to_the_measurement():
    model, x = mlp().cuda(), torch.randn(64, 8, device="cuda")
    measured = memory.measure_step_peak(model, x)
    assert measured.total.provenance == "measured"
    assert int(memory.estimate_step_peak(model, x)) == pytest.approx(int(measured), rel=0.05)


def test_report_plot_shows_once_as_an_image_in_a_fresh_kernel(tmp_path):
    # a fresh kernel has not imported pyplot, which is what makes Jupyter render a Figure as an image
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(
        "import torch\nfrom labkit import memory\nmemory.training_state(torch.nn.Linear(4, 4)).plot()")]
    NotebookClient(notebook, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    images = [output for output in notebook.cells[0].outputs if "image/png" in output.get("data", {})]
    assert len(images) == 1, [output.get("data", output).keys() for output in notebook.cells[0].outputs]


def test_a_cpu_measurement_stores_no_profiler_notice_but_keeps_other_stderr():
    # Kineto prints "USDT:... profiler_start" on fd 2, below Python: only a child process sees it.
    script = ("import os, torch\n"
              "from labkit.memory import peak_bytes_during\n"
              "peak_bytes_during(lambda: (os.write(2, b'kept line\\n'), torch.ones(256) * 2))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "USDT:" not in result.stderr
    assert "kept line" in result.stderr


def test_the_timeline_rises_in_forward_and_falls_in_backward_to_what_is_kept():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)), torch.randn(32, 64)
    held = []
    timeline = memory.live_bytes_timeline({"forward": lambda: held.append(model(x).square().sum()),
                                           "backward": lambda: held.pop().backward()})
    assert {name for name, _ in timeline} == {"forward", "backward"}
    forward_end = max(alive for name, alive in timeline if name == "forward")
    saved = 32 * 128 * 4 * 2  # the first Linear's output (ReLU input) and the ReLU output, float32
    assert forward_end >= saved
    # After backward only the gradients remain: one per parameter, exactly their size.
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert timeline[-1] == ("backward", gradient_bytes)


@pytest.mark.parametrize("phases, problem", [({}, "dict of phase name"), ({"forward": 3}, "not functions")])
def test_the_timeline_rejects_bad_phases(phases, problem):
    with pytest.raises(LabkitError, match=problem):
        memory.live_bytes_timeline(phases)


def test_a_compiled_model_is_measured_as_its_eager_module_on_its_first_call():
    # AP4: dynamo traced under labkit's global module hooks failed on the first call, blaming the model
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    compiled = torch.compile(model, backend="aot_eager")
    assert memory.saved_bytes(compiled, x) == memory.saved_bytes(model, x) > 0
