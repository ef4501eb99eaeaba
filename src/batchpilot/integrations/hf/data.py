"""The train data of the Hugging Face integration: the adaptive loader Trainer iterates, its loop bounds, one
step's micro-batches, and a micro-batch's rows cut into forward/backward passes."""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher
from transformers.trainer_utils import seed_worker

from ...data.loader import AdaptiveDataLoader, MicroBatch, split_even


class TrainLoader:
    """One epoch of :class:`~batchpilot.MicroBatch` objects per ``iter()``; ``len()`` is an upper bound.

    ``Trainer`` computes its loop bounds from ``len(train_dataloader)``. Every optimizer step consumes at
    least one sample, so an epoch has at most ``len(dataset)`` steps of ``accumulation_steps``
    micro-batches each: that bound never ends an epoch early. The epoch really ends when the iterator does
    (the trainer then stops the epoch). ``set_epoch`` is ignored: the position belongs to the sampler.
    """

    def __init__(self, loader: AdaptiveDataLoader, accumulation_steps: int) -> None:
        self.loader = loader
        self.dataset = loader.dataset
        self.num_samples = loader.sampler.num_samples
        self._length = self.num_samples * accumulation_steps  # every step takes >= 1 sample

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[MicroBatch]:
        return iter(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the sampler counts epochs by data coverage, and a resumed run starts mid-epoch."""


def check_train_dataset(dataset: Any) -> None:
    """Raise unless ``dataset`` is a map-style dataset with a length (the sampler cuts global batches from it)."""
    if dataset is None:
        raise ValueError("Trainer: training requires a train_dataset.")
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError(
            f"train_dataset of type {type(dataset).__name__} has no length; AdaptiveBatchSizeTrainer cuts "
            "global batches from a map-style dataset (with __len__ and __getitem__). Materialise it first."
        )


def build_loader(dataset: Any, collator: Any, args: Any, *, global_batch_size: int, world_size: int,
                 wrap_loader: Callable[[torch.utils.data.DataLoader], Any], batch_unit: str = "samples",
                 lengths: Any = None) -> AdaptiveDataLoader:
    """The rank's adaptive loader with the TrainingArguments' data settings; ``wrap_loader`` prepares each
    DataLoader it builds (accelerate's device placement and look-ahead). With ``batch_unit="tokens"`` the sizes
    count tokens (``lengths``: every sample's)."""
    workers = args.dataloader_num_workers
    extra: dict[str, Any] = {"in_order": True}  # micro-batches must arrive in the order they were planned
    if workers > 0:
        extra["worker_init_fn"] = functools.partial(seed_worker, num_workers=workers, rank=args.process_index)
        context = getattr(args, "dataloader_multiprocessing_context", None)  # transformers >= 5.x
        if context is not None:
            extra["multiprocessing_context"] = context
    return AdaptiveDataLoader(
        dataset,
        global_batch_size,
        shuffle=getattr(args, "train_sampling_strategy", "random") != "sequential",
        seed=args.data_seed if args.data_seed is not None else args.seed,
        drop_last=args.dataloader_drop_last,
        rank=args.process_index,
        world_size=world_size,
        num_workers=workers,
        collate_fn=collator,
        pin_memory=args.dataloader_pin_memory and args.device.type != "cpu",
        prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
        persistent_workers=workers > 0,  # a size change then drains the queue instead of new processes
        accumulation_steps=args.gradient_accumulation_steps,
        wrap_loader=wrap_loader,
        dataloader_kwargs=extra,
        batch_unit=batch_unit,
        lengths=lengths,
    )


def prepare_unsharded(accelerator: Any, dataloader: torch.utils.data.DataLoader) -> Any:
    """``accelerator.prepare`` (device placement, look-ahead), with the rank sharding made a pass-through.

    Raises:
        ValueError: accelerate dispatches batches from rank 0 (``dispatch_batches=True``).
    """
    even = accelerator.even_batches
    # Our sampler already gives every rank the same number of batches; accelerate < 1.14 refuses a batch
    # sampler without a fixed batch_size under even_batches=True, so prepare this loader without it.
    accelerator.even_batches = False
    try:
        prepared = accelerator.prepare(dataloader)
    finally:
        accelerator.even_batches = even
    if isinstance(prepared, DataLoaderDispatcher):
        raise ValueError(
            "accelerate dispatches batches from rank 0 (dispatch_batches=True), which cannot split batches of "
            "changing size; pass TrainingArguments(accelerator_config={'dispatch_batches': False})."
        )
    shard = getattr(prepared, "batch_sampler", None)
    if isinstance(shard, BatchSamplerShard):
        # The sampler already yields this rank's share; sharding again would drop 1 - 1/W of the data.
        shard.num_processes, shard.process_index = 1, 0
    return prepared


def loop_bounds(args: Any, num_samples: int, initial_batch_size: int) -> tuple:
    """``Trainer.set_initial_training_values``' bounds that never cut an epoch short: our epochs end by
    coverage, training by epochs (samples) or ``max_steps``."""
    steps_bound = num_samples  # every step takes >= 1 sample
    if args.max_steps > 0:
        max_steps, epochs, train_samples = args.max_steps, sys.maxsize, args.max_steps * initial_batch_size
    else:
        train_samples = math.ceil(args.num_train_epochs * num_samples)
        max_steps, epochs = train_samples, math.ceil(args.num_train_epochs)  # an upper bound; stop by samples
    return (
        epochs, steps_bound, num_samples, train_samples, initial_batch_size,
        steps_bound * args.gradient_accumulation_steps, max_steps,
    )


def next_step(epoch_iterator: Any, accumulation_steps: int) -> list[MicroBatch]:
    """The next optimizer step's micro-batches from Trainer's epoch iterator; empty when the epoch is covered.

    Raises:
        RuntimeError: the step does not have ``accumulation_steps`` micro-batches.
    """
    micro = []
    for m in epoch_iterator:
        micro.append(m)
        if m.is_last:
            break
    if micro and (len(micro) != accumulation_steps or not micro[-1].is_last):
        raise RuntimeError(
            f"a step yielded {len(micro)} micro-batches but Trainer expects {accumulation_steps}; "
            "the training loop and the loader disagree on gradient_accumulation_steps."
        )
    return micro


def is_hf_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``datasets.Dataset`` (without importing ``datasets``)."""
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(dataset, datasets.Dataset)


def mask_labels(data: Any, floats: bool = False) -> Any:
    """A ghost micro-batch with ``labels`` (and ``shift_labels``, which Trainer counts instead when a
    collator gives them) set to -100, which losses ignore and Trainer's item count skips.

    Float labels (regression, soft labels) are masked only with ``floats=True``, for the count: in a forward
    -100 would be a value, not a mark."""
    if not isinstance(data, dict):
        return data
    masked = {}
    for key in ("labels", "shift_labels"):
        labels = data.get(key)
        if isinstance(labels, torch.Tensor) and (floats or not labels.is_floating_point()):
            masked[key] = torch.full_like(labels, -100)
    return {**data, **masked} if masked else data


def split_rows(inputs: Any, max_rows: int | None, sizes: list[int] | None = None) -> list[tuple[Any, int]]:
    """``inputs`` (a dict or tuple of batch-first tensors) cut into chunks of at most ``max_rows`` rows, with
    each chunk's row count. The rows are those of the first tensor with a dimension; they split as evenly as
    possible (chunk sizes differ by at most one), or into chunks of ``sizes`` rows when given (they must add up to
    the rows); values that are not tensors with that many rows along dim 0 go to every chunk as they are. One
    chunk when ``max_rows`` and ``sizes`` are ``None`` or the batch fits.

    Raises:
        TypeError: ``max_rows`` is set but ``inputs`` is not a mapping or tuple/list holding such a tensor.
    """
    if isinstance(inputs, Mapping):
        values = list(inputs.values())
    else:
        values = list(inputs) if isinstance(inputs, (tuple, list)) else []
    rows = next((int(v.shape[0]) for v in values if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    if max_rows is None and sizes is None:
        return [(inputs, rows or 0)]
    if rows is None:
        raise TypeError(
            f"max_micro_batch_size={max_rows} cuts batches along their rows, which needs a dict or tuple of "
            f"tensors (rows along dim 0); got a {type(inputs).__name__} without one. Use a collator that returns "
            "a dict of tensors."
        )
    if sizes is None:
        assert max_rows is not None
        if rows <= max_rows:
            return [(inputs, rows)]
        sizes = [stop - start for start, stop in split_even(rows, -(-rows // max_rows))]
    elif sum(sizes) != rows:
        raise ValueError(f"a micro-batch of {rows} rows cannot be cut into passes of {sizes} samples: passes bounded "
                         "in tokens need one row per sample (a padding-free collator packs several); drop "
                         "max_micro_batch_tokens or use a collator that keeps samples in rows.")
    if len(sizes) == 1:
        return [(inputs, rows)]
    chunks = len(sizes)

    def cut(value: Any) -> list[Any]:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            return list(torch.split(value, sizes))
        return [value] * chunks

    if isinstance(inputs, Mapping):
        parts = {key: cut(value) for key, value in inputs.items()}
        made = [{key: pieces[i] for key, pieces in parts.items()} for i in range(chunks)]
    else:
        pieces = [cut(value) for value in inputs]
        rebuild = type(inputs)._make if hasattr(inputs, "_fields") else type(inputs)  # a namedtuple, or not
        made = [rebuild(p[i] for p in pieces) for i in range(chunks)]
    return list(zip(made, sizes))
