"""The machine a run ran on: `fingerprint()` and `format_fingerprint()`, public as `labkit.probes.fingerprint`.

Python, torch, CUDA and cuDNN builds, the GPU and its driver, the CPU and the cores this process may
use, and torch's determinism flags, each with the reason when it cannot be had. Every notebook
prints it in an ignored cell, and `python -m labkit repro` stores it beside each run. Used in
`00_start_here`; both are declared in `labkit.probes`, their one spelling.
"""

from __future__ import annotations

import math
import os
import platform
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch

from labkit.errors import LabkitError

__all__: list[str] = []  # fingerprint and format_fingerprint are declared in labkit.probes

_FINGERPRINT_KEYS = ("python", "torch", "cuda", "cudnn", "gpu", "driver", "cpu", "flags", "unavailable")
_NEEDS_CUDA = "needs a CUDA device: torch.cuda.is_available() is False on this machine"


def fingerprint() -> dict:
    """Describe this machine and software in a JSON-serialisable dict, in well under a second.

    Keys: python, platform, torch, cuda (torch's CUDA build), cudnn, gpu (name, capability, memory,
    multiprocessors, count), driver, cpu (model, cores, torch threads), flags (determinism and TF32
    switches), and ``unavailable``: for every value that is None, the reason it could not be had.
    Used in `00_start_here`; `labkit.notebooks.stamp_notebook` stores it in an executed notebook's metadata.
    """
    fields = {"cuda": _cuda_build(), "cudnn": _cudnn_version(), "gpu": _gpu_identity(), "driver": _driver_version()}
    cpu = _cpu_identity()
    missing = {key: reason for key, (value, reason) in fields.items() if value is None}
    if cpu["physical_cores"] is None:
        missing["cpu.physical_cores"] = "psutil cannot count physical cores on this system"
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        **{key: value for key, (value, _) in fields.items()},
        "cpu": cpu,
        "flags": _determinism_flags(),
        "unavailable": missing,
    }


def format_fingerprint(fp: dict) -> str:
    """A compact multi-line text of a `fingerprint()` dict, as `00_start_here` prints it.

    The text differs from machine to machine, so a notebook prints it in a cell tagged
    ``nbval-ignore-output``.
    """
    if not isinstance(fp, dict) or any(key not in fp for key in _FINGERPRINT_KEYS):
        raise LabkitError(
            "format_fingerprint needs the dict that labkit.probes.fingerprint() returns: "
            "call format_fingerprint(fingerprint())"
        )
    missing = fp["unavailable"]
    cpu, flags = fp["cpu"], fp["flags"]
    lines = [
        f"python {fp['python']} · torch {fp['torch']} · CUDA {fp['cuda'] or '—'} · cuDNN {fp['cudnn'] or '—'}",
        f"gpu     {_describe_gpu(fp['gpu'], missing.get('gpu', ''))}",
        f"driver  {fp['driver'] or '— (' + missing.get('driver', '') + ')'}",
        f"cpu     {cpu['model']} · {cpu['usable_cores']} usable cores · torch threads {cpu['torch_threads']}"
        + (" (more threads than cores)" if cpu["oversubscribed"] else ""),
        "flags   deterministic algorithms {deterministic_algorithms} · cudnn.deterministic "
        "{cudnn_deterministic} · cudnn.benchmark {cudnn_benchmark} · float32 matmul precision "
        "{float32_matmul_precision} · TF32 matmul {cuda_matmul_allow_tf32}".format(**flags),
    ]
    return "\n".join(lines)


def _describe_gpu(gpu: dict | None, reason: str) -> str:
    if gpu is None:
        return f"— ({reason})"
    memory_gib = gpu["memory_bytes"] / 2**30
    return (
        f"{gpu['name']} · capability {gpu['capability']} · {memory_gib:.0f} GiB · "
        f"{gpu['multiprocessors']} SMs · {gpu['count']} visible"
    )


def _cuda_build() -> tuple[str | None, str]:
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is built without CUDA"
    return torch.version.cuda, ""


def _cudnn_version() -> tuple[int | None, str]:
    version = torch.backends.cudnn.version()
    if version is None:
        return None, f"torch {torch.__version__} has no cuDNN"
    return version, ""


def _gpu_identity() -> tuple[dict | None, str]:
    if not torch.cuda.is_available():
        return None, _NEEDS_CUDA
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "index": index,
        "count": torch.cuda.device_count(),
        "memory_bytes": props.total_memory,
        "multiprocessors": props.multi_processor_count,
    }, ""


def _driver_version() -> tuple[str | None, str]:
    with _nvml() as (pynvml, reason):
        if pynvml is None:
            return None, reason
        version = pynvml.nvmlSystemGetDriverVersion()
        # nvidia-ml-py before 11.5 returns bytes; the fingerprint must stay plain JSON.
        return (version.decode() if isinstance(version, bytes) else version), ""


@contextmanager
def _nvml():
    """Yield (pynvml, "") with NVML initialised, or (None, reason) where NVML cannot start."""
    try:
        import pynvml
    except ImportError:
        yield None, "needs an NVIDIA driver: nvidia-ml-py (pynvml) is not installed"
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        yield None, f"needs an NVIDIA driver: NVML did not start ({err})"
        return
    try:
        yield pynvml, ""
    finally:
        pynvml.nvmlShutdown()


def _cpu_identity() -> dict:
    usable = _usable_cores()
    threads = torch.get_num_threads()
    return {
        "model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cores": usable,
        "torch_threads": threads,
        "interop_threads": torch.get_num_interop_threads(),
        "oversubscribed": threads > usable,
    }


def _cpu_model() -> str:
    # /proc/cpuinfo names the model on Linux x86; platform.processor() is often empty there.
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""  # not Linux: the platform module is all there is
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _usable_cores() -> int:
    """Cores this process may really use: affinity, physical cores and a cgroup v2 quota, whichever is least."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    limits = [affinity, psutil.cpu_count(logical=False) or affinity]
    quota = _cgroup_cpu_quota()
    if quota is not None:
        limits.append(max(1, math.floor(quota)))
    return min(limits)


def _cgroup_cpu_quota() -> float | None:
    """CPUs granted by a cgroup v2 quota ("max 100000" means no quota), or None."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _determinism_flags() -> dict:
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", "unset"),
    }
