"""Engine-side measurement: the engine's gradients, timings and losses read into the numbers the (pure)
estimators of :mod:`batchpilot.stats` need.

Gradient noise (McCandlish et al. 2018): on a measured step every micro-batch whose gradient is visible
before any cross-rank reduction is a "small" batch; the step's final (reduced) gradient is the "big" one.
The increment of ``.grad`` by micro-batch ``j`` is ``(n_j / B) g_j`` (the engine's loss weighting), so
``|g_j|^2 = |increment|^2 (B / n_j)^2``. Under DDP the last micro-batch's backward already all-reduces,
so its local norm is read inside DDP's all-reduce by a communication hook (:meth:`GradientNoiseProbe.attach_ddp`);
without DDP all of them are small batches. With several ranks the small batches thus come for free
(each rank's gradient before the reduction; three scalars are all-reduced). Otherwise (one process, or
a DDP model that already has a communication hook) a step with a single micro-batch is split in two on
measured steps (:attr:`GradientNoiseProbe.split_every`), which keeps the estimate unbiased.

How often: the split costs a second forward/backward pass at half size on a measured step (+70-80% of that
step for a small CNN on CPU at batch 32-128, nothing at 512), so the default period is 16 steps (about +4.5-5%
per step; docs/statistics.md). The estimator's EMA decay per measurement is ``0.99 ** (every / 4)``: whatever
the period, old measurements fade with a time constant of about 400 *steps*.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from ._extras import install_hint
from ._validation import check_positive_int
from .clipping import sum_of_squares
from .controllers.boundary import controller_name
from .stats.loss_trend import LossTrend
from .stats.noise_scale import NoiseScaleEstimator
from .stats.system import SystemMonitor
from .stats.throughput import ThroughputModel

logger = logging.getLogger("batchpilot")

DEFAULT_NOISE_EVERY = 16
"""Measurement period of the gradient noise scale when a controller needs it and the user did not say."""


def read_scalars(values: list[torch.Tensor]) -> list[float]:
    """The values of 0-dim tensors (a step's micro-batch losses) with one device-to-host copy: on a GPU a
    ``float()`` each would wait for the device once per tensor."""
    if not values:
        return []
    first = values[0]
    return torch.stack([v.to(first.device, first.dtype) for v in values]).tolist()


class GradientNoiseProbe:
    """Measures micro-batch gradient norms on every ``every``-th step and feeds a noise-scale estimator.

    Args:
        params: The trained parameters.
        every: Measure on steps whose index is a multiple of ``every``.
        ema_decay: Smoothing of the estimator per measurement (see
            :class:`~batchpilot.stats.NoiseScaleEstimator`); default ``0.99 ** (every / 4)``, a time
            constant of about 400 steps.
        ranks_are_small_batches: Every rank's gradient is visible before the engine reduces it (several
            ranks, no DDP): the ranks are the small batches, so a measured step is never split.
        population: The dataset's size: steps are drawn from it without replacement, and the estimate is
            corrected for that (see :func:`~batchpilot.stats.two_batch_estimates`); ``None``: no correction.
            :attr:`population` may be set between steps (a dataset reloaded with another size).
    """

    def __init__(self, params: list[torch.nn.Parameter], every: int = DEFAULT_NOISE_EVERY,
                 ema_decay: float | None = None, ranks_are_small_batches: bool = False,
                 population: int | None = None) -> None:
        self.params = params
        self.population = population  # checked by the property
        self.every = every
        self._split = not ranks_are_small_batches
        if ema_decay is None:
            ema_decay = 0.99 ** (every / 4)
        self.estimator = NoiseScaleEstimator(ema_decay=ema_decay)
        self.measuring = False
        self._prev: list[torch.Tensor] | None = None
        self._sq_norms: list[float] = []
        self._sizes: list[int] = []
        self._index = {id(p): i for i, p in enumerate(params)}
        # Last micro-batch's local |increment|^2, seen by the DDP hook (a device tensor on a GPU).
        self._hook_sq: float | torch.Tensor | None = None
        self.seconds = 0.0  # time spent measuring, for the overhead report

    @property
    def population(self) -> int | None:
        """The dataset's size the estimate is corrected for (``None``: no correction); settable between steps
        to ``None`` or an int >= 1 (else ``TypeError``/``ValueError``)."""
        return self._population

    @population.setter
    def population(self, value: int | None) -> None:
        self._population = None if value is None else check_positive_int(value, "population")

    @property
    def split_every(self) -> int | None:
        """Split every ``split_every``-th step into at least two micro-batches, whose gradients are then the
        small batches (``None``: never; the ranks are the small batches)."""
        return self.every if self._split else None

    def set_params(self, params: list[torch.nn.Parameter]) -> None:
        """Measure ``params`` from the next step on (call between steps, when the trainable set changed: the
        small batches' norms must cover the same parameters as the step's norm). The estimates carry over."""
        if self.measures(params):
            return
        self.params = params
        self._index = {id(p): i for i, p in enumerate(params)}
        self._prev = None

    def measures(self, params: list[torch.nn.Parameter]) -> bool:
        """Whether the probe measures exactly ``params``, in this order."""
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params))

    def attach_ddp(self, ddp_model: Any) -> bool:
        """Read each rank's gradient inside DDP's own all-reduce (a communication hook), so that under DDP
        the ranks are the small batches for free and no measured step is split.

        The hook adds the squared norm of the rank-local gradient increment (the bucket before the
        reduction) on measured steps, then averages over ranks exactly as DDP's default does. DDP allows one
        hook per model, so the hook reads the model's current probe: a later probe on the same model (a second
        ``train()`` or ``fit()``) takes the hook over. Returns ``False`` (and the probe keeps splitting) if
        the model already has another communication hook.
        """
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        if getattr(ddp_model, "_batchpilot_probe", None) is not None:  # our hook is there: hand it over
            ddp_model._batchpilot_probe = self
            self._split = False
            return True

        def hook(state, bucket):  # no annotations: DDP checks them
            ddp_model._batchpilot_probe._read_bucket(bucket)
            return allreduce_hook(state, bucket)

        try:
            ddp_model.register_comm_hook(ddp_model.process_group, hook)  # DDP's own group, not always WORLD
        except RuntimeError:  # a hook is registered already: DDP allows one
            return False
        ddp_model._batchpilot_probe = self
        self._split = False
        return True

    def _read_bucket(self, bucket: Any) -> None:
        """On a measured step, add the squared norm of this rank's gradient increment in ``bucket``."""
        if self.measuring:
            start = time.perf_counter()
            prev = self._prev
            index = [self._index.get(id(p)) for p in bucket.parameters()]
            increment = [g if prev is None or i is None else g - prev[i] for g, i in zip(bucket.gradients(), index)]
            sq = sum_of_squares(increment, lazy=True)  # on a GPU a device tensor: no sync inside backward
            self._hook_sq = sq if self._hook_sq is None else self._hook_sq + sq
            self.seconds += time.perf_counter() - start

    def begin_step(self, step_index: int) -> None:
        self.measuring = step_index % self.every == 0
        self._sq_norms.clear()
        self._sizes.clear()
        self._hook_sq = None
        if self.measuring and self._prev is not None:
            torch._foreach_zero_(self._prev)

    def after_backward(self, micro_batch_size: int, to_mean: float, synced: bool) -> None:
        """Record the gradient norm of a micro-batch of ``micro_batch_size`` samples.

        Args:
            micro_batch_size: Samples in the micro-batch.
            to_mean: The factor between this backward's ``.grad`` increment and the micro-batch's mean
                gradient (the engine's loss weight, times the AMP loss scale, times ``micro_batch_size`` for a
                summed loss): ``increment = to_mean * g_j``.
            synced: This backward already reduced the gradients over ranks (DDP's last micro-batch);
                its local norm is the one the DDP hook saw (:meth:`attach_ddp`), if any.
        """
        if synced:
            sq, self._hook_sq = self._hook_sq, None
            if self.measuring and micro_batch_size and sq is not None:
                self._sq_norms.append(float(sq) / to_mean**2)
                self._sizes.append(micro_batch_size)
            return
        if not self.measuring or micro_batch_size == 0:
            return
        start = time.perf_counter()
        grads = self._grads()
        if self._prev is None:
            self._prev = [torch.zeros_like(g) for g in grads]
        increment = torch._foreach_sub(grads, self._prev)
        sq = sum_of_squares(increment)
        torch._foreach_copy_(self._prev, grads)
        self._sq_norms.append(sq / to_mean**2)
        self._sizes.append(micro_batch_size)
        self.seconds += time.perf_counter() - start

    def end_step(
        self, global_batch_size: int, grad_sq_norm: float, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> dict[str, float]:
        """Update the estimator with the step's reduced gradient; return the current estimates.

        ``reduce`` sums a small tensor over ranks (every rank must call this on a measured step): the
        small-batch norms of all ranks then enter one estimate, identical everywhere.
        """
        if self.measuring:
            totals = [float(len(self._sizes)), sum(1.0 / n for n in self._sizes), sum(self._sq_norms)]
            if reduce is not None:
                totals = reduce(torch.tensor(totals, dtype=torch.float64)).tolist()
            k, inverse_sizes, sq_sum = totals
            if k > 0 and math.isfinite(sq_sum) and math.isfinite(grad_sq_norm):
                b_small = k / inverse_sizes  # harmonic mean of the small batch sizes
                # A step longer than the dataset repeats samples: no correction for it (never in the engine).
                population = self.population if self.population and global_batch_size <= self.population else None
                if global_batch_size > b_small:
                    self.estimator.update(b_small, sq_sum / k, global_batch_size, grad_sq_norm, population=population)
        self.measuring = False
        return self.values()

    def values(self) -> dict[str, float]:
        out = self.estimator.metrics()
        if "stats/trace_cov" in out:
            out["stats/grad_variance"] = out["stats/trace_cov"]  # seed 002's sigma_t^2, from micro-batches
        if self.estimator.count:
            out["stats/noise_count"] = self.estimator.count  # measured steps behind the estimate
        return out

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def state_dict(self) -> dict[str, Any]:
        return {"every": int(self.every), "estimator": self.estimator.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (``ValueError``/``TypeError`` for a period that is not an
        int >= 1, or an invalid estimator state; nothing is changed then)."""
        every = check_positive_int(state["every"], "the checkpoint's noise_every")
        self.estimator.load_state_dict(state["estimator"])
        self.every = every


def engine_probe(params: list[torch.nn.Parameter], every: int | None, *, needed: bool, ranks_are_small_batches: bool,
                 population: int, ddp_model: Any = None) -> GradientNoiseProbe | None:
    """The engine's probe, measuring every ``every`` steps (``None``: every ``DEFAULT_NOISE_EVERY`` when
    ``needed``, else no probe), hooked into ``ddp_model``'s all-reduce when one is given (:meth:`attach_ddp
    <GradientNoiseProbe.attach_ddp>`); ``population``: the dataset's size (epochs draw without replacement)."""
    if every is None and needed:
        every = DEFAULT_NOISE_EVERY
    if not every:
        return None
    probe = GradientNoiseProbe(params, every=every, ranks_are_small_batches=ranks_are_small_batches,
                               population=population)
    if ddp_model is not None and not probe.attach_ddp(ddp_model):
        logger.info("the DDP model already has a communication hook: measured steps are split in two "
                    "to measure the gradient noise scale (see docs/statistics.md)")
    return probe


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
            seconds = [MicroTimer.seconds(s) for s in self._micro_seconds]
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
