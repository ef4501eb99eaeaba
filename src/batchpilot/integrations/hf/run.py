"""`HFRun`: the adaptive-batch state of one ``AdaptiveBatchSizeTrainer.train()`` call.

It ties the loader (data position, exact sizes), the driver (controller, counters) and the optional LR
coupling together, keeps the step in flight, and is what ``trainer.batchpilot`` exposes to users.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ... import distributed as bpdist
from ...data.loader import AdaptiveDataLoader, MicroBatch
from ...engine.driver import SizeDriver
from ...lr import LRCoupling
from .._rank_shares import RankShares


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as this rank ran it.

    Attributes:
        step: 0-based index of the step.
        global_size: Samples in the step over all ranks (B).
        local_size: This rank's samples in the step.
        accumulation_steps: Micro-batches per rank (``gradient_accumulation_steps``).
        epoch, offset: Position of the step's first sample (epoch, samples of it consumed before).
        indices: This rank's dataset indices in the step, ghost micro-batches excluded.
        ghosts: Micro-batches of this rank that carried no sample of its own (weighted 0).
        global_tokens, local_tokens: With ``batch_unit="tokens"``, the step's tokens over all ranks and on this
            rank (``None`` otherwise).
    """

    step: int
    global_size: int
    local_size: int
    accumulation_steps: int
    epoch: int
    offset: int
    indices: np.ndarray
    ghosts: int
    global_tokens: int | None = None
    local_tokens: int | None = None

    @property
    def global_units(self) -> int:
        """The step's size in the batch unit: samples, or tokens."""
        return self.global_size if self.global_tokens is None else self.global_tokens


