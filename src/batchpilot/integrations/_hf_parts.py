"""Pieces of the Hugging Face integration that do not need the Trainer class itself.

- :class:`TrainLoader`: what ``Trainer`` iterates (one epoch of micro-batches per ``iter``), with a length
  that bounds the batches of an epoch from above, so that no loop built on ``len()`` ends an epoch early.
- :class:`SampleLambdaLR`: a ``LambdaLR`` whose clock is ``samples_seen``, not the number of ``step()`` calls.
- :func:`write_state` / :func:`read_state`: batchpilot's part of a checkpoint folder.
- :func:`check_arguments`: the Trainer settings the adaptive loop cannot honour.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..data.loader import AdaptiveDataLoader, MicroBatch, split_even

STATE_FILE = "batchpilot_state.json"
_FORMAT = "batchpilot.integrations.hf"
_VERSION = 1


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


class SampleLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """``lr = base_lr * lr_lambda(samples_seen)``, however many steps it took to see those samples.

    ``Trainer`` calls ``step()`` once per optimizer step; each call reads ``clock()`` (the samples seen
    after the step that just ran) instead of counting calls. Build the lambdas in sample units (warm-up and
    total length in samples), e.g. from ``transformers.get_scheduler(..., num_training_steps=total_samples)``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, lr_lambdas: Any, clock: Callable[[], int]) -> None:
        self._clock = clock
        super().__init__(optimizer, lr_lambdas)

    def step(self, epoch: int | None = None) -> None:
        if epoch is None:
            self.last_epoch = int(self._clock()) - 1  # LRScheduler.step() adds 1
        super().step()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.pop("_clock", None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        clock = self._clock
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "_clock"})
        self._clock = clock


def write_state(folder: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write batchpilot's state into a checkpoint folder atomically (temporary file, then rename)."""
    path = Path(folder) / STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": _FORMAT, "version": _VERSION, **state}
    tmp = path.with_name(f".{STATE_FILE}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_state(folder: str | os.PathLike) -> dict[str, Any]:
    """Read what :func:`write_state` wrote.

    Raises:
        FileNotFoundError: the folder has no batchpilot state (a checkpoint of another trainer).
        ValueError: the file is truncated or corrupt, or not a batchpilot state of a version this release
            reads.
    """
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(folder)!r} has no {STATE_FILE}: it was not written by AdaptiveBatchSizeTrainer, so the data "
            "position and batch size cannot be restored. Resume from a checkpoint this trainer saved."
        )
    try:
        payload = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"{str(path)!r} is truncated or corrupt ({exc}); resume from another checkpoint folder of this run."
        ) from exc
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT or payload.get("version") != _VERSION:
        found = payload if not isinstance(payload, dict) else \
            f"format={payload.get('format')!r}, version={payload.get('version')!r}"
        raise ValueError(f"{str(path)!r} is not a batchpilot Trainer state of version {_VERSION} ({str(found)[:100]}).")
    return payload


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


def split_rows(inputs: Any, max_rows: int | None) -> list[tuple[Any, int]]:
    """``inputs`` (a dict or tuple of batch-first tensors) cut into chunks of at most ``max_rows`` rows, with
    each chunk's row count. The rows are those of the first tensor with a dimension; they split as evenly as
    possible (chunk sizes differ by at most one); values that are not tensors with that many rows along dim 0
    go to every chunk as they are. One chunk when ``max_rows`` is ``None`` or the batch fits.

    Raises:
        TypeError: ``max_rows`` is set but ``inputs`` is not a mapping or tuple/list holding such a tensor.
    """
    if isinstance(inputs, Mapping):
        values = list(inputs.values())
    else:
        values = list(inputs) if isinstance(inputs, (tuple, list)) else []
    rows = next((int(v.shape[0]) for v in values if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    if max_rows is None:
        return [(inputs, rows or 0)]
    if rows is None:
        raise TypeError(
            f"max_micro_batch_size={max_rows} cuts batches along their rows, which needs a dict or tuple of "
            f"tensors (rows along dim 0); got a {type(inputs).__name__} without one. Use a collator that returns "
            "a dict of tensors."
        )
    if rows <= max_rows:
        return [(inputs, rows)]
    chunks = -(-rows // max_rows)
    sizes = [stop - start for start, stop in split_even(rows, chunks)]

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


def sync_each_batch_problem(args: Any, measure: bool, world_size: int) -> str | None:
    """Why the gradient statistics cannot run with accelerate's ``sync_each_batch`` under DDP, or ``None``."""
    kwargs = getattr(args.accelerator_config, "gradient_accumulation_kwargs", None) or {}
    if measure and world_size > 1 and kwargs.get("sync_each_batch"):
        return ("accelerator_config.gradient_accumulation_kwargs={'sync_each_batch': True} all-reduces every "
                "micro-batch, so the gradient statistics cannot read each rank's micro-batches; leave it off while "
                "a controller reads them (or noise_every is set).")
    return None


def check_arguments(trainer: Any) -> None:
    """Reject Trainer settings the adaptive loop cannot honour, all at once."""
    args = trainer.args
    problems = []
    if args.auto_find_batch_size:
        problems.append(
            "auto_find_batch_size=True restarts training with 0.9x the batch; the size is the scheduler's job "
            "here: bound it with max_batch_size= and fit memory with max_micro_batch_size=."
        )
    strategy = getattr(args, "train_sampling_strategy", "random")  # transformers >= 5.x
    if strategy not in ("random", "sequential"):
        problems.append(
            f"train_sampling_strategy={strategy!r} builds its own batches; use 'random' or 'sequential'."
        )
    if getattr(args, "group_by_length", False):  # earlier 5.x releases
        problems.append("group_by_length=True builds its own batches (train_sampling_strategy); set it to False.")
    config = args.accelerator_config
    if getattr(config, "split_batches", False):
        problems.append("accelerator_config.split_batches=True needs a fixed batch size; set it to False.")
    if getattr(config, "dispatch_batches", None):
        problems.append("accelerator_config.dispatch_batches=True cannot split changing batch sizes; set it to False.")
    from transformers import Trainer

    if type(trainer)._get_train_sampler is not Trainer._get_train_sampler:
        problems.append(
            f"{type(trainer).__name__} overrides _get_train_sampler, which this trainer never calls: its sampler "
            "decides coverage and the batch size. Reorder or weight the data in the dataset instead."
        )
    parallel = trainer.get_tp_size() * trainer.get_cp_size() * trainer.get_sp_size()
    if parallel > 1:
        problems.append(f"tensor/context/sequence parallelism (size {parallel}) is not supported; use data parallelism.")
    if args.max_steps <= 0:
        for name in ("logging", "eval", "save"):
            value = getattr(args, f"{name}_steps", None)
            if isinstance(value, float) and 0 < value < 1:
                problems.append(
                    f"{name}_steps={value} is a fraction of the total number of steps, which is unknown while the "
                    f"batch size changes; pass a whole number of steps (or set max_steps)."
                )
    if problems:
        raise ValueError("AdaptiveBatchSizeTrainer cannot honour these TrainingArguments:\n  - " + "\n  - ".join(problems))
