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

from .sampler import AdaptiveBatchSampler, SamplerPosition
from .shares import largest_share, share_bounds, smallest_share
from .tokens import TokenStep, split_tokens


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
        tokens, local_tokens, global_tokens: With ``batch_unit="tokens"`` (:mod:`.tokens`): the tokens of this
            micro-batch (0 for a ghost), of this rank's share and of the global batch; ``None`` otherwise.
        samples_seen: Samples consumed by the steps before this one.
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
    tokens: int | None = None
    local_tokens: int | None = None
    global_tokens: int | None = None
    samples_seen: int = 0

    @property
    def size(self) -> int:
        """Samples in this micro-batch that count (0 for a ghost)."""
        return 0 if self.ghost else len(self.indices)

    @property
    def units(self) -> int:
        """What this micro-batch counts for in its step: its samples, or its tokens when batches count tokens."""
        return self.size if self.tokens is None else self.tokens

    @property
    def global_units(self) -> int:
        """The global batch size in its unit: samples, or tokens when batches count tokens."""
        return self.global_size if self.global_tokens is None else self.global_tokens

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
    tokens: int | None = None  # with batch_unit="tokens": this micro-batch's, this rank's and the step's tokens
    local_tokens: int | None = None
    global_tokens: int | None = None
    token_step: Any = None  # the step's data.tokens.TokenStep (its shares), to plan its split again

    @property
    def global_units(self) -> int:
        """The step's size in its unit (samples, or tokens)."""
        return self.global_batch_size if self.global_tokens is None else self.global_tokens

    def fetched(self, data: Any) -> MicroBatch:
        """The micro-batch with its collated ``data``."""
        return MicroBatch(data, self.indices, self.micro_index, self.accumulation_steps, self.local_batch_size,
                          self.global_batch_size, self.ghost, self.position.epoch, self.position.offset, self.step,
                          self.tokens, self.local_tokens, self.global_tokens, self.position.samples_seen)


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


def plan_token_micro_batches(global_batch: np.ndarray, step_shares: TokenStep, rank: int, accumulation_steps: int,
                             position: SamplerPosition, step: int,
                             max_micro_batch_size: int | None,
                             max_micro_batch_tokens: int | None = None) -> list[PlannedMicroBatch]:
    """Split ``rank``'s share of a global batch counted in tokens into ``accumulation_steps`` contiguous
    micro-batches balanced in tokens (:func:`.tokens.split_tokens`); an empty one is a ghost (0 tokens)."""
    start, stop = step_shares.bounds[rank]
    share, cumulative = global_batch[start:stop], step_shares.share_cumulative(rank)
    local_tokens, global_tokens = int(cumulative[-1]), step_shares.tokens
    planned = []
    for micro, (lo, hi) in enumerate(split_tokens(cumulative, accumulation_steps, max_micro_batch_size,
                                                             max_micro_batch_tokens)):
        ghost = hi <= lo
        planned.append(PlannedMicroBatch(
            global_batch[:1] if ghost else share[lo:hi], micro, accumulation_steps, len(share), len(global_batch),
            position, step, ghost, 0 if ghost else int(cumulative[hi] - cumulative[lo]), local_tokens, global_tokens,
            step_shares))
    return planned


def accumulation_for(global_batch_size: int, shares: TokenStep | None, sampler: AdaptiveBatchSampler, *,
                     accumulation_steps: int | None, max_micro_batch_size: int | None,
                     max_micro_batch_tokens: int | None, split: bool) -> int:
    """Micro-batches of a step on every rank (:func:`plan_accumulation_steps`; in tokens, for the step's token
    ``shares``: :meth:`.tokens.TokenStep.accumulation_steps`)."""
    if shares is not None:
        return shares.accumulation_steps(fixed=accumulation_steps, max_tokens=max_micro_batch_tokens,
                                         max_samples=max_micro_batch_size, split=split)
    return plan_accumulation_steps(global_batch_size, sampler.world_size, accumulation_steps=accumulation_steps,
                                   max_micro_batch_size=max_micro_batch_size, split=split, weights=sampler.rank_weights)


def plan_step(global_batch: np.ndarray, sampler: AdaptiveBatchSampler, shares: TokenStep | None,
              accumulation_steps: int, position: SamplerPosition, step: int,
              max_micro_batch_size: int | None, max_micro_batch_tokens: int | None = None) -> list[PlannedMicroBatch]:
    """This rank's planned micro-batches of ``global_batch``: its share in samples, or in tokens (``shares``)."""
    if shares is None:
        return plan_micro_batches(global_batch, sampler.local_share(global_batch), accumulation_steps, position, step)
    return plan_token_micro_batches(global_batch, shares, sampler.rank, accumulation_steps, position, step,
                                    max_micro_batch_size, max_micro_batch_tokens)
