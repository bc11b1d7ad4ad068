"""Memory calculators for a training step: exact where they can be, honest where they estimate.

Used in ``13_memory`` (``02_gradients_accumulate`` uses :func:`saved_bytes` and
:func:`training_state`). One module per method, all re-exported here:

* :func:`saved_tensors` / :func:`saved_bytes` (``saved``): the exact bytes autograd keeps for
  backward after one forward, counted with ``torch.autograd.graph.saved_tensors_hooks``, per module.
* :func:`activation_table` / :func:`analytic_activation_bytes` / :func:`analytic_memory`
  (``formulas``): the same number from per-layer formulas, line by line, plus parameters,
  gradients, master weights and optimizer state at a chosen precision (:func:`training_state`).
* :func:`estimate_step_peak` (``estimate``, with ``workspace``): the steady-state peak of a whole
  training step, run on fake tensors (nothing of the step is allocated), plus the private
  workspace of convolution and recurrent kernels, measured one kernel call at a time.
* :func:`measure_step_peak`, :func:`peak_bytes_during`, :func:`live_bytes_after_forward`,
  :func:`live_bytes_timeline` (``measure``): what the allocator really did, as peaks (each a
  :class:`~labkit.readings.Reading`) and as bytes alive over a step; on a machine without CUDA a CUDA peak is "unavailable, because ...", never the 0 that
  ``torch.cuda.max_memory_allocated`` returns there.

Each returns or prints a :class:`MemoryReport` (``report``).
"""

from labkit.memory._common import OPTIMIZERS, TRAINING_PRECISIONS
from labkit.memory.estimate import estimate_step_peak
from labkit.memory.formulas import (
    ActivationLine,
    ActivationTable,
    AnalyticBytes,
    AnalyticMemory,
    activation_table,
    analytic_activation_bytes,
    analytic_memory,
    onednn_lstm_workspace_bytes,
    training_state,
)
from labkit.memory.measure import live_bytes_after_forward, live_bytes_timeline, measure_step_peak, peak_bytes_during
from labkit.memory.report import MemoryReport, plot_reports
from labkit.memory.saved import SavedTensors, saved_bytes, saved_tensors
from labkit.memory.workspace import KERNEL_WORKSPACE

__all__ = [
    "KERNEL_WORKSPACE",
    "OPTIMIZERS",
    "TRAINING_PRECISIONS",
    "ActivationLine",
    "ActivationTable",
    "AnalyticBytes",
    "AnalyticMemory",
    "MemoryReport",
    "SavedTensors",
    "activation_table",
    "analytic_activation_bytes",
    "analytic_memory",
    "estimate_step_peak",
    "live_bytes_after_forward",
    "live_bytes_timeline",
    "measure_step_peak",
    "onednn_lstm_workspace_bytes",
    "peak_bytes_during",
    "plot_reports",
    "saved_bytes",
    "saved_tensors",
    "training_state",
]
