"""Engine-side measurement: the engine's gradients, timings and losses read into the numbers the (pure)
estimators of :mod:`batchpilot.stats` need: the gradient noise probe (:mod:`.noise_probe`), the micro-batch
timer and the per-step meter (loss trend, throughput model, system load).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, cast

import torch

from .._extras import install_hint
from ..controllers.boundary import controller_name
from ..stats.loss_trend import LossTrend
from ..stats.system import SystemMonitor
from ..stats.throughput import ThroughputModel
from .noise_probe import (
    DECAY_PER_STEP,
    DEFAULT_NOISE_EVERY,
    MAX_PERIOD,
    MIN_SPLIT_PERIOD,
    TARGET_RELATIVE_ERROR,
    GradientNoiseProbe,
    engine_probe,
)

__all__ = ["DECAY_PER_STEP", "DEFAULT_NOISE_EVERY", "MAX_PERIOD", "MIN_SPLIT_PERIOD", "TARGET_RELATIVE_ERROR",
           "GradientNoiseProbe", "MicroTimer", "StepMeter", "engine_probe", "read_scalars"]

logger = logging.getLogger("batchpilot")


def read_scalars(values: list[torch.Tensor]) -> list[float]:
    """The values of 0-dim tensors (a step's micro-batch losses) with one device-to-host copy: on a GPU a
    ``float()`` each would wait for the device once per tensor."""
    if len(values) < 2:  # (the common case: one micro-batch) no stack to build
        return [values[0].item()] if values else []
    first = values[0]
    return torch.stack([v.to(first.device, first.dtype) for v in values]).tolist()


class MicroTimer:
    """Times one micro-batch's forward and backward for the throughput model (Pollux's ``T_grad``).

    On CPU: the wall clock. On a CUDA device kernels run asynchronously, so when ``backward()`` returns the
    work may still be queued and the wall clock would time the kernel launches only; the GPU time would then
    land in the per-step overhead and the model would price large batches as free. There a pair of CUDA
    events on the current stream times the micro-batch; :func:`seconds` reads it (waiting for the end event)
    when the step ends.
    """

    def __init__(self, device: Any = None) -> None:
        self.device = None if device is None else torch.device(device)
        self.cuda = self.device is not None and self.device.type == "cuda"
        self._start: Any = None

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))  # the model's device, not necessarily the current one
        return event

    def start(self) -> None:
        """A micro-batch's forward starts now."""
        self._start = self._event() if self.cuda else time.perf_counter()

    def stop(self) -> float | tuple[Any, Any]:
        """Its backward returned: elapsed seconds, or (on CUDA) the event pair to read with :func:`seconds`."""
        if self.cuda:
            return self._start, self._event()
        return time.perf_counter() - self._start

    @staticmethod
    def seconds(value: float | tuple[Any, Any]) -> float:
        """Seconds of a :meth:`stop` result (for CUDA events: waits until the end event has happened)."""
        if isinstance(value, tuple):
            start, end = value
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        return value


