"""The automatic mode in the Lightning callback: ``AdaptiveBatchSize(batch_size="auto")``.

At ``on_train_start`` (the optimizer and the LR schedulers exist, Lightning's loop has not fetched a batch yet),
the start probes of :mod:`batchpilot.integrations._auto` run with the module's own ``training_step`` on the
callback's loader; the pre-probe state is restored, the fit starts at the knee with the found LR, and ``Auto``
grows the batch from there.
"""

from __future__ import annotations

from typing import Any

import torch

from ...controllers.auto import resolve_auto_mode
from ...data.micro_batch import MicroBatch
from .._auto import run_start_probes
from .._step_stats import check_measurable

__all__ = ["check_auto_fit", "resolve_auto", "start_probes"]


def resolve_auto(controller: Any, batch_size: Any) -> tuple[Any, Any]:
    """``(controller, first batch size)`` with ``batch_size="auto"`` resolved: ``Auto()`` unless one is given,
    and its ``min_size`` as the placeholder first size (the probes replace it with the knee).

    Raises:
        ValueError: ``batch_size="auto"`` with another controller, or ``Auto`` with an int batch size.
    """
    batch_size, controller, _ = resolve_auto_mode(batch_size, controller)
    return controller, batch_size


def check_auto_fit(trainer: Any, pl_module: Any) -> None:
    """Refuse fits whose probe steps the callback cannot run like Lightning would.

    Raises:
        ValueError: several processes, manual optimization, or not exactly one optimizer.
    """
    problems = []
    if trainer.world_size > 1:
        problems.append(f"the fit has {trainer.world_size} processes: the callback's start probes run on one; use "
                        "batchpilot.Pilot(..., batch_size='auto') under DDP, or an int batch_size")
    if not pl_module.automatic_optimization:
        problems.append("the module uses manual optimization: the probes step the optimizer themselves; use "
                        "automatic optimization, or an int batch_size")
    if len(trainer.optimizers) != 1:
        problems.append(f"configure_optimizers returned {len(trainer.optimizers)} optimizers: the LR range test "
                        "sweeps one; return one optimizer, or use an int batch_size")
    if problems:
        raise ValueError("AdaptiveBatchSize(batch_size='auto') cannot probe this fit:\n  - " + "\n  - ".join(problems))


def start_probes(callback: Any, trainer: Any, pl_module: Any) -> None:
    """Run the start probes for ``callback`` (whose controller is an ``Auto`` that has not probed): the fit then
    starts at the knee with the found LR. ``callback.probing`` is true while ``training_step`` runs for a probe."""
    check_auto_fit(trainer, pl_module)
    # Auto reads the noise scale after the probes: refuse a fit that cannot measure it before probing, not after.
    check_measurable(trainer.world_size, trainer.accumulate_grad_batches, manual=False)
    optimizer = trainer.optimizers[0]
    accumulation = trainer.accumulate_grad_batches
    clip, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
    adaptive = callback._loader  # (its micro-batch is what training_step reads from the callback)
    transfer = getattr(pl_module, "_apply_batch_transfer_handler", None)

    def step(micro: list[MicroBatch]) -> float:
        pl_module.train()
        total = 0.0
        for i, m in enumerate(micro):
            adaptive.current = m
            batch = transfer(m.data) if transfer is not None else trainer.strategy.batch_to_device(m.data)
            out = trainer.strategy.training_step(batch, i)
            loss = out["loss"] if isinstance(out, dict) else out
            if loss is None:
                continue  # training_step skipped the micro-batch, as Lightning allows
            loss = loss / accumulation  # as Lightning's automatic optimization scales it
            loss.backward()
            total += float(loss.detach())
        if clip:
            if str(algorithm) in ("value", "GradClipAlgorithmType.VALUE"):
                torch.nn.utils.clip_grad_value_(pl_module.parameters(), float(clip))
            else:
                torch.nn.utils.clip_grad_norm_(pl_module.parameters(), float(clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    quiet = {"log": lambda *a, **k: None, "log_dict": lambda *a, **k: None}
    for name, fn in quiet.items():  # probe steps are not training steps: their metrics are not logged
        setattr(pl_module, name, fn)
    callback.probing = True
    try:
        _, callback.probe_records = run_start_probes(
            callback.driver.controller, model=pl_module, optimizer=optimizer, loader=adaptive.loader, step=step,
            schedulers=[config.scheduler for config in trainer.lr_scheduler_configs])
    finally:
        callback.probing = False
        adaptive.current = None
        for name in quiet:
            delattr(pl_module, name)
        callback._losses.clear()  # what weight() recorded during the probes
