"""The automatic mode in `AdaptiveBatchSizeTrainer`: ``batch_size_scheduler=Auto()``.

Before Trainer's loop takes its first step (``on_train_begin``, once the optimizer and the LR schedule exist), the
start probes of :mod:`batchpilot.integrations._auto` run with the trainer's own ``compute_loss`` on its collated
batches; the pre-probe state is restored, the run starts at the knee with the found LR, and ``Auto`` grows the
batch from there.
"""

from __future__ import annotations

from typing import Any

import torch

from ...controllers.auto import Auto
from ...data.micro_batch import MicroBatch
from .._auto import run_start_probes

__all__ = ["check_auto", "resolve_auto", "start_probes"]


def resolve_auto(batch_size_scheduler: Any) -> Any:
    """``batch_size_scheduler="auto"`` is ``Auto()`` with its defaults; anything else is returned as it is."""
    if isinstance(batch_size_scheduler, str) and batch_size_scheduler == "auto":
        return Auto()
    return batch_size_scheduler


def check_auto(controller: Any, lr_rule: Any, world_size: int) -> None:
    """Refuse settings the automatic mode cannot honour.

    Raises:
        ValueError: ``Auto`` with several processes, or with an LR rule that multiplies the LR blindly.
    """
    if not isinstance(controller, Auto):
        return
    if world_size > 1:
        raise ValueError(
            f"batch_size_scheduler=Auto() runs its start probes on one process; this run has {world_size} ranks. "
            "Train on one process, or use batchpilot.Pilot(..., batch_size='auto'), whose probes run under DDP."
        )
    if isinstance(lr_rule, str) and lr_rule in ("linear", "linear-then-sqrt"):
        raise ValueError(
            f"lr_rule={lr_rule!r} with batch_size_scheduler=Auto(): the linear rule doubles the LR the range test "
            "found at the knee on every doubling of the batch, past the stability edge. Use lr_rule='none' (the "
            "default: the found LR stays) or 'sqrt'."
        )


def start_probes(trainer: Any, run: Any) -> None:
    """Run the start probes for ``run`` (an :class:`HFRun` whose controller is an ``Auto`` that has not probed)
    and start the run at the knee with the found LR."""
    model = trainer.model
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper: its optimizer
    max_norm = float(trainer.args.max_grad_norm or 0.0)

    def step(micro: list[MicroBatch]) -> float:
        model.train()
        total = 0.0
        for m in micro:
            if m.ghost or not m.size:
                continue
            loss = trainer.compute_loss(trainer.model_wrapped, trainer._prepare_inputs(m.data))
            share = m.units / m.global_units  # the step's gradient is the mean over its samples (or tokens)
            (loss * share).backward()
            total += float(loss.detach()) * share
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    schedulers = [] if trainer.lr_scheduler is None else [trainer.lr_scheduler]
    result, records = run_start_probes(run.driver.controller, model=model, optimizer=optimizer, loader=run.loader,
                                       step=step, schedulers=schedulers)
    run.decided = result.start_size
    run.lr_anchor = result.start_size
    run.probe_records = records
