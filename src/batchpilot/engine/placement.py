"""Where this process trains: its rank in the process group, its device, and who sums the gradients over
ranks (DDP inside the last backward, or the engine at the step's end)."""

from __future__ import annotations

from typing import Any

import torch

from .. import distributed as bpdist
from .config import DistributedConfig, PilotConfig
from .sharded import ShardedModel, is_sharded


def data_parallel_wrapper(module: torch.nn.Module, ddp_model: Any, config: PilotConfig) -> Any:
    """The DDP wrapper, or for a model sharded by ``fully_shard`` (FSDP2) its stand-in :class:`ShardedModel`
    (engine/sharded.py), or ``None``.

    Raises:
        ValueError: an FSDP2 model with a setting it cannot train with (see :class:`ShardedModel`).
    """
    if ddp_model is not None or not is_sharded(module):
        return ddp_model
    return ShardedModel(module, oom_recovery=config.memory.oom_recovery, amp=config.precision.amp,
                        compression=config.distributed.compression)


def resolve_world(distributed: DistributedConfig, ddp_model: Any) -> tuple[int, int]:
    """``(rank, world_size)`` from the settings and the process group, checked against a DDP wrapper's group.

    Raises:
        ValueError: several ranks without a process group, ranks that disagree with it, or a DDP model whose
            group is not the one the batch is shared over.
    """
    rank, world_size = bpdist.rank_and_world(distributed.rank, distributed.world_size)
    if world_size > 1 and not bpdist.is_distributed():
        raise ValueError(
            f"world_size={world_size} but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first (torchrun sets it up), or use world_size=1."
        )
    group = bpdist.rank_and_world()
    if world_size > 1 and (rank, world_size) != group:
        raise ValueError(
            f"rank={rank}, world_size={world_size} disagree with the process group (rank {group[0]} "
            f"of {group[1]}); leave them None to train over the group, or pass world_size=1 to train this "
            "rank on its own."
        )
    if ddp_model is None:  # a DDP model exists only with a process group
        return rank, world_size
    ddp_size = bpdist.group_size(getattr(ddp_model, "process_group", None))
    if world_size == 1 and ddp_size > 1:
        raise ValueError(
            f"world_size=1 trains this rank on its own, but the DDP model all-reduces every backward over "
            f"{ddp_size} ranks (they would average weights while deciding sizes apart, and hang when their "
            "step counts differ); pass the bare model (ddp_model.module) with world_size=1, or leave "
            "world_size None to train over the group."
        )
    if ddp_size != world_size:
        raise ValueError(
            f"the DDP model averages over a process group of {ddp_size} ranks, but the batch is shared over "
            f"all {world_size}; batchpilot shares data, weights losses and decides over the default "
            "group, so wrap the model with DDP over the default group (hybrid parallelism with a data-"
            "parallel subgroup is not supported)."
        )
    return rank, world_size


def engine_reduces_gradients(ddp_model: Any, world_size: int, oom_recovery: bool) -> bool:
    """Whether the engine sums the gradients over ranks at the step's end: without DDP, and under OOM recovery,
    where the ranks must agree on a replay before any reduction (else DDP does, inside the last backward)."""
    engine_reduces = world_size > 1 and (ddp_model is None or oom_recovery)
    if ddp_model is not None and engine_reduces:
        # Every micro-batch then runs under no_sync, whose forwards do no collective, except that DDP
        # broadcasts the buffers in a forward that follows a synced one, and starts as if one had run.
        # A rank that fails inside a forward would leave the ranks' collectives out of step; the engine
        # broadcasts the buffers itself at each step's end instead.
        ddp_model.require_forward_param_sync = False
    return engine_reduces


def training_device(device: torch.device | str | None, module: torch.nn.Module, *, first_param: torch.nn.Parameter,
                    broadcast: bool) -> torch.device:
    """The device micro-batches go to (default: ``first_param``'s), made the current CUDA device under a process
    group; with ``broadcast`` every rank starts from rank 0's weights, as DDP does when it is built."""
    device = torch.device(device) if device is not None else first_param.device
    if device.type == "cuda" and device.index is not None and bpdist.is_distributed():
        # NCCL collectives (the decisions, the statistics, checkpoints) run on the *current* CUDA device:
        # make it this rank's, or every rank that skipped torch.cuda.set_device would talk on cuda:0.
        torch.cuda.set_device(device)
    if broadcast:  # (after set_device: under NCCL the broadcast runs on this device)
        bpdist.broadcast_module(module)
    return device
