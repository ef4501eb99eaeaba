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


def load_elsewhere(rank: int, world_size: int, init_file: str, saved: dict, out_file: str) -> None:
    """Load a state saved under another world size into a OneBitState of this group, then take one compressed
    step; save the loaded state and the step's result."""
    init(rank, world_size, init_file)
    model = Params()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = OneBitState(warmup_steps=0)
    state.register(ddp)
    state.load_state_dict(saved)
    loaded = state.state_dict()
    ddp(fixed_gradients(0, rank)).backward()
    torch.save({"loaded": loaded, "grads": [p.grad for p in model.ps], "step": state.step},
               out_file.format(rank=rank))
    leave()


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


# ---------------------------------------------------------------------------------------------- Pilot runs
def make_data(n: int = 192) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] - 0.5 * x[:, 3] + 0.3 * x[:, 5] > 0).long()
    return torch.utils.data.TensorDataset(x, y)


def make_pilot(compression, **settings):
    import batchpilot

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    settings.setdefault("system_every", None)
    return batchpilot.Pilot(ddp, opt, make_data(), batch_size=32, compression=compression, seed=3, **settings), ddp


def pilot_run(compression, *, steps: int, resume_from: str | None = None, save_to: str | None = None,
              **settings) -> dict:
    """Train a small classifier under DDP with a Pilot for ``steps`` steps in all (after ``resume_from``);
    return its weights, step losses, last noise values, and the hook's counters."""
    pilot, ddp = make_pilot(compression, **settings)
    if resume_from is not None:
        pilot.load_checkpoint(resume_from)
    losses: list[float] = []
    pilot.add_callback(lambda p, record: losses.append(record["loss"]))
    for x, y in pilot.batches(max_steps=steps):
        pilot.backward(torch.nn.functional.cross_entropy(ddp(x), y))
    part = pilot._state.parts["compression"]
    hook_state = None if part is None else part.state
    if save_to is not None:
        pilot.save_checkpoint(save_to)
    x, y = make_data().tensors
    with torch.no_grad():
        full_loss = float(torch.nn.functional.cross_entropy(ddp.module(x), y))
    return {"weights": [p.detach().clone() for p in ddp.module.parameters()], "losses": losses,
            "noise": {k: v for k, v in pilot.last_record.items() if k.startswith("stats/")},
            "full_loss": full_loss, "compressed_steps": getattr(hook_state, "compressed_steps", None),
            "hook_step": getattr(hook_state, "step", None), "wire_bytes": getattr(hook_state, "wire_bytes", None),
            "full_bytes": getattr(hook_state, "full_bytes", None)}


def pilot_scenarios(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """The Pilot scenarios of tests/distributed/test_compression_pilot.py, in one process group."""
    from batchpilot.distributed.compression import OneBitState

    init(rank, world_size, init_file)
    ckpt = os.path.join(out_dir, "ckpt.pt")
    out: dict = {}
    # Resume: 12 steps at once, or 6, a checkpoint, a new Pilot, 6 more (noise measured on every 4th step).
    out["straight"] = pilot_run(OneBitState(warmup_steps=2).hook, steps=12, noise_every=4)
    pilot_run(OneBitState(warmup_steps=2).hook, steps=6, noise_every=4, save_to=ckpt)
    out["resumed"] = pilot_run(OneBitState(warmup_steps=2).hook, steps=12, noise_every=4, resume_from=ckpt)
    # Statistics: measured steps are reduced in full precision, so measuring every step equals no compression.
    out["plain_every_step"] = pilot_run(None, steps=8, noise_every=1)
    out["1bit_every_step"] = pilot_run("1bit", steps=8, noise_every=1)
    # Convergence.
    out["plain"] = pilot_run(None, steps=60)
    out["1bit"] = pilot_run("1bit", steps=60)
    # A plain DDP hook (torch's fp16 compression): no state of its own, bypassed on measured steps.
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    out["fp16_hook"] = pilot_run(fp16_compress_hook, steps=4, noise_every=2)
    # Gradient accumulation (no_sync on all micro-batches but the last): one hook step per optimizer step.
    out["accumulated"] = pilot_run("1bit", steps=5, max_micro_batch_size=8)
    # fp16 loss scaling: when the GradScaler's scale changes, the error buffers (scaled residuals) follow it.
    pilot, ddp = make_pilot(OneBitState(warmup_steps=0).hook, amp="fp16")
    for x, y in pilot.batches(max_steps=3):
        pilot.backward(torch.nn.functional.cross_entropy(ddp(x), y))
    part = pilot._state.parts["compression"]
    before = part.state.state_dict()["worker_error"]
    pilot.scaler.update(new_scale=pilot.scaler.get_scale() / 4)
    part.after_step(pilot, {})
    out["fp16_rescaled"] = (before, part.state.state_dict()["worker_error"])
    # Refused: with oom_recovery (the engine reduces, DDP's hook never runs); a DDP model with its own hook.
    errors = {}
    try:
        make_pilot("1bit", oom_recovery=True)
    except ValueError as exc:
        errors["oom_recovery"] = str(exc)
    try:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        import batchpilot

        model = torch.nn.Linear(8, 2)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(None, fp16_compress_hook)
        batchpilot.Pilot(ddp, torch.optim.SGD(model.parameters(), lr=0.1), make_data(), batch_size=8,
                         compression="1bit")
    except ValueError as exc:
        errors["own_hook"] = str(exc)
    out["errors"] = errors
    if rank == 0:
        out["checkpoint"] = torch.load(ckpt, weights_only=False)["state"]["compression"]
    torch.save(out, os.path.join(out_dir, f"pilot{rank}.pt"))
    leave()
