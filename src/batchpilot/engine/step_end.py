"""The end of a step: the mean loss over ranks (more follows as Pilot's step end moves here)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import distributed as bpdist
from ..measure import read_scalars


def reduce_step_loss(losses: Sequence[tuple[torch.Tensor, float]], global_batch_size: int, *,
                     world_size: int, rank: int) -> float:
    """The step's mean loss over its global batch, from ``(detached loss, weight in samples)`` pairs.

    One device-to-host copy for the losses; with several ranks one float64 all-reduce that also carries the
    step's size (no extra collective), so ranks that trained different global batch sizes are caught.

    Raises:
        RuntimeError: the ranks trained steps of different global batch sizes.
    """
    loss_sum = sum(value * weight for value, (_, weight) in zip(read_scalars([loss for loss, _ in losses]), losses))
    if world_size > 1:
        size = global_batch_size
        totals = bpdist.all_reduce_sum(torch.tensor([loss_sum, size, size * size], dtype=torch.float64))
        loss_sum = float(totals[0])
        if float(totals[1]) != world_size * size or float(totals[2]) != world_size * size * size:
            raise RuntimeError(
                f"the ranks trained steps of different global sizes (this rank, {rank}: {size}; the mean "
                f"over ranks: {float(totals[1]) / world_size:g}). Under DDP call set_batch_size() on every "
                "rank with the same value (broadcast a value only rank 0 knows with "
                "batchpilot.distributed.broadcast_int)."
            )
    return loss_sum / global_batch_size
