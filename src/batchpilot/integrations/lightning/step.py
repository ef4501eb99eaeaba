"""A step's end in a Lightning fit: its mean loss over all ranks, the values logged after it, and telling
Lightning which batch really ends an epoch (the loader's length is only an upper bound)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ... import distributed as bpdist
from ...data.micro_batch import MicroBatch
from ...measure import read_scalars

__all__ = ["StepLosses", "log_progress", "mark_last_batch"]


class StepLosses:
    """A step's micro-batch losses: detached tensors, read once the step ends (on a GPU a ``float()`` per
    micro-batch would wait for each forward before its backward is queued), with their factor and samples."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, float, int]] = []
        self.recorded: torch.Tensor | None = None  # the current micro-batch's mean loss, recorded by weight()

    def clear(self) -> None:
        self.pending, self.recorded = [], None

    def record(self, loss: torch.Tensor) -> None:
        """Keep the current micro-batch's mean loss, as ``weight()`` receives it."""
        self.recorded = loss.detach()

    def add(self, micro: MicroBatch, outputs: Any, accumulation_steps: int) -> None:
        """After a micro-batch: keep its mean loss, as ``weight()`` recorded it or as ``training_step`` returned it."""
        raw, factor, self.recorded = self.recorded, 1.0, None
        if raw is None:  # training_step did not call weight(): Lightning divided its loss by the accumulation
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if isinstance(loss, torch.Tensor):
                raw, factor = loss.detach(), float(accumulation_steps)
        if raw is not None and micro.size:
            self.pending.append((raw, factor, micro.size))

    def mean(self) -> float | None:
        """The step's mean loss over the samples of all ranks that reported one (``None``: none did); a collective.

        Not ``engine.step_end.reduce_step_loss``: that one divides by the global batch size, so a micro-batch
        whose ``training_step`` returned no loss (manual optimization) would count as a zero loss.
        """
        values = read_scalars([raw for raw, _, _ in self.pending])  # one device-to-host copy
        totals = torch.tensor([sum(v * f * n for v, (_, f, n) in zip(values, self.pending)),
                               float(sum(n for _, _, n in self.pending))], dtype=torch.float64)
        self.pending = []
        totals = bpdist.all_reduce_sum(totals)
        return float(totals[0] / totals[1]) if totals[1] > 0 else None


def log_progress(pl_module: Any, micro: MicroBatch, *, coverage: float, samples_seen: int, num_samples: int,
                 stats: Mapping[str, float] | None) -> None:
    """Log the step's global batch size and the epoch's coverage in the progress bar (whose total, the loader's
    length, is an upper bound), and ``samples_seen``, the coverage-based ``epoch`` and ``noise_scale`` beside them."""
    shown = {"batch_size": float(micro.global_size), "train_coverage": coverage}
    hidden = {"samples_seen": float(samples_seen), "epoch": samples_seen / num_samples}
    if stats and "stats/noise_scale" in stats:
        hidden["noise_scale"] = float(stats["stats/noise_scale"])
    for metrics, prog_bar in ((shown, True), (hidden, False)):
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=prog_bar,
                           batch_size=max(micro.size, 1), rank_zero_only=True)


def mark_last_batch(trainer: Any) -> None:
    """Tell Lightning that the batch in flight ends the epoch."""
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True
