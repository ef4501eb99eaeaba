"""`Pilot`'s settings: frozen dataclasses, one per concern, and every check, collected and raised once.

Each setting can be passed to ``Pilot(...)`` by its own keyword (``num_workers=2``) or inside its group
(``data=DataConfig(num_workers=2)``), not both.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from .._validation import (
    check_batch_size,
    check_bool,
    check_bounds,
    check_choice,
    check_positive_int,
    collect_problems,
)
from ..controllers.boundary import check_controller
from ..data.shares import check_rank_weights
from ..data.tokens import check_batch_unit
from ..lr import check_rule
from .compression_setup import check_compression
from .guard import check_rollback_settings


@dataclass(frozen=True)
class DecisionConfig:
    """When the controller is asked, and what its answers may be."""

    decide_every: int = 1
    """Ask the controller after every ``decide_every``-th step."""
    min_batch_size: int | None = None
    """Smallest global batch size a decision may set (smaller ones are clamped, and logged)."""
    max_batch_size: int | None = None
    """Largest global batch size a decision may set (larger ones are clamped, and logged)."""
    on_invalid: str = "raise"
    """``"raise"`` on a decision of 0, a negative, NaN or a non-integer; ``"keep"`` keeps the size and warns."""
    loss_history: int = 50
    """How many recent step losses an :class:`~batchpilot.Observation` carries."""
    rollback: bool | None = None
    """Roll back a size change followed by a non-finite step or a loss spike (docs/rollback.md; ``None``: on for the
    controllers that decide from measurements, those with ``adaptive = True``)."""
    rollback_window: int = 100
    """Steps watched after each change of size by the controller."""
    rollback_spike: float = 2.0
    """A watched loss above this times the median loss before the change (and above its noise) is a spike."""
    rollback_cooldown: int = 200
    """Steps during which the controller may not go back to a failed size; doubles with each rollback."""

    def driver_settings(self) -> dict[str, Any]:
        """The settings :class:`~batchpilot.engine.driver.SizeDriver` takes (all but the rollback guard's)."""
        return {k: v for k, v in vars(self).items() if not k.startswith("rollback")}


@dataclass(frozen=True)
class LRConfig:
    """How the learning rate follows the global batch size, on top of the user's schedulers."""

    lr_rule: str | Callable[[float], float] | None = None
    """``"none"``, ``"linear"`` (Goyal et al. 2017), ``"sqrt"`` (Malladi et al. 2022), ``"linear-then-sqrt"``,
    ``"adascale"`` (Johnson et al. 2020: the gain from measured gradient noise), ``"auto"`` (with
    ``batch_size="auto"`` only: the LR range test's LR at the knee, on AdaScale's curve; docs/auto.md) or a
    callable ratio -> factor (``None``: the controller's ``recommended_lr_rule`` if it has one, else ``"none"``;
    docs/lr.md)."""
    base_batch_size: int | None = None
    """The global batch size at which the optimizer's LR is right (``None``: the first step's ``batch_size``)."""
    lr_knee: int = 4096
    """Knee of ``"linear-then-sqrt"``."""
    lr_schedulers: Sequence[Any] = ()
    """torch LR schedulers (stepped once per step; not ``ReduceLROnPlateau``) and/or
    :class:`~batchpilot.lr.SampleLRSchedule` (stepped with ``samples_seen``)."""


@dataclass(frozen=True)
class DataConfig:
    """Data order and loading (:class:`~batchpilot.AdaptiveBatchSampler`, :class:`~batchpilot.AdaptiveDataLoader`)."""

    shuffle: bool = True
    """Draw each epoch in a new random order."""
    seed: int = 0
    """Seed of the order (the same on every rank)."""
    drop_last: bool = False
    """Drop an epoch's final global batch when it is smaller than the current size."""
    num_workers: int = 0
    """Worker processes that fetch micro-batches."""
    collate_fn: Callable[[list[Any]], Any] | None = None
    """Turns a list of samples into a micro-batch (``None``: torch's default_collate)."""
    pin_memory: bool = False
    """Fetch into page-locked memory (faster copies to a GPU)."""
    prefetch_factor: int | None = None
    """Micro-batches each worker fetches ahead (needs ``num_workers > 0``)."""
    batch_unit: str = "samples"
    """What a batch size counts: ``"samples"``, or ``"tokens"`` (then ``batch_size``, the bounds, the controller's
    sizes and the LR coupling count tokens, and ``lengths`` gives every sample's tokens; docs/tokens.md)."""
    lengths: Any = None
    """With ``batch_unit="tokens"``: every sample's token count, a sequence of ints or the name of a dataset attribute
    or column holding it (a column of sequences, e.g. ``"input_ids"``, gives their lengths), read once."""


@dataclass(frozen=True)
class MemoryConfig:
    """What one forward/backward may hold, and what happens when it does not fit."""

    max_micro_batch_size: int | None = None
    """Most samples per forward/backward on one rank; larger local batches accumulate over several
    micro-batches (``None``: one micro-batch per step)."""
    max_micro_batch_tokens: int | None = None
    """With ``batch_unit="tokens"``: most tokens per forward/backward on one rank (a longer sample gets a micro-batch
    of its own; ``None``: no token bound)."""
    oom_recovery: bool = False
    """Run a step that ran out of memory again with micro-batches of half the size (same samples, global batch
    and LR); each micro-batch's forward and backward then go inside ``with pilot.micro_step():``. With several
    ranks a DDP model then runs every micro-batch under ``no_sync`` (see docs/concepts.md)."""


@dataclass(frozen=True)
class PrecisionConfig:
    """The numerics of an update: the loss's reduction, mixed precision, clipping and non-finite steps."""

    loss_reduction: str = "mean"
    """Whether the loss given to :meth:`Pilot.backward` is the ``"mean"`` or the ``"sum"`` over its micro-batch."""
    amp: str | None = None
    """``None``, ``"bf16"`` (autocast to bfloat16) or ``"fp16"`` (autocast to float16 with a GradScaler, for
    CUDA; a step whose scaled gradient overflows is skipped by the scaler)."""
    grad_clip: float | str | None = None
    """``None``, a max global gradient norm, or ``"stats"`` (:class:`~batchpilot.clipping.StatsClip`)."""
    skip_nonfinite: bool = True
    """Skip the optimizer step when the loss or the gradient norm is not finite."""


@dataclass(frozen=True)
class LoggingConfig:
    """What rank 0 writes while training."""

    log_path: str | os.PathLike | None = None
    """JSONL adjustment log (steps, decisions, events)."""
    tensorboard_dir: str | os.PathLike | None = None
    """Also write step metrics to TensorBoard (needs ``batchpilot[tensorboard]``)."""
    progress: bool | None = None
    """Show a progress bar (``None``: when stderr is a terminal)."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Periodic checkpoints."""

    checkpoint_dir: str | os.PathLike | None = None
    """Folder of ``step-<step>.pt`` files (also where a failing controller's finished step is saved)."""
    checkpoint_every: int | None = None
    """Save every N steps (needs ``checkpoint_dir``)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep in ``checkpoint_dir``."""
    save_on_sigterm: bool = False
    """On SIGTERM every rank agrees to save a checkpoint in ``checkpoint_dir`` at the end of the current step, and
    training stops there (a planned scale-down or preemption loses nothing; docs/distributed.md)."""


@dataclass(frozen=True)
class StatsConfig:
    """Measurements beyond the always-on loss trend and throughput model (time per micro-batch ``a + b*m``)."""

    noise_every: int | None = None
    """Measure the gradient noise scale (McCandlish et al. 2018) every N steps (``None``: at an adaptive period
    when the controller reads gradient statistics or ``lr_rule="adascale"``, else never: every 16 steps or
    less often as the estimate settles, free small batches more often; docs/statistics.md)."""
    system_every: int | None = 100
    """Sample CPU/memory/GPU load every N steps (needs ``batchpilot[system]``; ``None``: off)."""


@dataclass(frozen=True)
class DistributedConfig:
    """Where this process trains, and its place in the process group."""

    device: torch.device | str | None = None
    """Where micro-batches are moved (``None``: the device of the model's first parameter)."""
    rank: int | None = None
    """This process's rank (``None``: what torch.distributed reports; for tests)."""
    world_size: int | None = None
    """Processes that share each global batch (``None``: the process group's size; 1: this rank on its own)."""
    rank_weights: str | Sequence[float] | None = None
    """Each rank's share of the global batch, proportional to its weight (``None``: even shares; ``"auto"``:
    from each rank's measured speed, agreed through rank 0; a list: one weight per rank; docs/distributed.md)."""
    compression: str | Callable[..., Any] | None = None
    """Gradient compression of a DDP model (``None``: full precision; ``"1bit"``, ``"auto"`` or a DDP comm hook;
    docs/distributed.md)."""


GROUPS: dict[str, type] = {
    "decisions": DecisionConfig, "lr": LRConfig, "data": DataConfig, "memory": MemoryConfig,
    "precision": PrecisionConfig, "logs": LoggingConfig, "checkpoints": CheckpointConfig, "stats": StatsConfig,
    "distributed": DistributedConfig,
}
GROUP_OF = {f.name: group for group, cls in GROUPS.items() for f in fields(cls)}
"""Each flat setting's group, by name."""


@dataclass(frozen=True)
class PilotConfig:
    """All of a `Pilot`'s settings, by group (``pilot.config``)."""

    decisions: DecisionConfig = field(default_factory=DecisionConfig)
    lr: LRConfig = field(default_factory=LRConfig)
    data: DataConfig = field(default_factory=DataConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logs: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


def merge_settings(settings: Mapping[str, Any]) -> PilotConfig:
    """One :class:`PilotConfig` from ``Pilot(...)``'s keywords: group objects and flat settings.

    Raises:
        TypeError: an unknown keyword (the message names the closest valid one), a group of the wrong type,
            or a setting given both as a keyword and inside its group.
    """
    groups = {k: v for k, v in settings.items() if k in GROUPS and v is not None}  # None: not passed
    flat = {k: v for k, v in settings.items() if k not in GROUPS}
    for name in flat:
        if name not in GROUP_OF:
            close = difflib.get_close_matches(name, [*GROUP_OF, *GROUPS, "batch_size", "controller"], n=1)
            hint = f"did you mean {close[0]!r}?" if close else "see batchpilot.engine.config for every setting."
            raise TypeError(f"Pilot() got an unexpected keyword argument {name!r}; {hint}")
    for name, value in groups.items():
        if not isinstance(value, GROUPS[name]):
            raise TypeError(f"{name} must be a {GROUPS[name].__name__}, got {value!r}.")
    for name in flat:
        group = GROUP_OF[name]
        if group in groups:
            cls = GROUPS[group].__name__
            raise TypeError(f"{name} is given as a keyword while its group is passed as {group}={cls}(...): set "
                            f"{name} inside {cls}(...), or pass it as a keyword without {group}=.")
    built = {group: groups[group] if group in groups else cls(**{k: v for k, v in flat.items() if GROUP_OF[k] == group})
             for group, cls in GROUPS.items()}
    return PilotConfig(**built)


def checked(config: PilotConfig, *, batch_size: Any, controller: Any, optimizer: torch.optim.Optimizer,
            model: torch.nn.Module) -> tuple[int, PilotConfig]:
    """Check every setting, report all problems at once, and return ``batch_size`` and the settings with plain
    ints (a numpy integer passes the checks but would be pickled into checkpoints, which
    ``torch.load(weights_only=True)`` then refuses to read).

    Raises:
        ValueError, TypeError: invalid settings (all problems in one ValueError).
    """
    dec, lr, mem, prec, ckpt, st = (config.decisions, config.lr, config.memory, config.precision,
                                    config.checkpoints, config.stats)
    lo, hi = dec.min_batch_size, dec.max_batch_size
    if lr.lr_rule is None:  # the controller's recommended rule (docs/lr.md)
        lr = replace(lr, lr_rule=getattr(controller, "recommended_lr_rule", None) or "none")
    problems = collect_problems(
        batch_size=lambda: check_batch_size(batch_size),
        decide_every=lambda: check_positive_int(dec.decide_every, "decide_every"),
        bounds=lambda: check_bounds(lo, hi, ("min_batch_size", "max_batch_size")),
        base_batch_size=lambda: lr.base_batch_size is None or check_batch_size(lr.base_batch_size, "base_batch_size"),
        on_invalid=lambda: check_choice(dec.on_invalid, "on_invalid", ("raise", "keep")),
        amp=lambda: check_choice(prec.amp, "amp", (None, "bf16", "fp16")),
        loss_reduction=lambda: check_choice(prec.loss_reduction, "loss_reduction", ("mean", "sum")),
        loss_history=lambda: check_positive_int(dec.loss_history, "loss_history"),
        rollback=lambda: check_rollback_settings(dec.rollback, dec.rollback_window, dec.rollback_spike,
                                                 dec.rollback_cooldown),
        noise_every=lambda: st.noise_every is None or check_positive_int(st.noise_every, "noise_every"),
        system_every=lambda: st.system_every is None or check_positive_int(st.system_every, "system_every"),
        keep_checkpoints=lambda: check_positive_int(ckpt.keep_checkpoints, "keep_checkpoints"),
        checkpoint_every=lambda: ckpt.checkpoint_every is None or check_positive_int(ckpt.checkpoint_every,
                                                                                     "checkpoint_every"),
        grad_clip=lambda: _check_grad_clip(prec.grad_clip),
        controller=lambda: check_controller(controller),
        oom_recovery=lambda: check_bool(mem.oom_recovery, "oom_recovery"),
        save_on_sigterm=lambda: check_bool(ckpt.save_on_sigterm, "save_on_sigterm"),
        skip_nonfinite=lambda: check_bool(prec.skip_nonfinite, "skip_nonfinite"),
        progress=lambda: config.logs.progress is None or check_bool(config.logs.progress, "progress"),
        lr_schedulers=lambda: _check_schedulers(lr.lr_schedulers, optimizer),
        lr_rule=lambda: check_rule(lr.lr_rule, "lr_rule", also=("auto", "adascale")),  # the message names every rule
        lr_knee=lambda: check_positive_int(lr.lr_knee, "lr_knee"),
        compression=lambda: check_compression(config.distributed.compression),
        batch_unit=lambda: check_batch_unit(config.data.batch_unit, config.data.lengths, mem.max_micro_batch_tokens),
        rank_weights=lambda: check_rank_weights(config.distributed.rank_weights, config.distributed.world_size),
    )
    if not problems and ckpt.checkpoint_every is not None and ckpt.checkpoint_dir is None:
        problems.append("checkpoint_every is set but checkpoint_dir is None; pass checkpoint_dir=... too.")
    if not problems and ckpt.save_on_sigterm and ckpt.checkpoint_dir is None:
        problems.append("save_on_sigterm=True saves into checkpoint_dir, which is None; pass checkpoint_dir=... too.")
    if not problems and ((lo is not None and batch_size < lo) or (hi is not None and batch_size > hi)):
        problems.append(f"batch_size={batch_size} lies outside [min_batch_size={lo}, max_batch_size={hi}].")
    if problems:
        raise ValueError("invalid Pilot arguments:\n  - " + "\n  - ".join(problems))
    if prec.amp == "fp16" and any(p.dtype == torch.float16 for p in model.parameters() if p.requires_grad):
        raise ValueError("amp='fp16' needs float32 parameters (the GradScaler cannot unscale float16 gradients); "
                         "keep the model in float32 (autocast runs the float16 math), or use amp='bf16' or amp=None.")
    if any(isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau) for s in lr.lr_schedulers):
        raise TypeError("lr_schedulers holds a ReduceLROnPlateau, which steps on a metric, not once per step; "
                        "keep it out of the Pilot and call its step(metric) yourself, e.g. from a callback "
                        "(pilot.add_callback) after an evaluation.")
    return int(batch_size), replace(
        config,
        decisions=replace(dec, decide_every=int(dec.decide_every), loss_history=int(dec.loss_history),
                          min_batch_size=_int(lo), max_batch_size=_int(hi), rollback_window=int(dec.rollback_window),
                          rollback_spike=float(dec.rollback_spike), rollback_cooldown=int(dec.rollback_cooldown)),
        memory=replace(mem, max_micro_batch_tokens=_int(mem.max_micro_batch_tokens)),
        lr=replace(lr, base_batch_size=_int(lr.base_batch_size), lr_schedulers=list(lr.lr_schedulers)),
        precision=replace(prec, grad_clip=prec.grad_clip if prec.grad_clip is None or isinstance(prec.grad_clip, str)
                          else float(prec.grad_clip)),
        checkpoints=replace(ckpt, checkpoint_every=_int(ckpt.checkpoint_every),
                            keep_checkpoints=int(ckpt.keep_checkpoints),
                            checkpoint_dir=None if ckpt.checkpoint_dir is None else Path(ckpt.checkpoint_dir)),
        stats=replace(st, noise_every=_int(st.noise_every), system_every=_int(st.system_every)),
    )


def stop_samples(epochs: int | None, max_steps: int | None, max_samples: int | None, num_samples: int) -> int | None:
    """Check the stop conditions of :meth:`Pilot.batches`; return the samples they allow in total (``None``:
    ``max_steps`` alone gives no sample count).

    Raises:
        ValueError, TypeError: no condition, or one that is not an int >= 0.
    """
    if epochs is None and max_steps is None and max_samples is None:
        raise ValueError("batches() needs a stop condition: pass epochs=, max_steps= or max_samples=.")
    for name, value in (("epochs", epochs), ("max_steps", max_steps), ("max_samples", max_samples)):
        if value is not None:
            check_positive_int(value, name, minimum=0)
    bounds = [b for b in (None if epochs is None else epochs * num_samples, max_samples) if b is not None]
    return min(bounds) if bounds else None


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _check_schedulers(schedulers: Any, optimizer: torch.optim.Optimizer) -> None:
    """``lr_schedulers`` holds LR schedulers: objects with ``step()``, ``state_dict()`` and ``load_state_dict()``
    (torch's, batchpilot's sample schedules, or your own), stepped once per step."""
    if isinstance(schedulers, (str, bytes)) or not isinstance(schedulers, Sequence):
        raise TypeError(f"lr_schedulers must be a list of LR schedulers, got {schedulers!r}; wrap one in a list.")
    for i, s in enumerate(schedulers):
        lacks = [m for m in ("step", "state_dict", "load_state_dict") if not callable(getattr(s, m, None))]
        if lacks:
            raise TypeError(f"lr_schedulers[{i}] is {s!r}, which has no {', '.join(m + '()' for m in lacks)}: pass LR "
                            "schedulers (torch.optim.lr_scheduler or batchpilot.lr schedules) built on this Pilot's "
                            "optimizer.")
        if getattr(s, "optimizer", optimizer) is not optimizer:
            raise ValueError(f"lr_schedulers[{i}] ({type(s).__name__}) was built on another optimizer than the "
                             "Pilot's, so it would schedule an optimizer that is not trained; build it on the "
                             "optimizer you pass to Pilot.")


def _check_grad_clip(value: Any) -> None:
    if value is None or (isinstance(value, str) and value == "stats"):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0 \
            or not math.isfinite(float(value)):
        raise ValueError(f"grad_clip must be None, a positive finite max-norm or 'stats'; got {value!r}.")

