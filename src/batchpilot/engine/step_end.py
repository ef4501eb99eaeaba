"""The end of a step, in order: reduce the gradients and the loss over ranks, unscale, measure, clip, apply the
optimizer (with AdaScale's gain), step the LR schedulers; then the step's record and where it is written."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import distributed as bpdist
from ..clipping import StatsClip, grad_norm
from ..data.loader import MicroBatch
from ..data.sampler import AdaptiveBatchSampler
from ..logs import AdjustmentLog, TensorBoardSink
from ..lr import AdaScaleLR, LRCoupling, SampleLRSchedule
from ..measure import GradientNoiseProbe, read_scalars
from .config import LRConfig
from .preemption import Preemption
from .sharded import ShardedModel

logger = logging.getLogger("batchpilot")

Event = Callable[..., None]
"""``event(kind, data, warn=True)``: report something that happened in the step (see :class:`StepLog`)."""


def reduce_step_loss(losses: Sequence[tuple[torch.Tensor, float]], global_batch_size: int, *,
                     world_size: int, rank: int) -> float:
    """The step's mean loss over its global batch, from ``(detached loss, weight in samples)`` pairs (see
    :func:`reduce_step_totals`)."""
    return reduce_step_totals(losses, global_batch_size, world_size=world_size, rank=rank)[0]


def reduce_step_totals(losses: Sequence[tuple[torch.Tensor, float]], global_batch_size: int, *,
                       world_size: int, rank: int, stop: bool = False) -> tuple[float, bool]:
    """The step's mean loss over its global batch, from ``(detached loss, weight in samples)`` pairs, and whether
    any rank passed ``stop`` (a SIGTERM it received: engine/preemption.py).

    One device-to-host copy for the losses; with several ranks one float64 all-reduce that also carries the
    step's size and the stop flags (no extra collective), so ranks that trained different global batch sizes
    are caught, and a signal that reached one rank stops every rank at this step.

    Raises:
        RuntimeError: the ranks trained steps of different global batch sizes.
    """
    if len(losses) == 1:  # (one micro-batch: the common case) the same sum, without the lists
        loss_sum = losses[0][0].item() * losses[0][1]
    else:
        loss_sum = sum(value * weight for value, (_, weight) in zip(read_scalars([loss for loss, _ in losses]), losses))
    if world_size > 1:
        # The size and its square ride along (no extra collective): ranks that disagree cannot sum to both.
        square = global_batch_size * global_batch_size
        totals = bpdist.all_reduce_sum(torch.tensor([loss_sum, global_batch_size, square, float(stop)],
                                                    dtype=torch.float64))
        loss_sum, stop = float(totals[0]), float(totals[3]) > 0
        if float(totals[1]) != world_size * global_batch_size or float(totals[2]) != world_size * square:
            raise RuntimeError(
                f"the ranks trained steps of different global sizes (this rank, {rank}: {global_batch_size}; the mean "
                f"over ranks: {float(totals[1]) / world_size:g}). Under DDP call set_batch_size() on every "
                "rank with the same value (broadcast a value only rank 0 knows with "
                "batchpilot.distributed.broadcast_int)."
            )
    return loss_sum / global_batch_size, stop


def cpu_grad_norm(params: list[torch.nn.Parameter]) -> float:
    """:func:`~batchpilot.clipping.grad_norm` of float32/float64 CPU gradients, the same sum without its checks."""
    grads = [p.grad for p in params if p.grad is not None]
    return math.sqrt(sum(float(n) ** 2 for n in torch._foreach_norm(grads))) if grads else 0.0


class Gradients:
    """The trainable parameters (``requires_grad`` and the optimizer's groups may change between steps: call
    :meth:`refresh`), and those of them the optimizer does not hold, whose ``.grad`` would else grow from step
    to step: every trainable gradient is reduced, measured, clipped and dropped after each step.

    Raises:
        ValueError: the model has no trainable parameter, or the optimizer holds none of them.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._all = list(model.parameters())
        self.refresh()
        if not self.params:
            raise ValueError("the model has no parameter with requires_grad=True: there is nothing to train.")
        if len(self.unheld) == len(self.params):
            raise ValueError(
                "the optimizer holds none of the model's trainable parameters, so training would change nothing; "
                "build it from this model's parameters, e.g. torch.optim.SGD(model.parameters(), ...)."
            )

    def refresh(self) -> None:
        """Re-read the trainable parameters and the optimizer's."""
        self.params = [p for p in self._all if p.requires_grad]
        # float32/64 gradients on the CPU: their norm needs none of grad_norm's cases (low precision, devices)
        self.cpu_wide = all(p.device.type == "cpu" and p.dtype in (torch.float32, torch.float64) for p in self.params)
        held = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        self.unheld = [p for p in self.params if id(p) not in held]

    def zero(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.unheld:  # the optimizer's zero_grad misses trainable parameters it does not hold
            p.grad = None


@dataclass
class StepOutcome:
    """What the update did: the step's mean loss, gradient norm (NaN when nothing needed it), the LR it used,
    whether it was skipped, and the statistics measured on it."""

    loss: float
    grad_norm: float
    lr: float
    skipped: bool
    stats: dict[str, float] = field(default_factory=dict)


class StepEnd:
    """Turns a step's accumulated gradients into one optimizer update.

    Args:
        grads: The trainable parameters.
        scaler: fp16's GradScaler, or ``None``.
        adascale: AdaScale's LR gain (Johnson et al. 2020), or ``None``.
        grad_clip: ``None``, a max norm, or ``"stats"`` (then ``stats_clip`` holds the rule).
        noise: The gradient noise probe, or ``None``.
        engine_reduces: The gradients are summed over ranks here (without DDP, or under OOM recovery), not by
            DDP inside the last backward; ``ddp_model``'s buffers are then broadcast here too.
    """

    def __init__(self, grads: Gradients, *, scaler: torch.amp.GradScaler | None, adascale: AdaScaleLR | None,
                 grad_clip: float | str | None, skip_nonfinite: bool, noise: GradientNoiseProbe | None,
                 lr_schedulers: list[Any], engine_reduces: bool, ddp_model: Any, module: torch.nn.Module,
                 world_size: int, rank: int) -> None:
        self.grads, self.optimizer = grads, grads.optimizer
        self.scaler, self.adascale, self.noise, self.lr_schedulers = scaler, adascale, noise, lr_schedulers
        self.grad_clip, self.skip_nonfinite = grad_clip, skip_nonfinite
        self.stats_clip = StatsClip() if grad_clip == "stats" else None
        self.engine_reduces, self.ddp_model, self.module = engine_reduces, ddp_model, module
        self.sharded = ddp_model if isinstance(ddp_model, ShardedModel) else None  # FSDP2: norms over shards
        self.world_size, self.rank = world_size, rank
        self.losses: list[tuple[torch.Tensor, float]] = []  # the step's (detached loss, weight in samples)
        self.preemption: Preemption | None = None  # save_on_sigterm's flag, agreed on in the loss all-reduce

    def refresh_params(self) -> None:
        """Re-read the trainable parameters (between steps); the noise probe's small batches follow, as they must
        cover the parameters of the step's norm."""
        self.grads.refresh()
        if self.noise is not None:
            self.noise.set_params(self.grads.params)

    def discard(self) -> None:
        """Drop the step's gradients and losses (it runs again)."""
        self.grads.zero()
        self.losses.clear()

    def apply(self, global_batch_size: int, event: Event) -> StepOutcome:
        """Reduce, unscale, measure, clip and step; the gradients and losses are dropped afterwards."""
        params = self.grads.params
        if self.engine_reduces:
            bpdist.all_reduce_gradients(params)
            if self.ddp_model is not None and self.ddp_model.broadcast_buffers:
                bpdist.broadcast_buffers(self.module)  # what DDP does before a synced forward
        preemption = self.preemption
        loss, stop = reduce_step_totals(self.losses, global_batch_size, world_size=self.world_size, rank=self.rank,
                                        stop=preemption is not None and preemption.requested)
        if stop and preemption is not None:
            preemption.agreed = True  # every rank saves and stops after this step (engine/preemption.py)
        self.losses.clear()
        scaler = self.scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)
            if self.grads.unheld:  # the GradScaler unscales only the optimizer's parameters
                inverse = 1.0 / scaler.get_scale()
                for p in self.grads.unheld:
                    if p.grad is not None:
                        p.grad.mul_(inverse)
        measuring = self.noise is not None and self.noise.measuring
        # With a GradScaler and AdaScale the norm tells an overflowing step (skipped: no AdaScale progress).
        needs_norm = self.skip_nonfinite or self.grad_clip is not None or measuring or \
            (scaler is not None and self.adascale is not None)
        norm = float("nan")
        if needs_norm:
            if self.sharded is not None:
                norm = self.sharded.grad_norm(params)
            else:
                norm = cpu_grad_norm(params) if self.grads.cpu_wide else grad_norm(params)
        stats = {}
        if self.noise is not None:
            reduce = bpdist.all_reduce_sum if self.world_size > 1 else None
            stats = self.noise.end_step(global_batch_size, norm * norm, reduce)
        finite = math.isfinite(loss) and (math.isfinite(norm) or not self.skip_nonfinite)
        lr = float(self.optimizer.param_groups[0]["lr"])  # a tensor LR would be the optimizer's own, changed later
        skipped = False
        # With a GradScaler, a non-finite gradient is the scaler's to skip (and lowers its scale); a non-finite
        # loss over finite gradients is skipped here, closing the scaler's iteration (unscale_ was called).
        if self.skip_nonfinite and not finite and (scaler is None or not math.isfinite(loss)):
            skipped = True
            if scaler is not None:
                scaler.update()
            event("skipped_step", {"loss": loss, "grad_norm": norm})
        else:
            self._clip(norm)
            overflow = scaler is not None and needs_norm and not math.isfinite(norm)
            scaler_skipped = self._optimizer_step(global_batch_size, stats, overflow)
            lr *= stats.get("lr/adascale_gain", 1.0)  # the LR the step used (AdaScale scales it inside)
            if scaler_skipped:
                assert scaler is not None  # only the GradScaler skips a step in there
                skipped = True
                # Routine while the GradScaler finds its scale: logged, not warned.
                event("skipped_step", {"loss": loss, "grad_norm": norm, "reason": "fp16 overflow",
                                       "loss_scale": scaler.get_scale()}, warn=False)
        self.grads.zero()
        return StepOutcome(loss, norm, lr, skipped, stats)

    def step_schedulers(self, samples_seen: int, skipped: bool) -> None:
        """Step the LR schedulers after a step that brought ``samples_seen`` to its value."""
        for scheduler in self.lr_schedulers:
            if isinstance(scheduler, SampleLRSchedule):  # a function of samples: it follows the data consumed
                scheduler.step(samples_seen if self.adascale is None else self.adascale.progress_samples)
            elif not skipped:  # a per-step scheduler counts updates: a skipped step made none (as accelerate)
                scheduler.step()

    def _optimizer_step(self, global_batch_size: int, stats: dict[str, float], overflow: bool) -> bool:
        """Step the optimizer (through the GradScaler with fp16, with AdaScale's gain in the LR when on);
        return whether the scaler skipped the step (its scale fell: the scaled gradient overflowed)."""
        gain = None
        if self.adascale is not None and not overflow:  # an overflowing step is skipped: it makes no progress
            gain = self.adascale.gain_for(global_batch_size, stats.get("stats/trace_cov"),
                                          stats.get("stats/grad_sq_norm"))
            self.adascale.scale(gain)
            stats["lr/adascale_gain"] = gain
        try:
            if self.scaler is None:
                self.optimizer.step()
                return False
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            return self.scaler.get_scale() < scale_before
        finally:
            if gain is not None and self.adascale is not None:
                self.adascale.unscale()

    def _clip(self, norm: float) -> None:
        if self.grad_clip is None:
            return
        if self.stats_clip is not None:
            threshold = self.stats_clip.threshold()
            self.stats_clip.observe(norm)
        else:
            threshold = float(self.grad_clip)
        if threshold is not None and math.isfinite(norm) and norm > threshold:
            grads = [p.grad for p in self.grads.params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, threshold / (norm + 1e-6))


