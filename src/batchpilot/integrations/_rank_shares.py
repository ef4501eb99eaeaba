"""``rank_weights`` inside a framework's loop (the HF trainer, the Lightning callback): each global batch shared over
the ranks in proportion to per-rank weights, fixed or estimated online (``"auto"``).

``"auto"`` is :class:`~batchpilot.engine.rank_balance.RankBalancer` (LB-BSP, arXiv 1806.02508; Cannikin, arXiv
2402.05302) fed with each micro-batch's *forward* time per sample on this rank: the framework's backward under DDP
ends in the all-reduce, where a fast rank waits for the slow one, so it would hide the difference the weights are
to remove; the backward's cost is taken to scale like the forward's. The weights change between steps only, on
every rank alike (rank 0 decides), and the loader re-plans the steps it had planned ahead.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from ..controllers.goodput import LEAD_SHARE_KEY
from ..data.loader import AdaptiveDataLoader
from ..data.shares import RankWeights, check_rank_weights
from ..engine.rank_balance import RankBalancer, fold_and_update
from ..measure import MicroTimer

__all__ = ["RankShares", "with_lead_share"]

logger = logging.getLogger("batchpilot")


def with_lead_share(stats: dict[str, Any] | None, weights: Sequence[float] | None,
                    world_size: int) -> dict[str, Any] | None:
    """``stats`` with rank 0's share of the global batch (``dist/lead_share``) when ``weights`` make the shares
    uneven: ``Goodput``'s step-time model is fitted to rank 0's micro-batch times (as ``Pilot`` reports it)."""
    if weights is None or len(weights) != world_size or world_size < 2:
        return stats
    return {**(stats or {}), LEAD_SHARE_KEY: float(weights[0]) / math.fsum(weights)}


class RankShares:
    """One run's ``rank_weights``: fixed weights set on the loader, or ``"auto"``'s balancer and its timings.

    Args:
        setting: ``None`` (even shares), ``"auto"`` or one positive finite weight per rank.
        loader: The rank's loader (its sampler shares the global batches).
        world_size, rank: The data-parallel ranks and this one.
        device: The training device (CUDA forwards are timed with events).
        on_change: Called on every rank with ``(old, new, rates)`` when ``"auto"`` changes the weights.

    Raises:
        TypeError, ValueError: ``setting`` is not a valid ``rank_weights`` for ``world_size`` ranks.
    """

    def __init__(self, setting: Any, *, loader: AdaptiveDataLoader, world_size: int, rank: int, device: Any,
                 on_change: Callable[[RankWeights | None, RankWeights, list[float | None]], None] | None = None) -> None:
        self.setting = check_rank_weights(setting, world_size)
        self.loader = loader
        self.balancer = RankBalancer(world_size, rank) if self.setting == "auto" and world_size > 1 else None
        self.on_change = on_change
        self._timer = MicroTimer(device)
        self._pending: list[tuple[int, float | tuple[Any, Any]]] = []  # this step's (samples, forward timing)
        if isinstance(self.setting, tuple):
            loader.set_rank_weights(self.setting)

    @property
    def timed(self) -> bool:
        """Whether forwards are timed (``"auto"`` on more than one rank)."""
        return self.balancer is not None

    def forward_starts(self, first: bool) -> None:
        """A micro-batch's forward starts (``first``: the step's first; a step run again starts over)."""
        if self.balancer is not None:
            if first:
                self._pending.clear()
            self._timer.start()

    def forward_ends(self, samples: int) -> None:
        """That forward computed the loss of ``samples`` of this rank's samples (0: a ghost micro-batch)."""
        if self.balancer is not None:
            self._pending.append((samples, self._timer.stop()))

    def after_step(self, step: int) -> RankWeights | None:
        """After every optimizer step, on every rank: fold in the step's timings and re-estimate (a collective on
        the balancer's steps); new weights go to the loader before its next step is planned."""
        if self.balancer is None:
            return None
        old, new = fold_and_update(self.balancer, self._pending, self.loader, step)
        if new is not None and self.on_change is not None:
            self.on_change(old, new, list(self.balancer.rates))
        return new

    def state_dict(self) -> dict[str, Any]:
        """The setting and ``"auto"``'s estimate (JSON-serialisable); the weights in force are in the loader's state."""
        setting = list(self.setting) if isinstance(self.setting, tuple) else self.setting
        return {"setting": setting, "balancer": None if self.balancer is None else self.balancer.state_dict()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Continue from :meth:`state_dict` after the loader's state was loaded (``None``: a checkpoint without one).

        ``"auto"`` continues the saved estimate (even weights again when it was saved under another world size;
        the loaded shares when it was saved without ``"auto"``); fixed weights and ``None`` stay as set here, with a
        warning when the checkpoint's batches were shared otherwise."""
        loader = self.loader
        if self.balancer is not None:
            saved = (state or {}).get("balancer")
            if saved is not None:
                self.balancer.load_state_dict(saved)
            else:
                loaded = loader.sampler.rank_weights or (1.0,) * self.balancer.world_size
                self.balancer.weights = tuple(w * len(loaded) / math.fsum(loaded) for w in loaded)
            weights = self.balancer.weights
            loader.set_rank_weights(None if len(set(weights)) == 1 else weights)
            return
        here = self.setting if isinstance(self.setting, tuple) else None
        if loader.sampler.rank_weights != here:
            logger.warning("the checkpoint's global batches were shared with rank weights %s; continuing with "
                           "rank_weights=%s", loader.sampler.rank_weights, here)
            loader.set_rank_weights(here)
