"""Memory calculators for a training step: exact where they can be, honest where they estimate.

Taught in ``13_memory``; the precision options of the analytic calculator in ``10_mixed_precision``.

* :func:`saved_tensors` / :func:`saved_bytes`: the exact bytes autograd keeps for backward after one
  forward, counted with ``torch.autograd.graph.saved_tensors_hooks``, per module.
* :func:`activation_table` / :func:`analytic_activation_bytes` / :func:`analytic_memory`: the same
  number from per-layer formulas, line by line, plus parameters, gradients, master weights and
  optimizer state at a chosen precision (:func:`training_state`).
* :func:`estimate_step_peak`: the steady-state peak of a whole training step, run on fake tensors
  (nothing of the step is allocated), plus the private workspace of convolution and recurrent
  kernels, measured one kernel call at a time.
* :func:`measure_step_peak`, :func:`peak_bytes_during`, :func:`live_bytes_after_forward`: what the
  allocator really did. Every number is a :class:`~labkit.readings.Reading`; on a machine without
  CUDA a CUDA peak is "unavailable, because ...", never the 0 that ``torch.cuda.max_memory_allocated``
  returns there.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import math
import textwrap
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.modules.module import register_module_forward_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten
from torch.utils.module_tracker import ModuleTracker
from torch.utils.weak import WeakIdKeyDictionary

from labkit.errors import LabkitError
from labkit.readings import Reading

OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw")
PRECISIONS = ("fp32", "amp_bf16", "amp_fp16", "bf16", "fp16", "mixed_bf16", "mixed_fp16")

# CUDACachingAllocator hands out blocks in multiples of 512 bytes (kMinBlockSize).
_CUDA_BLOCK = 512
_ROOT = "(model)"
_OUTSIDE = "(outside any module)"


# --------------------------------------------------------------------------------------------
# small helpers


def _tensors(obj) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(obj)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _storage_key(tensor: torch.Tensor) -> int:
    return StorageWeakRef(tensor.untyped_storage()).cdata


def _storage_nbytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


def _allocated_nbytes(tensor: torch.Tensor) -> int:
    nbytes = _storage_nbytes(tensor)
    if tensor.device.type == "cuda":
        return -(-nbytes // _CUDA_BLOCK) * _CUDA_BLOCK
    return nbytes


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} GiB"


def _shape_text(shape, dtype: torch.dtype) -> str:
    dims = "×".join(str(int(d)) for d in shape) or "scalar"
    return f"{dims} {str(dtype).removeprefix('torch.')}"


def _as_inputs(inputs) -> tuple:
    return (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise LabkitError(
            f"expected a torch.nn.Module, got {type(model).__name__}: pass the model itself, "
            "for example saved_bytes(model, x)"
        )


def _describe(inputs: Sequence) -> str:
    parts = [
        f"Tensor[{_shape_text(x.shape, x.dtype)}, {x.device}]" if isinstance(x, torch.Tensor)
        else type(x).__name__
        for x in inputs
    ]
    return "(" + ", ".join(parts) + ")"


def _forward(model: nn.Module, inputs: Sequence):
    try:
        return model(*inputs)
    except LabkitError:
        raise
    except Exception as error:
        raise LabkitError(
            f"{type(model).__name__} failed in its forward pass on inputs {_describe(inputs)}: "
            f"{type(error).__name__}: {error}. Call the model once yourself with these inputs and "
            "fix that first: shapes, dtypes and device must be what the model expects."
        ) from error


def _device_of(model: nn.Module, inputs: Sequence) -> torch.device:
    for tensor in [*model.parameters(), *model.buffers(), *_tensors(inputs)]:
        return tensor.device
    return torch.device("cpu")


def _module_names(model: nn.Module) -> dict[nn.Module, str]:
    return {module: (name or _ROOT) for name, module in model.named_modules()}


@contextlib.contextmanager
def _model_left_unchanged(model: nn.Module, include_parameters: bool) -> Iterator[None]:
    """Undo what a measuring run does to the model: running statistics, weights, grads, RNG."""
    tensors = [*model.buffers(), *(model.parameters() if include_parameters else ())]
    originals = [tensor.detach().clone() for tensor in tensors]
    grads = [(p, p.grad) for p in model.parameters()]
    cuda_devices = sorted({t.device.index or 0 for t in [*model.parameters(), *model.buffers()]
                           if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda_devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for tensor, original in zip(tensors, originals):
                    tensor.copy_(original)
            for parameter, grad in grads:
                parameter.grad = grad


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Keep Python's cycle collector from freeing unrelated tensors inside a measured window."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# --------------------------------------------------------------------------------------------
# the report


@dataclass(frozen=True)
class MemoryReport:
    """Named byte counts, each a :class:`Reading`; prints as a table, draws a stacked bar.

    The total is the sum of the rows. It is ``measured`` only when every row is, ``unavailable``
    (with the reasons) when any row is, else ``estimated``. ``int(report)`` is the total in bytes
    and raises instead of returning 0 when it is unavailable. Taught in ``13_memory``.
    """

    title: str
    rows: tuple[tuple[str, Reading], ...]
    notes: tuple[str, ...] = ()

    @property
    def total(self) -> Reading:
        missing = [f"{label}: {reading.reason}" for label, reading in self.rows if not reading.available]
        if missing:
            return Reading.unavailable("B", "; ".join(missing))
        provenance = "measured" if all(r.provenance == "measured" for _, r in self.rows) else "estimated"
        return Reading(sum(int(r) for _, r in self.rows), "B", provenance, source="sum of the rows")

    def __int__(self) -> int:
        return int(self.total)

    def __getitem__(self, label: str) -> Reading:
        for name, reading in self.rows:
            if name == label:
                return reading
        raise LabkitError(f"no row {label!r} in {self.title!r}: rows are {[n for n, _ in self.rows]}")

    def __str__(self) -> str:
        width = max([len(label) for label, _ in self.rows] + [5])
        lines = [self.title]
        for label, reading in [*self.rows, ("total", self.total)]:
            lines.append(f"  {label:<{width}}  {_reading_cell(reading)}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def plot(self, ax=None):
        """A stacked bar of the rows; returns the matplotlib Figure (see :func:`plot_reports`)."""
        return plot_reports(self, ax=ax)


def _reading_cell(reading: Reading) -> str:
    if not reading.available:
        return f"{'unavailable':>14}  ({reading.reason})"
    value = int(reading)
    source = f"  {reading.source}" if reading.source else ""
    return f"{value:>14,} B  {_human(value):>10}  {reading.provenance:<9}{source}"


def plot_reports(*reports: MemoryReport, ax=None):
    """Side-by-side stacked bars, one per report, in MiB; returns the matplotlib Figure.

    Use it to put an estimate next to a measurement. Unavailable rows are left out of the bar and
    named under it. Without ``ax`` the figure is new and not left open in pyplot: it shows once as
    a cell's last value in Jupyter (pyplot's import sets up the inline display), and in a script
    ``.savefig(...)`` writes it. With ``ax`` it draws there. Taught in ``13_memory``.
    """
    from matplotlib.patches import Patch

    if not reports:
        raise LabkitError("plot_reports needs at least one MemoryReport")
    if ax is None:
        import matplotlib.pyplot as plt

        figure, ax = plt.subplots(figsize=(2.5 + 2.0 * len(reports), 4.2), layout="constrained")
        # closed in pyplot so that the inline backend does not show it a second time at cell end
        plt.close(figure)
    labels = list(dict.fromkeys(label for report in reports for label, _ in report.rows))
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    for x, report in enumerate(reports):
        _stack_bar(ax, x, report, colors)
    ax.set_xticks(range(len(reports)), [_bar_label(r) for r in reports])
    ax.set_ylabel("MiB")
    handles = [Patch(color=colors[label]) for label in labels]
    ax.legend(handles, labels, fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax.figure


def _stack_bar(ax, x: int, report: MemoryReport, colors: dict[str, str]) -> None:
    bottom = 0.0
    for label, reading in report.rows:
        if reading.available:
            height = int(reading) / 2**20
            ax.bar(x, height, bottom=bottom, color=colors[label], width=0.6)
            bottom += height
    total = report.total
    ax.annotate(
        f"{int(total) / 2**20:.2f} MiB" if total.available else "unavailable",
        (x, bottom), ha="center", va="bottom", fontsize="small",
    )


def _bar_label(report: MemoryReport) -> str:
    missing = [label for label, reading in report.rows if not reading.available]
    title = textwrap.fill(report.title, 20)
    return title + (f"\n(unavailable: {', '.join(missing)})" if missing else "")


# --------------------------------------------------------------------------------------------
# exact count of what autograd saves


@dataclass(frozen=True)
class SavedTensors:
    """What autograd keeps for backward after one forward, each storage counted once.

    ``per_module`` maps a module name (as in ``model.named_modules()``; the model itself is
    ``"(model)"``) to the bytes of the storages it was first to save. Parameters, buffers and the
    inputs are not counted: they exist whether or not you train. ``unhooked_bytes`` (already
    included) are tensors autograd saved without calling the hooks: Python scalars it wraps as
    0-d tensors. ``output_only_bytes`` are the forward's outputs that nothing saved: they are alive
    after the forward too, but are not activations. ``recomputed`` counts tensors another pack hook
    took over (``torch.utils.checkpoint``): they are not kept but recomputed in backward, so they
    are not counted; checkpoint's inputs are (it saves them through the hooks), while the RNG state
    it keeps per call (5,056 B on CPU) is not a saved tensor and is not. Taught in ``13_memory``.
    """

    per_module: dict[str, int]
    unhooked_bytes: int
    output_only_bytes: int
    tensor_count: int
    recomputed: int = 0

    @property
    def total(self) -> int:
        return sum(self.per_module.values())

    def __int__(self) -> int:
        return self.total

    def report(self) -> MemoryReport:
        rows = tuple(
            (name, Reading(nbytes, "B", "measured", source="saved_tensors_hooks"))
            for name, nbytes in self.per_module.items()
        )
        notes = [
            f"{self.tensor_count} storages; {self.unhooked_bytes:,} B of wrapped Python scalars "
            "found on the graph (autograd saves those without calling the hooks)",
            f"outputs nothing saved: {self.output_only_bytes:,} B (alive after forward, not counted)",
        ]
        if self.recomputed:
            notes.append(f"{self.recomputed} saved tensors belong to another pack hook (torch.utils.checkpoint): "
                         "recomputed in backward, not kept, not counted; checkpoint's RNG state per call is not counted")
        return MemoryReport("Saved for backward, per module (exact)", rows, tuple(notes))

    def __str__(self) -> str:
        return str(self.report())


class _SavedTensorCounter:
    """Counts storages autograd saves, attributing each to the innermost module running."""

    def __init__(self, model: nn.Module, inputs: Sequence):
        state = [*model.parameters(), *model.buffers(), *_tensors(inputs)]
        self._excluded = {_storage_key(t) for t in state}
        self._counted: dict[int, tuple[str, int]] = {}
        self._names = _module_names(model)
        self._tracker = ModuleTracker()
        self._seen_nodes: set = set()
        self.unhooked_bytes = 0
        self.recomputed = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        after_forward = register_module_forward_hook(self._find_unhooked, with_kwargs=True)
        try:
            with self._tracker, torch.autograd.graph.saved_tensors_hooks(self._pack, _identity):
                yield
        finally:
            after_forward.remove()

    def result(self, output) -> SavedTensors:
        per_module: dict[str, int] = {}
        for owner, nbytes in self._counted.values():
            per_module[owner] = per_module.get(owner, 0) + nbytes
        outputs = {_storage_key(t): _storage_nbytes(t) for t in _tensors(output)}
        output_only = sum(
            nbytes for key, nbytes in outputs.items() if key not in self._counted and key not in self._excluded
        )
        return SavedTensors(per_module, self.unhooked_bytes, output_only, len(self._counted), self.recomputed)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._count(tensor, self._innermost_module())
        return tensor

    def _count(self, tensor: torch.Tensor, owner: str) -> int:
        key = _storage_key(tensor)
        if key in self._excluded or key in self._counted:
            return 0
        self._counted[key] = (owner, _storage_nbytes(tensor))
        return self._counted[key][1]

    def _innermost_module(self) -> str:
        # ModuleTracker names a module "RootClass.child.grandchild"; the deepest active one is running.
        deepest = max(self._tracker.parents, key=lambda name: (name != "Global", name.count(".")))
        if deepest == "Global":
            return _OUTSIDE
        return deepest.partition(".")[2] or _ROOT

    def _find_unhooked(self, module, args, kwargs, output) -> None:
        # Autograd saves Python scalars (e.g. the 0.5 in x * 0.5) as 0-d tensors without calling
        # saved_tensors_hooks; they are only visible on the graph this module just built.
        stop = {t.grad_fn for t in _tensors((args, kwargs)) if t.grad_fn is not None}
        owner = self._names.get(module, _OUTSIDE)
        for node in _new_graph_nodes(_tensors(output), stop, self._seen_nodes):
            for handle in _saved_handles(node):
                if handle.unpack_hook is None:
                    # data is None for an undefined saved tensor (an absent optional input)
                    if isinstance(handle.data, torch.Tensor):
                        self.unhooked_bytes += self._count(handle.data, owner)
                elif handle.unpack_hook is not _identity:
                    self.recomputed += 1


def _identity(tensor):
    return tensor


def _new_graph_nodes(outputs: list[torch.Tensor], stop: set, seen: set) -> list:
    """Nodes between a module's outputs and its inputs that no inner module claimed already.

    The walk goes on through claimed nodes: functional code between two submodules (an F.relu
    in the parent's forward) lies beyond the submodules' nodes."""
    frontier = [t.grad_fn for t in outputs if t.grad_fn is not None]
    walked, found = set(), []
    while frontier:
        node = frontier.pop()
        if node is None or node in walked or node in stop:
            continue
        walked.add(node)
        if node not in seen:
            seen.add(node)
            found.append(node)
        frontier.extend(next_node for next_node, _ in node.next_functions)
    return found


def _saved_handles(node) -> list:
    # The raw SavedTensor handles, not node._saved_x: unpacking a hooked one would run its unpack
    # hook, which for torch.utils.checkpoint recomputes the forward and returns fresh storages.
    values = [getattr(node, name) for name in dir(node) if name.startswith("_raw_saved_")]
    return [h for v in values for h in (v if isinstance(v, (tuple, list)) else (v,))
            if isinstance(h, torch._C._autograd.SavedTensor)]


def saved_tensors(model: nn.Module, *inputs) -> SavedTensors:
    """Run ``model(*inputs)`` once and count, exactly, the bytes autograd saves for backward.

    Each storage is counted once (a tensor saved by two layers, or two views of one tensor, cost
    memory once), parameters, buffers and the inputs are left out, and every byte is attributed
    to the module that saved it first. The model's train/eval mode is used as is; gradient mode is
    switched on; buffers (BatchNorm statistics) and the RNG are restored afterwards. Works on the
    meta device too. Taught in ``13_memory``.
    """
    _check_model(model)
    counter = _SavedTensorCounter(model, inputs)
    with _model_left_unchanged(model, include_parameters=False), torch.enable_grad():
        with counter.counting():
            output = _forward(model, inputs)
        return counter.result(output)


def saved_bytes(model: nn.Module, *inputs) -> int:
    """The exact bytes autograd saves for backward in one ``model(*inputs)``, as an int.

    See :func:`saved_tensors` for the per-module breakdown. Taught in ``13_memory``.
    """
    return saved_tensors(model, *inputs).total


# --------------------------------------------------------------------------------------------
# tracing a forward on fake tensors (allocation-free)

_FAKE_FAILURES = tuple(
    getattr(torch._subclasses.fake_tensor, name)
    for name in ("UnsupportedFakeTensorException", "DynamicOutputShapeException",
                 "DataDependentOutputException", "UnsupportedOperatorException")
    if hasattr(torch._subclasses.fake_tensor, name)
)


def _fake_copy(model: nn.Module, inputs: Sequence, mode: FakeTensorMode, dtype=None, device=None):
    """A structural copy of the model whose tensors are fake: same shapes, no memory.

    ``device`` moves the fake tensors (a meta-device model traced as if on the CPU, so the
    dispatcher picks the CPU kernels); ``dtype`` casts the floating-point ones."""

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        result = mode.from_tensor(tensor.detach())
        with mode:
            if device is not None and result.device != device:
                result = torch.empty_strided(result.shape, result.stride(), dtype=result.dtype, device=device)
            if dtype is not None and tensor.is_floating_point():
                result = result.to(dtype)
        # a parameter gets requires_grad from nn.Parameter below; an input may need it too
        if tensor.requires_grad and not isinstance(tensor, nn.Parameter):
            result.requires_grad_()
        return result

    memo: dict[int, object] = {}
    for parameter in model.parameters():
        memo[id(parameter)] = nn.Parameter(fake(parameter), requires_grad=parameter.requires_grad)
    for module in model.modules():
        for value in [*module._buffers.values(), *vars(module).values()]:
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = fake(value)
    try:
        fake_model = copy.deepcopy(model, memo)
    except Exception as error:
        raise LabkitError(
            f"could not copy {type(model).__name__}'s structure for an allocation-free run "
            f"({type(error).__name__}: {error}); measure instead with measure_step_peak"
        ) from error
    fake_inputs = tree_map_only(torch.Tensor, fake, list(inputs))
    return fake_model, fake_inputs


def _fake_forward(model: nn.Module, inputs: Sequence):
    try:
        return _forward(model, inputs)
    except LabkitError as error:
        if isinstance(error.__cause__, _FAKE_FAILURES):
            raise LabkitError(
                f"{type(model).__name__} uses an operation fake tensors cannot run "
                f"({error.__cause__}); the allocation-free path is closed for it: use "
                "saved_tensors / measure_step_peak on a real device instead"
            ) from error.__cause__
        raise


@dataclass
class _Call:
    name: str
    module: nn.Module
    args: tuple
    kwargs: dict
    outputs: list = field(default_factory=list)
    ops: set = field(default_factory=set)
    children: list = field(default_factory=list)

    @property
    def input(self) -> torch.Tensor:
        return _tensors((self.args, self.kwargs))[0]

    @property
    def needs_grad(self) -> bool:
        return any(t.requires_grad for t in self.outputs)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.outputs[0].dtype


class _CallRecorder(TorchDispatchMode):
    """Records each module call's arguments, outputs and the aten ops that ran inside it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.calls: list[_Call] = []
        self._open: list[_Call] = []
        self._model = model
        self._names = _module_names(model)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        handles = []
        for module in self._model.modules():
            handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            handles.append(module.register_forward_hook(self._leave, with_kwargs=True))
        try:
            with self:
                yield
        finally:
            for handle in handles:
                handle.remove()

    def _enter(self, module, args, kwargs) -> None:
        call = _Call(self._names[module], module, args, dict(kwargs))
        if self._open:
            self._open[-1].children.append(call)
        self.calls.append(call)
        self._open.append(call)

    def _leave(self, module, args, kwargs, output) -> None:
        self._open.pop().outputs = _tensors(output)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name().split("::")[-1].split(".")[0]
        for call in self._open:
            call.ops.add(name)
        return func(*args, **(kwargs or {}))


def _trace(model: nn.Module, inputs: Sequence, precision: str, device) -> tuple[list[_Call], set[int]]:
    """Run the forward on fake tensors at the given precision; return the calls and the storages
    that are model state or inputs (never counted as activations)."""
    mode = FakeTensorMode()
    dtype = _PURE_DTYPES.get(precision)
    fake_model, fake_inputs = _fake_copy(model, inputs, mode, dtype, device)
    state = [*fake_model.parameters(), *fake_model.buffers(), *_tensors(fake_inputs)]
    recorder = _CallRecorder(fake_model)
    with mode, torch.enable_grad(), _autocast_for(precision, device or _device_of(model, inputs)):
        with recorder.recording():
            _fake_forward(fake_model, fake_inputs)
    return recorder.calls, {_storage_key(t) for t in state}


_PURE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16,
                "mixed_bf16": torch.bfloat16, "mixed_fp16": torch.float16}
