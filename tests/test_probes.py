"""labkit.probes: provenance is never a silent zero, CPU fallbacks, the timer, the benchmark, the GPU runner.

CPU tests use small buffers and short timing windows so the file runs in seconds; the tests marked
`gpu` run on a CUDA machine through `.ci/gpu-runner` (`make test-gpu`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from labkit import _version, probes
from labkit.errors import LabkitError
from labkit.probes import _datasheets, _throughput
from labkit.readings import Reading, UnavailableReading

REPO = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
cpu_machine_only = pytest.mark.skipif(HAS_CUDA, reason="checks the behaviour without CUDA; this machine has CUDA")
QUICK = {"warmup": 1, "min_run_time": 0.02}  # enough to exercise a probe, not to trust its number
NEEDS_CUDA = "needs a CUDA device"


def _none_paths(tree: dict, prefix: str = "") -> set[str]:
    """Dotted paths of every None value in a nested dict."""
    paths = set()
    for key, value in tree.items():
        if isinstance(value, dict):
            paths |= _none_paths(value, f"{prefix}{key}.")
        elif value is None:
            paths.add(f"{prefix}{key}")
    return paths


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("benchmark_probes", REPO / "benchmarks" / "probes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------ fingerprint


def test_fingerprint_is_fast_plain_json_and_explains_every_missing_value():
    if HAS_CUDA:
        torch.cuda.init()  # CUDA's one-time start-up is the driver's cost, not the fingerprint's
    start = time.perf_counter()
    fp = probes.fingerprint()
    assert time.perf_counter() - start < 1.0
    assert json.loads(json.dumps(fp)) == fp
    missing = {key: value for key, value in fp.items() if key != "unavailable"}
    assert _none_paths(missing) == set(fp["unavailable"])
    assert all(reason for reason in fp["unavailable"].values())
    assert fp["torch"] == torch.__version__
    assert fp["cpu"]["torch_threads"] == torch.get_num_threads()


@cpu_machine_only
def test_fingerprint_on_a_cpu_machine_says_why_there_is_no_gpu():
    fp = probes.fingerprint()
    assert fp["gpu"] is None
    assert fp["unavailable"]["gpu"].startswith(NEEDS_CUDA)


def test_fingerprint_records_the_flags_in_force(monkeypatch):
    # cudnn's flags and the matmul precision are cheap to flip; use_deterministic_algorithms costs seconds.
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        flags = probes.fingerprint()["flags"]
    finally:
        torch.set_float32_matmul_precision(precision)
    assert flags["float32_matmul_precision"] == "high"
    assert flags["cuda_matmul_allow_tf32"] is True
    assert flags["cudnn_benchmark"] is True
    assert flags["cudnn_deterministic"] is True
    assert flags["deterministic_algorithms"] is torch.are_deterministic_algorithms_enabled()


def test_format_fingerprint_is_compact_and_names_the_stack():
    fp = probes.fingerprint()
    text = probes.format_fingerprint(fp)
    assert len(text.splitlines()) == 5
    assert f"torch {torch.__version__}" in text
    assert f"python {fp['python']}" in text
    if not HAS_CUDA:
        assert NEEDS_CUDA in text
    with pytest.raises(LabkitError, match="fingerprint\\(\\)"):
        probes.format_fingerprint({"torch": "2.13.0"})


# ------------------------------------------------------------------------------------------ timer


def test_timer_agrees_with_a_wall_clock_on_a_sleep():
    start = time.perf_counter()
    time.sleep(0.03)
    wall = time.perf_counter() - start
    timing = probes.measure_time(lambda: time.sleep(0.03), device="cpu", warmup=1, min_run_time=0.15)
    assert timing.samples >= 5
    assert 0.03 <= timing.median_s < 0.045
    assert abs(timing.median_s - wall) < 0.015
    assert "wall clock" in timing.method


def test_timer_tops_up_a_slow_call_to_five_samples():
    timing = probes.measure_time(lambda: time.sleep(0.04), device="cpu", warmup=0, min_run_time=0.01)
    assert timing.samples == 5
    assert 0 <= timing.spread < 0.5


def test_timer_rejects_bad_arguments():
    with pytest.raises(LabkitError, match="function"):
        probes.measure_time(42)
    with pytest.raises(LabkitError, match="warmup"):
        probes.measure_time(lambda: None, warmup=-1)
    with pytest.raises(LabkitError, match="min_run_time"):
        probes.measure_time(lambda: None, min_run_time=0)


@cpu_machine_only
def test_timer_on_cuda_without_cuda_says_so():
    with pytest.raises(LabkitError, match=NEEDS_CUDA):
        probes.measure_time(lambda: None, device="cuda")


# ------------------------------------------------------------------------------------------ probes on a CPU


def test_copy_bandwidth_counts_bytes_read_and_written(monkeypatch):
    calls = []

    def fixed_timing(fn, **_):
        calls.append(fn())  # the probe's copy must run
        return probes.Timing(0.001, 0.0, 5, "fixed")

    monkeypatch.setattr(_throughput, "measure_time", fixed_timing)
    reading = probes.copy_bandwidth("cpu", size_mib=1)
    assert calls, "the copy was never timed"
    assert reading.value == pytest.approx(2 * 2**20 / 0.001 / 1e9)
    assert reading.unit == "GB/s"


def test_matmul_counts_two_n_cubed_flop_and_runs_fp32_without_tf32(monkeypatch):
    seen = []

    def fixed_timing(fn, **_):
        fn()
        seen.append(torch.get_float32_matmul_precision())
        return probes.Timing(0.002, 0.0, 5, "fixed")

    monkeypatch.setattr(_throughput, "measure_time", fixed_timing)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        reading = probes.matmul_throughput("fp32", "cpu", n=64)
        after = torch.get_float32_matmul_precision()
    finally:
        torch.set_float32_matmul_precision(before)
    assert reading.value == pytest.approx(2 * 64**3 / 0.002 / 1e9)
    assert seen == ["highest"]
    assert after == "medium"


@pytest.fixture
def one_thread():
    """One torch thread for a probe and its reference: on a busy shared runner, several threads wait on
    each other's cores and the two numbers drift apart for reasons neither measures."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_rate(work: float, operation, calls: int = 10, samples: int = 15) -> float:
    """``work`` per second of ``operation``, timed here with perf_counter (median of ``samples`` batches of
    ``calls``): an independent reference for a probe's number. Timed before and after the probe, the two
    bracket the machine's load; the probe must fall within 3x of them (a wrong unit, or n² for n³ FLOP, would not)."""
    operation()
    batches = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls):
            operation()
        batches.append((time.perf_counter() - start) / calls)
    return work / sorted(batches)[samples // 2]


def test_copy_bandwidth_on_a_cpu_is_measured_in_gb_per_s(one_thread):
    src = torch.rand(8 * 2**20 // 4)
    dst = torch.empty_like(src)
    before = reference_rate(2 * src.nbytes / 1e9, lambda: dst.copy_(src))
    reading = probes.copy_bandwidth("cpu", size_mib=8, warmup=1, min_run_time=0.1)
    after = reference_rate(2 * src.nbytes / 1e9, lambda: dst.copy_(src))
    assert reading.provenance == "measured"
    assert reading.unit == "GB/s"
    assert min(before, after) / 3 < reading.value < max(before, after) * 3, (reading.value, before, after)
    assert "read + written" in reading.source


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", torch.float32])
def test_matmul_throughput_on_a_cpu_is_measured_in_gflop_per_s(precision, one_thread):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, precision)
    a, b = torch.rand(64, 64, dtype=dtype), torch.rand(64, 64, dtype=dtype)
    before = reference_rate(2 * 64**3 / 1e9, lambda: torch.mm(a, b))
    reading = probes.matmul_throughput(precision, "cpu", n=64, warmup=1, min_run_time=0.1)
    after = reference_rate(2 * 64**3 / 1e9, lambda: torch.mm(a, b))
    assert reading.provenance == "measured"
    assert reading.unit == "GFLOP/s"
    assert min(before, after) / 3 < reading.value < max(before, after) * 3, (reading.value, before, after)


def test_tf32_on_a_cpu_is_unavailable_with_the_reason():
    reading = probes.matmul_throughput("tf32", "cpu")
    assert reading.value is None
    assert reading.reason.startswith(NEEDS_CUDA)
    with pytest.raises(UnavailableReading):
        float(reading)


@cpu_machine_only
@pytest.mark.parametrize("probe", [
    lambda: probes.copy_bandwidth("cuda"),
    lambda: probes.matmul_throughput("bf16", "cuda"),
    lambda: probes.peak_memory(),
    lambda: probes.peak_memory("cuda"),
    lambda: probes.ceiling("copy", "cuda"),
], ids=["copy", "matmul", "peak_memory", "peak_memory_cuda", "ceiling"])
def test_gpu_only_probes_say_they_need_a_cuda_device(probe):
    reading = probe()
    assert reading.value is None
    assert reading.reason.startswith(NEEDS_CUDA)


def test_bad_probe_arguments_name_the_fix():
    with pytest.raises(LabkitError, match="fp32, tf32, bf16, fp16"):
        probes.matmul_throughput("fp8")
    with pytest.raises(LabkitError, match="fp32, tf32, bf16, fp16"):
        probes.matmul_throughput(torch.int8)
    with pytest.raises(LabkitError, match="size_mib"):
        probes.copy_bandwidth("cpu", size_mib=0)
    with pytest.raises(LabkitError, match="n must be"):
        probes.matmul_throughput("fp32", "cpu", n=0)
    with pytest.raises(LabkitError, match="'auto', 'cpu', 'cuda' or 'cuda:N'"):
        probes.copy_bandwidth("tpu")
    with pytest.raises(LabkitError, match="not supported here: use 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        probes.peak_memory("mps")
    with pytest.raises(LabkitError, match="'copy'"):
        probes.ceiling("int4")


def test_no_cpu_probe_returns_a_silent_zero():
    readings = {
        **{f"fact {key}": reading for key, reading in probes.device_facts("cpu").items()},
        **{f"ceiling {kind}": probes.ceiling(kind, "cpu") for kind in ("copy", *probes.MATMUL_PRECISIONS)},
        "peak_memory": probes.peak_memory("cpu"),
        "copy": probes.copy_bandwidth("cpu", size_mib=4, **QUICK),
        "matmul": probes.matmul_throughput("fp32", "cpu", n=64, **QUICK),
        "tf32": probes.matmul_throughput("tf32", "cpu"),
    }
    for name, reading in readings.items():
        assert isinstance(reading, Reading), name
        if reading.available:
            assert reading.value > 0, name
        else:
            assert reading.value is None and reading.reason, name


def test_device_facts_on_a_cpu():
    facts = probes.device_facts("cpu")
    assert facts["memory"].value == psutil.virtual_memory().total
    assert facts["multiprocessors"].reason.startswith(NEEDS_CUDA)
    cache = facts["last_level_cache"]
    if cache.available:  # a CPU's highest cache level: 64 KiB to 4 GiB, read from sysfs
        assert cache.provenance == "measured" and 2**16 <= cache.value <= 2**32 and cache.source.startswith("L")
    else:
        assert cache.reason.startswith("this OS exposes no readable cache sizes")
    assert not facts["bandwidth_theoretical"].available


def test_oversubscribed_threads_warn_and_show_in_the_fingerprint():
    threads = torch.get_num_threads()
    cores = probes.fingerprint()["cpu"]["usable_cores"]
    torch.set_num_threads(cores + 1)
    try:
        with pytest.warns(probes.OversubscribedWarning, match=f"set_num_threads\\({cores}\\)"):
            reading = probes.copy_bandwidth("cpu", size_mib=4, **QUICK)
        oversubscribed = probes.fingerprint()["cpu"]["oversubscribed"]
    finally:
        torch.set_num_threads(threads)
    assert "oversubscribed" in reading.source
    assert oversubscribed is True


# ------------------------------------------------------------------------------------------ ceilings


@pytest.mark.parametrize("device_name, model", [
    ("NVIDIA H200", "NVIDIA H200 SXM"),
    ("NVIDIA H200 NVL", "NVIDIA H200 NVL"),
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"),
    ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe"),
    ("NVIDIA H100 NVL", "NVIDIA H100 NVL"),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 SXM 80GB"),
    ("NVIDIA A100-SXM-80GB", "NVIDIA A100 SXM 80GB"),
    ("NVIDIA A100 80GB PCIe", "NVIDIA A100 PCIe 80GB"),
    ("NVIDIA A100-SXM4-40GB", "NVIDIA A100 40GB"),
    ("NVIDIA L40S", "NVIDIA L40S"),
    ("NVIDIA A10", "NVIDIA A10"),
    ("NVIDIA L4", "NVIDIA L4"),
    ("Tesla T4", "NVIDIA T4"),
    ("Tesla V100-SXM2-32GB", "NVIDIA V100 SXM2"),
    ("Tesla V100-PCIE-16GB", "NVIDIA V100 PCIe"),
    ("NVIDIA GH200 480GB", None),
    ("NVIDIA A10G", None),
    ("NVIDIA GeForce GT 710", None),
])
def test_datasheet_lookup_by_device_name(device_name, model):
    sheet = probes.datasheet_for(device_name)
    assert (sheet.model if sheet else None) == model


def test_every_datasheet_entry_is_reachable_and_sourced():
    reached = {probes.datasheet_for(name).model for name in (
        "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL",
        "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-40GB", "NVIDIA L40S",
        "NVIDIA A10", "NVIDIA L4", "Tesla T4", "Tesla V100-SXM2-16GB", "Tesla V100-PCIE-32GB")}
    assert reached == {sheet.model for sheet in probes.DATASHEETS}
    for sheet in probes.DATASHEETS:
        assert sheet.source and sheet.bandwidth_tb_s > 0 and sheet.tflops["fp32"] > 0
        assert sheet.tflops["fp16"] > sheet.tflops["fp32"]  # tensor cores beat plain fp32 on every listed GPU
        if sheet.tflops["tf32"] is not None:  # half the bf16 rate; the L40S sheet rounds 181 up to 183
            assert sheet.tflops["tf32"] == pytest.approx(sheet.tflops["bf16"] / 2, rel=0.02)


def test_datasheet_ceilings_carry_provenance_and_say_what_is_missing():
    copy = probes.datasheet_ceiling("copy", "NVIDIA H200")
    assert (copy.value, copy.unit, copy.provenance) == (4.8, "TB/s", "datasheet")
    assert "H200" in copy.source
    bf16 = probes.datasheet_ceiling("bf16", "NVIDIA H200")
    assert (bf16.value, bf16.unit) == (989.5, "TFLOP/s")
    assert "lists no dense bf16" in probes.datasheet_ceiling("bf16", "Tesla T4").reason
    assert "DATASHEETS" in probes.datasheet_ceiling("copy", "NVIDIA GeForce GT 710").reason


def test_theoretical_bandwidth_from_the_reported_memory_clock_and_bus():
    # An H100 SXM reports a 2619 MHz memory clock on a 5120-bit bus: 3.35 TB/s, its datasheet figure.
    h100 = SimpleNamespace(memory_clock_rate=2_619_000, memory_bus_width=5120)
    reading = _datasheets._theoretical_bandwidth(h100)
    assert reading.provenance == "estimated"
    assert reading.value == pytest.approx(3.352, rel=1e-3)
    silent = SimpleNamespace(memory_clock_rate=0, memory_bus_width=5120)
    assert _datasheets._theoretical_bandwidth(silent).reason


def test_fraction_of_ceiling_converts_units_and_passes_on_reasons():
    ceiling = probes.datasheet_ceiling("copy", "NVIDIA H200")
    in_tb = probes.fraction_of_ceiling(Reading(4.3, "TB/s", "measured"), ceiling)
    in_gb = probes.fraction_of_ceiling(Reading(4300.0, "GB/s", "measured"), ceiling)
    assert in_tb.value == pytest.approx(89.583, rel=1e-4)
    assert in_gb.value == pytest.approx(in_tb.value)
    assert (in_tb.unit, in_tb.provenance) == ("%", "estimated")
    no_ceiling = probes.fraction_of_ceiling(Reading(40.0, "GB/s", "measured"), probes.ceiling("copy", "cpu"))
    assert no_ceiling.reason.startswith("no ceiling: no ceiling for a CPU")
    with pytest.raises(LabkitError, match="cannot compare"):
        probes.fraction_of_ceiling(Reading(40.0, "GB/s", "measured"), Reading(1.0, "TFLOP/s", "datasheet"))
    with pytest.raises(LabkitError, match="two Readings"):
        probes.fraction_of_ceiling(4.3, ceiling)


# ------------------------------------------------------------------------------------------ utilisation


def test_utilisation_sampler_on_a_cpu_sees_a_busy_loop():
    with probes.UtilisationSampler("cpu", interval_s=0.05) as sampler:
        with pytest.raises(LabkitError, match="after its with-block"):
            sampler.mean()
        end = time.perf_counter() + 0.4
        while time.perf_counter() < end:
            pass
    reading = sampler.mean()
    assert reading.provenance == "measured"
    assert len(sampler.samples) >= 3
    assert reading.value > 5  # one busy thread is half of two cores, less when others share them
    with pytest.raises(LabkitError, match="interval_s"):
        probes.UtilisationSampler("cpu", interval_s=0)


@cpu_machine_only
def test_utilisation_sampler_on_cuda_without_cuda_says_so():
    with probes.UtilisationSampler("cuda") as sampler:
        time.sleep(0.01)
    assert sampler.mean().reason.startswith(NEEDS_CUDA)


# ------------------------------------------------------------------------------------------ benchmark


def test_benchmark_prints_achieved_against_ceiling_and_compares_runs(tmp_path, capsys):
    bench = _load_benchmark()
    first = tmp_path / "first.json"
    small = ["--device", "cpu", "--size-mib", "4", "--n", "64", "--min-run-time", "0.02"]
    assert bench.main([*small, "--runs", "2", "--json", str(first)]) == 0
    printed = capsys.readouterr().out
    assert "| copy |" in printed and "GB/s" in printed
    assert "load average" in printed
    rows = {row["probe"]: row for row in json.loads(first.read_text())["rows"]}
    assert set(rows) == {"copy", *probes.MATMUL_PRECISIONS}
    assert len(rows["copy"]["values"]) == 2 and rows["copy"]["spread_pct"] is not None
    assert rows["tf32"]["reason"].startswith(NEEDS_CUDA)
    assert bench.main([*small, "--runs", "1", "--compare", str(first)]) == 0
    printed = capsys.readouterr().out
    assert "copy change from first.json" in printed
    assert "— (one run)" in printed


def test_benchmark_checks_the_h200_targets_only_on_gpu_rows():
    bench = _load_benchmark()
    h200 = {"gpu": {"name": "NVIDIA H200"}}
    rows = [
        {"probe": "copy", "unit": "TB/s", "fraction_pct": 89.6, "spread_pct": 1.0},
        {"probe": "bf16", "unit": "TFLOP/s", "fraction_pct": 70.0, "spread_pct": 3.0},
    ]
    lines = bench.check_targets(rows, h200)
    assert "copy ≥ 85 % of ceiling: 89.6 % — met" in lines
    assert "bf16 ≥ 75 % of ceiling: 70.0 % — MISSED" in lines
    assert "bf16 run-to-run spread ≤ 2 %: 3.0 % — MISSED" in lines
    cpu_rows = [{"probe": "copy", "unit": "GB/s", "fraction_pct": None, "spread_pct": 1.0}]
    assert bench.check_targets(cpu_rows, h200) == []


# ------------------------------------------------------------------------------------------ GPU runner


# The runner's own logic (.ci/gpu-runner's stages and report), the same on every stack: make test-compat
# leaves these out (lock_only); the dry run costs a pytest, a benchmark and an nbval start.
@cpu_machine_only
@pytest.mark.lock_only
def test_gpu_runner_skips_cleanly_without_cuda(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "GPU_RUNNER_PYTHON": sys.executable}
    result = subprocess.run(["bash", ".ci/gpu-runner"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"SKIPPED: {NEEDS_CUDA}" in result.stdout
    assert not out.exists()
    wrong = subprocess.run(["bash", ".ci/gpu-runner", "bogus"], cwd=REPO, capture_output=True, text=True)
    assert wrong.returncode == 2 and "usage" in wrong.stderr


# torch claims a CUDA device it lacks: the runner takes its CUDA path on a CPU machine
FAKE_CUDA = "import torch\ntorch.cuda.is_available = lambda: True\n"


@cpu_machine_only
@pytest.mark.lock_only
def test_gpu_runner_runs_and_reports_every_stage_where_torch_claims_cuda(tmp_path):
    # The runner's CUDA path, dry: with no device behind the claim every stage fails quickly, and each
    # must still run, in order, within its limit, and be reported; a GPU session is too short to debug
    # the runner in.
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "sitecustomize.py").write_text(FAKE_CUDA)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "GPU_RUNNER_PYTHON": sys.executable, "TMPDIR": str(tmp_path),
           "PYTHONPATH": str(tmp_path / "fake"), "NOTEBOOKS": "01"}
    result = subprocess.run(["bash", ".ci/gpu-runner"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    report = (out / "gpu_runner.md").read_text()
    assert report.splitlines()[2].endswith(f" with {_version.describe()}."), "the report names the code it ran"
    table = report.split("| --- | --- | --- |\n", 1)[1].split("\n\n", 1)[0]
    rows = [row.strip("| ").split(" | ") for row in table.splitlines()]
    assert [row[0] for row in rows] == ["fingerprint", "GPU-marked tests (pytest -m gpu)",
                                        "probe benchmark (benchmarks/probes.py)", "nbval 01_computation_graph.ipynb"]
    assert all(exit_code == "1" for _, exit_code, _ in rows), rows
    assert "failed" in rows[1][2] and "failed" in rows[3][2], rows
    # the fingerprint failed on the missing device (how torch words it depends on its build): no file
    # left behind for the report to show as a fingerprint
    assert not (out / "fingerprint.json").exists()
    assert "(not written: see fingerprint.log)" in report
    assert "Traceback" in (out / "fingerprint.log").read_text()
    # nbval's run appends what the notebook recorded, under the notebook's name, and the report lists its verdicts
    logged = [json.loads(line) for line in (out / "gpu_records.jsonl").read_text().splitlines()]
    assert logged[0] == {"mime": "notebook", "notebook": "01_computation_graph.ipynb"}
    verdicts = [record for record in logged if record["mime"].endswith("claim+json")]
    assert verdicts, "01 records verdicts in its cells that need no device"
    assert f"| 01_computation_graph.ipynb | {verdicts[0]['id']} | {verdicts[0]['verdict']} |" in report


# ------------------------------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
def test_gpu_timer_agrees_with_a_wall_clock():
    timing = probes.measure_time(lambda: time.sleep(0.02), device="cuda", warmup=1, min_run_time=0.1)
    assert timing.method == "CUDA events"
    assert 0.0195 <= timing.median_s < 0.03
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    events = probes.measure_time(lambda: a @ a, device="cuda", min_run_time=0.2)
    # torch.utils.benchmark's clock synchronises CUDA, so the CPU path is a synchronised wall clock here.
    wall = probes.measure_time(lambda: a @ a, device="cpu", min_run_time=0.2)
    assert events.median_s == pytest.approx(wall.median_s, rel=0.15)


@pytest.mark.gpu
def test_gpu_copy_bandwidth_is_measured_against_its_ceiling():
    reading = probes.copy_bandwidth("cuda", size_mib=1024, min_run_time=0.2)
    assert (reading.unit, reading.provenance) == ("TB/s", "measured")
    fraction = probes.fraction_of_ceiling(reading, probes.ceiling("copy", "cuda"))
    assert 20 < fraction.value < 105, fraction.source


@pytest.mark.gpu
def test_gpu_matmul_precisions_are_measured_and_bf16_beats_fp32():
    before = torch.get_float32_matmul_precision()
    readings = {p: probes.matmul_throughput(p, "cuda", n=4096, min_run_time=0.2) for p in probes.MATMUL_PRECISIONS}
    assert torch.get_float32_matmul_precision() == before
    assert readings["fp32"].provenance == "measured" and readings["fp32"].unit == "TFLOP/s"
    for reading in readings.values():
        assert reading.provenance == "measured" or reading.reason
    if readings["bf16"].available:
        assert readings["bf16"].value > 2 * readings["fp32"].value


@pytest.mark.gpu
def test_gpu_peak_memory_sees_an_allocation():
    torch.cuda.reset_peak_memory_stats()
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    reading = probes.peak_memory("cuda")
    assert reading.provenance == "measured"
    assert reading.value >= block.nbytes


@pytest.mark.gpu
def test_gpu_device_facts_and_fingerprint_describe_the_device():
    facts = probes.device_facts("cuda")
    props = torch.cuda.get_device_properties(0)
    assert facts["multiprocessors"].value == props.multi_processor_count
    assert facts["last_level_cache"].value > 0
    theoretical, sheet = facts["bandwidth_theoretical"], facts["bandwidth_datasheet"]
    if theoretical.available and sheet.available:
        assert theoretical.value == pytest.approx(sheet.value, rel=0.25)
    fp = probes.fingerprint()
    assert fp["gpu"]["name"] == props.name
    assert fp["driver"] or fp["unavailable"]["driver"]


@pytest.mark.gpu
def test_gpu_utilisation_sampler_sees_kernels_running():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with probes.UtilisationSampler("cuda", interval_s=0.05) as sampler:
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end:
            a @ a
            torch.cuda.synchronize()
    reading = sampler.mean()
    assert reading.provenance == "measured", reading.reason
    assert reading.value > 20