class StepMeter:
    """Loss trend, the online throughput model and (optionally) system load, updated once per step.

    The metrics are refreshed every 10 steps (and on the first); in between the last values are reported.

    Args:
        loss_window: Steps in the loss-trend window (:class:`~batchpilot.stats.LossTrend`).
        system_every: Sample CPU/GPU load every N steps (``None``: never; needs psutil).
        device: The training device, for GPU metrics.
    """

    def __init__(self, loss_window: int = 50, system_every: int | None = 100, device: Any = None) -> None:
        self.trend = LossTrend(window=loss_window)
        self.throughput = ThroughputModel()
        self.system_every = system_every
        self.monitor = None
        if system_every is not None:
            try:
                # A CPU device means no GPU metrics (None would pick, and initialise, the current CUDA device).
                self.monitor = SystemMonitor(device)
            except ImportError:
                self.monitor = None  # psutil is optional: no system metrics without it
        self._system: dict[str, float] = {}
        self._metrics: dict[str, float] = {}
        self.refresh_every = 10 if system_every is None else math.gcd(10, system_every)
        self.timer = MicroTimer(device)
        self._micro_sizes: list[int] = []
        self._micro_seconds: list[float | tuple[Any, Any]] = []

    def warn_unmeasured(self, controller: Any, on_gpu: bool) -> None:
        """Warn when ``controller`` reads system load (``system/*`` in its ``required_stats``; GPU load only
        ``on_gpu``) that is never measured: sampling is off, psutil is missing, or NVML is missing on a GPU."""
        wanted = [k for k in getattr(controller, "required_stats", ())
                  if k.startswith("system/") and (on_gpu or not k.startswith("system/gpu"))]
        if not wanted:
            return
        name, monitor = controller_name(controller), self.monitor
        if self.system_every is None:
            logger.warning("%s reads %s, but system_every=None switches load sampling off: its rules on load never "
                           "act; pass system_every=N (default 100).", name, ", ".join(wanted))
        elif monitor is None:
            logger.warning("%s reads %s, but psutil is not installed, so no load is measured and its rules on load "
                           "never act; install it with: %s", name, ", ".join(wanted), install_hint("system"))
        elif "system/gpu_util" in wanted and on_gpu and not monitor.has_nvml:
            logger.warning("%s reads system/gpu_util, but nvidia-ml-py is not installed, so GPU utilisation is not "
                           "measured; install it with: %s", name, install_hint("gpu"))

    def begin_micro(self) -> None:
        """A micro-batch's forward starts."""
        self.timer.start()

    def end_micro(self, micro_batch_size: int) -> None:
        """Its backward returned (not called for ghost micro-batches): record its size and time."""
        self._micro_sizes.append(micro_batch_size)
        self._micro_seconds.append(self.timer.stop())

    def close(self) -> None:
        """Release what the system monitor holds (NVML); sampling later starts it again."""
        if self.monitor is not None:
            self.monitor.close()

    def discard_step(self) -> None:
        """Forget the micro-batches timed so far in this step (folded in, or to run again after running out
        of memory)."""
        self._micro_sizes.clear()
        self._micro_seconds.clear()

    def end_step(self, step: int, loss: float, step_seconds: float, skipped: bool,
                 overhead: bool = True) -> dict[str, float]:
        """Fold in the finished step; return the metrics for the step record. ``overhead=False``: the step's
        time outside its micro-batches is no fair sample of the per-step overhead (it started a data iterator,
        say); only its micro-batches are recorded."""
        if not skipped and math.isfinite(loss):
            self.trend.update(loss)
        if self._micro_sizes:
            # On CPU the timings are floats already (CUDA event pairs are read here, once per step).
            seconds = [MicroTimer.seconds(s) for s in self._micro_seconds] if self.timer.cuda else \
                cast(list[float], self._micro_seconds)
            self.throughput.observe_step(self._micro_sizes, seconds,
                                         max(step_seconds, sum(seconds)) if overhead else None)
        self.discard_step()
        if step % self.refresh_every == 0 or not self._metrics:
            # Refitting the throughput model and the trend costs tens of microseconds: every few steps is
            # plenty for controllers that act every tens of steps, and keeps the step loop cheap.
            if self.monitor is not None and self.system_every and step % self.system_every == 0:
                self._system = self.monitor.sample()
            self._metrics = {**self.trend.metrics(), **self.throughput.metrics(), **self._system}
        return self._metrics

    def state_dict(self) -> dict[str, Any]:
        # The values reported between refreshes are part of the state: a resumed run reports (and its
        # controller reads) what the uninterrupted one did.
        return {"trend": self.trend.state_dict(), "throughput": self.throughput.state_dict(),
                "metrics": dict(self._metrics), "system": dict(self._system)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trend.load_state_dict(state["trend"])
        self.throughput.load_state_dict(state["throughput"])
        self._metrics = dict(state.get("metrics", {}))  # absent in older checkpoints: refreshed at the next step
        self._system = dict(state.get("system", {}))
