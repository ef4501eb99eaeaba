"""Context providers that read the data itself: the mix of labels (:class:`DataMix`: task ratios, the new-to-old
data ratio) and the mean of a per-sample score (:class:`DataScore`: difficulty) over the samples the next step
trains, for :class:`~batchpilot.controllers.ContextSchedule` (seed 003 §5.3, §7.1, §7.2).

They read the training loader's epoch order (a function of the seed and the epoch) from its data position (the
first sample not trained yet), both the same on every rank, so the context is the global batch's wherever it is
computed, and a resumed run, whose position is restored, sees exactly the context of an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from .._validation import check_batch_size
from ..data.loader import AdaptiveDataLoader
from ..data.sampler import AdaptiveBatchSampler

__all__ = ["DataMix", "DataScore", "next_samples"]

_SOURCES = ("a batchpilot.Pilot, an AdaptiveBatchSizeTrainer, the loader AdaptiveBatchSize.dataloader() returned, an "
            "AdaptiveDataLoader or AdaptiveBatchSampler, or a zero-argument callable returning one")


def data_position(source: Any) -> tuple[AdaptiveBatchSampler, int, int, int]:
    """``(sampler, epoch, offset, batch_size)``: the training data's sampler, where the next step starts (samples
    prefetched but not trained excluded) and the global batch size in force, read from ``source`` (see
    :meth:`DataMix.attach`).

    Raises:
        TypeError: ``source`` is none of those.
        RuntimeError: the trainer has no training run yet (call during ``train()``).
    """
    obj = source
    for _ in range(8):
        if isinstance(obj, AdaptiveDataLoader):
            epoch, offset, _ = obj.position()
            return obj.sampler, epoch, offset, obj.batch_size
        if isinstance(obj, AdaptiveBatchSampler):
            return obj, obj.epoch, obj.offset, obj.batch_size
        if hasattr(obj, "batchpilot"):  # AdaptiveBatchSizeTrainer: its run (and loader) exist while train() runs
            if obj.batchpilot is None:
                raise RuntimeError(f"{type(obj).__name__} has no training run yet: the context is read during train().")
            obj = obj.batchpilot
        elif hasattr(obj, "loader"):  # Pilot, the HF run, Lightning's AdaptiveLoader
            obj = obj.loader
        elif callable(obj):
            obj = obj()
        else:
            break
    raise TypeError(f"cannot read the data position from {source!r} of type {type(source).__name__}; attach "
                    f"{_SOURCES}.")


def next_samples(sampler: AdaptiveBatchSampler, epoch: int, offset: int, count: int) -> np.ndarray:
    """The dataset indices of the next ``count`` samples (at most one epoch's worth) of the sampler's stream
    from ``(epoch, offset)``, continuing into the next epoch's order at an epoch's end."""
    n = sampler.num_samples
    count = min(count, n)
    parts = []
    while count > 0:
        take = min(count, n - offset)
        parts.append(np.array(sampler.order(epoch)[offset:offset + take]))
        count, epoch, offset = count - take, epoch + 1, 0
    return np.concatenate(parts)


class _NextBatch:
    """What :class:`DataMix` and :class:`DataScore` share: the source, the window and the per-sample values."""

    def __init__(self, values: np.ndarray, key: str, window: int | None, source: Any) -> None:
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {key!r}; it names the context entry, e.g. key='difficulty'.")
        if values.ndim != 1 or len(values) == 0:
            raise ValueError(f"{type(self).__name__} needs one value per sample (a non-empty 1-d sequence, in dataset "
                             f"order); got an array of shape {values.shape}.")
        self.values, self.key, self.source = values, key, source
        self.window = None if window is None else check_batch_size(window, "window")

    def attach(self, source: Any) -> Any:
        """Read the data position from ``source`` (returns ``self``): a ``Pilot``, an ``AdaptiveBatchSizeTrainer``,
        the loader ``AdaptiveBatchSize.dataloader()`` returned (Lightning), an ``AdaptiveDataLoader`` or
        ``AdaptiveBatchSampler``, or a zero-argument callable returning one (read at each call)."""
        self.source = source
        return self

    def indices(self) -> np.ndarray:
        """Dataset indices of the samples the next step trains if the size in force stays: the next samples of the
        epoch order from the data position, as many as the global batch size in force (with ``batch_unit="tokens"``,
        as the token budget takes), the epoch's rest at most; with ``window``, the next ``window`` samples, into the
        next epoch's order if need be. With ``drop_last``, a tail of the epoch smaller than the size in force is
        skipped, as the sampler will drop it.

        Raises:
            RuntimeError: nothing was attached.
            ValueError: the values do not have one entry per sample of the training data.
        """
        if self.source is None:
            raise RuntimeError(f"{type(self).__name__} has no data to read: call .attach(source) with {_SOURCES}, "
                               "before training.")
        sampler, epoch, offset, batch_size = data_position(self.source)
        if len(self.values) != sampler.num_samples:
            raise ValueError(f"{type(self).__name__}(key={self.key!r}) has {len(self.values)} values, but the training "
                             f"data has {sampler.num_samples} samples; pass one value per sample, in dataset order.")
        plan = sampler.token_plan  # batch_unit="tokens": the size in force is a token budget
        left = sampler.num_samples - offset if plan is None else plan.left(sampler.order(epoch), epoch, offset)
        if sampler.drop_last and offset > 0 and left < batch_size:
            epoch, offset = epoch + 1, 0
        if self.window is not None:
            return next_samples(sampler, epoch, offset, self.window)
        order = sampler.order(epoch)  # the next step's samples if the size stays: never past the epoch's end
        take = batch_size if plan is None else plan.take(order, epoch, offset, batch_size)
        return np.array(order[offset:offset + take])


class DataMix(_NextBatch):
    """Each label's share of the samples the next step trains: ``{key: {label: share}}`` (seed 003 §5.3's task
    ratios: labels = each sample's task).

    Every label of ``labels`` is in the mapping (0.0 when absent from the window), in sorted order.

    Args:
        labels: One label per sample, in dataset order (task names, ``"new"``/``"old"``, ...): hashable and
            sortable (all strings, or all numbers).
        key: Name of the context entry.
        window: Samples to read (default: the next step's samples if the size in force stays; at an epoch's end,
            its rest).
        source: Where to read the data position (see :meth:`attach`); may be attached later.
    """

    def __init__(self, labels: Sequence[Hashable], *, key: str = "ratios", window: int | None = None,
                 source: Any = None) -> None:
        try:
            names, codes = np.unique(np.asarray(labels), return_inverse=True)
        except TypeError as exc:
            raise TypeError(f"DataMix labels must be all strings or all numbers ({exc}).") from None
        super().__init__(codes.reshape(-1), key, window, source)
        self.labels = [x.item() if isinstance(x, np.generic) else x for x in names]

    def __call__(self) -> dict[str, dict[Any, float]]:
        """``{key: {label: share}}`` over the next step's samples."""
        counts = np.bincount(self.values[self.indices()], minlength=len(self.labels))
        total = int(counts.sum())
        return {self.key: {label: int(c) / total for label, c in zip(self.labels, counts)}}


class DataScore(_NextBatch):
    """The mean of a per-sample score over the samples the next step trains: ``{key: mean}`` (seed 003 §7.2's
    difficulty; with 1.0 for new and 0.0 for old samples, §7.1's new-to-old data ratio).

    Args:
        scores: One finite number per sample, in dataset order (a difficulty, a loss from a reference model,
            a length, ``is_new``, ...).
        key: Name of the context entry.
        window, source: As for :class:`DataMix`.
        reduce: How the window's scores become one number (default ``numpy.mean``; e.g. ``numpy.max``).
    """

    def __init__(self, scores: Sequence[float], *, key: str = "score", window: int | None = None,
                 source: Any = None, reduce: Callable[[np.ndarray], Any] = np.mean) -> None:
        values = np.asarray(scores, dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(values)) if values.ndim == 1 else np.empty(0, dtype=np.int64)
        if len(bad):
            raise ValueError(f"DataScore scores must be finite; sample {int(bad[0])} has {values[bad[0]]}.")
        super().__init__(values, key, window, source)
        if not callable(reduce):
            raise TypeError(f"reduce must be a function from an array of scores to a number, got {reduce!r}.")
        self.reduce = reduce

    def __call__(self) -> dict[str, float]:
        """``{key: reduce(scores of the next step's samples)}``."""
        return {self.key: float(self.reduce(self.values[self.indices()]))}
