"""Gradient statistics inside a framework's loop: what `Pilot` measures, for the HF and Lightning integrations.

The framework runs a fixed number of micro-batches per optimizer step on each rank and reduces the
gradients over ranks in the last one (DDP). The micro-batches and the ranks are the small batches of
McCandlish et al.'s two-batch noise-scale estimate (``batchpilot.measure.GradientNoiseProbe``, the same
probe as ``Pilot``'s): the ``.grad`` increment of every micro-batch before the reduction, with the last
micro-batch's read by a DDP communication hook; the step's reduced gradient (before clipping) is the big
one. These loops cannot split a step, so one process with a single micro-batch per step has no small
batch: that setting is refused for controllers that need the statistics, naming the fix. Per-micro-batch
times feed the throughput model (``perf/*``) as in ``Pilot``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from .. import distributed as bpdist
from .._wrappers import unwrap
from ..measure import DEFAULT_NOISE_EVERY, GradientNoiseProbe, StepMeter

logger = logging.getLogger("batchpilot")


def check_measurable(world_size: int, accumulation_steps: int, *, manual: bool = False) -> None:
    """Raise unless a step has a small batch to compare with (several micro-batches or several ranks);
    ``manual``: Lightning's manual optimization, where a step is one batch (no accumulation)."""
    if world_size == 1 and (accumulation_steps == 1 or manual):
        why = (
            "this module uses manual optimization (one batch per step: Lightning allows no accumulate_grad_batches "
            "there) on one process; train on >= 2 ranks (each rank's batch is then a small batch), or use "
            "automatic optimization with accumulate_grad_batches >= 2." if manual else
            "this run has one process and one micro-batch per step; set gradient_accumulation_steps >= 2 "
            "(Hugging Face) or accumulate_grad_batches >= 2 (Lightning): each micro-batch is then a small batch, "
            "at no extra cost; or train on >= 2 ranks."
        )
        raise ValueError("the batch size controller reads gradient statistics (the noise scale), which need two "
                         f"batch sizes per measured step, but {why}")