_AMP_DTYPES = {"amp_bf16": torch.bfloat16, "amp_fp16": torch.float16}


def _autocast_for(precision: str, device: torch.device):
    if precision not in _AMP_DTYPES:
        return contextlib.nullcontext()
    if device.type not in ("cpu", "cuda"):
        raise LabkitError(f"autocast ({precision}) runs on cpu or cuda, not {device.type}: pass "
                          "device='cpu' or device='cuda' to trace the model as if it lived there")
    return torch.autocast(device_type=device.type, dtype=_AMP_DTYPES[precision])


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise LabkitError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")


# --------------------------------------------------------------------------------------------
# per-layer formulas: what each layer's backward needs kept


@dataclass(frozen=True)
class _Item:
    what: str
    key: Hashable
    nbytes: int


def _kept(what: str, tensor: torch.Tensor) -> _Item:
    """An existing tensor kept alive: its whole storage counts, even for a view."""
    nbytes = _storage_nbytes(tensor)
    text = f"{what} {_shape_text(tensor.shape, tensor.dtype)}"
    if nbytes != tensor.numel() * tensor.element_size():
        text += f" (a view: keeps its whole {_human(nbytes)} storage alive)"
    return _Item(text, ("storage", _storage_key(tensor)), nbytes)


def _fresh(what: str, shape, dtype: torch.dtype) -> _Item:
    """A tensor created for backward; its key is unique, so it is never shared."""
    nbytes = math.prod(int(d) for d in shape) * dtype.itemsize
    return _Item(f"{what} {_shape_text(shape, dtype)}", object(), nbytes)


