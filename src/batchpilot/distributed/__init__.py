"""The one place where batchpilot talks to ``torch.distributed``.

Controllers and statistics never communicate; the engine calls these helpers. Every helper is a no-op
(or the identity) when the job runs as a single process, so the same code path serves both.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def init_torchrun(backend: str = "gloo", timeout: timedelta | None = None) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment; return ``(rank, world_size)``.

    Unlike a plain ``init_process_group(backend)``, the group's keys live under a per-attempt prefix
    (``TORCHELASTIC_RESTART_COUNT``) of torchrun's store. With torch 2.13 and gloo, a job restarted by
    ``torchrun --max-restarts`` otherwise reads the peer addresses of the failed attempt from the store
    and fails with "Gloo connectFullMesh failed ... Connection refused".

    Raises:
        RuntimeError: the torchrun variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) are missing.
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_torchrun() needs torchrun's environment; {', '.join(missing)} not set. Start with torchrun.")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    # torchrun's agent serves the store (TORCHELASTIC_USE_AGENT_STORE=True); under any other launcher that
    # only sets the four variables, rank 0 serves it, as torch's env:// initialisation does.
    serve = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=serve, **kwargs)
    dist.init_process_group(
        backend, store=dist.PrefixStore(f"batchpilot/attempt-{attempt}", store), rank=rank, world_size=world_size, **kwargs
    )
    return rank, world_size


def is_distributed() -> bool:
    """True when a default process group is initialised with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """Resolve ``(rank, world_size)``: explicit values win, then the process group, then ``(0, 1)``."""
    if world_size == 1 and rank is None:
        return 0, 1  # this process on its own, whatever its rank in a process group
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    return (0 if rank is None else rank), (1 if world_size is None else world_size)


def group_size(group: Any = None) -> int:
    """Ranks in ``group`` (``None``: the default group); 1 without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _comm_device() -> torch.device:
    """Device for small collective tensors: CUDA under NCCL, CPU otherwise (gloo; a mixed group such as
    ``"cpu:gloo,cuda:nccl"`` gets CPU tensors too, which its gloo part reduces)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_int(value: int, src: int = 0) -> int:
    """Broadcast one integer from ``src`` (a tensor broadcast: cheaper than pickling an object)."""
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_comm_device())
    dist.broadcast(t, src=src)
    return int(t.item())


def all_reduce_min_int(value: int) -> int:
    """The smallest of one integer over ranks (the value itself on one process)."""
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a small float64 tensor over ranks and return the sum (a new tensor when distributed)."""
    if is_distributed():
        device = _comm_device()
        moved = values.to(device)
        dist.all_reduce(moved, op=dist.ReduceOp.SUM)
        values = moved.to(values.device)
    return values


def all_reduce_gradients(params: list[torch.nn.Parameter]) -> None:
    """Sum the gradients of ``params`` over ranks, flattened into one buffer per dtype.

    Used when the model is not wrapped in DistributedDataParallel: the engine has already weighted each
    rank's loss by its share of the global batch, so a plain sum gives the global-batch mean gradient.
    """
    if not is_distributed():
        return
    # A parameter no rank gave a gradient keeps none (the optimizer then skips it, as on one process);
    # one that only some ranks used is summed with zeros from the others.
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=_comm_device())
    dist.all_reduce(present, op=dist.ReduceOp.SUM)
    grads = []
    for p, used in zip(params, present.tolist()):
        if used:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    if grads:
        _flattened(lambda flat: dist.all_reduce(flat, op=dist.ReduceOp.SUM), grads)


def broadcast_module(module: torch.nn.Module, src: int = 0) -> None:
    """Copy ``src``'s parameters and buffers to every rank (what DDP does when it wraps a model), flattened
    into one broadcast per dtype and device."""
    if is_distributed():
        with torch.no_grad():
            _flattened(lambda flat: dist.broadcast(flat, src=src), [*module.parameters(), *module.buffers()])


def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> None:
    """Copy ``src``'s module buffers (e.g. BatchNorm running statistics) to every rank, flattened into one
    broadcast per dtype and device."""
    if is_distributed():
        _flattened(lambda flat: dist.broadcast(flat, src=src), list(module.buffers()))


def _flattened(collective: Callable[[torch.Tensor], Any], tensors: list[torch.Tensor]) -> None:
    """Run an in-place ``collective`` on ``tensors`` as one flat buffer per dtype and device (one call
    each instead of one per tensor), and copy the result back."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    device = _comm_device()
    for group in groups.values():
        flat = torch.cat([t.reshape(-1) for t in group]).to(device)
        collective(flat)
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def barrier() -> None:
    """Wait for all ranks (no-op on one process)."""
    if is_distributed():
        dist.barrier()
