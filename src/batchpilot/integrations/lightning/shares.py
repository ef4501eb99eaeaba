"""``rank_weights`` in a Lightning fit: :class:`~batchpilot.integrations._rank_shares.RankShares` rebuilt at each
fit's start for that fit's loader and ranks, its ``"auto"`` estimate carried over fits and through checkpoints."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ...data.loader import AdaptiveDataLoader
from ...data.micro_batch import MicroBatch
from ...data.shares import check_rank_weights
from .._rank_shares import RankShares

__all__ = ["FitShares"]

logger = logging.getLogger("batchpilot")


class FitShares:
    """The callback's ``rank_weights`` over its fits.

    Args:
        setting: ``None`` (even shares), ``"auto"`` or one positive weight per rank (the length is checked when
            a fit starts and the world size is known).

    Raises:
        TypeError, ValueError: ``setting`` is not a valid ``rank_weights``.
    """

    def __init__(self, setting: str | Sequence[float] | None) -> None:
        self.setting = check_rank_weights(setting, None)
        self.shares: RankShares | None = None
        self._state: dict[str, Any] | None = None  # restored from a checkpoint, for the next fit

    def start(self, trainer: Any, device: Any, loader: AdaptiveDataLoader) -> None:
        """A fit starts: share ``loader``'s batches over ``trainer``'s ranks, continuing the last fit's estimate or
        the checkpoint's.

        Raises:
            ValueError: fixed weights of another length than the world size.
        """
        carried = self.shares.state_dict() if self.shares is not None else self._state

        def changed(old: Any, new: Any, rates: list[float | None]) -> None:
            if trainer.global_rank == 0:
                logger.info("step %d: rank weights %s -> %s (samples per forward second: %s)", trainer.global_step,
                            old, new, [None if r is None else round(r, 1) for r in rates])

        self.shares = RankShares(self.setting, loader=loader, world_size=trainer.world_size, rank=trainer.global_rank,
                                 device=device, on_change=changed)
        self.shares.load_state_dict(carried)

    def forward_starts(self, micro: MicroBatch) -> None:
        """``micro``'s training step starts."""
        if self.shares is not None:
            self.shares.forward_starts(micro.micro_index == 0)

    def forward_ends(self, micro: MicroBatch) -> None:
        """``micro``'s loss is there (its backward starts; the forward is what counts, see ``_rank_shares``)."""
        if self.shares is not None:
            self.shares.forward_ends(micro.size)

    def after_step(self, step: int, loader: AdaptiveDataLoader) -> None:
        """After every optimizer step, on every rank: ``"auto"`` re-estimates (a collective when due) and sets the
        weights on ``loader`` (the fit's, also after Lightning reloaded it)."""
        if self.shares is not None:
            self.shares.loader = loader
            self.shares.after_step(step)

    def state_dict(self) -> dict[str, Any] | None:
        return self.shares.state_dict() if self.shares is not None else self._state

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Keep a checkpoint's state for the fit that resumes from it (applied in :meth:`start`)."""
        self._state, self.shares = state, None