def _operand(what: str, tensor: torch.Tensor, dtype: torch.dtype, flattened: bool) -> _Item:
    """The input a matmul-like kernel saves: itself, or the copy autocast or a reshape made."""
    if tensor.dtype != dtype:
        return _fresh(f"{what} cast by autocast to", tensor.shape, dtype)
    if flattened and tensor.dim() > 2 and not tensor.is_contiguous():
        return _fresh(f"{what} copied to 2-D (not contiguous)", tensor.shape, dtype)
    return _kept(what, tensor)


def _weight_copy(weight: torch.Tensor, dtype: torch.dtype) -> list[_Item]:
    # autocast caches one low-precision copy per weight for the whole forward
    if weight.dtype == dtype:
        return []
    return [_Item(f"weight copy cast by autocast {_shape_text(weight.shape, dtype)}",
                  ("autocast", id(weight), dtype), weight.numel() * dtype.itemsize)]


def _linear(call: _Call) -> list[_Item]:
    weight, dtype = call.module.weight, call.compute_dtype
    items = [_operand("input", call.input, dtype, flattened=True)] if weight.requires_grad else []
    if call.input.requires_grad:
        items += _weight_copy(weight, dtype)
    return items


def _conv(call: _Call) -> list[_Item]:
    dtype = call.compute_dtype
    return [_operand("input", call.input, dtype, flattened=False), *_weight_copy(call.module.weight, dtype)]


def _stat_dtype(x: torch.Tensor, weight) -> torch.dtype:
    # CPU kernels keep statistics in the parameters' dtype; CUDA ones in fp32 for 16-bit inputs
    if x.device.type == "cpu":
        return weight.dtype if weight is not None else x.dtype
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _batch_norm(call: _Call) -> list[_Item]:
    module, x = call.module, call.input
    items = [_kept("input", x)]
    if module.training or module.running_mean is None:
        dtype = _stat_dtype(x, module.weight)
        items += [_fresh("batch mean", (x.shape[1],), dtype), _fresh("inverse std", (x.shape[1],), dtype)]
    return items


def _layer_norm(call: _Call) -> list[_Item]:
    x = call.input
    rows = x.shape[: x.dim() - len(call.module.normalized_shape)]
    dtype = _stat_dtype(x, call.module.weight)
    return [_kept("input", x), _fresh("mean", rows, dtype), _fresh("1/std", rows, dtype)]


def _group_norm(call: _Call) -> list[_Item]:
    x, groups = call.input, (call.input.shape[0], call.module.num_groups)
    dtype = _stat_dtype(x, call.module.weight)
    return [_kept("input", x), _fresh("mean", groups, dtype), _fresh("1/std", groups, dtype)]


def _saves_output(call: _Call) -> list[_Item]:
    return [_kept("output", call.outputs[0])]


def _saves_input(call: _Call) -> list[_Item]:
    return [_kept("input", call.input)]


def _saves_nothing(call: _Call) -> list[_Item]:
    return []


def _dropout(call: _Call) -> list[_Item]:
    module, x = call.module, call.input
    if not module.training or module.p == 0:
        return []
    if "native_dropout" in call.ops:
        return [_fresh("keep mask", x.shape, torch.bool)]
    feature = isinstance(module, (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d))
    shape = (*x.shape[:2], *[1] * (x.dim() - 2)) if feature else x.shape
    return [_fresh("scaled random mask", shape, x.dtype)]


def _max_pool(call: _Call) -> list[_Item]:
    indices = (_kept("argmax indices", call.outputs[1]) if len(call.outputs) > 1
               else _fresh("argmax indices", call.outputs[0].shape, torch.int64))
    return [_kept("input", call.input), indices]


def _adaptive_avg_pool(call: _Call) -> list[_Item]:
    # an all-ones output size runs as mean(), which keeps only shapes
    spatial = call.outputs[0].shape[2:] if call.input.dim() > 2 else call.outputs[0].shape[-1:]
    return [] if all(d == 1 for d in spatial) else [_kept("input", call.input)]


def _embedding(call: _Call) -> list[_Item]:
    return [_kept("indices", call.input)] if call.module.weight.requires_grad else []


_FUSED_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"}


