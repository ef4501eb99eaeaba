"""Fetching micro-batches: in process, or through a torch ``DataLoader`` whose workers fetch planned index lists.

A ``TensorDataset`` is fetched by tensor indexing and a dataset with ``__getitems__`` one batch at a time, both
much faster than one sample at a time. Workers fetch each micro-batch with generators seeded from its place
in the run, so random augmentation depends neither on the worker nor on a resume.
"""

from __future__ import annotations

import collections
import copy
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, default_collate, get_worker_info

# DataLoader arguments that AdaptiveDataLoader owns (dataloader_kwargs may not set them).
_OWN_LOADER_KWARGS = frozenset({
    "dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "collate_fn", "num_workers",
    "pin_memory", "prefetch_factor", "persistent_workers", "generator",
})


def dataset_length(dataset: Any) -> int:
    """The number of samples of a map-style ``dataset``.

    Raises:
        TypeError: ``dataset`` is a DataLoader, an IterableDataset, or cannot be indexed or measured.
        ValueError: it is empty.
    """
    if isinstance(dataset, DataLoader):
        raise TypeError(
            "dataset is a torch DataLoader; pass its dataset (loader.dataset): batchpilot cuts every batch itself, "
            "at the size of each step (num_workers=, collate_fn=, pin_memory= are arguments here too)."
        )
    if not callable(getattr(dataset, "__getitem__", None)):
        raise TypeError(f"dataset of type {type(dataset).__name__} cannot be indexed (no __getitem__); pass a "
                        "map-style dataset, e.g. a torch.utils.data.Dataset or TensorDataset.")
    try:
        length = len(dataset)
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
    return length


def check_dataloader_kwargs(extra: Mapping[str, Any]) -> None:
    """Refuse DataLoader arguments the loader sets itself, and ``in_order=False``.

    Raises:
        ValueError: naming the argument.
    """
    if extra.get("in_order", True) is not True:  # data would meet another micro-batch's planned indices
        raise ValueError(f"dataloader_kwargs sets in_order={extra['in_order']!r}: micro-batches must arrive in "
                         "the order they were planned; leave in_order at True.")
    clash = sorted(set(extra) & _OWN_LOADER_KWARGS)
    if clash:
        raise ValueError(
            f"dataloader_kwargs sets {', '.join(clash)}, which AdaptiveDataLoader sets itself; pass them as "
            "AdaptiveDataLoader arguments instead (batching is always the loader's own)."
        )


def _index_tensors(tensors: tuple[torch.Tensor, ...], indices: Any) -> list[torch.Tensor]:
    """Collate a TensorDataset batch by indexing (what default_collate would build, without the loop)."""
    index = torch.from_numpy(np.array(indices, dtype=np.int64))  # a copy: the epoch order is read-only
    # index_select needs the index on the tensor's device (a dataset may already live on the GPU).
    return [t.index_select(0, index if t.is_cpu else index.to(t.device)) for t in tensors]


def fetch_in_process(dataset: Any, collate_fn: Callable[[list[Any]], Any], indices: np.ndarray) -> Any:
    """Fetch and collate one micro-batch in this process (no workers)."""
    if type(dataset) is TensorDataset and collate_fn is default_collate:
        return _index_tensors(dataset.tensors, indices)
    items = indices.tolist()
    getitems = getattr(dataset, "__getitems__", None)
    samples = getitems(items) if getitems else [dataset[i] for i in items]
    return collate_fn(samples)


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


class SeededIndices(list):
    """A micro-batch's index list, with the seed a worker fetches it with (see :class:`_SeededDataset`)."""

    seed: int | None = None


def seeded_indices(indices: np.ndarray, seed: int | None) -> SeededIndices:
    """``indices`` as the list handed to the DataLoader, fetched with ``seed`` in a worker (``None``: unseeded)."""
    listed = SeededIndices(indices.tolist())
    listed.seed = seed
    return listed


def micro_batch_seed(loader_seed: int, step: int, micro_index: int, rank: int) -> int:
    """The seed a worker fetches a micro-batch with: a function of its place in the run only."""
    entropy = [loader_seed, step, micro_index, rank]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> 1)


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

    def __init__(self, plan: Callable[[], Iterator[list[int]]]) -> None:
        self._plan = plan

    def __iter__(self) -> Iterator[list[int]]:
        return self._plan()


class WorkerFeed:
    """The data of planned micro-batches, in plan order, from a torch DataLoader over ``plan()``'s index lists
    (workers, ``pin_memory``, or a ``wrap_loader`` such as ``accelerator.prepare``).

    Starting an iteration plans its prefetched micro-batches, so a fresh one only ever starts with nothing
    planned; after a rewind, a loaded state or a new loop the next pull starts one (persistent workers drain
    their queue and resume from the sampler's position).

    Attributes:
        pending: Fetched data not consumed yet, in plan order.
        exhausted: The current iteration has ended.
        seeded: Each micro-batch must be fetched with seeded generators (workers, and a dataset other than a
            plain TensorDataset).
    """

    def __init__(self, dataset: Any, plan: Callable[[], Iterator[list[int]]], *,
                 collate_fn: Callable[[list[Any]], Any], num_workers: int, pin_memory: bool,
                 prefetch_factor: int | None, persistent_workers: bool | None, seed: int, extra: Mapping[str, Any],
                 wrap_loader: Callable[[DataLoader], Iterable[Any]] | None) -> None:
        fast = type(dataset) is TensorDataset and collate_fn is default_collate
        self.seeded = not fast and num_workers > 0
        self.loader = DataLoader(
            _BatchedTensors(dataset.tensors) if fast else _SeededDataset(dataset),
            batch_sampler=_PlanBatchSampler(plan),
            num_workers=num_workers,
            collate_fn=_first if fast else collate_fn,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor,
            persistent_workers=(num_workers > 0) if persistent_workers is None else persistent_workers,
            # Worker seeds come from this generator, so starting or rewinding workers never draws from the
            # global torch RNG (dropout and friends stay reproducible across resume).
            generator=torch.Generator().manual_seed(seed),
            **extra,
        )
        self.wrapped: Iterable[Any] = self.loader if wrap_loader is None else wrap_loader(self.loader)
        self.pending: collections.deque[Any] = collections.deque()
        self.exhausted = False
        self._iterator: Iterator[Any] | None = None
        self._stale = True

    def restart(self) -> None:
        """Drop what was fetched: the next pull starts a new iteration at the sampler's position."""
        self.pending.clear()
        self.exhausted = False
        self._stale = True

    def pull(self, *, nothing_planned: bool) -> None:
        """Fetch the next micro-batch's data into ``pending`` (asking for data makes the DataLoader plan, and
        prefetch, further), or mark the iteration ``exhausted``."""
        if self._stale or self._iterator is None:
            if not nothing_planned or self.pending:
                raise RuntimeError("internal error: a worker iterator was started while micro-batches were planned")
            self._stale = False
            self._iterator = iter(self.wrapped)
        try:
            self.pending.append(next(self._iterator))
        except StopIteration:
            self.exhausted = True

    def close(self) -> None:
        """Stop the worker processes now (the next pull starts new ones)."""
        self._iterator = None
        for loader in (self.loader, getattr(self.wrapped, "base_dataloader", None)):
            if loader is not None and getattr(loader, "_iterator", None) is not None:
                loader._iterator = None  # its last reference: torch shuts the workers down cleanly
