"""`AdaptiveDataLoader`: micro-batches of exactly the decided global batch, with workers and prefetching.

Each global batch (one optimizer step) is cut from an :class:`AdaptiveBatchSampler`; this rank's share is
split into ``accumulation_steps`` near-equal micro-batches of at most ``max_micro_batch_size`` samples.
``accumulation_steps`` is computed from the *largest* rank share, so every rank runs the same number of
micro-steps (DDP collectives never hang). A rank whose part is empty gets a *ghost* micro-batch: one
borrowed sample of the step, to be weighted 0, so that it still runs forward and backward with the rest.

Exact sizes with prefetching: with ``num_workers > 0`` torch's DataLoader asks the batch sampler for index
lists ahead of consumption. Every planned micro-batch remembers the sampler position at the start of its
step; when :meth:`set_batch_size` changes the size while micro-batches of later steps were already planned,
the loader rewinds the sampler to the first unconsumed step and restarts the worker iterator (persistent
workers drain their queue instead of restarting). Nothing prefetched under the old size reaches the
consumer, and no index is lost or repeated. The cost is one discarded prefetch window per change.
"""

from __future__ import annotations

import collections
import copy
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, default_collate, get_worker_info

from .._validation import check_batch_size, check_bool, check_positive_int
from ..rng import torch_rng
from .sampler import AdaptiveBatchSampler, share_bounds


@dataclass
class MicroBatch:
    """One micro-batch of one step on this rank.

    Attributes:
        data: The collated samples.
        indices: Dataset indices in ``data`` (a numpy array).
        micro_index: Position within the step, ``0 <= micro_index < accumulation_steps``.
        accumulation_steps: Micro-batches in this step (equal on every rank).
        local_size: This rank's samples in the step.
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
class _Planned:
    indices: np.ndarray
    micro_index: int
    accumulation_steps: int
    local_size: int
    global_size: int
    position: tuple[int, int, int, int, int]  # (epoch, offset, samples_seen, dropped, step) at the step's start
    ghost: bool = False


# DataLoader arguments that AdaptiveDataLoader owns (dataloader_kwargs may not set them).
_OWN_LOADER_KWARGS = frozenset({
    "dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "collate_fn", "num_workers",
    "pin_memory", "prefetch_factor", "persistent_workers", "generator",
})


def accumulation_steps_for(global_size: int, world_size: int, max_micro_batch_size: int | None) -> int:
    """Micro-batches per step: enough for the largest rank share to fit ``max_micro_batch_size``."""
    if max_micro_batch_size is None:
        return 1
    largest_share = -(-global_size // world_size)
    return max(1, -(-largest_share // max_micro_batch_size))


def split_even(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``parts`` contiguous pieces whose sizes differ by at most one."""
    return [share_bounds(n, i, parts) for i in range(parts)]


def _index_tensors(tensors: tuple[torch.Tensor, ...], indices: Any) -> list[torch.Tensor]:
    """Collate a TensorDataset batch by indexing (what default_collate would build, without the loop)."""
    index = torch.from_numpy(np.array(indices, dtype=np.int64))  # a copy: the epoch order is read-only
    # index_select needs the index on the tensor's device (a dataset may already live on the GPU).
    return [t.index_select(0, index if t.device.type == "cpu" else index.to(t.device)) for t in tensors]


class _BatchedTensors(Dataset):
    """A TensorDataset view whose ``__getitems__`` fetches a whole batch at once (used by workers)."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[index] for t in self.tensors)

    def __getitems__(self, indices: list[int]) -> list[list[torch.Tensor]]:
        return [_index_tensors(self.tensors, indices)]


def _first(batch: list[Any]) -> Any:
    return batch[0]


class _SeededIndices(list):
    """A micro-batch's index list, with the seed a worker fetches it with (see :class:`_SeededDataset`)."""

    seed: int | None = None


