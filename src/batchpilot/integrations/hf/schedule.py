"""The LR schedule of an adaptive Hugging Face run: Trainer's schedule types, on a clock of samples seen."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from transformers.optimization import get_scheduler


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


def sample_schedule(args: Any, optimizer: torch.optim.Optimizer | None, *, total_samples: int,
                    initial_batch_size: int, clock: Callable[[], int]) -> Any:
    """``args.lr_scheduler_type`` in samples: ``total_samples`` long, warm-up steps counted in batches of the
    first step's size (a ratio: of ``total_samples``), stepped to ``clock()``.

    Raises:
        ValueError: no optimizer yet, or a schedule type that cannot run on samples.
    """
    if optimizer is None:
        raise ValueError("create_scheduler() needs an optimizer: call create_optimizer() first (Trainer does).")
    warmup = args.warmup_steps
    if warmup >= 1:
        warmup_samples = int(warmup) * initial_batch_size  # warm-up steps of the first step's size
    else:
        warmup_samples = math.ceil(total_samples * (warmup or getattr(args, "warmup_ratio", 0) or 0))
    schedule = get_scheduler(
        args.lr_scheduler_type, optimizer=optimizer, num_warmup_steps=warmup_samples,
        num_training_steps=total_samples, scheduler_specific_kwargs=args.lr_scheduler_kwargs,
    )
    if isinstance(schedule, torch.optim.lr_scheduler.LambdaLR):
        return SampleLambdaLR(optimizer, schedule.lr_lambdas, clock)
    if not isinstance(schedule, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(
            f"lr_scheduler_type={args.lr_scheduler_type!r} builds a {type(schedule).__name__}, which "
            "cannot be driven by samples; use a warm-up/decay schedule (linear, cosine, constant, ...) or "
            "set max_steps."
        )
    return schedule