def _attention(call: _Call) -> list[_Item]:
    """nn.MultiheadAttention: the projections, then the fused SDPA kernel or the explicit softmax."""
    module = call.module
    bound = inspect.signature(module.forward).bind(*call.args, **call.kwargs)
    bound.apply_defaults()
    query, key, value = (bound.arguments[n] for n in ("query", "key", "value"))
    dims = _attention_dims(module, query, key)
    dtype = call.compute_dtype
    items = _projection_inputs(module, query, key, value, dtype)
    q, k, v = _projections(query, key, value, dims, dtype)
    fused = bool(call.ops & _FUSED_ATTENTION) and not bound.arguments["need_weights"]
    core = _fused_core(call, q, k, v, dims, dtype) if fused else _explicit_core(call, bound, k, v, dims, dtype)
    return items + core


def _attention_dims(module, query, key) -> dict[str, int]:
    seq_dim, batch_dim = (1, 0) if module.batch_first else (0, 1)
    batched = query.dim() == 3
    return {
        "B": query.shape[batch_dim] if batched else 1,
        "L": query.shape[seq_dim] if batched else query.shape[0],
        "S": key.shape[seq_dim] if batched else key.shape[0],
        "E": module.embed_dim, "H": module.num_heads,
    }


def _projection_inputs(module, query, key, value, dtype) -> list[_Item]:
    if query is key and key is value:
        distinct = [("query", query)]
    elif key is value:
        distinct = [("query", query), ("key", key)]
    else:
        distinct = [("query", query), ("key", key), ("value", value)]
    return [_sequence_first_operand(name, tensor, module.batch_first, dtype) for name, tensor in distinct]


def _sequence_first_operand(name: str, tensor: torch.Tensor, batch_first: bool, dtype) -> _Item:
    # batch_first inputs are transposed to (seq, batch, E); a non-contiguous one is copied for the matmul
    if batch_first and tensor.dim() == 3:
        layout = torch.empty_strided(tensor.shape, tensor.stride(), device="meta").transpose(0, 1)
        if not layout.is_contiguous():
            return _fresh(f"{name} copied to (seq, batch, E) for in_proj", tensor.shape, dtype)
    return _operand(f"{name} (in_proj input)", tensor, dtype, flattened=True)


def _projections(query, key, value, dims, dtype) -> tuple[_Item, _Item, _Item]:
    B, L, S, E = dims["B"], dims["L"], dims["S"], dims["E"]
    if key is value and query is key:
        qkv = _fresh("q, k, v projections (one packed tensor)", (3, L, B, E), dtype)
        return qkv, qkv, qkv
    q = _fresh("q projection", (L, B, E), dtype)
    if key is value:
        kv = _fresh("k, v projections (one packed tensor)", (2, S, B, E), dtype)
        return q, kv, kv
    return q, _fresh("k projection", (S, B, E), dtype), _fresh("v projection", (S, B, E), dtype)


