"""The keywords ``Pilot(...)`` takes after ``batch_size`` and ``controller``, for type checkers."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from typing_extensions import TypedDict

from .config import (
    CheckpointConfig,
    DataConfig,
    DecisionConfig,
    DistributedConfig,
    LoggingConfig,
    LRConfig,
    MemoryConfig,
    PrecisionConfig,
    StatsConfig,
)


class PilotSettings(TypedDict, total=False):
    """``Pilot(...)``'s keywords after ``batch_size`` and ``controller``: the groups, or any field of a group as
    its own keyword."""

    decisions: DecisionConfig
    lr: LRConfig
    data: DataConfig
    memory: MemoryConfig
    precision: PrecisionConfig
    logs: LoggingConfig
    checkpoints: CheckpointConfig
    stats: StatsConfig
    distributed: DistributedConfig
    decide_every: int
    min_batch_size: int | None
    max_batch_size: int | None
    on_invalid: str
    loss_history: int
    rollback: bool | None
    rollback_window: int
    rollback_spike: float
    rollback_cooldown: int
    lr_rule: str | Callable[[float], float] | None
    base_batch_size: int | None
    lr_knee: int
    lr_schedulers: Sequence[Any]
    shuffle: bool
    seed: int
    drop_last: bool
    num_workers: int
    collate_fn: Callable[[list[Any]], Any] | None
    pin_memory: bool
    prefetch_factor: int | None
    batch_unit: str
    lengths: Any
    max_micro_batch_size: int | None
    max_micro_batch_tokens: int | None
    oom_recovery: bool
    loss_reduction: str
    amp: str | None
    grad_clip: float | str | None
    skip_nonfinite: bool
    log_path: str | os.PathLike | None
    tensorboard_dir: str | os.PathLike | None
    progress: bool | None
    checkpoint_dir: str | os.PathLike | None
    checkpoint_every: int | None
    keep_checkpoints: int
    save_on_sigterm: bool
    noise_every: int | None
    system_every: int | None
    device: torch.device | str | None
    rank: int | None
    world_size: int | None
    rank_weights: str | Sequence[float] | None
    compression: str | Callable[..., Any] | None