class StepStats:
    """Measures the gradient noise scale and the step meters for one rank of a framework's run.

    Args:
        params: The model's trainable parameters.
        world_size: Data-parallel ranks.
        accumulation_steps: Micro-batches per step on each rank.
        every: Measure the noise scale on every ``every``-th step (``None``: ``DEFAULT_NOISE_EVERY``).
        splits_measured_steps: The loop runs a measured step's only micro-batch as two passes (the HF trainer
            on one process with ``gradient_accumulation_steps=1``), so one micro-batch per step is fine.
        params_of: Returns the trainable parameters now; read at each measured step's start, so that a
            parameter unfrozen during training is measured in the small batches as in the step's norm.

    Raises:
        ValueError: one process with one micro-batch per step (no small batch to compare with).
    """

    def __init__(self, params: list[torch.nn.Parameter], *, world_size: int, accumulation_steps: int,
                 every: int | None = None, splits_measured_steps: bool = False,
                 params_of: Callable[[], list[torch.nn.Parameter]] | None = None) -> None:
        if not splits_measured_steps:
            check_measurable(world_size, accumulation_steps)
        self.world_size, self.accumulation_steps = world_size, accumulation_steps
        self._splits = splits_measured_steps
        self.probe = GradientNoiseProbe(params, every=every or DEFAULT_NOISE_EVERY)  # never asked to split a step
        self._params_of = params_of
        self.meter = StepMeter(device=params[0].device if params else None)  # CUDA: micro-batches timed by events
        self._hooked_to: Any = None  # the DDP model whose communication hook feeds this probe
        self._step, self._global_batch_size = 0, 0
        self._started = 0.0
        self._stats: dict[str, float] = {}

    def attach(self, wrapped_model: Any) -> None:
        """Under DDP, read the last micro-batch's local gradient in DDP's all-reduce (once per DDP model: a new
        fit's new wrapper is hooked again; one with another communication hook is warned about once).

        Raises:
            ValueError: the DDP model has its own communication hook and a step has one micro-batch per rank:
                that micro-batch is the last, so no small batch would ever be measured.
        """
        _, ddp = unwrap(wrapped_model)  # also inside a torch.compile wrapper
        if self.world_size == 1 or ddp is None or ddp is self._hooked_to:
            return
        self._hooked_to = ddp
        if not self.probe.attach_ddp(ddp):
            if self.accumulation_steps == 1 and not self._splits:
                raise ValueError(
                    "the DDP model already has a communication hook (a compression hook, say), so batchpilot cannot "
                    "read each rank's gradient inside the all-reduce, and with one micro-batch per step that is the "
                    "only small batch: the noise scale would never be measured. Set gradient_accumulation_steps >= 2 "
                    "(Hugging Face) or accumulate_grad_batches >= 2 (Lightning; with manual optimization, which allows no "
                    "accumulation, train without the hook), or train without the hook."
                )
            logger.warning("the DDP model already has a communication hook: the last micro-batch of each rank is "
                           "not measured, so the noise scale rests on the other micro-batches (see docs/statistics.md)")

    def begin_step(self, step: int, global_batch_size: int, population: int | None = None) -> None:
        """Step ``step`` (counting from 0) of ``global_batch_size`` samples starts; its samples are drawn without
        replacement from ``population`` (the dataset's size; ``None``: leave it as it was)."""
        self._step, self._global_batch_size = step, global_batch_size
        if population is not None:
            self.probe.population = population
        self._started = time.perf_counter()
        if self._params_of is not None and step % self.probe.every == 0:
            self.probe.set_params(self._params_of())
        self.probe.begin_step(step)

    def restart_step(self) -> None:
        """The step in flight runs again from its first micro-batch: forget what it measured so far."""
        self.meter.discard_step()
        self.begin_step(self._step, self._global_batch_size)

    def begin_micro(self) -> None:
        """A forward/backward starts (timed for the throughput model)."""
        self.meter.begin_micro()

    def end_micro(self, size: int) -> None:
        """That forward/backward of ``size`` samples returned (not called for ghost micro-batches)."""
        self.meter.end_micro(size)

    def after_micro(self, size: int, last: bool, to_mean: float, scaler: Any = None) -> None:
        """A small batch of ``size`` samples (a micro-batch, or one pass of a micro-batch cut into several;
        0: a ghost) finished its backward; ``last``: the step's last on this rank. ``to_mean``: the factor
        between its ``.grad`` increment and its mean gradient (its loss weight); ``scaler``: the fp16
        GradScaler whose scale ``.grad`` also holds, if any (read only on measured steps: ``get_scale()``
        synchronises with the GPU)."""
        if scaler is not None and self.probe.measuring:
            to_mean *= float(scaler.get_scale())
        # Under DDP the last backward already averaged .grad over ranks: its local increment is the one the
        # communication hook saw (none without the hook, and then this micro-batch is left out).
        self.probe.after_backward(size, to_mean, synced=self.world_size > 1 and last)

    @property
    def measuring(self) -> bool:
        """Whether the step in flight is a measured one (its reduced gradient's norm is needed)."""
        return self.probe.measuring

    def reduced(self, grad_norm: float | None) -> None:
        """The step's reduced gradient has norm ``grad_norm`` (before clipping): update the noise estimate.

        A collective on measured steps when distributed (every rank calls it)."""
        if self.probe.measuring:
            sq = float("nan") if grad_norm is None else float(grad_norm) ** 2
            if self._params_of is not None and not self.probe.measures(self._params_of()):
                # The trainable set changed inside the step (a callback's on_step_begin, say): the two norms
                # cover different parameters, so this measurement is left out (every rank still reduces).
                sq = float("nan")
            self.probe.end_step(self._global_batch_size, sq, bpdist.all_reduce_sum if self.world_size > 1 else None)

    def end_step(self, step: int, loss: float | None, max_micro_batch_size: int | None = None) -> dict[str, float]:
        """Step ``step`` (its mean loss ``loss``) is done: fold it into the meters; return every statistic.

        ``max_micro_batch_size``: most samples per forward/backward when the loop cut its micro-batches into
        passes (the HF trainer's bound, lowered after running out of memory), reported to ``Goodput``."""
        seconds = time.perf_counter() - self._started
        metrics = self.meter.end_step(step, float("nan") if loss is None else loss, seconds, False)
        self._stats = {**metrics, **self.probe.values(), "dist/world_size": float(self.world_size),
                       "perf/accumulation_steps": float(self.accumulation_steps)}
        if max_micro_batch_size is not None:  # each micro-batch runs in pieces of at most this many
            self._stats["perf/max_micro_batch_size"] = float(max_micro_batch_size)
        return self._stats

    @property
    def stats(self) -> dict[str, float]:
        """The statistics after the last step."""
        return dict(self._stats)

    def state_dict(self) -> dict[str, Any]:
        return {"probe": self.probe.state_dict(), "meter": self.meter.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.probe.load_state_dict(state["probe"])
        self.meter.load_state_dict(state["meter"])
