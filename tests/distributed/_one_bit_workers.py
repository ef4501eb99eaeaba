"""Workers for the 2-process gloo tests of the 1-bit hook (module level, so ``spawn`` can import them)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from batchpilot.distributed.compression import OneBitState

# Parameter sizes that exercise padding (7, 3), a chunk with no real value (1 value over 2 ranks: 8 per chunk),
# and several chunks (90).
SHAPES = [(9, 10), (7,), (3,), (1,)]


class Params(torch.nn.Module):
    """A module whose loss gradient is a given tensor per parameter: ``loss = sum_i <p_i, t_i>``."""

    def __init__(self) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in SHAPES])

    def forward(self, targets: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * t).sum() for p, t in zip(self.ps, targets))


def fixed_gradients(step: int, rank: int) -> list[torch.Tensor]:
    """The gradient rank ``rank`` feeds at ``step``: fixed random tensors with a few exact zeros and negative
    zeros (sign(0) must be deterministic)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = [torch.randn(s, generator=g) * (1 + i) for i, s in enumerate(SHAPES)]
    out[0].view(-1)[::11] = 0.0
    out[0].view(-1)[5] = -0.0
    return out


def init(rank: int, world_size: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)


def leave() -> None:
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def hook_steps(rank: int, world_size: int, init_file: str, out_dir: str, steps: int, warmup: int,
               bucket_cap_mb: float, nonfinite_step: int) -> None:
    """Feed ``fixed_gradients`` through DDP with the 1-bit hook; save each step's reduced gradient, the state's
    counters and its state_dict (``nonfinite_step``: rank 1 sends a NaN at that step)."""
    init(rank, world_size, init_file)
    model = Params()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    state = OneBitState(warmup_steps=warmup)
    state.register(ddp)
    reduced = []
    for step in range(steps):
        targets = fixed_gradients(step, rank)
        if step == nonfinite_step and rank == 1:
            targets[0].view(-1)[3] = float("nan")
        ddp(targets).backward()
        reduced.append([p.grad.detach().clone() for p in model.ps])
        for p in model.ps:
            p.grad = None
    saved = state.state_dict()
    torch.save({"reduced": reduced, "wire_bytes": state.wire_bytes, "full_bytes": state.full_bytes,
                "step": state.step, "compressed_steps": state.compressed_steps, "state": saved},
               os.path.join(out_dir, f"rank{rank}.pt"))
    leave()
