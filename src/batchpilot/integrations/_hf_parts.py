"""Pieces of the Hugging Face integration that do not need the Trainer class itself.

- :class:`TrainLoader`: what ``Trainer`` iterates (one epoch of micro-batches per ``iter``), with a length
  that bounds the batches of an epoch from above, so that no loop built on ``len()`` ends an epoch early.
- :class:`SampleLambdaLR`: a ``LambdaLR`` whose clock is ``samples_seen``, not the number of ``step()`` calls.
- :class:`SampleProgressCallback`: the training progress bar counted in samples.
- :func:`write_state` / :func:`read_state`: batchpilot's part of a checkpoint folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from tqdm.auto import tqdm
from transformers.trainer_callback import ProgressCallback

from ..data.loader import AdaptiveDataLoader, MicroBatch

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
        self.steps_bound = loader.sampler.num_samples
        self._length = self.steps_bound * accumulation_steps

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

    def step(self, epoch: int | None = None) -> None:  # noqa: D102 - see the class docstring
        if epoch is None:
            self.last_epoch = int(self._clock()) - 1  # LRScheduler.step() adds 1
        super().step()

    def state_dict(self) -> dict[str, Any]:  # noqa: D102 - LambdaLR's, without the clock (a bound method)
        state = super().state_dict()
        state.pop("_clock", None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: D102 - keeps this run's clock
        clock = self._clock
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "_clock"})
        self._clock = clock


class SampleProgressCallback(ProgressCallback):
    """The training bar counts samples towards ``num_train_epochs * len(train_dataset)``.

    Steps have no fixed size, so a bar in steps has no honest total; samples do. Evaluation bars and log
    printing are the parent's.
    """

    def __init__(self, run_getter: Callable[[], Any]) -> None:
        super().__init__()
        self._run = run_getter
        self._seen = 0

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: D102
        run = self._run()
        if run is None or run.total_samples is None:  # max_steps is set: the step count is exact
            return super().on_train_begin(args, state, control, **kwargs)
        self._seen = run.samples_seen
        self.current_step = state.global_step
        if state.is_world_process_zero:
            self.training_bar = tqdm(
                total=run.total_samples, initial=self._seen, unit="samples", unit_scale=True, dynamic_ncols=True
            )

    def on_step_end(self, args, state, control, **kwargs):  # noqa: D102
        run = self._run()
        if run is None or run.total_samples is None:
            return super().on_step_end(args, state, control, **kwargs)
        if state.is_world_process_zero and self.training_bar is not None:
            self.training_bar.update(run.samples_seen - self._seen)
            self.training_bar.set_postfix(step=state.global_step, batch_size=run.batch_size, refresh=False)
        self._seen = run.samples_seen
        self.current_step = state.global_step


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
        ValueError: the file is not a batchpilot state of a version this release reads.
    """
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(folder)!r} has no {STATE_FILE}: it was not written by AdaptiveBatchSizeTrainer, so the data "
            "position and batch size cannot be restored. Resume from a checkpoint this trainer saved."
        )
    payload = json.loads(path.read_text())
    if payload.get("format") != _FORMAT or payload.get("version") != _VERSION:
        raise ValueError(
            f"{str(path)!r} is not a batchpilot Trainer state of version {_VERSION} "
            f"(format={payload.get('format')!r}, version={payload.get('version')!r})."
        )
    return payload
