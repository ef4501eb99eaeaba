"""Trainer settings the callback refuses (or adapts) at the start of training and of each epoch: a step's split
into micro-batches is fixed when the loader is built, and an epoch's number of batches changes with the size."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import GradientAccumulationScheduler

from ...data.loader import AdaptiveDataLoader

__all__ = ["check_batch_limit", "check_fixed_accumulation", "validate_at_epoch_end"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_fixed_accumulation(trainer: Any, built: AdaptiveDataLoader | None) -> None:
    """Refuse an ``accumulate_grad_batches`` that changes during the run: the loader (``built``, if built in this
    fit) splits each step into that many micro-batches, and the loss weights assume that split.

    Raises:
        ValueError: a ``GradientAccumulationScheduler``, or a value other than the loader's.
    """
    if any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks) or \
            (built is not None and built.accumulation_steps != trainer.accumulate_grad_batches):
        raise ValueError(
            "accumulate_grad_batches changes during the run (GradientAccumulationScheduler), but each step's "
            "split into micro-batches is fixed when the loader is built: keep one accumulate_grad_batches for "
            "the run (the controller is what changes the batch size)."
        )


def check_batch_limit(trainer: Any) -> None:
    """``limit_train_batches`` counts micro-batches: a fraction of an epoch's batches has no meaning when their
    number changes, and an int must end on a step boundary (else Lightning steps on a partial accumulation and
    the next epoch replays part of it).

    Raises:
        ValueError: a fraction other than 0.0 and 1.0, or an int (``fast_dev_run`` too) that is not a multiple
            of ``accumulate_grad_batches``.
    """
    limit, accumulation_steps = trainer.limit_train_batches, trainer.accumulate_grad_batches
    if isinstance(limit, float) and limit not in (0.0, 1.0):  # 0.0 skips training, 1.0 is every batch
        raise ValueError(
            f"limit_train_batches={limit} is a fraction of the epoch's batches, and their number changes with "
            "the batch size; pass an int (micro-batches per epoch, a multiple of accumulate_grad_batches) or "
            "bound the run with max_steps."
        )
    if isinstance(limit, int) and limit % accumulation_steps and trainer.fast_dev_run:
        raise ValueError(
            f"fast_dev_run trains {limit} batch(es), which is not a multiple of accumulate_grad_batches="
            f"{accumulation_steps}: the optimizer step would be cut short; use fast_dev_run={accumulation_steps}."
        )
    if isinstance(limit, int) and limit % accumulation_steps:
        raise ValueError(
            f"limit_train_batches={limit} is not a multiple of accumulate_grad_batches={accumulation_steps}: the "
            f"last optimizer step of each epoch would be cut short; use a multiple, e.g. "
            f"{max(accumulation_steps, limit - limit % accumulation_steps)}."
        )


def validate_at_epoch_end(trainer: Any) -> None:
    """Make ``val_check_interval=1.0`` mean "at the epoch's last batch", as for a loader without length.

    Lightning turns a float interval into a batch count from ``len(train_dataloader)``, which for this
    loader is only an upper bound; an int interval (every k batches) and time intervals work as is.

    Raises:
        ValueError: an int interval that is not a multiple of ``accumulate_grad_batches`` or that counts from
            each epoch's start (``check_val_every_n_epoch`` set, with validation), or a fraction other than 1.0.
    """
    interval = trainer.val_check_interval
    accumulation_steps = trainer.accumulate_grad_batches
    if _is_int(interval) and interval % accumulation_steps:
        raise ValueError(
            f"val_check_interval={interval} is not a multiple of accumulate_grad_batches={accumulation_steps}: a "
            "validation (and a checkpoint it triggers) would fall inside an optimizer step, and a run resumed "
            f"from there would be out of step with the data; use a multiple, e.g. "
            f"{max(accumulation_steps, interval - interval % accumulation_steps)}."
        )
    every_n = trainer.check_val_every_n_epoch
    if _is_int(interval) and every_n is not None and trainer.limit_val_batches > 0:
        raise ValueError(
            f"val_check_interval={interval} with check_val_every_n_epoch={every_n} validates at every "
            f"{interval}th batch counted from each epoch's start, and an epoch's number of batches changes with "
            f"the batch size: once an epoch has fewer than {interval} batches, it is never validated. Pass "
            f"check_val_every_n_epoch=None to validate every {interval} batches counted over the fit, or "
            "val_check_interval=1.0 to validate at each epoch's end."
        )
    if not isinstance(interval, float) or getattr(trainer, "_val_check_time_interval", None) is not None:
        return
    if interval != 1.0:
        raise ValueError(
            f"val_check_interval={interval} is a fraction of the epoch's batches, and their number changes with "
            "the batch size; validate every k batches (an int), by time, or at epoch ends (1.0)."
        )
    trainer.val_check_batch = float("inf")
