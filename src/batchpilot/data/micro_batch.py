"""Micro-batches: how one rank's share of a global batch is split into the forward/backward passes of a step.

``accumulation_steps`` is computed from the *largest* rank share, so every rank runs the same number of
micro-steps (DDP collectives never hang). A rank whose part is empty gets a *ghost* micro-batch: one borrowed
sample of the step, to be weighted 0, so that it still runs forward and backward with the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .sampler import SamplerPosition
from .shares import largest_share, share_bounds, smallest_share


@dataclass
class MicroBatch:
    """One micro-batch of one step on this rank.

    Attributes:
        data: The collated samples.
        indices: Dataset indices in ``data`` (a numpy array).
        micro_index: Position within the step, ``0 <= micro_index < accumulation_steps``.
        accumulation_steps: Micro-batches in this step (equal on every rank).
        local_size: This rank's samples in the step (the local batch size).
        global_size: Samples in the step over all ranks (the global batch size B).
        ghost: True when this rank's part of the step is empty (a final global batch smaller than the
            number of ranks, or than the accumulation steps). ``data`` then holds one sample of the step,
            borrowed so that every rank runs the same forward/backward (DDP collectives never hang); its
            loss gets weight 0 and it does not count as seen.
        epoch, offset: Position of the step's first sample: its epoch and the samples of that epoch
            consumed before the step.
        step: 0-based index of the optimizer step this micro-batch belongs to.
    """

    data: Any
    indices: np.ndarray
    micro_index: int
    accumulation_steps: int
    local_size: int
    global_size: int
    ghost: bool = False
    epoch: int = 0
    offset: int = 0
    step: int = 0

    @property
    def size(self) -> int:
        """Samples in this micro-batch that count (0 for a ghost)."""
        return 0 if self.ghost else len(self.indices)

    @property
    def is_last(self) -> bool:
        """True for the final micro-batch of its step."""
        return self.micro_index == self.accumulation_steps - 1


@dataclass
class PlannedMicroBatch:
    """A micro-batch cut from the sampler but not fetched yet: its indices, and where its step starts."""

    indices: np.ndarray
    micro_index: int
    accumulation_steps: int
    local_batch_size: int
    global_batch_size: int
    position: SamplerPosition  # the sampler's position at the step's start
    step: int
    ghost: bool = False

    def fetched(self, data: Any) -> MicroBatch:
        """The micro-batch with its collated ``data``."""
        return MicroBatch(data, self.indices, self.micro_index, self.accumulation_steps, self.local_batch_size,
                          self.global_batch_size, self.ghost, self.position.epoch, self.position.offset, self.step)


def accumulation_steps_for(global_batch_size: int, world_size: int, max_micro_batch_size: int | None,
                           weights: Sequence[float] | None = None) -> int:
    """Micro-batches per step: enough for the largest rank share (of the even split, or of one in proportion to
    ``weights``) to fit ``max_micro_batch_size``. Every rank runs this many, the ranks with smaller shares in
    smaller micro-batches, so every rank makes the same collective calls."""
    if max_micro_batch_size is None:
        return 1
    largest = largest_share(global_batch_size, world_size, weights)
    return max(1, -(-largest // max_micro_batch_size))


def split_even(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``parts`` contiguous pieces whose sizes differ by at most one."""
    return [share_bounds(n, i, parts) for i in range(parts)]


def wants_split(split_every: int | Callable[[int], bool] | None, step: int) -> bool:
    """Whether ``split_every`` (a period, a function of the step index, or ``None``) asks to split ``step``."""
    if split_every is None:
        return False
    return bool(split_every(step)) if callable(split_every) else step % split_every == 0


def plan_accumulation_steps(global_batch_size: int, world_size: int, *, accumulation_steps: int | None,
                            max_micro_batch_size: int | None, split: bool,
                            weights: Sequence[float] | None = None) -> int:
    """Micro-batches of a step: ``accumulation_steps`` when fixed, else enough for ``max_micro_batch_size``
    (shares in proportion to ``weights``, if given) and, with ``split``, at least 2 (two half-batches for a
    gradient-noise measurement) where every rank has a sample for each."""
    if accumulation_steps is not None:
        return accumulation_steps
    steps = accumulation_steps_for(global_batch_size, world_size, max_micro_batch_size, weights)
    if not split:
        return steps
    return max(steps, min(2, smallest_share(global_batch_size, world_size, weights)))


def plan_micro_batches(global_batch: np.ndarray, share: np.ndarray, accumulation_steps: int,
                       position: SamplerPosition, step: int) -> list[PlannedMicroBatch]:
    """Split this rank's ``share`` of ``global_batch`` into ``accumulation_steps`` near-equal micro-batches;
    an empty one becomes a ghost holding the step's first sample."""
    global_batch_size, local_batch_size = len(global_batch), len(share)
    if accumulation_steps == 1 and local_batch_size:  # the common case: one micro-batch per step
        return [PlannedMicroBatch(share, 0, 1, local_batch_size, global_batch_size, position, step)]
    return [
        PlannedMicroBatch(share[lo:hi], micro, accumulation_steps, local_batch_size, global_batch_size, position,
                          step)
        if hi > lo
        else PlannedMicroBatch(global_batch[:1], micro, accumulation_steps, local_batch_size, global_batch_size,
                               position, step, ghost=True)
        for micro, (lo, hi) in enumerate(split_even(local_batch_size, accumulation_steps))
    ]