class HFRun:
    """Loader + driver + LR coupling for one training run (see the module docstring).

    Args:
        loader: The rank's :class:`~batchpilot.AdaptiveDataLoader` (fixed ``accumulation_steps``).
        driver: Decides the next global size.
        world_size: Data-parallel ranks.
        total_samples: ``num_train_epochs * len(dataset)`` when training by epochs (the LR schedule's and the
            progress bar's length), ``None`` when ``max_steps`` bounds training.
        lr_rule, lr_knee: LR coupling (see :func:`batchpilot.lr.lr_factor`); base batch size = first size.
        max_micro_batch_size: Most rows per forward/backward (``None``: a micro-batch runs whole); lowered by
            :meth:`restart_step` after running out of memory, and saved in :meth:`state_dict`.
        max_micro_batch_tokens: With ``batch_unit="tokens"``, most tokens per forward/backward.

    With ``batch_unit="tokens"`` the driver (the controller, the LR coupling and schedule, the noise scale) counts
    tokens; ``samples_seen``, epochs and coverage still count samples.
    """

    def __init__(
        self,
        loader: AdaptiveDataLoader,
        driver: SizeDriver,
        *,
        world_size: int,
        total_samples: int | None,
        lr_rule: Any = "none",
        lr_knee: int = 4096,
        max_micro_batch_size: int | None = None,
        max_micro_batch_tokens: int | None = None,
    ) -> None:
        self.loader = loader
        self.driver = driver
        self.world_size = world_size
        self.total_samples = total_samples
        self.lr_rule, self.lr_knee = lr_rule, lr_knee
        self.coupling: LRCoupling | None = None
        self._coupling_state: Mapping[str, Any] | None = None
        self.inflight: StepRecord | None = None
        self.last_step: StepRecord | None = None
        self.last_loss: float | None = None
        self.step_lr_factor = 1.0  # the LR coupling factor the last optimizer step ran with
        self._loss: torch.Tensor | float = 0.0
        self.stats: Any = None  # a StepStats when the controller reads gradient statistics
        self.max_micro_batch_size = max_micro_batch_size
        self.max_micro_batch_tokens = max_micro_batch_tokens
        plan = loader.sampler.token_plan
        self.lengths = None if plan is None else plan.lengths  # every sample's tokens (batch_unit="tokens")
        self._samples = 0  # samples of completed steps (the driver counts the batch unit)
        self.oom_replays = 0  # steps run again after running out of memory (this train() call)
        self.decided: int | None = None  # the controller's last size (the loader's may be cut to the samples left)
        self.samples_at_start = 0  # samples_seen when this train() call began (its throughput counts from there)
        self.lr_anchor: int | None = None  # the LR rule's base batch size when not the first size (Auto's knee)
        self.probe_records: list[dict[str, Any]] = []  # the start probes' records (Auto, this train() call)
        # rank_weights at work: fixed weights set on the loader, or "auto"'s balancer (integrations/_rank_shares.py)
        self.shares: RankShares | None = None

    # ------------------------------------------------------------------ progress (read by logs and users)
    @property
    def batch_size(self) -> int:
        """Global batch size of the next step."""
        return self.loader.batch_size

    @property
    def samples_seen(self) -> int:
        """Samples of completed steps, over all ranks."""
        return self._samples if self.lengths is not None else self.driver.samples_seen

    @property
    def tokens_seen(self) -> int | None:
        """Tokens of completed steps, over all ranks (``None`` unless ``batch_unit="tokens"``)."""
        return None if self.lengths is None else self.driver.samples_seen

    @property
    def total_units(self) -> int | None:
        """What the LR schedule runs over: ``total_samples``, or in tokens ``num_train_epochs`` worth of the
        dataset's tokens (``None`` with ``max_steps``)."""
        plan = self.loader.sampler.token_plan
        if self.total_samples is None or plan is None:
            return self.total_samples
        return math.ceil(self.total_samples / self.loader.sampler.num_samples * plan.total_tokens)

    @property
    def epoch(self) -> int:
        """Full passes over the data completed."""
        return self.loader.position()[0]

    @property
    def coverage(self) -> float:
        """Fraction of the current pass consumed, in ``[0, 1)``."""
        return self.loader.position()[1] / self.loader.sampler.num_samples

    @property
    def rank_weights(self) -> tuple[float, ...] | None:
        """The weights the global batches are shared by over the ranks (``None``: evenly)."""
        return self.loader.sampler.rank_weights

    @property
    def virtual_epoch(self) -> float:
        """``samples_seen / len(dataset)`` (seed 003's logged ``epoch``)."""
        return self.samples_seen / self.loader.sampler.num_samples

    def finished(self, num_train_epochs: float) -> bool:
        """Training by epochs, all of them are done: every sample counted, or every epoch covered
        (``epochs_done()`` counts one whose tail ``drop_last`` will drop)."""
        return self.total_samples is not None and (
            self.samples_seen >= self.total_samples or self.loader.epochs_done() >= num_train_epochs)

    @property
    def probe(self) -> Any:
        """What the start probes found (``Auto``'s :class:`~batchpilot.controllers.auto.ProbeResult`, kept in the
        checkpoint's controller state), or ``None`` without ``Auto``."""
        return getattr(self.driver.controller, "probe", None)

    # ------------------------------------------------------------------ one step
    def begin_step(self, micro: list[MicroBatch]) -> list[float]:
        """Record the step made of ``micro`` and return each micro-batch's loss divisor.

        Dividing micro-batch ``m``'s mean loss by ``B / (world_size * n_m)`` weights it by its share of the
        global batch (DDP then averages over ranks), so the step's gradient is the mean over all ``B``
        samples whatever the split; a ghost micro-batch (``n_m = 0``) gets an infinite divisor (weight 0).
        With ``batch_unit="tokens"``, ``B`` and ``n_m`` are tokens: a loss that is the mean over the micro-batch's
        tokens then gives the mean over the global batch's tokens.
        """
        first = micro[0]
        own = [m.indices for m in micro if not m.ghost]
        self.inflight = StepRecord(
            step=first.step,
            global_size=first.global_size,
            local_size=first.local_size,
            accumulation_steps=first.accumulation_steps,
            epoch=first.epoch,
            offset=first.offset,
            indices=np.concatenate(own) if own else np.empty(0, dtype=np.int64),
            ghosts=len(micro) - len(own),
            global_tokens=first.global_tokens,
            local_tokens=first.local_tokens,
        )
        self._loss = 0.0
        return [
            first.global_units / (self.world_size * m.units) if m.units else float("inf") for m in micro
        ]

    def restart_step(self, max_micro_batch_size: int) -> None:
        """The step in flight runs again from its first micro-batch (after running out of memory), in passes of
        at most ``max_micro_batch_size`` rows from now on: forget its losses and measurements so far."""
        self._loss = 0.0
        self.max_micro_batch_size = max_micro_batch_size
        self.oom_replays += 1
        if self.stats is not None:
            self.stats.restart_step()

    def add_loss(self, loss: torch.Tensor) -> None:
        """Add one micro-batch's (already weighted) loss, as ``Trainer.training_step`` returns it."""
        self._loss = self._loss + loss.detach()

    def lr_clock(self) -> int:
        """Samples (tokens) seen once the step in flight is done (what a sample-based LR schedule steps to)."""
        return self.driver.samples_seen + (self.inflight.global_units if self.inflight is not None else 0)

    def end_step(self) -> float:
        """Count the step in flight; return its mean loss over all ranks (a collective when distributed)."""
        step = self.inflight
        if step is None:
            raise RuntimeError("end_step() without a step in flight: get_batch_samples() did not run this step.")
        # Not engine.step_end.reduce_step_loss: these losses come weighted already (summed in the model's dtype);
        # weighting them again by B / W and dividing by B moves the last bit of about one loss in nine.
        loss = torch.as_tensor(self._loss, dtype=torch.float64).detach().reshape(1).cpu()
        if self.world_size > 1:
            loss = bpdist.all_reduce_sum(loss)
        # Each micro-batch returned mean * W * n / B, so the sum over all ranks is W times the global mean.
        self.last_loss = float(loss[0]) / self.world_size
        self.driver.end_step(step.global_units, self.last_loss)
        self._samples += step.global_size
        self.last_step, self.inflight = step, None
        return self.last_loss

    def decide(self, stats: Mapping[str, float] | None = None) -> int:
        """Ask the driver for the next size (rank 0 decides, all apply) and set it on the loader.

        With ``total_samples`` (``num_train_epochs``) the last step gets only the samples left, so training
        ends exactly there; the controller keeps seeing (and the checkpoint keeps) its own decision.
        """
        epoch, offset, _ = self.loader.position()
        global_batch_size = self.decided if self.decided is not None else self.loader.batch_size
        decided = self.decided = self.driver.decide(
            global_batch_size, epoch=epoch, coverage=offset / self.loader.sampler.num_samples, stats=stats
        )
        self.apply_size()
        if self.coupling is not None:
            self.coupling.scale(self.loader.next_step_size())
        if self.shares is not None:
            self.shares.after_step(self.driver.step)  # "auto": re-estimated on every rank (a collective when due)
        return decided

    def apply_size(self) -> None:
        """Set the loader to the decided size, cut to the samples left before ``total_samples`` (call between
        steps; rewinds whatever was prefetched at another size)."""
        global_batch_size = self.decided if self.decided is not None else self.loader.batch_size
        total, sampler = self.total_samples, self.loader.sampler
        # In tokens the budget is no sample count: a fractional num_train_epochs ends at the first step past it.
        left = None if total is None or self.lengths is not None else total - self.driver.samples_seen
        if total is not None and sampler.drop_last and total % sampler.num_samples == 0:
            # Whole epochs with drop_last: the final epoch ends as every other, its tail dropped when smaller than
            # the decided size (epochs_done() then ends the run). Cut to `left`, that tail would be trained as a
            # short step, or, when the look-ahead had dropped it already, the run would never count as finished.
            left = None
        self.loader.set_batch_size(left if left is not None and 0 < left < global_batch_size else global_batch_size)

    # ------------------------------------------------------------------ LR coupling
    def start_coupling(self, optimizer: torch.optim.Optimizer) -> None:
        """Scale the LR for the first step (or restore a saved coupling); call once the optimizer exists."""
        if self.lr_rule == "none" or self.coupling is not None:
            return
        # A resumed run keeps the LR rule's anchor: the first global batch of the original run (a resume under
        # another world size has another first global batch).
        state = self._coupling_state or {}
        base = int(state.get("base_batch_size", self.lr_anchor or self.driver.initial_batch_size))
        self.coupling = LRCoupling(optimizer, base, rule=self.lr_rule, knee=self.lr_knee)
        if self._coupling_state is not None:
            self.coupling.load_state_dict(self._coupling_state)  # the loaded optimizer holds the scaled LRs
        if not self.coupling.is_scaled:
            self.coupling.scale(self.loader.next_step_size())

    def unscale_lr(self) -> None:
        """Give the LR schedulers the schedule's own LR back (after the optimizer step)."""
        if self.coupling is not None and self.coupling.is_scaled:
            self.step_lr_factor = self.coupling.factor
            self.coupling.unscale()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Data position (with the next size), driver and controller, LR coupling: JSON-serialisable."""
        return {
            "loader": self.loader.state_dict(),
            "driver": self.driver.state_dict(),
            "coupling": None if self.coupling is None else self.coupling.state_dict(),
            "world_size": self.world_size,
            "stats": None if self.stats is None else self.stats.state_dict(),
            "max_micro_batch_size": self.max_micro_batch_size,
            "decided": self.decided,
            "rank_weights": None if self.shares is None else self.shares.state_dict(),
            "samples_seen": self.samples_seen,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (possibly saved under another world size)."""
        self.loader.load_state_dict(state["loader"])
        self.driver.load_state_dict(state["driver"])
        self._samples = int(state.get("samples_seen", self.driver.samples_seen))
        self._coupling_state = state.get("coupling")
        if self.stats is not None and state.get("stats") is not None:
            self.stats.load_state_dict(state["stats"])
        if state.get("max_micro_batch_size") is not None:  # a bound lowered after running out of memory stays
            self.max_micro_batch_size = int(state["max_micro_batch_size"])
        self.decided = None if state.get("decided") is None else int(state["decided"])
        if self.shares is not None:  # after the loader's state, which holds the weights it shared by
            self.shares.load_state_dict(state.get("rank_weights"))
