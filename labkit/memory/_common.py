"""What every memory method shares: tensor and storage helpers, the model guards, one training step.

Private to `labkit.memory`; the public constants `OPTIMIZERS` and `TRAINING_PRECISIONS` are
re-exported there.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

from labkit._torch_compat import tree_flatten
from labkit.devices import resolve_device
from labkit.errors import LabkitError

__all__ = ["OPTIMIZERS", "TRAINING_PRECISIONS"]


# the optimizer names training_state, estimate_step_peak and measure_step_peak accept
OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw")
# the training precisions the analytic calculator accepts (labkit.probes' MATMUL_PRECISIONS are the
# matmul kernels' precisions, a different list)
TRAINING_PRECISIONS = ("fp32", "amp_bf16", "amp_fp16", "bf16", "fp16", "mixed_bf16", "mixed_fp16")

# CUDACachingAllocator hands out blocks in multiples of 512 bytes (kMinBlockSize).
_CUDA_BLOCK = 512
_ROOT = "(model)"
_OUTSIDE = "(outside any module)"


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
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if isinstance(tensor, (UninitializedParameter, UninitializedBuffer)):
            raise LabkitError(
                f"{type(model).__name__}.{name} is an uninitialised lazy parameter (a Lazy* module that "
                "has not run yet), so it has no shape to count: call the model once on a real input "
                "first, then measure it"
            )
        if tensor.is_inference():
            raise LabkitError(
                f"{type(model).__name__}.{name} was created under torch.inference_mode(), and autograd "
                "cannot train or save such tensors: build the model outside inference mode"
            )


def _check_inputs(inputs: Sequence) -> None:
    for tensor in _tensors(inputs):
        if tensor.is_inference():
            raise LabkitError(
                f"an input {_describe([tensor])} was created under torch.inference_mode(), and autograd "
                "cannot save it for backward: create it outside inference mode (or pass x.clone() made "
                "inside `with torch.inference_mode(False):`)"
            )


def _with_autograd(function: Callable) -> Callable:
    """Run a memory method with autograd recording, whatever mode its caller is in.

    Under ``torch.no_grad()`` ``torch.enable_grad()`` is enough, but ``torch.inference_mode()`` is
    not lifted by it: autograd would record nothing, and every count would be 0. Nested
    ``torch.inference_mode(False)`` lifts it, so the count is the same as outside."""

    @functools.wraps(function)
    def with_autograd(*args, **kwargs):
        with torch.inference_mode(False), torch.enable_grad():
            return function(*args, **kwargs)

    return with_autograd


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


def _check_optimizer_name(optimizer: str) -> None:
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZERS:
        raise LabkitError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")


def _check_precision(precision: str) -> None:
    if precision not in TRAINING_PRECISIONS:
        raise LabkitError(f"unknown precision {precision!r}: use one of {', '.join(TRAINING_PRECISIONS)}")


def _optional_device(device) -> torch.device | None:
    """The device to count for (None: the model's own), resolved by `labkit.devices.resolve_device`,
    with an index: tensors say ``cuda:0``, and ``cuda`` != ``cuda:0``. Even fake CUDA tensors need a
    CUDA build and driver (without them torch aborts the process), so a missing GPU is refused first."""
    if device is None:
        return None
    device = resolve_device(device, kinds=("cpu", "cuda"))
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _optimizer_factory(model: nn.Module, optimizer, device: torch.device) -> Callable:
    if not any(p.requires_grad for p in model.parameters()):
        raise LabkitError(f"{type(model).__name__} has no trainable parameters, so a training step has "
                          "nothing to update: use saved_tensors for the forward's activations instead")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise LabkitError(
            f"optimizer is a {type(optimizer).__name__} instance; the step runs on a copy of the model, so "
            f"pass a name ({', '.join(OPTIMIZERS)}) or a factory that builds it on the parameters it is "
            f"given, e.g. optimizer=lambda params: torch.optim.{type(optimizer).__name__}(params, lr=1e-3)"
        )
    if callable(optimizer):
        return functools.partial(_built_optimizer, optimizer)
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


def _built_optimizer(factory: Callable, params) -> torch.optim.Optimizer:
    """The optimizer a user's factory builds on ``params``, checked before any step runs."""
    params = list(params)
    built = factory(params)
    if not isinstance(built, torch.optim.Optimizer):
        raise LabkitError(
            f"the optimizer factory returned {type(built).__name__}, not a torch.optim.Optimizer: return "
            "the optimizer built on the parameters it is given, e.g. lambda params: torch.optim.SGD(params, lr=0.1)"
        )
    given = {id(p) for p in params}
    foreign = sum(id(p) not in given for group in built.param_groups for p in group["params"])
    if foreign:
        raise LabkitError(
            f"the optimizer factory built an optimizer holding {foreign} parameter(s) it was not given (another "
            "model's?): build it on the parameters passed in, e.g. lambda params: torch.optim.SGD(params, lr=0.1)"
        )
    return built


def _checked_loss(loss) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise LabkitError(f"loss_fn returned {type(loss).__name__}, not a tensor: return a scalar tensor "
                          "computed from the model's output, e.g. loss_fn=lambda out: out.sum()")
    if loss.numel() != 1:
        raise LabkitError(f"loss_fn returned a tensor of shape {tuple(loss.shape)}, and backward needs one "
                          "number: reduce it, e.g. loss_fn=lambda out: out.sum() or F.mse_loss(out, target)")
    if not loss.requires_grad:
        raise LabkitError("the loss does not depend on any trainable parameter (it has no grad_fn), so backward "
                          "has nothing to do: compute it from the model's output, e.g. loss_fn=lambda out: out.sum()")
    return loss


def _sum_first_output(output) -> torch.Tensor:
    tensors = _tensors(output)
    if not tensors:
        raise LabkitError("the model returned no tensor: pass loss_fn=... that turns its output into a scalar")
    return tensors[0].sum()


def _train_step(model, optimizer, inputs, loss_fn, phase=lambda name: None) -> None:
    phase("forward")
    loss = _checked_loss((loss_fn or _sum_first_output)(_forward(model, inputs)))
    phase("backward")
    loss.backward()
    phase("optimizer")
    optimizer.step()
    optimizer.zero_grad()


def _unique_bytes(tensors, device: torch.device, seen: set | None = None) -> int:
    seen = set() if seen is None else seen
    nbytes = 0
    for tensor in tensors:
        key = _storage_key(tensor)
        if tensor.device == device and key not in seen:
            seen.add(key)
            nbytes += _allocated_nbytes(tensor)
    return nbytes


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in _tensors(state)]