def lr_rules(optimizer: torch.optim.Optimizer, lr: LRConfig,
             batch_size: int) -> tuple[LRCoupling, AdaScaleLR | None, bool]:
    """The LR coupling of ``lr.lr_rule`` and, for ``"adascale"``, AdaScale (Johnson et al. 2020: the LR gain
    from each step's gradient statistics), both anchored at ``base_batch_size`` (default: ``batch_size``); and
    whether the coupling changes the LR at all (``"none"`` never does: the per-step work is skipped)."""
    base = batch_size if lr.base_batch_size is None else lr.base_batch_size
    rule = "none" if lr.lr_rule is None else lr.lr_rule  # (a checked config has resolved None already)
    adascale = rule == "adascale"
    coupling = LRCoupling(optimizer, base, rule="none" if adascale else rule, knee=lr.lr_knee)
    return coupling, AdaScaleLR(optimizer, base) if adascale else None, rule not in ("none", "adascale")


def step_record(*, step: int, samples_seen: int, position: tuple[int, int, int], num_samples: int,
                micro: MicroBatch, outcome: StepOutcome, step_time: float, skipped_steps: int) -> dict[str, Any]:
    """The step's line in the adjustment log (and TensorBoard, and a controller's ``stats``)."""
    epoch, offset, _ = position
    samples_per_s = micro.global_size / step_time if step_time > 0 else float("nan")
    return {
        "step": step,
        "samples_seen": samples_seen,
        "epoch": epoch,
        "coverage": offset / num_samples,
        "virtual_epoch": samples_seen / num_samples,
        "batch/global_size": micro.global_size,
        "batch/local_size": micro.local_size,
        "batch/accumulation_steps": micro.accumulation_steps,
        "loss": outcome.loss,
        "lr": outcome.lr,
        "grad/norm": outcome.grad_norm,
        "perf/step_time_s": step_time,
        "perf/samples_per_s": samples_per_s,
        "train/skipped_steps": skipped_steps,
        **outcome.stats,
    }


