"""What a Lightning checkpoint needs beyond the callback's state to resume exactly: loop counters that match the
data position, weights and optimizer, and every rank's generator states (Lightning saves none)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from ...rng import gather_rng_states, restore_rng_states, set_torch_rng, torch_rng

__all__ = ["RNG_KEY", "StepStart"]

RNG_KEY = "batchpilot_rng"  # the checkpoint's entry for every rank's generator states
_COUNTERS = ("ready", "started", "processed", "completed")  # of a Lightning progress tracker


class StepStart:
    """The start of the step in flight (Lightning's batch counters and torch's RNG), which a checkpoint saved
    inside the step goes back to; and a loaded checkpoint's generator states, restored as its first step starts."""

    def __init__(self) -> None:
        # Lightning's batch counters (over the fit, in the epoch) before the first micro-batch of the step in
        # flight, and its optimizer steps; None between steps.
        self.counters: dict[str, int] | None = None
        self.rng: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.loaded_rng: list[dict[str, Any]] | None = None

    def begin(self, trainer: Any, device: torch.device) -> None:
        """A step's first micro-batch starts (a resumed fit's first step draws as the saved run would have)."""
        if self.loaded_rng is not None:
            restore_rng_states(self.loaded_rng, trainer.global_rank, trainer.world_size, device)
            self.loaded_rng = None
        self.rng = torch_rng(device)
        progress = trainer.fit_loop.epoch_loop.batch_progress  # "ready" counts this micro-batch already
        self.counters = {"total": progress.total.ready - 1, "current": progress.current.ready - 1,
                         "optimizer_steps": trainer.global_step}

    def end(self) -> None:
        """The step is counted (or will run again whole): a checkpoint from now on is at a step boundary."""
        self.counters = None

    def load(self, checkpoint: dict[str, Any]) -> None:
        """Keep ``checkpoint``'s generator states for the resumed fit's first step (none in older checkpoints)."""
        self.loaded_rng = checkpoint.get(RNG_KEY)

    def save(self, trainer: Any, device: torch.device, checkpoint: dict[str, Any]) -> None:
        """Add every rank's generator states to ``checkpoint`` (a collective) and set its loop counters."""
        current = torch_rng(device)
        if self.counters is not None and self.rng is not None:
            set_torch_rng(self.rng, device)
        checkpoint[RNG_KEY] = gather_rng_states(trainer.world_size, device)
        set_torch_rng(current, device)
        loop = checkpoint.get("loops", {}).get("fit_loop")
        if loop is not None:
            self._set_loop_counters(trainer, loop)

    def _set_loop_counters(self, trainer: Any, loop: dict[str, Any]) -> None:
        """Inside a step, the batch counters go back to its first micro-batch; an epoch Lightning cut short is
        recorded as unfinished."""
        batches, epochs = loop["epoch_loop.batch_progress"], loop["epoch_progress"]
        if self.counters is not None:
            for part in ("total", "current"):
                batches[part].update(dict.fromkeys(_COUNTERS, self.counters[part]))
            batches["is_last_batch"] = False
            if trainer.global_step != self.counters["optimizer_steps"]:
                rank_zero_warn(
                    "this checkpoint is saved after the optimizer updated the weights for the step in flight but "
                    "before AdaptiveBatchSize counted that step (a callback listed before AdaptiveBatchSize, or a "
                    "signal handler, saved it): a fit resumed from it runs the step again. List checkpointing "
                    "callbacks after AdaptiveBatchSize in callbacks=[...]."
                )
        # The epoch loop has ended (processed counts it) before the data epoch did, and not at limit_train_batches.
        if epochs["total"]["processed"] == epochs["total"]["started"] > 0 and not batches["is_last_batch"] and \
                batches["current"]["ready"] < trainer.num_training_batches:
            for part in ("total", "current"):
                epochs[part]["processed"] = epochs[part]["completed"] = epochs[part]["started"] - 1