class _SeededDataset(Dataset):
    """The dataset as workers see it: each micro-batch is fetched with torch, numpy and ``random`` seeded from
    (loader seed, step, micro-batch, rank). Random augmentation in ``__getitem__`` then depends neither on
    which worker fetched the batch nor on how many there are, and a resumed run draws what the interrupted
    one did (persistent workers' own streams could not be restored). In the main process nothing is seeded:
    there the global generators, saved in checkpoints, are drawn from as usual.

    Attributes are read from and written to the user's dataset, so a ``worker_init_fn`` that sets something
    on ``get_worker_info().dataset`` (a per-worker file handle, say) reaches it."""

    def __init__(self, dataset: Any) -> None:
        object.__setattr__(self, "_bp_dataset", dataset)  # a name no user dataset is likely to have

    def __getattr__(self, name: str) -> Any:  # only for names the wrapper does not have itself
        if name == "_bp_dataset":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._bp_dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._bp_dataset, name, value)

    def __copy__(self) -> _SeededDataset:  # the user's __copy__/__deepcopy__ must not replace the wrapper
        return _SeededDataset(self._bp_dataset)

    def __deepcopy__(self, memo: dict[int, Any]) -> _SeededDataset:
        return _SeededDataset(copy.deepcopy(self._bp_dataset, memo))

    def __len__(self) -> int:
        return len(self._bp_dataset)

    def __getitem__(self, index: int) -> Any:
        return self._bp_dataset[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        seed = getattr(indices, "seed", None)
        if seed is not None and get_worker_info() is not None:
            torch.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed % 2**32)
        items = list(indices)
        getitems = getattr(self._bp_dataset, "__getitems__", None)
        return getitems(items) if getitems else [self._bp_dataset[i] for i in items]


