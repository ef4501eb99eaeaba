"""System metrics for controllers that look at the machine (seed 000's "GPU utilisation < 70% -> grow").

:class:`SystemMonitor` reads, without blocking:

* ``system/cpu_util``: system-wide CPU utilisation in percent (0..100) since the previous reading, from
  ``psutil.cpu_times()`` deltas kept by the monitor itself (its own baseline, taken when it is built, in
  any thread). Absent from a sample taken less than ``MIN_CPU_SECONDS`` of CPU time (summed over cores)
  after the previous reading: the counters advance in clock ticks (10 ms), so a shorter interval would read
  0 or 100, which ``psutil.cpu_percent(None)`` reports as ``0.0``;
* ``system/mem_used_frac``: ``(total - available) / total`` of the host's memory (psutil);
* ``system/gpu_util``: percent of the last sample period in which the GPU ran a kernel (NVML, from the
  optional ``nvidia-ml-py`` package: ``pip install -e ".[gpu]"``);
* ``system/gpu_mem_frac``: used fraction of the GPU's memory, all processes included
  (``torch.cuda.mem_get_info`` once this process has a CUDA context, else NVML).

A metric that cannot be measured here is absent from the result, never a made-up number: no GPU keys
without CUDA, no ``system/gpu_util`` without ``nvidia-ml-py``. psutil itself is an optional extra
(``batchpilot[system]``): importing batchpilot never needs it, building a monitor does.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .._extras import install_hint

__all__ = ["MIN_CPU_SECONDS", "SystemMonitor"]

MIN_CPU_SECONDS = 0.05
"""Least CPU time (seconds, summed over cores) between two ``system/cpu_util`` readings: 5 clock ticks."""

logger = logging.getLogger("batchpilot")


class SystemMonitor:
    """Cheap, non-blocking samples of CPU, memory and (when present) GPU load.

    Args:
        device: The CUDA device to report on (index, ``"cuda:1"`` or ``torch.device``); default: the current
            CUDA device when CUDA is available. A non-CUDA device (``"cpu"``) or no CUDA: no GPU metrics.

    Raises:
        ImportError: psutil is not installed (``pip install -e ".[system]"``).
    """

    def __init__(self, device: int | str | torch.device | None = None) -> None:
        try:
            import psutil
        except ImportError as err:
            raise ImportError(
                f"SystemMonitor needs psutil, which is not installed: {install_hint('system')} or pip install psutil."
            ) from err
        self._psutil = psutil
        self._cpu_last = self._cpu_times()  # the baseline of the first reading
        self._cuda_index: int | None = None
        self._nvml: Any = None
        self._nvml_handle: Any = None
        self._closed = False
        dev = None if device is None else torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if torch.cuda.is_available() and (dev is None or dev.type == "cuda"):
            index = torch.cuda.current_device() if dev is None or dev.index is None else dev.index
            self._cuda_index = index
            self._nvml, self._nvml_handle = _nvml_handle(index)

    @property
    def has_nvml(self) -> bool:
        """Whether GPU utilisation can be read (nvidia-ml-py found the training GPU)."""
        return self._nvml_handle is not None

    @property
    def gpu_available(self) -> bool:
        """Whether GPU metrics are reported (CUDA is available)."""
        return self._cuda_index is not None

    def sample(self) -> dict[str, float]:
        """The current readings under their ``system/...`` names (see the module docstring)."""
        psutil = self._psutil
        mem = psutil.virtual_memory()
        out = {"system/mem_used_frac": float((mem.total - mem.available) / mem.total)}
        cpu = self._cpu_util()
        if cpu is not None:
            out["system/cpu_util"] = cpu
        if self._cuda_index is None:
            return out
        if self._closed:  # sampled again after close(): NVML is initialised again
            self._nvml, self._nvml_handle = _nvml_handle(self._cuda_index)
            self._closed = False
        if self._nvml_handle is not None:
            try:
                out["system/gpu_util"] = float(self._nvml.nvmlDeviceGetUtilizationRates(self._nvml_handle).gpu)
            except Exception as err:  # NVML errors are their own exception class; a missing reading is absent
                logger.debug("NVML utilisation query failed: %s", err)
        mem_frac = self._gpu_mem_frac()
        if mem_frac is not None:
            out["system/gpu_mem_frac"] = mem_frac
        return out

    def _cpu_times(self) -> tuple[float, float]:
        """``(busy, total)`` CPU seconds over all cores since boot, as psutil counts them (guest time is part of
        user time on Linux, and iowait is idle)."""
        t = self._psutil.cpu_times()
        total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        idle = t.idle + getattr(t, "iowait", 0.0)
        return total - idle, total

    def _cpu_util(self) -> float | None:
        """Percent busy since the previous reading; ``None`` (and the baseline kept) while less than
        ``MIN_CPU_SECONDS`` have passed."""
        busy, total = self._cpu_times()
        last_busy, last_total = self._cpu_last
        if total - last_total < MIN_CPU_SECONDS:
            return None
        self._cpu_last = (busy, total)
        return float(min(max(100.0 * (busy - last_busy) / (total - last_total), 0.0), 100.0))

    def close(self) -> None:
        """Release NVML (``nvmlShutdown``, paired with the ``nvmlInit`` of this monitor); a later
        :meth:`sample` initialises it again."""
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception as err:
                logger.debug("NVML shutdown failed: %s", err)
            self._nvml, self._nvml_handle = None, None
            self._closed = True

    def _gpu_mem_frac(self) -> float | None:
        # mem_get_info needs a CUDA context; creating one just to read memory would itself use memory,
        # so without one (a CPU run on a GPU machine) ask NVML instead.
        if torch.cuda.is_initialized():
            free, total = torch.cuda.mem_get_info(self._cuda_index)
            return float(1.0 - free / total) if total else None
        if self._nvml_handle is not None:
            try:
                info = self._nvml.nvmlDeviceGetMemoryInfo(self._nvml_handle)
                return float(info.used / info.total) if info.total else None
            except Exception as err:
                logger.debug("NVML memory query failed: %s", err)
        return None


def _nvml_handle(index: int) -> tuple[Any, Any]:
    """``(pynvml, handle)`` for torch's CUDA device ``index``, or ``(None, None)`` without NVML.

    torch numbers devices after ``CUDA_VISIBLE_DEVICES``; NVML sees all of them. The device UUID maps one
    to the other; the index is used only when torch cannot report the UUID."""
    try:
        import pynvml  # from the nvidia-ml-py package
    except ImportError:
        return None, None
    try:
        pynvml.nvmlInit()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        if uuid is not None:
            text = str(uuid)
            return pynvml, pynvml.nvmlDeviceGetHandleByUUID(text if text.startswith("GPU-") else f"GPU-{text}")
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as err:  # no driver, no permission, unknown UUID: report no NVML metrics
        logger.debug("NVML unavailable: %s", err)
        try:
            pynvml.nvmlShutdown()  # pairs an nvmlInit that succeeded (a no-op error otherwise)
        except Exception:
            pass
        return None, None
