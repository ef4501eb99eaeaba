"""`AdaptiveDataLoader`: micro-batches of exactly the decided global batch, with workers and prefetching.

Each global batch (one optimizer step) is cut from an :class:`AdaptiveBatchSampler`; this rank's share (even, or
weighted: :mod:`.shares`) is split into ``accumulation_steps`` near-equal micro-batches of at most
``max_micro_batch_size`` samples (:mod:`.micro_batch`), fetched in process or by a torch DataLoader's workers.

Exact sizes with prefetching: every planned micro-batch remembers the sampler position at its step's start; when
:meth:`set_batch_size` (or :meth:`set_rank_weights`) changes the size while workers prefetched later steps, the
loader seeks back to the first unconsumed step and restarts the worker iterator (one discarded prefetch window).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from .._validation import check_batch_size, check_bool, check_positive_int
from ..rng import torch_rng
from .fetch import (
    WorkerFeed,
    check_dataloader_kwargs,
    dataset_length,
    fetch_in_process,
    micro_batch_seed,
    seeded_indices,
)
from .micro_batch import (
    MicroBatch,
    PlannedMicroBatch,
    accumulation_for,
    accumulation_steps_for,
    plan_step,
    split_even,
    wants_split,
)
from .sampler import AdaptiveBatchSampler
from .shares import checked_weights
from .tokens import TokenStep, attach_tokens, next_step_units

__all__ = ["AdaptiveDataLoader", "MicroBatch", "accumulation_steps_for", "split_even"]


class AdaptiveDataLoader:
    """Iterate micro-batches whose steps follow the global batch size set before each step.

    Iterating yields :class:`MicroBatch` objects for the rest of the current epoch (like a DataLoader, one
    ``for`` loop is one epoch). Call :meth:`set_batch_size` between steps, that is after a micro-batch with
    ``is_last`` and before asking for the next one; the next step has exactly that size.

    Args:
        dataset: A map-style dataset with ``__len__``. A ``TensorDataset`` is fetched by tensor indexing and
            a dataset with ``__getitems__`` one batch at a time, both much faster than one sample at a time.
        batch_size: Initial global batch size.
        max_micro_batch_size: Upper bound of samples per forward/backward on one rank (``None``: no split).
        shuffle, seed, drop_last, rank, world_size: See :class:`AdaptiveBatchSampler`.
        num_workers, collate_fn, pin_memory, prefetch_factor, persistent_workers: As for
            ``torch.utils.data.DataLoader``; ``persistent_workers`` defaults to True when there are workers,
            which keeps a size change cheap.
        sampler: Use this sampler instead of building one (its settings win over the arguments above).
        accumulation_steps: Split every step into exactly this many micro-batches on every rank (ghost
            micro-batches where a rank's part is empty), for loops that run a fixed number of micro-batches
            per step (``transformers.Trainer``'s ``gradient_accumulation_steps``). Excludes
            ``max_micro_batch_size``.
        wrap_loader: Wrap the torch ``DataLoader`` that fetches micro-batches (e.g. ``accelerator.prepare``);
            the wrapper must yield one batch per index list, in order. With a wrapper the DataLoader is
            built even without workers, and a size change rewinds by re-iterating the wrapper.
        dataloader_kwargs: Further keyword arguments for that DataLoader (``multiprocessing_context``,
            ``worker_init_fn``, ``timeout``, ...); not those the loader sets itself, and not ``in_order=False``
            (micro-batches must arrive in the order they were planned).
        batch_unit, lengths, max_micro_batch_tokens: ``"tokens"``: batch sizes count tokens, ``lengths`` holds every
            sample's, a micro-batch at most ``max_micro_batch_tokens`` (:mod:`.tokens`); default ``"samples"``.
        rng_device: When given, torch's RNG state (CPU, and this device's when it is a CUDA device) is kept in
            ``step_start_rng`` right before each step's first micro-batch is fetched (fetching may draw random
            numbers), so that a step run again draws what its first run drew.

    Attributes:
        split_every: When set (and ``accumulation_steps`` is not), every step whose index it divides (an int),
            or for whose index it returns True (a function, e.g. an adaptive noise probe's ``splits``), gets at
            least 2 micro-batches (never more than the global batch has samples per rank): the two half-batches
            of a gradient-noise measurement. A function is asked again before a step planned ahead (workers)
            is consumed; a changed answer rewinds like a size change.
        step_start_rng: See ``rng_device``; ``None`` until a step starts.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, max_micro_batch_size: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, rank: int = 0, world_size: int = 1,
                 num_workers: int = 0, collate_fn: Callable[[list[Any]], Any] | None = None, pin_memory: bool = False,
                 prefetch_factor: int | None = None, persistent_workers: bool | None = None,
                 sampler: AdaptiveBatchSampler | None = None, accumulation_steps: int | None = None,
                 wrap_loader: Callable[[DataLoader], Iterable[Any]] | None = None,
                 dataloader_kwargs: Mapping[str, Any] | None = None,
                 rng_device: torch.device | str | None = None, batch_unit: str = "samples", lengths: Any = None,
                 max_micro_batch_tokens: int | None = None) -> None:
        length = dataset_length(dataset)
        self.dataset = dataset
        self.sampler = sampler or AdaptiveBatchSampler(
            length, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last, rank=rank, world_size=world_size
        )
        if self.sampler.num_samples != length:
            raise ValueError(
                f"sampler.num_samples={self.sampler.num_samples} but the dataset has {length} samples."
            )
        self.max_micro_batch_tokens = attach_tokens(self.sampler, dataset, batch_unit, lengths, max_micro_batch_tokens)
        self.max_micro_batch_size = (
            None if max_micro_batch_size is None else check_batch_size(max_micro_batch_size, "max_micro_batch_size")
        )
        self.accumulation_steps = (
            None if accumulation_steps is None else check_positive_int(accumulation_steps, "accumulation_steps")
        )
        if self.accumulation_steps is not None and self.max_micro_batch_size is not None:
            raise ValueError(
                f"accumulation_steps={accumulation_steps} and max_micro_batch_size={max_micro_batch_size} both "
                "decide how a step is split; pass only one of them."
            )
        self.num_workers = check_positive_int(num_workers, "num_workers", minimum=0)
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be a function from a list of samples to a batch, got {collate_fn!r}; "
                            "pass None for torch's default_collate.")
        if prefetch_factor is not None and self.num_workers == 0:
            raise ValueError(f"prefetch_factor={prefetch_factor!r} needs worker processes (num_workers > 0): without "
                             "them nothing is prefetched; pass num_workers=N or leave prefetch_factor at None.")
        check_bool(pin_memory, "pin_memory")
        extra = dict(dataloader_kwargs or {})
        check_dataloader_kwargs(extra)
        self.collate_fn = collate_fn or default_collate
        self.split_every: int | Callable[[int], bool] | None = None  # see the class docstring
        self.step_start_rng: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._rng_device = None if rng_device is None else torch.device(rng_device)
        self.rewinds = 0  # how often a size change discarded prefetched micro-batches
        self._planned: collections.deque[PlannedMicroBatch] = collections.deque()
        self._current: PlannedMicroBatch | None = None  # a micro-batch of the step last yielded from
        self._next_step = 0  # index of the next step to plan
        self._plan_moves = self.sampler.moves  # the sampler's set_epoch count when the plans were made
        self.sampler.plan_ahead(None)
        self._feed = None if self.num_workers == 0 and not pin_memory and wrap_loader is None else WorkerFeed(
            dataset, self._emit, collate_fn=self.collate_fn, num_workers=self.num_workers, pin_memory=pin_memory,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers, seed=self.sampler.seed,
            extra=extra, wrap_loader=wrap_loader,
        )

    # ------------------------------------------------------------------ size
    @property
    def batch_size(self) -> int:
        """Global batch size of the next step to be planned."""
        return self.sampler.batch_size

    def set_batch_size(self, batch_size: int) -> None:
        """Set the global batch size from the next step on (call between steps)."""
        global_batch_size = check_batch_size(batch_size)
        if global_batch_size == self.sampler.batch_size:
            return
        self._check_between_steps("set_batch_size")
        self.sampler.set_batch_size(global_batch_size)  # before the rewind: a restarted worker iterator plans at once
        if self._planned:
            self._rewind()

    def set_rank_weights(self, weights: Sequence[float] | None) -> None:
        """Share the global batches from the next step on in proportion to ``weights``, one positive weight per
        rank (``None``: evenly; see :mod:`.shares`); call between steps, on every rank with the same weights.
        Steps planned ahead are planned again, as after :meth:`set_batch_size`."""
        weights = checked_weights(weights, self.sampler.world_size)
        if weights != self.sampler.rank_weights:
            self._check_between_steps("set_rank_weights")
            self.sampler.set_rank_weights(weights)
            if self._planned:
                self._rewind()

    def epochs_done(self) -> int:
        """Full passes done before the next step: ``position()``'s epoch, +1 when all that is left of the
        epoch is a tail ``drop_last`` drops (call between steps)."""
        self._drop_stale_plans()
        if self._planned:
            return self._planned[0].position.epoch
        return self.sampler.epoch + self.sampler.at_tail_to_drop()

    def next_step_size(self) -> int:
        """Samples (tokens, in tokens) in the next global batch: the batch size, or the rest of the epoch when fewer are left
        (with ``drop_last``, such a rest is dropped and the next epoch's first batch counts). Call between
        steps."""
        self._drop_stale_plans()
        if self._planned:
            return self._planned[0].global_units
        return next_step_units(self.sampler)

    def set_max_micro_batch_size(self, size: int | None) -> None:
        """Change the micro-batch bound from the next step on (e.g. after running out of memory)."""
        bound = None if size is None else check_batch_size(size, "max_micro_batch_size")
        self._check_between_steps("set_max_micro_batch_size")
        self.max_micro_batch_size = bound
        if self._planned:
            self._rewind()

    def replay_step(self, max_micro_batch_size: int) -> None:
        """Plan the step of the last micro-batch yielded again, from its first micro-batch, split into
        micro-batches of at most ``max_micro_batch_size`` samples (after running out of memory in it).

        The step keeps its global batch (the same indices on every rank); the bound holds from then on.
        """
        bound = check_batch_size(max_micro_batch_size, "max_micro_batch_size")
        self.restart_step()
        self.max_micro_batch_size = bound

    def restart_step(self) -> None:
        """Plan the step of the last micro-batch yielded again, from its first micro-batch (its consumer
        left it unfinished): its samples count as not yet consumed, in the position and in checkpoints."""
        if self._current is None:
            raise RuntimeError("restart_step() was called before any micro-batch was yielded.")
        self._rewind(self._current)

    def _rewind(self, to_step_of: PlannedMicroBatch | None = None) -> None:
        """Return to the start of the first unconsumed step (or of the step of ``to_step_of``), discarding
        what was planned after it. A ``set_epoch`` made since the plans keeps its epoch and offset: the
        counters go back to the first unconsumed step, the position stays the user's."""
        planned = to_step_of or self._planned[0]
        position = planned.position
        if to_step_of is None and self.sampler.moves != self._plan_moves:
            moved = self.sampler.position()
            position = dataclasses.replace(position, epoch=moved.epoch, offset=moved.offset)
        self.sampler.seek(position)
        self._next_step = planned.step
        self._forget_plans()
        self.rewinds += 1

    def _forget_plans(self) -> None:
        """Drop every planned micro-batch and what workers fetched for them."""
        self._planned.clear()
        if self._feed is not None:
            self._feed.restart()
        self._share_first_unused()

    def _share_first_unused(self) -> None:
        """Tell the sampler where the first planned but unconsumed step starts, for ``set_epoch``."""
        fresh = self._planned and self.sampler.moves == self._plan_moves  # plans made before a move do not count
        self.sampler.plan_ahead(self._planned[0].position if fresh else None)

    def _drop_stale_plans(self) -> None:
        """Forget steps planned (prefetched) before a ``set_epoch`` moved the sampler: they are not what
        comes next."""
        if self._planned and self.sampler.moves != self._plan_moves:
            self._rewind()

    def _check_between_steps(self, what: str) -> None:
        if self._planned and self._planned[0].micro_index != 0:
            raise RuntimeError(
                f"{what} was called in the middle of a step; call it between steps "
                "(after the micro-batch whose is_last is True)."
            )

    # ------------------------------------------------------------------ planning
    def _plan_step(self) -> list[PlannedMicroBatch] | None:
        """Cut the next global batch and plan its micro-batches; ``None`` at the end of the epoch."""
        sampler = self.sampler
        self._plan_moves = sampler.moves
        position = sampler.position()
        batch = sampler.next_global_batch()
        if batch is None:
            return None
        step, plan = self._next_step, sampler.token_plan
        shares = None if plan is None else plan.step(batch, sampler.world_size, sampler.rank_weights)
        parts = plan_step(batch, sampler, shares, self._accumulation_for(len(batch), step, shares), position, step,
                          self.max_micro_batch_size, self.max_micro_batch_tokens)
        self._next_step += 1
        self._planned.extend(parts)
        self._share_first_unused()
        return parts

    def _accumulation_for(self, size: int, step: int, shares: TokenStep | None = None) -> int:
        return accumulation_for(size, shares, self.sampler, accumulation_steps=self.accumulation_steps,
                                max_micro_batch_size=self.max_micro_batch_size, split=wants_split(self.split_every, step),
                                max_micro_batch_tokens=self.max_micro_batch_tokens)

    def _split_changed(self) -> bool:
        """Whether the step about to be consumed was planned ahead with another split than asked for now."""
        first = self._planned[0]
        return first.micro_index == 0 and callable(self.split_every) and \
            first.accumulation_steps != self._accumulation_for(first.global_batch_size, first.step, first.token_step)

    def _emit(self) -> Iterator[list[int]]:
        """Plan the remaining steps of the current epoch; yield each micro-batch's index list."""
        start_epoch = self.sampler.epoch
        while self.sampler.epoch == start_epoch:
            if self.sampler.at_tail_to_drop():
                # Planning ahead stops at a tail to drop without dropping it: a smaller size decided before the
                # next step may still take it (as without workers); the next loop drops it if not.
                return
            parts = self._plan_step()
            if parts is None:
                return
            for part in parts:
                if part.micro_index == 0 and self.num_workers == 0:
                    self._step_starts()  # a DataLoader without workers (pin_memory) fetches right after this
                seed = None
                if self._feed is not None and self._feed.seeded:
                    seed = micro_batch_seed(self.sampler.seed, part.step, part.micro_index, self.sampler.rank)
                yield seeded_indices(part.indices, seed)

    def _step_starts(self) -> None:
        """A step's first micro-batch is about to be fetched: keep torch's RNG state for a replay of the step."""
        if self._rng_device is not None:
            self.step_start_rng = torch_rng(self._rng_device)

    def __iter__(self) -> Iterator[MicroBatch]:
        """Yield the micro-batches of the remaining steps of the current epoch.

        A loop left early (``break``) leaves its unfinished step to the next loop, which starts that step
        again from its first micro-batch. A loop that starts where only a tail to drop is left
        (``drop_last``) drops it and yields the next epoch.
        """
        if self._planned:
            self._rewind()  # keeps a set_epoch made since planning
        self.sampler.drop_tail()
        if self._feed is None:
            return self._iter_in_process()
        return self._iter_workers(self._feed)

    def _iter_in_process(self) -> Iterator[MicroBatch]:
        # Plan a step only once the previous one is consumed: nothing is ever planned ahead.
        start_epoch = self.sampler.epoch
        while True:
            if not self._planned:
                if self.sampler.epoch != start_epoch or self._plan_step() is None:
                    return
            planned = self._planned[0]
            if planned.micro_index == 0:
                self._step_starts()  # before the fetch: it may draw random numbers (augmentation)
            data = fetch_in_process(self.dataset, self.collate_fn, planned.indices)
            yield self._consume(data)

    def _iter_workers(self, feed: WorkerFeed) -> Iterator[MicroBatch]:
        # A new worker iteration at the sampler's position: the last loop may have left the old one unfinished.
        feed.restart()
        while True:
            if self._planned and self._split_changed():  # (between steps) plan it again with the split asked now
                self._rewind()
            while not self._planned and not feed.exhausted:
                feed.pull(nothing_planned=True)
            if not self._planned:
                return
            while not feed.pending:
                if feed.exhausted:
                    raise RuntimeError("the worker iterator ended before a planned micro-batch arrived.")
                feed.pull(nothing_planned=False)
            micro = self._consume(feed.pending.popleft())
            if micro.micro_index == 0 and self.num_workers > 0:
                self._step_starts()  # (without workers, _emit calls it before the DataLoader fetches)
            yield micro

    def _consume(self, data: Any) -> MicroBatch:  # the first planned micro-batch, fetched, leaves the plan
        planned = self._planned.popleft()
        self._share_first_unused()
        self._current = planned
        return planned.fetched(data)

    # ------------------------------------------------------------------ state
    def position(self) -> tuple[int, int, int]:
        """``(epoch, offset, samples_seen)`` at the first unconsumed step (prefetched steps excluded)."""
        self._drop_stale_plans()
        at = self._planned[0].position if self._planned else self.sampler.position()
        return at.epoch, at.offset, at.samples_seen

    def state_dict(self) -> dict[str, Any]:
        """The sampler position at the first unconsumed step (JSON-serialisable); call between steps."""
        self._drop_stale_plans()
        state = self.sampler.state_dict()
        state.pop("loop_epoch", None)  # the loader's loops are its own: a restored loader starts a new one
        state["step"] = self._next_step
        if self._planned:  # planned but unconsumed steps are not part of the position
            first = self._planned[0]
            state.update(dataclasses.asdict(first.position), step=first.step)
        state["max_micro_batch_size"] = self.max_micro_batch_size
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (possibly saved under another world size)."""
        state = dict(state)
        micro = state.pop("max_micro_batch_size", self.max_micro_batch_size)
        micro = None if micro is None else check_batch_size(micro, "the saved max_micro_batch_size")
        step = check_positive_int(state.pop("step", 0), "the saved step", minimum=0)
        state.pop("loop_epoch", None)
        self.sampler.load_state_dict(state)
        self.max_micro_batch_size = micro
        self._next_step = step
        self._forget_plans()

    def close(self) -> None:
        """Stop the worker processes now; the position is kept and the next ``for`` loop starts new ones.
        Without it persistent workers stop only in a cyclic garbage collection (the DataLoader's batch sampler
        points back here), after multiprocessing closed their queues: at torch's join timeout, ~5 s each."""
        if self._planned:
            self._rewind()  # forget what was prefetched: the next loop plans it again
        if self._feed is not None:
            self._feed.close()
