"""System monitor: real CPU/memory readings here, absent GPU keys without CUDA, the GPU paths with a fake
NVML and fake CUDA, and the optional-dependency errors."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from batchpilot.stats import SystemMonitor


def test_cpu_and_memory_readings():
    pytest.importorskip("psutil")
    import time

    from batchpilot.stats.system import MIN_CPU_SECONDS

    monitor = SystemMonitor()
    started = time.perf_counter()
    while time.perf_counter() - started < 4 * MIN_CPU_SECONDS:  # busy: at least this much CPU time passes
        sum(i * i for i in range(10_000))
    sample = monitor.sample()
    assert 0.0 <= sample["system/cpu_util"] <= 100.0
    assert sample["system/cpu_util"] > 20.0  # one of the cores was busy all along (0 would be the old bug)
    assert 0.0 < sample["system/mem_used_frac"] < 1.0
    if not torch.cuda.is_available():
        assert set(sample) == {"system/cpu_util", "system/mem_used_frac"}  # no made-up GPU numbers
        assert not monitor.gpu_available


def test_cpu_util_is_absent_until_enough_cpu_time_has_passed_and_then_measured_from_the_baseline():
    psutil = pytest.importorskip("psutil")
    import collections

    times = collections.namedtuple("times", "user system idle iowait")
    readings = iter([times(1.0, 0.0, 0.99, 0.01), times(1.02, 0.0, 1.0, 0.01), times(1.5, 0.0, 1.49, 0.01)])
    monitor = SystemMonitor()
    monitor._psutil = types.SimpleNamespace(cpu_times=lambda: next(readings), virtual_memory=psutil.virtual_memory)
    monitor._cpu_last = monitor._cpu_times()  # busy 1.0 of 2.0 s
    # 0.03 s of CPU time later (3 ticks): psutil.cpu_percent(None) would say 0.0 here; the monitor says nothing.
    assert "system/cpu_util" not in monitor.sample()
    # Measured from the kept baseline: 0.5 busy of 1.0 s.
    assert monitor.sample()["system/cpu_util"] == pytest.approx(50.0)


def test_missing_psutil_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)  # makes `import psutil` raise ImportError
    with pytest.raises(ImportError, match=r'pip install -e "\.\[system\]"'):
        SystemMonitor()


def test_importing_the_package_does_not_need_psutil_or_pynvml():
    code = (
        "import sys; sys.modules['psutil'] = None; sys.modules['pynvml'] = None\n"
        "import batchpilot, batchpilot.stats\n"
        "print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


# ------------------------------------------------------------------------------ fake CUDA and NVML
class FakeNVML(types.ModuleType):
    def __init__(self):
        super().__init__("pynvml")
        self.uuids = []

    def nvmlInit(self):
        self.live = getattr(self, "live", 0) + 1

    def nvmlShutdown(self):
        self.live -= 1

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.uuids.append(uuid)
        return ("handle", uuid)

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", index)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=37, memory=12)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=25, free=75, total=100)


@pytest.fixture
def fake_cuda(monkeypatch):
    pytest.importorskip("psutil")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=f"abcd-000{i}")
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (60, 100))
    return monkeypatch


def test_gpu_metrics_from_nvml(fake_cuda):
    nvml = FakeNVML()
    fake_cuda.setitem(sys.modules, "pynvml", nvml)
    sample = SystemMonitor(device="cuda:1").sample()
    assert nvml.uuids == ["GPU-abcd-0001"]  # torch's index mapped to NVML through the UUID
    assert sample["system/gpu_util"] == 37.0
    assert sample["system/gpu_mem_frac"] == 0.25  # no CUDA context yet: NVML's used / total


def test_closing_the_monitor_releases_nvml_and_a_later_sample_takes_it_again(fake_cuda):
    nvml = FakeNVML()
    fake_cuda.setitem(sys.modules, "pynvml", nvml)
    monitor = SystemMonitor(device="cuda:0")
    assert nvml.live == 1
    monitor.close()
    monitor.close()  # twice is fine
    assert nvml.live == 0
    assert monitor.sample()["system/gpu_util"] == 37.0 and nvml.live == 1


def test_gpu_memory_from_torch_once_cuda_is_initialised(fake_cuda):
    fake_cuda.setitem(sys.modules, "pynvml", FakeNVML())
    fake_cuda.setattr(torch.cuda, "is_initialized", lambda: True)
    assert SystemMonitor().sample()["system/gpu_mem_frac"] == pytest.approx(0.4)  # 1 - 60/100


def test_without_nvml_only_what_torch_can_tell(fake_cuda):
    fake_cuda.setitem(sys.modules, "pynvml", None)
    monitor = SystemMonitor()
    assert monitor.gpu_available
    assert "system/gpu_util" not in monitor.sample() and "system/gpu_mem_frac" not in monitor.sample()
    fake_cuda.setattr(torch.cuda, "is_initialized", lambda: True)
    sample = monitor.sample()
    assert "system/gpu_util" not in sample and sample["system/gpu_mem_frac"] == pytest.approx(0.4)


def test_cpu_device_reports_no_gpu(fake_cuda):
    fake_cuda.setitem(sys.modules, "pynvml", FakeNVML())
    monitor = SystemMonitor(device="cpu")
    assert not monitor.gpu_available
    assert not any(k.startswith("system/gpu") for k in monitor.sample())


def test_nvml_failure_means_absent_not_fake(fake_cuda):
    nvml = FakeNVML()

    def broken(handle):
        raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

    nvml.nvmlDeviceGetUtilizationRates = broken
    fake_cuda.setitem(sys.modules, "pynvml", nvml)
    sample = SystemMonitor().sample()
    assert "system/gpu_util" not in sample and sample["system/gpu_mem_frac"] == 0.25


def test_a_controller_reading_load_that_is_never_measured_is_warned_about(monkeypatch, caplog):
    import logging

    import batchpilot
    from batchpilot.controllers import ThresholdRules

    x = torch.randn(64, 4)
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())

    def build(**kwargs):
        model = torch.nn.Linear(4, 2)
        return batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=8,
                                progress=False, controller=ThresholdRules(util_source="cpu"), **kwargs)

    with caplog.at_level(logging.WARNING, logger="batchpilot"):
        build(system_every=None)
    assert "reads system/cpu_util, but system_every=None" in caplog.text
    caplog.clear()
    monkeypatch.setitem(sys.modules, "psutil", None)
    with caplog.at_level(logging.WARNING, logger="batchpilot"):
        build()
    assert "psutil is not installed" in caplog.text and 'pip install -e ".[system]"' in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="batchpilot"):
        model = torch.nn.Linear(4, 2)
        batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=8, progress=False)
    assert caplog.text == ""  # a run whose controller reads no load needs no psutil
    with caplog.at_level(logging.WARNING, logger="batchpilot"):
        model = torch.nn.Linear(4, 2)
        batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=8, progress=False,
                         controller=ThresholdRules(), system_every=None)  # util_source="gpu", on a CPU
    assert caplog.text == ""  # its GPU rule is skipped on a CPU by design: nothing to warn about
