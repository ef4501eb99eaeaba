"""`AdaptiveBatchSampler`: exact data coverage under a global batch size that changes every step.

The sampler owns the position in the data stream. Each epoch has one fixed order (a function of
``(seed, epoch)`` alone); every global batch is the next ``global_batch_size`` indices of that order, and each
rank receives a contiguous share of it. Because the position is counted in *global samples*, not in batches,
any sequence of batch sizes and any world size cover each epoch exactly once, and a state saved under one
world size resumes under another.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._validation import check_batch_size, check_bool, check_positive_int
from .shares import RankWeights, checked_weights, loaded_weights, share_bounds
from .tokens import TokenPlan, check_token_state, token_state

logger = logging.getLogger("batchpilot")

_FORMAT = "batchpilot.AdaptiveBatchSampler"
_VERSION = 1
_STATE_KEYS = ("num_samples", "seed", "shuffle", "drop_last", "epoch", "offset", "batch_size",
               "samples_seen", "dropped_samples")


@dataclass(frozen=True)
class SamplerPosition:
    """Where a sampler stands: the ``offset``-th sample of ``epoch``'s order is the next one, after
    ``samples_seen`` samples yielded and ``dropped_samples`` dropped (``drop_last``) since the start."""

    epoch: int
    offset: int
    samples_seen: int
    dropped_samples: int


class AdaptiveBatchSampler:
    """A batch sampler whose global batch size can change before any batch.

    Iterating yields, for each global batch of the current epoch, the list of dataset indices that form
    this rank's share. ``set_batch_size(n)`` sets the global batch size of the next batch to be yielded.

    Guarantees, for any sequence of ``set_batch_size`` calls and any ``world_size``:

    * within an epoch the union over ranks of all shares is exactly ``range(num_samples)``, each index
      once (with ``drop_last=True`` the incomplete final batch, if any, is dropped and counted in
      ``dropped_samples``);
    * all ranks agree on every global batch size, and shares differ by at most one index (with
      :meth:`set_rank_weights`: are proportional to the ranks' weights, see :mod:`.shares`); a rank whose share
      of a small final batch is empty still yields (an empty list), so every rank yields the same number
      of batches and no DDP collective hangs (torch's ``default_collate`` fails on an empty list:
      :class:`~batchpilot.AdaptiveDataLoader` makes it a ghost micro-batch);
    * the order is a deterministic function of ``(seed, epoch)``, independent of the sizes chosen;
    * ``state_dict()`` is JSON-serialisable, and ``load_state_dict()`` on a fresh sampler, with any world
      size, continues with exactly the remaining indices; a state saved inside a loop is continued by the
      first loop after loading, which ends with that loop's epoch (also right after its last batch).

    Args:
        num_samples: Dataset length (> 0).
        batch_size: Initial global batch size (samples over all ranks).
        shuffle: Shuffle each epoch (with ``seed`` and the epoch number); else natural order.
        seed: Seed of the per-epoch permutation; must be equal on all ranks.
        drop_last: Drop an epoch's final batch when it would be smaller than the requested size.
        rank: This process's rank, ``0 <= rank < world_size``.
        world_size: Number of ranks sharing each global batch.

    Raises:
        TypeError, ValueError: an argument is of the wrong type or out of range; the message names it.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if isinstance(num_samples, int) and not isinstance(num_samples, bool) and num_samples == 0:
            raise ValueError(
                "num_samples is 0: the dataset is empty, so there is nothing to sample; "
                "check that the dataset was loaded."
            )
        self.num_samples = check_positive_int(num_samples, "num_samples")
        self._global_batch_size = check_batch_size(batch_size)
        self.world_size = check_positive_int(world_size, "world_size")
        self.rank = check_positive_int(rank, "rank", minimum=0)
        if self.rank >= self.world_size:
            raise ValueError(
                f"rank={self.rank} must be < world_size={self.world_size}; ranks count from 0."
            )
        self.seed = check_positive_int(seed, "seed", minimum=0)
        self.shuffle = check_bool(shuffle, "shuffle")
        self.drop_last = check_bool(drop_last, "drop_last")
        self.epoch = 0
        self.offset = 0
        self.samples_seen = 0
        self.dropped_samples = 0
        self.moves = 0  # how often set_epoch moved the position (a consumer's plans made before are stale)
        self._order_epoch = -1
        self._order: np.ndarray | None = None
        self._loop_epoch: int | None = None  # the epoch set_epoch named for the loop that follows
        self._loops = 0  # loops started, to tell the open one
        self._open_loop: tuple[int, int] | None = None  # (loop, its epoch) of the loop that yielded last
        self._resumed_loop: int | None = None  # epoch of the loop a loaded state was saved in
        self._plans_ahead = False  # a consumer cuts batches before using them (see plan_ahead)
        self._first_unused: SamplerPosition | None = None
        self._weights: RankWeights | None = None
        self.token_plan: TokenPlan | None = None  # batch sizes count tokens (set by the loader: see .tokens)

    # ---------------------------------------------------------------- size and position
    @property
    def batch_size(self) -> int:
        """Global batch size of the next batch to be yielded."""
        return self._global_batch_size

    def set_batch_size(self, batch_size: int) -> None:
        """Set the global batch size of the next batch (and of the ones after it, until changed again)."""
        self._global_batch_size = check_batch_size(batch_size)

    @property
    def rank_weights(self) -> RankWeights | None:
        """Each rank's weight in the share of the next global batches (``None``: even shares)."""
        return self._weights

    def set_rank_weights(self, weights: Sequence[float] | None) -> None:
        """Share the next global batches in proportion to ``weights``, one positive weight per rank (``None``:
        evenly). Every rank must set the same weights before the same batch (exact coverage needs it)."""
        self._weights = checked_weights(weights, self.world_size)

    @property
    def coverage(self) -> float:
        """Fraction of the current epoch already consumed, in ``[0, 1)``."""
        return self.offset / self.num_samples

    @property
    def virtual_epoch(self) -> float:
        """``samples_seen / num_samples``: passes over the data, fractional (seed 003's logged ``epoch``)."""
        return self.samples_seen / self.num_samples

    def position(self) -> SamplerPosition:
        """The position of the next batch (see :meth:`seek`)."""
        return SamplerPosition(self.epoch, self.offset, self.samples_seen, self.dropped_samples)

    def seek(self, position: SamplerPosition) -> None:
        """Continue from ``position`` (one :meth:`position` returned): a consumer that cut batches it then
        did not use goes back to the first of them.

        Raises:
            ValueError: the offset is outside the epoch.
        """
        if not 0 <= position.offset < self.num_samples:
            raise ValueError(f"cannot seek to offset={position.offset}: it must be in [0, {self.num_samples}).")
        self.epoch, self.offset = position.epoch, position.offset
        self.samples_seen, self.dropped_samples = position.samples_seen, position.dropped_samples

    def plan_ahead(self, first_unused: SamplerPosition | None) -> None:
        """For a consumer that cuts batches before it uses them (:class:`~batchpilot.AdaptiveDataLoader`):
        ``first_unused`` is where its first batch not used yet starts (``None``: it used every batch cut).

        From the first call on, :meth:`set_epoch` compares with the epoch of the consumer's next batch, and an
        epoch whose only rest is a tail to drop counts as done (the consumer's next loop drops it).
        """
        self._plans_ahead = True
        self._first_unused = first_unused

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, unless it is already the current epoch (resume-safe).

        Under an :class:`~batchpilot.AdaptiveDataLoader`, which plans ahead, the current epoch is that of
        its next unconsumed step. After loading a state saved inside a loop, the epoch of that loop is current:
        the next loop continues it (and ends at once if it had yielded its epoch's last batch).
        """
        epoch = check_positive_int(epoch, "epoch", minimum=0)
        if self._plans_ahead:
            first = self._first_unused
            current = first.epoch if first is not None else self.epoch + self.at_tail_to_drop()
        elif epoch == self._resumed_loop:
            return
        else:
            # Where only the current epoch's tail is left (a loop that stopped there), the tail belongs to this
            # epoch: moving on drops (and counts) it, and a loop for this epoch ends there (see __iter__).
            self._resumed_loop = None
            self._loop_epoch = epoch
            if epoch > self.epoch and self.at_tail_to_drop():
                self.drop_tail()
            current = self.epoch
        if epoch != current:
            self.epoch, self.offset = epoch, 0
            self.moves += 1
            self._first_unused = None  # the consumer's plans were made before the move

    def order(self, epoch: int | None = None) -> np.ndarray:
        """The full index order of ``epoch`` (default: the current one), a function of (seed, epoch)."""
        epoch = self.epoch if epoch is None else epoch
        if epoch != self._order_epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, epoch])
                self._order = rng.permutation(self.num_samples)
            else:
                self._order = np.arange(self.num_samples)
            self._order.setflags(write=False)  # shared with callers (and batch views): never mutable
            self._order_epoch = epoch
        assert self._order is not None
        return self._order

    # ---------------------------------------------------------------- batches
    def next_global_batch(self) -> np.ndarray | None:
        """Advance by one global batch and return all its indices, or ``None`` at the end of the epoch.

        At the end of an epoch the position rolls over to the next epoch (``offset`` 0), and ``None`` is
        returned once, so that a ``for`` loop over the sampler covers exactly one epoch.
        """
        remaining = self.num_samples - self.offset
        if self.drop_last and self._units_left() < self._global_batch_size:
            self._drop(remaining)
            return None
        plan = self.token_plan
        global_batch_size = min(self._global_batch_size, remaining) if plan is None else \
            plan.take(self.order(), self.epoch, self.offset, self._global_batch_size)
        batch = self.order()[self.offset : self.offset + global_batch_size]
        self.offset += global_batch_size
        self.samples_seen += global_batch_size
        if self.offset == self.num_samples:
            self.epoch, self.offset = self.epoch + 1, 0
        return batch

    def drop_tail(self) -> bool:
        """With ``drop_last``, end an epoch that was left with fewer samples than the batch size.

        ``next_global_batch`` drops such a tail lazily, since a smaller size decided meanwhile could still
        take it; a loop that starts there calls this first so that it trains the next epoch instead of
        ending at once. Returns whether a tail was dropped.
        """
        if not self.at_tail_to_drop():
            return False
        self._drop(self.num_samples - self.offset)
        return True

    def at_tail_to_drop(self) -> bool:
        """With ``drop_last``: only a tail smaller than the global batch size is left of the current epoch."""
        return self.drop_last and self.offset > 0 and self._units_left() < self._global_batch_size

    def _units_left(self) -> int:
        """What is left of the current epoch in the batch size's unit: samples, or tokens (:mod:`.tokens`)."""
        plan = self.token_plan
        return self.num_samples - self.offset if plan is None else plan.left(self.order(), self.epoch, self.offset)

    def _drop(self, remaining: int) -> None:
        self.dropped_samples += remaining
        logger.info("drop_last: dropped the final %d samples of epoch %d (global batch size %d)",
                    remaining, self.epoch, self._global_batch_size)
        self.epoch, self.offset = self.epoch + 1, 0

    def local_share(self, global_batch: np.ndarray) -> np.ndarray:
        """This rank's contiguous share of ``global_batch`` (by tokens when batch sizes count tokens)."""
        if self.token_plan is not None:
            start, stop = self.token_plan.step(global_batch, self.world_size, self._weights).bounds[self.rank]
            return global_batch[start:stop]
        start, stop = share_bounds(len(global_batch), self.rank, self.world_size, self._weights)
        return global_batch[start:stop]

    def __iter__(self) -> Iterator[list[int]]:
        """Yield this rank's share of each remaining global batch of the current epoch (of the next one
        when only a tail to drop is left, unless ``set_epoch`` named the current epoch: then that epoch ends).

        The first loop after :meth:`load_state_dict` of a state saved inside a loop is that loop going on: it
        ends with the saved loop's epoch, at once if that loop had yielded the epoch's last batch.
        """
        named, self._loop_epoch = self._loop_epoch, None
        resumed, self._resumed_loop = self._resumed_loop, None
        self._loops += 1
        loop, self._open_loop = self._loops, None  # a new loop: an older one left open is abandoned
        if resumed is not None:
            loop_epoch = resumed
        else:
            tail_of = self.epoch
            if self.drop_tail() and named == tail_of:
                return  # the loop set_epoch named for that epoch ends with it
            loop_epoch = self.epoch
        try:
            # The last batch of an epoch rolls the position over: the loop ends there, not one batch later.
            while self.epoch == loop_epoch:
                batch = self.next_global_batch()
                if batch is None:
                    return
                self._open_loop = (loop, loop_epoch)  # a state saved now is continued by the next loop
                yield self.local_share(batch).tolist()
        finally:
            if self._open_loop is not None and self._open_loop[0] == loop:
                self._open_loop = None

    def __len__(self) -> int:
        """Batches left in the current epoch if the batch size stays as it is now: what an iteration in
        progress still yields. Where only a tail to drop is left that is 0, although a new ``iter()`` drops
        the tail and yields the next epoch."""
        if self.token_plan is not None:
            return self.token_plan.batches_left(self.order(), self.epoch, self.offset, self._global_batch_size,
                                                self.drop_last)
        remaining = self.num_samples - self.offset
        full, rest = divmod(remaining, self._global_batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position; restorable under any rank and world size.

        Inside a loop over the sampler it also holds ``loop_epoch``, that loop's epoch, which the first loop
        after loading continues; states taken between loops do not have the key.
        """
        state: dict[str, Any] = {
            "format": _FORMAT,
            "version": _VERSION,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "epoch": self.epoch,
            "offset": self.offset,
            "batch_size": self._global_batch_size,
            "samples_seen": self.samples_seen,
            "dropped_samples": self.dropped_samples,
            "rank_weights": None if self._weights is None else list(self._weights),
        }
        state.update(token_state(self.token_plan))  # a budget in tokens, of these lengths
        loop_epoch = self._open_loop[1] if self._open_loop is not None else self._resumed_loop
        if loop_epoch is not None:
            state["loop_epoch"] = loop_epoch
        return state

    def order_mismatches(self, state: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
        """``(key, in state, here)`` for each of ``num_samples``, ``seed`` and ``shuffle`` that differs: a
        ``state`` of another dataset or order (keys it lacks are not compared)."""
        return [(key, state[key], getattr(self, key)) for key in ("num_samples", "seed", "shuffle")
                if key in state and state[key] != getattr(self, key)]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`, possibly under another world size).

        The state is checked whole before anything changes: a rejected state leaves the sampler as it was.

        Raises:
            ValueError: ``state`` is not a sampler state (foreign, from another version, incomplete or
                corrupt), or describes a different dataset or order.
        """
        position, global_batch_size, loop_epoch = self._checked(state)
        self._weights = loaded_weights(state.get("rank_weights"), self.world_size)
        self.drop_last = state["drop_last"]
        self.seek(position)
        self._global_batch_size = global_batch_size
        self._loop_epoch = self._open_loop = self._first_unused = None
        self._resumed_loop = loop_epoch

    def _checked(self, state: Any) -> tuple[SamplerPosition, int, int | None]:
        """The position, global batch size and loop epoch of ``state``, after checking all of it."""
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(
                f"not an AdaptiveBatchSampler state (format={state.get('format') if isinstance(state, dict) else type(state).__name__!r}); "
                "pass the dict returned by AdaptiveBatchSampler.state_dict()."
            )
        if state.get("version") != _VERSION:
            raise ValueError(
                f"sampler state has version={state.get('version')!r}, but this batchpilot reads version "
                f"{_VERSION}; resume with the batchpilot release that wrote it."
            )
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(
                f"sampler state is missing {', '.join(missing)}; "
                "pass the unmodified dict returned by AdaptiveBatchSampler.state_dict()."
            )
        mismatches = self.order_mismatches(state)
        if mismatches:
            key, saved, here = mismatches[0]
            raise ValueError(
                f"sampler state has {key}={saved!r} but this sampler has {key}={here!r}; "
                "resume with the same dataset, seed and shuffle setting."
            )
        check_token_state(state, self.token_plan)
        counted = [key for key in ("epoch", "offset", "samples_seen", "dropped_samples", "loop_epoch") if key in state]
        try:  # a corrupt field is a bad state (ValueError), whatever its type
            counts = {key: check_positive_int(state[key], f"sampler state's {key}", minimum=0) for key in counted}
            global_batch_size = check_batch_size(state["batch_size"], "sampler state's batch_size")
        except TypeError as err:
            raise ValueError(str(err)) from err
        if counts["offset"] >= self.num_samples:
            raise ValueError(f"sampler state has offset={counts['offset']}, outside [0, {self.num_samples}).")
        if not isinstance(state["drop_last"], bool):
            raise ValueError(f"sampler state has drop_last={state['drop_last']!r}; it must be True or False.")
        position = SamplerPosition(counts["epoch"], counts["offset"], counts["samples_seen"], counts["dropped_samples"])
        return position, global_batch_size, counts.get("loop_epoch")