class _PlanBatchSampler:
    """The batch sampler handed to torch's DataLoader: each ``__iter__`` plans from the current position."""

    def __init__(self, owner: AdaptiveDataLoader) -> None:
        self._owner = owner

    def __iter__(self) -> Iterator[list[int]]:
        return self._owner._emit()


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
        rng_device: When given, torch's RNG state (CPU, and this device's when it is a CUDA device) is kept in
            ``step_start_rng`` right before each step's first micro-batch is fetched (fetching may draw random
            numbers), so that a step run again draws what its first run drew.

    Attributes:
        split_every: When set (and ``accumulation_steps`` is not), every step whose index it divides gets at
            least 2 micro-batches (never more than the global batch has samples per rank): the two half-batches
            of a gradient-noise measurement.
        step_start_rng: See ``rng_device``; ``None`` until a step starts.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        max_micro_batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        persistent_workers: bool | None = None,
        sampler: AdaptiveBatchSampler | None = None,
        accumulation_steps: int | None = None,
        wrap_loader: Callable[[DataLoader], Iterable[Any]] | None = None,
        dataloader_kwargs: Mapping[str, Any] | None = None,
        rng_device: torch.device | str | None = None,
    ) -> None:
        if isinstance(dataset, DataLoader):
            raise TypeError(
                "dataset is a torch DataLoader; pass its dataset (loader.dataset): batchpilot cuts every batch itself, "
                "at the size of each step (num_workers=, collate_fn=, pin_memory= are arguments here too)."
            )
        if not callable(getattr(dataset, "__getitem__", None)):
            raise TypeError(f"dataset of type {type(dataset).__name__} cannot be indexed (no __getitem__); pass a "
                            "map-style dataset, e.g. a torch.utils.data.Dataset or TensorDataset.")
        try:
            length = len(dataset)  # type: ignore[arg-type]
        except TypeError as exc:
            if callable(getattr(dataset, "__len__", None)):  # there is one, returning something else than an int
                raise TypeError(f"len() of the dataset of type {type(dataset).__name__} failed ({exc}); its __len__ "
                                "must return the number of samples as an int.") from exc
            raise TypeError(
                f"dataset of type {type(dataset).__name__} has no __len__; AdaptiveDataLoader needs a map-style "
                "dataset with a known length (wrap an iterable in a list or a Dataset)."
            ) from exc
        if length == 0:
            raise ValueError("the dataset has 0 samples: there is nothing to train on; check that it was loaded.")
        if isinstance(dataset, IterableDataset):
            raise TypeError(
                f"dataset of type {type(dataset).__name__} is an IterableDataset: it cannot be indexed, and "
                "AdaptiveDataLoader cuts every batch from an index order; use a map-style dataset (__getitem__)."
            )
        self.dataset = dataset
        self.sampler = sampler or AdaptiveBatchSampler(
            length, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last, rank=rank, world_size=world_size
        )
        if self.sampler.num_samples != length:
            raise ValueError(
                f"sampler.num_samples={self.sampler.num_samples} but the dataset has {length} samples."
            )
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
        clash = sorted(set(extra) & _OWN_LOADER_KWARGS)
        if extra.get("in_order", True) is not True:  # data would meet another micro-batch's planned indices
            raise ValueError(f"dataloader_kwargs sets in_order={extra['in_order']!r}: micro-batches must arrive in "
                             "the order they were planned; leave in_order at True.")
        if clash:
            raise ValueError(
                f"dataloader_kwargs sets {', '.join(clash)}, which AdaptiveDataLoader sets itself; pass them as "
                "AdaptiveDataLoader arguments instead (batching is always the loader's own)."
            )
        self.collate_fn = collate_fn or default_collate
        self._planned: collections.deque[_Planned] = collections.deque()
        self._pending: collections.deque[Any] = collections.deque()
        self._exhausted = False
        self._torch_loader: DataLoader | None = None
        self._iterator: Iterator[Any] | None = None
        # The worker iterator no longer matches the sampler's position (a rewind, a loaded state, a new
        # epoch): the next pull starts a fresh one. Starting it plans its prefetched micro-batches, so a
        # fresh iterator must only ever start with nothing planned.
        self._stale = True
        self.rewinds = 0  # how often a size change discarded prefetched micro-batches
        self._current: tuple[int, int, int, int, int] | None = None  # step position of the last micro yielded
        self._next_step = 0  # index of the next step to plan
        self.split_every: int | None = None  # steps whose index it divides get at least 2 micro-batches
        self._rng_device = None if rng_device is None else torch.device(rng_device)
        self.step_start_rng: tuple[torch.Tensor, torch.Tensor | None] | None = None  # see _step_starts
        self.min_accumulation: Callable[[int], int] | None = None  # step index -> least micro-batches
        self.on_step_start: Callable[[], None] | None = None  # called before a step's first micro-batch is fetched
        self._wrapped: Iterable[Any] | None = None
        self._seed_fetches = False  # workers fetch each micro-batch with seeded generators (_SeededDataset)
        self._plan_moves = self.sampler.moves  # the sampler's set_epoch count when the plans were made
        self.sampler.next_epoch_of = self.epochs_done  # a tail left to drop counts as done: set_epoch drops it
        if self.num_workers > 0 or pin_memory or wrap_loader is not None:
            fast = type(dataset) is TensorDataset and self.collate_fn is default_collate
            self._seed_fetches = not fast and self.num_workers > 0
            self._torch_loader = DataLoader(
                _BatchedTensors(dataset.tensors) if fast else _SeededDataset(dataset),  # type: ignore[attr-defined]
                batch_sampler=_PlanBatchSampler(self),
                num_workers=self.num_workers,
                collate_fn=_first if fast else self.collate_fn,
                pin_memory=pin_memory,
                prefetch_factor=prefetch_factor,
                persistent_workers=(self.num_workers > 0) if persistent_workers is None else persistent_workers,
                # Worker seeds come from this generator, so starting or rewinding workers never draws from
                # the global torch RNG (dropout and friends stay reproducible across resume).
                generator=torch.Generator().manual_seed(self.sampler.seed),
                **extra,
            )
            self._wrapped = self._torch_loader if wrap_loader is None else wrap_loader(self._torch_loader)

    # ------------------------------------------------------------------ size
    @property
    def batch_size(self) -> int:
        """Global size of the next step to be planned."""
        return self.sampler.batch_size

    def set_batch_size(self, batch_size: int) -> None:
        """Set the global batch size from the next step on (call between steps)."""
        batch_size = check_batch_size(batch_size)
        if batch_size == self.sampler.batch_size:
            return
        self._check_between_steps("set_batch_size")
        self.sampler.set_batch_size(batch_size)  # before the rewind: a restarted worker iterator plans at once
        if self._planned:
            self._rewind()

    def epochs_done(self) -> int:
        """Full passes completed before the next step: ``position()``'s epoch, plus one when all that is
        left of the epoch is a tail that ``drop_last`` will drop (call between steps)."""
        self._drop_stale_plans()
        if self._planned:
            return self._planned[0].position[0]
        return self.sampler.epoch + self.sampler.at_tail_to_drop()

    def next_step_size(self) -> int:
        """Samples in the next global batch: the batch size, or the rest of the epoch when fewer are left
        (with ``drop_last``, such a rest is dropped and the next epoch's first batch counts). Call between
        steps."""
        self._drop_stale_plans()
        if self._planned:
            return self._planned[0].global_size
        s = self.sampler
        remaining = s.num_samples - s.offset
        if s.drop_last and remaining < s.batch_size:
            remaining = s.num_samples
        return min(s.batch_size, remaining)

    def set_max_micro_batch_size(self, size: int | None) -> None:
        """Change the micro-batch bound from the next step on (e.g. after running out of memory)."""
        size = None if size is None else check_batch_size(size, "max_micro_batch_size")
        self._check_between_steps("set_max_micro_batch_size")
        self.max_micro_batch_size = size
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

    def _rewind(self, position: tuple[int, int, int, int, int] | None = None) -> None:
        """Return to the start of the first unconsumed step (or of the step at ``position``), discarding
        what was planned after it. A ``set_epoch`` made since the plans keeps its epoch and offset: the
        counters go back to the first unconsumed step, the position stays the user's."""
        s = self.sampler
        moved = (s.epoch, s.offset) if position is None and s.moves != self._plan_moves else None
        s.epoch, s.offset, s.samples_seen, s.dropped_samples, self._next_step = position or self._planned[0].position
        if moved is not None:
            s.epoch, s.offset = moved
        self._planned.clear()
        self._pending.clear()
        self._exhausted = False
        self.rewinds += 1
        self._stale = True  # persistent workers drain their queue and resume from the rewound position

    def _drop_stale_plans(self) -> None:
        """Forget steps planned (prefetched) before a ``set_epoch`` moved the sampler: they are not what
        comes next."""
        if self._planned and self.sampler.moves != self._plan_moves:
            self._rewind()

    def _fresh_iterator(self) -> Iterator[Any]:
        """A new iterator over the worker loader (persistent workers resume from the sampler's position)."""
        if self._wrapped is None:
            raise RuntimeError("internal error: no worker loader to iterate (num_workers=0 runs in process)")
        if self._planned or self._pending:
            raise RuntimeError("internal error: a worker iterator was started while micro-batches were planned")
        self._stale = False
        return iter(self._wrapped)

    def _check_between_steps(self, what: str) -> None:
        if self._planned and self._planned[0].micro_index != 0:
            raise RuntimeError(
                f"{what} was called in the middle of a step; call it between steps "
                "(after the micro-batch whose is_last is True)."
            )

    # ------------------------------------------------------------------ planning
    def _plan_step(self) -> list[_Planned] | None:
        """Cut the next global batch and plan its micro-batches; ``None`` at the end of the epoch."""
        sampler = self.sampler
        self._plan_moves = sampler.moves
        position = (sampler.epoch, sampler.offset, sampler.samples_seen, sampler.dropped_samples, self._next_step)
        batch = sampler.next_global_batch()
        if batch is None:
            return None
        share = sampler.local_share(batch)
        if self.accumulation_steps is not None:
            steps = self.accumulation_steps
        else:
            steps = accumulation_steps_for(len(batch), sampler.world_size, self.max_micro_batch_size)
        if self.accumulation_steps is None:
            # More micro-batches on request (two half-batches for a gradient-noise measurement), never so
            # many that a rank would get an empty one.
            wanted = 2 if self.split_every is not None and self._next_step % self.split_every == 0 else 1
            if self.min_accumulation is not None:
                wanted = max(wanted, self.min_accumulation(self._next_step))
            steps = max(steps, min(wanted, len(batch) // sampler.world_size))
        self._next_step += 1
        if steps == 1 and len(share):  # the common case: one micro-batch per step
            part = _Planned(share, 0, 1, len(share), len(batch), position)
            self._planned.append(part)
            return [part]
        parts = [
            _Planned(share[lo:hi], micro, steps, len(share), len(batch), position)
            if hi > lo
            else _Planned(batch[:1], micro, steps, len(share), len(batch), position, ghost=True)
            for micro, (lo, hi) in enumerate(split_even(len(share), steps))
        ]
        self._planned.extend(parts)
        return parts

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
                indices = _SeededIndices(part.indices.tolist())
                if self._seed_fetches:
                    entropy = [self.sampler.seed, part.position[4], part.micro_index, self.sampler.rank]
                    indices.seed = int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> 1)
                yield indices

    def _step_starts(self) -> None:
        """A step's first micro-batch is about to be fetched: keep torch's RNG state for a replay of the step."""
        if self._rng_device is not None:
            self.step_start_rng = torch_rng(self._rng_device)
        if self.on_step_start is not None:
            self.on_step_start()

    def _fetch(self, indices: np.ndarray) -> Any:
        """Fetch and collate one micro-batch in this process (no workers)."""
        ds = self.dataset
        if type(ds) is TensorDataset and self.collate_fn is default_collate:
            return _index_tensors(ds.tensors, indices)
        items = indices.tolist()
        getitems = getattr(ds, "__getitems__", None)
        samples = getitems(items) if getitems else [ds[i] for i in items]
        return self.collate_fn(samples)

    def __iter__(self) -> Iterator[MicroBatch]:
        """Yield the micro-batches of the remaining steps of the current epoch.

        A loop left early (``break``) leaves its unfinished step to the next loop, which starts that step
        again from its first micro-batch. A loop that starts where only a tail to drop is left
        (``drop_last``) drops it and yields the next epoch.
        """
        if self._planned:
            self._rewind()  # keeps a set_epoch made since planning
        self.sampler.drop_tail()
        if self._torch_loader is None:
            return self._iter_in_process()
        return self._iter_workers()

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
            data = self._fetch(planned.indices)
            self._planned.popleft()
            yield self._micro(planned, data)

    def _iter_workers(self) -> Iterator[MicroBatch]:
        assert self._torch_loader is not None
        # Every loop starts a new worker iteration at the sampler's position (__iter__ rewound anything
        # planned before): a loop may have ended at an epoch's end without reading the old one to its end.
        self._pending.clear()
        self._exhausted = False
        self._stale = True
        while True:
            while not self._planned and not self._exhausted:
                self._pull()  # asking for data makes the DataLoader plan (and prefetch) further
            if not self._planned:
                return
            planned = self._planned[0]
            while not self._pending:
                if self._exhausted:
                    raise RuntimeError("the worker iterator ended before a planned micro-batch arrived.")
                self._pull()
            data = self._pending.popleft()
            self._planned.popleft()
            if planned.micro_index == 0 and self.num_workers > 0:
                self._step_starts()  # (without workers, _emit calls it before the DataLoader fetches)
            yield self._micro(planned, data)

    def _pull(self) -> None:
        if self._stale or self._iterator is None:
            self._iterator = self._fresh_iterator()
        try:
            self._pending.append(next(self._iterator))
        except StopIteration:
            self._exhausted = True

    def _micro(self, planned: _Planned, data: Any) -> MicroBatch:
        self._current = planned.position
        return MicroBatch(
            data,
            planned.indices,
            planned.micro_index,
            planned.accumulation_steps,
            planned.local_size,
            planned.global_size,
            planned.ghost,
            planned.position[0],
            planned.position[1],
            planned.position[4],
        )

    # ------------------------------------------------------------------ state
    def position(self) -> tuple[int, int, int]:
        """``(epoch, offset, samples_seen)`` at the first unconsumed step (prefetched steps excluded)."""
        self._drop_stale_plans()
        if self._planned:
            epoch, offset, seen, _, _ = self._planned[0].position
            return epoch, offset, seen
        s = self.sampler
        return s.epoch, s.offset, s.samples_seen

    def state_dict(self) -> dict[str, Any]:
        """The sampler position at the first unconsumed step (JSON-serialisable); call between steps."""
        self._drop_stale_plans()
        state = self.sampler.state_dict()
        state["step"] = self._next_step
        if self._planned:  # planned but unconsumed steps are not part of the position
            state["epoch"], state["offset"], state["samples_seen"], state["dropped_samples"], state["step"] = (
                self._planned[0].position
            )
        state["max_micro_batch_size"] = self.max_micro_batch_size
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (possibly saved under another world size)."""
        state = dict(state)
        micro = state.pop("max_micro_batch_size", self.max_micro_batch_size)
        micro = None if micro is None else check_batch_size(micro, "the saved max_micro_batch_size")
        step = check_positive_int(state.pop("step", 0), "the saved step", minimum=0)
        self.sampler.load_state_dict(state)
        self.max_micro_batch_size = micro
        self._next_step = step
        self._planned.clear()
        self._pending.clear()
        self._exhausted = False
        self._stale = True

    def close(self) -> None:
        """Stop the worker processes now; the position is kept and the next ``for`` loop starts new ones.

        Without it, persistent workers stop when the loader is garbage-collected. The loader is part of a
        reference cycle (its DataLoader's batch sampler points back to it), so that happens in a cyclic
        garbage collection, after multiprocessing has already closed the workers' queues; each worker then
        stops only at torch's join timeout (about 5 s per worker).
        """
        if self._planned:
            self._rewind()  # forget what was prefetched: the next loop plans it again
        self._iterator = None
        for loader in (self._torch_loader, getattr(self._wrapped, "base_dataloader", None)):
            if loader is not None and getattr(loader, "_iterator", None) is not None:
                loader._iterator = None  # its last reference: torch shuts the workers down cleanly
