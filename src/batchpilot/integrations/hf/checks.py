"""The settings `AdaptiveBatchSizeTrainer` refuses, each named with its fix."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer

from ..._validation import check_bool, check_positive_int
from ...data.shares import check_rank_weights


def check_scheduler_argument(batch_size_scheduler: Any) -> None:
    """Refuse a model passed where ``batch_size_scheduler`` goes (Trainer's positional order is model, args, ...).

    Raises:
        TypeError: ``batch_size_scheduler`` is a ``torch.nn.Module``.
    """
    if isinstance(batch_size_scheduler, torch.nn.Module):
        raise TypeError(
            "the first argument of AdaptiveBatchSizeTrainer is batch_size_scheduler, but it got a torch.nn.Module "
            f"({type(batch_size_scheduler).__name__}); pass the model and the rest by keyword: "
            "AdaptiveBatchSizeTrainer(batch_size_scheduler=..., model=model, args=args, ...)."
        )


def check_step_options(noise_every: int | None, max_micro_batch_size: int | None, oom_recovery: bool,
                       world_size: int) -> None:
    """Check the trainer's own step settings.

    Raises:
        ValueError: ``noise_every`` or ``max_micro_batch_size`` is not a positive integer, or ``oom_recovery``
            is on with several processes.
        TypeError: ``oom_recovery`` is not a bool.
    """
    if noise_every is not None:
        check_positive_int(noise_every, "noise_every")
    if max_micro_batch_size is not None:
        check_positive_int(max_micro_batch_size, "max_micro_batch_size")
    check_bool(oom_recovery, "oom_recovery")
    if oom_recovery and world_size > 1:
        raise ValueError(
            f"oom_recovery=True needs one process (world size {world_size} here): under DDP a rank "
            "that runs out of memory inside Trainer's backward leaves the others waiting in DDP's all-reduce. "
            "Set max_micro_batch_size= to a size that fits, or use batchpilot.Pilot(oom_recovery=True), whose "
            "ranks agree on every retry."
        )


def check_rank_weights_setting(value: Any, args: Any, world_size: int, loss_owns_scaling: bool) -> Any:
    """Validate ``rank_weights`` (``None``, ``"auto"`` or one positive weight per rank); return it checked.

    Raises:
        TypeError, ValueError: the value is not a valid setting (see :func:`batchpilot.data.shares.check_rank_weights`),
            or uneven shares would be weighted wrongly: a loss normalised by ``num_items_in_batch`` with
            ``average_tokens_across_devices=False`` divides each rank's loss by its own item count.
    """
    checked = check_rank_weights(value, world_size)
    if checked is not None and world_size > 1 and loss_owns_scaling and not args.average_tokens_across_devices:
        raise ValueError(
            f"rank_weights={value!r} gives the ranks shares of different sizes, but the loss is normalised by "
            "num_items_in_batch with average_tokens_across_devices=False, so each rank divides by its own item count "
            "and DDP's average would weight a small share as much as a large one; set "
            "TrainingArguments(average_tokens_across_devices=True) (the default), or leave rank_weights=None."
        )
    return checked


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
    if type(trainer)._get_train_sampler is not Trainer._get_train_sampler:
        problems.append(
            f"{type(trainer).__name__} overrides _get_train_sampler, which this trainer never calls: its sampler "
            "decides coverage and the batch size. Reorder or weight the data in the dataset instead."
        )
    if getattr(args, "fsdp", None) or getattr(trainer, "is_fsdp_enabled", False):
        problems.append(
            "FSDP (TrainingArguments(fsdp=...) or accelerate's FSDP plugin) is not supported: the trainer's loss "
            "weighting, gradient statistics and checkpoints assume DDP. Train the fully_shard model with "
            "batchpilot.Pilot (docs/fsdp.md), or use DDP here."
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