class StepLog:
    """Where the records go: the JSONL adjustment log and TensorBoard (on the lead rank only), and logging.

    TensorBoard is opened first: without it installed, the ImportError leaves no log file opened behind."""

    def __init__(self, log_path: str | os.PathLike | None, tensorboard_dir: str | os.PathLike | None,
                 lead: bool, dropped: int = 0) -> None:
        self.tensorboard = TensorBoardSink(tensorboard_dir) if (tensorboard_dir is not None and lead) else None
        self.log = AdjustmentLog(log_path) if (log_path is not None and lead) else None
        self.dropped = dropped  # samples drop_last dropped, as reported so far

    def report_drops(self, sampler: AdaptiveBatchSampler, step: int) -> None:
        """Log the samples ``drop_last`` dropped since the last report (an epoch's incomplete final batch)."""
        if sampler.dropped_samples != self.dropped:
            self.event(step, "dropped_last", {"samples": sampler.dropped_samples - self.dropped,
                                              "epoch": sampler.epoch - 1}, warn=False)
            self.dropped = sampler.dropped_samples

    def event(self, step: int, kind: str, data: dict[str, Any], warn: bool = True) -> None:
        """Something that happened in ``step`` (a skipped step, an out-of-memory replay, dropped samples)."""
        (logger.warning if warn else logger.info)("step %d: %s %s", step, kind, data)
        if self.log is not None:
            self.log.write("event", {"step": step, "event": kind, **data})

    def step(self, record: dict[str, Any]) -> None:
        if self.log is not None:
            self.log.write("step", record)
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def decision(self, decision: dict[str, Any]) -> None:
        if self.log is not None:
            self.log.write("decision", decision)

    def flush(self) -> None:
        if self.log is not None:
            self.log.flush()

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