def _fused_core(call, q, k, v, dims, dtype) -> list[_Item]:
    B, L, E, H = dims["B"], dims["L"], dims["E"], dims["H"]
    rows = L if "_scaled_dot_product_efficient_attention" not in call.ops else -(-L // 32) * 32
    return [q, k, v, _fresh("attention output (also out_proj's input)", (B, H, L, E // H), dtype),
            _fresh("log-sum-exp per row", (B, H, rows), torch.float32)]


def _explicit_core(call, bound, k, v, dims, dtype) -> list[_Item]:
    B, L, S, E, H = dims["B"], dims["L"], dims["S"], dims["E"], dims["H"]
    need_weights = bound.arguments["need_weights"]
    items = [_fresh("q scaled by 1/sqrt(d)", (B * H, L, E // H), dtype)]
    items.append(k if need_weights else _fresh("k scaled, transposed", (B * H, E // H, S), dtype))
    weights = _fresh("softmax weights", (B, H, L, S), dtype)
    items.append(weights)
    if call.module.training and call.module.dropout > 0:
        mask_dtype = torch.bool if "native_dropout" in call.ops else dtype
        items += [_fresh("dropout mask on weights", (B, H, L, S), mask_dtype),
                  _fresh("weights after dropout", (B, H, L, S), dtype)]
    items += [v, _fresh("heads merged for out_proj", (L * B, E), dtype)]
    if need_weights:
        items.append(_fresh("the scale 1/sqrt(d) as a 0-d tensor", (), torch.float64))
    return items


def _onednn_good_ld(dim: int) -> int:
    # oneDNN pads a leading dimension to 64 bytes and by one more block when it is a multiple of 1 KiB
    ld = -(-dim // 16) * 16
    return ld + 16 if ld % 256 == 0 else ld


def onednn_lstm_workspace_bytes(seq_len: int, batch: int, input_size: int, hidden_size: int) -> int:
    """Bytes of the workspace oneDNN keeps for backward, per LSTM layer and direction (fp32, CPU).

    Seven parts, one per time step each: the gates, the hidden output, and five blocks of hidden
    and cell states (and their gradients) for seq_len + 1 steps; each padded to oneDNN's preferred
    row length and rounded up to 4096-byte pages. Fitted to the kernel's workspace sizes on this
    build and checked against the real kernel in ``tests/test_memory.py``; on CPU it is most of
    what an LSTM saves. Taught in ``13_memory``.
    """
    layer_ld = _onednn_good_ld(max(input_size, hidden_size))
    floats = [
        seq_len * batch * _onednn_good_ld(4 * hidden_size),
        seq_len * batch * _onednn_good_ld(hidden_size),
        *[2 * (seq_len + 1) * batch * layer_ld] * 3,
        *[2 * (seq_len + 1) * batch * hidden_size] * 2,
    ]
    return sum(-(-4 * count // 4096) * 4096 for count in floats)


def _lstm(call: _Call) -> list[_Item] | None:
    module, x = call.module, call.input
    if "mkldnn_rnn_layer" not in call.ops or x.dtype != torch.float32 or module.proj_size:
        return None
    seq_dim = 1 if module.batch_first and x.dim() == 3 else 0
    T, B = x.shape[seq_dim], (x.shape[1 - seq_dim] if x.dim() == 3 else 1)
    D, H = 2 if module.bidirectional else 1, module.hidden_size
    states = [_kept("given initial state", s) for s in _tensors(call.args[1:])] or [
        _fresh(f"zero initial {name}", (module.num_layers * D, B, H), x.dtype) for name in ("h0", "c0")]
    if seq_dim == 1:
        layer_input = _fresh("input transposed to (seq, batch, features)", (T, B, x.shape[-1]), x.dtype)
    else:
        layer_input = _kept("input", x)
    items: list[_Item] = []
    for layer in range(module.num_layers):
        width = x.shape[-1] if layer == 0 else H * D
        for _ in range(D):
            output = _layer_output(call, layer, (T, B, H))
            items += [layer_input, *states, output, _fresh("last h", (B, H), x.dtype),
                      _fresh("last c", (B, H), x.dtype),
                      _workspace(T, B, width, H)]
        layer_input, between = _between_layers(module, layer, (T, B, H * D), x.dtype, output)
        items += between
    return items


def _workspace(seq_len: int, batch: int, width: int, hidden: int) -> _Item:
    nbytes = onednn_lstm_workspace_bytes(seq_len, batch, width, hidden)
    return _Item(f"oneDNN workspace {nbytes:,} B (T={seq_len}, B={batch}, in={width}, H={hidden})", object(), nbytes)


def _layer_output(call: _Call, layer: int, shape) -> _Item:
    module = call.module
    if layer == module.num_layers - 1 and not module.bidirectional:
        # the last layer's output storage is the module's output (transposed back if batch_first)
        return _kept(f"layer {layer} output = the LSTM's output", call.outputs[0])
    return _fresh(f"layer {layer} output", shape, call.input.dtype)


def _between_layers(module, layer, shape, dtype, last_output) -> tuple[_Item, list[_Item]]:
    if layer == module.num_layers - 1:
        return last_output, []
    if module.training and module.dropout > 0:
        return _fresh(f"layer {layer} output after dropout", shape, dtype), [
            _fresh("dropout mask between layers", shape, dtype)]
    if module.bidirectional:
        return _fresh(f"layer {layer} directions concatenated", shape, dtype), []
    return last_output, []


def _transformer_layer(call: _Call) -> list[_Item] | None:
    """The feed-forward activation TransformerEncoder/DecoderLayer applies as a plain function."""
    module = call.module
    if isinstance(module.activation, nn.Module):
        return []
    calls = {child.module: child for child in call.children}
    linear1, dropout = calls.get(module.linear1), calls.get(module.dropout)
    if module.activation is F.relu and dropout is not None:
        return [_kept("ReLU output (F.relu between linear1 and linear2)", dropout.input)]
    if module.activation is F.gelu and linear1 is not None:
        return [_kept("GELU input (F.gelu between linear1 and linear2)", linear1.outputs[0])]
    return None


_FORMULAS: tuple[tuple[tuple[type, ...], Callable[[_Call], list[_Item] | None]], ...] = (
    ((nn.Linear,), _linear),
    ((nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d), _conv),
    ((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), _batch_norm),
    ((nn.LayerNorm,), _layer_norm),
    ((nn.GroupNorm,), _group_norm),
    ((nn.ReLU, nn.Sigmoid, nn.Tanh, nn.Softmax, nn.LogSoftmax, nn.Softmin), _saves_output),
    ((nn.GELU, nn.SiLU, nn.LeakyReLU, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Mish,
      nn.Softplus, nn.ELU, nn.CELU, nn.SELU, nn.PReLU, nn.Threshold), _saves_input),
    ((nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d), _dropout),
    ((nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
      nn.AdaptiveMaxPool3d), _max_pool),
    ((nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d), _saves_input),
    ((nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d), _adaptive_avg_pool),
    ((nn.Identity, nn.Flatten, nn.Unflatten), _saves_nothing),
    ((nn.Embedding,), _embedding),
    ((nn.MultiheadAttention,), _attention),
    ((nn.LSTM,), _lstm),
    ((nn.TransformerEncoderLayer, nn.TransformerDecoderLayer), _transformer_layer),
)


def _formula_for(module: nn.Module):
    for types, formula in _FORMULAS:
        if isinstance(module, types):
            return formula
    return None


# --------------------------------------------------------------------------------------------
# the analytic table


@dataclass(frozen=True)
class ActivationLine:
    """One module's share of the activations: what its backward needs kept, and the bytes."""

    module: str
    layer: str
    saves: str
    bytes: int
    exact: int | None = None


@dataclass(frozen=True)
class ActivationTable:
    """Per-layer formula for what autograd saves, one line per module, in call order.

    A tensor two layers need (a ReLU's output that the next Linear also saves) is counted on the
    first line only, as autograd stores it once. ``against(saved_tensors(...))`` fills in the exact
    count per module so the two can be read side by side. Taught in ``13_memory``.
    """

    lines: tuple[ActivationLine, ...]
    title: str = "Activations saved for backward, per layer (analytic)"

    @property
    def total(self) -> int:
        return sum(line.bytes for line in self.lines)

    def __int__(self) -> int:
        return self.total

    def against(self, exact: SavedTensors) -> ActivationTable:
        """This table with the exact count of each module beside the formula."""
        remaining = dict(exact.per_module)
        lines = [replace(line, exact=remaining.pop(line.module, 0)) for line in self.lines]
        lines += [ActivationLine(name, "-", "no formula: functional code in this module's forward", 0, nbytes)
                  for name, nbytes in remaining.items()]
        return replace(self, lines=tuple(lines), title=self.title + " vs exact count")

    def __str__(self) -> str:
        compared = any(line.exact is not None for line in self.lines)
        rows = [self.title, _table_row("module", "layer", "analytic", "exact" if compared else "", "what it saves")]
        rows += [_table_row(line.module, line.layer, f"{line.bytes:,}",
                            f"{line.exact:,}" if line.exact is not None else "", line.saves)
                 for line in self.lines]
        rows.append(_table_row("total (bytes)", "", f"{self.total:,}", self._exact_total(), self._difference()))
        return "\n".join(rows)

    def _exact_total(self) -> str:
        exact = [line.exact for line in self.lines if line.exact is not None]
        return f"{sum(exact):,}" if exact else ""

    def _difference(self) -> str:
        exact = sum(line.exact or 0 for line in self.lines)
        if not exact:
            return ""
        return f"analytic - exact = {self.total - exact:+,} B ({(self.total - exact) / exact:+.2%})"


def _table_row(module, layer, analytic, exact, saves) -> str:
    return f"  {module:<24} {layer:<20} {analytic:>13} {exact:>13}   {saves}"


def _line_for(call: _Call, counted: set, excluded: set) -> ActivationLine | None:
    formula = _formula_for(call.module)
    if formula is None and next(call.module.children(), None) is not None:
        return None  # a container: its children have the lines
    items = formula(call) if formula is not None and call.needs_grad else []
    if items is None or formula is None:
        kind = type(call.module).__name__
        return ActivationLine(call.name, kind, f"no formula for {kind} here: compare with the exact count", 0)
    texts, nbytes = [], 0
    for item in dict.fromkeys(items):
        if _is_model_state(item, excluded):
            texts.append(f"{item.what} (model input or state: not counted)")
        elif item.key in counted:
            texts.append(f"{item.what} (already counted above)")
        else:
            counted.add(item.key)
            texts.append(item.what)
            nbytes += item.nbytes
    return ActivationLine(call.name, type(call.module).__name__, "; ".join(texts) or "nothing", nbytes)


def _is_model_state(item: _Item, excluded: set) -> bool:
    return isinstance(item.key, tuple) and item.key[0] == "storage" and item.key[1] in excluded


def _merge_by_module(lines: list[ActivationLine]) -> tuple[ActivationLine, ...]:
    # a module called twice (weight sharing) gets one line, as in the exact count
    merged: dict[str, ActivationLine] = {}
    for line in lines:
        if line.module in merged:
            first = merged[line.module]
            line = replace(first, saves=f"{first.saves} | {line.saves}", bytes=first.bytes + line.bytes)
        merged[line.module] = line
    return tuple(merged.values())


def activation_table(model: nn.Module, *inputs, precision: str = "fp32", device=None) -> ActivationTable:
    """Per-layer formulas for the bytes autograd saves in one ``model(*inputs)``; nothing allocated.

    The forward runs on fake tensors only to learn each layer's shapes, dtypes and which kernel the
    dispatcher picks (fused attention or not, oneDNN LSTM or not); the bytes come from formulas
    for Linear, Conv, BatchNorm, LayerNorm, GroupNorm, activations, dropout, pooling, embedding,
    MultiheadAttention (fused SDPA and explicit softmax) and the oneDNN LSTM. ``precision`` runs
    the trace under autocast (``amp_*``) or with 16-bit weights (``bf16``, ``fp16``, ``mixed_*``).
    ``device`` traces as if the tensors lived there: a meta-device model with ``device="cpu"``
    gets the CPU kernels' choices (fused attention, oneDNN LSTM) without allocating anything.
    Taught in ``13_memory``; the precisions in ``10_mixed_precision``.
    """
    _check_model(model)
    _check_precision(precision)
    calls, excluded = _trace(model, inputs, precision, _optional_device(device))
    counted: set = set()
    lines = [line for call in calls if (line := _line_for(call, counted, excluded)) is not None]
    return ActivationTable(_merge_by_module(lines))


def analytic_activation_bytes(model: nn.Module, *inputs) -> int:
    """The formula-based count of activation bytes for one ``model(*inputs)``, as an int.

    See :func:`activation_table` for the per-layer lines. Taught in ``13_memory``.
    """
    return activation_table(model, *inputs).total


# --------------------------------------------------------------------------------------------
# parameters, gradients, master weights and optimizer state

# bytes per parameter for (weights, gradients, master copy, each optimizer slot)
_STATE_BYTES = {
    "fp32": (4, 4, 0, 4), "amp_bf16": (4, 4, 0, 4), "amp_fp16": (4, 4, 0, 4),
    "bf16": (2, 2, 0, 2), "fp16": (2, 2, 0, 2), "mixed_bf16": (2, 2, 4, 4), "mixed_fp16": (2, 2, 4, 4),
}
_OPTIMIZER_SLOTS = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}
_SLOT_NAMES = {0: "no state", 1: "momentum buffer", 2: "exp_avg + exp_avg_sq"}


def _check_optimizer_name(optimizer: str) -> None:
    if optimizer not in OPTIMIZERS:
        raise LabkitError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")


def training_state(model: nn.Module, optimizer: str = "adamw", precision: str = "fp32") -> MemoryReport:
    """Bytes of weights, gradients, master weights and optimizer state, from parameter counts.

    ``precision``: ``fp32``; ``amp_bf16``/``amp_fp16`` (autocast: fp32 weights, 16-bit activations);
    ``bf16``/``fp16`` (everything 16-bit, no master copy); ``mixed_bf16``/``mixed_fp16`` (16-bit
    weights and gradients, fp32 master weights and optimizer state: 16 B per parameter with Adam).
    Frozen parameters cost their weights only. Taught in ``10_mixed_precision`` and ``13_memory``.
    """
    _check_model(model)
    _check_precision(precision)
    _check_optimizer_name(optimizer)
    weight_b, grad_b, master_b, slot_b = _STATE_BYTES[precision]
    slots = _OPTIMIZER_SLOTS[optimizer]
    every = sum(p.numel() for p in model.parameters())
    trained = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in trained)

    def row(label: str, count: int, each: int, what: str) -> tuple[str, Reading]:
        return label, Reading(count * each, "B", "estimated", source=f"{count:,} × {each} B {what}")

    rows = [row("parameters", every, weight_b, "weights"), row("gradients", n, grad_b, "gradients")]
    if master_b:
        rows.append(row("master weights", n, master_b, "fp32 master copy"))
    rows.append(row("optimizer state", n, slots * slot_b, _SLOT_NAMES[slots]))
    if optimizer in ("adam", "adamw"):
        rows.append(row("step counters", len(trained), 4, "(0-d fp32 per parameter tensor; on the CPU "
                                                            "unless capturable or fused)"))
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    rows.append(("buffers", Reading(buffers, "B", "estimated", source="as stored")))
    return MemoryReport(f"Training state: {optimizer} at {precision}", tuple(rows))


@dataclass(frozen=True)
class AnalyticMemory:
    """The analytic calculator's answer: training state plus per-layer activations.

    The total is the sum of the parts, not the peak of a step (gradients appear while activations
    are being freed); see :func:`estimate_step_peak` for that. Taught in ``13_memory`` and
    ``10_mixed_precision``.
    """

    state: MemoryReport
    activations: ActivationTable

    def report(self) -> MemoryReport:
        activations = Reading(self.activations.total, "B", "estimated", source="per-layer formulas")
        return replace(self.state, title=self.state.title + " + activations",
                       rows=(*self.state.rows, ("activations", activations)),
                       notes=("sum of the parts, not the peak of a step: see estimate_step_peak",))

    def __int__(self) -> int:
        return int(self.report())

    def __str__(self) -> str:
        return f"{self.report()}\n\n{self.activations}"


def analytic_memory(model: nn.Module, *inputs, optimizer: str = "adamw", precision: str = "fp32",
                    device=None) -> AnalyticMemory:
    """Parameters, gradients, master weights, optimizer state and activations, all from formulas.

    Works without allocating: a model on the meta device is fine (e.g. ViT-Base at batch 64, with
    ``device="cpu"`` or ``"cuda"`` to get that device's kernel choices). Taught in ``13_memory``;
    ``precision`` in ``10_mixed_precision``.
    """
    return AnalyticMemory(training_state(model, optimizer, precision),
                          activation_table(model, *inputs, precision=precision, device=device))


def _optional_device(device) -> torch.device | None:
    """``torch.device(device)`` with an index: tensors say ``cuda:0``, and ``cuda`` != ``cuda:0``."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        # even fake CUDA tensors need a CUDA build and driver: without them torch aborts the process
        raise LabkitError(f"device={str(device)!r} needs CUDA, and this machine has none "
                          "(torch.cuda.is_available() is False): use device='cpu' here, or run on a GPU machine")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# --------------------------------------------------------------------------------------------
# one training step, real or fake


def _optimizer_factory(model: nn.Module, optimizer, device: torch.device) -> Callable:
    if not any(p.requires_grad for p in model.parameters()):
        raise LabkitError(f"{type(model).__name__} has no trainable parameters, so a training step has "
                          "nothing to update: use saved_tensors for the forward's activations instead")
    if callable(optimizer):
        return optimizer
    _check_optimizer_name(optimizer)
    # torch's own default (foreach on CUDA, a loop on CPU), stated: on fake tensors torch would
    # always pick the loop, whose temporaries differ from the foreach kernels'.
    foreach = device.type == "cuda"
    return {
        "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, foreach=foreach),
        "sgd_momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach),
        "adam": lambda params: torch.optim.Adam(params, lr=1e-3, foreach=foreach),
        "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=foreach),
    }[optimizer]


def _sum_first_output(output) -> torch.Tensor:
    tensors = _tensors(output)
    if not tensors:
        raise LabkitError("the model returned no tensor: pass loss_fn=... that turns its output into a scalar")
    return tensors[0].sum()


def _train_step(model, optimizer, inputs, loss_fn, phase=lambda name: None) -> None:
    phase("forward")
    loss = (loss_fn or _sum_first_output)(_forward(model, inputs))
    phase("backward")
    loss.backward()
    phase("optimizer")
    optimizer.step()
    optimizer.zero_grad()


# --------------------------------------------------------------------------------------------
# allocation-free estimate of a step's peak


class _OneDnnWorkspaceOnFake(TorchDispatchMode):
    """PyTorch's fake kernel for oneDNN's LSTM returns an empty workspace; give it its real size."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mkldnn_rnn_layer.default and args[15] and result[3].numel() == 0:
            # the input arrives (seq, batch, features) whatever its batch_first flag says
            x = args[0]
            size = onednn_lstm_workspace_bytes(x.shape[0], x.shape[1], x.shape[-1], args[10])
            result = (*result[:3], torch.empty(size, dtype=torch.uint8, device=x.device))
        return result


# Kernels that take private memory while they run (oneDNN's layout reorders and scratchpads, the
# native convolution's im2col buffers, cuDNN workspaces) and free it before returning: it goes
# through the allocator but never becomes a tensor, so no fake-tensor tracker can see it.
_WORKSPACE_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("convolution", "convolution_backward", "mkldnn_rnn_layer", "mkldnn_rnn_layer_backward",
                 "_cudnn_rnn", "_cudnn_rnn_backward")
    if hasattr(torch.ops.aten, name)
)
KERNEL_WORKSPACE = ("auto", "measure", "ignore")


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _TensorSpec:
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device)

    def zeros(self) -> torch.Tensor:
        extent = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride)) if all(self.shape) else 0
        return torch.zeros(extent, dtype=self.dtype, device=self.device).as_strided(self.shape, self.stride)


def _call_key(func, args, kwargs) -> tuple:
    leaves, _ = tree_flatten((args, kwargs))
    return (func, *(_TensorSpec.of(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves))


class _WorkspaceRecorder(TorchDispatchMode):
    """Notes each distinct call of a workspace-taking kernel: op, argument shapes, strides, dtypes."""

    def __init__(self):
        super().__init__()
        self.calls: dict[tuple, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _WORKSPACE_OPS:
            leaves, tree = tree_flatten((args, kwargs))
            specs = [_TensorSpec.of(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
            self.calls.setdefault(_call_key(func, args, kwargs), (func, specs, tree))
        return func(*args, **kwargs)


class _WorkspaceReporter(TorchDispatchMode):
    """After each workspace-taking kernel returns, reports the private bytes it was measured to hold."""

    def __init__(self, workspaces: dict[tuple, int], report: Callable[[int], None]):
        super().__init__()
        self._workspaces, self._report = workspaces, report

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self._workspaces and func in _WORKSPACE_OPS:
            self._report(self._workspaces[_call_key(func, args, kwargs)])
        return result


def _zero_filled(specs: list, tree) -> tuple[tuple, dict]:
    """A recorded call's arguments, with a zero-filled tensor for each tensor spec."""
    return tree_unflatten([spec.zeros() if isinstance(spec, _TensorSpec) else spec for spec in specs], tree)


def _cuda_private_bytes(calls: dict, device: torch.device) -> dict[tuple, int]:
    """Each kernel call alone: the CUDA allocator's peak rise during it, less its new outputs."""
    workspaces = {}
    for key, (func, specs, tree) in calls.items():
        args, kwargs = _zero_filled(specs, tree)
        inputs, kept = {_storage_key(t) for t in _tensors((args, kwargs))}, []
        with torch.no_grad():
            rise = int(peak_bytes_during(lambda: kept.append(func(*args, **kwargs)), device))
        outputs = _unique_bytes([t for t in _tensors(kept) if _storage_key(t) not in inputs], device)
        workspaces[key] = max(0, rise - outputs)
    return workspaces


def _cpu_private_bytes(calls: dict) -> dict[tuple, int]:
    """Every kernel call in one profiler session, each in its own range: within a range, the
    allocations' highest running total less what the range left allocated (its outputs)."""
    from torch.profiler import record_function

    labels = {f"labkit.kernel_workspace.{index}": key for index, key in enumerate(calls)}

    def run_each() -> None:
        for label, key in labels.items():
            func, specs, tree = calls[key]
            args, kwargs = _zero_filled(specs, tree)
            with torch.no_grad(), record_function(label):
                outputs = func(*args, **kwargs)
            # after the range closes, so that the range ends holding the outputs; and before the
            # next call's inputs exist, so that one call's tensors are alive at a time
            del outputs, args, kwargs

    stack, ranges = _profiled_events(run_each), {}
    while stack:
        node = stack.pop()
        if node.name in labels:
            ranges[labels[node.name]] = node
        else:
            stack.extend(node.children)
    return {key: _held_beyond_outputs(_allocations_under([node])) for key, node in ranges.items()}


def _held_beyond_outputs(events: list[tuple[int, int]]) -> int:
    running, peak, live = 0, 0, {}
    for ptr, delta in events:
        running += delta
        peak = max(peak, running)
        if delta > 0:
            live[ptr] = delta
        else:
            live.pop(ptr, None)
    return max(0, peak - sum(live.values()))


def _measure_workspaces(recorder: _WorkspaceRecorder, choice: str, model: nn.Module,
                        device: torch.device) -> tuple[dict[tuple, int], str | None]:
    """Private bytes per recorded kernel call, and a note for the report (None: nothing to say)."""
    if choice not in KERNEL_WORKSPACE:
        raise LabkitError(f"kernel_workspace={choice!r} is not one of {KERNEL_WORKSPACE}")
    if not recorder.calls:
        return {}, None
    if choice == "ignore":
        return {}, ("kernel workspaces ignored (kernel_workspace='ignore'): convolution and recurrent kernels "
                    "take private memory while they run, so the measured peak can be higher")
    reason = _no_allocator(device) or (
        "the model is on the meta device, so measuring would allocate what it was meant to avoid "
        "(pass kernel_workspace='measure' to run each such kernel once, alone)"
        if choice == "auto" and any(t.is_meta for t in (*model.parameters(), *model.buffers())) else None)
    if reason:
        if choice == "measure":
            raise LabkitError(f"kernel_workspace='measure' cannot measure on {device}: {reason}")
        return {}, f"kernel workspaces not measured: {reason}"
    workspaces = (_cpu_private_bytes(recorder.calls) if device.type == "cpu"
                  else _cuda_private_bytes(recorder.calls, device))
    ops = sorted({key[0].name().removeprefix("aten::") for key in workspaces})
    return workspaces, (
        f"kernel workspace: measured by running each of the {len(workspaces)} distinct {', '.join(ops)} calls once, "
        f"alone, on zero-filled tensors on {device} (largest: {max(workspaces.values()):,} B)")


def _mem_tracker_class():
    """PyTorch's MemTracker when this build has it (torch.distributed._tools, 2.5+), else None."""
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError:
        return None
    return MemTracker


_WORKSPACE = "kernel workspace"
_CATEGORIES = ("parameters", "buffers", "gradients", "optimizer state", "activations", "temporaries", _WORKSPACE,
               "inputs")
_MEM_TRACKER_CATEGORIES = {"Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients",
                           "Optstate": "optimizer state", "Activation": "activations",
                           "Temp": "temporaries", "Other": "inputs"}


def _peak_with_mem_tracker(tracker_class, model, optimizer, inputs, loss_fn, device, workspaces) -> dict[str, int]:
    tracker = tracker_class()
    tracker.track_external(model, optimizer, *_tensors(inputs))

    def categorised(kind: str) -> dict[str, int]:
        snapshot = tracker.get_tracker_snapshot(kind).get(device, {})
        named = {str(getattr(key, "value", key)): nbytes for key, nbytes in snapshot.items()}
        return {_MEM_TRACKER_CATEGORIES[key]: nbytes for key, nbytes in named.items() if key in _MEM_TRACKER_CATEGORIES}

    inside_kernels = _PeakInsideKernels(lambda: categorised("current"))
    with tracker, _WorkspaceReporter(workspaces, inside_kernels.add):
        _train_step(model, optimizer, inputs, loss_fn)
    breakdown = inside_kernels.higher_of(categorised("peak"))
    # MemTracker files everything created inside optimizer.step() as optimizer state, including the
    # step's temporaries (Adam's sqrt and division); the state itself is what optimizer.state holds.
    state = _unique_bytes(_optimizer_tensors(optimizer), device)
    misfiled = max(0, breakdown.get("optimizer state", 0) - state)
    breakdown["optimizer state"] = breakdown.get("optimizer state", 0) - misfiled
    breakdown["temporaries"] = breakdown.get("temporaries", 0) + misfiled
    return breakdown


class _PeakInsideKernels:
    """The highest moment inside a workspace-taking kernel: what the tracker holds when the kernel
    returns (inputs and outputs) plus the private bytes the kernel held on top."""

    def __init__(self, current: Callable[[], dict[str, int]]):
        self._current = current
        self.best: dict[str, int] = {}

    def add(self, workspace: int) -> None:
        moment = {**self._current(), _WORKSPACE: workspace}
        if sum(moment.values()) > sum(self.best.values()):
            self.best = moment

    def higher_of(self, tracked_peak: dict[str, int]) -> dict[str, int]:
        return dict(self.best) if sum(self.best.values()) > sum(tracked_peak.values()) else dict(tracked_peak)


def _unique_bytes(tensors, device: torch.device, seen: set | None = None) -> int:
    seen = set() if seen is None else seen
    nbytes = 0
    for tensor in tensors:
        key = _storage_key(tensor)
        if tensor.device == device and key not in seen:
            seen.add(key)
            nbytes += _allocated_nbytes(tensor)
    return nbytes


class _StorageTimeline(TorchDispatchMode):
    """Fallback for builds without MemTracker: every storage the step creates, with its lifetime.

    Storages are followed by weak reference; the peak is found by replaying the timeline, and its
    breakdown uses each storage's final category (a gradient is only known as one after backward).
    """

    def __init__(self, device: torch.device):
        super().__init__()
        self._device = device
        self._ids = WeakIdKeyDictionary()
        self._category: dict[int, str] = {}
        self._events: list[tuple[int, int]] = []
        self.current = "activations"

    def track(self, tensors, category: str) -> None:
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if tensor.device != self._device:
                continue
            if storage in self._ids:
                self._category[self._ids[storage]] = category
                continue
            self._add(storage, _allocated_nbytes(tensor), category)

    def add_workspace(self, nbytes: int) -> None:
        """Private bytes a kernel held while it ran: alive for that moment only."""
        workspace_id = len(self._category)
        self._category[workspace_id] = _WORKSPACE
        self._events += [(workspace_id, nbytes), (workspace_id, -nbytes)]

    def _add(self, storage, nbytes: int, category: str) -> None:
        storage_id = len(self._category)
        self._ids[storage] = storage_id
        self._category[storage_id] = category
        self._events.append((storage_id, nbytes))
        events = self._events
        weakref.finalize(storage, lambda: events.append((storage_id, -nbytes)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.track([t for t in _tensors(result) if t.untyped_storage() not in self._ids], self.current)
        return result

    def peak_breakdown(self) -> dict[str, int]:
        running, peak, peak_at = 0, 0, 0
        for index, (_, delta) in enumerate(self._events):
            running += delta
            if running > peak:
                peak, peak_at = running, index + 1
        live: dict[int, int] = {}
        for storage_id, delta in self._events[:peak_at]:
            live[storage_id] = live.get(storage_id, 0) + delta
        breakdown = dict.fromkeys(_CATEGORIES, 0)
        for storage_id, nbytes in live.items():
            breakdown[self._category[storage_id]] += nbytes
        return breakdown


def _peak_with_timeline(model, optimizer, inputs, loss_fn, device, workspaces) -> dict[str, int]:
    timeline = _StorageTimeline(device)
    timeline.track(model.parameters(), "parameters")
    timeline.track(model.buffers(), "buffers")
    timeline.track(_optimizer_tensors(optimizer), "optimizer state")
    timeline.track(_tensors(inputs), "inputs")

    def phase(name: str) -> None:
        if name == "optimizer":
            timeline.track([p.grad for p in model.parameters() if p.grad is not None], "gradients")
        timeline.current = "activations" if name == "forward" else "temporaries"

    with timeline, _WorkspaceReporter(workspaces, timeline.add_workspace):
        _train_step(model, optimizer, inputs, loss_fn, phase)
    return timeline.peak_breakdown()


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in _tensors(state)]


def estimate_step_peak(model: nn.Module, inputs, optimizer="adamw", loss_fn=None, device=None,
                       kernel_workspace: str = "auto") -> MemoryReport:
    """The steady-state peak bytes of one training step, without running the step on real tensors.

    Runs forward, ``loss_fn(output)`` (default: sum of the first output), backward,
    ``optimizer.step()`` and ``zero_grad()`` twice on fake tensors and reports the peak of the
    second step, when the optimizer state exists; the rows are the breakdown at that moment.
    Uses PyTorch's MemTracker when the build has it, else a storage timeline of our own.
    ``int(report)`` is the peak in bytes. ``device`` runs the fake step as if the tensors lived
    there (a meta-device model estimated with the CPU's or CUDA's kernels). Taught in ``13_memory``.

    Convolution and recurrent kernels also take private memory while they run (oneDNN reorders
    and scratchpads, im2col buffers, cuDNN workspaces) that is never a tensor, so fake tensors
    cannot see it. ``kernel_workspace`` says what to do about it: ``"measure"`` runs each distinct
    such call once, alone, on zero-filled tensors of its shapes, and adds the bytes it held beyond
    its outputs at that moment of the step (memory for one layer's call, never the model's step);
    ``"ignore"`` leaves it out (the report's note says the measured peak can be higher);
    ``"auto"`` (default) measures unless the model is on the meta device or the device has no
    allocator to read.
    """
    _check_model(model)
    inputs = _as_inputs(inputs)
    device = _optional_device(device) or _device_of(model, inputs)
    make_optimizer = _optimizer_factory(model, optimizer, device)
    mode = FakeTensorMode()
    fake_model, fake_inputs = _fake_copy(model, inputs, mode, device=device)
    recorder = _WorkspaceRecorder()
    with mode, _OneDnnWorkspaceOnFake(), torch.enable_grad(), recorder:
        fake_optimizer = make_optimizer(fake_model.parameters())
        _guarded_fake_step(fake_model, fake_optimizer, fake_inputs, loss_fn)
    workspaces, workspace_note = _measure_workspaces(recorder, kernel_workspace, model, device)
    tracker_class = _mem_tracker_class()
    with mode, _OneDnnWorkspaceOnFake(), torch.enable_grad():
        step = (fake_model, fake_optimizer, fake_inputs, loss_fn, device, workspaces)
        if tracker_class is not None:
            breakdown = _peak_with_mem_tracker(tracker_class, *step)
        else:
            breakdown = _peak_with_timeline(*step)
    return _estimate_report(breakdown, tracker_class is not None, workspaces, workspace_note)


def _guarded_fake_step(model, optimizer, inputs, loss_fn) -> None:
    try:
        _train_step(model, optimizer, inputs, loss_fn)
    except LabkitError as error:
        if isinstance(error.__cause__, _FAKE_FAILURES):
            raise LabkitError(
                f"{type(model).__name__} uses an operation fake tensors cannot run ({error.__cause__}): "
                "use measure_step_peak on a real device instead"
            ) from error.__cause__
        raise


def _estimate_report(breakdown: dict[str, int], used_mem_tracker: bool, workspaces: dict,
                     workspace_note: str | None) -> MemoryReport:
    source = "fake tensors + " + ("torch MemTracker" if used_mem_tracker else "labkit storage timeline")
    rows = [(c, Reading(breakdown.get(c, 0), "B", "estimated", source=source)) for c in _CATEGORIES if c != _WORKSPACE]
    if workspaces:
        rows.insert(-1, (_WORKSPACE, Reading(breakdown.get(_WORKSPACE, 0), "B", "estimated",
                                             source="each kernel call measured alone")))
    notes = ["steady state: the peak of step 2, once the optimizer state exists"]
    if workspace_note:
        notes.append(workspace_note)
    return MemoryReport("Step peak (estimated, allocation-free)", tuple(rows), tuple(notes))


# --------------------------------------------------------------------------------------------
# measurements


def _profiled_events(fn: Callable[[], object]) -> list:
    """The profiler's event tree (its roots) for one run of fn, with CPU allocator events."""
    from torch.profiler import ProfilerActivity, profile

    with _gc_paused(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return list(prof.profiler.kineto_results.experimental_event_tree())


def _allocations_under(roots: list) -> list[tuple[int, int]]:
    """(address, +bytes or -bytes) for every CPU allocator event in these subtrees, in time order."""
    from torch._C._profiler import _EventType

    stack, events = list(roots), []
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
    return [(ptr, size) for _, ptr, size in sorted(events, key=lambda event: event[0])]


def _allocation_events(fn: Callable[[], object]) -> list[tuple[int, int]]:
    """(address, +bytes or -bytes) for every CPU allocator event while fn runs, in time order."""
    return _allocations_under(_profiled_events(fn))


def _no_allocator(device: torch.device) -> str | None:
    if device.type == "cuda" and not torch.cuda.is_available():
        return ("no CUDA on this machine or in this PyTorch build (torch.cuda.is_available() is False); "
                "torch.cuda.max_memory_allocated() would return 0 here, which is not a measurement")
    if device.type == "meta":
        return "meta tensors have no storage: nothing is allocated, so there is nothing to measure"
    if device.type not in ("cpu", "cuda"):
        return f"labkit has no allocator statistics for device type {device.type!r}"
    if device.type == "cpu" and torch.autograd._profiler_enabled():
        return ("a torch profiler is already running, and CPU allocations are read with one: starting "
                "another would end yours; measure outside the profiler's `with` block")
    return None


def peak_bytes_during(fn: Callable[[], object], device="cpu") -> Reading:
    """The measured rise of allocated bytes above their level at the start, at its highest, while
    ``fn()`` runs.

    On CPU from the profiler's allocation events (``profile_memory=True``); on CUDA from
    ``torch.cuda`` statistics (reset, run, read). Unavailable, with the reason, where there is
    nothing to measure. Taught in ``13_memory``.
    """
    device = torch.device(device)
    reason = _no_allocator(device)
    if reason:
        return Reading.unavailable("B", reason)
    if device.type == "cuda":
        return Reading(_cuda_peak_rise(fn, device), "B", "measured",
                       source="torch.cuda.max_memory_allocated after reset_peak_memory_stats")
    running, peak = 0, 0
    for _, delta in _allocation_events(fn):
        running += delta
        peak = max(peak, running)
    return Reading(peak, "B", "measured", source="torch.profiler allocation events")


def _cuda_peak_rise(fn, device) -> int:
    with _gc_paused():  # collect first, then read the baseline
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - start


def live_bytes_after_forward(model: nn.Module, *inputs) -> Reading:
    """Bytes allocated during one ``model(*inputs)`` that are still allocated when it returns.

    The allocator's view of what a forward leaves behind: the saved activations plus the outputs
    nothing saved (compare with ``saved_tensors(...)``, whose ``total + output_only_bytes`` should be
    the same number). Taught in ``13_memory``.
    """
    _check_model(model)
    device = _device_of(model, inputs)
    reason = _no_allocator(device)
    if reason:
        return Reading.unavailable("B", reason)
    kept: list = []
    with _model_left_unchanged(model, include_parameters=False), torch.enable_grad():
        if device.type == "cuda":
            return _cuda_live_after(lambda: kept.append(_forward(model, inputs)), device)
        live: dict[int, int] = {}
        for ptr, delta in _allocation_events(lambda: kept.append(_forward(model, inputs))):
            if delta > 0:
                live[ptr] = delta
            else:
                live.pop(ptr, None)
    return Reading(sum(live.values()), "B", "measured", source="torch.profiler allocation events")


def _cuda_live_after(fn, device) -> Reading:
    with _gc_paused():  # collect first, then read the baseline
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        fn()
    torch.cuda.synchronize(device)
    return Reading(torch.cuda.memory_allocated(device) - start, "B", "measured",
                   source="torch.cuda.memory_allocated before and after")


def _state_rows(model, optimizer, inputs, device) -> list[tuple[str, Reading]]:
    groups = [("parameters", list(model.parameters())), ("buffers", list(model.buffers())),
              ("gradients", [p.grad for p in model.parameters() if p.grad is not None]),
              ("optimizer state", _optimizer_tensors(optimizer)), ("inputs", _tensors(inputs))]
    seen: set[int] = set()
    source = "storages alive at the start of step 2"
    return [(label, Reading(_unique_bytes(tensors, device, seen), "B", "measured", source=source))
            for label, tensors in groups]


def measure_step_peak(model: nn.Module, inputs, optimizer="adamw", loss_fn=None) -> MemoryReport:
    """The measured steady-state peak of one training step: the counterpart of
    :func:`estimate_step_peak`, on the model's device.

    Runs two real steps (the model's weights, buffers, grads and RNG are restored afterwards).
    Rows: what is alive when step 2 starts (counted from the live tensors), plus the allocator's
    highest rise during step 2 (profiler events on CPU, ``torch.cuda`` statistics on CUDA). On a
    device with no allocator to read, the rows say why instead of giving 0. Taught in ``13_memory``.
    """
    _check_model(model)
    inputs = _as_inputs(inputs)
    device = _device_of(model, inputs)
    make_optimizer = _optimizer_factory(model, optimizer, device)
    reason = _no_allocator(device)
    if reason:
        return MemoryReport("Step peak (measured)", (("step 2 peak", Reading.unavailable("B", reason)),))
    with _model_left_unchanged(model, include_parameters=True), torch.enable_grad():
        real_optimizer = make_optimizer(model.parameters())
        _train_step(model, real_optimizer, inputs, loss_fn)
        rows = _state_rows(model, real_optimizer, inputs, device)
        rise = peak_bytes_during(lambda: _train_step(model, real_optimizer, inputs, loss_fn), device)
    rows.append(("rise during step 2", rise))
    return MemoryReport("Step peak (measured)", tuple(rows))
